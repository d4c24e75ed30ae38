use super::*;
use crate::coll::Choice;
use crate::pool::PoolConfig;

fn m(bytes: u64, ag: [f64; 3], rs: [f64; 2]) -> Measurement {
    Measurement {
        bytes,
        all_gather: ag.map(Some),
        reduce_scatter: rs.map(Some),
        // All-reduce as reduce-scatter, with the symmetric kernel ahead by five.
        all_reduce: [Some(rs[0] + 5.0), Some(rs[1])],
    }
}

#[test]
fn derives_thresholds_and_bands() {
    let k = 1u64 << 10;
    let ms = vec![
        m(64 * k, [6.0, 5.0, 5.5], [6.7, 6.0]),
        m(128 * k, [12.0, 10.0, 11.0], [12.8, 11.6]),
        m(256 * k, [25.0, 20.0, 23.0], [20.9, 23.3]),
        m(512 * k, [50.0, 40.0, 46.0], [43.0, 47.0]),
        m(1024 * k, [97.0, 70.0, 69.0], [85.0, 71.0]),
        m(2048 * k, [176.0, 110.0, 85.0], [100.0, 91.0]),
        m(16384 * k, [290.0, 284.0, 196.0], [172.0, 183.0]),
        m(32768 * k, [300.0, 320.0, 220.0], [173.0, 205.0]),
        m(65536 * k, [311.0, 355.0, 241.0], [179.0, 219.0]),
    ];
    let p = derive(&ms, &PathPolicy::default());
    assert_eq!(p.ce_all_gather_min_bytes, 32 << 20);
    assert_eq!(
        p.symmetric_reduce_scatter_bands,
        vec![(0, 128 << 10), (1 << 20, 2 << 20)]
    );
    // The symmetric all-reduce wins where it beats the plain one, on its own figures.
    assert_eq!(p.symmetric_all_reduce_bands, vec![(0, 2 << 20)]);
    // A copy engine that wins in the middle only does not count.
    let mut odd = ms.clone();
    odd[2].all_gather[1] = Some(99.0);
    assert_eq!(
        derive(&odd, &PathPolicy::default()).ce_all_gather_min_bytes,
        32 << 20
    );
    // Symmetric reduce-scatter best at the top extends to every larger size.
    let mut top = ms;
    top[8].reduce_scatter = [Some(300.0), Some(219.0)];
    let bands = derive(&top, &PathPolicy::default()).symmetric_reduce_scatter_bands;
    assert_eq!(bands.last(), Some(&(64 << 20, u64::MAX)));
    // Where neither all-gather path beats the plain ring, nothing changes to that.
    assert_eq!(p.plain_all_gather_bands, vec![]);
}

#[test]
fn plain_all_gather_where_the_ring_is_fastest() {
    let (k, mib) = (1u64 << 10, 1u64 << 20);
    // Two ranks time-sharing one GPU, say: the ring beats both registered paths at
    // the small sizes and at the largest, the copy engine wins in between.
    let ms = vec![
        m(64 * k, [3.0, 2.0, 4.0], [3.0, 4.0]),
        m(128 * k, [6.0, 5.0, 8.0], [6.0, 8.0]),
        m(256 * k, [12.0, 13.0, 11.0], [12.0, 16.0]),
        m(mib, [30.0, 40.0, 35.0], [30.0, 35.0]),
        m(16 * mib, [50.0, 60.0, 55.0], [50.0, 55.0]),
        m(64 * mib, [52.0, 58.0, 61.0], [52.0, 61.0]),
    ];
    let p = derive(&ms, &PathPolicy::default());
    assert_eq!(
        p.plain_all_gather_bands,
        vec![(0, 128 * k), (64 * mib, u64::MAX)]
    );
    // The copy engine at every other size (the plain ones do not count against it).
    assert_eq!(p.ce_all_gather_min_bytes, 0);
    assert_eq!(p.symmetric_reduce_scatter_bands, vec![]);
    // All-reduce: symmetric ahead up to 16 MiB (a tie at 1 and 16 MiB goes to the
    // default, symmetric), the ring ahead at 64 MiB.
    assert_eq!(p.symmetric_all_reduce_bands, vec![(0, 16 * mib)]);
    // At every measured size the policy picks the fastest path.
    for m in &ms {
        let fastest = [Path::SymmetricKernel, Path::CopyEngine, Path::PlainKernel]
            .into_iter()
            .zip(m.all_gather)
            .max_by(|a, b| a.1.unwrap().total_cmp(&b.1.unwrap()))
            .unwrap()
            .0;
        assert_eq!(auto_all_gather(&p, m.bytes), fastest, "{} bytes", m.bytes);
    }
    // The ring fastest everywhere: plain at every size, the threshold as it was.
    let ring: Vec<Measurement> = (ms.iter())
        .map(|x| m(x.bytes, [1.0, 2.0, 3.0], [1.0, 3.0]))
        .collect();
    let p = derive(&ring, &PathPolicy::default());
    assert_eq!(p.plain_all_gather_bands, vec![(0, u64::MAX)]);
    assert_eq!(p.ce_all_gather_min_bytes, 32 << 20);
    assert_eq!(p.symmetric_reduce_scatter_bands, vec![]);
    // A copy engine that wins in the middle only is not taken; where the ring beats
    // the symmetric kernel that runs there instead, the ring runs.
    let mut odd = ms.clone();
    odd[5].all_gather = [Some(70.0), Some(58.0), Some(61.0)];
    let p = derive(&odd, &PathPolicy::default());
    assert_eq!(p.ce_all_gather_min_bytes, u64::MAX);
    assert_eq!(
        p.plain_all_gather_bands,
        vec![(0, 128 * k), (mib, 16 * mib)]
    );
    // A path that did not run (None) never wins; its fallback is compared instead.
    let mut no_ce = ms;
    for x in &mut no_ce {
        x.all_gather[1] = None;
    }
    let p = derive(&no_ce, &PathPolicy::default());
    assert_eq!(p.ce_all_gather_min_bytes, u64::MAX);
    assert_eq!(
        p.plain_all_gather_bands,
        vec![(0, 128 * k), (mib, u64::MAX)]
    );
}

