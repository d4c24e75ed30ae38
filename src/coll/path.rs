//! Which path a collective takes, and the measured thresholds behind the choice.

use crate::backend::{CommInfo, CommRole};
use crate::dtype::{DType, ReduceOp};
use crate::error::NcclVersion;
use serde::Serialize;

/// How NCCL will run a collective. On the host backend it is the path NCCL would take
/// under the same version, communicators and registrations (the host moves the same
/// data whatever the path), so path selection is tested without GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Path {
    /// Copy-engine all-gather: no SMs (`CTAPolicy = NCCL_CTA_POLICY_ZERO`, output in a
    /// symmetric window; NCCL 2.28+). NCCL 2.28 logs `Init CE` once and no per-call
    /// line; 2.29+ logs `[Copy Engine]`.
    CopyEngine,
    /// NCCL's symmetric kernels (both buffers in symmetric windows; NCCL 2.27+). Logged
    /// as `<Coll> [Symmetric]: ... Kernel <name>`.
    SymmetricKernel,
    /// NCCL's ordinary ring/tree kernels through its internal buffers.
    PlainKernel,
}

/// What a collective did: the path, the communicator, and the size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CollectiveReport {
    /// The path NCCL takes, derived from the NCCL version, the communicator's CTA
    /// policy and the buffers' registrations.
    pub path: Path,
    /// Index of the communicator used, in the backend's list.
    pub comm: usize,
    /// Its role.
    pub role: CommRole,
    /// Bytes per rank: the all-gather input, the reduce-scatter output, the
    /// all-reduce buffer.
    pub bytes_per_rank: u64,
}

/// A request to use one path, or the automatic choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Choice {
    /// The crate picks by size (see [`PathPolicy`]).
    Auto,
    /// Prefer this path; falls back (and reports the fallback) when it is not
    /// available for the call.
    Prefer(Path),
}

/// Thresholds of the automatic path choice, in bytes per rank.
///
/// The defaults come from the collectives benchmark on two H200s linked by NVLink
/// without NVLink multicast (figures and dates in the repository's `BENCHMARKS.md`):
/// - all-gather: the symmetric kernel beats ring at every size and the copy engine up
///   to about 16 MiB per rank; the copy engine wins from about 64 MiB.
/// - reduce-scatter: the symmetric kernel wins for small outputs (its LL kernel) and
///   around 1–2 MiB (its LD kernel), and loses to ring in between and for large
///   outputs.
/// - all-reduce: the symmetric kernel wherever NCCL has one for the call (no
///   measurement yet: calibrate to narrow it).
///
/// [`Coll::calibrate`](super::Coll::calibrate) measures them on the machine at hand.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PathPolicy {
    /// All-gathers of at least this many bytes per rank use the copy engine; smaller
    /// ones the symmetric kernel (default 32 MiB).
    pub ce_all_gather_min_bytes: u64,
    /// Inclusive ranges of output bytes per rank where reduce-scatter uses the
    /// symmetric kernel; other sizes use NCCL's ring on the unregistered communicator
    /// (default `[(0, 128 KiB), (1 MiB, 4 MiB)]`).
    pub symmetric_reduce_scatter_bands: Vec<(u64, u64)>,
    /// Inclusive ranges of bytes per rank where all-reduce uses the symmetric
    /// kernel; other sizes use NCCL's ordinary kernels on the unregistered
    /// communicator (default `[(0, u64::MAX)]`: every size).
    pub symmetric_all_reduce_bands: Vec<(u64, u64)>,
    /// Override for all-gather.
    pub all_gather: Choice,
    /// Override for reduce-scatter.
    pub reduce_scatter: Choice,
    /// Override for all-reduce.
    pub all_reduce: Choice,
}

impl Default for PathPolicy {
    fn default() -> Self {
        PathPolicy {
            ce_all_gather_min_bytes: 32 << 20,
            symmetric_reduce_scatter_bands: vec![(0, 128 << 10), (1 << 20, 4 << 20)],
            symmetric_all_reduce_bands: vec![(0, u64::MAX)],
            all_gather: Choice::Auto,
            reduce_scatter: Choice::Auto,
            all_reduce: Choice::Auto,
        }
    }
}

impl PathPolicy {
    /// Set the copy-engine all-gather threshold.
    pub fn with_ce_all_gather_min_bytes(mut self, bytes: u64) -> Self {
        self.ce_all_gather_min_bytes = bytes;
        self
    }

    /// Set the sizes where reduce-scatter uses the symmetric kernel.
    pub fn with_symmetric_reduce_scatter_bands(mut self, bands: Vec<(u64, u64)>) -> Self {
        self.symmetric_reduce_scatter_bands = bands;
        self
    }

    /// Prefer paths for all-gather and reduce-scatter.
    pub fn with_choices(mut self, all_gather: Choice, reduce_scatter: Choice) -> Self {
        self.all_gather = all_gather;
        self.reduce_scatter = reduce_scatter;
        self
    }

