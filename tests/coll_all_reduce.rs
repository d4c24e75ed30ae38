//! All-reduce on the host backends: ranks as threads and ranks as processes over
//! shared memory. Results against a reference reduced in rank order in the element
//! type's arithmetic, for every operation and element type, in place and out of
//! place, on the symmetric path (buffers in windows) and the plain one; the paths the
//! policy picks; bad input as clear errors (mismatched sizes, buffers of another pool,
//! `Avg` on an NCCL without `ncclAvg`) after which the pool stays usable; and the
//! record compared under `Strict` and `Async`.

mod common;

use common::procs::{CHILD, Job};
use common::rng::Rng;
use std::thread;
use std::time::Duration;
use symmpool::coll::{Choice, Path, PathPolicy};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, DType, Element, Error, Group, GroupConfig, HostBackend,
    HostConfig, NcclVersion, PoolConfig, ReduceOp, Stream, SymmPool, bf16, f16,
};

const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Max,
    ReduceOp::Min,
    ReduceOp::Prod,
];

fn config() -> GroupConfig {
    GroupConfig::default().with_timeout(Duration::from_secs(30))
}

/// One pool per rank of a host world with `host`'s settings, in groups made with
/// `config`.
fn pools_with(host: HostConfig, config: GroupConfig) -> Vec<SymmPool> {
    let groups = Group::world(HostBackend::world(host).unwrap(), &config).unwrap();
    SymmPool::world(&groups, &PoolConfig::default()).unwrap()
}

/// As [`pools_with`], on `world` ranks with the default host settings.
fn host_pools(world: usize, config: GroupConfig) -> Vec<SymmPool> {
    pools_with(HostConfig::new(world), config)
}

/// Rank `r`'s input: values exact in bf16 ([-4, 4) in steps of 1/128; any byte for
/// `u8`), different per rank and per `salt`.
fn input<T: Element>(r: usize, count: usize, salt: u64) -> Vec<T> {
    let mut rng = Rng(salt.wrapping_mul(1000).wrapping_add(r as u64));
    (0..count)
        .map(|_| {
            let bits = rng.next();
            if T::DTYPE == DType::U8 {
                T::from_f64((bits % 256) as f64)
            } else {
                T::from_f64(((bits % 1024) as f64 - 512.0) / 128.0)
            }
        })
        .collect()
}

/// The reduction over ranks, in rank order, rounding to `T` after every step (as
/// NCCL's kernels do); averages as NCCL's: floating point scales each input by
/// 1/ranks and sums, integers sum and divide.
fn reference<T: Element>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    let n = inputs.len();
    let premul = op == ReduceOp::Avg && T::DTYPE != DType::U8;
    (0..inputs[0].len())
        .map(|i| {
            let mut acc: Option<T> = None;
            for data in inputs {
                let mut x = data[i];
                if premul {
                    x = T::from_f64(x.to_f64() / n as f64);
                }
                acc = Some(match acc {
                    None => x,
                    Some(a) => {
                        let (a, b) = (a.to_f64(), x.to_f64());
                        T::from_f64(match op {
                            ReduceOp::Sum | ReduceOp::Avg => a + b,
                            ReduceOp::Prod => a * b,
                            ReduceOp::Max => a.max(b),
                            ReduceOp::Min => a.min(b),
                        })
                    }
                });
            }
            let acc = acc.unwrap();
            if op == ReduceOp::Avg && !premul {
                T::from_f64(acc.to_f64() / n as f64)
            } else {
                acc
            }
        })
        .collect()
}

