//! [`PoolStats`], and the pool's local views of its core (statistics, snapshot,
//! invariant check).

use super::SymmPool;
use super::state::PoolState;
use crate::backend::CommRole;
use crate::core::{CoreStats, Snapshot};
use serde::Serialize;

/// Counters of a pool, beside the core's.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PoolStats {
    /// The allocator core's statistics (`active_bytes` counts freed blocks whose
    /// streams are not yet known to be done).
    pub core: CoreStats,
    /// The role of each communicator, in the backend's order: the index of the
    /// per-communicator counts below.
    pub roles: Vec<CommRole>,
    /// Window registrations made, per communicator.
    pub registrations: Vec<u64>,
    /// Windows currently registered (NCCL returned a window), per communicator.
    pub windows: Vec<u64>,
    /// Deregistrations made, per communicator.
    pub deregistrations: Vec<u64>,
    /// Agreements among ranks (growth, reserve, trim, close).
    pub agreements: u64,
    /// Time spent allocating and registering segments, in seconds.
    pub growth_seconds: f64,
    /// Pool calls recorded in the history.
    pub calls: u64,
}

impl SymmPool {
    /// Tell the core which fences are complete (only the `active_bytes` statistic
    /// depends on it). A failed query is logged and ends the refresh: the blocks it
    /// did not ask about still count as active.
    pub(crate) fn refresh_fences(&self, st: &mut PoolState) {
        let streams = self.inner.backend.streams();
        for &sid in &st.fenced_streams.clone() {
            match streams.completed_fence(sid) {
                Ok(Some(fence)) => st.core.complete_fences(sid, fence),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(target: "symmpool::pool", rank = self.rank(), error = %e,
                        "querying fences for statistics failed");
                    return;
                }
            }
        }
    }

    /// Statistics of the pool and its core. Asks the device which fences completed
    /// first, so `active_bytes` falls back to the live figure once the streams that
    /// used freed blocks are done.
    ///
    /// Deprecated: [`memory_stats`](Self::memory_stats) is the one statistics API
    /// (PyTorch's keys, and every figure of this struct under its own key).
    #[deprecated(since = "0.1.0", note = "use memory_stats(), the one statistics API")]
    pub fn stats(&self) -> PoolStats {
        let mut st = self.state();
        self.refresh_fences(&mut st);
        let comms = self.inner.backend.communicators();
        let mut windows = vec![0; comms.len()];
        for entry in st.segments.values() {
            for (c, w) in entry.windows.iter().enumerate() {
                windows[c] += u64::from(w.is_some());
            }
        }
        PoolStats {
            roles: comms.iter().map(|c| c.role).collect(),
            core: st.core.stats(),
            registrations: st.counters.registrations.clone(),
            windows,
            deregistrations: st.counters.deregistrations.clone(),
            agreements: st.counters.agreements,
            growth_seconds: st.counters.growth_time.as_secs_f64(),
            calls: st.history.seq(),
        }
    }

    /// Reset the peaks of the core's statistics.
    pub fn reset_peak(&self) {
        self.state().core.reset_peak();
    }

    /// Every segment and block (serialisable with serde).
    ///
    /// Deprecated: [`memory_snapshot`](Self::memory_snapshot) is the one snapshot API
    /// (the same segments and blocks, with windows, allocation numbers, fenced
    /// states and the statistics).
    #[deprecated(since = "0.1.0", note = "use memory_snapshot(), the one snapshot API")]
    pub fn snapshot(&self) -> Snapshot {
        self.state().core.snapshot()
    }

    /// Run the core's invariant check (for tests and debugging).
    ///
    /// # Errors
    /// The violation found.
    pub fn check_invariants(&self) -> std::result::Result<(), crate::core::InvariantViolation> {
        self.state().core.check_invariants()
    }
}
