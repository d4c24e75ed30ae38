//! Pools per thread on ranks as threads (host backend): a parameter pool and a
//! gradient pool on one backend, each with communicators of its own
//! (a group of its own, [`Group::split`]), used from two threads per rank (FSDP's
//! all-gather stream and reduce-scatter stream), alternating allocations that grow the
//! pools and collectives, in interleavings that differ between ranks.

mod common;

use std::thread;
use std::time::Duration;
use symmpool::{CheckMode, Error, Group, GroupConfig, PoolConfig, SymmPool};

const TIMEOUT: Duration = Duration::from_secs(20);
const ITERATIONS: usize = 20;

/// Per rank (a thread each): a parameter pool and a gradient pool, made in that order
/// (creation is collective), in groups made with `config`: each in a group of its own
/// split off the rank's group ([`Group::split`]) if `own`, else both in the rank's group.
fn pools_per_rank(world: usize, config: &GroupConfig, own: bool) -> Vec<(SymmPool, SymmPool)> {
    let groups = Group::host(world, config).unwrap();
    thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .map(|g| {
                s.spawn(move || {
                    let (gp, gg) = match own {
                        true => (g.split("params").unwrap(), g.split("grads").unwrap()),
                        false => (g.clone(), g),
                    };
                    let config = PoolConfig::default();
                    let params = SymmPool::new(&gp, config.clone().with_name("params"));
                    let grads = SymmPool::new(&gg, config.with_name("grads"));
                    (params.unwrap(), grads.unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn two_pools_with_their_own_communicators_on_two_threads_per_rank_stay_correct() {
    for (world, mode) in [
        (2, CheckMode::Async),
        (2, CheckMode::Strict),
        (3, CheckMode::Async),
    ] {
        let config = GroupConfig::default()
            .with_timeout(TIMEOUT)
            .with_check(mode);
        let per_rank = pools_per_rank(world, &config, true);
        let outcomes = thread::scope(|s| {
            let hs: Vec<_> = per_rank
                .iter()
                .map(|(p, g)| {
                    s.spawn(move || common::two_pools::params_and_grads(p, g, ITERATIONS))
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (rank, outcome) in outcomes.iter().enumerate() {
            for r in outcome {
                assert!(r.is_ok(), "{world} ranks, {mode:?}: rank {rank}: {r:?}");
            }
        }
        // Each pool registered on its own communicators only, the same on every rank.
        let stats: Vec<_> = per_rank
            .iter()
            .map(|(p, g)| {
                let registrations = |pool: &SymmPool| {
                    (pool.memory_stats().into_iter())
                        .filter(|(k, _)| k.starts_with("registrations."))
                        .collect::<Vec<_>>()
                };
                (registrations(p), registrations(g))
            })
            .collect();
        assert!(stats.windows(2).all(|w| w[0] == w[1]), "{stats:?}");
        // Closing is collective: every rank, both pools, in order.
        let closed = thread::scope(|s| {
            let hs: Vec<_> = (per_rank.iter())
                .map(|(p, g)| s.spawn(move || p.close().and_then(|()| g.close())))
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        assert!(closed.iter().all(Result::is_ok), "{closed:?}");
    }
}

#[test]
fn a_pool_split_twice_with_different_names_is_a_channel_mismatch_on_every_rank() {
    let groups = Group::host(2, &GroupConfig::default()).unwrap();
    let errs: Vec<Error> = thread::scope(|s| {
        let hs: Vec<_> = groups
            .into_iter()
            .enumerate()
            .map(|(rank, g)| {
                s.spawn(move || {
                    let name = if rank == 0 { "params" } else { "grads" };
                    g.split(name).unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(matches!(e, Error::ChannelMismatch { .. }), "{e:?}");
    }
}

#[test]
fn two_pools_sharing_communicators_on_two_threads_fail_naming_the_remedy() {
    // The same pattern on the backend's communicators: the threads reach them in
    // different orders on the two ranks. Whatever fails says what to do.
    let config = GroupConfig::default().with_timeout(Duration::from_secs(3));
    let per_rank = pools_per_rank(2, &config, false);
    let outcomes = thread::scope(|s| {
        let hs: Vec<_> = per_rank
            .iter()
            .map(|(p, g)| s.spawn(move || common::two_pools::params_and_grads(p, g, ITERATIONS)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // (The second handle on the shared communicators is refused, naming the remedy:
    // the other thread then does not run.)
    let failures: Vec<&String> = (outcomes.iter().flatten())
        .filter_map(|r| r.as_ref().err())
        .filter(|e| *e != "not run")
        .collect();
    assert!(!failures.is_empty(), "{outcomes:?}");
    // Every error is the crate's and names the remedy: a collective that paired one
    // pool's call with the other pool's is refused (each call carries its pool), so
    // the test's own check of the data never sees wrong data.
    for e in failures {
        assert!(!e.contains("wrong data"), "{e}");
        assert!(e.contains("Group::split"), "{e}");
    }
}
