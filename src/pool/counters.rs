//! Lock-free counters a pool keeps for observers: collectives per path (indexed by
//! the collectives' path number), failed allocations, deferred frees.

use std::sync::atomic::{AtomicU64, Ordering};

/// Collectives run on one path: calls and bytes per rank.
#[derive(Debug, Default)]
struct PathCounter {
    count: AtomicU64,
    bytes: AtomicU64,
}

/// Counters a pool keeps beside its state, updated without its lock.
#[derive(Debug, Default)]
pub(crate) struct PoolCounters {
    paths: [PathCounter; 3],
    /// Allocation calls that failed for want of memory (pool limit, device, peer).
    pub(crate) ooms: AtomicU64,
    /// Frees queued because the pool's state was busy (applied by the next call).
    pub(crate) deferred_frees: AtomicU64,
}

impl PoolCounters {
    /// Count one collective that ran on path number `path` with `bytes_per_rank`.
    ///
    /// A load and a store, not a locked read-modify-write (this is on every
    /// collective's path): exact because one rank's collectives on a pool are ordered
    /// (every rank must issue them in the same order, so calls from several threads
    /// are synchronised by the caller, and that synchronisation orders these
    /// accesses too).
    #[inline]
    pub(crate) fn collective(&self, path: usize, bytes_per_rank: u64) {
        let Some(c) = self.paths.get(path) else {
            return;
        };
        let n = c.count.load(Ordering::Relaxed);
        c.count.store(n.wrapping_add(1), Ordering::Relaxed);
        let b = c.bytes.load(Ordering::Relaxed);
        c.bytes
            .store(b.wrapping_add(bytes_per_rank), Ordering::Relaxed);
    }

    /// (calls, bytes per rank) of collectives on path number `path`.
    pub(crate) fn collectives(&self, path: usize) -> (u64, u64) {
        self.paths.get(path).map_or((0, 0), |c| {
            (
                c.count.load(Ordering::Relaxed),
                c.bytes.load(Ordering::Relaxed),
            )
        })
    }
}
