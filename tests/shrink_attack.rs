//! A careless user of `SymmPool::shrink`: shrinks with no rank lost, twice, on some
//! ranks only, after the ranks diverged, with the old pool's buffers and handles used
//! after it; a second rank lost during the shrink of processes, the store's host lost,
//! and a raw client that sends the store's shrink protocol nonsense. Every attack ends
//! in a clear error or a consistent success, well within the pools' timeout.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};
use symmpool::{
    Coll, CollectiveCalls, Error, PoolConfig, ReduceOp, ShrinkReport, Stream, SymmBuffer, SymmPool,
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
