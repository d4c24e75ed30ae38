//! Collectives on the host backend: real data movement and summation against a
//! host-computed reference, for every element type, both placements, odd sizes, and
//! the paths reported; plus the errors for inconsistent calls.

use std::thread;
use std::time::{Duration, Instant};
use symmpool::coll::{Path, PathPolicy};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Element, Error, Group, GroupConfig, HostBackend, HostConfig,
    PoolConfig, ReduceOp, Stream, SymmPool, bf16, f16,
};

/// One default pool per rank of a new host world of `world` ranks, in groups with
/// `group`'s settings.
fn host_pools(world: usize, group: GroupConfig) -> Vec<SymmPool> {
    let groups = Group::host(world, &group).unwrap();
    SymmPool::world(&groups, &PoolConfig::default()).unwrap()
}

fn pools(world: usize) -> Vec<SymmPool> {
    host_pools(
        world,
        GroupConfig::default().with_timeout(Duration::from_secs(10)),
    )
}

/// Pools whose collectives are checked before they launch.
fn strict_pools(world: usize) -> Vec<SymmPool> {
    host_pools(
        world,
        GroupConfig::default()
            .with_timeout(Duration::from_secs(10))
            .with_check(CheckMode::Strict),
    )
}

/// `f` on every rank (a thread each) with its pool and a collectives handle made for
/// the call; the results in rank order.
fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool, &Coll) -> R + Sync) -> Vec<R> {
    let colls = Coll::world(pools).unwrap();
    thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .zip(&colls)
            .map(|(p, c)| s.spawn(|| f(p, c)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `f` on every rank (a thread each) with its pool (for a test that holds the
/// handles itself); the results in rank order.
fn pool_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Element `i` of rank `r`'s data: small integers, exact in every type.
fn value<T: Element>(r: usize, i: usize) -> T {
    T::from_f64(((r * 31 + i * 7) % 23) as f64)
}

fn check_all_gather<T: Element>(world: usize, count: usize, in_place: bool) {
    let pools = pools(world);
    let results = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let r = pool.rank();
        let size = std::mem::size_of::<T>();
        let mine: Vec<T> = (0..count).map(|i| value(r, i)).collect();
        let out = pool.alloc((world * count * size) as u64, &stream).unwrap();
        // Poison the output so unwritten elements show.
        out.write(&vec![T::from_f64(99.0); world * count]).unwrap();
        let report = if in_place {
            out.view::<T>()
                .unwrap()
                .slice(r * count, count)
                .unwrap()
                .copy_from_host(&mine)
                .unwrap();
            coll.tagged(0)
                .all_gather_in_place::<T>(&out, &stream)
                .unwrap()
        } else {
            let input = pool.alloc((count * size) as u64, &stream).unwrap();
            input.write(&mine).unwrap();
            coll.tagged(0)
                .all_gather::<T>(&input, &out, &stream)
                .unwrap()
        };
        (report, out.read::<T>().unwrap())
    });
    let want: Vec<T> = (0..world)
        .flat_map(|r| (0..count).map(move |i| value::<T>(r, i)))
        .collect();
    for (report, got) in results {
        assert_eq!(
            got,
            want,
            "{:?} world {world} count {count} in_place {in_place}",
            T::DTYPE
        );
        assert_eq!(
            report.bytes_per_rank,
            (count * std::mem::size_of::<T>()) as u64
        );
    }
}

fn check_reduce_scatter<T: Element>(world: usize, count: usize, in_place: bool, op: ReduceOp) {
    let pools = pools(world);
    let results = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let r = pool.rank();
        let size = std::mem::size_of::<T>();
        let data: Vec<T> = (0..world * count).map(|i| value(r, i)).collect();
        let input = pool.alloc((world * count * size) as u64, &stream).unwrap();
        input.write(&data).unwrap();
        if in_place {
            let report = coll
                .tagged(0)
                .reduce_scatter_in_place::<T>(&input, op, &stream)
                .unwrap();
            let all = input.read::<T>().unwrap();
            (report, all[r * count..(r + 1) * count].to_vec())
        } else {
            let out = pool.alloc((count * size) as u64, &stream).unwrap();
            out.write(&vec![T::from_f64(99.0); count]).unwrap();
            let report = coll
                .tagged(0)
                .reduce_scatter::<T>(&input, &out, op, &stream)
                .unwrap();
            (report, out.read::<T>().unwrap())
        }
    });
    for (rank, (_, got)) in results.iter().enumerate() {
        let want: Vec<T> = (0..count)
            .map(|i| {
                let vals = (0..world).map(|r| value::<T>(r, rank * count + i).to_f64());
                let x = match op {
                    ReduceOp::Sum => vals.sum(),
                    // Integers: sum, then divide. Floats: NCCL's pre-multiplied sum,
                    // each term scaled by 1/ranks and rounded to T, summed in T.
                    ReduceOp::Avg if T::DTYPE == symmpool::DType::U8 => {
                        vals.sum::<f64>() / world as f64
                    }
                    ReduceOp::Avg => vals.fold(0.0, |acc, v| {
                        T::from_f64(acc + T::from_f64(v / world as f64).to_f64()).to_f64()
                    }),
                    ReduceOp::Prod => vals.product(),
                    ReduceOp::Max => vals.fold(f64::MIN, f64::max),
                    ReduceOp::Min => vals.fold(f64::MAX, f64::min),
                };
                T::from_f64(x)
            })
            .collect();
        assert_eq!(
            got,
            &want,
            "{:?} {op:?} rank {rank} world {world} count {count}",
            T::DTYPE
        );
    }
}

