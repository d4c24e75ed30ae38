//! Frees: a dropped [`SymmBuffer`] returns its block with one fence per stream that
//! used it, never waiting for the pool's state (a busy state queues the free for the
//! next call), and failures inside `Drop` wait for the next fallible call.

use super::state::PoolState;
use super::{SymmBuffer, SymmPool};
use crate::core::{BlockId, Wait};
use crate::error::{Error, Result};
use crate::group::CallKind;
use smallvec::SmallVec;
use std::sync::TryLockError;
use std::sync::atomic::Ordering;

impl SymmPool {
    /// The error a `Drop` recorded, if any (taken: reported once).
    pub(crate) fn take_deferred_error(&self) -> Result<()> {
        self.inner.deferred_error.lock().take().map_or(Ok(()), Err)
    }

    /// Record a failure inside a `Drop` for the next fallible call (the first one
    /// wins until it is reported).
    pub(crate) fn record_deferred_error(&self, during: String, error: Error) {
        tracing::error!(target: "symmpool::pool", rank = self.rank(), during = %during,
            error = %error, "failure inside a drop, returned by the next call");
        let source = Box::new(error);
        (self.inner.deferred_error.lock()).get_or_insert(Error::Deferred { during, source });
    }

    /// Apply frees that found the state busy, in the order they were made.
    pub(super) fn apply_deferred(&self, st: &mut PoolState) {
        let pending = std::mem::take(&mut *self.inner.deferred.lock());
        if !pending.is_empty() {
            tracing::debug!(target: "symmpool::pool", rank = self.rank(), count = pending.len(),
                "deferred frees applied");
        }
        for (block, fences) in pending {
            self.apply_free(st, block, &fences);
        }
    }

    fn apply_free(&self, st: &mut PoolState, block: BlockId, fences: &[Wait]) {
        if st.closed {
            return;
        }
        // Pinned: another rank holds the block with no buffer to free it.
        if st.pinned.contains(&block.seq) {
            st.pinned_freed.insert(block.seq);
            return;
        }
        // Where the block is and its stream, for the allocation history (only while
        // recording).
        let seen = st.memory_history.is_some().then(|| {
            let at = st.core.locate(block).ok();
            let stream = (st.core.streams_of(block).ok()).and_then(|s| s.first().copied());
            (at, stream)
        });
        match st.core.free(block, fences) {
            Ok(()) => {
                if let Some((Some(at), stream)) = seen {
                    let address = st.segments.get(&at.0).and_then(|e| e.segment.device_ptr());
                    if let Some(h) = st.memory_history.as_deref_mut() {
                        h.free(block.seq, at, address, stream);
                    }
                }
                st.history.record(CallKind::Free, block.seq, 0);
                st.fenced_streams.extend(fences.iter().map(|w| w.stream));
            }
            Err(e) => self.record_deferred_error(
                format!("returning allocation #{} to the pool", block.seq),
                e.into(),
            ),
        }
    }

    /// Hand `buf`'s block to the pool a shrink replaced this closed one with: the
    /// core is that pool's now (after a `close` there is none, and the block goes).
    fn release_to_successor(&self, buf: &SymmBuffer) {
        if let Some(next) = self.inner.successor.get() {
            next.release_block(buf);
        }
    }

    /// Return a block to the cache (from `SymmBuffer::drop`): record a fence on every
    /// stream that used it. Never collective, never waits for the state; failures are
    /// returned by the next fallible call.
    pub(crate) fn release_block(&self, buf: &SymmBuffer) {
        if self.is_closed() {
            return self.release_to_successor(buf);
        }
        let mut fences: SmallVec<[Wait; 3]> = SmallVec::new();
        for s in &buf.streams() {
            match self.inner.backend.streams().record_fence(s) {
                Ok(f) => fences.push(Wait {
                    stream: s.id(),
                    fence: f,
                }),
                // The device is failing (a fence is an event record). Free the block
                // anyway, so that this rank's calls stay in step with its peers'.
                Err(e) => {
                    let seq = buf.allocation_seq();
                    let during = format!("recording a fence for allocation #{seq} on {s:?}");
                    self.record_deferred_error(during, e);
                }
            }
        }
        // Never wait for the state: another thread may hold it through a whole
        // agreement (up to the timeout). Then the free is queued and applied, in
        // order, by the next pool call.
        let mut st = match self.inner.state.try_lock() {
            Ok(st) => st,
            Err(TryLockError::Poisoned(p)) => PoolState::poisoned(p),
            Err(TryLockError::WouldBlock) => {
                tracing::debug!(target: "symmpool::pool", rank = self.rank(),
                    allocation = buf.block.seq, "free deferred: the pool is busy");
                (self.inner.counters.deferred_frees).fetch_add(1, Ordering::Relaxed);
                self.inner.deferred.lock().push((buf.block, fences));
                // A shrink that closed the pool meanwhile may have moved the queue
                // before this free joined it: move what is left.
                if self.is_closed() {
                    self.forward_deferred();
                }
                return;
            }
        };
        if st.closed {
            // Closed since the check above (by a shrink: applied to this state, the
            // free would be lost).
            drop(st);
            return self.release_to_successor(buf);
        }
        self.apply_deferred(&mut st);
        self.apply_free(&mut st, buf.block, &fences);
    }
}