/// One rank's all-reduce of `count` elements of `T` with `op`: checks the result
/// against the reference and returns the path taken.
fn one_rank<T: Element>(
    pool: &SymmPool,
    coll: &Coll,
    count: usize,
    op: ReduceOp,
    in_place: bool,
    salt: u64,
) -> Path {
    let stream = Stream::host();
    let (r, world) = (pool.rank(), pool.world_size());
    let bytes = (count * std::mem::size_of::<T>()) as u64;
    let mine = input::<T>(r, count, salt);
    let buf = pool.alloc(bytes, &stream).unwrap();
    buf.write(&mine).unwrap();
    let (report, got) = if in_place {
        let report = coll
            .tagged(0)
            .all_reduce_in_place::<T>(&buf, op, &stream)
            .unwrap();
        (report, buf.read::<T>().unwrap())
    } else {
        let out = pool.alloc(bytes, &stream).unwrap();
        // Poison the output so unwritten elements show.
        out.write(&vec![T::from_f64(99.0); count]).unwrap();
        let report = coll
            .tagged(0)
            .all_reduce::<T>(&buf, &out, op, &stream)
            .unwrap();
        assert_eq!(buf.read::<T>().unwrap(), mine, "the input is left alone");
        (report, out.read::<T>().unwrap())
    };
    let inputs: Vec<Vec<T>> = (0..world).map(|p| input::<T>(p, count, salt)).collect();
    let want = reference(op, &inputs);
    assert!(
        got == want,
        "{:?} {op:?} x{count} in_place={in_place} world {world}: rank {r} differs",
        T::DTYPE
    );
    assert_eq!(report.bytes_per_rank, bytes);
    report.path
}

/// Every operation, element type and placement at `count` elements on this rank
/// (every rank calls it, in the same order); the paths taken, in order.
fn every_case(pool: &SymmPool, coll: &Coll, count: usize, salt: u64) -> Vec<Path> {
    let mut paths = Vec::new();
    for op in OPS {
        for in_place in [false, true] {
            paths.push(one_rank::<f32>(pool, coll, count, op, in_place, salt));
            paths.push(one_rank::<bf16>(pool, coll, count, op, in_place, salt));
            paths.push(one_rank::<f16>(pool, coll, count, op, in_place, salt));
            paths.push(one_rank::<u8>(pool, coll, count, op, in_place, salt));
        }
    }
    paths
}

/// `f` on every rank (a thread each) with its pool and a handle; results in rank order.
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

#[test]
fn threads_match_the_reference_for_every_op_type_and_placement() {
    for world in [1, 2, 3, 4] {
        let pools = host_pools(world, config());
        let paths = on_ranks(&pools, |pool, coll| {
            let mut paths = Vec::new();
            for count in [1, 999] {
                paths.extend(every_case(pool, coll, count, count as u64));
            }
            paths
        });
        assert!(paths.iter().all(|p| *p == paths[0]), "ranks' paths differ");
        // Sum on f32/bf16/f16 in windows: the symmetric kernel; u8 and the other
        // reductions (Avg before NCCL 2.30 included): the plain kernel.
        let first = &paths[0];
        let symmetric = Path::SymmetricKernel;
        assert_eq!(
            first[..4],
            [symmetric, symmetric, symmetric, Path::PlainKernel]
        );
        assert!(
            first[8..40].iter().all(|p| *p == Path::PlainKernel),
            "{first:?}"
        );
    }
}

#[test]
fn threads_large_buffers_and_the_plain_path_in_place() {
    let pools = host_pools(3, config());
    on_ranks(&pools, |pool, coll| {
        assert_eq!(
            one_rank::<f32>(pool, coll, 300_001, ReduceOp::Sum, true, 7),
            Path::SymmetricKernel
        );
        one_rank::<bf16>(pool, coll, 300_001, ReduceOp::Max, false, 8);
        // Forced onto the plain path, in place.
        coll.set_path_policy(
            PathPolicy::default().with_all_reduce(Choice::Prefer(Path::PlainKernel)),
        );
        assert_eq!(
            one_rank::<f32>(pool, coll, 300_001, ReduceOp::Sum, true, 9),
            Path::PlainKernel
        );
        // No size in the symmetric bands: plain too.
        coll.set_path_policy(PathPolicy::default().with_symmetric_all_reduce_bands(vec![]));
        assert_eq!(
            one_rank::<f16>(pool, coll, 1000, ReduceOp::Sum, false, 10),
            Path::PlainKernel
        );
    });
}

#[test]
fn unregistered_pools_take_the_plain_path() {
    let pools = pools_with(HostConfig::new(2).with_symmetric(false), config());
    let paths = on_ranks(&pools, |pool, coll| every_case(pool, coll, 77, 3));
    assert!(paths[0].iter().all(|p| *p == Path::PlainKernel));
}

