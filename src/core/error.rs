//! Errors of the allocator core.

use super::types::{BlockId, Growth, SegmentId};

/// Why the core refused a call. The core's state is unchanged whenever one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AllocError {
    /// A request of zero bytes, always refused (it never takes memory or grows).
    #[error("zero-size allocation requested")]
    ZeroSize,
    /// A request above the configured maximum (or one whose rounding overflows `u64`).
    #[error("requested {requested_bytes} bytes, more than the maximum of {max_bytes} bytes")]
    TooLarge {
        /// The size asked for.
        requested_bytes: u64,
        /// The configured limit.
        max_bytes: u64,
    },
    /// An alignment that is not a power of two or exceeds the segment granularity.
    #[error("alignment {align_bytes} is not a power of two no larger than {max_align_bytes}")]
    BadAlignment {
        /// The alignment asked for.
        align_bytes: u64,
        /// The largest alignment supported (the segment granularity).
        max_align_bytes: u64,
    },
    /// No free block fits: the caller must add a segment of this size and class
    /// (see [`CoreConfig`](super::CoreConfig)'s growth policy) and retry.
    #[error("no free block fits; growth needed: {0:?}")]
    NeedsGrowth(Growth),
    /// Growth would exceed `max_reserved_bytes`.
    #[error(
        "out of memory: growing by {segment_bytes} bytes would reserve {would_reserve_bytes} bytes, limit {max_reserved_bytes}"
    )]
    OutOfMemory {
        /// Size of the segment that would be needed.
        segment_bytes: u64,
        /// Reserved bytes after that growth.
        would_reserve_bytes: u64,
        /// The configured limit.
        max_reserved_bytes: u64,
    },
    /// The handle does not name a live block: already freed, or from another allocator.
    #[error("stale or foreign block handle {0:?}")]
    StaleBlock(BlockId),
    /// A segment added with a size the config does not allow.
    #[error("segment of {size_bytes} bytes is not a non-zero multiple of the granularity")]
    BadSegmentSize {
        /// The size given.
        size_bytes: u64,
    },
    /// The segment is not known to this allocator.
    #[error("unknown {0}")]
    UnknownSegment(SegmentId),
    /// Too many segments or blocks for the handle types (2³² - 1).
    #[error("too many segments or blocks")]
    Exhausted,
    /// The configuration is inconsistent.
    #[error("invalid allocator configuration: {0}")]
    Config(&'static str),
    /// A [`Layout`](super::Layout) that no allocator under the given configuration can
    /// have: the rule it breaks (see [`Allocator::from_layout`](super::Allocator::from_layout)).
    #[error("invalid allocator layout: {0}")]
    BadLayout(&'static str),
}
