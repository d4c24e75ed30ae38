//! Statistics and snapshots, in the spirit of PyTorch's `torch.cuda.memory_stats` and
//! `torch.cuda.memory_snapshot`.

use super::types::{SegmentId, SizeClass, StreamId};
use serde::{Deserialize, Serialize};

/// A gauge with its high-water mark.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stat {
    /// Value now.
    pub current: u64,
    /// Largest value since creation or the last [`Allocator::reset_peak`](super::Allocator::reset_peak).
    pub peak: u64,
}

impl Stat {
    pub(crate) fn add(&mut self, x: u64) {
        self.current += x;
        self.peak = self.peak.max(self.current);
    }

    pub(crate) fn sub(&mut self, x: u64) {
        debug_assert!(self.current >= x, "stat underflow");
        self.current -= x;
    }

    pub(crate) fn reset_peak(&mut self) {
        self.peak = self.current;
    }
}

/// Counters and gauges of one allocator. All sizes in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoreStats {
    /// Bytes in allocated blocks (block sizes, after rounding).
    pub allocated_bytes: Stat,
    /// Bytes the callers asked for in live allocations (before rounding).
    pub requested_bytes: Stat,
    /// Bytes in all segments.
    pub reserved_bytes: Stat,
    /// Allocated bytes plus free blocks carrying a fence not yet reported complete
    /// through [`Allocator::complete_fences`](super::Allocator::complete_fences), like
    /// PyTorch's "active". A merged free block counts whole (an over-estimate, as its
    /// waits are).
    pub active_bytes: Stat,
    /// Number of segments.
    pub segments: Stat,
    /// Number of allocated blocks.
    pub allocated_blocks: Stat,
    /// Number of free blocks (fragments).
    pub free_blocks: u64,
    /// Successful allocations so far.
    pub num_allocs: u64,
    /// Frees so far.
    pub num_frees: u64,
    /// Times a free block was split to serve a request.
    pub num_splits: u64,
    /// Times a freed block merged with a free neighbour.
    pub num_merges: u64,
    /// Segments added.
    pub num_growths: u64,
    /// Segments released.
    pub num_releases: u64,
    /// Device-side waits returned by allocations (cross-stream reuse).
    pub num_waits: u64,
    /// Requests refused because no block fitted (each is followed by growth or an error).
    pub num_misses: u64,
    /// The small class alone (zero when absent from older serialised stats).
    #[serde(default)]
    pub small: ClassStats,
    /// The large class alone.
    #[serde(default)]
    pub large: ClassStats,
}

impl CoreStats {
    /// The statistics of one size class.
    pub fn class(&self, class: SizeClass) -> &ClassStats {
        match class {
            SizeClass::Small => &self.small,
            SizeClass::Large => &self.large,
        }
    }

    pub(crate) fn class_mut(&mut self, class: SizeClass) -> &mut ClassStats {
        match class {
            SizeClass::Small => &mut self.small,
            SizeClass::Large => &mut self.large,
        }
    }

    /// Every gauge with its name, the per-class ones included (for `reset_peak` and
    /// the invariant check).
    pub(crate) fn gauges_mut(&mut self) -> [(&'static str, &mut Stat); 10] {
        [
            ("allocated_bytes", &mut self.allocated_bytes),
            ("requested_bytes", &mut self.requested_bytes),
            ("reserved_bytes", &mut self.reserved_bytes),
            ("active_bytes", &mut self.active_bytes),
            ("segments", &mut self.segments),
            ("allocated_blocks", &mut self.allocated_blocks),
            ("small.segments", &mut self.small.segments),
            ("small.reserved_bytes", &mut self.small.reserved_bytes),
            ("large.segments", &mut self.large.segments),
            ("large.reserved_bytes", &mut self.large.reserved_bytes),
        ]
    }
}

/// Gauges of one size class ([`CoreStats::small`], [`CoreStats::large`]), changed only
/// when a segment is added or released. The two classes add up to the allocator-wide
/// `segments` and `reserved_bytes` (their peaks need not). A class's allocated bytes
/// come from [`Allocator::class_allocated_bytes`](super::Allocator::class_allocated_bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassStats {
    /// Number of segments of the class.
    pub segments: Stat,
    /// Bytes in the class's segments.
    pub reserved_bytes: Stat,
}

/// State of a block in a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockState {
    /// Handed out and not yet freed.
    Allocated,
    /// Free and available.
    Free,
}

/// One block in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockSnapshot {
    /// Offset from the segment start, in bytes.
    pub offset_bytes: u64,
    /// Block size in bytes.
    pub size_bytes: u64,
    /// Bytes requested by the caller (0 for free blocks).
    pub requested_bytes: u64,
    /// Allocated or free.
    pub state: BlockState,
    /// Stream it was allocated on (allocated blocks) or last used on (free blocks that
    /// carry fences; `None` for never-used memory).
    pub stream: Option<StreamId>,
    /// Other streams recorded on an allocated block, or holding fences on a free block.
    pub other_streams: Vec<StreamId>,
}

/// One segment in a snapshot, with its blocks in address order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentSnapshot {
    /// The segment.
    pub id: SegmentId,
    /// Its size class.
    pub class: SizeClass,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Blocks tiling `[0, size_bytes)` in address order.
    pub blocks: Vec<BlockSnapshot>,
}

/// Every segment and block of an allocator, serialisable with serde.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Segments in id order.
    pub segments: Vec<SegmentSnapshot>,
    /// The stats at the time of the snapshot.
    pub stats: CoreStats,
}
