//! Release: `trim` and `close` (collective), and the bounded local teardown of a pool
//! dropped without `close`. Order (NCCL's): drain the device, deregister every window,
//! free the segment.

use super::state::{PoolState, SegmentEntry};
use super::{MemoryAction, PoolInner, SymmPool};
use crate::backend::Backend;
use crate::core::{Allocator, SegmentId};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{CallKind, LiveBuffer, MAX_LIVE_NAMED, Note, Op};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard, PoisonError};

/// Deregister and free one entry, waiting in the provider until `deadline` at most.
/// On failure the entry comes back with what is left of it (windows that would not
/// deregister, the segment) for a later retry. The caller makes sure that no work
/// uses the segment (drained device, or no block ever handed out) and that no buffer
/// holds the entry.
pub(super) fn release_entry(
    backend: &Backend,
    mut entry: SegmentEntry,
    deregistrations: &mut [u64],
    deadline: Deadline,
) -> std::result::Result<(), (SegmentEntry, Error)> {
    let mut first_err = None;
    for (slot, count) in entry.windows.iter_mut().zip(deregistrations.iter_mut()) {
        let Some(w) = slot.take() else {
            continue;
        };
        // SAFETY: the window was made by this backend's provider for this entry's
        // segment; no work uses it and no buffer holds the entry (the caller's
        // promise).
        match unsafe { backend.segments().deregister(w, deadline) } {
            Ok(()) => *count += 1,
            Err(refused) => {
                *slot = Some(refused.handle);
                first_err.get_or_insert(refused.error);
            }
        }
    }
    if let Some(e) = first_err {
        return Err((entry, e));
    }
    let SegmentEntry { segment, windows } = entry;
    // SAFETY: every window of the segment is deregistered above, no work uses it and
    // no buffer refers to the segment (the caller's promise).
    match unsafe { backend.segments().free(segment) } {
        Ok(()) => Ok(()),
        Err(refused) => Err((
            SegmentEntry {
                segment: refused.handle,
                windows,
            },
            refused.error,
        )),
    }
}