#[test]
fn all_gather_every_type_both_placements_odd_sizes() {
    for world in [2, 3, 4] {
        for count in [1, 127, 1000, 3 * 100_003] {
            for in_place in [false, true] {
                check_all_gather::<f32>(world, count, in_place);
                check_all_gather::<f16>(world, count, in_place);
                check_all_gather::<bf16>(world, count, in_place);
                check_all_gather::<u8>(world, count, in_place);
            }
        }
    }
}

#[test]
fn reduce_scatter_every_type_both_placements_odd_sizes() {
    for world in [2, 4] {
        for count in [1, 333, 50_001] {
            for in_place in [false, true] {
                check_reduce_scatter::<f32>(world, count, in_place, ReduceOp::Sum);
                check_reduce_scatter::<f16>(world, count, in_place, ReduceOp::Sum);
                check_reduce_scatter::<bf16>(world, count, in_place, ReduceOp::Sum);
                check_reduce_scatter::<u8>(world, count, in_place, ReduceOp::Sum);
            }
        }
    }
    for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod, ReduceOp::Avg] {
        check_reduce_scatter::<f32>(3, 100, false, op);
        check_reduce_scatter::<u8>(2, 100, true, op);
    }
    check_reduce_scatter::<f16>(3, 100, false, ReduceOp::Avg);
}

#[test]
fn f16_average_does_not_overflow_where_the_mean_fits() {
    let pools = pools(2);
    let got = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let input = pool.alloc(2 * 2, &stream).unwrap();
        input.write(&[f16::from_f32(60000.0); 2]).unwrap();
        let out = pool.alloc(2, &stream).unwrap();
        coll.tagged(0)
            .reduce_scatter::<f16>(&input, &out, ReduceOp::Avg, &stream)
            .unwrap();
        out.read::<f16>().unwrap()[0]
    });
    for g in got {
        assert_eq!(g.to_f32(), 60000.0);
    }
}

#[test]
fn eight_ranks_gather_and_reduce() {
    check_all_gather::<bf16>(8, 4099, true);
    check_reduce_scatter::<f32>(8, 4099, false, ReduceOp::Sum);
}

#[test]
fn paths_follow_size_type_and_operation() {
    // A call's deadline covers its data movement too: 64 MiB reductions on the host,
    // unoptimised, on a busy machine, get the default timeout.
    let pools = SymmPool::host_group(2, PoolConfig::default()).unwrap();
    let paths = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let small = pool.alloc(2 * (64 << 10), &stream).unwrap();
        let big = pool.alloc(2 * (64 << 20), &stream).unwrap();
        let big_out = pool.alloc(64 << 20, &stream).unwrap();
        let small_out = pool.alloc(64 << 10, &stream).unwrap();
        vec![
            coll.tagged(0)
                .all_gather_in_place::<bf16>(&small, &stream)
                .unwrap()
                .path,
            coll.tagged(0)
                .all_gather_in_place::<bf16>(&big, &stream)
                .unwrap()
                .path,
            coll.tagged(0)
                .reduce_scatter::<bf16>(&small, &small_out, ReduceOp::Sum, &stream)
                .unwrap()
                .path,
            coll.tagged(0)
                .reduce_scatter::<bf16>(&big, &big_out, ReduceOp::Sum, &stream)
                .unwrap()
                .path,
            coll.tagged(0)
                .reduce_scatter::<bf16>(&small, &small_out, ReduceOp::Max, &stream)
                .unwrap()
                .path,
            coll.tagged(0)
                .reduce_scatter::<u8>(&small, &small_out, ReduceOp::Sum, &stream)
                .unwrap()
                .path,
        ]
    });
    for p in paths {
        assert_eq!(
            p,
            vec![
                Path::SymmetricKernel,
                Path::CopyEngine,
                Path::SymmetricKernel,
                Path::PlainKernel,
                Path::PlainKernel,
                Path::PlainKernel,
            ]
        );
    }
}

