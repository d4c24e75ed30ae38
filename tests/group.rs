//! The communicator set as a value (`Group`): it owns the ledger, so a broken group
//! is dropped and made anew; each group's pools wait by its own timeout; the ranks
//! agree on its check mode; a pool registers no window while a stream it knows
//! captures a CUDA graph, in a growth or a shrink; one collectives handle per group.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Error, Group, GroupConfig, HostBackend, HostConfig,
    PoolConfig, Result, Stream, SymmPool,
};

mod common;

use common::on_ranks;

fn strict() -> GroupConfig {
    GroupConfig::default()
        .with_check(CheckMode::Strict)
        .with_timeout(Duration::from_secs(20))
}

/// One all-reduce of `tag` of this rank's number: the sum of the ranks' numbers.
fn sum(pool: &SymmPool, coll: &Coll, tag: u64) -> Result<f32> {
    let stream = Stream::host();
    let buf = pool.alloc(4 * 256, &stream)?;
    buf.write(&[pool.rank() as f32; 256])?;
    coll.tagged(tag)
        .all_reduce_in_place::<f32>(&buf, symmpool::ReduceOp::Sum, &stream)?;
    Ok(buf.read::<f32>()?[0])
}

/// A pool of `group` and its handle, after the ranks made different collectives (tag
/// 1 on rank 0, 2 on rank 1): the group is broken.
fn diverged(rank: usize, group: &Group) -> (SymmPool, Coll) {
    let pool = SymmPool::new(group, PoolConfig::default()).unwrap();
    let coll = Coll::new(&pool).unwrap();
    let diverged = sum(&pool, &coll, 1 + rank as u64);
    assert!(
        matches!(diverged, Err(Error::CollectiveDivergence(_))),
        "rank {rank}: {diverged:?}"
    );
    (pool, coll)
}

#[test]
fn a_group_broken_by_a_divergence_is_made_anew_and_its_pools_work() {
    let groups = Group::host(2, &strict()).unwrap();
    let rebuilt = on_ranks(groups, |rank, group| {
        let (pool, coll) = diverged(rank, &group);
        // Every later call of the group's pools says it is broken...
        assert!(pool.alloc(1 << 20, &Stream::host()).is_err());
        // ...and so does a new pool in it: the verdict is the group's.
        let late = SymmPool::new(&group, PoolConfig::default().with_name("late")).unwrap();
        assert!(late.alloc(64 << 20, &Stream::host()).is_err());
        // What the error says: drop the group and make a new one.
        let backend = group.backend().split("again").unwrap();
        drop((coll, pool, late, group));
        let group = Group::new(backend, strict()).unwrap();
        let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
        let coll = Coll::new(&pool).unwrap();
        let total = sum(&pool, &coll, 7).unwrap();
        drop(coll);
        pool.close().unwrap();
        total
    });
    assert_eq!(rebuilt, vec![1.0, 1.0]);
}

#[test]
fn a_group_on_the_same_backend_after_a_divergence_starts_unbroken() {
    let groups = Group::host(2, &strict()).unwrap();
    let fresh = on_ranks(groups, |rank, group| {
        let (pool, coll) = diverged(rank, &group);
        let backend = group.backend().clone();
        drop((coll, pool, group));
        // Pool calls of a new group on the same backend (no collective: the backend's
        // communicators were abandoned with the broken group's collectives).
        let group = Group::new(backend, strict()).unwrap();
        let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
        let buf = pool.alloc(4 << 20, &Stream::host()).unwrap();
        let offset = buf.offset_bytes();
        drop(buf);
        pool.trim().unwrap();
        pool.close().unwrap();
        offset
    });
    assert_eq!(fresh, vec![0, 0]);
}

#[test]
fn each_group_waits_by_its_own_timeout() {
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    let quick = GroupConfig::default().with_timeout(Duration::from_millis(300));
    // Rank 1 stays (its exchange open) until rank 0's wait is over.
    let done = std::sync::Barrier::new(2);
    let waited = on_ranks(backends, |rank, backend| {
        // A patient group first, then a quick one beside it.
        let patient = GroupConfig::default().with_timeout(Duration::from_secs(600));
        let slow = Group::new(backend, patient).unwrap();
        let fast = Group::new(slow.backend().split("fast").unwrap(), quick.clone()).unwrap();
        let _slow_pool = SymmPool::new(&slow, PoolConfig::default().with_name("slow")).unwrap();
        let pool = SymmPool::new(&fast, PoolConfig::default().with_name("fast")).unwrap();
        assert_eq!(pool.group().config().timeout, Duration::from_millis(300));
        // Rank 0 grows the quick group's pool alone: it waits by that group's timeout.
        let started = Instant::now();
        if rank == 0 {
            let alone = pool.alloc(64 << 20, &Stream::host());
            assert!(matches!(alone, Err(Error::Timeout { .. })), "{alone:?}");
        }
        let took = started.elapsed();
        done.wait();
        took
    });
    assert!(waited[0] < Duration::from_secs(10), "{waited:?}");
}

