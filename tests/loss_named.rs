//! A loss is named as a loss: one process per rank on the shared-memory backend, the
//! pools' timeout equal to the store's heartbeat timeout (or half of it), and rank 2
//! of 4 frozen (`SIGSTOP`) while every rank is in async-checked collectives. Whichever
//! wait runs out first, every survivor is told `PeerLost` naming rank 2 (never
//! `GroupBroken` naming a live rank that timed out first, nor a bare `Timeout`), and
//! the README's recovery loop (match on `err.kind()`, shrink, go on) carries them on
//! at world size 3 with correct sums.
//! The frozen rank, resumed (`SIGCONT`) once the survivors went on, is told that the
//! store declared it lost (not that the store's host is gone). Nothing is left in
//! `/dev/shm`.

mod common;

use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use std::time::Duration;
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Error, ErrorKind, Group, GroupConfig, PoolConfig, ReduceOp,
    Stream, SymmPool,
};

const ENTRY: &str = "child_process_entry";
/// The store's heartbeat interval and timeout.
const HEARTBEAT_MS: u64 = 250;
const HEARTBEAT_TIMEOUT_MS: u64 = 2000;
const WORLD: usize = 4;
const FROZEN: usize = 2;
/// Steps every survivor runs at the smaller size before it ends.
const STEPS_AFTER: usize = 5;

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(code) => code,
        Err(e) => {
            println!("@@error {}", describe(&e));
            2
        }
    };
    std::process::exit(code);
}

/// `e` as one line: its kind, its variant, the rank it names, its message.
fn describe(e: &Error) -> String {
    let debug = format!("{e:?}");
    let variant = debug.split([' ', '{', '(']).next().unwrap_or_default();
    let rank = match e {
        Error::PeerLost { rank, .. }
        | Error::GroupBroken { rank, .. }
        | Error::DeclaredLost { rank, .. } => Some(*rank),
        _ => None,
    };
    format!("kind={} variant={variant} rank={rank:?} {e}", e.kind())
}

/// One step: a tagged all-gather and all-reduce of every rank's `rank + 1`, and the
/// step's end; the all-reduce's sum, checked against the gather.
fn step(pool: &SymmPool, coll: &Coll, step: u64) -> symmpool::Result<f32> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let gathered = pool.alloc((world * 256 * 4) as u64, &stream)?;
    (gathered.view::<f32>()?.slice(rank * 256, 256)?).copy_from_host(&[(rank + 1) as f32; 256])?;
    coll.tagged(step << 8)
        .all_gather_in_place::<f32>(&gathered, &stream)?;
    let summed = pool.alloc(256 * 4, &stream)?;
    summed.write(&[(rank + 1) as f32; 256])?;
    coll.tagged(step << 8 | 1)
        .all_reduce_in_place::<f32>(&summed, ReduceOp::Sum, &stream)?;
    coll.end_step()?;
    let sum = summed.read::<f32>()?[0];
    let from_gather: f32 = (gathered.read::<f32>()?.chunks(256)).map(|c| c[0]).sum();
    assert_eq!(sum, from_gather, "rank {rank}, world {world}");
    Ok(sum)
}