    /// Set the sizes where all-reduce uses the symmetric kernel.
    pub fn with_symmetric_all_reduce_bands(mut self, bands: Vec<(u64, u64)>) -> Self {
        self.symmetric_all_reduce_bands = bands;
        self
    }

    /// Prefer a path for all-reduce.
    pub fn with_all_reduce(mut self, all_reduce: Choice) -> Self {
        self.all_reduce = all_reduce;
        self
    }

    /// This policy with every collective preferring `path` (calibration forces one
    /// path at a time). Out of line: calibration only, off the call path.
    #[cold]
    #[inline(never)]
    pub(crate) fn forcing(&self, path: Path) -> Self {
        self.clone()
            .with_choices(Choice::Prefer(path), Choice::Prefer(path))
            .with_all_reduce(Choice::Prefer(path))
    }
}

/// Which collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CollOp {
    AllGather,
    ReduceScatter(ReduceOp),
    AllReduce(ReduceOp),
}

impl CollOp {
    /// The collective's name in events: `all_gather`, `reduce_scatter`, `all_reduce`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CollOp::AllGather => "all_gather",
            CollOp::ReduceScatter(_) => "reduce_scatter",
            CollOp::AllReduce(_) => "all_reduce",
        }
    }

    /// The reduction (`Sum` for an all-gather, which has none).
    pub(crate) fn reduction(self) -> ReduceOp {
        match self {
            CollOp::AllGather => ReduceOp::Sum,
            CollOp::ReduceScatter(op) | CollOp::AllReduce(op) => op,
        }
    }
}

/// `ncclAvg`: NCCL 2.10 (older NCCLs refuse the reduction).
pub(crate) const AVG: NcclVersion = NcclVersion::new(2, 10, 0);

/// Everything the choice depends on.
pub(crate) struct Inputs<'a> {
    pub(crate) coll: CollOp,
    pub(crate) bytes_per_rank: u64,
    pub(crate) dtype: DType,
    pub(crate) version: NcclVersion,
    pub(crate) world_size: usize,
    /// Nodes the ranks span ([`BackendInfo::nodes`](crate::backend::BackendInfo::nodes)).
    pub(crate) nodes: usize,
    pub(crate) comms: &'a [CommInfo],
    /// Whether (send, recv) are in symmetric windows on communicator `c`.
    pub(crate) registered: &'a dyn Fn(usize) -> (bool, bool),
    pub(crate) policy: &'a PathPolicy,
}

/// Pick the communicator and path. Rules (NCCL's, read from its source: `enqueue.cc`
/// and `symmetric/` of NCCL 2.27–2.29):
/// - copy engine: NCCL ≥ 2.28, a `CTAPolicy = ZERO` communicator, the output in a
///   window (and, before 2.29, the input too), more than one rank;
/// - symmetric kernel: NCCL ≥ 2.27, both buffers in windows on a default-policy
///   communicator; for reduce-scatter and all-reduce also `Sum` (or `Avg` from
///   2.30) on fp32/fp16/bf16;
/// - otherwise the plain communicator.
///
/// Across nodes ([`Inputs::nodes`] above 1; see [`one_nvlink_domain_needed`]), the
/// copy engine is never chosen up to NCCL 2.30.3 and the symmetric kernels not before
/// 2.29: those need every rank in one NVLink domain, which ranks on several hosts are
/// not known to share.
///
/// Inlined into the call path (one caller in release code): out of line, the choice
/// cost ≈ 70 instructions more per call, the `registered` closure then called through
/// its vtable (BENCHMARKS.md, "Lean call path").
#[inline]
pub(crate) fn select(i: &Inputs<'_>) -> (usize, Path) {
    // The candidates are tried in the order of preference, each only if the one
    // before is not available: most calls settle on the first (a cost on every
    // collective call, hence plain functions rather than closures).
    let (choice, auto) = match i.coll {
        CollOp::AllGather => (
            i.policy.all_gather,
            if i.bytes_per_rank >= i.policy.ce_all_gather_min_bytes {
                [Path::CopyEngine, Path::SymmetricKernel]
            } else {
                [Path::SymmetricKernel, Path::CopyEngine]
            },
        ),
        CollOp::ReduceScatter(_) | CollOp::AllReduce(_) => {
            let (bands, choice) = match i.coll {
                CollOp::AllReduce(_) => (&i.policy.symmetric_all_reduce_bands, i.policy.all_reduce),
                _ => (
                    &i.policy.symmetric_reduce_scatter_bands,
                    i.policy.reduce_scatter,
                ),
            };
            let symmetric = bands
                .iter()
                .any(|&(lo, hi)| (lo..=hi).contains(&i.bytes_per_rank));
            (
                choice,
                if symmetric {
                    [Path::SymmetricKernel, Path::PlainKernel]
                } else {
                    [Path::PlainKernel, Path::PlainKernel]
                },
            )
        }
    };
    if let Choice::Prefer(p) = choice
        && let Some(c) = attempt(i, p)
    {
        return (c, p);
    }
    for p in auto {
        if let Some(c) = attempt(i, p) {
            return (c, p);
        }
    }
    (plain(i), Path::PlainKernel)
}