#[test]
fn one_live_group_per_communicator_set() {
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    on_ranks(backends, |_, backend| {
        let group = Group::new(backend.clone(), GroupConfig::default()).unwrap();
        // A second group over the same communicators would pair its pools' windows
        // and collectives with the first's unseen: refused, at once, on each rank.
        let second = Group::new(backend.clone(), GroupConfig::default());
        let Err(Error::Config { expected, .. }) = &second else {
            panic!("{second:?}");
        };
        assert!(expected.contains("Group::split"), "{expected}");
        // Once the first is gone, the communicators take a new group.
        drop(group);
        Group::new(backend, GroupConfig::default()).unwrap();
    });
}

#[test]
fn ranks_that_set_different_check_modes_fail_when_they_make_the_group() {
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    let made = on_ranks(backends, |rank, backend| {
        let mode = [CheckMode::Strict, CheckMode::Async][rank];
        let config = GroupConfig::default()
            .with_check(mode)
            .with_timeout(Duration::from_secs(20));
        Group::new(backend, config).map(|_| ())
    });
    for (rank, m) in made.iter().enumerate() {
        let Err(Error::ChannelMismatch { .. }) = m else {
            panic!("rank {rank}: {m:?}");
        };
        let text = m.as_ref().unwrap_err().to_string();
        assert!(text.contains("strict") && text.contains("async"), "{text}");
    }
}

#[test]
fn a_handle_takes_the_pools_of_one_group_only() {
    let groups = Group::host(2, &GroupConfig::default()).unwrap();
    on_ranks(groups, |_, group| {
        let own = group.split("own").unwrap();
        let a = SymmPool::new(&group, PoolConfig::default().with_name("a")).unwrap();
        let b = SymmPool::new(&group, PoolConfig::default().with_name("b")).unwrap();
        let c = SymmPool::new(&own, PoolConfig::default().with_name("c")).unwrap();
        let both = Coll::with_pools(&[a.clone(), b.clone()]).unwrap();
        // A second handle on the group is refused; one on the split group is not.
        let second = Coll::new(&a);
        assert!(
            matches!(second, Err(Error::InvalidCollective { .. })),
            "{second:?}"
        );
        let across = Coll::with_pools(&[a.clone(), c.clone()]);
        assert!(
            matches!(across, Err(Error::InvalidCollective { .. })),
            "{across:?}"
        );
        let of_c = Coll::new(&c).unwrap();
        drop((both, of_c));
        for p in [a, b, c] {
            p.close().unwrap();
        }
    });
}

/// Two host ranks whose streams report capture as the cell says.
fn capturing_groups() -> (Arc<AtomicU64>, Vec<Group>) {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(20));
    common::capture::capturing_groups(2, &config)
}

#[test]
fn no_growth_registers_while_another_stream_the_pool_knows_captures() {
    let (capturing, groups) = capturing_groups();
    let capturing = &capturing;
    on_ranks(groups, |rank, group| {
        let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
        let (graph, other) = (pool.new_stream().unwrap(), pool.new_stream().unwrap());
        drop(pool.alloc(1 << 20, &graph).unwrap());
        // Rank 1's graph stream captures; both ranks grow on their other stream.
        if rank == 1 {
            capturing.store(graph.id().0, Ordering::SeqCst);
        }
        let grown = pool.alloc(256 << 20, &other);
        assert!(
            matches!(grown, Err(Error::GraphCapture)),
            "rank {rank}: {grown:?}"
        );
        let grown = pool.memory_stats()["num_device_alloc"].as_u64();
        assert_eq!(
            grown,
            Some(1),
            "rank {rank}: nothing was allocated or registered"
        );
    });
}

#[test]
fn no_shrink_registers_while_a_stream_the_pool_knows_captures_and_it_goes_on_after() {
    let (capturing, groups) = capturing_groups();
    let capturing = &capturing;
    on_ranks(groups, |rank, group| {
        let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
        let graph = pool.new_stream().unwrap();
        drop(pool.alloc(1 << 20, &graph).unwrap());
        if rank == 0 {
            capturing.store(graph.id().0, Ordering::SeqCst);
        }
        // No rank is lost: every rank asks, and the group shrinks to the same size.
        let refused = pool.shrink().map(|_| ());
        assert!(
            matches!(refused, Err(Error::GraphCapture)),
            "rank {rank}: {refused:?}"
        );
        // Rank 0's refusal came after every rank's readiness was sent.
        capturing.store(0, Ordering::SeqCst);
        let (next, report) = pool.shrink().unwrap();
        assert_eq!((report.world_size, report.segments), (2, 1));
        next.close().unwrap();
    });
}
