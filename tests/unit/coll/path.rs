use super::*;

fn comms() -> Vec<CommInfo> {
    CommInfo::STANDARD.to_vec()
}

fn pick(
    coll: CollOp,
    bytes: u64,
    dtype: DType,
    version: NcclVersion,
    reg: (bool, bool),
    policy: &PathPolicy,
) -> (usize, Path) {
    let c = comms();
    let registered = move |comm: usize| {
        if c[comm].registers {
            reg
        } else {
            (false, false)
        }
    };
    select(&Inputs {
        coll,
        bytes_per_rank: bytes,
        dtype,
        version,
        world_size: 2,
        nodes: 1,
        comms: &comms(),
        registered: &registered,
        policy,
    })
}

const V228: NcclVersion = NcclVersion::new(2, 28, 3);
const V230: NcclVersion = NcclVersion::new(2, 30, 0);
const MIB: u64 = 1 << 20;
const AG: CollOp = CollOp::AllGather;
const BOTH: (bool, bool) = (true, true);
use Path::{CopyEngine as CE, PlainKernel as PK, SymmetricKernel as SK};

/// A call's inputs and the path it must take, on that path's communicator of
/// [`CommInfo::STANDARD`] (symmetric 0, copy engine 1, plain 2).
type Case<'a> = (
    CollOp,
    u64,
    DType,
    NcclVersion,
    (bool, bool),
    &'a PathPolicy,
    Path,
);

fn comm_of(path: Path) -> usize {
    match path {
        SK => 0,
        CE => 1,
        PK => 2,
    }
}

fn expect(cases: &[Case<'_>]) {
    for (i, &(coll, bytes, dtype, version, reg, policy, want)) in cases.iter().enumerate() {
        assert_eq!(
            pick(coll, bytes, dtype, version, reg, policy),
            (comm_of(want), want),
            "case {i}: {coll:?}, {bytes} B of {dtype:?}, NCCL {version}, registered {reg:?}"
        );
    }
}

#[test]
fn all_gather_by_size() {
    let p = PathPolicy::default();
    expect(&[
        (AG, 64 << 10, DType::BF16, V228, BOTH, &p, SK),
        (AG, 256 * MIB, DType::BF16, V228, BOTH, &p, CE),
        (AG, 8 * MIB, DType::U8, V228, BOTH, &p, SK),
        (AG, 16 * MIB, DType::U8, V228, BOTH, &p, SK),
        (AG, 32 * MIB, DType::U8, V228, BOTH, &p, CE),
    ]);
}

#[test]
fn reduce_scatter_by_size_type_and_op() {
    let p = PathPolicy::default();
    let [sum, max, avg] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg].map(CollOp::ReduceScatter);
    expect(&[
        (sum, MIB, DType::BF16, V228, BOTH, &p, SK),
        (sum, 256 * MIB, DType::BF16, V228, BOTH, &p, PK),
        (sum, MIB, DType::U8, V228, BOTH, &p, PK),
        // The bands: symmetric up to 128 KiB and from 1 to 4 MiB.
        (sum, 128 << 10, DType::BF16, V228, BOTH, &p, SK),
        (sum, 256 << 10, DType::BF16, V228, BOTH, &p, PK),
        (sum, 512 << 10, DType::BF16, V228, BOTH, &p, PK),
        (sum, 1024 << 10, DType::BF16, V228, BOTH, &p, SK),
        (sum, 4096 << 10, DType::BF16, V228, BOTH, &p, SK),
        (sum, 8192 << 10, DType::BF16, V228, BOTH, &p, PK),
        (max, MIB, DType::F32, V228, BOTH, &p, PK),
        (avg, MIB, DType::F32, V228, BOTH, &p, PK),
        (avg, MIB, DType::F32, V230, BOTH, &p, SK),
    ]);
}

