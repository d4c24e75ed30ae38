//! Calls that know who they are: tagged collectives and the step boundary, on ranks as
//! threads (host backend). A model that reuses one persistent gather buffer for every
//! layer makes calls of the same shape for different layers; one rank skipping a
//! layer, running more layers, allocating one buffer more, or skipping the last
//! collective must fail on every rank (under `Strict` before data moves where the
//! records already differ, under `Async` by `end_step` at the latest), with the same
//! message on every rank, naming where each rank is, within one exchange round rather
//! than a timeout.
//!
//! The last rank is the perturbed one. Pool and backend timeouts are a few seconds;
//! nothing sleeps. Under `Async`, a collective that waits for a peer who stopped
//! joining them (it learnt of the divergence first) ends when this rank's check
//! fails too, well before the timeout.

mod common;

use common::identity::{LAYERS, Plan, Seen, divergence, step};
use std::thread;
use std::time::Duration;
use symmpool::{CheckMode, Error, HostBackend, HostConfig, PoolConfig, SymmPool};

/// The pools' and the host backend's timeout.
const TIMEOUT: Duration = Duration::from_secs(3);
/// What "within one exchange round" means here: well under the timeout.
const PROMPT: Duration = Duration::from_millis(1500);

fn pools(world: usize, mode: CheckMode) -> Vec<SymmPool> {
    let bs = HostBackend::world(HostConfig::new(world).with_timeout(TIMEOUT)).unwrap();
    let config = PoolConfig::default()
        .with_timeout(TIMEOUT)
        .with_check(mode)
        .with_check_queue(4);
    SymmPool::group(bs, &config).unwrap()
}

