//! # symmpool
//!
//! A deterministic symmetric-memory caching allocator for NCCL, with a thin
//! collectives module on top.
//!
//! Since NCCL 2.27 a collective can run on *symmetric memory*: buffers every rank has
//! registered, in the same order, as an NCCL window. On such buffers NCCL runs faster
//! kernels, and since 2.28 it runs all-gather on the GPU's copy engines, leaving every
//! SM to the computation it overlaps. Registration costs milliseconds and is
//! collective, so the memory must come from a pool that carves many buffers out of a
//! few registered segments, registers each segment once per communicator, and makes
//! exactly the same placement decision on every rank. That pool is this crate.
//!
//! The communicator set ([`Group`], [`GroupConfig`]: one rank's backend, the ledger in
//! which the ranks compare their calls, the timeout and check mode), the pool
//! ([`SymmPool`], [`PoolConfig`]) and the allocator core's types
//! ([`CoreConfig`], [`SegmentId`], …) are re-exported here; the public modules are
//! [`control`] (what the ranks agree over: [`Exchange`], [`LocalExchange`] for threads,
//! [`StoreExchange`] for one process per rank, [`Launch`]), [`backend`] (where segments
//! come from: [`HostBackend`], [`ShmBackend`], `NcclBackend` with `ncclMemAlloc` and
//! `ncclCommWindowRegister`), [`coll`] (a [`Coll`] handle whose [`CollectiveCalls`]
//! run checked all-gather, reduce-scatter and all-reduce on pool buffers) and
//! [`observe`] (`tracing`, statistics, snapshots). `docs/ARCHITECTURE.md` in the
//! repository shows how the modules stack (a test checks it).
//!
//! ```
//! use symmpool::{PoolConfig, Stream, SymmPool};
//!
//! let pools = SymmPool::host_group(2, PoolConfig::default())?;
//! std::thread::scope(|s| {
//!     for pool in &pools {
//!         s.spawn(move || {
//!             let stream = Stream::host();
//!             // Like `with torch.cuda.use_mem_pool(pool):`
//!             let buf = pool.scope(|| symmpool::alloc(4 << 20, &stream)).unwrap();
//!             assert_eq!(buf.offset_bytes(), 0); // the same on every rank
//!         });
//!     }
//! });
//! # Ok::<(), symmpool::Error>(())
//! ```
//!
//! # Where the ranks are
//!
//! | ranks | backend | made by |
//! |---|---|---|
//! | threads of one process, no GPU (tests, CI) | [`HostBackend`] | [`SymmPool::host_group`] |
//! | one process per rank, no GPU (`torchrun` on a CPU machine) | [`ShmBackend`]: segments in shared memory every rank maps | `ShmBackend::join(Arc::new(StoreExchange::from_env()?), ShmConfig::default())`, then [`Group::new`] and [`SymmPool::new`] |
//! | one process per GPU | `NcclBackend` (feature `nccl`) | `NcclBackend::launch(NcclConfig::default())`, then [`Group::new`] and [`SymmPool::new`] |
//!
//! `examples/shm_ranks.rs` is a whole program of the second kind: it runs under
//! `torchrun --no-python`, or starts its own ranks.
//!
//! # Threads and safety
//!
//! A [`SymmPool`] is one rank's pool; it is `Send + Sync` and serialises its own
//! calls. The ranks of a communicator each own one and make the same sequence of pool
//! calls; when they do not, the next collective pool operation fails with
//! [`Error::Divergence`] on every rank instead of hanging.

#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
#![warn(unreachable_pub, clippy::multiple_unsafe_ops_per_block)]

/// Builder setters, one a line: `with_x(field: Type, …);` writes
/// `pub fn with_x(mut self, field: Type, …) -> Self`, which sets `self.field` (each
/// field given), documented "Set [`field`](Self::field)." for each and then any doc
/// attributes written before it.
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident($($field:ident: $ty:ty),+);)*) => {$(
        $(#[doc = concat!("Set [`", stringify!($field), "`](Self::", stringify!($field), ").")])+
        $(#[$doc])*
        pub fn $name(mut self, $($field: $ty),+) -> Self {
            $(self.$field = $field;)+
            self
        }
    )*};
}

pub mod backend;
pub mod coll;
pub mod control;
mod core;
mod deadline;
mod dtype;
mod error;
mod group;
pub mod observe;
mod pool;
mod stream;

pub use backend::{Backend, HostBackend, HostConfig};
#[cfg(feature = "nccl")]
pub use backend::{NcclBackend, NcclConfig};
#[cfg(target_os = "linux")]
pub use backend::{ShmBackend, ShmConfig};
pub use coll::{Coll, CollectiveCalls};
pub use control::{
    ChannelId, Exchange, Launch, LocalExchange, StoreConfig, StoreExchange, StoreServer,
};
// The core's types that the public API names (the core itself is internal).
pub use core::{
    AllocError, BlockId, CoreConfig, Fence, Growth, GrowthPolicy, InvariantViolation, SegmentId,
    SizeClass, StreamId,
};
pub use deadline::Deadline;
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CollectiveDivergence, Divergence, Error, ErrorKind, NcclVersion, Result};
pub use group::{CheckMode, Group, GroupConfig};
pub use half::{bf16, f16};
#[cfg(feature = "nccl")]
pub use pool::{CudaView, CudaViewMut};
pub use pool::{
    FitReport, GrowReport, MAX_HISTORY, PoolConfig, ShrinkReport, SymmBuffer, SymmPool, TypedView,
    alloc, alloc_aligned, current,
};
pub use stream::Stream;

/// The allocator core, whole, for the crate's own tests, benchmarks and fuzz target
/// (which drive [`Allocator`](crate::__core::Allocator) directly). **Not public API**:
/// hidden from the documentation, with no stability promise; it may change or go in
/// any release. Users name the core's types from the crate root.
#[doc(hidden)]
pub mod __core {
    pub use crate::core::*;
}

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
