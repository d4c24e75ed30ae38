//! [`SymmPool::shrink`]: after a lost rank, the survivors go on with a pool of their
//! own over smaller communicators, keeping the memory they have.

use super::state::{PoolState, SegmentEntry};
use super::{History, SymmPool, events};
use crate::core::Allocator;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{Note, Op, Readiness};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// What [`SymmPool::shrink`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShrinkReport {
    /// This rank before the shrink.
    pub old_rank: usize,
    /// This rank in the new group (the survivors, numbered densely in their old order).
    pub rank: usize,
    /// The world size before the shrink.
    pub old_world_size: usize,
    /// The world size after.
    pub world_size: usize,
    /// The ranks of the old group that are gone (old numbering), ascending.
    pub lost_ranks: Vec<usize>,
    /// Segments kept, each registered once on each new communicator that registers.
    pub segments: usize,
    /// Window registrations made on the new communicators.
    pub registrations: u64,
    /// Buffers of the old pool still alive on this rank (readable and writable, but no
    /// collective's: see [`SymmPool::shrink`]).
    pub live_buffers: u64,
    /// Bytes of those buffers' blocks.
    pub live_bytes: u64,
    /// From the call to the new pool, ready.
    pub took: Duration,
}

impl SymmPool {
    /// Go on without the lost ranks: a pool of the survivors, in their shrunk group
    /// (made once for every pool of this one's group, over the shrunk backend,
    /// [`Backend::shrink`](crate::Backend::shrink): later pools are made from the new
    /// pool's [`group`](SymmPool::group)), with this pool's memory, blocks
    /// (live or cached, where they were) and history, each segment registered once on
    /// each new communicator that registers, in segment order (windows do not survive
    /// the loss of a communicator). This pool is closed (its calls fail with
    /// [`Error::Shrunk`]) and sends the frees of its buffers to the new pool. Its live
    /// buffers stay readable and writable on this rank (their memory is the new
    /// pool's too), but no collective takes them ([`Error::Shrunk`]): their layout was
    /// made for the old world size (a shard of a quarter is not a shard of a third);
    /// allocate anew from the new pool.
    /// Call it on every survivor after a collective or pool call failed with
    /// [`Error::PeerLost`] (or [`Error::PoolBroken`] naming a loss). Every wait ends
    /// by the group's timeout. Called with no rank lost (every rank asks), it makes a
    /// group of the same size: the same ranks over new communicators.
    ///
    /// The survivors must have made the same pool calls (allocations, frees, growths)
    /// before the loss: their pools are compared first, and a difference is
    /// [`Error::Divergence`] on every survivor.
    ///
    /// # Collective
    /// Every surviving rank calls it, for its pools in the same order (pools over the
    /// same communicators share one shrunk exchange).
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`]: the store's host is gone, a second rank was lost while
    /// the survivors agreed (`retry`: call it again), or the backend cannot shrink (one
    /// assembled from parts of its own); [`Error::Shrunk`] / [`Error::PoolClosed`] on a
    /// pool already replaced or closed; [`Error::Divergence`] if the survivors' pools
    /// differ; [`Error::CollectiveDivergence`] if the ranks' collectives did (a bug to
    /// fix, not a loss to survive); [`Error::Timeout`] / [`Error::PeerLost`] if a survivor does not come or
    /// is lost while the segments are registered anew (after a loss, call it again:
    /// the survivors of both losses go on); [`Error::GraphCapture`] on every survivor
    /// if a stream the pool has allocated on captures a CUDA graph on one of them (end
    /// the capture, then call it again); the registration errors of a growth.
    /// On error the old pool keeps its memory and state (broken), and the new
    /// communicators are dropped.
    pub fn shrink(&self) -> Result<(SymmPool, ShrinkReport)> {
        self.shrink_unlogged()
            .inspect_err(|e| events::call_failed(self, "shrink", e))
    }

    fn shrink_unlogged(&self) -> Result<(SymmPool, ShrinkReport)> {
        let started = Instant::now();
        let config = &self.inner.config;
        let deadline = Deadline::after(self.group().config().timeout);
        let mut old = self.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        self.apply_deferred(&mut old);
        if old.closed {
            return Err(self.closed_error());
        }
        if let Some(d) = &old.diverged {
            return Err(Error::Divergence(d.clone()));
        }
        // Ranks that made different collectives are a bug to fix, not a loss to survive.
        if let Some(d @ Error::CollectiveDivergence(_)) = self.ledger().failure() {
            return Err(d);
        }
        let group = self.inner.group.shrink(deadline)?;
        let (old_rank, old_world_size) = (self.rank(), self.world_size());
        let fresh = Allocator::new(config.core)?;
        let mode = group.check_mode();
        let pool = SymmPool::over(group, config.clone(), mode, deadline, || {
            let core = std::mem::replace(&mut old.core, fresh);
            let history = std::mem::replace(&mut old.history, History::new(config.history_len));
            (core, history)
        })?;
        let mut st = pool.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        let taken = pool.take_over(&mut st, &mut old, old_rank, deadline);
        let (was, registrations) = match taken {
            Ok(done) => done,
            Err(e) => {
                // The new windows go with the new communicators; the memory stays.
                st.segments.clear();
                st.closed = true;
                pool.inner.closed.store(true, Ordering::Release);
                std::mem::swap(&mut old.core, &mut st.core);
                std::mem::swap(&mut old.history, &mut st.history);
                old.memory_history = old.memory_history.take().or(st.memory_history.take());
                return Err(e);
            }
        };
        let c = st.core.stats();
        let report = ShrinkReport {
            old_rank,
            rank: pool.rank(),
            old_world_size,
            world_size: pool.world_size(),
            lost_ranks: (0..old_world_size).filter(|r| !was.contains(r)).collect(),
            segments: st.segments.len(),
            registrations,
            live_buffers: c.num_allocs - c.num_frees,
            live_bytes: c.allocated_bytes.current,
            took: started.elapsed(),
        };
        drop(st);
        // The old pool: closed, its buffers' frees (and those it queued) go to the new
        // one (the successor first, so a free never finds it closed with nowhere to go).
        old.segments.clear();
        old.closed = true;
        let _ = self.inner.successor.set(pool.clone());
        self.inner.closed.store(true, Ordering::Release);
        drop(old);
        self.forward_deferred();
        tracing::info!(target: "symmpool::pool", pool = %config.name, old_rank,
            rank = report.rank, world_size = report.world_size, lost = ?report.lost_ranks,
            seconds = report.took.as_secs_f64(), "pool shrunk");
        Ok((pool, report))
    }

    /// Move the frees this (closed, shrunk) pool queued to its successor.
    pub(super) fn forward_deferred(&self) {
        if let Some(next) = self.inner.successor.get() {
            let queued = std::mem::take(&mut *self.inner.deferred.lock());
            next.inner.deferred.lock().extend(queued);
        }
    }

    /// The new pool's part of a shrink, under its lock `st`, with the old pool's state
    /// `old`: take its streams and counters, agree with the survivors (their pools
    /// must match), register its segments on the new communicators. The survivors' old
    /// ranks and the registrations made.
    fn take_over(
        &self,
        st: &mut PoolState,
        old: &mut PoolState,
        old_rank: usize,
        deadline: Deadline,
    ) -> Result<(Vec<usize>, u64)> {
        st.known_streams = old.known_streams.clone();
        st.fenced_streams = old.fenced_streams.clone();
        let segments = old.segments.len() as u64;
        // Its old rank, or why it cannot register now (a stream the pool knows
        // captures a CUDA graph): every rank learns that any rank cannot, in the one
        // round ([`Error::GraphCapture`] on every rank). No segment, no registration.
        let ready = match segments {
            0 => Note::Ready(Readiness::Ready),
            _ => self.readiness(st),
        };
        let mine = match ready {
            Note::Ready(Readiness::Ready) => Note::Was(old_rank as u64),
            not_ready => not_ready,
        };
        let notes = self.agree(st, Op::Shrink, "shrink", segments, mine, deadline)?;
        let as_ready = |n: &Note| match n {
            Note::Was(_) => Note::Ready(Readiness::Ready),
            n => *n,
        };
        st.all_ready(&notes.iter().map(as_ready).collect::<Vec<_>>())?;
        let was = (notes.iter())
            .map(|n| match n {
                Note::Was(r) => *r as usize,
                _ => usize::MAX,
            })
            .collect();
        let before: u64 = st.counters.registrations.iter().sum();
        let held: std::collections::BTreeSet<_> = st.core.segments().map(|(id, _, _)| id).collect();
        for (id, entry) in &old.segments {
            let mut next = SegmentEntry {
                segment: entry.segment.share(),
                windows: (0..entry.windows.len()).map(|_| None).collect(),
            };
            // A segment the core no longer holds (a release that failed) is only
            // waiting to be freed: it needs no window.
            if held.contains(id) {
                self.register_segment(st, &mut next, deadline)?;
            }
            st.segments.insert(*id, Arc::new(next));
        }
        let after: u64 = st.counters.registrations.iter().sum();
        st.memory_history = old.memory_history.take();
        Ok((was, after - before))
    }
}
