//! Where segments come from, how they are registered, and how device work is ordered:
//! the provider seam, and its implementations [`HostBackend`] (ranks as threads, host
//! memory, always available) and `NcclBackend` (`ncclMemAlloc` +
//! `ncclCommWindowRegister`, feature `nccl`).
//!
//! A [`Backend`] is one rank's view, assembled from four small parts, one per job:
//!
//! | part | trait | job |
//! |---|---|---|
//! | segments | [`SegmentProvider`] | allocate a segment → an owned [`Segment`]; register it on a communicator → an owned [`Window`] (or "no symmetric support"); consuming deregister and free |
//! | streams | [`StreamOps`] | streams, fences (events), device-side waits, capture status, draining with a deadline |
//! | data | [`DataMover`] | host ↔ segment copies, timing of device work |
//! | collectives | [`Collectives`] | all-gather and reduce-scatter on regions (dispatched by [`coll`](crate::coll)) |
//!
//! plus its identity ([`BackendInfo`]: rank, world size, NCCL version, granularity, the
//! communicators) and the host-side [`Exchange`] the pool agrees over.
//!
//! Backends keep no tables of segments or windows: the pool's segment entries own the
//! handles, and every operation on a segment receives it. The operations that can
//! break the pool's invariants (register, deregister, free) are `unsafe fn`s with a
//! `# Safety` list; the pool is their only caller in the crate. A test double replaces
//! one part ([`Backend::with_streams`], …) and keeps the others.
//!
//! Safe code cannot free or deregister what a pool owns:
//!
//! ```compile_fail
//! use symmpool::{HostBackend, HostConfig};
//! let backend = HostBackend::world(HostConfig::new(1)).unwrap().remove(0);
//! let segment = backend.segments().allocate(2 << 20).unwrap();
//! backend.segments().free(segment); // error[E0133]: call to unsafe function
//! ```

pub mod host;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(target_os = "linux")]
pub mod shm;

pub use host::{HostBackend, HostConfig};
#[cfg(feature = "nccl")]
pub use nccl::{NcclBackend, NcclConfig, NcclWorldConfig};
#[cfg(target_os = "linux")]
pub use shm::{ShmBackend, ShmConfig};

use crate::control::{ChannelId, Exchange};
use crate::core::{Fence, StreamId};
use crate::deadline::Deadline;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use serde::Serialize;
use std::any::Any;
use std::fmt;
use std::sync::Arc;

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

