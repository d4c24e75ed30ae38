//! Pools per thread and calls that know who they are, with one process per rank on the
//! shared-memory backend: two pools in groups of their own (communicators of their own)
//! on two threads per rank, and the identity cases of `tests/coll_identity.rs` (a skipped layer with a
//! persistent buffer, uneven layer counts, an extra allocation, a skipped last
//! collective). Every job is bounded and leaves no process (the job kills and reaps
//! its children on every path) and no `/dev/shm` file.
#![cfg(target_os = "linux")]

mod common;

use common::identity::{LAYERS, Plan, step};
use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use std::time::Duration;
use symmpool::{CheckMode, Error, Group, GroupConfig, PoolConfig, SymmPool};

const ENTRY: &str = "child_process_entry";
/// The groups' and the backend's timeout.
const TIMEOUT: Duration = Duration::from_secs(20);
/// The identity cases' timeouts: what a rank blocked in a shared-memory collective
/// its peer never joins waits (under `Async`).
const IDENTITY_TIMEOUT: Duration = Duration::from_secs(3);
/// "Within one exchange round" for processes on a loaded machine: well under the
/// timeout.
const PROMPT: Duration = Duration::from_millis(2500);

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(code) => code,
        Err(e) => {
            println!("@@error {e}");
            2
        }
    };
    std::process::exit(code);
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn child() -> symmpool::Result<i32> {
    let role = var("CHILD_ROLE");
    let (rank, world, backend) = join()?;
    match role.as_deref() {
        Some("two_pools") => two_pools_child(backend),
        Some("identity") => identity_child(rank, world, backend),
        other => {
            println!("@@unknown role {other:?}");
            Ok(4)
        }
    }
}

/// A parameter pool and a gradient pool in groups of their own, over communicators of
/// their own (`Group::split`), used from two threads (`common::two_pools`); prints each
/// thread's outcome.
fn two_pools_child(backend: symmpool::Backend) -> symmpool::Result<i32> {
    let config = GroupConfig::default().with_timeout(TIMEOUT).with_check(
        match var("CHECK_MODE").as_deref() {
            Some("strict") => CheckMode::Strict,
            _ => CheckMode::Async,
        },
    );
    let group = Group::new(backend, config)?;
    let params = SymmPool::new(
        &group.split("params")?,
        PoolConfig::default().with_name("params"),
    )?;
    let grads = SymmPool::new(
        &group.split("grads")?,
        PoolConfig::default().with_name("grads"),
    )?;
    let [p, g] = common::two_pools::params_and_grads(&params, &grads, 20);
    println!("@@two_pools params={p:?} grads={g:?}");
    params.close()?;
    grads.close()?;
    Ok(0)
}

/// One step of the layer loop (`common::identity`) as `SCENARIO` says for the last
/// rank (or, for `uneven`, rank 0 with two layers more); prints where the first
/// failure was, the step's time and the divergence's message.
fn identity_child(rank: usize, world: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
    let mode = match var("CHECK_MODE").as_deref() {
        Some("strict") => CheckMode::Strict,
        Some("off") => CheckMode::Off,
        _ => CheckMode::Async,
    };
    let (tagged, careless) = (var("TAGGED").is_some(), var("CARELESS").is_some());
    // Untagged calls run on a pool made for them (the explicit opt-out), except for
    // the careless user's, on the defaults.
    let group = GroupConfig::default()
        .with_timeout(IDENTITY_TIMEOUT)
        .with_check(mode);
    let config = PoolConfig::default().with_untagged_collectives(!tagged && !careless);
    let pool = SymmPool::new(&Group::new(backend, group)?, config)?;
    let normal = Plan::layers(LAYERS, tagged);
    let last = rank == world - 1;
    let plan = match var("SCENARIO").as_deref() {
        Some("skip") if last => Plan {
            skip: Some(3),
            ..normal
        },
        Some("skip_last") if last => Plan {
            skip: Some(LAYERS - 1),
            ..normal
        },
        Some("uneven") if rank == 0 => Plan {
            layers: LAYERS + 2,
            ..normal
        },
        Some("extra_alloc") if last => Plan {
            extra_alloc_before: Some(LAYERS),
            ..normal
        },
        Some("extra_growth") if last => Plan {
            extra_growth_before: Some(2),
            ..normal
        },
        _ => normal,
    };
    let seen = step(&pool, plan);
    if careless {
        let first = seen.first.as_ref();
        let refused = first.is_some_and(|(_, e)| matches!(e, Error::Untagged { .. }));
        let closed = pool.close();
        println!(
            "@@careless first={:?} refused={refused} untouched={} wrong_ok={} end={:?} closed={closed:?}",
            first.map(|f| f.0),
            seen.untouched,
            seen.wrong_ok,
            seen.end
        );
        return Ok(0);
    }
    let divergence = (seen.first.iter().map(|(_, e)| e))
        .chain(seen.end.iter())
        .find_map(|e| match e {
            Error::CollectiveDivergence(d) => Some(d.to_string()),
            _ => None,
        })
        .unwrap_or_else(|| format!("none: {seen:?}"));
    let started = std::time::Instant::now();
    let closed = pool.close();
    println!(
        "@@closed ms={} wrong_ok={} {closed:?}",
        started.elapsed().as_millis(),
        seen.wrong_ok
    );
    println!(
        "@@identity first={:?} elapsed_ms={} {divergence}",
        seen.first.as_ref().map(|f| f.0),
        seen.elapsed.as_millis()
    );
    Ok(0)
}

