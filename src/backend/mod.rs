//! Where segments come from, how they are registered, and how device work is ordered:
//! the provider seam, and its implementations [`HostBackend`] (ranks as threads, host
//! memory, always available), `ShmBackend` (ranks as processes, shared memory, Linux)
//! and `NcclBackend` (`ncclMemAlloc` + `ncclCommWindowRegister`, feature `nccl`).
//!
//! A [`Backend`] is one rank's view, assembled from four small parts, one per job:
//!
//! | part | trait | job |
//! |---|---|---|
//! | segments | [`SegmentProvider`] | allocate a segment → an owned [`Segment`]; register it on a communicator → an owned [`Window`] (or "no symmetric support"); consuming deregister and free |
//! | streams | [`StreamOps`] | streams, fences (events), device-side waits, capture status, draining with a deadline |
//! | data | [`DataMover`] | host ↔ segment copies, timing of device work |
//! | collectives | [`Collectives`] | all-gather, reduce-scatter and all-reduce on regions (dispatched by [`coll`](crate::coll)) |
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

mod handles;
pub mod host;
mod info;
#[cfg(feature = "nccl")]
pub mod nccl;
mod parts;
#[cfg(target_os = "linux")]
pub mod shm;

pub use handles::{Refused, Region, Segment, SegmentMemory, Window};
pub use host::{HostBackend, HostConfig};
pub use info::{BackendInfo, BackendKind, CommInfo, CommRole};
#[cfg(feature = "nccl")]
pub use nccl::{NcclBackend, NcclConfig};
pub use parts::{DataMover, SegmentProvider, StreamOps};
#[cfg(target_os = "linux")]
pub use shm::{ShmBackend, ShmConfig};

use crate::control::Exchange;
pub use crate::deadline::CallDeadline;
use crate::deadline::Deadline;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// Arguments of one collective call on one rank.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CollArgs<'a> {
    /// Index of the communicator in [`BackendInfo::communicators`].
    pub comm: usize,
    /// The input: this rank's chunk (all-gather), the whole input (reduce-scatter),
    /// or `count` elements (all-reduce).
    pub send: Region<'a>,
    /// The output: the whole output (all-gather), this rank's chunk (reduce-scatter),
    /// or `count` elements (all-reduce; the same region as `send` in place).
    pub recv: Region<'a>,
    /// Elements per rank: the all-gather input count, the reduce-scatter output count,
    /// the all-reduce count.
    pub count: u64,
    /// Element type.
    pub dtype: DType,
    /// Reduction (reduce-scatter and all-reduce).
    pub op: ReduceOp,
    /// Stream to enqueue on.
    pub stream: &'a Stream,
    /// The windows of the send and receive segments on `comm`, when the call expects
    /// the symmetric path (both `None` on the plain path).
    pub windows: (Option<&'a Window>, Option<&'a Window>),
    /// Who calls: the calling pool's identity (its agreement channel's ordinal, the same
    /// on every rank for the same pool; 0 when unknown). Backends that exchange their
    /// ranks' calls (the host backends) compare it, so that two pools whose threads
    /// share the communicators cannot pair each other's collectives unnoticed.
    pub caller: u64,
    /// When the call must end: the calling pool's deadline (from
    /// [`GroupConfig::timeout`](crate::GroupConfig::timeout), shared with its checks). The
    /// host backends' whole call, their waits for peers included, ends by it.
    deadline: CallDeadline,
}

