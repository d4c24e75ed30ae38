//! One process per rank on the shared-memory host backend, as real jobs run: 2, 4 and 8
//! processes place identically, move and reduce real data through each other's
//! memory, report a divergence on every rank naming the first differing call, and a
//! rank killed with `kill -9` in an agreement is reported by every survivor, naming
//! it, within the control plane's bound. Nothing is left in `/dev/shm`.

mod common;

use common::procs::{CHILD, Job};
use common::rng::Rng;
use common::shm::{join, shm_entries};
use std::time::{Duration, Instant};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Error, Group, GroupConfig, PoolConfig, ReduceOp, Stream,
    SymmPool, coll,
};

const MIB: u64 = 1 << 20;
const ENTRY: &str = "child_process_entry";

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
    let (rank, world, backend) = join()?;
    match var("CHILD_ROLE").as_deref() {
        Some("checked") => return checked_child(rank, world, backend),
        Some("strict_cost") => return strict_cost_child(rank, backend),
        Some("stall") => return stall_child(rank, backend),
        _ => {}
    }
    // PyTorch's caching policy: every large request grows the pool (an agreement), so
    // the divergence test sees one at call 3.
    let group = GroupConfig::default().with_timeout(Duration::from_secs(60));
    let group = Group::new(backend, group)?;
    let config = PoolConfig::default().with_core(symmpool::CoreConfig::default());
    let pool = SymmPool::new(&group, config)?;
    let stream = Stream::host();
    match var("CHILD_ROLE").as_deref() {
        Some("collectives") => {
            let coll = Coll::new(&pool)?;
            // The same seeded call sequence on every rank: placements must agree.
            let mut rng = Rng(7);
            let mut live = Vec::new();
            let mut digest = 0u64;
            for _ in 0..40 {
                if !live.is_empty() && rng.next().is_multiple_of(3) {
                    let i = (rng.next() % live.len() as u64) as usize;
                    live.swap_remove(i);
                } else {
                    let bytes = 1 + rng.next() % (24 * MIB);
                    let b = pool.alloc(bytes, &stream)?;
                    digest =
                        digest.rotate_left(7) ^ (b.segment().0 as u64) << 40 ^ b.offset_bytes();
                    live.push(b);
                }
            }
            drop(live);
            // All-gather in place: each rank's shard lands in every rank's buffer.
            // Odd sizes; smaller with more ranks (the plain path moves every rank's
            // input through the control plane).
            let n = 400_009 / world;
            let params = pool.alloc((world * n * 4) as u64, &stream)?;
            let shard: Vec<f32> = (0..n).map(|i| (rank * 1_000_000 + i) as f32).collect();
            params
                .view::<f32>()?
                .slice(rank * n, n)?
                .copy_from_host(&shard)?;
            let report = coll
                .tagged(0)
                .all_gather_in_place::<f32>(&params, &stream)?;
            let all = params.read::<f32>()?;
            for r in 0..world {
                for i in [0, n / 2, n - 1] {
                    assert_eq!(
                        all[r * n + i],
                        (r * 1_000_000 + i) as f32,
                        "rank {r} element {i}"
                    );
                }
            }
            // Reduce-scatter (sum) out of place, on both paths.
            for plain in [false, true] {
                let input = pool.alloc((world * n * 4) as u64, &stream)?;
                let out = pool.alloc((n * 4) as u64, &stream)?;
                let mine: Vec<f32> = (0..world * n).map(|i| (i % 97 + rank) as f32).collect();
                input.write(&mine)?;
                let policy = coll::PathPolicy::default().with_choices(
                    coll::Choice::Auto,
                    if plain {
                        coll::Choice::Prefer(coll::Path::PlainKernel)
                    } else {
                        coll::Choice::Prefer(coll::Path::SymmetricKernel)
                    },
                );
                coll.set_path_policy(policy);
                let rs =
                    coll.tagged(0)
                        .reduce_scatter::<f32>(&input, &out, ReduceOp::Sum, &stream)?;
                let got = out.read::<f32>()?;
                let ranks_sum = (world * (world - 1) / 2) as f32;
                for i in [0, n / 3, n - 1] {
                    let want = world as f32 * ((rank * n + i) % 97) as f32 + ranks_sum;
                    assert_eq!(got[i], want, "{:?} element {i}", rs.path);
                }
                println!("@@path {:?}", rs.path);
            }
            println!("@@placement {digest:016x} all-gather {:?}", report.path);
            drop((params, coll));
            pool.close()?;
            Ok(0)
        }
        Some("diverge") => {
            // Rank 1 asks for another size at call 3; the growth agreement names it.
            let mut keep = Vec::new();
            for call in 1..=3u64 {
                let bytes = if call == 3 && rank == 1 {
                    48 * MIB
                } else {
                    32 * MIB
                };
                match pool.alloc(bytes, &stream) {
                    Ok(b) => keep.push(b),
                    Err(Error::Divergence(d)) => {
                        println!("@@divergence first={:?}", d.first_differing_call);
                        return Ok(0);
                    }
                    Err(e) => return Err(e),
                }
            }
            println!("@@no divergence");
            Ok(3)
        }
        Some("victim") => {
            let victim: usize = var("CHILD_VICTIM")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let b = pool.alloc(4 * MIB, &stream)?;
            drop(b);
            if rank == victim {
                println!("@@stalled");
                std::thread::sleep(Duration::from_secs(300));
                return Ok(9);
            }
            println!("@@waiting");
            let t0 = Instant::now();
            match pool.trim() {
                Err(Error::PeerLost { rank: lost, op, .. }) => {
                    println!(
                        "@@lost rank={lost} op={op} after={}ms",
                        t0.elapsed().as_millis()
                    );
                    Ok(0)
                }
                other => {
                    println!("@@unexpected {other:?}");
                    Ok(3)
                }
            }
        }
        other => {
            println!("@@unknown role {other:?}");
            Ok(4)
        }
    }
}

