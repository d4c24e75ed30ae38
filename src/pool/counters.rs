//! Lock-free counters a pool keeps for observers: failed allocations, deferred frees.

use std::sync::atomic::AtomicU64;

/// Counters a pool keeps beside its state, updated without its lock.
#[derive(Debug, Default)]
pub(crate) struct PoolCounters {
    /// Allocation calls that failed for want of memory (pool limit, device, peer).
    pub(crate) ooms: AtomicU64,
    /// Frees queued because the pool's state was busy (applied by the next call).
    pub(crate) deferred_frees: AtomicU64,
}