impl<'a> CollArgs<'a> {
    /// Arguments for communicator `comm`, to end by `deadline` (a [`Deadline`], or a
    /// [`CallDeadline`] made at the first wait).
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
        deadline: impl Into<CallDeadline>,
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
            caller: 0,
            deadline: deadline.into(),
        }
    }

    /// When the call must end (fixed by the first call of this method if the
    /// arguments were made with a [`CallDeadline::from_first_wait`]).
    pub fn deadline(&self) -> Deadline {
        self.deadline.get()
    }

    /// The same arguments, made by pool `caller` (see [`caller`](Self::caller)).
    pub fn with_caller(self, caller: u64) -> Self {
        CollArgs { caller, ..self }
    }

    /// The regions must hold what the collective will touch: `count` elements on one
    /// side and `world × count` on the other (the input for a reduce-scatter, the
    /// output for an all-gather; `world` 1 for an all-reduce, `count` on both sides).
    /// Returns the chunk size in bytes.
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
    /// All-gather `count` elements per rank from `send` into `recv`, by
    /// [`CollArgs::deadline`] where the backend waits for its peers on the host.
    ///
    /// # Errors
    /// [`Error::InvalidCollective`]; [`Error::Nccl`]; on the host backends also
    /// [`Error::CollectiveMismatch`], [`Error::Timeout`] (at the deadline) and
    /// [`Error::GroupBroken`].
    fn all_gather(&self, args: &CollArgs<'_>) -> Result<()>;
    /// Reduce-scatter: `recv` gets `count` elements, the reduction over ranks of this
    /// rank's chunk of `send`.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather).
    fn reduce_scatter(&self, args: &CollArgs<'_>) -> Result<()>;
    /// All-reduce: `recv` gets `count` elements, the reduction over ranks of every
    /// rank's `send` (`send` and `recv` may be the same region). The default refuses
    /// it: a backend without all-reduce.
    ///
    /// # Errors
    /// As [`all_gather`](Self::all_gather); the default [`Error::InvalidCollective`].
    fn all_reduce(&self, args: &CollArgs<'_>) -> Result<()> {
        let _ = args;
        Err(Error::InvalidCollective {
            op: "all_reduce",
            detail: "this backend has no all-reduce".into(),
        })
    }

    /// The ranks were found out of step (a collective check failed, `why`): end this
    /// rank's collectives that wait for their peers now, and refuse later ones, where
    /// the backend can. The host backend breaks its communicators, as a timeout in
    /// them does ([`Error::GroupBroken`] on every rank's waiting and later calls);
    /// the default does nothing (NCCL's calls do not wait on the host; its watchdog
    /// bounds them).
    fn abandon(&self, why: &'static str) {
        let _ = why;
    }
}

/// [`Error::CollectiveMismatch`] for `who` ("a peer", "rank 3") found at another step
/// of its calls on a communicator, with the remedy when two threads share the
/// communicators.
pub(crate) fn out_of_step(op: &'static str, who: impl std::fmt::Display) -> Error {
    let detail = format!(
        "{who} is at another step of its calls on this communicator (pools that share communicators must make their collectives in the same order on every rank; pools used from different threads need groups of their own: Group::split)"
    );
    Error::CollectiveMismatch { op, detail }
}

/// The ranks' calls of one collective round came from different pools (`callers`,
/// in rank order, see [`CollArgs::caller`]): one rank's pool paired another pool's
/// call. [`Error::SharedCommunicators`], which says what to do; not a peer's failure
/// (the checks are not waited for: each pool's check round waits for the other).
pub(crate) fn callers_differ(op: &'static str, callers: &[u64]) -> Result<()> {
    if callers.windows(2).all(|w| w[0] == w[1]) {
        return Ok(());
    }
    let mut pools: Vec<String> = callers.iter().map(|c| format!("pool #{c}")).collect();
    pools.dedup();
    let who: Vec<String> = (callers.iter().enumerate())
        .map(|(rank, c)| format!("rank {rank}: pool #{c}"))
        .collect();
    let who = who.join(", ");
    let detail =
        format!("the ranks' calls paired on this communicator come from different pools ({who})");
    let error = Box::new(Error::CollectiveMismatch { op, detail });
    Err(Error::SharedCommunicators { pools, error })
}

/// What a backend that cannot split or grow should be instead.
const MADE_HERE: &str = "a backend made by HostBackend, ShmBackend or NcclBackend";

/// How the crate's backends make communicators of their own beside a backend's
/// ([`Backend::split`], [`Backend::shrink`], [`Backend::grow`]).
pub(crate) trait Regroup {
    /// [`Backend::split`] of `backend`, made of this value.
    fn split(&self, backend: &Backend, name: &str) -> Result<Backend>;
    /// The backend of this rank over `exchange`, `backend`'s exchange shrunk, or grown
    /// (`grown`: `Some(wait)`, as [`Backend::grow`] waited): its new communicators.
    fn regroup(
        &self,
        backend: &Backend,
        exchange: Arc<dyn Exchange>,
        deadline: Deadline,
        grown: Option<bool>,
    ) -> Result<Backend>;
}

#[cfg(feature = "nccl")]
impl Regroup for NcclBackend {
    fn split(&self, backend: &Backend, name: &str) -> Result<Backend> {
        NcclBackend::split(self, backend, name)
    }

    fn regroup(
        &self,
        _: &Backend,
        exchange: Arc<dyn Exchange>,
        deadline: Deadline,
        grown: Option<bool>,
    ) -> Result<Backend> {
        NcclBackend::regroup(self, exchange, deadline, grown.is_some())
    }
}

/// How long making a backend waits for the other ranks (ranks of real jobs start
/// minutes apart): 10 minutes. A lost peer ends the wait sooner (see
/// [`control`](crate::control)).
pub const SETUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A hold on a flag that clones share (a backend's group, a group's collectives
/// handle); released on drop.
pub(crate) struct Claim(Arc<AtomicBool>);

impl Claim {
    /// The hold on `flag`: `None` while another holds it.
    pub(crate) fn take(flag: &Arc<AtomicBool>) -> Option<Claim> {
        (flag
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok())
        .map(|_| Claim(flag.clone()))
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// One rank's backend: its identity, its exchange, and the four parts. Cheap to
/// clone (shared parts).
#[derive(Clone)]
pub struct Backend {
    info: Arc<BackendInfo>,
    exchange: Arc<dyn Exchange>,
    segments: Arc<dyn SegmentProvider>,
    streams: Arc<dyn StreamOps>,
    data: Arc<dyn DataMover>,
    collectives: Arc<dyn Collectives>,
    origin: Arc<dyn Any + Send + Sync>,
    /// Set while a live [`Group`](crate::Group) holds these communicators (shared by
    /// clones and variants; a split or shrunk backend has its own).
    grouped: Arc<AtomicBool>,
}

impl fmt::Debug for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backend")
            .field("info", &self.info)
            .field("streams", &self.streams)
            .finish_non_exhaustive()
    }
}

/// [`Error::Config`] unless `exchange` has `info`'s rank and world size.
fn check_exchange(exchange: &dyn Exchange, info: &BackendInfo) -> Result<()> {
    let (rank, world) = (exchange.rank(), exchange.world_size());
    let (r, w) = (info.rank, info.world_size);
    if (rank, world) == (r, w) {
        return Ok(());
    }
    Err(Error::config(
        "exchange",
        format!("rank {rank} of {world}, the backend rank {r} of {w}"),
        "the backend's rank and world size",
    ))
}

/// `Backend::with_*`: the same backend with one part replaced by `f(part)`.
macro_rules! with_part {
    ($($(#[$doc:meta])* $name:ident: $field:ident, $part:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(mut self, f: impl FnOnce(Arc<dyn $part>) -> Arc<dyn $part>) -> Self {
            self.$field = f(self.$field);
            self
        }
    )*};
}

impl Backend {
    /// A backend whose four parts are one value (as `NcclBackend` is; the host
    /// backends share their stream operations, see `with_stream_ops`).
    ///
    /// Local: the ranks meet when they make a [`Group`](crate::Group) of it.
    ///
    /// # Errors
    /// [`Error::Config`] if `exchange` disagrees with `info` on rank or world size.
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
        check_exchange(&*exchange, &info)?;
        Ok(Backend {
            info: Arc::new(info),
            grouped: Arc::default(),
            exchange,
            segments: parts.clone(),
            streams,
            data: parts.clone(),
            collectives: parts.clone(),
            origin: parts,
        })
    }

    with_part! {
        /// The same backend with its segment provider replaced by `f(provider)` (a test
        /// double gets the original to delegate to).
        with_segments: segments, SegmentProvider;
        /// The same backend with its stream operations replaced by `f(streams)`.
        with_streams: streams, StreamOps;
        /// The same backend with its data mover replaced by `f(data)`.
        with_data: data, DataMover;
        /// The same backend with its collectives replaced by `f(collectives)`.
        with_collectives: collectives, Collectives;
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
        check_exchange(&*exchange, &self.info)?;
        self.exchange = exchange;
        Ok(self)
    }

    /// A backend beside this one for one pool: the same rank, identity, exchange and
    /// device, with **communicators of its own**, made collectively (a new set on the
    /// host backends, new channels on the shared-memory backend, communicators split off
    /// the control communicator on NCCL). A pool on it never shares a communicator with
    /// a pool on this backend, so the two can be used from different threads, in any
    /// interleaving on each rank: the FSDP pattern of a parameter pool on the
    /// all-gather stream's thread and a gradient pool on the reduce-scatter stream's
    /// ([`Group::split`](crate::Group::split) makes a group of it).
    ///
    /// The new backend's segments, data and collectives are the implementation's own
    /// (parts replaced with [`with_segments`](Self::with_segments) and the like are not
    /// carried over); its stream operations are this backend's on the host backends.
    ///
    /// # Collective
    /// Every rank splits at the same point with the same `name` (the ranks agree on it
    /// over the exchange, waiting up to [`SETUP_TIMEOUT`]).
    ///
    /// # Errors
    /// [`Error::Config`] for a backend that cannot split (one assembled from parts of
    /// its own, or NCCL communicators adopted without a control communicator);
    /// [`Error::ChannelMismatch`] on every rank if the ranks split with different
    /// names or at different points; the exchange's errors; on NCCL the errors of
    /// `ncclCommSplit` ([`Error::Nccl`], [`Error::NcclTimeout`]).
    pub fn split(&self, name: &str) -> Result<Backend> {
        match self.regrouper() {
            Some(r) => r.split(self, name),
            None => Err(Error::config(
                "Backend::split",
                format!("{:?}", self.info.kind),
                MADE_HERE,
            )),
        }
    }

    /// The backend of this rank in the group that survives a loss: the exchange shrunk
    /// ([`Exchange::shrink`]: the survivors, numbered densely in their old order), and
    /// new communicators among the survivors (a new set on the host backend's threads,
    /// new channels on the shared-memory backend, a new set made from the store on
    /// NCCL, this backend's aborted) of the same kinds and order. Its device, memory
    /// limit (and on the host backends its stream operations) are this backend's;
    /// segments of this backend may be registered on it, but none of its windows.
    ///
    /// # Collective
    /// Every surviving rank calls it after the loss (a [`Error::PeerLost`]), for its
    /// backends in the same order, waiting for the others until `deadline` (the
    /// [`Group`](crate::Group) of the backend shrinks it once for all its pools).
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`] for a backend that cannot shrink (one assembled from
    /// parts of its own) and as [`Exchange::shrink`] says; the exchange's errors on the
    /// new group; on NCCL those of [`NcclBackend::from_env`].
    pub fn shrink(&self, deadline: Deadline) -> Result<Backend> {
        let Some(r) = self.regrouper() else {
            let kind = self.info.kind;
            let reason =
                format!("a {kind:?} backend assembled from parts of its own cannot shrink");
            return Err(Error::shrink_failed(reason, false));
        };
        r.regroup(self, self.exchange.shrink(deadline)?, deadline, None)
    }

    /// The backend of this rank in its group grown by newcomers ([`Exchange::grow`]):
    /// new communicators among the ranks of the grown group (a new set on the host
    /// backend's threads, new channels on the shared-memory backend; on NCCL the
    /// control communicator grown by `ncclCommGrow` where NCCL has it, 2.29.2+, else a
    /// new set made from the store, this backend's aborted), as the newcomers make theirs
    /// ([`HostBackend::join`], [`ShmBackend::join`], [`NcclBackend::from_env`] over the
    /// exchange they joined with). Its device, memory limit (and on the host backends
    /// its stream operations) are this backend's; segments of this backend may be
    /// registered on it, but none of its windows. `None` when no newcomer waits (see
    /// [`Exchange::grow`] for `wait`).
    ///
    /// # Collective
    /// Every rank of the group calls it, for its backends in the same order, waiting
    /// until `deadline` (the [`Group`](crate::Group) of the backend grows it once for
    /// all its pools).
    ///
    /// # Errors
    /// [`Error::Config`] for a backend that cannot grow (one assembled from parts of
    /// its own) and as [`Exchange::grow`] says; the exchange's errors on the grown
    /// group; on NCCL those of [`NcclBackend::from_env`].
    pub fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Backend>> {
        let Some(r) = self.regrouper() else {
            let kind = format!("{:?} assembled from parts of its own", self.info.kind);
            return Err(Error::config("Backend::grow", kind, MADE_HERE));
        };
        let grown = self.exchange.grow(wait, deadline)?;
        grown
            .map(|ex| r.regroup(self, ex, deadline, Some(wait)))
            .transpose()
    }

    /// The value this backend was made of, where it can split, shrink and grow.
    fn regrouper(&self) -> Option<&dyn Regroup> {
        if let Some(host) = self.downcast_ref::<HostBackend>() {
            return Some(host);
        }
        #[cfg(target_os = "linux")]
        if let Some(shm) = self.downcast_ref::<ShmBackend>() {
            return Some(shm);
        }
        #[cfg(feature = "nccl")]
        if let Some(nccl) = self.downcast_ref::<NcclBackend>() {
            return Some(nccl);
        }
        None
    }

    /// A backend with this one's identity at the rank and world size of `exchange`
    /// (this one's for a [`split`](Self::split), the shrunk one's for a
    /// [`shrink`](Self::shrink)), its stream operations, and `parts` (communicators of
    /// their own) for the rest: what those two return on the host backends. Local,
    /// as [`new`](Self::new).
    pub(crate) fn with_parts<T>(
        &self,
        exchange: Arc<dyn Exchange>,
        parts: Arc<T>,
    ) -> Result<Backend>
    where
        T: SegmentProvider + DataMover + Collectives + 'static,
    {
        let mut info = BackendInfo::clone(&self.info);
        (info.rank, info.world_size) = (exchange.rank(), exchange.world_size());
        Self::with_stream_ops(info, exchange, parts, self.streams.clone())
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

    /// Claim these communicators for one live group: `None` while another holds them.
    pub(crate) fn claim_group(&self) -> Option<Claim> {
        Claim::take(&self.grouped)
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

    /// The collectives part, shared.
    pub(crate) fn collectives_handle(&self) -> Arc<dyn Collectives> {
        self.collectives.clone()
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