#[test]
fn a_calibrated_policy_steers_every_path_and_moves_the_same_data() {
    // A policy as calibration derives it where the ring is fastest for small
    // all-gathers (two ranks sharing a GPU, say): plain up to 64 KiB, symmetric
    // kernel above, copy engine from 1 MiB; the ring for every reduce-scatter.
    let pools = pools(2);
    let policy = PathPolicy::default()
        .with_plain_all_gather_bands(vec![(0, 64 << 10)])
        .with_ce_all_gather_min_bytes(1 << 20)
        .with_symmetric_reduce_scatter_bands(vec![]);
    let got = on_ranks(&pools, |pool, coll| {
        coll.set_path_policy(policy.clone());
        let stream = Stream::host();
        let rank = pool.rank();
        [64 << 10, 256 << 10, 1 << 20]
            .map(|per_rank: u64| {
                let buf = pool.alloc(2 * per_rank, &stream).unwrap();
                let n = (per_rank / 4) as usize;
                let mut mine = vec![0f32; 2 * n];
                mine[rank * n..(rank + 1) * n].fill(rank as f32 + 1.0);
                buf.write(&mine).unwrap();
                let ag = coll
                    .tagged(0)
                    .all_gather_in_place::<f32>(&buf, &stream)
                    .unwrap()
                    .path;
                let all = buf.read::<f32>().unwrap();
                assert!(all[..n].iter().all(|&x| x == 1.0) && all[n..].iter().all(|&x| x == 2.0));
                let rs =
                    (coll
                        .tagged(0)
                        .reduce_scatter_in_place::<f32>(&buf, ReduceOp::Sum, &stream))
                    .unwrap()
                    .path;
                let sum = buf.read::<f32>().unwrap();
                // Every rank holds the gathered buffer: chunk r sums to 2 (r + 1).
                let own = &sum[rank * n..(rank + 1) * n];
                let want = 2.0 * (rank as f32 + 1.0);
                assert!(own.iter().all(|&x| x == want), "rank {rank}");
                (ag, rs)
            })
            .to_vec()
    });
    for paths in got {
        assert_eq!(
            paths,
            vec![
                (Path::PlainKernel, Path::PlainKernel),
                (Path::SymmetricKernel, Path::PlainKernel),
                (Path::CopyEngine, Path::PlainKernel),
            ]
        );
    }
}

#[test]
fn a_pool_that_does_not_register_runs_plain() {
    let pools = SymmPool::host_group(2, PoolConfig::default().with_register(false)).unwrap();
    let paths = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let buf = pool.alloc(2 * (64 << 20), &stream).unwrap();
        let p = coll
            .tagged(0)
            .all_gather_in_place::<f32>(&buf, &stream)
            .unwrap()
            .path;
        let stats = pool.memory_stats();
        let role = |r: &str| stats[&format!("registrations.{r}")].as_u64().unwrap();
        (
            p,
            vec![role("symmetric"), role("copy_engine"), role("plain")],
        )
    });
    for (p, regs) in paths {
        assert_eq!(p, Path::PlainKernel);
        assert_eq!(regs, vec![0, 0, 0]);
    }
}

#[test]
fn inconsistent_sizes_are_refused_before_launch() {
    let pools = pools(2);
    on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let a = pool.alloc(4096, &stream).unwrap();
        let b = pool.alloc(4096, &stream).unwrap();
        let odd = pool.alloc(4097, &stream).unwrap();
        for e in [
            coll.tagged(0)
                .all_gather::<f32>(&a, &b, &stream)
                .unwrap_err(),
            coll.tagged(0)
                .reduce_scatter::<f32>(&a, &b, ReduceOp::Sum, &stream)
                .unwrap_err(),
            coll.tagged(0)
                .all_gather_in_place::<f32>(&odd, &stream)
                .unwrap_err(),
            coll.tagged(0)
                .all_gather::<f32>(&odd, &b, &stream)
                .unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidCollective { .. }), "{e:?}");
        }
        let three = pool.alloc(12, &stream).unwrap();
        assert!(matches!(
            coll.tagged(0)
                .reduce_scatter_in_place::<f32>(&three, ReduceOp::Sum, &stream),
            Err(Error::InvalidCollective { .. })
        ));
    });
}

