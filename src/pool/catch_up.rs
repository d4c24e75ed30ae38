//! A shrink's first round: survivors of a loss that stopped a few pool calls apart
//! (one learned of the loss before its next allocation, another just after it) are
//! brought to the same call before they agree, instead of failing as diverged.

use super::SymmPool;
use super::state::PoolState;
use crate::control::gather_records;
use crate::core::{AllocError, AllocRequest, StreamId};
use crate::deadline::Deadline;
use crate::error::Result;
use crate::group::{CallKind, Stop, catch_up};
use std::collections::BTreeMap;

impl SymmPool {
    /// The survivors send where their pools stopped ([`Stop`]); each replays on its
    /// core and history the calls it lacks of the one furthest on, as [`catch_up`]
    /// says (allocations on no stream of its own, the frees of those, and the failed
    /// agreements of a `reserve`, `trim` or `fit_to_peak` as records only), and the
    /// blocks allocated after the earliest stop that are live then are pinned on every
    /// rank (no buffer of them on the ranks that replayed). When they cannot be caught
    /// up nothing changes, and the shrink's agreement reports what differs. Returns the
    /// number of blocks pinned.
    ///
    /// # Collective
    /// Every survivor, in its shrink.
    ///
    /// # Errors
    /// Those of the round ([`gather_records`]).
    pub(super) fn catch_up(&self, st: &mut PoolState, deadline: Deadline) -> Result<u64> {
        let allocs = st.core.stats().num_allocs;
        let exchange = self.inner.backend.exchange();
        let stop = Stop::of(&st.history, allocs);
        let stops = gather_records(exchange, self.inner.channel, "shrink", &stop, deadline)?;
        let Some((calls, pinned)) = catch_up(&stops, self.rank()) else {
            return Ok(0);
        };
        let mut replayed = BTreeMap::new();
        for c in &calls {
            let done = match c.kind {
                CallKind::Alloc => {
                    let request = AllocRequest::new(c.a, StreamId(0)).with_align(c.b);
                    // An allocation that needed a growth is recorded before it grows; the
                    // growth could not be agreed with a rank lost, so it left no block.
                    match st.core.alloc(request) {
                        Ok(p) => replayed.insert(p.block.seq, p.block).is_none(),
                        Err(e) => matches!(e, AllocError::NeedsGrowth(_)),
                    }
                }
                CallKind::Free => {
                    (replayed.remove(&c.a)).is_some_and(|b| st.core.free(b, &[]).is_ok())
                }
                // A `reserve`, `trim` or `fit_to_peak` whose agreement failed: recorded.
                _ => true,
            };
            if !done {
                // Not the furthest one's call after all: the agreement names the difference.
                break;
            }
            st.history.record(c.kind, c.a, c.b);
        }
        let live: Vec<u64> = (st.allocated().into_iter())
            .filter(|q| pinned.contains(q))
            .collect();
        st.pinned.extend(&live);
        st.pinned_freed.extend(live.iter().filter(|&&q| q > allocs));
        tracing::info!(target: "symmpool::pool", pool = %self.inner.config.name, rank = self.rank(),
            replayed = calls.len(), pinned = live.len(),
            "the survivors had stopped some pool calls apart: caught up");
        Ok(live.len() as u64)
    }
}