/// The path the automatic choice gives an all-gather of `bytes` under `p` when
/// every path is available.
fn auto_all_gather(p: &PathPolicy, bytes: u64) -> Path {
    if in_bands(&p.plain_all_gather_bands, bytes) {
        Path::PlainKernel
    } else if bytes >= p.ce_all_gather_min_bytes {
        Path::CopyEngine
    } else {
        Path::SymmetricKernel
    }
}

#[test]
fn ties_go_to_the_current_choice() {
    let mib = 1u64 << 20;
    // Every path equal at 1 MiB and 64 MiB.
    let tie = |bytes| Measurement {
        bytes,
        all_gather: [Some(5.0); 3],
        reduce_scatter: [Some(5.0); 2],
        all_reduce: [Some(5.0); 2],
    };
    let ms = vec![tie(mib), tie(64 * mib)];
    let default = PathPolicy::default();
    let p = derive(&ms, &default);
    // The defaults: symmetric at 1 MiB, copy engine at 64 MiB; reduce-scatter
    // symmetric at 1 MiB (in its band), plain at 64 MiB.
    assert_eq!(p.plain_all_gather_bands, vec![]);
    assert_eq!(p.ce_all_gather_min_bytes, 64 * mib);
    assert_eq!(p.symmetric_reduce_scatter_bands, vec![(0, mib)]);
    assert_eq!(p.symmetric_all_reduce_bands, vec![(0, u64::MAX)]);
    // A handle already on the ring keeps it.
    let ring = default
        .clone()
        .with_plain_all_gather_bands(vec![(0, u64::MAX)])
        .with_symmetric_reduce_scatter_bands(vec![])
        .with_symmetric_all_reduce_bands(vec![]);
    let p = derive(&ms, &ring);
    assert_eq!(p.plain_all_gather_bands, vec![(0, u64::MAX)]);
    assert_eq!(p.symmetric_reduce_scatter_bands, vec![]);
    assert_eq!(p.symmetric_all_reduce_bands, vec![]);
}

#[test]
fn sizes_are_the_ends_and_the_powers_of_two_between() {
    let (k, mib) = (1u64 << 10, 1u64 << 20);
    let sizes = |lo, hi| CalibrateConfig::default().with_range(lo, hi).sizes();
    assert_eq!(sizes(64 * k, 256 * k), vec![64 * k, 128 * k, 256 * k]);
    assert_eq!(sizes(3 * mib, 3 * mib), vec![3 * mib]);
    assert_eq!(
        sizes(48 * k, 200 * k),
        vec![48 * k, 64 * k, 128 * k, 200 * k]
    );
    assert_eq!(sizes(4, 8), vec![4, 8]);
    assert_eq!(sizes(4, 5), vec![4, 5]);
    let d = CalibrateConfig::default();
    assert_eq!(d.sizes().len(), 13, "64 KiB to 256 MiB");
    // The quick settings: 3 reps, 3 iterations at the top, at most 8 at the bottom.
    let q = CalibrateConfig::quick(16 * mib, 16 * mib);
    assert_eq!(
        (q.reps, q.bytes_per_rep, q.sizes()),
        (3, 48 * mib, vec![16 * mib])
    );
    let q = CalibrateConfig::quick(64 * k, 64 * mib);
    assert_eq!(q.bytes_per_rep, 512 * k);
    let q = CalibrateConfig::default()
        .with_reps(2)
        .with_bytes_per_rep(7);
    assert_eq!((q.reps, q.bytes_per_rep), (2, 7));
}

