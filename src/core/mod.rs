//! The deterministic caching-allocator core: pure data structures, no FFI, no threads,
//! no unsafe code.
//!
//! [`Allocator`] carves blocks out of segments that the caller provides. It is the part
//! of the pool that must make *exactly* the same decision on every rank, so every
//! decision is a function of the call sequence alone.
//!
//! # Algorithm
//!
//! - **Rounding** ([`CoreConfig::round_request`]) up to a multiple of `min_block_bytes`
//!   (512 B), all arithmetic checked.
//! - **Size classes** ([`SizeClass`]), each with its own segments and free index.
//! - **Best fit**: the smallest free block of the class that holds the request at an
//!   aligned offset, ties broken by segment then offset.
//! - **Split**: the padding in front of an aligned block stays free; a remainder is
//!   split off when worth keeping (`min_block_bytes` in small segments,
//!   `large_split_min_bytes` in large ones).
//! - **Coalesce**: a freed block merges with its free neighbours in the same segment
//!   (never across segments, which are separate device allocations).
//! - **Growth**: when nothing fits, [`Allocator::alloc`] returns
//!   [`AllocError::NeedsGrowth`] with the segment to add ([`CoreConfig`]'s policy); the
//!   caller adds it with [`Allocator::add_segment`] and retries. Segment ids count up
//!   from 0 and are never reused.
//! - **Streams**: placement never looks at streams or fence completion; memory handed
//!   out on another stream than its last users' comes with their fences to wait for
//!   ([`Placement::waits`]). A merged free block keeps the latest fence per stream of
//!   all its parts: conservative, never unsafe.
//! - **Hand-over**: [`Allocator::layout`] is what placement depends on; a rank joining
//!   a grown group starts from the survivors' with [`Allocator::from_layout`] and
//!   decides as they do from then on.
//!
//! [`Allocator::check_invariants`] recounts everything and lists the invariants.
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
mod layout;
mod marks;
mod segments;
mod stats;
mod types;

pub(crate) use align::is_pow2;
pub use allocator::Allocator;
pub use config::{CoreConfig, GrowthPolicy, MAX_SEGMENT_BYTES};
pub use error::AllocError;
pub use fit::FitPlan;
pub use invariants::InvariantViolation;
pub use layout::{BlockLayout, Layout, LiveBlock, SegmentLayout};
pub use stats::{
    BlockSnapshot, BlockState, ClassStats, CoreStats, SegmentSnapshot, Snapshot, Stat,
};
pub use types::{
    AllocRequest, BlockId, Fence, Growth, Placement, SegmentId, SizeClass, StreamId, Wait,
};