fn env(
    role: &'static str,
    extra: Vec<(&'static str, String)>,
) -> impl Fn(usize) -> Vec<(&'static str, String)> {
    move |_| {
        let mut v = vec![
            ("CHILD_ROLE", role.to_string()),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
        ];
        v.extend(extra.iter().cloned());
        v
    }
}

/// Run `role` on `world` processes; for each prefix, every rank's line after it.
fn job_lines<const N: usize>(
    world: usize,
    role: &'static str,
    extra: Vec<(&'static str, String)>,
    prefixes: [&str; N],
) -> [Vec<String>; N] {
    let mut job = Job::start(ENTRY, world, env(role, extra));
    let all: Vec<usize> = (0..world).collect();
    let codes = job.wait(&all, Duration::from_secs(180));
    assert_eq!(codes, vec![0; world], "{role}: {:?}", job.seen);
    prefixes.map(|prefix| {
        (all.iter())
            .map(|&r| job.expect(r, prefix, Duration::from_secs(5)))
            .collect()
    })
}

#[test]
fn two_pools_with_their_own_communicators_on_two_threads_per_process() {
    let before = shm_entries();
    for (world, mode) in [(2, "async"), (2, "strict"), (3, "async")] {
        let [lines] = job_lines(
            world,
            "two_pools",
            vec![("CHECK_MODE", mode.to_string())],
            ["@@two_pools "],
        );
        for (rank, line) in lines.iter().enumerate() {
            assert_eq!(
                line, "params=Ok(()) grads=Ok(())",
                "{world} ranks, {mode}: rank {rank}"
            );
        }
    }
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

/// Every rank's line of one identity case: (first failing call, milliseconds, the
/// divergence's message), the message the same on every rank and on `field`.
fn identity_case(
    world: usize,
    mode: &'static str,
    scenario: &'static str,
    tagged: bool,
    field: &str,
) -> Vec<(String, u128, String)> {
    let mut extra = vec![
        ("CHECK_MODE", mode.to_string()),
        ("SCENARIO", scenario.to_string()),
    ];
    if tagged {
        extra.push(("TAGGED", "1".to_string()));
    }
    let [lines, closed] = job_lines(world, "identity", extra, ["@@identity ", "@@closed "]);
    let parsed: Vec<(String, u128, String)> = lines
        .iter()
        .map(|l| {
            let (first, rest) = l.split_once(' ').unwrap();
            let (ms, msg) = rest.split_once(' ').unwrap();
            let ms = ms.trim_start_matches("elapsed_ms=").parse().unwrap();
            (first.to_string(), ms, msg.to_string())
        })
        .collect();
    let what = format!("{scenario} {mode} tagged={tagged} world {world}");
    // After the step every rank closes its pool within a second, with the divergence
    // as the cause (the memory released without a round).
    for (rank, line) in closed.iter().enumerate() {
        let (ms, rest) = line.split_once(' ').unwrap();
        let ms: u128 = ms.trim_start_matches("ms=").parse().unwrap();
        assert!(ms < 1000, "{what}: rank {rank} closed in {ms} ms");
        let (wrong, result) = rest.split_once(' ').unwrap();
        assert!(
            result.starts_with("Err(PoolBroken { reason: \"ranks diverged"),
            "{what}: rank {rank}: {result}"
        );
        // Tagged: no call returns another layer's data under Strict, at most the
        // mismatched call and `check_queue` (1) more under Async.
        let wrong: usize = wrong.trim_start_matches("wrong_ok=").parse().unwrap();
        if tagged {
            let bound = if mode == "strict" { 0 } else { 2 };
            assert!(wrong <= bound, "{what}: rank {rank}: {wrong} wrong results");
        }
    }
    for (_, _, msg) in &parsed {
        assert_eq!(
            msg, &parsed[0].2,
            "{what}: ranks report different divergences"
        );
    }
    assert!(
        parsed[0].2.contains(&format!(": {field} differs:")),
        "{what}: {}",
        parsed[0].2
    );
    parsed
}

/// Every rank within `bound`.
fn all_within(parsed: &[(String, u128, String)], bound: Duration, what: &str) {
    for (rank, (_, ms, msg)) in parsed.iter().enumerate() {
        assert!(
            *ms < bound.as_millis(),
            "{what}: rank {rank} took {ms} ms: {msg}"
        );
    }
}

#[test]
fn identity_cases_between_processes() {
    let before = shm_entries();
    // A skipped layer with the persistent buffer: tagged, on the tag (Strict: before
    // data moves, at once); untagged, at the step boundary.
    let p = identity_case(2, "strict", "skip", true, "tag");
    all_within(&p, PROMPT, "skip tagged strict");
    assert!(p.iter().all(|l| l.0 == "first=Some(4)"), "{p:?}");
    // Async: the fourth gather differs; by the sixth at the latest every rank knows.
    let p = identity_case(2, "async", "skip", true, "tag");
    all_within(&p, PROMPT, "skip tagged async");
    for (first, _, _) in &p {
        let at: usize = (first
            .trim_start_matches("first=Some(")
            .trim_end_matches(')'))
        .parse()
        .unwrap_or_else(|_| panic!("{p:?}"));
        assert!(at <= 6, "{p:?}");
    }
    for mode in ["strict", "async"] {
        let p = identity_case(2, mode, "skip", false, "record kind");
        assert!(
            p[0].2.contains("rank 1 has a step boundary (after 7"),
            "{p:?}"
        );
        // The rank behind is at its step boundary: never held by a timeout. (The
        // rank ahead, under Async, may wait in a collective its peer never joins:
        // the backend's timeout bounds it.)
        all_within(&p[1..], PROMPT, mode);
        all_within(&p, IDENTITY_TIMEOUT + PROMPT, mode);
    }
    // Uneven layer counts.
    for mode in ["strict", "async"] {
        let p = identity_case(2, mode, "uneven", false, "record kind");
        assert!(
            p[0].2
                .contains("rank 0 has a collective (this rank's collective #9"),
            "{p:?}"
        );
        all_within(&p[1..], PROMPT, mode);
        all_within(&p, IDENTITY_TIMEOUT + PROMPT, mode);
    }
    // An extra allocation after the last layer (a cache hit): the step boundary's
    // call count.
    for mode in ["strict", "async"] {
        let p = identity_case(2, mode, "extra_alloc", false, "pool call count");
        all_within(&p, PROMPT, mode);
    }
    // An extra allocation that grows the pool: the growth record meets the peers'
    // collective record within one round.
    for world in [2, 3] {
        let p = identity_case(world, "strict", "extra_growth", false, "record kind");
        assert!(
            p[0].2
                .contains(&format!("rank {} has a growth of the pool by", world - 1)),
            "{p:?}"
        );
        all_within(&p, PROMPT, "extra growth strict");
    }
    let p = identity_case(2, "async", "extra_growth", false, "record kind");
    all_within(&p[1..], PROMPT, "extra growth async: the growing rank");
    all_within(&p, IDENTITY_TIMEOUT + PROMPT, "extra growth async");
    // A skipped last collective: at the step boundary, not by a timeout.
    for tagged in [false, true] {
        let p = identity_case(2, "strict", "skip_last", tagged, "record kind");
        assert!(
            p[0].2.contains("rank 1 has a step boundary (after 7"),
            "{p:?}"
        );
        all_within(&p, PROMPT, "skip last strict");
    }
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

/// A careless user's layer loop between processes: untagged calls on a pool with the
/// default settings, the last rank skipping layer 3 of the one persistent gather
/// buffer, or rank 0 running two layers more. Every call is refused before anything
/// moves, in every check mode (`off` included): no call returns another layer's data.
#[test]
fn careless_untagged_layer_loops_between_processes_are_refused() {
    let before = shm_entries();
    for mode in ["strict", "async", "off"] {
        for scenario in ["skip", "uneven"] {
            let extra = vec![
                ("CHECK_MODE", mode.to_string()),
                ("SCENARIO", scenario.to_string()),
                ("CARELESS", "1".to_string()),
            ];
            let [lines] = job_lines(2, "identity", extra, ["@@careless "]);
            for (rank, line) in lines.iter().enumerate() {
                assert_eq!(
                    line,
                    "first=Some(1) refused=true untouched=true wrong_ok=0 end=None closed=Ok(())",
                    "{scenario} {mode}: rank {rank}"
                );
            }
        }
    }
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}
