//! The allocation history, PyTorch's `_record_memory_history`: a ring buffer of the
//! pool's alloc, free and segment events on this rank.

use super::SymmPool;
use crate::core::{Placement, SegmentId, StreamId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

/// What happened, in a [`MemoryEvent`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum MemoryAction {
    /// A block was handed out (a cache hit, or after a growth).
    Alloc,
    /// A block was returned to the cache (its buffer dropped). The pool records
    /// fences and makes a reuse on another stream wait for them, so the block is
    /// reusable at once: PyTorch's `free_requested` and `free_completed` in one.
    Free,
    /// A segment was allocated (and registered) and added to the pool: growth,
    /// `reserve`, `fit_to_peak`.
    SegmentAlloc,
    /// A segment was deregistered and freed: `trim`, `fit_to_peak`, `close`.
    SegmentFree,
}

impl MemoryAction {
    /// `alloc`, `free`, `segment_alloc` or `segment_free`.
    pub fn name(self) -> &'static str {
        match self {
            MemoryAction::Alloc => "alloc",
            MemoryAction::Free => "free",
            MemoryAction::SegmentAlloc => "segment_alloc",
            MemoryAction::SegmentFree => "segment_free",
        }
    }
}

/// One entry of the allocation history ([`SymmPool::record_memory_history`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryEvent {
    /// Position in the history, from 1, counting every event recorded since the history
    /// was started (so the first entry kept says how many the ring buffer dropped).
    pub seq: u64,
    /// What happened.
    pub action: MemoryAction,
    /// The segment.
    pub segment: SegmentId,
    /// The segment's device address, when the backend has one (NCCL); `None` on the
    /// host backends.
    pub segment_address: Option<u64>,
    /// Offset of the block from the segment's start, in bytes (0 for segment events).
    pub offset_bytes: u64,
    /// Block size in bytes (the request rounded up), or the segment's size.
    pub size_bytes: u64,
    /// Bytes the caller asked for (alloc and free; 0 for segment events or a free whose
    /// alloc the history did not see).
    pub requested_bytes: u64,
    /// The allocation's sequence number (as
    /// [`SymmBuffer::allocation_seq`](crate::SymmBuffer::allocation_seq)); `None` for
    /// segment events.
    pub allocation_seq: Option<u64>,
    /// The stream the block was allocated on; `None` for segment events.
    pub stream: Option<StreamId>,
    /// Wall-clock time, in microseconds since the Unix epoch.
    pub time_us: u64,
}

/// The ring buffer behind [`SymmPool::record_memory_history`], kept in the pool's
/// state while recording.
pub(crate) struct MemoryHistory {
    max_entries: usize,
    events: VecDeque<MemoryEvent>,
    next_seq: u64,
    /// Requested bytes of the live allocations the history saw, by allocation number,
    /// for their free events.
    requested: std::collections::HashMap<u64, u64>,
}

impl MemoryHistory {
    pub(crate) fn new(max_entries: usize) -> Self {
        MemoryHistory {
            max_entries: max_entries.max(1),
            events: VecDeque::with_capacity(max_entries.clamp(1, 1 << 16)),
            next_seq: 1,
            requested: std::collections::HashMap::new(),
        }
    }

    /// Append `event` (numbered and timed here), dropping the oldest when full.
    fn push(&mut self, event: MemoryEvent) {
        if self.events.len() == self.max_entries {
            self.events.pop_front();
        }
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH);
        let time_us = since_epoch.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let seq = self.next_seq;
        self.events.push_back(MemoryEvent {
            seq,
            time_us,
            ..event
        });
        self.next_seq += 1;
    }

    /// A block was handed out.
    pub(crate) fn alloc(
        &mut self,
        p: &Placement,
        segment_address: Option<u64>,
        requested_bytes: u64,
        stream: StreamId,
    ) {
        self.requested.insert(p.block.seq, requested_bytes);
        self.push(MemoryEvent {
            seq: 0,
            action: MemoryAction::Alloc,
            segment: p.segment,
            segment_address,
            offset_bytes: p.offset_bytes,
            size_bytes: p.size_bytes,
            requested_bytes,
            allocation_seq: Some(p.block.seq),
            stream: Some(stream),
            time_us: 0,
        });
    }

    /// A block, located at `(segment, offset_bytes, size_bytes)`, was freed.
    pub(crate) fn free(
        &mut self,
        allocation_seq: u64,
        (segment, offset_bytes, size_bytes): (SegmentId, u64, u64),
        segment_address: Option<u64>,
        stream: Option<StreamId>,
    ) {
        let requested_bytes = self.requested.remove(&allocation_seq).unwrap_or(0);
        self.push(MemoryEvent {
            seq: 0,
            action: MemoryAction::Free,
            segment,
            segment_address,
            offset_bytes,
            size_bytes,
            requested_bytes,
            allocation_seq: Some(allocation_seq),
            stream,
            time_us: 0,
        });
    }

    /// A segment was added (`SegmentAlloc`) or released (`SegmentFree`).
    pub(crate) fn segment(
        &mut self,
        action: MemoryAction,
        segment: SegmentId,
        segment_address: Option<u64>,
        size_bytes: u64,
    ) {
        self.push(MemoryEvent {
            seq: 0,
            action,
            segment,
            segment_address,
            offset_bytes: 0,
            size_bytes,
            requested_bytes: 0,
            allocation_seq: None,
            stream: None,
            time_us: 0,
        });
    }
}

impl super::PoolState {
    /// The recorded allocation history, oldest first (empty when not recording).
    pub(crate) fn history_events(&self) -> Vec<MemoryEvent> {
        let recorded = self.memory_history.iter().flat_map(|h| h.events.iter());
        recorded.cloned().collect()
    }
}

impl SymmPool {
    /// Start recording this rank's allocation history, as PyTorch's
    /// `torch.cuda.memory._record_memory_history(max_entries=…)`: every alloc, free,
    /// segment allocation and segment release, with sizes, streams, the segment and
    /// offset, and a sequence number, in a ring buffer of the last `max_entries`
    /// events (older ones are dropped). Called while recording, it changes the bound
    /// and keeps the newest events; `max_entries` 0 stops recording and drops the
    /// history. Local (not collective); while recording, each event costs a clock
    /// read and a push under the pool's lock.
    ///
    /// Read it with [`memory_history`](Self::memory_history) or
    /// [`memory_snapshot_with_history`](Self::memory_snapshot_with_history). Failed
    /// allocations (PyTorch's `oom` entries) are errors, counted in `num_ooms`.
    pub fn record_memory_history(&self, max_entries: usize) {
        let mut st = self.state();
        match (&mut st.memory_history, max_entries) {
            (history, 0) => *history = None,
            (Some(h), n) => {
                // Keep the newest `n`.
                h.max_entries = n;
                let dropped = h.events.len().saturating_sub(n);
                h.events.drain(..dropped);
            }
            (history, n) => *history = Some(Box::new(MemoryHistory::new(n))),
        }
    }

    /// The recorded allocation history, oldest first (empty when not recording; see
    /// [`record_memory_history`](Self::record_memory_history)). Local.
    pub fn memory_history(&self) -> Vec<MemoryEvent> {
        self.state().history_events()
    }
}