#[test]
fn all_reduce_by_size_type_and_op() {
    let p = PathPolicy::default();
    let [sum, max, avg] = [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg].map(CollOp::AllReduce);
    // Never the copy engine, even when preferred; bands and a preference for plain.
    let ce = PathPolicy::default().with_all_reduce(Choice::Prefer(Path::CopyEngine));
    let banded = PathPolicy::default().with_symmetric_all_reduce_bands(vec![(0, MIB)]);
    let plain = PathPolicy::default().with_all_reduce(Choice::Prefer(Path::PlainKernel));
    // The reduce-scatter settings do not steer all-reduce.
    let rs = PathPolicy::default()
        .with_symmetric_reduce_scatter_bands(vec![])
        .with_choices(Choice::Auto, Choice::Prefer(Path::PlainKernel));
    expect(&[
        // Symmetric at every size by default, for the types NCCL's kernels reduce.
        (sum, 4, DType::BF16, V228, BOTH, &p, SK),
        (sum, MIB, DType::BF16, V228, BOTH, &p, SK),
        (sum, 256 * MIB, DType::BF16, V228, BOTH, &p, SK),
        (sum, MIB, DType::U8, V228, BOTH, &p, PK),
        (sum, MIB, DType::F32, V228, (true, false), &p, PK),
        (max, MIB, DType::F32, V228, BOTH, &p, PK),
        (avg, MIB, DType::F16, V228, BOTH, &p, PK),
        (avg, MIB, DType::F16, V230, BOTH, &p, SK),
        (sum, 256 * MIB, DType::F32, V228, BOTH, &ce, SK),
        (sum, 2 * MIB, DType::F32, V228, BOTH, &banded, PK),
        (sum, 4, DType::F32, V228, BOTH, &plain, PK),
        (sum, MIB, DType::F32, V228, BOTH, &rs, SK),
    ]);
}

#[test]
fn versions_and_registration_gate_the_fast_paths() {
    let p = PathPolicy::default();
    let big = 256 * MIB;
    expect(&[
        // 2.27: windows but no copy engine.
        (
            AG,
            big,
            DType::F32,
            NcclVersion::new(2, 27, 3),
            BOTH,
            &p,
            SK,
        ),
        // 2.26: nothing symmetric.
        (
            AG,
            big,
            DType::F32,
            NcclVersion::new(2, 26, 5),
            BOTH,
            &p,
            PK,
        ),
        // Unregistered (NULL windows): plain.
        (AG, big, DType::F32, V228, (false, false), &p, PK),
        // Output only registered: 2.28 needs both for CE and the symmetric kernel;
        // 2.29 runs the copy engine.
        (AG, big, DType::F32, V228, (false, true), &p, PK),
        (
            AG,
            big,
            DType::F32,
            NcclVersion::new(2, 29, 7),
            (false, true),
            &p,
            CE,
        ),
    ]);
}

#[test]
fn preferences_fall_back_when_unavailable() {
    let ce = PathPolicy::default().with_choices(
        Choice::Prefer(Path::CopyEngine),
        Choice::Prefer(Path::SymmetricKernel),
    );
    let plain = PathPolicy::default().with_choices(
        Choice::Prefer(Path::PlainKernel),
        Choice::Prefer(Path::PlainKernel),
    );
    let sum = CollOp::ReduceScatter(ReduceOp::Sum);
    expect(&[
        (AG, 64 << 10, DType::F32, V228, BOTH, &ce, CE),
        (sum, 256 * MIB, DType::F32, V228, BOTH, &ce, SK),
        (
            AG,
            64 << 10,
            DType::F32,
            NcclVersion::new(2, 27, 0),
            BOTH,
            &ce,
            SK,
        ),
        (AG, 256 * MIB, DType::F32, V228, BOTH, &plain, PK),
    ]);
}

