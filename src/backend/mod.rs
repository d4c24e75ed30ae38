//! Where segments come from and how they are registered: the [`Backend`] trait and
//! its two implementations, [`HostBackend`] (ranks as threads, host memory, always
//! available) and `NcclBackend` (`ncclMemAlloc` + `ncclCommWindowRegister`, feature
//! `nccl`).
//!
//! A backend is one rank's view: its memory, its streams, and an ordered list of
//! communicators ([`CommInfo`]) that is the same on every rank. The pool registers each
//! segment on every communicator whose [`CommInfo::registers`] is set, in list order.

pub mod host;
#[cfg(feature = "nccl")]
pub mod nccl;

pub use host::{HostBackend, HostConfig};
#[cfg(feature = "nccl")]
pub use nccl::{NcclBackend, NcclWorldConfig};

use crate::core::{Fence, SegmentId, StreamId};

/// A backend's name for a segment: unique among all pools on that backend (the pool's
/// number in the high 32 bits, its [`SegmentId`] in the low 32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentKey(pub u64);

impl SegmentKey {
    /// The key of segment `id` of pool number `pool`.
    pub fn new(pool: u32, id: SegmentId) -> Self {
        SegmentKey(((pool as u64) << 32) | id.0 as u64)
    }

    /// The pool-local segment id.
    pub fn segment(self) -> SegmentId {
        SegmentId(self.0 as u32)
    }
}

use crate::dtype::{DType, ReduceOp};
use crate::error::{NcclVersion, Result};
use crate::exchange::Exchange;
use crate::stream::Stream;
use serde::Serialize;
use std::fmt;
use std::time::Duration;

/// Which implementation a backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum BackendKind {
    /// In-process ranks on host memory.
    Host,
    /// NCCL on GPUs.
    Nccl,
}

/// What a communicator is for. The collectives pick one per call (see
/// [`coll`](crate::coll)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum CommRole {
    /// Default CTA policy, segments registered: NCCL's symmetric kernels.
    Symmetric,
    /// `CTAPolicy = NCCL_CTA_POLICY_ZERO`, segments registered: copy-engine all-gather.
    CopyEngine,
    /// Default CTA policy, nothing registered: NCCL's ring/tree kernels through its own
    /// buffers (the fastest for large reduce-scatters on two GPUs without NVLS).
    Plain,
}

/// One communicator of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CommInfo {
    /// What it is for.
    pub role: CommRole,
    /// The CTA policy it was created with (`0` default, `2` zero).
    pub cta_policy: i32,
    /// Whether the pool registers its segments on it.
    pub registers: bool,
}

impl CommInfo {
    /// A default-policy communicator whose segments are registered (symmetric kernels).
    pub const SYMMETRIC: CommInfo = CommInfo {
        role: CommRole::Symmetric,
        cta_policy: 0,
        registers: true,
    };
    /// A `CTAPolicy = NCCL_CTA_POLICY_ZERO` communicator whose segments are registered
    /// (copy-engine all-gather).
    pub const COPY_ENGINE: CommInfo = CommInfo {
        role: CommRole::CopyEngine,
        cta_policy: 2,
        registers: true,
    };
    /// A default-policy communicator where nothing is registered (ring/tree kernels).
    pub const PLAIN: CommInfo = CommInfo {
        role: CommRole::Plain,
        cta_policy: 0,
        registers: false,
    };
    /// The three communicators the crate's backends create, in registration order.
    pub const STANDARD: [CommInfo; 3] = [Self::SYMMETRIC, Self::COPY_ENGINE, Self::PLAIN];
}

/// Outcome of registering a segment on a communicator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Registration {
    /// A symmetric window (`NCCL_WIN_COLL_SYMMETRIC`) now covers the whole segment.
    Symmetric,
    /// The communicator cannot do symmetric memory (NCCL returned a NULL window): the
    /// segment is not registered and collectives on it take the plain path.
    Unsupported,
}

/// A byte range of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// The segment.
    pub segment: SegmentKey,
    /// Offset from the segment start, in bytes.
    pub offset_bytes: u64,
    /// Length in bytes.
    pub len_bytes: u64,
    /// The device address of the first byte, when the caller knows it (the pool
    /// caches it per buffer); a backend may use it instead of looking the segment up.
    pub device_ptr: Option<u64>,
}

impl Region {
    /// The `len_bytes` bytes that start `offset_bytes` into this region, with the device
    /// address moved along when it is known. The caller keeps the range inside the
    /// region (backends check every region against its segment).
    pub(crate) fn sub(&self, offset_bytes: u64, len_bytes: u64) -> Region {
        Region {
            segment: self.segment,
            offset_bytes: self.offset_bytes + offset_bytes,
            len_bytes,
            device_ptr: self.device_ptr.map(|p| p + offset_bytes),
        }
    }
}

/// Arguments of one collective call on one rank.
#[derive(Debug, Clone)]
pub struct CollArgs<'a> {
    /// Index of the communicator in [`Backend::communicators`].
    pub comm: usize,
    /// The input: this rank's chunk (all-gather) or the whole input (reduce-scatter).
    pub send: Region,
    /// The output: the whole output (all-gather) or this rank's chunk (reduce-scatter).
    pub recv: Region,
    /// Elements per rank: the all-gather input count, the reduce-scatter output count.
    pub count: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduction (reduce-scatter only).
    pub op: ReduceOp,
    /// Stream to enqueue on.
    pub stream: &'a Stream,
    /// Whether the pool expects the symmetric path: the host backend then also checks
    /// that every rank passes the same offsets, as NCCL's kernels assume.
    pub symmetric: bool,
}