/// How long the stalled-peer scenario lets rank 0 wait for rank 1.
const STALL_TIMEOUT: Duration = Duration::from_millis(500);

/// Rank 1 makes the pool, then stalls (alive, connected, never arriving); rank 0's
/// growth or a registration of its own (`CHILD_STALL`) fails within its timeout + 1 s.
fn stall_child(rank: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
    let group = Group::new(
        backend.clone(),
        GroupConfig::default().with_timeout(STALL_TIMEOUT),
    )?;
    let pool = SymmPool::new(&group, PoolConfig::default())?;
    if rank == 1 {
        println!("@@stalled");
        std::thread::sleep(Duration::from_secs(300));
        return Ok(9);
    }
    let t0 = Instant::now();
    let outcome = if var("CHILD_STALL").as_deref() == Some("growth") {
        pool.alloc(4 * MIB, &Stream::host()).map(drop)
    } else {
        let segment = backend.segments().allocate(2 * MIB)?;
        // SAFETY: a new segment, registered once on communicator 0; rank 1 never
        // registers, so the registration times out instead of pairing anything.
        unsafe {
            backend
                .segments()
                .register(&segment, 0, symmpool::Deadline::after(STALL_TIMEOUT))
        }
        .map(drop)
    };
    let took = t0.elapsed();
    let in_time = took < STALL_TIMEOUT + Duration::from_secs(1);
    let timed_out = matches!(outcome, Err(Error::Timeout { .. }));
    println!("@@outcome {in_time} {timed_out} ({took:?}, {outcome:?})");
    Ok(0)
}

