//! Calls that know who they are: tagged collectives and the step boundary, on ranks as
//! threads (host backend). A model that reuses one persistent gather buffer for every
//! layer makes calls of the same shape for different layers; one rank skipping a
//! layer, running more layers, allocating one buffer more, or skipping the last
//! collective must fail on every rank (under `Strict` before data moves where the
//! records already differ, under `Async` by `end_step` at the latest), with the same
//! message on every rank, naming where each rank is, within one exchange round rather
//! than a timeout.
//!
//! Every collective needs its tag by default: untagged calls are refused before
//! anything runs (a careless user's untagged loop never returns another layer's data),
//! and the tests of untagged calls' checks make their pools for them
//! (`PoolConfig::with_untagged_collectives`), which every rank must set alike.
//!
//! The last rank is the perturbed one. Pool and backend timeouts are a few seconds;
//! nothing sleeps. Under `Async`, a collective that waits for a peer who stopped
//! joining them (it learnt of the divergence first) ends when this rank's check
//! fails too, well before the timeout.

mod common;

use common::identity::{LAYERS, Plan, Seen, divergence, step};
use std::thread;
use std::time::{Duration, Instant};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Error, Group, GroupConfig, HostBackend, HostConfig,
    PoolConfig, ReduceOp, Stream, SymmPool,
};

/// The groups' timeout (their collectives' waits in the host backend end with it).
const TIMEOUT: Duration = Duration::from_secs(3);
/// What "within one exchange round" means here: well under the timeout.
const PROMPT: Duration = Duration::from_millis(1500);

/// The groups' settings under `mode` (with [`TIMEOUT`]).
fn group_config(mode: CheckMode) -> GroupConfig {
    GroupConfig::default()
        .with_timeout(TIMEOUT)
        .with_check(mode)
}

/// The groups' and pools' settings under `mode`: the defaults (every collective needs
/// a tag), or for plans whose calls are untagged a pool made for them (the explicit
/// opt-out, [`PoolConfig::with_untagged_collectives`]).
fn config(mode: CheckMode, tagged: bool) -> (GroupConfig, PoolConfig) {
    let pool = PoolConfig::default().with_untagged_collectives(!tagged);
    (group_config(mode), pool)
}