impl SymmPool {
    /// The pool's lock for a collective pool call: a deferred error first, then the
    /// lock, refused once closed ([`Error::PoolClosed`], or [`Error::Shrunk`] once a
    /// shrink replaced the pool).
    pub(super) fn lock_open(&self) -> Result<MutexGuard<'_, PoolState>> {
        self.take_deferred_error()?;
        let st = self.state();
        if st.closed {
            return Err(self.closed_error());
        }
        Ok(st)
    }

    /// Deregister and free the segments this rank holds but the core no longer does
    /// (released by `trim`/`close`, or a failed release's), after draining the device
    /// until `deadline`; one whose release fails stays listed for the next try.
    pub(super) fn release_segments(&self, st: &mut PoolState, deadline: Deadline) -> Result<()> {
        let held: std::collections::BTreeSet<SegmentId> =
            st.core.segments().map(|(id, _, _)| id).collect();
        let gone: Vec<SegmentId> = (st.segments.keys().copied())
            .filter(|id| !held.contains(id))
            .collect();
        if gone.is_empty() {
            return Ok(());
        }
        let backend = &self.inner.backend;
        let started = std::time::Instant::now();
        if !backend.streams().drain(deadline)? {
            let op = "draining the device before releasing segments";
            return Err(Error::timeout_since(op, started, &[]));
        }
        let mut first_err = None;
        for id in gone {
            let Some(shared) = st.segments.remove(&id) else {
                continue;
            };
            let entry = match Arc::try_unwrap(shared) {
                Ok(entry) if !entry.segment.is_shared() => entry,
                // A buffer of it is still being dropped on another thread (one of the
                // pool before a shrink holds the memory through its own entry).
                held => {
                    st.segments
                        .insert(id, held.map_or_else(|shared| shared, Arc::new));
                    continue;
                }
            };
            let bytes = entry.segment.size_bytes();
            tracing::info!(target: "symmpool::pool", rank = self.rank(), segment = id.0, segment_bytes = bytes, "releasing segment");
            let address = entry.segment.device_ptr();
            match release_entry(backend, entry, &mut st.counters.deregistrations, deadline) {
                Ok(()) => {
                    if let Some(h) = st.memory_history.as_deref_mut() {
                        h.segment(MemoryAction::SegmentFree, id, address, bytes);
                    }
                }
                Err((entry, e)) => {
                    st.segments.insert(id, Arc::new(entry));
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Release every entirely free segment: drain the device, deregister its windows,
    /// free it. Returns the bytes released.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence (the ranks agree
    /// first, so they release the same segments).
    ///
    /// # Errors
    /// [`Error::PoolClosed`] ([`Error::Shrunk`] once a shrink replaced the pool),
    /// [`Error::PoolBroken`], [`Error::Divergence`],
    /// [`Error::Timeout`], backend errors; [`Error::RegistrationBroken`] on every rank
    /// once a registration has failed (the ranks' windows may be out of step, so no
    /// rank deregisters any until [`close`](Self::close), which releases everything).
    #[tracing::instrument(target = "symmpool::pool", level = "info", skip(self), fields(rank = self.rank(), pool = %self.inner.config.name), ret, err(Display))]
    pub fn trim(&self) -> Result<u64> {
        let mut st = self.lock_open()?;
        st.history.record(CallKind::Trim, 0, 0);
        let deadline = self.group().deadline();
        let ready = Note::Ready(st.readiness());
        self.agree_ready(&mut st, Op::Trim, 0, false, ready, deadline)?;
        let released = st.core.release_free_segments();
        self.release_segments(&mut st, deadline)?;
        Ok(released.iter().map(|(_, b)| b).sum())
    }

    /// Close the pool: drain the device, deregister every window, free every segment.
    /// Later calls fail with [`Error::PoolClosed`]; closing again is a no-op. Under
    /// checked collectives its agreement follows every collective record in the
    /// ledger, so that a divergence still in flight is found, on every rank, before
    /// the close decides.
    ///
    /// # Collective
    /// Every rank calls it at the same point of its call sequence. If any rank still
    /// has live buffers, every rank gets [`Error::BuffersAlive`] and nothing is
    /// released (the pool stays usable).
    ///
    /// # Errors
    /// [`Error::BuffersAlive`], [`Error::Divergence`], [`Error::Timeout`], backend
    /// errors. After the ledger broke (the collective checks found the ranks diverged,
    /// [`Error::CollectiveDivergence`], which every rank learns from the same records;
    /// or one of its rounds timed out or lost a peer; or the close's own round lost
    /// one) the pool closes without a round, at once: it releases this rank's memory
    /// and returns [`Error::PoolBroken`] naming the cause (the pool is closed; a second
    /// `close` returns `Ok`), or, while buffers of this rank are alive,
    /// [`Error::BuffersAlive`] with this rank's buffers (the peers' are not asked). A
    /// pool broken on this rank alone (a panic under its lock) still closes on every
    /// rank through the round (its memory is released; the ranks' call histories are
    /// not compared then).
    #[tracing::instrument(target = "symmpool::pool", level = "info", skip(self), fields(rank = self.rank(), pool = %self.inner.config.name), err(Display))]
    pub fn close(&self) -> Result<()> {
        let deadline = self.group().deadline();
        let mut st = self.state();
        if st.closed {
            return Ok(());
        }
        let live = st.core.stats().allocated_blocks.current - st.pinned_freed.len() as u64;
        if let Some(failure) = self.ledger().failure() {
            return self.close_alone(st, live, failure.reason(), deadline);
        }
        let named = live_buffers(&st);
        // The close's agreement follows every record of this rank in the ledger: a
        // divergence still in flight is found in its rounds, on every rank.
        let records = match self.agree_naming(
            &mut st,
            (Op::Close, "close"),
            0,
            Note::Live(live),
            named,
            deadline,
        ) {
            // A peer gone for good never agrees: close alone, as after a broken ledger.
            Err(e @ (Error::CollectiveDivergence(_) | Error::PeerLost { .. })) => {
                return self.close_alone(st, live, e.to_string(), deadline);
            }
            out => out?,
        };
        let live_per_rank: Vec<u64> = (records.iter())
            .map(|r| match r.extra {
                Note::Live(n) => n,
                _ => 0,
            })
            .collect();
        if live_per_rank.iter().any(|&l| l > 0) {
            let buffers = (records.iter().enumerate())
                .flat_map(|(rank, r)| r.live.iter().map(move |b| (rank, b.to_string())))
                .collect();
            return Err(Error::BuffersAlive {
                live_per_rank,
                buffers,
            });
        }
        self.finish_close(&mut st, deadline)
    }

    /// The end of a `close` that goes through: recorded (only now: a refused close
    /// changes nothing, and a rank that frees its last buffer after one keeps the same
    /// history as a peer that freed it before), closed, every segment released. If a
    /// release fails, the segments stay listed and dropping the pool retries.
    fn finish_close(&self, st: &mut PoolState, deadline: Deadline) -> Result<()> {
        st.history.record(CallKind::Close, 0, 0);
        // Pinned blocks with no buffer go with their segments.
        if let (false, Ok(empty)) = (
            st.pinned_freed.is_empty(),
            Allocator::new(*st.core.config()),
        ) {
            st.core = empty;
        }
        st.core.release_free_segments();
        st.closed = true;
        self.inner.closed.store(true, Ordering::Release);
        self.release_segments(st, deadline)?;
        self.take_deferred_error()
    }

    /// `close` of a pool whose ledger broke (`reason`): no round, as
    /// [`close`](Self::close) says (a peer may never join it); this rank releases its
    /// memory alone (deregistration and free are local) and reports why.
    fn close_alone(
        &self,
        mut st: MutexGuard<'_, PoolState>,
        live: u64,
        reason: String,
        deadline: Deadline,
    ) -> Result<()> {
        if live > 0 {
            // Only this rank's buffers are known (no round): the peers' count as 0.
            let mut live_per_rank = vec![0; self.world_size()];
            live_per_rank[self.rank()] = live;
            let buffers = (live_buffers(&st).iter())
                .map(|b| (self.rank(), b.to_string()))
                .collect();
            return Err(Error::BuffersAlive {
                live_per_rank,
                buffers,
            });
        }
        self.finish_close(&mut st, deadline)?;
        Err(Error::PoolBroken {
            reason: format!("{reason} (closed: this rank released its memory without a round)"),
        })
    }
}

/// This rank's live buffers, as a refused `close` names them (the first few).
fn live_buffers(st: &PoolState) -> Vec<LiveBuffer> {
    (st.live_blocks().into_iter().take(MAX_LIVE_NAMED))
        .map(|(segment, b)| LiveBuffer {
            segment: segment.0,
            offset_bytes: b.offset_bytes,
            requested_bytes: b.requested_bytes,
        })
        .collect()
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        self.group.forget_user(self.channel.ordinal());
        let timeout = self.group.config().timeout;
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if st.segments.is_empty() {
            return;
        }
        let bytes: u64 = st.segments.values().map(|e| e.segment.size_bytes()).sum();
        if !st.closed {
            let (rank, name, n) = (self.group.rank(), &self.config.name, st.segments.len());
            let broken = st.broken.as_ref().map(Error::reason);
            super::events::dropped_without_close(rank, name, n, bytes, broken.as_deref());
        }
        // Never wait without bound in a drop: if the device does not drain in time
        // (a peer died in a collective, say), leak the memory on purpose.
        let deadline = Deadline::after(timeout);
        let drained = self.backend.streams().drain(deadline);
        if !matches!(drained, Ok(true)) {
            let why = match drained {
                Err(e) => e.to_string(),
                _ => format!("not drained within {timeout:?}"),
            };
            tracing::error!(
                "symmpool: rank {}: the device did not drain ({why}); {} segments ({bytes} bytes) and their windows are leaked on purpose",
                self.group.rank(),
                st.segments.len()
            );
            // Device memory is not freed by dropping its handle: leaked, as said.
            st.segments.clear();
            return;
        }
        for (SegmentId(id), shared) in std::mem::take(&mut st.segments) {
            // No buffer is alive (buffers keep the pool alive), so the entry is ours.
            let Some(entry) = Arc::try_unwrap(shared)
                .ok()
                .filter(|e| !e.segment.is_shared())
            else {
                tracing::error!("symmpool: segment {id} still shared at teardown; leaked");
                continue;
            };
            if let Err((_, e)) = release_entry(
                &self.backend,
                entry,
                &mut st.counters.deregistrations,
                deadline,
            ) {
                tracing::error!(
                    "symmpool: releasing segment {id} at teardown failed ({e}); leaked"
                );
            }
        }
    }
}
