use super::*;
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
