//! [`SymmPool::shrink`] and [`SymmPool::grow`]: after a lost rank, the survivors go on
//! with a pool of their own over smaller communicators, keeping the memory they have;
//! later newcomers join them ([`SymmPool::join`]), given the survivors' layout, and
//! the pools of the grown group go on over communicators of the full size.

use super::state::{PoolState, SegmentEntry};
use super::{History, PoolConfig, SymmPool, events};
use crate::control::gather_records;
use crate::core::{Allocator, StreamId};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{Group, Note, Op, state_digest};
use std::mem::{replace, swap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
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
    /// Blocks allocated by some survivors after others had stopped (they learned of
    /// the loss a few local pool calls apart, see [`SymmPool::shrink`]), pinned by this
    /// shrink: allocated on every rank from now on, until the pool is closed (0 on a
    /// shrink asked again after a failed one, which pinned them already).
    pub pinned_blocks: u64,
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
    /// [`Error::Divergence`] on every survivor. Survivors that stopped a few local calls
    /// apart (they learned of the loss at different points) are first brought to the
    /// same call: each replays the allocations it lacks of the one furthest on, and
    /// their frees (within the last [`PoolConfig::history_len`] calls); the blocks
    /// allocated after the earliest stop stay allocated on every rank until the pool is
    /// closed ([`ShrinkReport::pinned_blocks`]). A free of a buffer still live on
    /// another survivor cannot be made up: [`Error::Divergence`].
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
        let deadline = self.group().deadline();
        let old = self.open_state()?;
        let group = self.inner.group.shrink(deadline)?;
        let (old_rank, old_world_size) = (self.rank(), self.world_size());
        self.replace(old, group, true, deadline, |new, st| {
            new.take_over(st, old_rank, old_world_size, started, deadline)
        })
    }

    /// Go on in this pool's group grown by the newcomers waiting to join it
    /// ([`Exchange::grow`](crate::Exchange::grow): on a store, processes started with
    /// `SYMMPOOL_JOIN=1` and the job rank they replace): a pool of the grown group
    /// (made once for every pool of this one's group, over the grown backend,
    /// [`Backend::grow`](crate::Backend::grow)) with this pool's memory and blocks,
    /// each segment registered once on each new communicator that registers, in
    /// segment order. The newcomers' [`join`](SymmPool::join) gives them this pool's
    /// layout (segments, blocks, counters): every rank's next placement is identical.
    /// `None` when no newcomer waits once every rank has asked and some rank asked with
    /// `wait` false (call it again later: at a step's end, say); with `wait` on every
    /// rank, the ranks wait for a newcomer until the group's timeout.
    ///
    /// This pool is closed (its calls fail with [`Error::Shrunk`]) as after a
    /// [`shrink`](Self::shrink): its live buffers stay readable and writable on this
    /// rank, no collective takes them, and their blocks stay allocated in the new pool
    /// when they are dropped (the newcomers hold them too, with no buffer to free
    /// them): drop the buffers before the grow to have their memory back. The
    /// application hands the newcomers their state (from the survivors, or a
    /// checkpoint) and allocates anew for the new world size.
    ///
    /// # Collective
    /// Every rank of the group calls it, for its pools in the same order; each
    /// newcomer calls [`join`](Self::join) for the same pools in the same order.
    ///
    /// # Errors
    /// [`Error::PeerLost`] if the group lost a rank (before, or while they ask):
    /// [`shrink`](Self::shrink) past it, then grow; [`Error::Timeout`] if a rank does
    /// not ask, or a rank of the grown group does not come, in time;
    /// [`Error::Divergence`] if the ranks' pools differ (they made different pool
    /// calls, or a newcomer's pool other `core`, `register`, `require_symmetric`); [`Error::PeerOutOfMemory`] if a newcomer cannot allocate the segments;
    /// [`Error::GraphCapture`] on every rank if a stream the pool has allocated on
    /// captures a CUDA graph on one of them; [`Error::Shrunk`] / [`Error::PoolClosed`]
    /// on a pool already replaced or closed; [`Error::Config`] for a backend that
    /// cannot grow; the registration errors of a growth. On error the old pool keeps
    /// its memory and state, and the new communicators are dropped.
    pub fn grow(&self, wait: bool) -> Result<Option<(SymmPool, GrowReport)>> {
        self.grow_unlogged(wait)
            .inspect_err(|e| events::call_failed(self, "grow", e))
    }

    fn grow_unlogged(&self, wait: bool) -> Result<Option<(SymmPool, GrowReport)>> {
        let started = Instant::now();
        let deadline = self.group().deadline();
        let old = self.open_state()?;
        let Some(group) = self.inner.group.grow(wait, deadline)? else {
            return Ok(None);
        };
        let old_world_size = self.world_size();
        self.replace(old, group, false, deadline, |new, st| {
            new.admit(st, old_world_size, started, deadline)
        })
        .map(Some)
    }

    /// A newcomer's pool in the group it joined (made over the backend it joined with,
    /// see [`Backend::grow`](crate::Backend::grow)), with `config`: the pool the ranks
    /// already in the group make in [`grow`](Self::grow), with their layout (segments
    /// of the same sizes allocated here, registered with theirs in segment order, and
    /// their live blocks allocated, with no buffer: they stay allocated).
    ///
    /// # Collective
    /// With the group's ranks' [`grow`](Self::grow) of the same pool: the newcomer
    /// makes its pools in the order they grow theirs, with the same names and settings.
    ///
    /// # Errors
    /// As [`new`](Self::new) and [`grow`](Self::grow), on every rank alike (the
    /// newcomer frees the segments it allocated; another name:
    /// [`Error::ChannelMismatch`]; other settings: [`Error::Divergence`]);
    /// [`Error::PoolBroken`] on every rank
    /// if the layout received does not fit `config` (the newcomer's names why).
    pub fn join(group: &Group, config: PoolConfig) -> Result<(SymmPool, GrowReport)> {
        let started = Instant::now();
        let deadline = group.deadline();
        let pool = Self::create(group, config, group.check_mode())?;
        let mut st = pool.state();
        let report = pool.admit(&mut st, 0, started, deadline);
        // Failed: the pool goes, and its segments with it (released as it drops).
        st.closed = report.is_err();
        drop(st);
        let report = report.inspect_err(|e| events::call_failed(&pool, "join", e))?;
        Ok((pool, report))
    }

    /// This pool's state for a shrink or grow: deferred frees applied, open, not
    /// diverged.
    fn open_state(&self) -> Result<MutexGuard<'_, PoolState>> {
        let old = self.state();
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
        Ok(old)
    }

    /// Replace this pool (its state `old`) by one over `group` with its core, its
    /// segments (shared, to register anew) and its history if `keep_history`, whose
    /// part `take_over` does under the new pool's lock; on success this pool is
    /// closed, its frees going to the new one.
    fn replace<R>(
        &self,
        mut old: MutexGuard<'_, PoolState>,
        group: Group,
        keep_history: bool,
        deadline: Deadline,
        take_over: impl FnOnce(&SymmPool, &mut PoolState) -> Result<R>,
    ) -> Result<(SymmPool, R)> {
        let config = &self.inner.config;
        let fresh = Allocator::new(config.core)?;
        let mode = group.check_mode();
        let pool = SymmPool::over(group, config.clone(), mode, deadline, || {
            let mut history = History::new(config.history_len);
            if keep_history {
                swap(&mut old.history, &mut history);
            }
            (replace(&mut old.core, fresh), history)
        })?;
        let mut st = pool.state();
        st.known_streams = old.known_streams.clone();
        st.fenced_streams = old.fenced_streams.clone();
        (st.pinned, st.pinned_freed) = (old.pinned.clone(), old.pinned_freed.clone());
        let comms = pool.inner.backend.communicators().len();
        st.segments = (old.segments.iter())
            .map(|(id, e)| (*id, Arc::new(SegmentEntry::new(e.segment.share(), comms))))
            .collect();
        let out = match take_over(&pool, &mut st) {
            Ok(out) => out,
            Err(e) => {
                // The new windows go with the new communicators; the memory stays.
                st.segments.clear();
                st.closed = true;
                pool.inner.closed.store(true, Ordering::Release);
                // The core (a shrink's catch-up replays on it) and its pins go back.
                swap(&mut old.core, &mut st.core);
                swap(&mut old.pinned, &mut st.pinned);
                swap(&mut old.pinned_freed, &mut st.pinned_freed);
                if keep_history {
                    swap(&mut old.history, &mut st.history);
                }
                return Err(e);
            }
        };
        st.memory_history = old.memory_history.take();
        drop(st);
        // The old pool: closed, its buffers' frees (and those it queued) go to the new
        // one (the successor first, so a free never finds it closed with nowhere to go).
        old.segments.clear();
        old.closed = true;
        let _ = self.inner.successor.set(pool.clone());
        self.inner.closed.store(true, Ordering::Release);
        drop(old);
        self.forward_deferred();
        Ok((pool, out))
    }

    /// Move the frees this (closed, shrunk) pool queued to its successor.
    pub(super) fn forward_deferred(&self) {
        if let Some(next) = self.inner.successor.get() {
            let queued = std::mem::take(&mut *self.inner.deferred.lock());
            next.inner.deferred.lock().extend(queued);
        }
    }

    /// The new pool's part of a shrink, under its lock `st` (the old pool's streams,
    /// counters and segments taken): agree with the survivors (their pools must
    /// match), register the segments on the new communicators.
    fn take_over(
        &self,
        st: &mut PoolState,
        old_rank: usize,
        old_world_size: usize,
        started: Instant,
        deadline: Deadline,
    ) -> Result<ShrinkReport> {
        let pinned_blocks = self.catch_up(st, deadline)?;
        let segments = st.segments.len() as u64;
        // Its old rank, or why it cannot register now (a stream the pool knows
        // captures a CUDA graph): every rank learns that any rank cannot, in the one
        // round ([`Error::GraphCapture`] on every rank). No segment, no registration.
        let was = Note::Was(old_rank as u64);
        let notes = self.agree_ready(st, Op::Shrink, segments, segments > 0, was, deadline)?;
        let registrations = self.register_held(st, deadline)?;
        let live = st.live_blocks();
        let report = ShrinkReport {
            old_rank,
            rank: self.rank(),
            old_world_size,
            world_size: self.world_size(),
            lost_ranks: (0..old_world_size)
                .filter(|&r| !notes.contains(&Note::Was(r as u64)))
                .collect(),
            segments: st.segments.len(),
            registrations,
            live_buffers: live.len() as u64,
            live_bytes: live.iter().map(|(_, b)| b.size_bytes).sum(),
            pinned_blocks,
            took: started.elapsed(),
        };
        tracing::info!(target: "symmpool::pool", pool = %self.inner.config.name, old_rank,
            rank = report.rank, world_size = report.world_size, lost = ?report.lost_ranks,
            seconds = report.took.as_secs_f64(), "pool shrunk");
        Ok(report)
    }

    /// The grown pool's part of a grow (`old_world_size` 0 on a newcomer), under its
    /// lock `st`: the ranks of the group send their layout (their segments are the
    /// old pool's), a newcomer takes it and allocates its segments; the ranks agree
    /// (their layouts, readiness and memory); every segment is registered on the new
    /// communicators, in segment order; the blocks live now are pinned.
    fn admit(
        &self,
        st: &mut PoolState,
        old_world_size: usize,
        started: Instant,
        deadline: Deadline,
    ) -> Result<GrowReport> {
        let newcomer = old_world_size == 0;
        let mine = (!newcomer).then(|| st.core.layout());
        let exchange = self.inner.backend.exchange();
        let all = gather_records(
            exchange,
            self.inner.channel,
            Op::Admit.name(),
            &mine,
            deadline,
        )?;
        let Some(layout) = all.iter().flatten().next() else {
            return Err(Error::internal("a group grew with no rank from before it"));
        };
        let mut allocated = true;
        if newcomer {
            match Allocator::from_layout(self.inner.config.core, layout, StreamId(0)) {
                Ok(core) => {
                    st.core = core;
                    st.pinned_freed = st.allocated();
                }
                Err(e) => {
                    let reason = format!("the survivors' layout does not fit this pool: {e}");
                    st.broken = Some(Error::PoolBroken { reason });
                }
            }
            // Held by the pool at once: on error they are released as it drops.
            let comms = self.inner.backend.communicators().len();
            for (id, _, size_bytes) in st.core.segments().collect::<Vec<_>>() {
                match self.inner.backend.segments().allocate(size_bytes) {
                    Ok(segment) => {
                        let entry = Arc::new(SegmentEntry::new(segment, comms));
                        st.segments.insert(id, entry);
                    }
                    Err(e) => {
                        tracing::warn!(target: "symmpool::pool", rank = self.rank(), error = %e,
                            "a newcomer could not allocate the group's segments");
                        allocated = false;
                        break;
                    }
                }
            }
        }
        // The ranks compare the layout they go on from (but for what fence completion
        // and streams change): survivors whose pools differ diverged.
        let mut compared = mine.as_ref().unwrap_or(layout).clone();
        (compared.stats.active_bytes, compared.stats.num_waits) = Default::default();
        // And the settings that place and register blocks (a newcomer's may differ).
        let config = &self.inner.config;
        let settings = (config.core, config.register, config.require_symmetric);
        let bytes = postcard::to_allocvec(&(&compared, settings)).unwrap_or_default();
        let digest = state_digest(&Vec::from_iter(bytes.into_iter().map(u64::from)));
        // (A broken newcomer, whose layout does not fit, is not ready.)
        let note = Note::Allocated(allocated);
        let notes = self.agree_ready(st, Op::Admit, digest, true, note, deadline)?;
        super::growth::all_allocated(&notes, st.core.stats().reserved_bytes.current)?;
        let registrations = self.register_held(st, deadline)?;
        st.pinned = st.allocated();
        let c = st.core.stats();
        let report = GrowReport {
            rank: self.rank(),
            old_world_size,
            world_size: self.world_size(),
            newcomers: (0..all.len()).filter(|&r| all[r].is_none()).collect(),
            segments: st.segments.len(),
            registrations,
            pinned_blocks: c.num_allocs - c.num_frees,
            pinned_bytes: c.allocated_bytes.current,
            took: started.elapsed(),
        };
        tracing::info!(target: "symmpool::pool", pool = %self.inner.config.name,
            rank = report.rank, world_size = report.world_size, newcomers = ?report.newcomers,
            seconds = report.took.as_secs_f64(), "pool grown");
        Ok(report)
    }

    /// Register the segments of `st` that its core holds on the new communicators, in
    /// segment order (another is only waiting to be freed: it needs no window); the
    /// registrations made.
    fn register_held(&self, st: &mut PoolState, deadline: Deadline) -> Result<u64> {
        let before: u64 = st.counters.registrations.iter().sum();
        for (id, _, _) in st.core.segments().collect::<Vec<_>>() {
            // The new pool's entries are its own (no buffer holds one yet).
            let Some(mut entry) = st.segments.remove(&id).and_then(Arc::into_inner) else {
                continue;
            };
            let registered = self.register_segment(st, &mut entry, deadline);
            st.segments.insert(id, Arc::new(entry));
            registered?;
        }
        Ok(st.counters.registrations.iter().sum::<u64>() - before)
    }
}

/// What [`SymmPool::grow`] (on a rank of the group) or [`SymmPool::join`] (on a
/// newcomer) did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GrowReport {
    /// This rank in the grown group.
    pub rank: usize,
    /// The world size before the grow (0 on a newcomer).
    pub old_world_size: usize,
    /// The world size after.
    pub world_size: usize,
    /// The newcomers' ranks in the grown group, ascending.
    pub newcomers: Vec<usize>,
    /// Segments of the pool, each registered once on each new communicator that
    /// registers.
    pub segments: usize,
    /// Window registrations made on the new communicators.
    pub registrations: u64,
    /// Blocks allocated before the grow (buffers of the old pool on the ranks that had
    /// it): they stay allocated in the new pool, on every rank.
    pub pinned_blocks: u64,
    /// Bytes of those blocks.
    pub pinned_bytes: u64,
    /// From the call to the new pool, ready.
    pub took: Duration,
}