/// `plan(rank)` on every rank, a thread each, on pools of `config` (groups', pools'
/// settings), then `close`; the results in rank order. Every rank's close returns
/// within `PROMPT`: after a divergence with [`Error::PoolBroken`] naming it (the memory
/// released without a round), else `Ok`.
fn run(
    world: usize,
    (group, config): (GroupConfig, PoolConfig),
    plan: impl Fn(usize) -> Plan + Sync,
) -> Vec<Seen> {
    let groups = Group::host(world, &group).unwrap();
    let pools = SymmPool::world(&groups, &config).unwrap();
    let out: Vec<(Seen, Duration, symmpool::Result<()>)> = thread::scope(|sc| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let plan = &plan;
                sc.spawn(move || {
                    let seen = step(p, plan(p.rank()));
                    let started = Instant::now();
                    let closed = p.close();
                    (seen, started.elapsed(), closed)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (seen, took, closed)) in out.iter().enumerate() {
        assert!(*took < PROMPT, "rank {rank}: close took {took:?}");
        let diverged = seen
            .first
            .iter()
            .map(|f| &f.1)
            .chain(seen.end.iter())
            .find_map(|e| match e {
                Error::CollectiveDivergence(d) => Some(d.to_string()),
                _ => None,
            });
        match (diverged, closed) {
            (None, closed) => assert!(closed.is_ok(), "rank {rank}: {closed:?}"),
            (Some(d), Err(Error::PoolBroken { reason })) => {
                assert!(reason.starts_with(&d), "rank {rank}: {reason} is not {d}")
            }
            (Some(d), closed) => panic!("rank {rank}: close after {d}: {closed:?}"),
        }
        assert!(pools[rank].close().is_ok(), "a second close");
    }
    out.into_iter().map(|(seen, _, _)| seen).collect()
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
        let all = run(world, config(CheckMode::Strict, normal.tagged), |r| {
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
        let all = run(world, config(CheckMode::Strict, normal.tagged), |r| {
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
        let all = run(2, config(CheckMode::Strict, tagged), |r| {
            perturbed(2, r, skip, normal)
        });
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
            let all = run(2, config(mode, tagged), |r| {
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
            let normal = Plan::layers(LAYERS, true);
            let extra = Plan {
                extra_alloc_before: Some(before),
                ..normal
            };
            let all = run(2, config(mode, true), |r| perturbed(2, r, extra, normal));
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
        let all = run(2, config(CheckMode::Async, tagged), |r| {
            perturbed(2, r, skip, normal)
        });
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
        let all = run(2, config(mode, true), |_| Plan::layers(LAYERS, true));
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
    let all = run(2, config(CheckMode::Async, true), |r| {
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
            let normal = Plan::layers(LAYERS, true);
            let grow = Plan {
                extra_growth_before: Some(2),
                ..normal
            };
            let all = run(world, config(mode, true), |r| {
                perturbed(world, r, grow, normal)
            });
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

/// Under `Async`, after a mismatch at a rank's collective *k*, at most this many
/// further collectives of the rank run ([`GroupConfig::check_queue`]'s default).
const ASYNC_FURTHER: usize = 1;

#[test]
fn no_tagged_call_returns_ok_with_another_layers_data() {
    // A skipped layer: the ranks' fourth gathers are different layers.
    const MISMATCH: usize = 4;
    for mode in [CheckMode::Strict, CheckMode::Async] {
        for world in [2, 4] {
            let normal = Plan::layers(LAYERS, true);
            let skip = Plan {
                skip: Some(3),
                ..normal
            };
            let all = run(world, config(mode, true), |r| {
                perturbed(world, r, skip, normal)
            });
            same_divergence_everywhere(&all, "tag");
            for (rank, seen) in all.iter().enumerate() {
                let (at, _) = seen.first.as_ref().expect("a call fails");
                match mode {
                    CheckMode::Strict => {
                        assert_eq!(seen.wrong_ok, 0, "rank {rank}: {seen:?}");
                        assert_eq!(*at, MISMATCH, "rank {rank}");
                    }
                    _ => {
                        // The mismatched call itself and `ASYNC_FURTHER` after it.
                        assert!(seen.wrong_ok <= 1 + ASYNC_FURTHER, "rank {rank}: {seen:?}");
                        assert!(*at <= MISMATCH + ASYNC_FURTHER + 1, "rank {rank}: {seen:?}");
                    }
                }
            }
        }
        // Uneven layer counts: the layers both ranks run match; the rank ahead fails
        // at its first extra layer, without a wrong result.
        let all = run(2, config(mode, true), |r| {
            Plan::layers(if r == 0 { 10 } else { 8 }, true)
        });
        same_divergence_everywhere(&all, "record kind");
        for seen in &all {
            assert_eq!(seen.wrong_ok, 0, "{mode:?}: {seen:?}");
        }
    }
}

/// Ranks as threads: `body(rank, pool, coll)` on each, with a pool of `config` in a
/// group checked under `mode` (with [`TIMEOUT`]).
fn each_rank<R: Send>(
    world: usize,
    mode: CheckMode,
    config: PoolConfig,
    body: impl Fn(usize, &SymmPool, &Coll) -> R + Sync,
) -> Vec<R> {
    let groups = Group::host(world, &group_config(mode)).unwrap();
    let pools = SymmPool::world(&groups, &config).unwrap();
    thread::scope(|sc| {
        let hs: Vec<_> = (pools.iter())
            .map(|p| {
                let body = &body;
                sc.spawn(move || {
                    let coll = Coll::new(p).unwrap();
                    body(p.rank(), p, &coll)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every collective of `coll` on `pool`'s buffers, untagged (in place and out of
/// place): their results, with whether each left the buffers as this rank wrote them.
fn every_untagged_call(pool: &SymmPool, coll: &Coll) -> Vec<(symmpool::Result<()>, bool)> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let whole = pool.alloc((world * 4 * 256) as u64, &stream).unwrap();
    let part = pool.alloc(4 * 256, &stream).unwrap();
    let other = pool.alloc(4 * 256, &stream).unwrap();
    let calls: [&dyn Fn() -> symmpool::Result<()>; 6] = [
        &|| coll.all_gather_in_place::<f32>(&whole, &stream).map(drop),
        &|| coll.all_gather::<f32>(&part, &whole, &stream).map(drop),
        &|| (coll.reduce_scatter_in_place::<f32>(&whole, ReduceOp::Sum, &stream)).map(drop),
        &|| (coll.reduce_scatter::<f32>(&whole, &part, ReduceOp::Sum, &stream)).map(drop),
        &|| (coll.all_reduce_in_place::<f32>(&part, ReduceOp::Sum, &stream)).map(drop),
        &|| (coll.all_reduce::<f32>(&part, &other, ReduceOp::Max, &stream)).map(drop),
    ];
    calls
        .iter()
        .map(|call| {
            let (w, p) = (
                vec![rank as f32 + 1.0; world * 256],
                vec![rank as f32 + 7.0; 256],
            );
            whole.write(&w).unwrap();
            part.write(&p).unwrap();
            let r = call();
            let untouched = whole.read::<f32>().unwrap() == w && part.read::<f32>().unwrap() == p;
            (r, untouched)
        })
        .collect()
}

#[test]
fn an_untagged_call_is_refused_by_default_in_every_mode_and_world_size() {
    for world in [1, 2] {
        for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
            let out = each_rank(world, mode, PoolConfig::default(), |_, pool, coll| {
                let refused = every_untagged_call(pool, coll);
                // A refused call touches nothing: tagged calls go on, and the step ends
                // clean on every rank.
                let stream = Stream::host();
                let buf = pool.alloc((world * 4 * 256) as u64, &stream).unwrap();
                coll.tagged(0)
                    .all_gather_in_place::<f32>(&buf, &stream)
                    .unwrap();
                coll.end_step().unwrap();
                refused
            });
            for (rank, refused) in out.iter().enumerate() {
                for (n, (r, untouched)) in refused.iter().enumerate() {
                    let what = format!("world {world}, {mode:?}, rank {rank}, call {n}");
                    let e = r.as_ref().expect_err(&what);
                    assert!(matches!(e, Error::Untagged { .. }), "{what}: {e:?}");
                    assert_eq!(e.kind(), symmpool::ErrorKind::Usage, "{what}");
                    let msg = e.to_string();
                    for says in [
                        "coll.tagged(tag)",
                        "tag= in Python",
                        "PoolConfig::with_untagged_collectives(true)",
                        "untagged_collectives=True",
                    ] {
                        assert!(msg.contains(says), "{what}: {msg:?} lacks {says:?}");
                    }
                    assert!(untouched, "{what}: data moved");
                }
                let names: Vec<_> = (refused.iter())
                    .map(|(r, _)| match r {
                        Err(Error::Untagged { op, pool }) => (*op, pool.as_str()),
                        other => panic!("{other:?}"),
                    })
                    .collect();
                assert_eq!(
                    names,
                    [
                        ("all_gather_in_place", "pool"),
                        ("all_gather", "pool"),
                        ("reduce_scatter_in_place", "pool"),
                        ("reduce_scatter", "pool"),
                        ("all_reduce_in_place", "pool"),
                        ("all_reduce", "pool"),
                    ]
                );
            }
        }
    }
}

#[test]
fn a_pool_made_for_untagged_collectives_runs_them_in_every_mode() {
    for world in [1, 2] {
        for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
            let config = PoolConfig::default().with_untagged_collectives(true);
            let out = each_rank(world, mode, config, |rank, pool, coll| {
                let ran = every_untagged_call(pool, coll);
                let stream = Stream::host();
                let buf = pool.alloc((world * 4 * 256) as u64, &stream).unwrap();
                buf.write(&vec![rank as f32; world * 256]).unwrap();
                coll.all_gather_in_place::<f32>(&buf, &stream).unwrap();
                let gathered = buf.read::<f32>().unwrap();
                // Tagged calls run on it too.
                coll.tagged(9)
                    .all_gather_in_place::<f32>(&buf, &stream)
                    .unwrap();
                (ran, gathered, coll.end_step())
            });
            for (rank, (ran, gathered, end)) in out.iter().enumerate() {
                let what = format!("world {world}, {mode:?}, rank {rank}");
                for (n, (r, _)) in ran.iter().enumerate() {
                    assert!(r.is_ok(), "{what}, call {n}: {r:?}");
                }
                let expected: Vec<f32> = (0..world)
                    .flat_map(|r| std::iter::repeat_n(r as f32, 256))
                    .collect();
                assert_eq!(gathered, &expected, "{what}");
                assert!(end.is_ok(), "{what}: {end:?}");
            }
        }
    }
}

#[test]
fn ranks_that_differ_about_untagged_collectives_fail_when_they_make_the_pool() {
    for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
        let bs = HostBackend::world(HostConfig::new(2)).unwrap();
        let errs: Vec<Error> = thread::scope(|sc| {
            let hs: Vec<_> = (bs.into_iter())
                .map(|b| {
                    sc.spawn(move || {
                        let untagged = b.rank() == 1;
                        let group = Group::new(b, group_config(mode)).unwrap();
                        let config = PoolConfig::default().with_untagged_collectives(untagged);
                        SymmPool::new(&group, config).unwrap_err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for e in errs {
            match &e {
                Error::ChannelMismatch { opened } => {
                    assert_eq!(opened[0].2, "pool:pool");
                    assert_eq!(opened[1].2, "pool:pool:untagged_collectives");
                }
                other => panic!("{mode:?}: {other:?}"),
            }
            assert!(e.to_string().contains("untagged_collectives"), "{e}");
        }
    }
}

/// A careless user's layer loop (`common::identity`, untagged, on a pool with the
/// default settings): the last rank skips layer 3 of the one persistent gather buffer,
/// or rank 0 runs two layers more. Every untagged call is refused before anything
/// moves, so no call returns `Ok` with another call's data, in every check mode (`Off`
/// included) and at every world size.
#[test]
fn a_careless_untagged_layer_loop_never_returns_another_layers_data() {
    for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
        for world in [2, 4] {
            let normal = Plan::layers(LAYERS, false);
            let skip = Plan {
                skip: Some(3),
                ..normal
            };
            let uneven = |r: usize| Plan::layers(if r == 0 { LAYERS + 2 } else { LAYERS }, false);
            let config = (group_config(mode), PoolConfig::default());
            let skipped = run(world, config.clone(), |r| perturbed(world, r, skip, normal));
            let uneven = run(world, config, uneven);
            for (case, all) in [("skip", skipped), ("uneven", uneven)] {
                for (rank, seen) in all.iter().enumerate() {
                    let what = format!("{case}, {mode:?}, world {world}, rank {rank}");
                    assert_eq!(seen.wrong_ok, 0, "{what}: {seen:?}");
                    let (at, e) = seen.first.as_ref().expect(&what);
                    assert_eq!(*at, 1, "{what}: the first call is refused");
                    assert!(matches!(e, Error::Untagged { .. }), "{what}: {e:?}");
                    assert!(e.to_string().contains("coll.tagged(tag)"), "{what}: {e}");
                    assert!(seen.untouched, "{what}: data moved");
                    // No collective ran on any rank: the step boundary agrees.
                    assert!(seen.end.is_none(), "{what}: {:?}", seen.end);
                }
            }
        }
    }
}

#[test]
fn tag_zero_is_a_tag() {
    // Every rank tags 0: a valid identity, the step passes.
    let out = each_rank(
        2,
        CheckMode::Strict,
        PoolConfig::default(),
        |_, pool, coll| {
            let stream = Stream::host();
            let buf = pool.alloc(2 * 4 * 256, &stream).unwrap();
            coll.tagged(0).all_gather_in_place::<f32>(&buf, &stream)?;
            coll.end_step()
        },
    );
    assert!(out.iter().all(Result::is_ok), "{out:?}");
    // Tag 0 against no tag (on a pool made for untagged calls): a difference in the
    // tag, named as such.
    let out = each_rank(
        2,
        CheckMode::Strict,
        PoolConfig::default().with_untagged_collectives(true),
        |rank, pool, coll| {
            let stream = Stream::host();
            let buf = pool.alloc(2 * 4 * 256, &stream).unwrap();
            match rank {
                0 => coll.tagged(0).all_gather_in_place::<f32>(&buf, &stream),
                _ => coll.all_gather_in_place::<f32>(&buf, &stream),
            }
            .unwrap_err()
        },
    );
    for e in &out {
        let msg = e.to_string();
        assert!(
            msg.contains("tag differs: rank 0 has tag 0 (0x0); rank 1 has no tag"),
            "{msg}"
        );
    }
}

#[test]
fn a_second_handle_on_the_same_communicators_is_refused_with_advice() {
    let mode = CheckMode::default();
    let out = each_rank(2, mode, PoolConfig::default(), |_, pool, coll| {
        let second = Coll::new(pool).unwrap_err();
        // Another pool in the same group (on the same communicators): refused too.
        let other = SymmPool::new(pool.group(), PoolConfig::default().with_name("other")).unwrap();
        let on_other = Coll::new(&other).unwrap_err();
        // A pool in a group of its own (communicators split for it) has a handle of
        // its own.
        let own = pool.group().split("own").unwrap();
        let own = SymmPool::new(&own, PoolConfig::default().with_name("own")).unwrap();
        let own_coll = Coll::new(&own).map(drop);
        // A clone is the same handle; once the handle is gone, a new one is fine.
        let clone = coll.clone();
        drop(clone);
        (second, on_other, own_coll)
    });
    for (second, on_other, own_coll) in out {
        for e in [&second, &on_other] {
            assert!(
                matches!(
                    e,
                    Error::InvalidCollective {
                        op: "Coll::new",
                        ..
                    }
                ),
                "{e:?}"
            );
            let msg = e.to_string();
            assert!(msg.contains("already have a collectives handle"), "{msg}");
            assert!(msg.contains("clone the handle"), "{msg}");
            assert!(msg.contains("Coll::with_pools"), "{msg}");
        }
        assert!(own_coll.is_ok(), "{own_coll:?}");
    }
    // Dropped, the handle frees the communicators for a new one.
    let pools = SymmPool::host_group(2, PoolConfig::default()).unwrap();
    let first = Coll::world(&pools).unwrap();
    drop(first);
    Coll::world(&pools).unwrap();
}

#[test]
fn pools_used_in_crossed_order_through_one_handle_diverge_on_the_pool() {
    for mode in [CheckMode::Strict, CheckMode::Async] {
        let bs = HostBackend::world(HostConfig::new(2)).unwrap();
        let out = thread::scope(|sc| {
            let hs: Vec<_> = (bs.into_iter())
                .map(|b| {
                    sc.spawn(move || {
                        let rank = b.rank();
                        // Both pools in the rank's one group (they share communicators).
                        let group = Group::new(b, group_config(mode)).unwrap();
                        let config = PoolConfig::default();
                        let a = SymmPool::new(&group, config.clone().with_name("a")).unwrap();
                        let c = SymmPool::new(&group, config.with_name("b")).unwrap();
                        let coll = Coll::with_pools(&[a.clone(), c.clone()]).unwrap();
                        let stream = Stream::host();
                        let bufs = [&a, &c].map(|p| p.alloc(2 * 4 * 256, &stream).unwrap());
                        // Rank 0 gathers pool a then b; rank 1 b then a.
                        let order = if rank == 0 { [0, 1] } else { [1, 0] };
                        let mut first_error = None;
                        let mut wrong_ok = 0;
                        for (n, &i) in order.iter().enumerate() {
                            bufs[i].write(&vec![(rank * 10 + i) as f32; 512]).unwrap();
                            // Tagged with its place in the rank's sequence: the same
                            // on both ranks, so the pools differ, not the tags.
                            let tagged = coll.tagged(n as u64);
                            match tagged.all_gather_in_place::<f32>(&bufs[i], &stream) {
                                Ok(_) => {
                                    let got = bufs[i].read::<f32>().unwrap();
                                    if got[256..] != vec![(10 * (1 - rank) + i) as f32; 256][..]
                                        && got[..256] != vec![(10 * (1 - rank) + i) as f32; 256][..]
                                    {
                                        wrong_ok += 1;
                                    }
                                }
                                Err(e) => {
                                    first_error = Some((n + 1, e));
                                    break;
                                }
                            }
                        }
                        let end = coll.end_step().err();
                        (first_error, wrong_ok, end)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>()
        });
        for (rank, (first, wrong_ok, end)) in out.iter().enumerate() {
            // Strict: the crossed call itself. Async: `end_step` (the call may first be
            // refused by the host backend, which sees two pools' calls paired).
            let e = match mode {
                CheckMode::Strict => first.as_ref().map(|f| &f.1),
                _ => end.as_ref(),
            };
            let msg = e.map(ToString::to_string).unwrap_or_default();
            assert!(
                msg.contains("pool (channel ordinal) differs"),
                "{mode:?} rank {rank}: {msg}"
            );
            if mode == CheckMode::Strict {
                assert_eq!(first.as_ref().map(|f| f.0), Some(1), "{mode:?}: {msg}");
                assert_eq!(*wrong_ok, 0, "{mode:?} rank {rank}");
            } else {
                assert!(
                    *wrong_ok <= 1 + ASYNC_FURTHER,
                    "{mode:?} rank {rank}: {wrong_ok}"
                );
            }
        }
    }
}

/// Collectives that return at once: a rank whose peer never joins its collective.
#[derive(Debug)]
struct Alone;

impl symmpool::backend::Collectives for Alone {
    fn all_gather(&self, _: &symmpool::backend::CollArgs<'_>) -> symmpool::Result<()> {
        Ok(())
    }
    fn reduce_scatter(&self, _: &symmpool::backend::CollArgs<'_>) -> symmpool::Result<()> {
        Ok(())
    }
}

#[test]
fn dropping_a_handle_whose_check_waits_forever_is_bounded() {
    // Timeouts of Duration::MAX everywhere; rank 0's collective returns at once, its
    // record waits for a peer that never posts one.
    let mut bs = HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = bs.pop().unwrap();
    let b0 = bs
        .pop()
        .unwrap()
        .with_collectives(|_| std::sync::Arc::new(Alone));
    let config = GroupConfig::default()
        .with_timeout(Duration::MAX)
        .with_check(CheckMode::Async);
    let groups = Group::world(vec![b0, b1], &config).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let stream = Stream::host();
    // Both ranks allocate (the growth is collective), before the handles.
    let bufs = thread::scope(|sc| {
        let hs: Vec<_> = (pools.iter())
            .map(|p| sc.spawn(|| p.alloc(2 * 4 * 256, &Stream::host()).unwrap()))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    let colls = Coll::world(&pools).unwrap();
    colls[0]
        .tagged(0)
        .all_gather_in_place::<f32>(&bufs[0], &stream)
        .unwrap();
    let mut colls = colls.into_iter();
    let first = colls.next().unwrap();
    let started = Instant::now();
    drop(first);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

/// A rank's collectives, where the thread named "A", once inside the backend (its
/// record posted), lets the rank's thread "B" go, and on rank 0 then waits until B's
/// call returned (at most `HOLD`): a thread preempted between its record and its
/// launch.
#[derive(Debug)]
struct HoldA {
    inner: std::sync::Arc<dyn symmpool::backend::Collectives>,
    a_inside: std::sync::mpsc::SyncSender<()>,
    /// Rank 0 only.
    b_done: Option<std::sync::Mutex<std::sync::mpsc::Receiver<()>>>,
}

const HOLD: Duration = Duration::from_millis(500);

impl symmpool::backend::Collectives for HoldA {
    fn all_gather(&self, a: &symmpool::backend::CollArgs<'_>) -> symmpool::Result<()> {
        if thread::current().name() == Some("A") {
            let _ = self.a_inside.try_send(());
            if let Some(b_done) = &self.b_done {
                let _ = b_done.lock().unwrap().recv_timeout(HOLD);
            }
        }
        self.inner.all_gather(a)
    }
    fn reduce_scatter(&self, a: &symmpool::backend::CollArgs<'_>) -> symmpool::Result<()> {
        self.inner.reduce_scatter(a)
    }
    fn abandon(&self, why: &'static str) {
        self.inner.abandon(why)
    }
}

#[test]
fn two_threads_of_a_rank_pair_their_records_as_they_launch_under_async() {
    // Both ranks post A's record, then B's; on rank 0, A reaches the backend only
    // after B's call returned (or `HOLD`). The record and the launch are one step per
    // handle, so B waits for A's launch: no call returns another thread's data.
    let (b_done_tx, b_done_rx) = std::sync::mpsc::channel::<()>();
    let mut b_done_rx = Some(b_done_rx);
    let mut a_inside_rx = Vec::new();
    let world: Vec<_> = (HostBackend::world(HostConfig::new(2)).unwrap())
        .into_iter()
        .map(|b| {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            a_inside_rx.push(std::sync::Mutex::new(rx));
            let b_done = (b.rank() == 0).then(|| std::sync::Mutex::new(b_done_rx.take().unwrap()));
            b.with_collectives(|inner| {
                std::sync::Arc::new(HoldA {
                    inner,
                    a_inside: tx,
                    b_done,
                })
            })
        })
        .collect();
    let groups = Group::world(world, &group_config(CheckMode::Async)).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let b_done_tx = std::sync::Mutex::new(Some(b_done_tx));
    let wrong: usize = thread::scope(|sc| {
        let hs: Vec<_> = (pools.iter())
            .map(|p| {
                let (b_done_tx, a_inside) = (&b_done_tx, &a_inside_rx[p.rank()]);
                sc.spawn(move || {
                    let coll = Coll::new(p).unwrap();
                    let rank = p.rank();
                    let bufs: Vec<_> = (0..2)
                        .map(|_| p.alloc(2 * 4 * 64, &Stream::host()).unwrap())
                        .collect();
                    let wrong = thread::scope(|s2| {
                        let hs: Vec<_> = (0..2)
                            .map(|th| {
                                let (coll, buf) = (coll.clone(), &bufs[th]);
                                let name = ["A", "B"][th].to_string();
                                let body = move || {
                                    buf.write(&vec![(rank * 10 + th) as f32; 128]).unwrap();
                                    if th == 1 {
                                        // B starts once A is inside the backend.
                                        let rx = a_inside.lock().unwrap();
                                        rx.recv_timeout(Duration::from_secs(10)).unwrap();
                                    }
                                    let r = (coll.tagged(th as u64))
                                        .all_gather_in_place::<f32>(buf, &Stream::host());
                                    if th == 1 && rank == 0 {
                                        drop(b_done_tx.lock().unwrap().take());
                                    }
                                    let peer = buf.read::<f32>().unwrap()[(1 - rank) * 64];
                                    usize::from(r.is_ok() && peer != ((1 - rank) * 10 + th) as f32)
                                };
                                thread::Builder::new()
                                    .name(name)
                                    .spawn_scoped(s2, body)
                                    .unwrap()
                            })
                            .collect();
                        hs.into_iter().map(|h| h.join().unwrap()).sum::<usize>()
                    });
                    let _ = coll.end_step();
                    wrong
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(wrong, 0, "calls returned Ok with another thread's data");
}

#[test]
fn close_right_after_an_async_divergence_names_it_on_every_rank() {
    // No end_step: close itself compares what is still in flight first, so every rank
    // learns the divergence and closes without a round, promptly.
    for _ in 0..10 {
        let out = each_rank(
            2,
            CheckMode::Async,
            PoolConfig::default(),
            |rank, pool, coll| {
                let stream = Stream::host();
                let buf = pool.alloc(2 * 4 * 256, &stream).unwrap();
                let _ = coll
                    .tagged(rank as u64)
                    .all_gather_in_place::<f32>(&buf, &stream);
                drop(buf);
                let started = Instant::now();
                let closed = pool.close();
                (started.elapsed(), closed)
            },
        );
        for (took, closed) in out {
            assert!(took < PROMPT, "{took:?}");
            assert!(
                matches!(&closed, Err(Error::PoolBroken { reason }) if reason.contains("tag differs")),
                "{closed:?}"
            );
        }
    }
}

#[test]
fn a_checked_growth_takes_its_agreement_round_and_no_other_check_round() {
    // A growth among checked collectives: the growth's agreement is a record of the
    // ledger, compared with the peers' collective records in its own round (no
    // separate check round before it, as when the checks had a channel of their own).
    let rounds = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let backends: Vec<_> = HostBackend::world(HostConfig::new(2))
        .unwrap()
        .into_iter()
        .map(|b| {
            let rounds = rounds.clone();
            b.with_exchange(move |inner| {
                common::watched::Watched::wrap(inner, move |op| rounds.lock().unwrap().push(op))
            })
            .unwrap()
        })
        .collect();
    let groups = Group::world(backends, &group_config(CheckMode::Strict)).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let stream = Stream::host();
    let per_rank: Vec<Vec<&'static str>> = thread::scope(|s| {
        let hs: Vec<_> = (pools.iter())
            .map(|pool| {
                s.spawn(|| {
                    let coll = Coll::new(pool).unwrap();
                    let buf = pool.alloc(2 * 4 * 256, &stream).unwrap();
                    coll.tagged(0)
                        .all_gather_in_place::<f32>(&buf, &stream)
                        .unwrap();
                    buf
                })
            })
            .collect();
        let bufs: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        rounds.lock().unwrap().clear();
        let hs: Vec<_> = (pools.iter())
            .map(|pool| s.spawn(|| pool.alloc(64 << 20, &stream).map(drop)))
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
        drop(bufs);
        vec![rounds.lock().unwrap().clone()]
    });
    let all = &per_rank[0];
    println!("rounds of one growth on both ranks: {all:?}");
    let checks = all.iter().filter(|op| op.contains("check")).count();
    assert_eq!(checks, 0, "{all:?}");
    assert_eq!(
        all.iter().filter(|op| **op == "growth").count(),
        2,
        "{all:?}"
    );
}