#[test]
fn bad_input_is_a_clear_error_and_the_pool_stays_usable() {
    let pools = host_pools(2, config());
    let others = host_pools(2, config());
    on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let a = pool.alloc(4096, &stream).unwrap();
        let b = pool.alloc(2048, &stream).unwrap();
        let err = coll
            .tagged(0)
            .all_reduce::<f32>(&a, &b, ReduceOp::Sum, &stream)
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidCollective { op: "all_reduce", detail } if detail.contains("2048")),
            "{err}"
        );
        let foreign = others[pool.rank()].alloc(4096, &stream).unwrap();
        for err in [
            coll.tagged(0)
                .all_reduce::<f32>(&a, &foreign, ReduceOp::Sum, &stream)
                .unwrap_err(),
            coll.tagged(0)
                .all_reduce_in_place::<f32>(&foreign, ReduceOp::Sum, &stream)
                .unwrap_err(),
        ] {
            assert!(matches!(err, Error::ForeignBuffer { .. }), "{err}");
        }
        // 6 bytes are not a whole number of f32s.
        let odd = pool.alloc(6, &stream).unwrap();
        let err = coll
            .tagged(0)
            .all_reduce_in_place::<f32>(&odd, ReduceOp::Max, &stream)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidCollective { .. }), "{err}");
        drop((foreign, odd));
        // Nothing moved: the pool and the handle still work.
        one_rank::<bf16>(pool, coll, 512, ReduceOp::Sum, true, 4);
    });
    // Closing is collective: every rank at once.
    thread::scope(|s| {
        for p in &others {
            s.spawn(move || p.close().unwrap());
        }
    });
}

#[test]
fn avg_needs_an_nccl_with_ncclavg() {
    let old = HostConfig::new(2).with_nccl_version(NcclVersion::new(2, 9, 9));
    let pools = pools_with(old, config());
    on_ranks(&pools, |pool, coll| {
        let stream = Stream::host();
        let buf = pool.alloc(64, &stream).unwrap();
        let err = coll
            .tagged(0)
            .all_reduce_in_place::<f32>(&buf, ReduceOp::Avg, &stream)
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidCollective { detail, .. } if detail.contains("ncclAvg")),
            "{err}"
        );
        // The other reductions run (on the plain kernel: no windows before 2.27).
        assert_eq!(
            one_rank::<f32>(pool, coll, 16, ReduceOp::Sum, false, 5),
            Path::PlainKernel
        );
    });
    // NCCL 2.30: the symmetric kernel averages too.
    let new = HostConfig::new(2).with_nccl_version(NcclVersion::new(2, 30, 0));
    let pools = pools_with(new, config());
    on_ranks(&pools, |pool, coll| {
        assert_eq!(
            one_rank::<bf16>(pool, coll, 100, ReduceOp::Avg, true, 6),
            Path::SymmetricKernel
        );
    });
}

#[test]
fn strict_checks_catch_a_different_reduction_size_or_collective() {
    let strict = || config().with_check(CheckMode::Strict);
    type Call = fn(&Coll, &symmpool::SymmBuffer, usize, &Stream) -> symmpool::Result<()>;
    let cases: [(&str, Call); 3] = [
        ("reduction", |coll, buf, rank, stream| {
            let op = if rank == 0 {
                ReduceOp::Sum
            } else {
                ReduceOp::Max
            };
            coll.tagged(0)
                .all_reduce_in_place::<f32>(buf, op, stream)
                .map(drop)
        }),
        ("collective", |coll, buf, rank, stream| {
            if rank == 0 {
                coll.tagged(0)
                    .all_reduce_in_place::<f32>(buf, ReduceOp::Sum, stream)
                    .map(drop)
            } else {
                coll.tagged(0)
                    .reduce_scatter_in_place::<f32>(buf, ReduceOp::Sum, stream)
                    .map(drop)
            }
        }),
        ("count", |coll, buf, rank, stream| {
            // Rank 1 reads the same bytes as bf16: twice the elements.
            if rank == 0 {
                coll.tagged(0)
                    .all_reduce_in_place::<f32>(buf, ReduceOp::Sum, stream)
                    .map(drop)
            } else {
                coll.tagged(0)
                    .all_reduce_in_place::<bf16>(buf, ReduceOp::Sum, stream)
                    .map(drop)
            }
        }),
    ];
    for (field, call) in cases {
        let pools = host_pools(2, strict());
        let errs = on_ranks(&pools, |pool, coll| {
            let stream = Stream::host();
            let buf = pool.alloc(1024, &stream).unwrap();
            buf.write(&[1.0f32; 256]).unwrap();
            let err = call(coll, &buf, pool.rank(), &stream).unwrap_err();
            // No data moved.
            assert_eq!(buf.read::<f32>().unwrap(), vec![1.0; 256]);
            err
        });
        for err in errs {
            match err {
                Error::CollectiveDivergence(d) => assert!(
                    d.field == field || (field == "count" && d.field == "element type"),
                    "{field}: {d}"
                ),
                other => panic!("{field}: {other}"),
            }
        }
    }
}

