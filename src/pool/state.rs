//! What a pool holds under its lock: the core, the call history, and the segment
//! entries that own the memory and windows.

use crate::backend::{Segment, Window};
use crate::core::{Allocator, BlockSnapshot, SegmentId, StreamId};
use crate::error::{Divergence, Error, Result};
use crate::group::{History, Readiness};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, MutexGuard, PoisonError};
use std::time::Duration;

/// One segment of a pool: the single owner of its memory and of its windows.
///
/// Immutable while buffers use it (windows are made before the first block is handed
/// out and released after the last is freed); buffers hold it through an `Arc`.
pub(crate) struct SegmentEntry {
    /// The memory.
    pub(crate) segment: Segment,
    /// Per communicator: the window, if the segment is registered there.
    pub(crate) windows: Vec<Option<Window>>,
}

impl SegmentEntry {
    /// `segment`, with no window on any of `comms` communicators yet.
    pub(crate) fn new(segment: Segment, comms: usize) -> Self {
        let windows = (0..comms).map(|_| None).collect();
        SegmentEntry { segment, windows }
    }

    /// The window on communicator `comm`, if any.
    pub(crate) fn window(&self, comm: usize) -> Option<&Window> {
        self.windows.get(comm).and_then(Option::as_ref)
    }
}

/// Counters a pool keeps beside its state, updated without its lock.
#[derive(Default)]
pub(crate) struct PoolCounters {
    /// Allocation calls that failed for want of memory (pool limit, device, peer).
    pub(crate) ooms: AtomicU64,
    /// Frees queued because the pool's state was busy (applied by the next call).
    pub(crate) deferred_frees: AtomicU64,
}

/// Counters of what the pool did, beside the core's statistics.
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) registrations: Vec<u64>,
    pub(crate) deregistrations: Vec<u64>,
    pub(crate) agreements: u64,
    pub(crate) growth_time: Duration,
    /// Cumulative bytes of allocated blocks, of requests, and of segments added.
    pub(crate) allocated_bytes_total: u64,
    pub(crate) requested_bytes_total: u64,
    pub(crate) reserved_bytes_total: u64,
}

pub(crate) struct PoolState {
    pub(crate) core: Allocator,
    pub(crate) history: History,
    /// Segments this rank holds memory (and windows) for. Usually the core's segments;
    /// after a failed release also ones the core has dropped, until a retry succeeds.
    pub(crate) segments: BTreeMap<SegmentId, Arc<SegmentEntry>>,
    pub(crate) closed: bool,
    /// A registration failed (the first failing rank, and why as this rank knows it):
    /// the pool refuses growth, `reserve` and `trim` on every rank.
    pub(crate) registration_broken: Option<(usize, String)>,
    /// The pool is unusable: local calls fail with [`Error::CollectiveDivergence`]
    /// after the collectives' checks found the ranks diverged, else with
    /// [`Error::PoolBroken`].
    pub(crate) broken: Option<Error>,
    /// Set once an agreement found the ranks diverged: later calls fail.
    pub(crate) diverged: Option<Box<Divergence>>,
    /// Streams with fences recorded at frees: polled for completion by `stats`.
    pub(crate) fenced_streams: BTreeSet<StreamId>,
    pub(crate) counters: Counters,
    /// Streams the pool has allocated on: `reserve` refuses while any is capturing.
    pub(crate) known_streams: Vec<crate::stream::Stream>,
    /// The allocation history, while recording (`record_memory_history`).
    pub(crate) memory_history: Option<Box<super::MemoryHistory>>,
    /// Blocks that stay allocated when freed, by allocation number: those live when
    /// the pool's group grew (a newcomer holds them as allocated too, with no buffer to
    /// free them: [`SymmPool::grow`](super::SymmPool::grow)), and those some survivors
    /// of a loss allocated after others had stopped ([`SymmPool::shrink`](super::SymmPool::shrink)).
    pub(crate) pinned: BTreeSet<u64>,
    /// Pinned blocks with no buffer on this rank (freed since, or a newcomer's), by
    /// allocation number: not live for `close`, which releases their segments.
    pub(crate) pinned_freed: BTreeSet<u64>,
}