fn child() -> symmpool::Result<i32> {
    let (_, world, backend) = join()?;
    let timeout_ms: u64 = (std::env::var("CHILD_POOL_TIMEOUT_MS").ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(HEARTBEAT_TIMEOUT_MS);
    let config = GroupConfig::default()
        .with_timeout(Duration::from_millis(timeout_ms))
        .with_check(CheckMode::Async);
    let mut pool = SymmPool::new(&Group::new(backend, config)?, PoolConfig::default())?;
    let mut coll = Coll::new(&pool)?;
    let (mut at, mut after, mut first_error) = (0u64, 0, true);
    loop {
        match step(&pool, &coll, at) {
            Ok(sum) => {
                at += 1;
                if at == 3 && pool.world_size() == world {
                    println!("@@running");
                }
                if pool.world_size() < world {
                    let n = pool.world_size();
                    assert_eq!(sum, (n * (n + 1) / 2) as f32);
                    after += 1;
                    if after == STEPS_AFTER {
                        break;
                    }
                }
            }
            Err(e) => {
                if std::mem::take(&mut first_error) {
                    println!("@@first_error {}", describe(&e));
                }
                // The README's loop: a loss (of whatever variant) is shrunk past; the
                // rest ends the rank.
                if e.kind() != ErrorKind::PeerLost {
                    println!("@@ended {}", describe(&e));
                    return Ok(3);
                }
                let (next, report) = loop {
                    match pool.shrink() {
                        Err(Error::ShrinkFailed { retry: true, .. }) => continue,
                        other => break other?,
                    }
                };
                println!(
                    "@@shrunk world={} lost={:?}",
                    report.world_size, report.lost_ranks
                );
                drop(coll);
                pool = next;
                coll = Coll::new(&pool)?;
            }
        }
    }
    drop(coll);
    pool.close()?;
    println!("@@done");
    Ok(0)
}

fn signal(job: &Job, rank: usize, sig: i32) {
    let pid = job.children[rank].id() as i32;
    // SAFETY: kill(2) only sends a signal to the test's own child process.
    let sent = unsafe { libc::kill(pid, sig) };
    assert_eq!(sent, 0, "signal {sig} to rank {rank}");
}

#[test]
fn a_frozen_rank_is_named_lost_when_the_pool_timeout_is_the_heartbeat_timeout() {
    frozen_rank_with_pool_timeout(HEARTBEAT_TIMEOUT_MS);
}

#[test]
fn a_frozen_rank_is_named_lost_when_the_pool_timeout_is_half_the_heartbeat_timeout() {
    frozen_rank_with_pool_timeout(HEARTBEAT_TIMEOUT_MS / 2);
}

/// A job of `WORLD` ranks whose pools time out after `pool_timeout_ms`; rank `FROZEN`
/// stopped in the middle of its collectives, and resumed once the others went on.
fn frozen_rank_with_pool_timeout(pool_timeout_ms: u64) {
    let before = shm_entries();
    let env = |_| {
        vec![
            ("SYMMPOOL_HEARTBEAT_INTERVAL_MS", HEARTBEAT_MS.to_string()),
            (
                "SYMMPOOL_HEARTBEAT_TIMEOUT_MS",
                HEARTBEAT_TIMEOUT_MS.to_string(),
            ),
            ("CHILD_POOL_TIMEOUT_MS", pool_timeout_ms.to_string()),
        ]
    };
    let mut job = Job::start(ENTRY, WORLD, env);
    for r in 0..WORLD {
        job.expect(r, "@@running", Duration::from_secs(60));
    }
    signal(&job, FROZEN, libc::SIGSTOP);
    let survivors: Vec<usize> = (0..WORLD).filter(|&r| r != FROZEN).collect();
    let limit = Duration::from_secs(60);
    for &r in &survivors {
        let first = job.expect(r, "@@first_error ", limit);
        assert!(
            first.starts_with(&format!(
                "kind=peer_lost variant=PeerLost rank=Some({FROZEN}) "
            )),
            "rank {r}: {first}\n{:?}",
            job.seen
        );
        let shrunk = job.expect(r, "@@shrunk ", limit);
        assert_eq!(shrunk, format!("world=3 lost=[{FROZEN}]"), "rank {r}");
    }
    let codes = job.wait(&survivors, limit);
    assert_eq!(codes, vec![0; survivors.len()], "{:?}", job.seen);
    for &r in &survivors {
        job.expect(r, "@@done", Duration::from_secs(5));
    }
    // The frozen rank, resumed: told that it was declared lost.
    signal(&job, FROZEN, libc::SIGCONT);
    let told = job.expect(FROZEN, "@@first_error ", limit);
    assert!(
        told.starts_with(&format!(
            "kind=group_lost variant=DeclaredLost rank=Some({FROZEN}) "
        )) && told.contains("declared lost"),
        "{told}"
    );
    assert_eq!(job.wait(&[FROZEN], limit), vec![3], "{:?}", job.seen);
    drop(job);
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}
