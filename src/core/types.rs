//! Identifiers and small value types shared by the core and the layers above it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Identifies a segment inside one allocator.
///
/// Ids are handed out in increasing order starting at 0 and are never reused, so the
/// same call sequence gives the same ids on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SegmentId(pub u32);

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "segment {}", self.0)
    }
}

/// A generation-checked handle to a block: a handle whose `seq` no longer matches the
/// block in its slot is stale, and using it is an error
/// ([`AllocError::StaleBlock`](super::AllocError::StaleBlock)), not corruption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockId {
    /// Slab slot of the block (slots are reused).
    pub slot: u32,
    /// Allocation sequence number (1-based, unique for the allocator's lifetime).
    pub seq: u64,
}

/// Identifies a stream to the core, which only compares ids. Stream ids need not agree
/// across ranks: placement never depends on them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct StreamId(pub u64);

/// A point in one stream's work, given by the caller when a block is freed (the pool
/// records a CUDA event there). Fences on one stream increase with time: waiting for
/// one waits for every earlier one. The core only stores, merges (keeping the largest
/// per stream) and returns them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Fence(pub u64);

/// A device-side wait the caller must enqueue before using a block handed out on
/// `Placement::stream`: "make the allocating stream wait for `fence` on `stream`".
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Wait {
    /// The stream whose earlier work may still use the memory.
    pub stream: StreamId,
    /// The point on `stream` after which the memory is no longer used.
    pub fence: Fence,
}

/// Which family of segments a request is served from: small requests (at most
/// [`CoreConfig::small_request_max_bytes`](super::CoreConfig)) from small segments only,
/// large ones from large segments only, so a small request never pins a large segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SizeClass {
    /// Requests up to `small_request_max_bytes`.
    Small,
    /// Everything larger.
    Large,
}

impl SizeClass {
    /// The class's place in per-class arrays: `Small` 0, `Large` 1 (the declaration's order).
    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// One allocation request, as the pool passes it to the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocRequest {
    /// Requested size in bytes; must be non-zero.
    pub size_bytes: u64,
    /// Required alignment of the block's offset in its segment, in bytes: a power of
    /// two, at most the segment granularity. Values below the minimum block size
    /// (512 B by default) are raised to it.
    pub align_bytes: u64,
    /// The stream the block is allocated on.
    pub stream: StreamId,
}

impl AllocRequest {
    /// A request with the default alignment (the minimum block size).
    pub fn new(size_bytes: u64, stream: StreamId) -> Self {
        AllocRequest {
            size_bytes,
            align_bytes: 1,
            stream,
        }
    }

    setters! {
        /// The same request with alignment `align_bytes`.
        with_align(align_bytes: u64);
    }
}

/// Where a request was placed, and what the caller must wait for before using it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Handle to free the block with.
    pub block: BlockId,
    /// The segment holding the block.
    pub segment: SegmentId,
    /// Offset of the block from the segment's start, in bytes; a multiple of the
    /// request's alignment. Identical on every rank for the same call sequence.
    pub offset_bytes: u64,
    /// Size of the block in bytes (≥ the request, a multiple of the minimum block size).
    pub size_bytes: u64,
    /// Device-side waits to enqueue on the allocating stream before first use, in
    /// ascending stream order. Empty when the memory was last used only on that stream.
    pub waits: smallvec::SmallVec<[Wait; 2]>,
    /// The fence on the allocating stream itself after which the memory's earlier use
    /// there ended (`None` if it was not used there). The allocating stream is ordered
    /// after it already; a use of the block on *another* stream must wait for it too,
    /// with [`waits`](Self::waits).
    pub own_fence: Option<Fence>,
}

/// What the core needs from the caller when no free block fits: a new segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Growth {
    /// Size class the new segment serves.
    pub class: SizeClass,
    /// Size of the segment to add, in bytes (a multiple of the granularity).
    pub segment_bytes: u64,
}