impl PoolState {
    pub(crate) fn new(core: Allocator, history: History, comms: usize) -> Self {
        PoolState {
            core,
            history,
            segments: BTreeMap::new(),
            closed: false,
            registration_broken: None,
            broken: None,
            diverged: None,
            fenced_streams: BTreeSet::new(),
            counters: Counters {
                registrations: vec![0; comms],
                deregistrations: vec![0; comms],
                ..Counters::default()
            },
            known_streams: Vec::new(),
            memory_history: None,
            pinned: BTreeSet::new(),
            pinned_freed: BTreeSet::new(),
        }
    }

    /// The blocks of this rank's live buffers, with their segments: the allocated
    /// ones but the pinned ones with no buffer ([`pinned_freed`](Self::pinned_freed)).
    pub(crate) fn live_blocks(&self) -> Vec<(SegmentId, BlockSnapshot)> {
        let marks = self.core.block_marks().into_iter().flatten();
        let blocks = (self.core.snapshot().segments.into_iter())
            .flat_map(|s| s.blocks.into_iter().map(move |b| (s.id, b)));
        // (A block has an allocation number while it is allocated.)
        (blocks.zip(marks))
            .filter(|(_, m)| {
                m.allocation_seq
                    .is_some_and(|q| !self.pinned_freed.contains(&q))
            })
            .map(|(b, _)| b)
            .collect()
    }

    /// The allocation numbers of the core's allocated blocks.
    pub(crate) fn allocated(&self) -> BTreeSet<u64> {
        let marks = self.core.block_marks().into_iter().flatten();
        marks.filter_map(|m| m.allocation_seq).collect()
    }

    /// The state behind a lock that a panic poisoned, marked broken: the core may be
    /// half-mutated and place blocks differently from the peers.
    pub(crate) fn poisoned<'a>(
        poisoned: PoisonError<MutexGuard<'a, PoolState>>,
    ) -> MutexGuard<'a, PoolState> {
        let mut st = poisoned.into_inner();
        st.broken.get_or_insert_with(|| Error::PoolBroken {
            reason: "a thread panicked while it held the pool's state".into(),
        });
        st
    }

    /// An internal error (a bug) that breaks the pool: `what`, as the error returned
    /// and as the reason later calls give.
    pub(crate) fn broken_by(&mut self, what: String) -> Error {
        self.broken = Some(Error::PoolBroken {
            reason: what.clone(),
        });
        Error::internal(what)
    }

    /// Fail unless the pool, open, can serve a local call (allocation, free,
    /// collective).
    pub(crate) fn check_usable(&self) -> Result<()> {
        // A divergence, a loss (with its kind: the survivors may shrink), or a broken
        // pool.
        if let Some(failure) = &self.broken {
            return Err(failure.clone());
        }
        if let Some(d) = &self.diverged {
            // The ranks' allocators differ: a cache hit would place this buffer at an
            // offset the peers do not share, which NCCL would not notice.
            return Err(Error::Divergence(d.clone()));
        }
        Ok(())
    }

    /// This rank's readiness, before any stream is looked at.
    pub(crate) fn readiness(&self) -> Readiness {
        if self.broken.is_some() || self.diverged.is_some() {
            Readiness::PoolBroken
        } else if self.registration_broken.is_some() {
            Readiness::RegistrationBroken
        } else {
            Readiness::Ready
        }
    }

    /// Turn the ranks' readiness into the same error on every rank. A peer's broken
    /// pool breaks this rank's too: the ranks can no longer make the same calls.
    pub(crate) fn all_ready(&mut self, ready: &[Readiness]) -> Result<()> {
        let find = |r: Readiness| ready.iter().position(|&n| n == r);
        if let Some(rank) = find(Readiness::PoolBroken) {
            if let Some(f) = self.broken.as_ref().and_then(Error::group_failure) {
                return Err(f.clone());
            }
            // A broken rank reports its own reason.
            let reason = match &self.diverged {
                Some(d) => d.to_string(),
                None => format!("rank {rank}'s pool is broken"),
            };
            let reason = self
                .broken
                .get_or_insert(Error::PoolBroken { reason })
                .reason();
            return Err(Error::PoolBroken { reason });
        }
        if find(Readiness::Capturing).is_some() {
            return Err(Error::GraphCapture);
        }
        if let Some(rank) = find(Readiness::RegistrationBroken) {
            // Every rank recorded the same failing rank in the growth's outcome round.
            let (rank, reason) = match &self.registration_broken {
                Some((failed, why)) => (*failed, why.clone()),
                None => (
                    rank,
                    format!("a registration failed earlier on rank {rank}"),
                ),
            };
            return Err(Error::RegistrationBroken { rank, reason });
        }
        Ok(())
    }
}
