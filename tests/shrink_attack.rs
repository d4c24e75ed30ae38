//! A careless user of `SymmPool::shrink`: shrinks with no rank lost, twice, on some
//! ranks only, after the ranks diverged, with the old pool's buffers and handles used
//! after it; a second rank lost during the shrink of processes, the store's host lost,
//! and a raw client that sends the store's shrink protocol nonsense. Every attack ends
//! in a clear error or a consistent success, well within the pools' timeout.

use std::sync::{Arc, Barrier, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Deadline, Error, ErrorKind, Exchange, Group, GroupConfig,
    HostBackend, HostConfig, PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool,
};

mod common;

use common::on_ranks;
use common::watched::{Watch, Watched};

/// The groups' timeout where every wait should succeed: no wait of a test comes near it.
const TIMEOUT: Duration = Duration::from_secs(30);

/// One default pool per rank of a new host world of `world` ranks, in groups with
/// `group`'s settings.
fn host_pools_of(world: usize, group: &GroupConfig) -> Vec<SymmPool> {
    let groups = Group::host(world, group).unwrap();
    SymmPool::world(&groups, &PoolConfig::default()).unwrap()
}

fn host_pools(world: usize, timeout: Duration) -> Vec<SymmPool> {
    host_pools_of(world, &GroupConfig::default().with_timeout(timeout))
}