#[test]
fn diverged_offsets_are_caught_at_the_collective() {
    // Rank 1 allocates one extra small buffer from the cache (no growth, so no
    // agreement): its next buffer lands at another offset. NCCL would silently read
    // the wrong bytes; the strict check reports it on every rank.
    let pools = strict_pools(2);
    let errs = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let warm = pool.alloc(4096, &stream).unwrap();
        drop(warm);
        let _extra = (pool.rank() == 1).then(|| pool.alloc(512, &stream).unwrap());
        let buf = pool.alloc(8192, &stream).unwrap();
        coll.tagged(0)
            .all_gather_in_place::<f32>(&buf, &stream)
            .unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, Error::CollectiveDivergence(_)), "{e:?}");
        assert!(e.to_string().contains("input allocation"), "{e}");
    }
}

#[test]
fn mismatched_counts_across_ranks_are_errors_not_hangs() {
    let pools = strict_pools(2);
    let errs = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        drop(pool.alloc(1 << 20, &stream).unwrap()); // grow together first
        let n = if pool.rank() == 0 { 1024 } else { 2048 };
        let buf = pool.alloc(2 * n * 4, &stream).unwrap();
        coll.tagged(0)
            .all_gather_in_place::<f32>(&buf, &stream)
            .unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, Error::CollectiveDivergence(_)), "{e:?}");
        assert!(e.to_string().contains("count differs"), "{e}");
    }
}

#[test]
fn a_missing_rank_times_out() {
    let pools = host_pools(
        2,
        GroupConfig::default().with_timeout(Duration::from_millis(300)),
    );
    let stream = Stream::host();
    let buf = pools[0].alloc(4096, &stream);
    // Growth needs both ranks: rank 0 alone times out.
    assert!(matches!(buf, Err(Error::Timeout { .. })));
}