#[test]
fn async_checks_compare_all_reduce_records() {
    let pools = host_pools(2, config().with_check(CheckMode::Async));
    let verdicts = on_ranks(&pools, |pool, coll| {
        // Matching calls pass.
        one_rank::<f32>(pool, coll, 64, ReduceOp::Min, false, 11);
        coll.wait_checks().unwrap();
        // A different reduction on rank 1: found when the records are compared.
        let stream = Stream::host();
        let buf = pool.alloc(256, &stream).unwrap();
        let op = if pool.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Min
        };
        let _ = coll.tagged(0).all_reduce_in_place::<f32>(&buf, op, &stream);
        coll.wait_checks().unwrap_err()
    });
    for err in verdicts {
        assert!(
            matches!(&err, Error::CollectiveDivergence(d) if d.field == "reduction"),
            "{err}"
        );
    }
}

// ---- ranks as processes over shared memory ----

const ENTRY: &str = "child_process_entry";

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(()) => 0,
        Err(e) => {
            println!("@@error {e}");
            2
        }
    };
    std::process::exit(code);
}

/// A rank of the job: every case on the symmetric and the plain path, large buffers
/// moved through the control plane in pieces, a bad call, a strict check.
fn child() -> symmpool::Result<()> {
    let (_, _, backend) = common::shm::join()?;
    let group = GroupConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_check(CheckMode::Strict);
    let pool = SymmPool::new(&Group::new(backend, group)?, PoolConfig::default())?;
    let coll = Coll::new(&pool)?;
    let paths = every_case(&pool, &coll, 333, 1);
    println!("@@paths {:?}", &paths[..4]);
    // Over a megabyte per rank: the symmetric path reads the peers' windows; the plain
    // path moves it through the control plane in pieces.
    one_rank::<f32>(&pool, &coll, 300_001, ReduceOp::Sum, true, 2);
    coll.set_path_policy(PathPolicy::default().with_all_reduce(Choice::Prefer(Path::PlainKernel)));
    for in_place in [false, true] {
        one_rank::<f32>(&pool, &coll, 300_001, ReduceOp::Sum, in_place, 3);
    }
    let stream = Stream::host();
    let a = pool.alloc(64, &stream)?;
    let b = pool.alloc(32, &stream)?;
    match coll
        .tagged(0)
        .all_reduce::<u8>(&a, &b, ReduceOp::Sum, &stream)
    {
        Err(Error::InvalidCollective { .. }) => {}
        other => panic!("mismatched sizes: {other:?}"),
    }
    // A divergence under Strict: every rank reports it and no data moves.
    let op = if pool.rank() == 0 {
        ReduceOp::Sum
    } else {
        ReduceOp::Max
    };
    match coll.tagged(0).all_reduce_in_place::<u8>(&a, op, &stream) {
        Err(Error::CollectiveDivergence(d)) if d.field == "reduction" => {}
        other => panic!("divergence: {other:?}"),
    }
    drop((a, b));
    println!("@@done");
    Ok(())
}

#[test]
fn processes_match_the_reference_on_both_paths() {
    for world in [2, 3] {
        let mut job = Job::start(ENTRY, world, |_| {
            vec![("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string())]
        });
        let all: Vec<usize> = (0..world).collect();
        let codes = job.wait(&all, Duration::from_secs(240));
        if codes != vec![0; world] {
            // Whatever the ranks said (their errors, panics), then fail.
            let _ = job.expect(usize::MAX, "never", Duration::from_millis(500));
        }
        for r in all {
            let paths = job.expect(r, "@@paths ", Duration::from_secs(5));
            assert_eq!(
                paths,
                "[SymmetricKernel, SymmetricKernel, SymmetricKernel, PlainKernel]"
            );
            job.expect(r, "@@done", Duration::from_secs(5));
        }
    }
}
