//! A pool's figures as the tests read them, from `SymmPool::memory_stats` (the one
//! statistics API; the typed `PoolStats` went with the deprecated `stats()`).
#![allow(dead_code)]

use symmpool::SymmPool;
use symmpool::backend::CommRole;
use symmpool::observe::MemoryStats;

/// The count under `key` (panics naming a key that is missing or not a count).
pub fn count(stats: &MemoryStats, key: &str) -> u64 {
    (stats.get(key).and_then(|v| v.as_u64()))
        .unwrap_or_else(|| panic!("no count {key:?} in the statistics {stats:?}"))
}

/// The count under `key` in `pool`'s statistics now.
pub fn stat(pool: &SymmPool, key: &str) -> u64 {
    count(&pool.memory_stats(), key)
}

/// `pool`'s segments now.
pub fn segments(pool: &SymmPool) -> u64 {
    stat(pool, "segment.all.current")
}

/// `what` (`registrations`, `deregistrations` or `windows`) per communicator of
/// `pool`'s backend, in the backend's order, from `stats`' per-role keys (the host
/// backends have one communicator per role; where several share a role, each gets
/// the role's total).
pub fn per_comm(pool: &SymmPool, stats: &MemoryStats, what: &str) -> Vec<u64> {
    let role = |r: CommRole| match r {
        CommRole::Symmetric => "symmetric",
        CommRole::CopyEngine => "copy_engine",
        CommRole::Plain => "plain",
    };
    (pool.backend().communicators().iter())
        .map(|c| count(stats, &format!("{what}.{}", role(c.role))))
        .collect()
}