/// Who a backend is: the same on every call, and (but for `rank`) on every rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct BackendInfo {
    /// Which implementation.
    pub kind: BackendKind,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// The NCCL version in use (the host backend reports the version whose rules it
    /// follows).
    pub nccl_version: NcclVersion,
    /// Segment size and alignment granularity in bytes, a power of two (2 MiB on H200:
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`, which `ncclMemAlloc` rounds to).
    pub granularity_bytes: u64,
    /// The communicators, in the order segments are registered. Same on every rank.
    pub communicators: Vec<CommInfo>,
    /// Number of nodes (hosts) the ranks run on, 1 unless set with
    /// [`with_nodes`](Self::with_nodes). The NCCL backend counts the ranks' node
    /// identities at set-up; path selection avoids the paths that need one NVLink
    /// domain when it is above 1.
    pub nodes: usize,
}

impl BackendInfo {
    /// The identity of one rank of a backend.
    ///
    /// # Errors
    /// [`Error::Config`] for `rank >= world_size`, no communicators, more than
    /// 64, or a granularity that is not a power of two.
    pub fn new(
        kind: BackendKind,
        rank: usize,
        world_size: usize,
        nccl_version: NcclVersion,
        granularity_bytes: u64,
        communicators: Vec<CommInfo>,
    ) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::Config {
                setting: "rank",
                value: format!("{rank} in a world of {world_size}"),
                expected: "a rank below the world size",
            });
        }
        if communicators.is_empty() || communicators.len() > 64 {
            return Err(Error::Config {
                setting: "communicators",
                value: format!("{} communicators", communicators.len()),
                expected: "1 to 64 communicators",
            });
        }
        if !crate::core::is_pow2(granularity_bytes) {
            return Err(Error::Config {
                setting: "granularity_bytes",
                value: granularity_bytes.to_string(),
                expected: "a power of two",
            });
        }
        Ok(BackendInfo {
            kind,
            rank,
            world_size,
            nccl_version,
            granularity_bytes,
            communicators,
            nodes: 1,
        })
    }

    /// The same identity, with the ranks spread over `nodes` nodes (at least 1).
    pub fn with_nodes(mut self, nodes: usize) -> Self {
        self.nodes = nodes.max(1);
        self
    }
}

/// The memory behind a [`Segment`], as a provider made it.
pub trait SegmentMemory: Send + Sync + fmt::Debug + Any {
    /// Size in bytes: a non-zero multiple of the backend's granularity, constant for
    /// the memory's life ([`Segment::new`] reads it once).
    fn size_bytes(&self) -> u64;
    /// The device address of the first byte (NCCL), `None` for host memory.
    fn device_ptr(&self) -> Option<u64>;
    /// For a provider to find its own type again.
    fn as_any(&self) -> &dyn Any;
}

/// An owned segment: one whole allocation of a provider (one `ncclMemAlloc`), at
/// least one granularity long.
///
/// The pool's segment entry is its single owner. Give it back with the provider's
/// [`free`](SegmentProvider::free); dropping it instead leaks device memory on
/// purpose (host memory is released), which is what a pool does when its device
/// cannot drain in time.
#[derive(Debug)]
pub struct Segment {
    memory: Box<dyn SegmentMemory>,
    /// `memory.size_bytes()`, read once: every collective call checks its regions.
    size_bytes: u64,
}

impl Segment {
    /// Wrap a provider's memory.
    pub fn new(memory: Box<dyn SegmentMemory>) -> Self {
        let size_bytes = memory.size_bytes();
        Segment { memory, size_bytes }
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The device address of the first byte, `None` for host memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.memory.device_ptr()
    }

    /// The provider's memory, as its own type.
    pub fn memory<T: SegmentMemory>(&self) -> Option<&T> {
        self.memory.as_any().downcast_ref::<T>()
    }

    /// The `len_bytes` bytes at `offset_bytes`, checked against the segment.
    ///
    /// # Errors
    /// [`Error::BadView`] if the range leaves the segment.
    #[inline]
    pub fn region(&self, offset_bytes: u64, len_bytes: u64) -> Result<Region<'_>> {
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.size_bytes() => Ok(Region {
                segment: self,
                offset_bytes,
                len_bytes,
            }),
            _ => Err(outside(
                offset_bytes,
                len_bytes,
                "segment",
                self.size_bytes(),
            )),
        }
    }
}

/// An owned window: one segment registered on one communicator
/// (`ncclCommWindowRegister(.., NCCL_WIN_COLL_SYMMETRIC)`). The pool's segment entry
/// owns it beside its segment; give it back with
/// [`deregister`](SegmentProvider::deregister) before the segment is freed.
pub struct Window {
    comm: usize,
    ordinal: u64,
    handle: Box<dyn Any + Send + Sync>,
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("comm", &self.comm)
            .field("ordinal", &self.ordinal)
            .finish_non_exhaustive()
    }
}

impl Window {
    /// A provider's window on communicator `comm`, its `ordinal`-th registration there
    /// (1-based), with the provider's own handle.
    pub fn new(comm: usize, ordinal: u64, handle: Box<dyn Any + Send + Sync>) -> Self {
        Window {
            comm,
            ordinal,
            handle,
        }
    }

    /// The communicator, an index into [`BackendInfo::communicators`].
    pub fn comm(&self) -> usize {
        self.comm
    }

    /// Its position among the registrations on its communicator (1-based): NCCL pairs
    /// windows across ranks by this order.
    pub fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// The provider's handle, as its own type.
    pub fn handle<T: Any>(&self) -> Option<&T> {
        self.handle.downcast_ref::<T>()
    }

    /// Take the provider's handle out, as its own type (or the window back).
    ///
    /// # Errors
    /// The window, unchanged, if the handle is of another type.
    pub fn into_handle<T: Any>(self) -> std::result::Result<Box<T>, Window> {
        let Window {
            comm,
            ordinal,
            handle,
        } = self;
        handle.downcast::<T>().map_err(|handle| Window {
            comm,
            ordinal,
            handle,
        })
    }
}

/// A release a provider could not do: the handle comes back with the reason, so the
/// caller can try again later instead of losing track of the memory.
#[derive(Debug)]
pub struct Refused<T> {
    /// The handle, still owned.
    pub handle: T,
    /// Why.
    pub error: Error,
}

/// Where segments come from and how they become windows.
///
/// # Collective
/// [`register`](Self::register) is collective on its communicator: every rank
/// registers the same segments in the same order (NCCL pairs windows by call order).
/// Everything else is local.
pub trait SegmentProvider: Send + Sync + fmt::Debug {
    /// Allocate a segment of `size_bytes` (a non-zero multiple of the granularity).
    ///
    /// # Errors
    /// [`Error::DeviceOutOfMemory`] or [`Error::PoolLimit`] if the memory is not there;
    /// [`Error::Cuda`] / [`Error::Nccl`] otherwise. Nothing is allocated on error.
    fn allocate(&self, size_bytes: u64) -> Result<Segment>;

    /// Register the whole segment as a symmetric window on communicator `comm`.
    /// `Ok(None)`: the communicator cannot do symmetric memory (NCCL returned a NULL
    /// window); the segment is not registered there.
    ///
    /// # Collective
    /// Every rank registers the same segments on `comm` in the same order.
    ///
    /// # Safety
    /// - every rank makes this call for its own segment of the same size at the same
    ///   point of its sequence of registrations on `comm` (else NCCL pairs the wrong
    ///   buffers, or hangs);
    /// - `segment` is not registered on `comm` yet (one window per segment and
    ///   communicator: NCCL ≥ 2.30.7 makes a second one undefined behaviour);
    /// - no stream of this device is capturing a CUDA graph.
    ///
    /// # Errors
    /// [`Error::Timeout`] (or [`Error::NcclTimeout`]) if peers have not registered by
    /// `deadline`, the caller's; [`Error::Nccl`]; [`Error::RegistrationMismatch`]
    /// where the provider can see that ranks passed different sizes.
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> Result<Option<Window>>;

    /// Deregister a window (local in NCCL).
    ///
    /// # Safety
    /// `window` was made by this provider's [`register`](Self::register), and no work
    /// that uses its segment through that communicator is pending on the device.
    ///
    /// # Errors
    /// The window back, with [`Error::Nccl`].
    unsafe fn deregister(&self, window: Window) -> std::result::Result<(), Refused<Window>>;

    /// Free a segment.
    ///
    /// # Safety
    /// `segment` was made by this provider's [`allocate`](Self::allocate), no window
    /// covers it any more, and no pending device work uses it.
    ///
    /// # Errors
    /// The segment back, with [`Error::Cuda`] / [`Error::Nccl`].
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>>;
}

/// Streams, fences and device-side ordering.
pub trait StreamOps: Send + Sync + fmt::Debug {
    /// A new stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    fn new_stream(&self) -> Result<Stream>;
    /// Record a fence on `stream`: a point after all work enqueued so far. Fences on
    /// one stream increase.
    ///
    /// # Errors
    /// [`Error::WrongStream`] for a stream of another backend kind; [`Error::Cuda`].
    fn record_fence(&self, stream: &Stream) -> Result<Fence>;
    /// Make `stream` wait (device-side) for `fence` recorded on stream `on`.
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()>;
    /// The latest fence on `stream` known to be complete, if any (a cheap query that
    /// never waits). Only statistics use it: placement never depends on completion.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>>;
    /// Whether `stream` is capturing a CUDA graph.
    ///
    /// # Errors
    /// As [`record_fence`](Self::record_fence).
    fn is_capturing(&self, stream: &Stream) -> Result<bool>;
    /// Wait on the host until all work enqueued so far on every stream this device has
    /// recorded fences on is done, or `deadline` passes: `Ok(true)` if it drained,
    /// `Ok(false)` at the deadline. Never waits past the deadline (it polls; it does
    /// not block in the driver).
    ///
    /// # Errors
    /// [`Error::Cuda`] (a failed device: its work will never drain).
    fn drain(&self, deadline: Deadline) -> Result<bool>;
}

/// Copies between the host and segments, and timing of device work.
pub trait DataMover: Send + Sync + fmt::Debug {
    /// Copy `data` into `region` (its first `data.len()` bytes), ordered on `stream`;
    /// returns once `data` may be reused.
    ///
    /// # Errors
    /// [`Error::BadView`] if `data` is longer than the region; [`Error::WrongStream`];
    /// [`Error::Cuda`].
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()>;
    /// Copy `region` (its first `out.len()` bytes) into `out`, ordered on `stream`, and
    /// wait for it.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()>;
    /// Time the device work `f` enqueues on `stream`, in milliseconds (CUDA events on
    /// the NCCL backend, the wall clock on the host backend). Waits for it.
    ///
    /// # Errors
    /// [`Error::Cuda`], or the first error of `f`.
    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64>;
}

/// A byte range of a segment. Made only through [`Segment::region`], so it always lies
/// inside its segment.
#[derive(Debug, Clone, Copy)]
pub struct Region<'a> {
    segment: &'a Segment,
    offset_bytes: u64,
    len_bytes: u64,
}

impl<'a> Region<'a> {
    /// The segment.
    pub fn segment(&self) -> &'a Segment {
        self.segment
    }

    /// Offset from the segment start, in bytes.
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// Length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// The device address of the first byte (NCCL), `None` for host memory.
    pub fn device_ptr(&self) -> Option<u64> {
        self.segment.device_ptr().map(|p| p + self.offset_bytes)
    }

    /// The `len_bytes` bytes that start `offset_bytes` into this region.
    ///
    /// # Errors
    /// [`Error::BadView`] if they leave the region.
    #[inline]
    pub fn sub(&self, offset_bytes: u64, len_bytes: u64) -> Result<Region<'a>> {
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.len_bytes => Ok(Region {
                segment: self.segment,
                offset_bytes: self.offset_bytes + offset_bytes,
                len_bytes,
            }),
            _ => Err(outside(offset_bytes, len_bytes, "region", self.len_bytes)),
        }
    }
}

/// The error of a range that leaves a `what` of `size_bytes` (out of line: the checks
/// above run on every collective call).
#[cold]
#[inline(never)]
fn outside(offset_bytes: u64, len_bytes: u64, what: &str, size_bytes: u64) -> Error {
    Error::BadView(format!(
        "range {offset_bytes}+{len_bytes} outside a {what} of {size_bytes} bytes"
    ))
}

/// Arguments of one collective call on one rank.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CollArgs<'a> {
    /// Index of the communicator in [`BackendInfo::communicators`].
    pub comm: usize,
    /// The input: this rank's chunk (all-gather) or the whole input (reduce-scatter).
    pub send: Region<'a>,
    /// The output: the whole output (all-gather) or this rank's chunk (reduce-scatter).
    pub recv: Region<'a>,
    /// Elements per rank: the all-gather input count, the reduce-scatter output count.
    pub count: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduction (reduce-scatter only).
    pub op: ReduceOp,
    /// Stream to enqueue on.
    pub stream: &'a Stream,
    /// The windows of the send and receive segments on `comm`, when the call expects
    /// the symmetric path (both `None` on the plain path).
    pub windows: (Option<&'a Window>, Option<&'a Window>),
}

impl<'a> CollArgs<'a> {
    /// Arguments for communicator `comm`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        comm: usize,
        send: Region<'a>,
        recv: Region<'a>,
        count: u64,
        dtype: DType,
        op: ReduceOp,
        stream: &'a Stream,
        windows: (Option<&'a Window>, Option<&'a Window>),
    ) -> Self {
        CollArgs {
            comm,
            send,
            recv,
            count,
            dtype,
            op,
            stream,
            windows,
        }
    }

    /// Whether the call expects NCCL's symmetric path (windows given).
    pub fn symmetric(&self) -> bool {
        self.windows.0.is_some() || self.windows.1.is_some()
    }

    /// The regions must hold what the collective will touch: `count` elements on one
    /// side and `world × count` on the other (the input for a reduce-scatter, the
    /// output for an all-gather). Returns the chunk size in bytes.
    ///
    /// # Errors
    /// [`Error::InvalidCollective`].
    pub fn check_counts(&self, op: &'static str, world: usize, reduce: bool) -> Result<u64> {
        let chunk = self.count.checked_mul(self.dtype.size_bytes());
        let whole = chunk.and_then(|c| c.checked_mul(world as u64));
        let (small, big) = if reduce {
            (&self.recv, &self.send)
        } else {
            (&self.send, &self.recv)
        };
        match (chunk, whole) {
            (Some(c), Some(w)) if c <= small.len_bytes && w <= big.len_bytes => Ok(c),
            _ => Err(Error::InvalidCollective {
                op,
                detail: format!(
                    "{} elements of {} bytes per rank do not fit regions of {} and {} bytes",
                    self.count,
                    self.dtype.size_bytes(),
                    self.send.len_bytes,
                    self.recv.len_bytes
                ),
            }),
        }
    }
}

/// The collectives a backend runs on regions. [`coll`](crate::coll) checks the
/// buffers, picks the communicator and path, and calls these.
///
/// # Collective
/// Every rank calls them in the same order on the same communicator, with matching
/// counts, types, operations and (on the symmetric path) offsets.
pub trait Collectives: Send + Sync + fmt::Debug {
    /// All-gather `count` elements per rank from `send` into `recv`.
    ///
    /// # Errors
    /// [`Error::InvalidCollective`]; [`Error::Nccl`]; on the host backend also
    /// [`Error::CollectiveMismatch`], [`Error::Timeout`] and [`Error::GroupBroken`].
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()>;
    /// Reduce-scatter: `recv` gets `count` elements, the reduction over ranks of this
    /// rank's chunk of `send`.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()>;
}

/// How long making a backend waits for the other ranks (ranks of real jobs start
/// minutes apart): 10 minutes. A lost peer ends the wait sooner (see
/// [`control`](crate::control)).
pub const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// One rank's backend: its identity, its exchange, and the four parts. Cheap to
/// clone (shared parts).
#[derive(Clone)]
pub struct Backend {
    info: Arc<BackendInfo>,
    /// The channel on which pools agree before every window registration.
    registrations: ChannelId,
    /// Held from that agreement to the last registration of the segment, so that two
    /// pools of this rank cannot interleave their registrations.
    registering: Arc<parking_lot::Mutex<()>>,
    exchange: Arc<dyn Exchange>,
    segments: Arc<dyn SegmentProvider>,
    streams: Arc<dyn StreamOps>,
    data: Arc<dyn DataMover>,
    collectives: Arc<dyn Collectives>,
    origin: Arc<dyn Any + Send + Sync>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("info", &self.info)
            .field("streams", &self.streams)
            .finish_non_exhaustive()
    }
}

impl Backend {
    /// A backend whose four parts are one value (as `NcclBackend` is; the host
    /// backends share their stream operations, see `with_stream_ops`).
    ///
    /// # Collective
    /// Every rank makes its backend at the same point: the ranks open the backend's
    /// registration channel on `exchange` (waiting up to [`SETUP_TIMEOUT`] for late
    /// ranks). Before each window registration the pools agree there on which pool
    /// registers a segment of which size, so two pools sharing the communicators can
    /// never pair one's window with the other's.
    ///
    /// # Errors
    /// [`Error::Config`] if `exchange` disagrees with `info` on rank or world size;
    /// the errors of [`Exchange::open_channel`].
    pub fn new<T>(info: BackendInfo, exchange: Arc<dyn Exchange>, parts: Arc<T>) -> Result<Self>
    where
        T: SegmentProvider + StreamOps + DataMover + Collectives + 'static,
    {
        Self::with_stream_ops(info, exchange, parts.clone(), parts)
    }

    /// As [`new`](Self::new), with the stream operations from `streams` rather than
    /// from `parts` (the host backends share theirs).
    pub(crate) fn with_stream_ops<T>(
        info: BackendInfo,
        exchange: Arc<dyn Exchange>,
        parts: Arc<T>,
        streams: Arc<dyn StreamOps>,
    ) -> Result<Self>
    where
        T: SegmentProvider + DataMover + Collectives + 'static,
    {
        if exchange.rank() != info.rank || exchange.world_size() != info.world_size {
            return Err(Error::Config {
                setting: "exchange",
                value: format!(
                    "rank {} of {}, the backend rank {} of {}",
                    exchange.rank(),
                    exchange.world_size(),
                    info.rank,
                    info.world_size
                ),
                expected: "the backend's rank and world size",
            });
        }
        let registrations = exchange.open_channel("backend:registrations", SETUP_TIMEOUT)?;
        Ok(Backend {
            info: Arc::new(info),
            registrations,
            registering: Arc::new(parking_lot::Mutex::new(())),
            exchange,
            segments: parts.clone(),
            streams,
            data: parts.clone(),
            collectives: parts.clone(),
            origin: parts,
        })
    }

    /// The same backend with its segment provider replaced by `f(provider)` (a test
    /// double gets the original to delegate to).
    pub fn with_segments(
        mut self,
        f: impl FnOnce(Arc<dyn SegmentProvider>) -> Arc<dyn SegmentProvider>,
    ) -> Self {
        self.segments = f(self.segments);
        self
    }

    /// The same backend with its stream operations replaced by `f(streams)`.
    pub fn with_streams(
        mut self,
        f: impl FnOnce(Arc<dyn StreamOps>) -> Arc<dyn StreamOps>,
    ) -> Self {
        self.streams = f(self.streams);
        self
    }

    /// The same backend with its data mover replaced by `f(data)`.
    pub fn with_data(mut self, f: impl FnOnce(Arc<dyn DataMover>) -> Arc<dyn DataMover>) -> Self {
        self.data = f(self.data);
        self
    }

    /// The same backend with its collectives replaced by `f(collectives)`.
    pub fn with_collectives(
        mut self,
        f: impl FnOnce(Arc<dyn Collectives>) -> Arc<dyn Collectives>,
    ) -> Self {
        self.collectives = f(self.collectives);
        self
    }

    /// The same backend with its exchange replaced by `f(exchange)`.
    ///
    /// # Errors
    /// [`Error::Config`] if the new exchange disagrees on rank or world size.
    pub fn with_exchange(
        mut self,
        f: impl FnOnce(Arc<dyn Exchange>) -> Arc<dyn Exchange>,
    ) -> Result<Self> {
        let exchange = f(self.exchange.clone());
        if exchange.rank() != self.info.rank || exchange.world_size() != self.info.world_size {
            return Err(Error::Config {
                setting: "exchange",
                value: format!("rank {} of {}", exchange.rank(), exchange.world_size()),
                expected: "the backend's rank and world size",
            });
        }
        self.exchange = exchange;
        Ok(self)
    }

    /// Who this backend is.
    pub fn info(&self) -> &BackendInfo {
        &self.info
    }

    /// Which implementation.
    pub fn kind(&self) -> BackendKind {
        self.info.kind
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.info.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.info.world_size
    }

    /// The NCCL version whose rules apply.
    pub fn nccl_version(&self) -> NcclVersion {
        self.info.nccl_version
    }

    /// Segment granularity in bytes.
    pub fn granularity_bytes(&self) -> u64 {
        self.info.granularity_bytes
    }

    /// The communicators, in registration order.
    pub fn communicators(&self) -> &[CommInfo] {
        &self.info.communicators
    }

    /// The host-side exchange the pool agrees over.
    pub fn exchange(&self) -> &dyn Exchange {
        self.exchange.as_ref()
    }

    /// The channel of the pre-registration agreement, and the lock that makes the
    /// agreement and the registrations that follow one step on this rank.
    pub(crate) fn registration_channel(&self) -> (ChannelId, parking_lot::MutexGuard<'_, ()>) {
        (self.registrations, self.registering.lock())
    }

    /// The exchange, shared (for another backend or a store-backed component).
    pub fn exchange_handle(&self) -> Arc<dyn Exchange> {
        self.exchange.clone()
    }

    /// The segment provider.
    pub fn segments(&self) -> &dyn SegmentProvider {
        self.segments.as_ref()
    }

    /// Streams and fences.
    pub fn streams(&self) -> &dyn StreamOps {
        self.streams.as_ref()
    }

    /// Host ↔ segment copies and timing.
    pub fn data(&self) -> &dyn DataMover {
        self.data.as_ref()
    }

    /// The collectives on regions.
    pub fn collectives(&self) -> &dyn Collectives {
        self.collectives.as_ref()
    }

    /// The value the backend was made from (for example the `NcclBackend`, for its
    /// device context and raw communicators).
    pub fn downcast_ref<T: Any>(&self) -> Option<&T> {
        self.origin.downcast_ref::<T>()
    }

    /// Fail unless `stream` is of this backend's kind.
    ///
    /// # Errors
    /// [`Error::WrongStream`].
    pub fn check_stream(&self, stream: &Stream) -> Result<()> {
        if stream.is_host() != (self.info.kind == BackendKind::Host) {
            return Err(Error::WrongStream);
        }
        Ok(())
    }
}
