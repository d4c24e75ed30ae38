//! The deterministic caching-allocator core: pure data structures, no FFI, no threads,
//! no unsafe code.
//!
//! [`Allocator`] carves blocks out of segments that the caller provides. It is the part
//! of the pool that must make *exactly* the same decision on every rank, so every
//! decision is a function of the call sequence alone.
//!
//! # Algorithm
//!
//! - **Rounding.** A request is rounded up to a multiple of
//!   [`CoreConfig::min_block_bytes`] (512 B). Zero bytes is refused
//!   ([`AllocError::ZeroSize`]); so is anything above `max_request_bytes`
//!   ([`AllocError::TooLarge`]). All arithmetic is checked.
//! - **Size classes.** Requests up to `small_request_max_bytes` (1 MiB) are served only
//!   from small segments, larger ones only from large segments, each class with its own
//!   free index. A small request therefore never splits and pins a large segment.
//! - **Best fit.** Each class keeps an ordered index of free blocks keyed by
//!   (size, segment, offset). The first block at least as large as the request whose
//!   offset can be aligned wins: the smallest that fits, ties broken by segment then
//!   offset.
//! - **Split.** The padding in front of an aligned block stays free. A remainder is
//!   split off when it is worth keeping: at least `min_block_bytes` in small segments,
//!   at least `large_split_min_bytes` (1 MiB) in large ones; otherwise the block keeps it.
//! - **Coalesce.** A freed block merges with free neighbours in the same segment
//!   (never across segments, which are separate device allocations).
//! - **Growth.** When nothing fits, [`Allocator::alloc`] returns
//!   [`AllocError::NeedsGrowth`] with the segment to add, chosen by the policy in
//!   [`CoreConfig`]; the caller adds it with [`Allocator::add_segment`] and retries.
//!   Segment ids count up from 0 and are never reused.
//! - **Streams.** A block remembers its allocating stream and the streams recorded on
//!   it. When it is freed the caller gives one [`Fence`] per such stream; when the
//!   memory is handed out again on a *different* stream, [`Placement::waits`] lists the
//!   fences to wait for (device-side). Placement itself never looks at streams or at
//!   fence completion. A merged free block keeps the latest fence per stream of all
//!   its parts: conservative (a reuse may wait for work that touched a neighbouring
//!   part), never unsafe.
//!
//! # Invariants ([`Allocator::check_invariants`])
//!
//! Per segment the blocks tile the segment exactly, in address order, in whole
//! 512-byte units, with no two free blocks adjacent; the free index holds exactly the
//! free blocks; every statistic equals a recount.
//!
//! # Example
//!
//! ```
//! use symmpool::__core::{Allocator, AllocError, AllocRequest, CoreConfig, StreamId};
//!
//! let mut core = Allocator::new(CoreConfig::default())?;
//! let req = AllocRequest::new(3 << 20, StreamId(0));
//! let placement = match core.alloc(req) {
//!     Err(AllocError::NeedsGrowth(growth)) => {
//!         core.add_segment(growth)?; // here the pool allocates and registers memory
//!         core.alloc(req)?
//!     }
//!     other => other?,
//! };
//! assert_eq!((placement.segment.0, placement.offset_bytes), (0, 0));
//! let streams = core.streams_of(placement.block)?;
//! assert_eq!(streams.as_slice(), &[StreamId(0)]);
//! core.free(placement.block, &[])?;
//! core.check_invariants().unwrap();
//! # Ok::<(), AllocError>(())
//! ```

#![forbid(unsafe_code)]

mod align;
mod allocator;
mod config;
mod error;
mod fit;
mod free_index;
mod invariants;
mod marks;
mod segments;
mod stats;
mod types;

pub(crate) use align::{align_up, is_pow2};
pub use allocator::Allocator;
pub use config::{CoreConfig, GrowthPolicy, MAX_SEGMENT_BYTES};
pub use error::AllocError;
pub use fit::FitPlan;
pub use invariants::InvariantViolation;
pub use stats::{
    BlockSnapshot, BlockState, ClassStats, CoreStats, SegmentSnapshot, Snapshot, Stat,
};
pub use types::{
    AllocRequest, BlockId, Fence, Growth, Placement, SegmentId, SizeClass, StreamId, Wait,
};
