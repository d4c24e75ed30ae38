//! A pool's snapshot for observers: every segment with its windows and every block
//! with its allocation number, sizes, stream and state.

use super::stats::build_stats;
use crate::core::{BlockState, SegmentId, SizeClass, StreamId};
use crate::pool::{MemoryEvent, MemoryStats, SymmPool, role_name};
use serde::{Deserialize, Serialize};

/// State of a block in a [`PoolSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BlockStatus {
    /// Handed out and not yet freed.
    Allocated,
    /// Free, and no device work is known to use it.
    Free,
    /// Free, but carrying a fence not yet known complete: device work on another
    /// stream may still use it (a reuse on another stream waits for it).
    FreeFenced,
}

impl BlockStatus {
    /// `allocated`, `free` or `free_fenced` (also the CSS class in pictures).
    pub fn name(self) -> &'static str {
        match self {
            BlockStatus::Allocated => "allocated",
            BlockStatus::Free => "free",
            BlockStatus::FreeFenced => "free_fenced",
        }
    }
}

/// One block of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockView {
    /// Offset from the segment's start, in bytes.
    pub offset_bytes: u64,
    /// Block size in bytes (the request rounded up).
    pub size_bytes: u64,
    /// Bytes the caller asked for (0 for free blocks).
    pub requested_bytes: u64,
    /// The allocation's sequence number (as [`SymmBuffer::allocation_seq`]) of an
    /// allocated block; `None` for free ones.
    ///
    /// [`SymmBuffer::allocation_seq`]: crate::SymmBuffer::allocation_seq
    pub allocation_seq: Option<u64>,
    /// Allocated, free, or free but fenced.
    pub state: BlockStatus,
    /// Stream it was allocated on (allocated blocks) or last used on (fenced free
    /// blocks); `None` for memory never used.
    pub stream: Option<StreamId>,
    /// Other streams recorded on it, or holding fences on it.
    pub other_streams: Vec<StreamId>,
}

/// A segment's window on one communicator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowView {
    /// Index of the communicator in the backend's list.
    pub comm: usize,
    /// Its role: `symmetric`, `copy_engine` or `plain`.
    pub role: String,
    /// Whether the segment is registered there (NCCL returned a window).
    pub registered: bool,
}

/// One segment, with its windows and its blocks in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentView {
    /// The segment's id (the same on every rank for the same call sequence).
    pub id: SegmentId,
    /// Its size class.
    pub class: SizeClass,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Its device address (NCCL backend); `None` on the host backends.
    #[serde(default)]
    pub address: Option<u64>,
    /// One entry per communicator of the backend, in the backend's order.
    pub windows: Vec<WindowView>,
    /// Blocks tiling `[0, size_bytes)` in address order.
    pub blocks: Vec<BlockView>,
}

/// Everything one rank's pool holds, with its [statistics](SymmPool::memory_stats):
/// what the `memory_map` example draws. Serialisable and loadable with serde.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    /// The pool's name ([`PoolConfig::name`](crate::PoolConfig)).
    pub pool: String,
    /// The rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Segments in id order.
    pub segments: Vec<SegmentView>,
    /// The flat statistics at the time of the snapshot.
    pub stats: MemoryStats,
}

impl PoolSnapshot {
    /// Every block of every segment, with its segment.
    pub fn blocks(&self) -> impl Iterator<Item = (&SegmentView, &BlockView)> {
        self.segments
            .iter()
            .flat_map(|s| s.blocks.iter().map(move |b| (s, b)))
    }
}

impl SymmPool {
    /// This rank's [`PoolSnapshot`]: its segments, windows and blocks, and the flat
    /// statistics, taken under one lock. Local; O(blocks).
    pub fn memory_snapshot(&self) -> PoolSnapshot {
        self.observe_with(|_, _| ()).0
    }

    /// [`memory_snapshot`](Self::memory_snapshot) and the recorded
    /// [`memory_history`](Self::memory_history) (oldest first), taken under one lock:
    /// the history ends where the snapshot was taken (what PyTorch's
    /// `torch.cuda.memory._snapshot()` returns; the Python package exports it in that
    /// format). Local; O(blocks + history).
    pub fn memory_snapshot_with_history(&self) -> (PoolSnapshot, Vec<MemoryEvent>) {
        self.observe_with(|st, _| st.history_events())
    }

    /// The flat statistics, with PyTorch's key names where they mean the same thing
    /// (see the table in [`observe`](crate::observe)). Local; O(blocks) (the per-class
    /// and split figures are counted from the blocks).
    pub fn memory_stats(&self) -> MemoryStats {
        self.observe_with(|_, _| ()).0.stats
    }

    /// This rank's [`PoolSnapshot`] and `also(state, snapshot)` under one lock.
    pub(crate) fn observe_with<T>(
        &self,
        also: impl FnOnce(&mut crate::pool::PoolState, &PoolSnapshot) -> T,
    ) -> (PoolSnapshot, T) {
        let comms = self.backend().communicators();
        let mut st = self.state();
        self.refresh_fences(&mut st);
        let snap = st.core.snapshot();
        let segments: Vec<SegmentView> = snap
            .segments
            .into_iter()
            .zip(st.core.block_marks())
            .map(|(seg, marks)| {
                let entry = st.segments.get(&seg.id);
                let windows = comms
                    .iter()
                    .enumerate()
                    .map(|(c, info)| WindowView {
                        comm: c,
                        role: role_name(info.role).to_string(),
                        registered: entry.is_some_and(|e| e.window(c).is_some()),
                    })
                    .collect();
                let blocks = seg
                    .blocks
                    .into_iter()
                    .zip(marks)
                    .map(|(b, m)| BlockView {
                        offset_bytes: b.offset_bytes,
                        size_bytes: b.size_bytes,
                        requested_bytes: b.requested_bytes,
                        allocation_seq: m.allocation_seq,
                        state: match (b.state, m.fenced) {
                            (BlockState::Allocated, _) => BlockStatus::Allocated,
                            (BlockState::Free, true) => BlockStatus::FreeFenced,
                            (BlockState::Free, false) => BlockStatus::Free,
                        },
                        stream: b.stream,
                        other_streams: b.other_streams,
                    })
                    .collect();
                SegmentView {
                    id: seg.id,
                    class: seg.class,
                    size_bytes: seg.size_bytes,
                    address: entry.and_then(|e| e.segment.device_ptr()),
                    windows,
                    blocks,
                }
            })
            .collect();
        let mut windows = vec![0u64; comms.len()];
        for entry in st.segments.values() {
            for (c, w) in entry.windows.iter().enumerate() {
                windows[c] += u64::from(w.is_some());
            }
        }
        let stats = build_stats(
            &snap.stats,
            (&st.counters, st.history.seq()),
            &segments,
            &windows,
            comms,
            &self.inner.counters,
        );
        let snapshot = PoolSnapshot {
            pool: self.config().name.clone(),
            rank: self.rank(),
            world_size: self.world_size(),
            segments,
            stats,
        };
        let extra = also(&mut st, &snapshot);
        (snapshot, extra)
    }
}
