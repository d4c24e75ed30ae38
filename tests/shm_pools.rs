//! Pools per thread and calls that know who they are, with one process per rank on the
//! shared-memory backend: two pools with communicators of their own on two threads per
//! rank, and the identity cases of `tests/coll_identity.rs` (a skipped layer with a
//! persistent buffer, uneven layer counts, an extra allocation, a skipped last
//! collective). Every job is bounded and leaves no process (the job kills and reaps
//! its children on every path) and no `/dev/shm` file.
#![cfg(target_os = "linux")]

mod common;

use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use std::time::Duration;
use symmpool::{CheckMode, PoolConfig, SymmPool};

const ENTRY: &str = "child_process_entry";
/// The pools' and the backend's timeout.
const TIMEOUT: Duration = Duration::from_secs(20);

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
    let (_, _, backend) = join(TIMEOUT)?;
    match var("CHILD_ROLE").as_deref() {
        Some("two_pools") => two_pools_child(backend),
        other => {
            println!("@@unknown role {other:?}");
            Ok(4)
        }
    }
}

/// A parameter pool and a gradient pool with communicators of their own, used from
/// two threads (`common::two_pools`); prints each thread's outcome.
fn two_pools_child(backend: symmpool::Backend) -> symmpool::Result<i32> {
    let config = PoolConfig::default()
        .with_timeout(TIMEOUT)
        .with_check(match var("CHECK_MODE").as_deref() {
            Some("strict") => CheckMode::Strict,
            _ => CheckMode::Async,
        })
        .with_own_communicators(true);
    let params = SymmPool::new(backend.clone(), config.clone().with_name("params"))?;
    let grads = SymmPool::new(backend, config.with_name("grads"))?;
    let [p, g] = common::two_pools::params_and_grads(&params, &grads, 20);
    println!("@@two_pools params={p:?} grads={g:?}");
    params.close()?;
    grads.close()?;
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

/// Run `role` on `world` processes; every rank's line after `prefix`.
fn job_lines(
    world: usize,
    role: &'static str,
    extra: Vec<(&'static str, String)>,
    prefix: &str,
) -> Vec<String> {
    let mut job = Job::start(ENTRY, world, env(role, extra));
    let all: Vec<usize> = (0..world).collect();
    let codes = job.wait(&all, Duration::from_secs(180));
    assert_eq!(codes, vec![0; world], "{role}: {:?}", job.seen);
    all.iter()
        .map(|&r| job.expect(r, prefix, Duration::from_secs(5)))
        .collect()
}

#[test]
fn two_pools_with_their_own_communicators_on_two_threads_per_process() {
    let before = shm_entries();
    for (world, mode) in [(2, "async"), (2, "strict"), (3, "async")] {
        let lines = job_lines(
            world,
            "two_pools",
            vec![("CHECK_MODE", mode.to_string())],
            "@@two_pools ",
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