/// The checked-collective scenarios as processes (the last rank is perturbed): a free
/// and an allocation in another order, a skipped all-gather, crossed pools.
fn checked_child(rank: usize, world: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
    let mode = match var("CHECK_MODE").as_deref() {
        Some("strict") => CheckMode::Strict,
        _ => CheckMode::Async,
    };
    let config = GroupConfig::default()
        .with_timeout(Duration::from_secs(5))
        .with_check(mode)
        .with_check_queue(CHECK_QUEUE);
    // Both pools in the rank's one group (they share communicators).
    let group = Group::new(backend, config)?;
    let a = SymmPool::new(&group, PoolConfig::default().with_name("a"))?;
    let b = SymmPool::new(&group, PoolConfig::default().with_name("b"))?;
    let coll = Coll::with_pools(&[a.clone(), b.clone()])?;
    let stream = Stream::host();
    let perturbed = rank == world - 1;
    drop(a.alloc(MIB, &stream)?);
    drop(b.alloc(MIB, &stream)?);
    let mut calls = 0usize;
    let mut first: Option<(usize, Error, bool)> = None;
    let mut call = |buf: &symmpool::SymmBuffer| -> bool {
        calls += 1;
        let pattern: Vec<u8> = (0..buf.len_bytes() as usize)
            .map(|i| ((rank * 37 + i + calls) % 251) as u8 + 1)
            .collect();
        buf.write(&pattern).unwrap();
        match coll.tagged(0).all_gather_in_place::<f32>(buf, &stream) {
            Ok(_) => true,
            Err(e) => {
                let untouched = buf.read::<u8>().unwrap() == pattern;
                first = Some((calls, e, untouched));
                false
            }
        }
    };
    let more = CHECK_QUEUE + 3;
    let mut alloc_failed = None;
    match var("SCENARIO").as_deref() {
        Some("free_order") => {
            let x = a.alloc(4096, &stream)?;
            let y = a.alloc(8192, &stream)?;
            let _z = a.alloc(4096, &stream)?;
            drop(x);
            let c = if perturbed {
                let c = a.alloc(8192, &stream)?;
                drop(y);
                c
            } else {
                drop(y);
                a.alloc(8192, &stream)?
            };
            for _ in 0..more {
                if !call(&c) {
                    break;
                }
            }
        }
        Some("skip") => {
            for layer in 0..more + 2 {
                // Under Async a detected divergence fails the next allocation too.
                let buf = match a.alloc(8192, &stream) {
                    Ok(buf) => buf,
                    Err(e) => {
                        alloc_failed = Some(e);
                        break;
                    }
                };
                if perturbed && layer == 1 {
                    continue;
                }
                if !call(&buf) {
                    break;
                }
            }
        }
        Some("crossed") => {
            let x = a.alloc(8192, &stream)?;
            let y = b.alloc(8192, &stream)?;
            'outer: for i in 0..more {
                let order = if perturbed && i == 0 {
                    [&y, &x]
                } else {
                    [&x, &y]
                };
                for buf in order {
                    if !call(buf) {
                        break 'outer;
                    }
                }
            }
        }
        other => {
            println!("@@unknown scenario {other:?}");
            return Ok(4);
        }
    }
    if first.is_none()
        && let Some(e) = alloc_failed
    {
        first = Some((calls + 1, e, true));
    }
    let after = coll.wait_checks().err();
    let field = |e: &Error| match e {
        Error::CollectiveDivergence(d) => d.field.to_string(),
        other => format!("{other:?}")
            .split([' ', '{', '('])
            .next()
            .unwrap_or("")
            .to_string(),
    };
    match (first, after) {
        (Some((at, e, untouched)), after) => println!(
            "@@checked at={at} first={} untouched={untouched} after={}",
            field(&e),
            after.as_ref().map_or("none".into(), field)
        ),
        (None, _) => println!("@@checked none"),
    }
    Ok(0)
}

/// The async check queue (`GroupConfig::check_queue`'s default).
const CHECK_QUEUE: usize = 1;