/// The regions must hold what a collective will touch: `count` elements on one side and
/// `world × count` on the other (the input for a reduce-scatter, the output for an
/// all-gather).
pub(crate) fn check_counts(
    op: &'static str,
    a: &CollArgs<'_>,
    world: usize,
    reduce: bool,
) -> Result<()> {
    let chunk = a.count.checked_mul(a.dtype.size_bytes());
    let whole = chunk.and_then(|c| c.checked_mul(world as u64));
    let (small, big) = if reduce {
        (&a.recv, &a.send)
    } else {
        (&a.send, &a.recv)
    };
    match (chunk, whole) {
        (Some(c), Some(w)) if c <= small.len_bytes && w <= big.len_bytes => Ok(()),
        _ => Err(crate::Error::InvalidCollective {
            op,
            detail: format!(
                "{} elements of {} bytes per rank do not fit regions of {} and {} bytes",
                a.count,
                a.dtype.size_bytes(),
                a.send.len_bytes,
                a.recv.len_bytes
            ),
        }),
    }
}

/// Where segments come from and how they are registered; one rank's view.
///
/// Implementations must be usable from several threads (`Send + Sync`) and must
/// serialise calls on one communicator (NCCL's communicators are not thread-safe).
///
/// # Collective
/// [`register`](Self::register), [`all_gather`](Self::all_gather) and
/// [`reduce_scatter`](Self::reduce_scatter) are collective on their communicator: every
/// rank calls them in the same order with matching arguments. Everything else is local.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The NCCL version in use (the host backend reports the version whose rules it
    /// follows).
    fn nccl_version(&self) -> NcclVersion;
    /// Segment size and alignment granularity in bytes (2 MiB on H200).
    fn granularity_bytes(&self) -> u64;
    /// The communicators, in the order segments are registered. Same on every rank.
    fn communicators(&self) -> &[CommInfo];
    /// The host-side exchange the pool agrees over.
    fn exchange(&self) -> &dyn Exchange;

    /// Allocate a segment of `size_bytes` (a multiple of the granularity) under `id`.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`](crate::Error::OutOfMemory) if the memory is not there; a
    /// backend error otherwise. Nothing is allocated on error.
    fn alloc_segment(&self, id: SegmentKey, size_bytes: u64) -> Result<()>;
    /// Free a segment. It must not be registered on any communicator.
    ///
    /// # Errors
    /// A backend error; the segment is forgotten either way.
    fn free_segment(&self, id: SegmentKey) -> Result<()>;
    /// Register a whole segment as a symmetric window on communicator `comm`.
    ///
    /// # Collective
    /// Every rank registers the same segments on `comm` in the same order (NCCL pairs
    /// windows across ranks by call order).
    ///
    /// # Errors
    /// A backend error; [`Error::Timeout`](crate::Error::Timeout) on the host backend if
    /// peers do not register in time.
    fn register(&self, id: SegmentKey, comm: usize) -> Result<Registration>;
    /// Deregister a segment's window on `comm` (local, not collective). No-op if not
    /// registered.
    ///
    /// # Errors
    /// A backend error.
    fn deregister(&self, id: SegmentKey, comm: usize) -> Result<()>;

    /// A new stream on this rank's device.
    ///
    /// # Errors
    /// A backend error.
    fn new_stream(&self) -> Result<Stream>;
    /// Record a fence on `stream`: a point after all work enqueued so far. Fences on one
    /// stream increase.
    ///
    /// # Errors
    /// A backend error.
    fn record_fence(&self, stream: &Stream) -> Result<Fence>;
    /// Make `stream` wait (device-side) for `fence` recorded on stream `on`.
    ///
    /// # Errors
    /// A backend error.
    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()>;
    /// Whether `stream` is capturing a CUDA graph.
    ///
    /// # Errors
    /// A backend error.
    fn is_capturing(&self, stream: &Stream) -> Result<bool>;
    /// Wait on the host until all work on this rank's device is done.
    ///
    /// # Errors
    /// A backend error.
    fn synchronize(&self) -> Result<()>;

    /// Wait on the host, at most `timeout`, for all work on this rank's device: `true`
    /// if it drained. Used where blocking without bound is not allowed (drops).
    ///
    /// # Errors
    /// A backend error.
    fn synchronize_within(&self, timeout: Duration) -> Result<bool> {
        let _ = timeout;
        self.synchronize().map(|()| true)
    }

    /// Copy `data` into a region, ordered on `stream`.
    ///
    /// # Errors
    /// A backend error.
    fn write(&self, region: Region, data: &[u8], stream: &Stream) -> Result<()>;
    /// Copy a region into `out`, ordered on `stream`, and wait for it.
    ///
    /// # Errors
    /// A backend error.
    fn read(&self, region: Region, out: &mut [u8], stream: &Stream) -> Result<()>;
    /// The device address of a region's first byte (NCCL backend), for interop.
    fn device_ptr(&self, region: Region) -> Option<u64>;
    /// Time the device work `f` enqueues on `stream`, in milliseconds (CUDA events on
    /// the NCCL backend, the wall clock on the host backend). Waits for it.
    ///
    /// # Errors
    /// A backend error, or the first error of `f`.
    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64>;

    /// All-gather `count` elements per rank from `send` into `recv`.
    ///
    /// # Errors
    /// A backend error; on the host backend also
    /// [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) and
    /// [`Error::Timeout`](crate::Error::Timeout).
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()>;
    /// Reduce-scatter: `recv` gets `count` elements, the reduction over ranks of this
    /// rank's chunk of `send`.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()>;
}