#[test]
fn the_policy_reads_as_one_line() {
    let (k, mib) = (1u64 << 10, 1u64 << 20);
    assert_eq!(
        PathPolicy::default().to_string(),
        "all-gather: symm < 32 MiB, ce ≥ 32 MiB; reduce-scatter: symm ≤ 128 KiB, \
         1 MiB–4 MiB, else plain; all-reduce: symm"
    );
    let p = PathPolicy::default()
        .with_plain_all_gather_bands(vec![(0, 64 * k), (64 * mib, u64::MAX)])
        .with_ce_all_gather_min_bytes(0)
        .with_symmetric_reduce_scatter_bands(vec![])
        .with_symmetric_all_reduce_bands(vec![(3 * mib + 5, 3 * mib + 5)])
        .with_choices(Choice::Auto, Choice::Prefer(Path::PlainKernel));
    assert_eq!(
        p.to_string(),
        "all-gather: plain ≤ 64 KiB, ≥ 64 MiB, else ce; reduce-scatter: plain (prefers \
         plain); all-reduce: symm 3145733 B, else plain"
    );
    let p = PathPolicy::default()
        .with_plain_all_gather_bands(vec![(0, u64::MAX)])
        .with_ce_all_gather_min_bytes(u64::MAX);
    assert!(p.to_string().starts_with("all-gather: plain; "), "{p}");
}

#[test]
fn calibration_is_needed_off_the_reference_setup() {
    use crate::backend::{BackendInfo, CommInfo};
    use crate::error::NcclVersion;
    let info = |kind, world| {
        let v = NcclVersion::new(2, 28, 3);
        BackendInfo::new(kind, 0, world, v, 2 << 20, CommInfo::STANDARD.to_vec()).unwrap()
    };
    let nccl = info(BackendKind::Nccl, 2);
    assert_eq!(reason(&nccl), None, "each rank its own GPU, one node");
    let shared = nccl.clone().with_shared_devices(true);
    assert_eq!(reason(&shared), Some("shared GPU"));
    assert_eq!(reason(&shared.with_nodes(2)), Some("shared GPU"));
    assert_eq!(reason(&nccl.with_nodes(2)), Some("several nodes"));
    let one = info(BackendKind::Nccl, 1).with_shared_devices(true);
    assert_eq!(reason(&one), None, "one rank");
    let host = info(BackendKind::Host, 2)
        .with_shared_devices(true)
        .with_nodes(2);
    assert_eq!(reason(&host), None, "the host backends");
    // A handle on the host backend.
    let pools = SymmPool::host_group(2, PoolConfig::default()).unwrap();
    let coll = Coll::new(&pools[0]).unwrap();
    assert!(!coll.needs_calibration());
    assert_eq!(coll.calibration_reason(), None);
}

#[test]
fn refuses_odd_configs_and_closed_pools() {
    let pools = SymmPool::host_group(1, PoolConfig::default()).unwrap();
    let coll = Coll::new(&pools[0]).unwrap();
    let s = Stream::host();
    for cfg in [
        CalibrateConfig::default().with_range(0, 1 << 20),
        CalibrateConfig::default().with_range(1, 1 << 20),
        CalibrateConfig::default().with_range(1 << 20, 1 << 10),
        CalibrateConfig::default().with_range(1 << 63, u64::MAX),
        CalibrateConfig::default().with_range(u64::MAX, u64::MAX),
        CalibrateConfig {
            reps: 0,
            ..CalibrateConfig::default()
        },
    ] {
        assert!(
            matches!(coll.calibrate(&s, &cfg), Err(Error::Config { .. })),
            "{cfg:?}"
        );
    }
    pools[0].close().unwrap();
    assert!(matches!(
        coll.calibrate(&s, &CalibrateConfig::default()),
        Err(Error::PoolClosed)
    ));
}

#[test]
fn calibrates_on_the_host_backend_and_agrees_across_ranks() {
    let pools = SymmPool::host_group(2, PoolConfig::default()).unwrap();
    let cfg = CalibrateConfig {
        reps: 1,
        bytes_per_rep: 1 << 20,
        ..CalibrateConfig::default().with_range(64 << 10, 256 << 10)
    };
    let out: Vec<Calibration> = std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let cfg = &cfg;
                s.spawn(move || {
                    let coll = Coll::new(p).unwrap();
                    coll.calibrate(&Stream::host(), cfg).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(out[0], out[1], "every rank gets rank 0's result");
    assert_eq!(out[0].measurements.len(), 3);
    assert!(out[0].measurements.iter().all(|m| {
        m.all_gather
            .iter()
            .chain(&m.all_reduce)
            .all(Option::is_some)
    }));
    for p in &pools {
        assert_eq!(
            p.memory_stats()["segment.all.current"].as_u64(),
            Some(0),
            "the temporary pool is gone"
        );
    }
}