/// `f` on every item's thread (an exchange, a rank); the results in order.
fn on_each<E: Sync, R: Send>(group: &[E], f: impl Fn(&E) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|x| s.spawn(|| f(x))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank's `rank + 1` summed over the pool's ranks, in a fresh buffer.
fn sum_of_ranks(pool: &SymmPool, coll: &Coll) -> symmpool::Result<f32> {
    let stream = Stream::host();
    let b = pool.alloc(1024, &stream)?;
    b.write(&vec![(pool.rank() + 1) as f32; 256])?;
    coll.tagged(0)
        .all_reduce_in_place::<f32>(&b, ReduceOp::Sum, &stream)?;
    Ok(b.read::<f32>()?[0])
}

/// A survivor learns of the loss: the collective fails with an error of kind
/// `PeerLost` (as the README's loop matches it).
fn learn_of_loss(pool: &SymmPool, coll: &Coll) {
    match sum_of_ranks(pool, coll) {
        Err(e) if e.kind() == ErrorKind::PeerLost => {}
        other => panic!("rank {}: {other:?}", pool.rank()),
    }
}

#[test]
fn a_shrink_with_no_rank_lost_gives_a_group_of_the_same_size() {
    let out = on_ranks(host_pools(3, TIMEOUT), |_, pool| {
        let coll = Coll::new(&pool).unwrap();
        assert_eq!(sum_of_ranks(&pool, &coll).unwrap(), 6.0);
        let (next, report) = pool.shrink().unwrap();
        assert!(report.lost_ranks.is_empty(), "{report:?}");
        let coll = Coll::new(&next).unwrap();
        let sum = sum_of_ranks(&next, &coll).unwrap();
        drop(coll);
        next.close().unwrap();
        (report.rank, report.world_size, sum)
    });
    assert_eq!(out, [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]);
}

#[test]
fn a_shrink_some_ranks_ask_for_times_out_and_the_pool_goes_on() {
    let timeout = Duration::from_millis(1500);
    let asked = Barrier::new(3);
    let started = Instant::now();
    let out = on_ranks(host_pools(3, timeout), |rank, pool| {
        let shrunk = match rank {
            2 => None,
            _ => Some(pool.shrink().map(|_| ())),
        };
        asked.wait();
        let coll = Coll::new(&pool).unwrap();
        let sum = sum_of_ranks(&pool, &coll);
        drop(coll);
        pool.close().unwrap();
        (shrunk, sum.unwrap())
    });
    for (rank, (shrunk, sum)) in out.into_iter().enumerate() {
        match (rank, shrunk) {
            (2, None) => {}
            // (A peer that gave up first is missing too by then.)
            (_, Some(Err(Error::Timeout { missing_ranks, .. }))) => {
                assert!(missing_ranks.contains(&2), "rank {rank}: {missing_ranks:?}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(sum, 6.0);
    }
    assert!(started.elapsed() < timeout * 4, "{:?}", started.elapsed());
}

/// `world` host ranks; rank `lost` drops its pool (its thread is lost to the others)
/// after `before(rank, pool)` ran on every rank; each survivor learns of the loss and
/// runs `after(rank, pool, coll)`. The survivors' results, in rank order.
fn with_a_loss<R: Send>(
    world: usize,
    lost: usize,
    before: impl Fn(usize, &SymmPool) -> Vec<SymmBuffer> + Sync,
    after: impl Fn(usize, SymmPool, Coll, Vec<SymmBuffer>) -> R + Sync,
) -> Vec<R> {
    let started = Instant::now();
    let out = on_ranks(host_pools(world, TIMEOUT), |rank, pool| {
        let kept = before(rank, &pool);
        if rank == lost {
            drop((kept, pool));
            return None;
        }
        let coll = Coll::new(&pool).unwrap();
        learn_of_loss(&pool, &coll);
        Some(after(rank, pool, coll, kept))
    });
    assert!(started.elapsed() < TIMEOUT / 2, "{:?}", started.elapsed());
    out.into_iter().flatten().collect()
}

/// Three buffers of 1024 `f32` on every rank, each filled with `10 * rank + i`.
fn three_buffers(rank: usize, pool: &SymmPool) -> Vec<SymmBuffer> {
    (0..3)
        .map(|i| {
            let b = pool.alloc(4096, &Stream::host()).unwrap();
            b.write(&[(10 * rank + i) as f32; 1024]).unwrap();
            b
        })
        .collect()
}

fn is_shrunk<T: std::fmt::Debug>(r: symmpool::Result<T>) -> bool {
    matches!(r, Err(Error::Shrunk { .. }))
}

#[test]
fn after_a_shrink_the_old_pool_and_handle_refuse_and_its_buffers_live_on() {
    let out = with_a_loss(4, 3, three_buffers, |rank, pool, coll, kept| {
        let stream = Stream::host();
        let (next, report) = pool.shrink().unwrap();
        assert_eq!(report.live_buffers, 3);
        // Twice on the old pool; its calls and handles.
        assert!(is_shrunk(pool.shrink()), "{:?}", pool.shrink().map(|_| ()));
        assert!(is_shrunk(pool.alloc(64, &stream)));
        assert!(is_shrunk(pool.trim()), "{:?}", pool.trim());
        assert!(pool.close().is_ok());
        let again = Coll::new(&pool).map(|_| ());
        assert!(matches!(again, Err(Error::Shrunk { .. })), "{again:?}");
        assert!(is_shrunk(Coll::with_pools(&[next.clone(), pool.clone()])));
        assert!(is_shrunk(coll.tagged(0).all_reduce_in_place::<f32>(
            &kept[0],
            ReduceOp::Sum,
            &stream
        )));
        let fresh = next.alloc(4096, &stream).unwrap();
        let foreign = coll
            .tagged(0)
            .all_reduce_in_place::<f32>(&fresh, ReduceOp::Sum, &stream);
        assert!(
            matches!(foreign, Err(Error::ForeignBuffer { .. })),
            "{foreign:?}"
        );
        let step = coll.end_step();
        assert!(step.is_err(), "{step:?}");
        // The new pool's handle with an old buffer on either side.
        let new_coll = Coll::new(&next).unwrap();
        let mixed = new_coll
            .tagged(0)
            .all_reduce::<f32>(&fresh, &kept[1], ReduceOp::Sum, &stream);
        assert!(
            matches!(mixed, Err(Error::ForeignBuffer { .. })),
            "{mixed:?}"
        );
        let mixed = new_coll
            .tagged(0)
            .all_reduce::<f32>(&kept[1], &fresh, ReduceOp::Sum, &stream);
        assert!(is_shrunk(mixed));
        // The old buffers: readable, writable, their data kept.
        assert_eq!(kept[0].read::<f32>().unwrap(), [(10 * rank) as f32; 1024]);
        kept[1].write(&[7.0f32; 1024]).unwrap();
        assert_eq!(kept[1].read::<f32>().unwrap(), [7.0; 1024]);
        drop(coll);
        // Shrink the new pool right away, with no further loss: the same survivors.
        let (newer, again) = next.shrink().unwrap();
        assert_eq!((again.world_size, again.live_buffers), (3, 4), "{again:?}");
        assert!(again.lost_ranks.is_empty());
        drop(new_coll);
        // Drops in any order: through the old pool and the one after it.
        let mut kept = kept.into_iter();
        drop(kept.next());
        drop(pool);
        drop(fresh);
        let newer_coll = Coll::new(&newer).unwrap();
        let sum = sum_of_ranks(&newer, &newer_coll).unwrap();
        // Closing with old buffers alive is refused; once they are gone it closes.
        let refused = newer.close();
        assert!(
            matches!(refused, Err(Error::BuffersAlive { .. })),
            "{refused:?}"
        );
        drop((kept, newer_coll));
        newer.close().unwrap();
        assert!(next.close().is_ok());
        (again.rank, sum)
    });
    assert_eq!(out, [(0, 6.0), (1, 6.0), (2, 6.0)]);
}

#[test]
fn after_a_loss_every_later_call_reports_it_with_the_kind_of_a_loss() {
    // A runtime sorts by kind: whichever call meets the loss first (here a collective,
    // under each check mode), the later ones (a collective, a growth, a step's end)
    // say `PeerLost` too, never a broken pool of another kind; and the shrink goes on.
    for mode in [CheckMode::Strict, CheckMode::Async, CheckMode::Off] {
        let config = GroupConfig::default()
            .with_timeout(TIMEOUT)
            .with_check(mode);
        let pools = host_pools_of(3, &config);
        let out = on_ranks(pools, |rank, pool| {
            let coll = Coll::new(&pool).unwrap();
            assert_eq!(sum_of_ranks(&pool, &coll).unwrap(), 6.0);
            if rank == 2 {
                drop((coll, pool));
                return None;
            }
            learn_of_loss(&pool, &coll);
            let kinds = [
                sum_of_ranks(&pool, &coll).map(drop),
                pool.alloc(64 << 20, &Stream::host()).map(drop),
                coll.end_step(),
            ]
            .map(|r| r.map_err(|e| (e.kind(), e.to_string())));
            drop(coll);
            let (next, report) = pool.shrink().unwrap();
            drop(pool);
            next.close().unwrap();
            Some((kinds, report.world_size))
        });
        for (kinds, world) in out.into_iter().flatten() {
            for (i, k) in kinds.iter().enumerate() {
                // (Unchecked, a step's end compares nothing.)
                let unchecked_end = mode == CheckMode::Off && i == 2;
                assert!(
                    matches!(k, Err((ErrorKind::PeerLost, _))) || (unchecked_end && k.is_ok()),
                    "{mode:?}: {kinds:?}"
                );
            }
            assert_eq!(world, 2);
        }
    }
}

#[test]
fn survivors_that_diverged_before_the_loss_all_get_a_divergence() {
    let extra = |rank: usize, pool: &SymmPool| {
        let mut kept = three_buffers(rank, pool);
        if rank == 1 {
            kept.push(pool.alloc(4096, &Stream::host()).unwrap());
        }
        kept
    };
    let out = with_a_loss(4, 3, extra, |_, pool, coll, kept| {
        drop(coll);
        let first = pool.shrink().map(|_| ());
        let second = pool.shrink().map(|_| ());
        drop(kept);
        (first, second)
    });
    for (first, second) in out {
        assert!(matches!(first, Err(Error::Divergence(_))), "{first:?}");
        assert!(matches!(second, Err(Error::Divergence(_))), "{second:?}");
    }
}

#[test]
fn ranks_whose_collectives_diverged_cannot_shrink_past_it() {
    let config = GroupConfig::default()
        .with_timeout(TIMEOUT)
        .with_check(CheckMode::Strict);
    let pools = host_pools_of(3, &config);
    let out = on_ranks(pools, |rank, pool| {
        let coll = Coll::new(&pool).unwrap();
        // Rank 1 takes the maximum where the others sum: a bug, not a loss.
        let b = pool.alloc(4096, &Stream::host()).unwrap();
        let op = if rank == 1 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        let reduced = coll
            .tagged(0)
            .all_reduce_in_place::<f32>(&b, op, &Stream::host());
        let shrunk = pool.shrink().map(|(_, report)| report);
        drop((coll, b));
        let closed = pool.close();
        (reduced, shrunk, closed)
    });
    for (reduced, shrunk, closed) in out {
        assert!(
            matches!(reduced, Err(Error::CollectiveDivergence(_))),
            "{reduced:?}"
        );
        assert!(
            matches!(shrunk, Err(Error::CollectiveDivergence(_))),
            "{shrunk:?}"
        );
        assert!(
            matches!(closed, Err(Error::PoolBroken { .. })),
            "{closed:?}"
        );
    }
}

#[test]
fn a_rank_lost_just_before_close_leaves_the_others_closed_alone() {
    let started = Instant::now();
    let out = on_ranks(host_pools(3, TIMEOUT), |rank, pool| {
        let coll = Coll::new(&pool).unwrap();
        assert_eq!(sum_of_ranks(&pool, &coll).unwrap(), 6.0);
        drop(coll);
        if rank == 2 {
            drop(pool);
            return None;
        }
        let first = pool.close();
        let second = pool.close();
        Some((first, second))
    });
    for (first, second) in out.into_iter().flatten() {
        assert!(matches!(first, Err(Error::PoolBroken { .. })), "{first:?}");
        assert!(second.is_ok(), "{second:?}");
    }
    assert!(started.elapsed() < TIMEOUT / 2, "{:?}", started.elapsed());
}

/// At a rank's ask to shrink (its old pool's state held by the shrink): let the
/// dropper go, and wait until it dropped every old buffer.
struct DropDuring {
    go: mpsc::Sender<()>,
    dropped: Mutex<mpsc::Receiver<()>>,
}

impl Watch for DropDuring {
    fn shrink(
        &self,
        inner: &dyn Exchange,
        deadline: Deadline,
    ) -> symmpool::Result<Arc<dyn Exchange>> {
        self.go.send(()).unwrap();
        self.dropped.lock().unwrap().recv_timeout(TIMEOUT).unwrap();
        inner.shrink(deadline)
    }
}

#[test]
fn old_buffers_dropped_on_another_thread_during_the_shrink_all_return_to_the_new_pool() {
    let backends = HostBackend::world(HostConfig::new(3)).unwrap();
    let out = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                s.spawn(move || {
                    let (go, go_rx) = mpsc::channel();
                    let (dropped_tx, dropped) = mpsc::channel();
                    let dropped = Mutex::new(dropped);
                    let b = b.with_exchange(|x| Watched::with(x, DropDuring { go, dropped }));
                    let config = GroupConfig::default().with_timeout(TIMEOUT);
                    let group = Group::new(b.unwrap(), config).unwrap();
                    let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
                    let kept: Vec<_> = (0..100)
                        .map(|_| pool.alloc(512, &Stream::host()).unwrap())
                        .collect();
                    if rank == 2 {
                        return None;
                    }
                    let coll = Coll::new(&pool).unwrap();
                    learn_of_loss(&pool, &coll);
                    drop(coll);
                    let (next, report) = thread::scope(|s| {
                        s.spawn(move || {
                            go_rx.recv().unwrap();
                            drop(kept);
                            dropped_tx.send(()).unwrap();
                        });
                        pool.shrink().unwrap()
                    });
                    drop(pool);
                    // The frees queued while the shrink held the old pool reach the new one.
                    Some((report.live_buffers, next.close().map_err(|e| e.to_string())))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(out, [Some((100, Ok(()))), Some((100, Ok(()))), None]);
}

#[test]
fn a_collective_waiting_on_another_thread_when_the_group_shrinks_ends_with_shrunk() {
    // On ranks 0 and 1 a helper thread enters a collective that rank 2 never joins,
    // while every rank's main thread shrinks the pool with no rank lost; rank 2 then
    // drops its old pool at once. The helpers' collective ends with `Shrunk` (the
    // group it waits in is over), not with `PeerLost` naming rank 2, which lives on
    // in the new group; and the new group's collectives run.
    for mode in [CheckMode::Strict, CheckMode::Async, CheckMode::Off] {
        let started = Instant::now();
        let config = GroupConfig::default()
            .with_timeout(TIMEOUT)
            .with_check(mode);
        let pools = host_pools_of(3, &config);
        let out = on_ranks(pools, |rank, pool| {
            let coll = Coll::new(&pool).unwrap();
            let buf = pool.alloc(1024, &Stream::host()).unwrap();
            let (entering, entered) = mpsc::channel();
            let (helper, next) = thread::scope(|s| {
                let helper = (rank != 2).then(|| {
                    s.spawn(|| {
                        entering.send(()).unwrap();
                        (coll.tagged(1))
                            .all_reduce_in_place::<f32>(&buf, ReduceOp::Sum, &Stream::host())
                            .map(drop)
                    })
                });
                if helper.is_some() {
                    entered.recv_timeout(TIMEOUT).unwrap();
                }
                let next = pool.shrink().unwrap().0;
                (helper.map(|h| h.join().unwrap()), next)
            });
            drop((coll, buf, pool));
            let coll = Coll::new(&next).unwrap();
            let sum = sum_of_ranks(&next, &coll).unwrap();
            drop(coll);
            next.close().unwrap();
            (helper, sum)
        });
        for (rank, (helper, sum)) in out.into_iter().enumerate() {
            match helper {
                None => assert_eq!(rank, 2),
                Some(Err(Error::Shrunk { .. })) => {}
                Some(other) => panic!("{mode:?}: rank {rank}'s helper: {other:?}"),
            }
            assert_eq!(sum, 6.0);
        }
        assert!(started.elapsed() < TIMEOUT / 2, "{:?}", started.elapsed());
    }
}

#[test]
fn the_last_survivor_shrinks_to_a_world_of_one() {
    let out = with_a_loss(
        2,
        1,
        |_, _| Vec::new(),
        |_, pool, coll, _| {
            drop(coll);
            let (next, report) = pool.shrink().unwrap();
            let sum = sum_of_ranks(&next, &Coll::new(&next).unwrap()).unwrap();
            next.close().unwrap();
            (report.world_size, report.lost_ranks, sum)
        },
    );
    assert_eq!(out, [(1, vec![1], 1.0)]);
}

#[test]
fn pools_shrunk_in_crossed_orders_fail_on_every_rank_then_go_on_in_one_order() {
    let backends = HostBackend::world(HostConfig::new(3)).unwrap();
    let out = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                s.spawn(move || {
                    // Both pools in the rank's one group (they share communicators).
                    let group =
                        Group::new(b, GroupConfig::default().with_timeout(TIMEOUT)).unwrap();
                    let config = |name: &str| PoolConfig::default().with_name(name);
                    let a = SymmPool::new(&group, config("a")).unwrap();
                    let z = SymmPool::new(&group, config("z")).unwrap();
                    if rank == 2 {
                        return None;
                    }
                    let coll = Coll::with_pools(&[a.clone(), z.clone()]).unwrap();
                    learn_of_loss(&a, &coll);
                    drop(coll);
                    let crossed = if rank == 0 { [&a, &z] } else { [&z, &a] };
                    for p in crossed {
                        let e = p.shrink().map(|_| ());
                        assert!(matches!(e, Err(Error::ChannelMismatch { .. })), "{e:?}");
                    }
                    let sizes: Vec<usize> = [&a, &z]
                        .iter()
                        .map(|p| p.shrink().unwrap().0.world_size())
                        .collect();
                    Some(sizes)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(out, [Some(vec![2, 2]), Some(vec![2, 2]), None]);
}

#[test]
fn pools_with_communicators_of_their_own_shrink_one_after_the_other() {
    let started = Instant::now();
    let backends = HostBackend::world(HostConfig::new(3)).unwrap();
    let out = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                s.spawn(move || {
                    // Each pool in a group of its own, split off the rank's.
                    let group =
                        Group::new(b, GroupConfig::default().with_timeout(TIMEOUT)).unwrap();
                    let own = |name: &str| {
                        let group = group.split(name).unwrap();
                        SymmPool::new(&group, PoolConfig::default().with_name(name)).unwrap()
                    };
                    let a = own("a");
                    let z = own("z");
                    if rank == 2 {
                        return None;
                    }
                    let colls = [Coll::new(&a).unwrap(), Coll::new(&z).unwrap()];
                    learn_of_loss(&a, &colls[0]);
                    learn_of_loss(&z, &colls[1]);
                    drop(colls);
                    let sums: Vec<f32> = [a, z]
                        .iter()
                        .map(|p| {
                            let (next, report) = p.shrink().unwrap();
                            assert_eq!(report.lost_ranks, [2]);
                            let sum = sum_of_ranks(&next, &Coll::new(&next).unwrap()).unwrap();
                            next.close().unwrap();
                            sum
                        })
                        .collect();
                    Some(sums)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(out, [Some(vec![3.0, 3.0]), Some(vec![3.0, 3.0]), None]);
    assert!(started.elapsed() < TIMEOUT / 2);
}

// ---------------------------------------------------------------------------------
// Processes on the shared-memory backend: a rank killed with `kill -9`, then a second
// one killed while the survivors agree or register their segments anew, or the
// store's host killed.

use common::procs::{CHILD, HEARTBEAT_TIMEOUT_MS, Job};

const ENTRY: &str = "attack_child";
/// The processes' group timeout: every answer comes well before it.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);
/// The groups' timeout of the `frozen` attack, whose survivors wait for it.
const FROZEN_TIMEOUT: Duration = Duration::from_secs(3);

/// Where the second victim stops for good (the test kills it there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stall {
    /// In its ask to shrink, before it asks.
    Agreeing,
    /// Right after the group shrank, before the backend's new communicators.
    Shrunk,
    /// In the first round of the new group that agrees on a window registration.
    Registering,
}

fn stall_here() -> ! {
    println!("@@stalled");
    loop {
        thread::park();
    }
}

impl Watch for Stall {
    fn shrink(
        &self,
        inner: &dyn Exchange,
        deadline: Deadline,
    ) -> symmpool::Result<Arc<dyn Exchange>> {
        if *self == Stall::Agreeing {
            stall_here();
        }
        let next = inner.shrink(deadline)?;
        if *self == Stall::Shrunk {
            stall_here();
        }
        Ok(Watched::wrap(next, |op| {
            if op == "window registration order" {
                stall_here();
            }
        }))
    }
}

#[test]
fn attack_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(()) => 0,
        Err(e) => {
            println!("@@error {e:?}");
            2
        }
    };
    std::process::exit(code);
}

/// A rank of a job of `ATTACK` (`agreeing`, `shrunk`, `registering`: rank 2 stalls there after
/// the first loss; `host`: the first victim is rank 0): set up, say `@@ready`, then
/// (the first victim, `VICTIM`, stalls) wait in a collective for the first victim
/// (killed by the test), ask to shrink up to three times, and say what each ask answered.
fn child() -> symmpool::Result<()> {
    let (rank, _, backend) = common::shm::join()?;
    let attack = std::env::var("ATTACK").unwrap();
    let stall = match attack.as_str() {
        "agreeing" | "frozen" => Some(Stall::Agreeing),
        "shrunk" => Some(Stall::Shrunk),
        "registering" => Some(Stall::Registering),
        _ => None,
    };
    let backend = match (rank, stall) {
        (2, Some(stall)) => backend.with_exchange(|x| Watched::with(x, stall))?,
        _ => backend,
    };
    let timeout = match attack.as_str() {
        "frozen" => FROZEN_TIMEOUT,
        _ => PROCESS_TIMEOUT,
    };
    let group = Group::new(backend, GroupConfig::default().with_timeout(timeout))?;
    let pool = SymmPool::new(&group, PoolConfig::default())?;
    let coll = Coll::new(&pool)?;
    let kept = pool.alloc(4096, &Stream::host())?;
    kept.write(&[rank as f32; 1024])?;
    sum_of_ranks(&pool, &coll)?;
    println!("@@ready");
    if std::env::var("VICTIM").is_ok_and(|v| v == rank.to_string()) {
        // The first victim takes no part in the collective the others then wait in:
        // it is killed while they wait, never after the collective completed.
        stall_here();
    }
    let lost = sum_of_ranks(&pool, &coll).map(|_| ());
    let lost_at = Instant::now();
    println!("@@lost {lost:?}");
    drop(coll);
    println!("@@asking");
    for _ in 0..3 {
        let asked = Instant::now();
        match pool.shrink() {
            Ok((next, report)) => {
                let coll = Coll::new(&next)?;
                let sum = sum_of_ranks(&next, &coll)?;
                println!(
                    "@@answer Ok world={} lost={:?} sum={sum}",
                    report.world_size, report.lost_ranks
                );
                assert_eq!(kept.read::<f32>()?, [rank as f32; 1024]);
                drop((coll, kept));
                next.close()?;
                break;
            }
            Err(e) => println!(
                "@@answer Err {e:?} took={} ms={}",
                asked.elapsed().as_millis(),
                lost_at.elapsed().as_millis()
            ),
        }
    }
    Ok(())
}

/// A 4-rank job of `attack`: the test kills `first` once every rank is ready, then
/// (where `second`) that rank once it stalled and the others ask; every other rank's
/// answers, in order, each job rank's after it exited.
fn job_of(attack: &str, first: usize, second: Option<usize>) -> Vec<Vec<String>> {
    let before = common::shm::shm_entries();
    let world = 4;
    let env = |_| {
        vec![
            ("ATTACK", attack.to_string()),
            ("VICTIM", first.to_string()),
        ]
    };
    let mut job = Job::start(ENTRY, world, env);
    for r in 0..world {
        job.expect(r, "@@ready", Duration::from_secs(60));
    }
    job.children[first].kill().unwrap();
    let killed_at = Instant::now();
    let survivors: Vec<usize> = (0..world)
        .filter(|r| *r != first && Some(*r) != second)
        .collect();
    if let Some(second) = second {
        job.expect(second, "@@stalled", Duration::from_secs(60));
        for &r in &survivors {
            job.expect(r, "@@asking", Duration::from_secs(60));
        }
        // A frozen rank stays, alive to the store (its heartbeats go on), until the
        // job ends.
        if attack != "frozen" {
            job.children[second].kill().unwrap();
        }
    }
    let codes = job.wait(&survivors, PROCESS_TIMEOUT / 2);
    assert_eq!(codes, vec![0; survivors.len()], "{:?}", job.seen);
    assert!(killed_at.elapsed() < PROCESS_TIMEOUT / 2);
    let answers = survivors
        .iter()
        .map(|&r| {
            (job.seen.iter())
                .filter(|(at, l)| *at == r && l.starts_with("@@answer "))
                .map(|(_, l)| l["@@answer ".len()..].to_string())
                .collect()
        })
        .collect();
    drop(job);
    assert_eq!(
        common::shm::shm_entries(),
        before,
        "nothing left in /dev/shm"
    );
    answers
}

#[test]
fn a_second_process_killed_while_the_survivors_agree_fails_their_ask_and_they_ask_again() {
    for answers in job_of("agreeing", 3, Some(2)) {
        let (last, failed) = answers.split_last().expect("an answer");
        assert!(
            last.starts_with("Ok world=2 lost=[2, 3] sum=3"),
            "{answers:?}"
        );
        for f in failed {
            assert!(f.starts_with("Err ShrinkFailed"), "{answers:?}");
            assert!(f.contains("job rank 2 was lost"), "{answers:?}");
            assert!(f.contains("retry: true"), "{answers:?}");
        }
    }
}

#[test]
fn a_second_process_killed_right_after_the_group_shrank_fails_their_ask_and_they_ask_again() {
    for answers in job_of("shrunk", 3, Some(2)) {
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert!(
            answers[0].starts_with("Err PeerLost { rank: 2"),
            "{answers:?}"
        );
        assert!(
            answers[1].starts_with("Ok world=2 lost=[2, 3] sum=3"),
            "{answers:?}"
        );
    }
}

#[test]
fn a_second_process_killed_while_the_survivors_register_anew_fails_their_ask_and_they_ask_again() {
    for answers in job_of("registering", 3, Some(2)) {
        // The new group lost its rank 2: said once, then the survivors of both go on.
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert!(
            answers[0].starts_with("Err PeerLost { rank: 2"),
            "{answers:?}"
        );
        assert!(
            answers[1].starts_with("Ok world=2 lost=[2, 3] sum=3"),
            "{answers:?}"
        );
    }
}

#[test]
fn a_second_rank_frozen_inside_the_shrink_ends_every_ask_by_the_timeout() {
    let bound = (FROZEN_TIMEOUT + Duration::from_secs(1)).as_millis();
    for answers in job_of("frozen", 3, Some(2)) {
        assert_eq!(answers.len(), 3, "{answers:?}");
        for a in &answers {
            assert!(a.starts_with("Err "), "{answers:?}");
            let took: u128 = a
                .split("took=")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(took <= bound, "an ask took {took} ms: {answers:?}");
        }
        // The frozen rank is named among those the survivors waited for.
        assert!(
            answers[0].contains(", 2]") || answers[0].contains("[2]"),
            "{answers:?}"
        );
    }
}

#[test]
fn without_the_stores_host_every_survivor_fails_its_shrink_at_once() {
    for answers in job_of("host", 0, None) {
        assert_eq!(answers.len(), 3, "{answers:?}");
        for a in &answers {
            assert!(a.starts_with("Err ShrinkFailed"), "{answers:?}");
            assert!(a.contains("the store is gone"), "{answers:?}");
            assert!(a.contains("retry: false"), "{answers:?}");
        }
        let ms: u64 = answers[0].rsplit("ms=").next().unwrap().parse().unwrap();
        assert!(ms < HEARTBEAT_TIMEOUT_MS, "{answers:?}");
    }
}

// ---------------------------------------------------------------------------------
// A raw client as one rank of the store's group: stale and future epochs, a vote
// before the others ask, and a frame that is not one.

use std::io::{Read, Write};
use std::net::TcpStream;
use symmpool::control::{Launch, StoreConfig, StoreExchange, StoreServer};

/// The client's messages, in the store's order (variant index, then fields, postcard).
#[derive(serde::Serialize)]
#[allow(dead_code)]
enum ToServer {
    Hello {
        #[serde(with = "serde_bytes")]
        token: Vec<u8>,
        job: String,
        rank: u32,
        world_size: u32,
        host: String,
        pid: u32,
        joining: bool,
    },
    Contribute {
        epoch: u64,
        channel: u64,
        round: u64,
        op: String,
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
    Abandon {
        epoch: u64,
        channel: u64,
        round: u64,
        op: String,
    },
    Heartbeat,
    Bye,
    Shrink {
        epoch: u64,
    },
    Withdraw {
        epoch: u64,
    },
}

/// The server's message indices a raw client reads here.
const WELCOME: u8 = 0;
const SHRUNK: u8 = 8;
const SHRINK_FAILED: u8 = 9;

fn store_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = StoreConfig::new(Launch::explicit(rank, world, "127.0.0.1", port).unwrap());
    c.host_server = false;
    c.token = Some("attack".into());
    c.startup_timeout = TIMEOUT;
    c.heartbeat_interval = Duration::from_millis(200);
    // The raw client sends no heartbeat: it stays a member for the whole test.
    c.heartbeat_timeout = TIMEOUT;
    c.linger = Duration::from_millis(200);
    c
}

struct Raw(TcpStream);

impl Raw {
    fn send_bytes(&mut self, body: &[u8]) {
        let mut frame = (body.len() as u32).to_le_bytes().to_vec();
        frame.extend(body);
        self.0.write_all(&frame).unwrap();
    }

    fn send(&mut self, msg: &ToServer) {
        self.send_bytes(&postcard::to_allocvec(msg).unwrap());
    }

    /// The body of the next frame of message `index` (others skipped), within the
    /// socket's read timeout.
    fn expect(&mut self, index: u8) -> Vec<u8> {
        loop {
            let mut len = [0u8; 4];
            self.0.read_exact(&mut len).unwrap();
            let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
            self.0.read_exact(&mut body).unwrap();
            if body[0] == index {
                return body[1..].to_vec();
            }
        }
    }

    fn refused_because(&mut self) -> String {
        postcard::from_bytes(&self.expect(SHRINK_FAILED)).unwrap()
    }

    /// Join as `rank` of `world`: the preface and hello, then the welcome.
    fn join(port: u16, rank: u32, world_size: u32) -> Raw {
        let mut raw = Raw(TcpStream::connect(("127.0.0.1", port)).unwrap());
        raw.0.set_read_timeout(Some(TIMEOUT)).unwrap();
        let mut preface = b"SYMMPOOL".to_vec();
        preface.extend(9u16.to_le_bytes());
        preface.extend([0, 0]);
        raw.0.write_all(&preface).unwrap();
        raw.send(&ToServer::Hello {
            token: b"attack".to_vec(),
            job: String::new(),
            rank,
            world_size,
            host: "raw".into(),
            pid: 1,
            joining: false,
        });
        let mut theirs = [0u8; 12];
        raw.0.read_exact(&mut theirs).unwrap();
        assert_eq!(theirs, preface.as_slice());
        raw.expect(WELCOME);
        raw
    }
}

#[test]
fn a_raw_client_sending_stale_epochs_and_garbage_gets_clear_answers_and_the_others_go_on() {
    let world = 3;
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    thread::scope(|s| {
        let host = s.spawn(|| StoreExchange::connect_hosting(store_config(0, world, port), server));
        let one = s.spawn(|| StoreExchange::connect(store_config(1, world, port)));
        let mut raw = Raw::join(port, 2, world as u32);
        let group = [host.join().unwrap().unwrap(), one.join().unwrap().unwrap()];
        // An epoch that has not come: refused, to this rank alone.
        raw.send(&ToServer::Shrink { epoch: 5 });
        let why = raw.refused_because();
        assert!(why.contains("epoch 5") && why.contains("epoch 0"), "{why}");
        // A vote before the others ask counts: the group of three shrinks to itself.
        raw.send(&ToServer::Shrink { epoch: 0 });
        let next = on_each(&group, |x| x.shrink(Deadline::after(TIMEOUT)).unwrap());
        let (epoch, survivors): (u64, Vec<u32>) =
            postcard::from_bytes(&raw.expect(SHRUNK)).unwrap();
        assert_eq!((epoch, survivors), (1, vec![0, 1, 2]));
        assert!(next.iter().all(|x| x.world_size() == 3));
        // An epoch that is over: refused.
        raw.send(&ToServer::Shrink { epoch: 0 });
        let why = raw.refused_because();
        assert!(why.contains("epoch 0") && why.contains("epoch 1"), "{why}");
        // A round of the group that shrank, given up or contributed to late: ignored;
        // the new group's first round has the raw rank's own payload.
        let (channel, round, op) = (0, 1, "a round".to_string());
        raw.send(&ToServer::Abandon {
            epoch: 0,
            channel,
            round,
            op: op.clone(),
        });
        for (epoch, payload) in [(0, 9), (1, 2)] {
            let op = op.clone();
            let payload = vec![payload];
            raw.send(&ToServer::Contribute {
                epoch,
                channel,
                round,
                op,
                payload,
            });
        }
        for r in on_each(&next[..], |x| {
            common::round::round(x.as_ref(), x.rank() as u8)
        }) {
            assert_eq!(r.unwrap(), [[0], [1], [2]]);
        }
        // A frame that is no message: the raw rank is lost, and the others go on.
        raw.send_bytes(&[200, 1, 2, 3]);
        for l in on_each(&next[..], |x| common::round::round(x.as_ref(), 1)) {
            assert!(matches!(l, Err(Error::PeerLost { rank: 2, .. })), "{l:?}");
        }
        let deadline = Deadline::after(TIMEOUT);
        // Asked before the store saw the departure, a shrink fails with it: ask again.
        let last = on_each(&next[..], |x| {
            loop {
                match x.shrink(deadline) {
                    Err(Error::ShrinkFailed {
                        reason,
                        retry: true,
                    }) if reason.contains("job rank 1") => {}
                    other => break other.unwrap(),
                }
            }
        });
        for r in on_each(&last[..], |x| {
            common::round::round(x.as_ref(), x.rank() as u8)
        }) {
            assert_eq!(r.unwrap(), [[0], [1]]);
        }
        drop((last, next, group));
    });
}

#[test]
fn an_ask_to_shrink_that_timed_out_is_withdrawn_from_the_store() {
    let world = 4;
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    let server = Mutex::new(Some(server));
    let mut group = on_each(&[0, 1, 2, 3], |&rank| {
        let config = store_config(rank, world, port);
        match rank {
            0 => StoreExchange::connect_hosting(config, server.lock().unwrap().take().unwrap()),
            _ => StoreExchange::connect(config),
        }
        .unwrap()
    });
    let briefly = || Deadline::after(Duration::from_millis(300));
    let missing = |r: symmpool::Result<Arc<StoreExchange>>| match r {
        Err(Error::Timeout { missing_ranks, .. }) => missing_ranks,
        other => panic!("{other:?}"),
    };
    // The store names the ranks that had not asked.
    assert_eq!(missing(group[1].shrink(briefly())), [0, 2, 3]);
    // Rank 1 gave up: the others' asks do not count it as asking.
    let others = on_each(&group[..], |x| (x.rank() != 1).then(|| x.shrink(briefly())));
    for (rank, o) in others.into_iter().enumerate() {
        let Some(o) = o else { continue };
        // The first to withdraw may still see the others asking.
        let m = missing(o);
        assert!(m.contains(&1) && !m.contains(&rank), "rank {rank}: {m:?}");
    }
    // The group of epoch 0 is as it was.
    for r in on_each(&group[..], |x| common::round::round(x, 1)) {
        assert_eq!(r.unwrap(), [[1]; 4]);
    }
    // All four ask: the group of four goes on.
    let mut next = on_each(&group[..], |x| x.shrink(Deadline::after(TIMEOUT)).unwrap());
    for r in on_each(&next[..], |x| {
        common::round::round(x.as_ref(), x.rank() as u8)
    }) {
        assert_eq!(r.unwrap(), [[0], [1], [2], [3]]);
    }
    // Job rank 1 leaves; the group of job ranks 0, 2 and 3 names its ranks by place.
    drop((group.remove(1), next.remove(1)));
    let deadline = Deadline::after(TIMEOUT);
    // Asked before the store saw the departure, a shrink fails with it: ask again.
    let last = on_each(&next[..], |x| {
        loop {
            match x.shrink(deadline) {
                Err(Error::ShrinkFailed {
                    reason,
                    retry: true,
                }) if reason.contains("job rank 1") => {}
                other => break other.unwrap(),
            }
        }
    });
    assert_eq!(missing(last[2].shrink(briefly())), [0, 1]);
}

#[test]
fn a_round_under_which_the_group_shrinks_ends_with_shrunk_at_once() {
    let world = 2;
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    let server = Mutex::new(Some(server));
    let group = on_each(&[0, 1], |&rank| {
        let config = store_config(rank, world, port);
        match rank {
            0 => StoreExchange::connect_hosting(config, server.lock().unwrap().take().unwrap()),
            _ => StoreExchange::connect(config),
        }
        .unwrap()
    });
    let started = Instant::now();
    // On rank 1, one thread waits in a round that rank 0 never joins while another
    // asks to shrink (as two pools of one rank may); rank 0 asks too.
    let (waited, next) = thread::scope(|s| {
        let waiting = s.spawn(|| common::round::round(&group[1], 7));
        let next = on_each(&group[..], |x| x.shrink(Deadline::after(TIMEOUT)).unwrap());
        (waiting.join().unwrap(), next)
    });
    assert!(matches!(waited, Err(Error::Shrunk { .. })), "{waited:?}");
    assert!(started.elapsed() < TIMEOUT / 2, "{:?}", started.elapsed());
    for r in on_each(&next[..], |x| {
        common::round::round(x.as_ref(), x.rank() as u8)
    }) {
        assert_eq!(r.unwrap(), [[0], [1]]);
    }
}
