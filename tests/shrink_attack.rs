//! A careless user of `SymmPool::shrink`: shrinks with no rank lost, twice, on some
//! ranks only, after the ranks diverged, with the old pool's buffers and handles used
//! after it; a second rank lost during the shrink of processes, the store's host lost,
//! and a raw client that sends the store's shrink protocol nonsense. Every attack ends
//! in a clear error or a consistent success, well within the pools' timeout.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};
use symmpool::{
    Coll, CollectiveCalls, Error, PoolConfig, ReduceOp, Stream, SymmBuffer, SymmPool,
};

mod common;

/// The pools' timeout where every wait should succeed: no wait of a test comes near it.
const TIMEOUT: Duration = Duration::from_secs(30);

fn host_pools(world: usize, timeout: Duration) -> Vec<SymmPool> {
    SymmPool::host_group(world, PoolConfig::default().with_timeout(timeout)).unwrap()
}

/// Run `f(rank, pool)` on one thread per pool; the results in rank order.
fn on_ranks<R: Send>(
    pools: Vec<SymmPool>,
    f: impl Fn(usize, SymmPool) -> R + Sync,
) -> Vec<R> {
    thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (pools.into_iter().enumerate())
            .map(|(rank, p)| s.spawn(move || f(rank, p)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank's `rank + 1` summed over the pool's ranks, in a fresh buffer.
fn sum_of_ranks(pool: &SymmPool, coll: &Coll) -> symmpool::Result<f32> {
    let stream = Stream::host();
    let b = pool.alloc(1024, &stream)?;
    b.write(&vec![(pool.rank() + 1) as f32; 256])?;
    coll.all_reduce_in_place::<f32>(&b, ReduceOp::Sum, &stream)?;
    Ok(b.read::<f32>()?[0])
}

/// A survivor learns of the loss: the collective fails with `PeerLost` (or the pool
/// reports it broken by the loss).
fn learn_of_loss(pool: &SymmPool, coll: &Coll) {
    match sum_of_ranks(pool, coll) {
        Err(Error::PeerLost { .. } | Error::PoolBroken { .. }) => {}
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
        assert!(is_shrunk(coll.all_reduce_in_place::<f32>(
            &kept[0],
            ReduceOp::Sum,
            &stream
        )));
        let fresh = next.alloc(4096, &stream).unwrap();
        let foreign = coll.all_reduce_in_place::<f32>(&fresh, ReduceOp::Sum, &stream);
        assert!(matches!(foreign, Err(Error::ForeignBuffer { .. })), "{foreign:?}");
        let step = coll.end_step();
        assert!(step.is_err(), "{step:?}");
        // The new pool's handle with an old buffer on either side.
        let new_coll = Coll::new(&next).unwrap();
        let mixed = new_coll.all_reduce::<f32>(&fresh, &kept[1], ReduceOp::Sum, &stream);
        assert!(matches!(mixed, Err(Error::ForeignBuffer { .. })), "{mixed:?}");
        let mixed = new_coll.all_reduce::<f32>(&kept[1], &fresh, ReduceOp::Sum, &stream);
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
        assert!(matches!(refused, Err(Error::BuffersAlive { .. })), "{refused:?}");
        drop((kept, newer_coll));
        newer.close().unwrap();
        assert!(next.close().is_ok());
        (again.rank, sum)
    });
    assert_eq!(out, [(0, 6.0), (1, 6.0), (2, 6.0)]);
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

// ---------------------------------------------------------------------------------
// Processes on the shared-memory backend: a rank killed with `kill -9`, then a second
// one killed while the survivors agree or register their segments anew, or the
// store's host killed.

use common::procs::{CHILD, HEARTBEAT_TIMEOUT_MS, Job};
use common::watched::{Watch, Watched};
use std::sync::Arc;
use symmpool::{Deadline, Exchange};

const ENTRY: &str = "attack_child";
/// The processes' pool timeout: every answer comes well before it.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(60);

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
/// wait in a collective for the first victim (killed by the test), ask to shrink up
/// to three times, and say what each ask answered.
fn child() -> symmpool::Result<()> {
    let (rank, _, backend) = common::shm::join()?;
    let attack = std::env::var("ATTACK").unwrap();
    let stall = match attack.as_str() {
        "agreeing" => Some(Stall::Agreeing),
        "shrunk" => Some(Stall::Shrunk),
        "registering" => Some(Stall::Registering),
        _ => None,
    };
    let backend = match (rank, stall) {
        (2, Some(stall)) => backend.with_exchange(|x| Watched::with(x, stall))?,
        _ => backend,
    };
    let pool = SymmPool::new(backend, PoolConfig::default().with_timeout(PROCESS_TIMEOUT))?;
    let coll = Coll::new(&pool)?;
    let kept = pool.alloc(4096, &Stream::host())?;
    kept.write(&[rank as f32; 1024])?;
    sum_of_ranks(&pool, &coll)?;
    println!("@@ready");
    let lost = sum_of_ranks(&pool, &coll).map(|_| ());
    let lost_at = Instant::now();
    println!("@@lost {lost:?}");
    drop(coll);
    println!("@@asking");
    for _ in 0..3 {
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
            Err(e) => println!("@@answer Err {e:?} ms={}", lost_at.elapsed().as_millis()),
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
    let mut job = Job::start(ENTRY, world, |_| vec![("ATTACK", attack.to_string())]);
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
        job.children[second].kill().unwrap();
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
    assert_eq!(common::shm::shm_entries(), before, "nothing left in /dev/shm");
    answers
}

#[test]
fn a_second_process_killed_while_the_survivors_agree_fails_their_ask_and_they_ask_again() {
    for answers in job_of("agreeing", 3, Some(2)) {
        let (last, failed) = answers.split_last().expect("an answer");
        assert!(last.starts_with("Ok world=2 lost=[2, 3] sum=3"), "{answers:?}");
        for f in failed {
            assert!(f.starts_with("Err ShrinkFailed"), "{answers:?}");
            assert!(f.contains("job rank 2 was lost"), "{answers:?}");
        }
    }
}

#[test]
fn a_second_process_killed_right_after_the_group_shrank_fails_their_ask_and_they_ask_again() {
    for answers in job_of("shrunk", 3, Some(2)) {
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert!(answers[0].starts_with("Err PeerLost { rank: 2"), "{answers:?}");
        assert!(answers[1].starts_with("Ok world=2 lost=[2, 3] sum=3"), "{answers:?}");
    }
}

#[test]
fn a_second_process_killed_while_the_survivors_register_anew_fails_their_ask_and_they_ask_again()
{
    for answers in job_of("registering", 3, Some(2)) {
        // The new group lost its rank 2: said once, then the survivors of both go on.
        assert_eq!(answers.len(), 2, "{answers:?}");
        assert!(answers[0].starts_with("Err PeerLost { rank: 2"), "{answers:?}");
        assert!(answers[1].starts_with("Ok world=2 lost=[2, 3] sum=3"), "{answers:?}");
    }
}

#[test]
fn without_the_stores_host_every_survivor_fails_its_shrink_at_once() {
    for answers in job_of("host", 0, None) {
        assert_eq!(answers.len(), 3, "{answers:?}");
        for a in &answers {
            assert!(a.starts_with("Err ShrinkFailed"), "{answers:?}");
            assert!(a.contains("job rank 0, is gone"), "{answers:?}");
        }
        let ms: u64 = answers[0].rsplit("ms=").next().unwrap().parse().unwrap();
        assert!(ms < HEARTBEAT_TIMEOUT_MS, "{answers:?}");
    }
}