/// `plan(rank)` on every rank, a thread each; the results in rank order.
fn run(world: usize, mode: CheckMode, plan: impl Fn(usize) -> Plan + Sync) -> Vec<Seen> {
    let pools = pools(world, mode);
    thread::scope(|sc| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let plan = &plan;
                sc.spawn(move || step(p, plan(p.rank())))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank reports the same divergence, on `field`; its message.
fn same_divergence_everywhere(all: &[Seen], field: &str) -> String {
    let first = divergence(&all[0]);
    for seen in all {
        let d = divergence(seen);
        assert_eq!(d, first, "ranks report different divergences");
    }
    assert!(
        first.contains(&format!(": {field} differs:")),
        "not on {field:?}: {first}"
    );
    first
}

fn perturbed(world: usize, rank: usize, plan: Plan, normal: Plan) -> Plan {
    if rank == world - 1 { plan } else { normal }
}

#[test]
fn strict_tagged_skipped_layer_fails_on_the_tag_before_data_moves() {
    for world in [2, 4] {
        let normal = Plan::layers(LAYERS, true);
        let skip = Plan {
            skip: Some(3),
            ..normal
        };
        let all = run(world, CheckMode::Strict, |r| {
            perturbed(world, r, skip, normal)
        });
        let msg = same_divergence_everywhere(&all, "tag");
        for (rank, seen) in all.iter().enumerate() {
            // The fourth gather: layer 3 on the others, layer 4 on the last rank.
            let (at, _) = seen.first.as_ref().expect("the call fails");
            assert_eq!(*at, 4, "rank {rank}: {msg}");
            assert!(seen.untouched, "rank {rank}: data moved");
            assert!(seen.elapsed < PROMPT, "rank {rank}: {:?}", seen.elapsed);
        }
        assert!(msg.contains("4294967299 (0x100000003)"), "{msg}");
        assert!(msg.contains("4294967300 (0x100000004)"), "{msg}");
    }
}

#[test]
fn strict_untagged_skipped_layer_fails_by_the_step_boundary_naming_each_rank() {
    // Untagged, the records of the same-shape calls match until the ranks' counts
    // part: the others' last gather meets the last rank's step boundary.
    for world in [2, 4] {
        let normal = Plan::layers(LAYERS, false);
        let skip = Plan {
            skip: Some(3),
            ..normal
        };
        let all = run(world, CheckMode::Strict, |r| {
            perturbed(world, r, skip, normal)
        });
        let msg = same_divergence_everywhere(&all, "record kind");
        assert!(
            msg.contains("rank 0 has a collective (this rank's collective #8 on the pool)"),
            "{msg}"
        );
        assert!(
            msg.contains(&format!(
                "rank {} has a step boundary (after 7 collectives on the pool)",
                world - 1
            )),
            "{msg}"
        );
        for (rank, seen) in all.iter().enumerate() {
            if rank == world - 1 {
                assert!(seen.first.is_none(), "{:?}", seen.first);
            } else {
                let (at, _) = seen.first.as_ref().expect("the eighth call fails");
                assert_eq!(*at, 8);
                assert!(seen.untouched, "rank {rank}: data moved");
            }
            assert!(seen.elapsed < PROMPT, "rank {rank}: {:?}", seen.elapsed);
        }
    }
}

#[test]
fn strict_skipped_last_collective_fails_at_the_step_boundary_not_by_timeout() {
    for tagged in [false, true] {
        let normal = Plan::layers(LAYERS, tagged);
        let skip = Plan {
            skip: Some(LAYERS - 1),
            ..normal
        };
        let all = run(2, CheckMode::Strict, |r| perturbed(2, r, skip, normal));
        let msg = same_divergence_everywhere(&all, "record kind");
        assert!(msg.contains("rank 1 has a step boundary (after 7"), "{msg}");
        for seen in &all {
            assert!(seen.elapsed < PROMPT, "{:?}: {msg}", seen.elapsed);
        }
        assert!(all[0].untouched);
    }
}

#[test]
fn uneven_layer_counts_fail_on_every_rank() {
    for mode in [CheckMode::Strict, CheckMode::Async] {
        for tagged in [false, true] {
            let all = run(2, mode, |r| {
                Plan::layers(if r == 0 { 10 } else { 8 }, tagged)
            });
            let msg = same_divergence_everywhere(&all, "record kind");
            assert!(
                msg.contains("rank 0 has a collective (this rank's collective #9"),
                "{mode:?}: {msg}"
            );
            assert!(msg.contains("rank 1 has a step boundary (after 8"), "{msg}");
            // The rank behind learns it within a round.
            assert!(all[1].elapsed < PROMPT, "{mode:?}: {:?}", all[1].elapsed);
            if mode == CheckMode::Strict {
                assert!(all[0].elapsed < PROMPT, "{:?}", all[0].elapsed);
                assert!(all[0].untouched);
            }
        }
    }
}

#[test]
fn an_extra_allocation_fails_on_the_call_count_naming_each_rank() {
    for mode in [CheckMode::Strict, CheckMode::Async] {
        // Before a layer: the next collective's record; after the last: the step's.
        for before in [2, LAYERS] {
            let normal = Plan::layers(LAYERS, false);
            let extra = Plan {
                extra_alloc_before: Some(before),
                ..normal
            };
            let all = run(2, mode, |r| perturbed(2, r, extra, normal));
            let msg = same_divergence_everywhere(&all, "pool call count");
            // Under Async a divergence inside the loop lets the rank that learns it
            // first stop joining the host backend's blocking collectives; the failed
            // check ends the other's wait in one of them: bounded all the same.
            for seen in &all {
                assert!(seen.elapsed < PROMPT, "{mode:?}: {:?}: {msg}", seen.elapsed);
            }
            if mode == CheckMode::Strict && before < LAYERS {
                for seen in &all {
                    assert_eq!(seen.first.as_ref().map(|f| f.0), Some(before + 1));
                    assert!(seen.untouched);
                }
            }
        }
    }
}

#[test]
fn async_skipped_layer_fails_by_the_step_boundary() {
    for tagged in [false, true] {
        let normal = Plan::layers(LAYERS, tagged);
        let skip = Plan {
            skip: Some(3),
            ..normal
        };
        let all = run(2, CheckMode::Async, |r| perturbed(2, r, skip, normal));
        let field = if tagged { "tag" } else { "record kind" };
        same_divergence_everywhere(&all, field);
        // Every rank's end_step fails: no clean exit with wrong data.
        for seen in &all {
            assert!(
                matches!(seen.end, Some(Error::CollectiveDivergence(_))),
                "{seen:?}"
            );
        }
        // Untagged, the rank behind is at its step boundary when the ranks part: not
        // held up by the timeout. Tagged, the ranks part at the fourth gather, and
        // the rank that learns it first stops joining the host backend's blocking
        // collectives; the failed check ends the other's wait in one of them (the
        // call reports the divergence): neither waits out the timeout.
        for seen in &all {
            assert!(seen.elapsed < PROMPT, "{:?}: {seen:?}", seen.elapsed);
        }
    }
}

#[test]
fn matching_tagged_steps_pass() {
    for mode in [CheckMode::Strict, CheckMode::Async] {
        let all = run(2, mode, |_| Plan::layers(LAYERS, true));
        for seen in &all {
            assert!(seen.first.is_none(), "{mode:?}: {:?}", seen.first);
            assert!(seen.end.is_none(), "{mode:?}: {:?}", seen.end);
        }
    }
}

#[test]
fn async_divergence_ends_a_blocked_host_collective_well_before_the_timeout() {
    // Rank 0 runs two layers more: its ninth gather waits in the host backend for a
    // peer that is at its step boundary. The failed check ends the wait; the call
    // reports the divergence.
    let all = run(2, CheckMode::Async, |r| {
        Plan::layers(if r == 0 { LAYERS + 2 } else { LAYERS }, true)
    });
    same_divergence_everywhere(&all, "record kind");
    for (rank, seen) in all.iter().enumerate() {
        assert!(seen.elapsed < PROMPT, "rank {rank}: {:?}", seen.elapsed);
    }
    let (at, e) = all[0].first.as_ref().expect("rank 0's extra gather fails");
    assert!(*at > LAYERS, "{at}");
    assert!(matches!(e, Error::CollectiveDivergence(_)), "{e:?}");
}

#[test]
fn an_extra_allocation_that_grows_the_pool_names_the_rank_within_a_round() {
    // The last rank grows the pool before the third layer while its peers gather:
    // its growth record meets their collective record, on every rank, at once.
    for mode in [CheckMode::Strict, CheckMode::Async] {
        for world in [2, 3] {
            let normal = Plan::layers(LAYERS, false);
            let grow = Plan {
                extra_growth_before: Some(2),
                ..normal
            };
            let all = run(world, mode, |r| perturbed(world, r, grow, normal));
            let msg = same_divergence_everywhere(&all, "record kind");
            assert!(
                msg.contains(&format!("rank {} has a growth of the pool by", world - 1)),
                "{mode:?}: {msg}"
            );
            assert!(
                msg.contains("rank 0 has a collective (this rank's collective #3 on the pool)"),
                "{mode:?}: {msg}"
            );
            for (rank, seen) in all.iter().enumerate() {
                assert!(seen.first.is_some(), "{mode:?}: rank {rank}: {seen:?}");
                assert!(
                    seen.elapsed < PROMPT,
                    "{mode:?}: rank {rank}: {:?}",
                    seen.elapsed
                );
            }
        }
    }
}
