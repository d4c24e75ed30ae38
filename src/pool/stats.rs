//! The flat statistics' value types ([`MemoryStats`], built by
//! [`observe`](crate::observe)), and the pool's local views of its core (fences for
//! the statistics, peaks, invariant check).

use super::SymmPool;
use super::state::PoolState;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// One value of the flat statistics: a count (bytes, calls) or a real (seconds).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum StatValue {
    /// A count or a size in bytes.
    Count(u64),
    /// A real number (seconds).
    Real(f64),
}

impl StatValue {
    /// The count, or `None` for a real.
    pub fn as_u64(self) -> Option<u64> {
        match self {
            StatValue::Count(n) => Some(n),
            StatValue::Real(_) => None,
        }
    }

    /// The value as a real.
    pub fn as_f64(self) -> f64 {
        match self {
            StatValue::Count(n) => n as f64,
            StatValue::Real(x) => x,
        }
    }
}

impl fmt::Display for StatValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StatValue::Count(n) => write!(f, "{n}"),
            StatValue::Real(x) => write!(f, "{x}"),
        }
    }
}

/// The flat statistics: key → value, keys as in the table of [`observe`](crate::observe).
pub type MemoryStats = BTreeMap<String, StatValue>;

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

    /// Reset the peaks of the core's statistics.
    pub fn reset_peak(&self) {
        self.state().core.reset_peak();
    }

    /// Run the core's invariant check (for tests and debugging).
    ///
    /// # Errors
    /// The violation found.
    pub fn check_invariants(&self) -> std::result::Result<(), crate::core::InvariantViolation> {
        self.state().core.check_invariants()
    }
}