fn pick_on_nodes(
    coll: CollOp,
    bytes: u64,
    version: NcclVersion,
    nodes: usize,
    policy: &PathPolicy,
) -> (usize, Path) {
    let c = comms();
    let registered = move |comm: usize| (c[comm].registers, c[comm].registers);
    select(&Inputs {
        coll,
        bytes_per_rank: bytes,
        dtype: DType::BF16,
        version,
        world_size: 16,
        nodes,
        comms: &comms(),
        registered: &registered,
        policy,
    })
}

#[test]
fn across_nodes_the_single_domain_paths_fall_back() {
    let p = PathPolicy::default();
    let ce = PathPolicy::default().with_choices(Choice::Prefer(Path::CopyEngine), Choice::Auto);
    let (big, small) = (256 * MIB, 64 << 10);
    let sum = CollOp::ReduceScatter(ReduceOp::Sum);
    let (v227, v229, v2303) = (
        NcclVersion::new(2, 27, 7),
        NcclVersion::new(2, 29, 2),
        NcclVersion::new(2, 30, 3),
    );
    let cases: &[(CollOp, u64, NcclVersion, usize, &PathPolicy, Path)] = &[
        // One node: copy engine for large all-gathers.
        (AG, big, V228, 1, &p, CE),
        // 2.28 across nodes: neither the copy engine nor the symmetric kernels.
        (AG, big, V228, 2, &p, PK),
        (AG, small, V228, 2, &p, PK),
        (sum, small, V228, 4, &p, PK),
        // 2.27 across nodes: no symmetric kernels either.
        (AG, small, v227, 2, &p, PK),
        // 2.29 and 2.30.3 across nodes: symmetric kernels where valid, no copy engine.
        (AG, big, v229, 2, &p, SK),
        (AG, small, v229, 2, &p, SK),
        (sum, small, v229, 2, &p, SK),
        (AG, big, v2303, 2, &p, SK),
        (AG, small, v2303, 2, &p, SK),
        (sum, small, v2303, 2, &p, SK),
        // After 2.30.3 the copy engine no longer needs one domain.
        (AG, big, NcclVersion::new(2, 30, 4), 2, &p, CE),
        // A preference for the copy engine falls back across nodes too.
        (AG, big, V228, 2, &ce, PK),
        (AG, big, v229, 2, &ce, SK),
    ];
    for (i, &(coll, bytes, version, nodes, policy, want)) in cases.iter().enumerate() {
        let got = pick_on_nodes(coll, bytes, version, nodes, policy);
        assert_eq!(got, (comm_of(want), want), "case {i}");
    }
    assert_eq!(one_nvlink_domain_needed(V228), (true, true));
    assert_eq!(
        one_nvlink_domain_needed(NcclVersion::new(2, 31, 0)),
        (false, false)
    );
}

#[test]
fn plain_all_gather_bands_come_first() {
    let k = 1u64 << 10;
    let p =
        PathPolicy::default().with_plain_all_gather_bands(vec![(0, 64 * k), (64 * MIB, u64::MAX)]);
    let ce = p
        .clone()
        .with_choices(Choice::Prefer(Path::CopyEngine), Choice::Auto);
    expect(&[
        (AG, 64 * k, DType::BF16, V228, BOTH, &p, PK),
        (AG, 64 * k + 2, DType::BF16, V228, BOTH, &p, SK),
        (AG, 32 * MIB, DType::BF16, V228, BOTH, &p, CE),
        (AG, 64 * MIB, DType::BF16, V228, BOTH, &p, PK),
        (AG, 256 * MIB, DType::BF16, V228, BOTH, &p, PK),
        // Not registered: plain either way.
        (AG, MIB, DType::BF16, V228, (false, false), &p, PK),
        // A preference beats the bands.
        (AG, 64 * k, DType::BF16, V228, BOTH, &ce, CE),
        // They steer all-gather only.
        (
            CollOp::ReduceScatter(ReduceOp::Sum),
            64 * k,
            DType::BF16,
            V228,
            BOTH,
            &p,
            SK,
        ),
    ]);
}
