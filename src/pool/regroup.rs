//! [`SymmPool::shrink`] and [`SymmPool::grow`]: after a lost rank, the survivors go on
//! with a pool of their own over smaller communicators, keeping the memory they have;
//! later newcomers join them ([`SymmPool::join`]), given the survivors' layout, and
//! the pools of the grown group go on over communicators of the full size.

use super::state::{PoolState, SegmentEntry};
use super::{History, PoolConfig, SymmPool, events};
use crate::core::{Allocator, StreamId};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::group::{Group, Note, Op, Readiness};
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
        let deadline = Deadline::after(self.group().config().timeout);
        let old = self.open_state()?;
        let group = self.inner.group.shrink(deadline)?;
        let (old_rank, old_world_size) = (self.rank(), self.world_size());
        let (pool, (was, registrations)) =
            self.replace(old, group, true, deadline, |new, st, old| {
                new.take_over(st, old, old_rank, deadline)
            })?;
        let st = pool.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        let live = st.live_blocks();
        let report = ShrinkReport {
            old_rank,
            rank: pool.rank(),
            old_world_size,
            world_size: pool.world_size(),
            lost_ranks: (0..old_world_size).filter(|r| !was.contains(r)).collect(),
            segments: st.segments.len(),
            registrations,
            live_buffers: live.len() as u64,
            live_bytes: live.iter().map(|(_, b)| b.size_bytes).sum(),
            took: started.elapsed(),
        };
        drop(st);
        tracing::info!(target: "symmpool::pool", pool = %self.inner.config.name, old_rank,
            rank = report.rank, world_size = report.world_size, lost = ?report.lost_ranks,
            seconds = report.took.as_secs_f64(), "pool shrunk");
        Ok((pool, report))
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
        let deadline = Deadline::after(self.group().config().timeout);
        let old = self.open_state()?;
        let Some(group) = self.inner.group.grow(wait, deadline)? else {
            return Ok(None);
        };
        let old_world_size = self.world_size();
        let (pool, report) = self.replace(old, group, false, deadline, |new, st, old| {
            new.admit(st, Some(old), old_world_size, started, deadline)
        })?;
        Ok(Some((pool, report)))
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
    /// As [`new`](Self::new) and [`grow`](Self::grow) (another name:
    /// [`Error::ChannelMismatch`]); [`Error::PoolBroken`] if the layout received does
    /// not fit `config`.
    pub fn join(group: &Group, config: PoolConfig) -> Result<(SymmPool, GrowReport)> {
        let started = Instant::now();
        let deadline = Deadline::after(group.config().timeout);
        let pool = Self::create(group, config, group.check_mode())?;
        let mut st = pool.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        let report = pool.admit(&mut st, None, 0, started, deadline);
        drop(st);
        report
            .map(|r| (pool.clone(), r))
            .inspect_err(|e| events::call_failed(&pool, "join", e))
    }

    /// This pool's state for a shrink or grow: deferred frees applied, open, not
    /// diverged.
    fn open_state(&self) -> Result<MutexGuard<'_, PoolState>> {
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
        Ok(old)
    }

    /// Replace this pool (its state `old`) by one over `group` with its core (and its
    /// history if `keep_history`), whose part `take_over` does under the new pool's
    /// lock; on success this pool is closed, its frees going to the new one.
    fn replace<R>(
        &self,
        mut old: MutexGuard<'_, PoolState>,
        group: Group,
        keep_history: bool,
        deadline: Deadline,
        take_over: impl FnOnce(&SymmPool, &mut PoolState, &mut PoolState) -> Result<R>,
    ) -> Result<(SymmPool, R)> {
        let config = &self.inner.config;
        let fresh = Allocator::new(config.core)?;
        let mode = group.check_mode();
        let pool = SymmPool::over(group, config.clone(), mode, deadline, || {
            let core = std::mem::replace(&mut old.core, fresh);
            let history = match keep_history {
                true => std::mem::replace(&mut old.history, History::new(config.history_len)),
                false => History::new(config.history_len),
            };
            (core, history)
        })?;
        let mut st = pool.inner.state.lock().unwrap_or_else(PoolState::poisoned);
        st.known_streams = old.known_streams.clone();
        st.fenced_streams = old.fenced_streams.clone();
        st.pinned_below_seq = old.pinned_below_seq;
        st.pinned_freed = old.pinned_freed.clone();
        let out = match take_over(&pool, &mut st, &mut old) {
            Ok(out) => out,
            Err(e) => {
                // The new windows go with the new communicators; the memory stays.
                st.segments.clear();
                st.closed = true;
                pool.inner.closed.store(true, Ordering::Release);
                std::mem::swap(&mut old.core, &mut st.core);
                if keep_history {
                    std::mem::swap(&mut old.history, &mut st.history);
                }
                old.memory_history = old.memory_history.take().or(st.memory_history.take());
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
        Ok((was, after - before))
    }

    /// The grown pool's part of a grow (`old`: this survivor's old pool's state; `None`
    /// on a newcomer), under its lock `st`: the survivors send their layout, a newcomer
    /// takes it and allocates its segments; the ranks agree (their layouts, readiness
    /// and memory); every segment is registered on the new communicators, in segment
    /// order; the blocks live now are pinned.
    fn admit(
        &self,
        st: &mut PoolState,
        old: Option<&mut PoolState>,
        old_world_size: usize,
        started: Instant,
        deadline: Deadline,
    ) -> Result<GrowReport> {
        let exchange = self.inner.backend.exchange();
        let mine = old.is_some().then(|| st.core.layout());
        let all =
            crate::control::gather_records(exchange, self.inner.channel, "grow", &mine, deadline)?;
        let Some(layout) = all.iter().flatten().next() else {
            return Err(Error::internal("a group grew with no rank from before it"));
        };
        let newcomers: Vec<usize> = (0..all.len()).filter(|&r| all[r].is_none()).collect();
        let mut fresh = Vec::new();
        let mut ready = self.readiness(st);
        if old.is_none() {
            match Allocator::from_layout(self.inner.config.core, layout, StreamId(0)) {
                Ok(core) => {
                    st.pinned_freed = (core.block_marks().iter().flatten())
                        .filter_map(|m| m.allocation_seq)
                        .collect();
                    st.core = core;
                }
                Err(e) => {
                    let reason = format!("the survivors' layout does not fit this pool: {e}");
                    st.broken = Some(Error::PoolBroken { reason });
                    ready = Note::Ready(Readiness::PoolBroken);
                }
            }
            for (_, _, size_bytes) in st.core.segments().collect::<Vec<_>>() {
                match self.inner.backend.segments().allocate(size_bytes) {
                    Ok(segment) => fresh.push(segment),
                    Err(e) => {
                        tracing::warn!(target: "symmpool::pool", rank = self.rank(), error = %e,
                            "a newcomer could not allocate the group's segments");
                        ready = Note::Allocated(false);
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
        let words: Vec<u64> = (bytes.chunks(8))
            .map(|c| c.iter().fold(0, |w, &b| w << 8 | u64::from(b)))
            .collect();
        let digest = crate::group::state_digest(&words);
        if ready == Note::Ready(Readiness::Ready) {
            ready = Note::Allocated(true);
        }
        let notes = self.agree(st, Op::Admit, "grow", digest, ready, deadline)?;
        let short: Vec<usize> = (0..notes.len())
            .filter(|&r| notes[r] == Note::Allocated(false))
            .collect();
        if !short.is_empty() {
            let segment_bytes = st.core.stats().reserved_bytes.current;
            return Err(Error::PeerOutOfMemory {
                segment_bytes,
                ranks: short,
            });
        }
        let as_ready = |n: &Note| match n {
            Note::Allocated(_) => Note::Ready(Readiness::Ready),
            n => *n,
        };
        st.all_ready(&notes.iter().map(as_ready).collect::<Vec<_>>())?;
        let windows = self.inner.backend.communicators().len();
        let entry = |segment| SegmentEntry {
            segment,
            windows: (0..windows).map(|_| None).collect(),
        };
        let mut entries: Vec<(crate::core::SegmentId, SegmentEntry)> = match old {
            Some(old) => {
                let held: std::collections::BTreeSet<_> =
                    st.core.segments().map(|(id, _, _)| id).collect();
                (old.segments.iter())
                    .filter(|(id, _)| held.contains(id))
                    .map(|(id, e)| (*id, entry(e.segment.share())))
                    .collect()
            }
            None => st
                .core
                .segments()
                .map(|(id, _, _)| id)
                .zip(fresh.into_iter().map(entry))
                .collect(),
        };
        let before: u64 = st.counters.registrations.iter().sum();
        for (id, mut next) in entries.drain(..) {
            let registered = self.register_segment(st, &mut next, deadline);
            st.segments.insert(id, Arc::new(next));
            registered?;
        }
        let after: u64 = st.counters.registrations.iter().sum();
        st.pinned_below_seq = layout.next_seq;
        let c = st.core.stats();
        let report = GrowReport {
            rank: self.rank(),
            old_world_size,
            world_size: self.world_size(),
            newcomers,
            segments: st.segments.len(),
            registrations: after - before,
            pinned_blocks: c.num_allocs - c.num_frees,
            pinned_bytes: c.allocated_bytes.current,
            took: started.elapsed(),
        };
        tracing::info!(target: "symmpool::pool", pool = %self.inner.config.name,
            rank = report.rank, world_size = report.world_size, newcomers = ?report.newcomers,
            seconds = report.took.as_secs_f64(), "pool grown");
        Ok(report)
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