/// The cost of the strict check: the same all-gathers on an `Off` pool and on a
/// `Strict` pool of one backend; rank 0 prints microseconds per call of each.
fn strict_cost_child(rank: usize, backend: symmpool::Backend) -> symmpool::Result<i32> {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(30));
    let off = Group::new(backend.clone(), config.clone().with_check(CheckMode::Off))?;
    let off = SymmPool::new(&off, PoolConfig::default().with_name("off"))?;
    // Communicators of its own (one handle per communicator set), split off the
    // backend's, in a group of another check mode (`Group::split` keeps the mode).
    let strict = Group::new(
        backend.split("strict")?,
        config.with_check(CheckMode::Strict),
    )?;
    let strict = SymmPool::new(&strict, PoolConfig::default().with_name("strict"))?;
    let colls = [Coll::new(&off)?, Coll::new(&strict)?];
    let stream = Stream::host();
    let n: usize = var("CALLS").and_then(|v| v.parse().ok()).unwrap_or(300);
    // Per mode: every call's time in microseconds, over its two blocks.
    let mut calls_us = [Vec::new(), Vec::new()];
    for (mode, pool) in [(0, &off), (1, &strict), (0, &off), (1, &strict)] {
        let buf = pool.alloc(64 << 10, &stream)?;
        for _ in 0..n {
            let t = Instant::now();
            colls[mode]
                .tagged(0)
                .all_gather_in_place::<f32>(&buf, &stream)?;
            calls_us[mode].push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    if rank == 0 {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (off_us, strict_us) = (mean(&calls_us[0]), mean(&calls_us[1]));
        let [mut off_calls, mut strict_calls] = calls_us;
        let (off_p50, strict_p50) = (median(&mut off_calls), median(&mut strict_calls));
        println!(
            "@@strict_cost off_us={off_us:.1} strict_us={strict_us:.1} added_us={:.1} \
             off_p50_us={off_p50:.1} strict_p50_us={strict_p50:.1} added_p50_us={:.1}",
            strict_us - off_us,
            strict_p50 - off_p50
        );
    }
    Ok(0)
}

fn role(role: &'static str) -> impl Fn(usize) -> Vec<(&'static str, String)> {
    // The store's default heartbeat timeout: 8 processes on 2 cores moving data
    // through the store must not look frozen.
    move |_| {
        vec![
            ("CHILD_ROLE", role.to_string()),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
        ]
    }
}

#[test]
fn processes_place_identically_and_move_real_data() {
    let before = shm_entries();
    for world in [2, 4, 8] {
        let mut job = Job::start(ENTRY, world, role("collectives"));
        let all: Vec<usize> = (0..world).collect();
        let codes = job.wait(&all, Duration::from_secs(240));
        if codes != vec![0; world] {
            // Whatever the ranks said (their errors, panics), then fail.
            let _ = job.expect(usize::MAX, "never", Duration::from_millis(500));
        }
        let placements: Vec<String> = all
            .iter()
            .map(|&r| job.expect(r, "@@placement ", Duration::from_secs(5)))
            .collect();
        assert!(
            placements.iter().all(|p| *p == placements[0]),
            "world {world}: {placements:?}"
        );
        assert!(
            placements[0].contains("all-gather SymmetricKernel"),
            "{placements:?}"
        );
        let paths: Vec<String> = (0..2)
            .map(|_| job.expect(0, "@@path ", Duration::from_secs(5)))
            .collect();
        assert_eq!(paths, ["SymmetricKernel", "PlainKernel"]);
    }
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

#[test]
fn a_divergence_between_processes_names_the_first_differing_call_on_every_rank() {
    let mut job = Job::start(ENTRY, 3, role("diverge"));
    let codes = job.wait(&[0, 1, 2], Duration::from_secs(120));
    assert_eq!(codes, vec![0; 3], "{:?}", job.seen);
    for r in 0..3 {
        assert_eq!(
            job.expect(r, "@@divergence ", Duration::from_secs(5)),
            "first=Some(3)"
        );
    }
}

#[test]
fn kill_9_in_an_agreement_is_reported_by_every_survivor_naming_the_rank() {
    let before = shm_entries();
    let world = 4;
    let victim = 2;
    let mut job = Job::start(ENTRY, world, |_| {
        vec![
            ("CHILD_ROLE", "victim".to_string()),
            ("CHILD_VICTIM", victim.to_string()),
        ]
    });
    job.expect(victim, "@@stalled", Duration::from_secs(120));
    let others: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    for &r in &others {
        job.expect(r, "@@waiting", Duration::from_secs(60));
    }
    let t0 = Instant::now();
    job.children[victim].kill().unwrap();
    let codes = job.wait(&others, Duration::from_secs(60));
    let took = t0.elapsed();
    assert_eq!(codes, vec![0; others.len()], "{:?}", job.seen);
    for &r in &others {
        let line = job.expect(r, "@@lost ", Duration::from_secs(5));
        assert!(
            line.starts_with(&format!("rank={victim} op=trim")),
            "{line}"
        );
    }
    // The control plane's bound for a dead process: its socket closes at once.
    assert!(took < Duration::from_secs(10), "survivors took {took:?}");
    drop(job);
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

#[test]
fn a_stalled_peer_fails_growth_and_registration_within_the_timeout() {
    for what in ["growth", "registration"] {
        let mut job = Job::start(ENTRY, 2, |_| {
            vec![
                ("CHILD_ROLE", "stall".to_string()),
                ("CHILD_STALL", what.to_string()),
            ]
        });
        job.expect(1, "@@stalled", Duration::from_secs(120));
        let codes = job.wait(&[0], Duration::from_secs(60));
        assert_eq!(codes, vec![0], "{:?}", job.seen);
        // Within the timeout + 1 s, with a timeout.
        let outcome = job.expect(0, "@@outcome ", Duration::from_secs(5));
        assert!(outcome.starts_with("true true"), "{what}: {outcome}");
    }
}

fn checked_job(world: usize, mode: &'static str, scenario: &'static str) -> Vec<String> {
    let mut job = Job::start(ENTRY, world, move |_| {
        vec![
            ("CHILD_ROLE", "checked".to_string()),
            ("CHECK_MODE", mode.to_string()),
            ("SCENARIO", scenario.to_string()),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
        ]
    });
    let all: Vec<usize> = (0..world).collect();
    let codes = job.wait(&all, Duration::from_secs(120));
    assert_eq!(
        codes,
        vec![0; world],
        "{mode} {scenario} world {world}: {:?}",
        job.seen
    );
    all.iter()
        .map(|&r| job.expect(r, "@@checked ", Duration::from_secs(5)))
        .collect()
}

#[test]
fn checked_collectives_between_processes_strict() {
    // Strict: every rank fails at the diverging collective, its buffer untouched.
    for (world, scenario, at, field) in [
        (2, "free_order", 1, "input offset"),
        (4, "free_order", 1, "input offset"),
        (8, "free_order", 1, "input offset"),
        (2, "skip", 2, "input allocation"),
        (4, "skip", 2, "input allocation"),
    ] {
        for line in checked_job(world, "strict", scenario) {
            assert!(
                line.starts_with(&format!("at={at} first={field} untouched=true")),
                "{scenario} world {world}: {line}"
            );
        }
    }
    // Crossed pools: one handle's records are one sequence, so the first crossed
    // call differs in its pool, on every rank, before any data moves.
    for line in checked_job(2, "strict", "crossed") {
        assert!(
            line.starts_with("at=1 first=pool (channel ordinal) untouched=true"),
            "{line}"
        );
    }
}

#[test]
fn checked_collectives_between_processes_async() {
    // Async: an error on every rank within the bound (divergent call + queue + 1),
    // and the divergence named by `wait_checks` on every rank.
    for (world, scenario, field) in [
        (2, "free_order", "input offset"),
        (4, "free_order", "input offset"),
        (2, "skip", "input allocation"),
        (4, "skip", "input allocation"),
    ] {
        for line in checked_job(world, "async", scenario) {
            let at: usize = line
                .strip_prefix("at=")
                .and_then(|l| l.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{scenario} world {world}: {line}"));
            assert!(
                at <= 2 + CHECK_QUEUE + 1,
                "{scenario} world {world}: {line}"
            );
            assert!(
                line.ends_with(&format!("after={field}")),
                "{scenario} world {world}: {line}"
            );
        }
    }
}

#[test]
fn crossed_pools_between_processes_are_refused_at_the_first_call() {
    // Under Async too: the first crossed call fails on every rank before any data
    // moves (each call carries its pool, and the shared-memory backend refuses a
    // pairing of two pools' calls, or the check names the pool first), and
    // `wait_checks` names the pool.
    for line in checked_job(2, "async", "crossed") {
        assert!(line.starts_with("at=1 first="), "{line}");
        assert!(line.contains("untouched=true"), "{line}");
        assert!(line.ends_with("after=pool (channel ordinal)"), "{line}");
    }
}

/// Not a timed test: prints the strict check's cost with 8 processes on loopback
/// (recorded in BENCHMARKS.md). Run with `--ignored --nocapture`.
#[test]
#[ignore = "measurement: run with --ignored --nocapture"]
fn strict_check_cost_with_8_processes() {
    let mut job = Job::start(ENTRY, 8, |_| {
        vec![
            ("CHILD_ROLE", "strict_cost".to_string()),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
        ]
    });
    let all: Vec<usize> = (0..8).collect();
    let codes = job.wait(&all, Duration::from_secs(300));
    assert_eq!(codes, vec![0; 8], "{:?}", job.seen);
    println!(
        "strict check, 8 processes: {}",
        job.expect(0, "@@strict_cost ", Duration::from_secs(5))
    );
}