#[test]
fn a_collective_that_timed_out_breaks_the_group_on_every_rank() {
    let pools = host_pools(
        2,
        GroupConfig::default().with_timeout(Duration::from_millis(300)),
    );
    let colls = Coll::world(&pools).unwrap();
    let bufs = pool_ranks(&pools, |p| p.alloc(8192, &Stream::host()).unwrap());
    let stream = Stream::host();
    // Rank 0 alone: times out.
    assert!(matches!(
        colls[0]
            .tagged(0)
            .all_gather_in_place::<f32>(&bufs[0], &stream),
        Err(Error::Timeout { .. })
    ));
    // Then both ranks make the same call: an error on both, no panic, no stale pairing.
    let errs = thread::scope(|s| {
        let hs: Vec<_> = bufs
            .iter()
            .zip(&colls)
            .map(|(b, coll)| {
                s.spawn(|| {
                    coll.tagged(0)
                        .all_gather_in_place::<f32>(b, &Stream::host())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // Rank 0's pool is broken by its timed-out collective; rank 1 reaches the
    // backend, whose group is broken.
    assert!(
        matches!(&errs[0], Err(Error::PoolBroken { reason }) if reason.contains("timed out")),
        "{:?}",
        errs[0]
    );
    assert!(
        matches!(errs[1], Err(Error::GroupBroken { rank: 0, .. })),
        "{:?}",
        errs[1]
    );
}

#[test]
fn a_failed_collective_ends_within_the_pool_timeout_in_every_check_mode() {
    // The backend has no timeout of its own: the group's timeout ends every wait of
    // the call (its check, the backend's rounds), however many there are.
    const TIMEOUT: Duration = Duration::from_secs(2);
    for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
        let config = GroupConfig::default()
            .with_timeout(TIMEOUT)
            .with_check(mode);
        let backends = HostBackend::world(HostConfig::new(2)).unwrap();
        let groups = Group::world(backends, &config).unwrap();
        let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
        let colls = Coll::world(&pools).unwrap();
        let bufs = pool_ranks(&pools, |p| p.alloc(8192, &Stream::host()).unwrap());
        // Rank 1 never makes the collective.
        let started = Instant::now();
        let r = colls[0]
            .tagged(0)
            .all_gather_in_place::<f32>(&bufs[0], &Stream::host());
        let took = started.elapsed();
        assert!(
            matches!(r, Err(Error::Timeout { .. } | Error::PoolBroken { .. })),
            "{mode:?}: {r:?}"
        );
        assert!(
            took < TIMEOUT + Duration::from_secs(1),
            "{mode:?}: the call took {took:?} with a group timeout of {TIMEOUT:?}"
        );
    }
}

#[test]
fn same_offset_in_another_window_is_caught() {
    // Two reserved segments; rank 1 takes an extra block from the cache (no agreement)
    // so its next buffer sits at offset 0 of the *second* window. Same offset, different
    // window: NCCL would pair the wrong memory; the strict check reports it.
    let pools = strict_pools(2);
    let errs = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        pool.reserve(20 << 20).unwrap();
        pool.reserve(20 << 20).unwrap();
        let _extra = (pool.rank() == 1).then(|| pool.alloc(20 << 20, &stream).unwrap());
        let b = pool.alloc(2 << 20, &stream).unwrap();
        assert_eq!(b.offset_bytes(), 0);
        coll.tagged(0)
            .all_gather_in_place::<f32>(&b, &stream)
            .unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, Error::CollectiveDivergence(_)), "{e:?}");
        assert!(e.to_string().contains("input allocation"), "{e}");
    }
}

#[test]
fn two_threads_of_one_rank_on_one_communicator_do_not_interleave_rounds() {
    // Rank 0 issues its two all-gathers from two threads (in either order); rank 1
    // issues the matching two from one thread. The host backend serialises each rank's
    // calls on a communicator, so calls pair whole: matched pairs succeed, crossed
    // pairs (different offsets) fail on both sides (the strict check); never a panic
    // or a hang.
    let pools = strict_pools(2);
    let colls = Coll::world(&pools).unwrap();
    let bufs = pool_ranks(&pools, |p| {
        (0..2)
            .map(|_| p.alloc(8192, &Stream::host()).unwrap())
            .collect::<Vec<_>>()
    });
    let (b0, b1) = (&bufs[0], &bufs[1]);
    for _ in 0..50 {
        let (r0, r1) = thread::scope(|s| {
            let c0 = &colls[0];
            let a = s.spawn(|| {
                c0.tagged(0)
                    .all_gather_in_place::<f32>(&b0[0], &Stream::host())
                    .is_ok()
            });
            let b = s.spawn(|| {
                c0.tagged(0)
                    .all_gather_in_place::<f32>(&b0[1], &Stream::host())
                    .is_ok()
            });
            let c = s.spawn(|| {
                b1.iter()
                    .map(|b| {
                        colls[1]
                            .tagged(0)
                            .all_gather_in_place::<f32>(b, &Stream::host())
                            .is_ok()
                    })
                    .collect::<Vec<_>>()
            });
            (
                vec![a.join().unwrap(), b.join().unwrap()],
                c.join().unwrap(),
            )
        });
        let ok0 = r0.iter().filter(|&&x| x).count();
        let ok1 = r1.iter().filter(|&&x| x).count();
        assert_eq!(ok0, ok1, "rank 0 {r0:?} rank 1 {r1:?}");
    }
}

#[test]
fn duration_max_timeouts_work_in_every_public_call() {
    // `Duration::MAX` means "never": no call may overflow making its deadline.
    for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
        let config = GroupConfig::default()
            .with_timeout(Duration::MAX)
            .with_check(mode);
        let pools = host_pools(2, config);
        let reports = on_ranks(&pools, |pool, coll| {
            let stream = Stream::host();
            let buf = pool.alloc(2 * 4 * 1024, &stream).unwrap();
            let out = pool.alloc(4 * 1024, &stream).unwrap();
            pool.reserve(2 << 20).unwrap();
            pool.reserve_small(1 << 20).unwrap();
            coll.tagged(0)
                .all_gather_in_place::<f32>(&buf, &stream)
                .unwrap();
            coll.tagged(0)
                .all_gather::<f32>(&out, &buf, &stream)
                .unwrap();
            coll.tagged(0)
                .reduce_scatter::<f32>(&buf, &out, ReduceOp::Sum, &stream)
                .unwrap();
            coll.tagged(0)
                .reduce_scatter_in_place::<f32>(&buf, ReduceOp::Max, &stream)
                .unwrap();
            coll.wait_checks().unwrap();
            coll.end_step().unwrap();
            let mut cal = symmpool::coll::CalibrateConfig::default().with_range(4 << 10, 8 << 10);
            (cal.reps, cal.bytes_per_rep) = (1, 1 << 16);
            coll.calibrate(&stream, &cal).unwrap();
            drop((buf, out));
            pool.fit_to_peak().unwrap();
            pool.trim().unwrap();
            pool.close().unwrap();
            pool.memory_stats()["calls"].as_u64().unwrap()
        });
        assert_eq!(reports[0], reports[1], "{mode:?}");
    }
}

#[test]
fn a_world_of_one_rank_checks_nothing() {
    // One rank has no peer to compare with: the handle runs as `Off` whatever the
    // pool's mode, and its collectives still move the data.
    let pools = strict_pools(1);
    let coll = Coll::new(&pools[0]).unwrap();
    assert_eq!(coll.check_mode(), CheckMode::Off);
    let stream = pools[0].new_stream().unwrap();
    let input = pools[0].alloc(16, &stream).unwrap();
    let output = pools[0].alloc(16, &stream).unwrap();
    input.write(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    coll.tagged(0)
        .all_gather::<f32>(&input, &output, &stream)
        .unwrap();
    assert_eq!(output.read::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    coll.wait_checks().unwrap();
    let two = strict_pools(2);
    let modes = on_ranks(&two, |_, c| c.check_mode());
    assert_eq!(modes, [CheckMode::Strict; 2]);
}

#[test]
fn ranks_that_calibrate_different_sizes_fail_before_any_collective() {
    // Rank 1 asks for twice rank 0's sizes: the temporary pool's name carries the
    // configuration, so making it fails on both ranks, and nothing is measured.
    let pools = SymmPool::host_group(2, PoolConfig::default()).unwrap();
    let errors = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let top = (8 << 10) << pool.rank();
        let cal = symmpool::coll::CalibrateConfig::default()
            .with_range(4 << 10, top)
            .with_reps(1);
        let err = coll.calibrate(&stream, &cal).unwrap_err();
        pool.close().unwrap();
        err
    });
    for e in errors {
        assert!(matches!(e, Error::ChannelMismatch { .. }), "{e}");
    }
}

#[test]
fn making_a_collectives_handle_is_local_a_lone_rank_gets_it_at_once() {
    // `Coll::new` makes no round with the peers (the pool is what the ranks make
    // together): rank 0 gets its handle, under every check mode, while rank 1 makes
    // none until later; their collectives then pair.
    for mode in [CheckMode::Strict, CheckMode::Async, CheckMode::Off] {
        let config = GroupConfig::default()
            .with_timeout(Duration::from_secs(10))
            .with_check(mode);
        let pools = host_pools(2, config);
        let started = Instant::now();
        let first = Coll::new(&pools[0]).unwrap();
        assert!(started.elapsed() < Duration::from_secs(1), "{mode:?}");
        let second = Coll::new(&pools[1]).unwrap();
        let sums = thread::scope(|s| {
            let hs: Vec<_> = [(&pools[0], &first), (&pools[1], &second)]
                .into_iter()
                .map(|(pool, coll)| {
                    s.spawn(move || {
                        let b = pool.alloc(1024, &Stream::host()).unwrap();
                        b.write(&[(pool.rank() + 1) as f32; 256]).unwrap();
                        (coll.tagged(0))
                            .all_reduce_in_place::<f32>(&b, ReduceOp::Sum, &Stream::host())
                            .unwrap();
                        b.read::<f32>().unwrap()[0]
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert_eq!(sums, [3.0, 3.0], "{mode:?}");
    }
}

/// A thread remembers the path of its last few calls' shapes (pool, operation, type,
/// size, segments), only while the policy stands: the same call on the same buffer
/// takes a new policy's path at once, and the old one's when it is back.
#[test]
fn a_remembered_path_choice_follows_every_new_policy() {
    use symmpool::coll::Choice;
    let pools = pools(2);
    let got = on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let buf = pool.alloc(2 * 4096, &stream).unwrap();
        let call = || {
            let tagged = coll.tagged(0);
            tagged
                .all_gather_in_place::<f32>(&buf, &stream)
                .unwrap()
                .path
        };
        let (first, again) = (call(), call());
        let plain = Choice::Prefer(Path::PlainKernel);
        coll.set_path_policy(PathPolicy::default().with_choices(plain, plain));
        let forced = call();
        coll.set_path_policy(PathPolicy::default());
        let back = call();
        drop(buf);
        coll.end_step().unwrap();
        [first, again, forced, back]
    });
    for [first, again, forced, back] in got {
        assert_ne!(
            first,
            Path::PlainKernel,
            "the default path on registered buffers"
        );
        assert_eq!((again, forced, back), (first, Path::PlainKernel, first));
    }
}