/// The communicator of `path` for the call, if the path is available for it.
#[inline]
fn attempt(i: &Inputs<'_>, path: Path) -> Option<usize> {
    match path {
        Path::CopyEngine => copy_engine(i),
        Path::SymmetricKernel => symmetric(i),
        Path::PlainKernel => Some(plain(i)),
    }
}

/// The first communicator of `role`.
#[inline]
fn find(i: &Inputs<'_>, role: CommRole) -> Option<usize> {
    i.comms.iter().position(|c| c.role == role)
}

/// The copy-engine communicator, if the copy engine can run the call.
fn copy_engine(i: &Inputs<'_>) -> Option<usize> {
    let c = find(i, CommRole::CopyEngine)?;
    if i.coll != CollOp::AllGather
        || i.world_size <= 1
        || i.version < NcclVersion::COPY_ENGINE
        || i.comms[c].cta_policy & 2 == 0
        || (i.nodes > 1 && one_nvlink_domain_needed(i.version).0)
    {
        return None;
    }
    let (send, recv) = (i.registered)(c);
    (recv && (send || i.version >= NcclVersion::CE_RECV_ONLY)).then_some(c)
}

/// The symmetric communicator, if NCCL's symmetric kernels can run the call.
#[inline]
fn symmetric(i: &Inputs<'_>) -> Option<usize> {
    let op_ok = match i.coll {
        CollOp::AllGather => true,
        CollOp::ReduceScatter(ReduceOp::Sum) | CollOp::AllReduce(ReduceOp::Sum) => {
            i.dtype.symmetric_reduce()
        }
        CollOp::ReduceScatter(ReduceOp::Avg) | CollOp::AllReduce(ReduceOp::Avg) => {
            i.dtype.symmetric_reduce() && i.version >= NcclVersion::SYMMETRIC_AVG
        }
        CollOp::ReduceScatter(_) | CollOp::AllReduce(_) => false,
    };
    if !op_ok
        || i.version < NcclVersion::WINDOWS
        || (i.nodes > 1 && one_nvlink_domain_needed(i.version).1)
    {
        return None;
    }
    let c = find(i, CommRole::Symmetric)?;
    let (send, recv) = (i.registered)(c);
    (send && recv).then_some(c)
}

/// The unregistered communicator; without one, NCCL runs its ordinary kernels on the
/// first.
fn plain(i: &Inputs<'_>) -> usize {
    find(i, CommRole::Plain).unwrap_or(0)
}

/// Whether (the copy engine, the symmetric kernels) need every rank in one NVLink
/// domain under NCCL `version`: the copy engine from 2.28 through 2.30.3, the
/// symmetric kernels before 2.29.
pub(crate) fn one_nvlink_domain_needed(version: NcclVersion) -> (bool, bool) {
    (
        version <= NcclVersion::new(2, 30, 3),
        version < NcclVersion::new(2, 29, 0),
    )
}

/// Every [`Path`], in the order of [`path_index`].
pub(crate) const PATHS: [Path; 3] = [Path::CopyEngine, Path::SymmetricKernel, Path::PlainKernel];

/// Index of `path` in [`PATHS`]: the pool's per-path counters are numbered so.
pub(crate) fn path_index(path: Path) -> usize {
    match path {
        Path::CopyEngine => 0,
        Path::SymmetricKernel => 1,
        Path::PlainKernel => 2,
    }
}

/// The name of a path in statistics keys and events: `copy_engine`,
/// `symmetric_kernel`, `plain_kernel`.
pub fn path_name(path: Path) -> &'static str {
    match path {
        Path::CopyEngine => "copy_engine",
        Path::SymmetricKernel => "symmetric_kernel",
        Path::PlainKernel => "plain_kernel",
    }
}

/// A collective ran: report the path chosen (the caller counts it, and checks the
/// level first, so that when off the event costs one load and not also the `log`
/// fallback's: the hot path's events go to tracing subscribers only).
#[cold]
pub(crate) fn collective(pool: &crate::SymmPool, coll: CollOp, report: &CollectiveReport) {
    tracing::debug!(
        target: "symmpool::coll",
        rank = pool.rank(),
        pool = %pool.config().name,
        op = coll.name(),
        path = path_name(report.path),
        comm = report.comm,
        bytes_per_rank = report.bytes_per_rank,
        "collective"
    );
}

#[cfg(test)]
mod tests {
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
        let [sum, max, avg] =
            [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg].map(CollOp::ReduceScatter);
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
}
