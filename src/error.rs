//! The crate's error type.

use crate::core::AllocError;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod divergence;
mod kind;
pub use divergence::{CollectiveDivergence, Divergence};
pub use kind::ErrorKind;

/// Result with the crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the pool, its backends and its collectives.
///
/// Every error leaves the pool consistent: a failed call changes nothing unless its
/// documentation says otherwise. The request errors ([`ZeroSize`](Self::ZeroSize),
/// [`TooLarge`](Self::TooLarge), [`BadAlignment`](Self::BadAlignment)) print exactly as
/// the core's [`AllocError`]s of the same names, which convert to them.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A zero-byte allocation. Zero-size requests are always refused; they never take
    /// memory, never grow the pool and never run a collective.
    #[error("{}", AllocError::ZeroSize)]
    ZeroSize,
    /// A request above the pool's limit (or one whose rounding overflows `u64`).
    #[error("{}", AllocError::TooLarge { requested_bytes: *requested_bytes, max_bytes: *max_bytes })]
    TooLarge {
        /// The size asked for.
        requested_bytes: u64,
        /// The limit.
        max_bytes: u64,
    },
    /// An alignment that is not a power of two, or larger than the segment granularity.
    #[error("{}", AllocError::BadAlignment { align_bytes: *align_bytes, max_align_bytes: *max_align_bytes })]
    BadAlignment {
        /// The alignment asked for.
        align_bytes: u64,
        /// The largest alignment supported.
        max_align_bytes: u64,
    },
    /// Growth would take the pool past its own reserved-memory limit
    /// ([`CoreConfig::max_reserved_bytes`](crate::core::CoreConfig::max_reserved_bytes), or
    /// a host backend's per-rank limit). Nothing was allocated.
    #[error(
        "pool limit: a segment of {segment_bytes} bytes would take reserved memory to {would_reserve_bytes} bytes, above the limit of {max_reserved_bytes} bytes (free buffers, trim(), or raise the limit)"
    )]
    PoolLimit {
        /// Size of the segment that was needed.
        segment_bytes: u64,
        /// Reserved bytes had it been allocated.
        would_reserve_bytes: u64,
        /// The limit.
        max_reserved_bytes: u64,
    },
    /// The device (or the host, on the host backend) could not allocate a segment.
    /// Nothing was allocated on any rank.
    #[error(
        "device out of memory: {op} could not allocate a segment of {segment_bytes} bytes (code {code}: {message})"
    )]
    DeviceOutOfMemory {
        /// Size of the segment that was needed.
        segment_bytes: u64,
        /// The call that failed (`ncclMemAlloc`, a host allocation).
        op: &'static str,
        /// The CUDA/NCCL result code (0 on the host backend).
        code: i32,
        /// What the library said.
        message: String,
    },
    /// Other ranks could not allocate their copy of a segment; this rank released its own.
    #[error(
        "ranks {ranks:?} could not allocate a segment of {segment_bytes} bytes; no rank grew (see their errors)"
    )]
    PeerOutOfMemory {
        /// Size of the segment that was needed.
        segment_bytes: u64,
        /// The ranks that failed.
        ranks: Vec<usize>,
    },
    /// The buffer was made by another pool (or another rank's pool).
    #[error("buffer (allocation #{allocation_seq}) is of another pool than the call's")]
    ForeignBuffer {
        /// The buffer's allocation number in its own pool.
        allocation_seq: u64,
    },
    /// A block was freed twice, or a handle outlived its block (a stale handle).
    #[error("allocation #{allocation_seq} was already freed (a double free or a stale handle)")]
    DoubleFree {
        /// The allocation number of the block.
        allocation_seq: u64,
    },
    /// A host stream given to a GPU pool, a CUDA stream to a host pool, or a CUDA
    /// view asked of a host pool's buffer.
    #[error(
        "stream or view of another backend than the pool's (host vs CUDA; a host buffer has no CUDA view)"
    )]
    WrongStream,
    /// The pool was closed with [`SymmPool::close`](crate::SymmPool::close).
    #[error("the pool is closed")]
    PoolClosed,
    /// [`SymmPool::close`](crate::SymmPool::close) found live buffers on some rank;
    /// nothing was released.
    #[error("cannot close: live buffers per rank {live_per_rank:?}{}; drop them on every rank, then close again",
        joined(.buffers, "", |(rank, buffer)| format!("; rank {rank}: {buffer}")))]
    BuffersAlive {
        /// Live buffers on each rank, in rank order.
        live_per_rank: Vec<u64>,
        /// The live buffers (rank, requested bytes, segment and offset), at most 16 a
        /// rank, in rank order.
        buffers: Vec<(usize, String)>,
    },
    /// Ranks' pool call sequences differ, found by an agreement: reported on every rank
    /// that takes part. Every later allocation (cache hits included: a hit could place
    /// the buffer at an offset the peers do not share) and agreement fails with it on
    /// every rank. Drop the pool (its memory is released locally) and build a new one.
    #[error("{0}")]
    Divergence(Box<Divergence>),
    /// A wait on other ranks ran out of time (and, over a store, no loss explains it:
    /// a rank the store declares lost by the heartbeat timeout and interval past the
    /// wait's start is reported as [`Error::PeerLost`] instead).
    #[error("timed out after {waited:?} in {op}{}", missing(.missing_ranks))]
    Timeout {
        /// What was being waited for.
        op: &'static str,
        /// How long.
        waited: Duration,
        /// The ranks that did not arrive in time.
        missing_ranks: Vec<usize>,
    },
    /// An earlier wait timed out on `rank`, so the ranks are out of step: every later
    /// collective pool operation or collective on the same group fails with this. Where
    /// the store declares a rank lost that explains the timeout (a frozen rank), the
    /// calls report that loss instead ([`Error::PeerLost`]): a call that meets the
    /// broken group waits for the verdict up to the heartbeat timeout and interval. So
    /// this error means that nobody was lost (kind [`Timeout`](ErrorKind::Timeout):
    /// restart; a shrink cannot help).
    #[error(
        "rank {rank} timed out in {op} earlier; the ranks are out of step (drop the pool and start again)"
    )]
    GroupBroken {
        /// The rank whose wait timed out first.
        rank: usize,
        /// What it was waiting in.
        op: &'static str,
    },
    /// Ranks disagree about a collective's arguments (sizes, offsets, operation).
    #[error("collective {op} arguments differ across ranks: {detail}")]
    CollectiveMismatch {
        /// The collective.
        op: &'static str,
        /// What differs.
        detail: String,
    },
    /// A collective's buffers are inconsistent (sizes, element type, placement).
    #[error("invalid collective arguments for {op}: {detail}")]
    InvalidCollective {
        /// The collective.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A collective without an identity (nothing ran): every collective carries a tag,
    /// [`Coll::tagged`](crate::coll::Coll::tagged), unless its pool was made for
    /// untagged collectives
    /// ([`PoolConfig::with_untagged_collectives`](crate::PoolConfig::with_untagged_collectives)).
    #[error(
        "collective {op} on pool {pool:?} has no identity: tag it (any u64, e.g. a hash of layer and step), coll.tagged(tag).{op}(...) in Rust, tag= in Python, so a rank skipping a call fails there instead of moving another call's data; or make the pool on every rank for untagged collectives, checked by shape only (PoolConfig::with_untagged_collectives(true); Python: untagged_collectives=True)"
    )]
    Untagged {
        /// The collective.
        op: &'static str,
        /// The pool's name.
        pool: String,
    },
    /// A typed view whose element size does not divide the buffer or whose range is
    /// out of bounds.
    #[error("bad view: {0}")]
    BadView(String),
    /// Growth or a reservation (a registration) while a stream of the pool captures a
    /// CUDA graph: pre-grow before capture with [`SymmPool::reserve`](crate::SymmPool::reserve)
    /// and [`SymmPool::reserve_small`](crate::SymmPool::reserve_small).
    #[error(
        "cannot register memory while a stream captures a CUDA graph; before capture, \
         call reserve(bytes) for large requests and reserve_small(bytes) for small ones (<= 1 MiB by default)"
    )]
    GraphCapture,
    /// [`alloc`](crate::alloc) was called outside any [`SymmPool::scope`](crate::SymmPool::scope).
    #[error("no symmetric pool is active on this thread (call inside SymmPool::scope)")]
    NoActivePool,
    /// A shared library (CUDA driver, NCCL, cuBLAS) could not be loaded.
    #[error("library {library} not available: {hint}")]
    LibraryUnavailable {
        /// The library.
        library: &'static str,
        /// What to do about it.
        hint: &'static str,
    },
    /// The NCCL found at run time is too old for a feature.
    #[error("NCCL {found} is too old for {feature}: needs {required} or newer")]
    NcclTooOld {
        /// Version found.
        found: NcclVersion,
        /// Version needed.
        required: NcclVersion,
        /// What needs it.
        feature: &'static str,
    },
    /// The communicator cannot register symmetric windows (NCCL returned a NULL
    /// window, or the host world was made without symmetric support) and the pool
    /// requires them.
    #[error("communicator {comm} has no symmetric-memory support")]
    NoSymmetricSupport {
        /// Index of the communicator in the backend's list.
        comm: usize,
    },
    /// A segment's window registration failed on `rank`. Every rank undoes that growth
    /// and from then on refuses growth, `reserve` and `trim` with this error (the
    /// ranks' windows may be out of step); cache hits and `close` still work.
    #[error(
        "a window registration failed earlier on rank {rank}; the pool cannot grow any more: {reason}"
    )]
    RegistrationBroken {
        /// The rank whose registration failed.
        rank: usize,
        /// The original failure (as that rank saw it, or a summary on other ranks).
        reason: String,
    },
    /// Ranks were about to register windows of different pools or sizes at the same
    /// position on their communicators; nothing was registered, on any rank.
    #[error(
        "ranks disagree on the next window registration (a group's pools grow in one order on every rank; pools of different threads need groups of their own: Group::split): {}",
        joined(.order, "; ", |(rank, pool, bytes)| format!("rank {rank}: {pool} segment of {bytes} bytes"))
    )]
    RegistrationOrder {
        /// Per rank, in rank order: (rank, pool name, segment bytes).
        order: Vec<(usize, String, u64)>,
    },
    /// A collective pool operation failed while other pools on the same communicators
    /// were used from other threads of this rank, which reach the communicators in
    /// different orders on different ranks. Give each thread's pool communicators of
    /// its own, in a group of its own ([`Group::split`](crate::Group::split)).
    #[error(
        "{error} (pools {pools:?} share communicators but were used from different threads: give each thread's pool its own group with Group::split)"
    )]
    SharedCommunicators {
        /// The pools on the shared communicators: this one first, then those last
        /// used from other threads.
        pools: Vec<String>,
        /// The failure itself.
        #[source]
        error: Box<Error>,
    },
    /// A shared-memory operation of the multi-process host backend failed (creating,
    /// sizing or mapping a segment, or mapping a peer's).
    #[error("shared memory: {op} failed ({detail}): {source}")]
    SharedMemory {
        /// What was being done.
        op: &'static str,
        /// Which segment or peer.
        detail: String,
        /// The operating system's error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// Ranks registered segments of different sizes at the same position.
    #[error("ranks registered different segment sizes at registration #{ordinal}: {sizes:?}")]
    RegistrationMismatch {
        /// Position of the registration on the communicator.
        ordinal: u64,
        /// Size in bytes per rank.
        sizes: Vec<u64>,
    },
    /// An NCCL call failed.
    #[error("{op} failed: NCCL error {code} ({message})")]
    Nccl {
        /// The NCCL function.
        op: &'static str,
        /// The `ncclResult_t` value.
        code: i32,
        /// `ncclGetErrorString` for it, or the last error message.
        message: String,
    },
    /// A CUDA driver call failed.
    #[error("{op} failed: CUDA error {code} ({message})")]
    Cuda {
        /// The CUDA function.
        op: &'static str,
        /// The `CUresult` value.
        code: i32,
        /// Its name and description.
        message: String,
    },
    /// One of the crate's own invariants does not hold: a bug in symmpool. The pool is
    /// marked broken; drop it. Please report the message.
    #[error("internal error (a bug in symmpool): {what}")]
    Internal {
        /// What was found.
        what: String,
    },
    /// The pool is unusable: a thread panicked while it held the pool's state, an
    /// internal invariant broke, or a peer reported its pool broken. Every later call
    /// on the broken rank fails with this; its peers learn it (and break) at the next
    /// agreement it takes part in (until then their cache hits succeed, and a growth it
    /// does not join times out). `close` still releases the memory on every rank.
    #[error("the pool is broken ({reason}); drop it and build a new one")]
    PoolBroken {
        /// Why, as this rank knows it.
        reason: String,
    },
    /// An operation that runs inside `Drop` (returning a buffer, releasing a segment)
    /// failed earlier; it is reported by the next fallible call on the same pool, which
    /// did nothing else.
    #[error("an earlier {during} failed: {source}")]
    Deferred {
        /// What was being done.
        during: String,
        /// The failure.
        #[source]
        source: Box<Error>,
    },
    /// A setting (a configuration field or a constructor's argument) has a value it
    /// cannot have.
    #[error("invalid configuration: {setting}: {value} (expected {expected})")]
    Config {
        /// The setting, by its name in the API (`rank`, `NcclConfig::device`, …).
        setting: &'static str,
        /// The value given, with what it was checked against.
        value: String,
        /// What the setting may be.
        expected: &'static str,
    },
    /// Settings that are inconsistent with each other, in words (the store's
    /// configuration).
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// An error of the allocator core that has no more specific variant above.
    #[error(transparent)]
    Core(AllocError),
    // control plane
    /// A peer rank of a control-plane exchange disconnected, died or stopped sending
    /// heartbeats (for rank 0, the rank hosting the store server, the connection to the
    /// server broke). Delivered to every surviving rank within the bound stated in
    /// [`control`](crate::control); the group is broken for good afterwards: restart the
    /// job, or go on without the lost rank with
    /// [`SymmPool::shrink`](crate::SymmPool::shrink) on every survivor (not when the
    /// lost rank hosted the store, rank 0 of a [`StoreExchange`](crate::StoreExchange):
    /// that shrink is [`Error::ShrinkFailed`]).
    #[error(
        "rank {rank} was lost while this rank was in {op}: {detail}; the group is broken for good \
         (see rank {rank}'s log, the OOM killer or its host; restart the job, or go on \
         without it unless it hosted the store: SymmPool::shrink on every survivor)"
    )]
    PeerLost {
        /// The rank that was lost.
        rank: usize,
        /// The operation this rank was in (or the first one to notice).
        op: &'static str,
        /// How the loss was noticed.
        detail: String,
    },
    /// The store declared this rank lost: it sent nothing for longer than the heartbeat
    /// timeout (frozen, e.g. `SIGSTOP`, or cut off from rank 0's host), so the store
    /// closed its connection and the other ranks went on without it (they may have
    /// shrunk the group). This process cannot rejoin: end it (restart the job, or let
    /// an elastic launcher start the rank anew). Every later call on the group fails
    /// with this, as does [`SymmPool::shrink`](crate::SymmPool::shrink).
    #[error(
        "this rank ({rank}) was declared lost by the store: {detail}; the others no longer wait for it (they may go on without it) and it cannot rejoin: end this process (restart the job, or let the launcher restart this rank)"
    )]
    DeclaredLost {
        /// This rank, in its group.
        rank: usize,
        /// The store's reason.
        detail: String,
    },
    /// The call was made on something (a pool, its collectives, an exchange) that
    /// [`SymmPool::shrink`](crate::SymmPool::shrink) or
    /// [`SymmPool::grow`](crate::SymmPool::grow) replaced. Nothing was done.
    #[error(
        "{what} belongs to the world before a shrink or a grow; use the pool SymmPool::shrink or SymmPool::grow returned, and buffers allocated from it anew (an old buffer's layout is the old world size's; its data stays readable)"
    )]
    Shrunk {
        /// What the call was made on.
        what: &'static str,
    },
    /// The surviving ranks could not shrink the group after a loss (the store's host,
    /// rank 0, is gone; another rank was lost while the survivors agreed; the store
    /// went on without this rank; the backend or its exchange cannot shrink): every
    /// survivor in [`SymmPool::shrink`](crate::SymmPool::shrink) gets it, its pool left
    /// as it was (broken). `retry`: a second rank was lost while the survivors agreed,
    /// call `shrink` again (kind [`PeerLost`](crate::ErrorKind::PeerLost)); otherwise
    /// restart (kind [`GroupLost`](crate::ErrorKind::GroupLost): shrinking again
    /// cannot help). A survivor that does not ask in time is [`Error::Timeout`]
    /// instead.
    #[error("the surviving ranks could not shrink the group: {reason}")]
    ShrinkFailed {
        /// Why, naming the ranks involved.
        reason: String,
        /// Whether `shrink` again can succeed (only after a second loss while agreeing).
        retry: bool,
    },
    /// A control-plane socket operation failed (resolving, connecting, reading or
    /// writing) other than by a peer going away.
    #[error(
        "control-plane transport failed in {op} ({detail}); check MASTER_ADDR/MASTER_PORT and the network"
    )]
    Transport {
        /// What was being done.
        op: &'static str,
        /// Where (address, rank).
        detail: String,
        /// The underlying error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The other end of a control-plane connection broke the protocol: a wrong magic
    /// number or protocol version, a frame that is too large or does not decode.
    #[error(
        "control-plane protocol error in {op}: {detail} (is the address a symmpool store of the same version?)"
    )]
    Protocol {
        /// What was being done.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The store server refused this rank's handshake (wrong job token, rank out of
    /// range, world size differs, rank already connected, group already broken).
    #[error("the store refused this rank: {reason}")]
    StoreRejected {
        /// The server's reason.
        reason: String,
    },
    /// The store on this port serves another job (its
    /// [`StoreConfig::job_id`](crate::control::StoreConfig::job_id) differs); it goes on.
    #[error(
        "the store serves another job: this rank's job is {job:?}, the store's is {store_job:?} (two jobs on one port: give each its own MASTER_PORT or SYMMPOOL_STORE_PORT)"
    )]
    JobMismatch {
        /// This rank's job identity (empty: none known).
        job: String,
        /// The store's job identity (empty: none known).
        store_job: String,
    },
    /// Another process already holds this rank in the store's group.
    #[error(
        "rank {rank} is already held by {holder}; this process is {claimant} (check RANK: two processes claim one rank, or a rank of another job took it)"
    )]
    RankTaken {
        /// The rank claimed twice.
        rank: usize,
        /// The process holding it: pid, host, address and when it joined.
        holder: String,
        /// This process, as the store saw it.
        claimant: String,
    },
    /// Ranks opened different channels (a different ordinal or name) in the same
    /// round; reported on every rank.
    #[error(
        "ranks opened different channels: {} (every rank makes its groups and pools in one order, with the same names and settings: group:ledger:MODE has the group's check mode, pool:NAME has :untagged_collectives where PoolConfig::untagged_collectives is set; ranks that are threads of one process use Group::world and SymmPool::world; a rank never makes them from two threads at once)",
        joined(.opened, ", ", |(rank, ordinal, name)| format!("rank {rank} opened #{ordinal} {name:?}"))
    )]
    ChannelMismatch {
        /// For each rank, in rank order: (rank, channel ordinal, channel name).
        opened: Vec<(usize, u64, String)>,
    },
    /// A payload larger than the exchange accepts; nothing was sent.
    #[error(
        "control-plane payload of {payload_bytes} bytes exceeds the limit of {max_bytes} bytes"
    )]
    PayloadTooLarge {
        /// Size of the payload.
        payload_bytes: usize,
        /// The largest payload accepted.
        max_bytes: usize,
    },
    /// The launcher environment (torchrun, slurm, Open MPI variables) is missing or
    /// invalid.
    #[error("launcher environment: {variable}: {detail}")]
    LaunchEnv {
        /// The variable at fault.
        variable: String,
        /// What is wrong and what to do.
        detail: String,
    },
    // NCCL processes
    /// An NCCL call that waits on other ranks (communicator creation or split, window
    /// registration or deregistration, a collective's enqueue) did not finish within its
    /// deadline ([`NcclConfig`](crate::backend::nccl::NcclConfig)). Later calls fail
    /// with [`Error::NcclAborted`].
    #[error(
        "{op} did not finish within {waited:?} (a peer rank is missing, frozen or diverged); \
         this rank aborted its NCCL communicators: drop the pools and the backend and restart"
    )]
    NcclTimeout {
        /// The NCCL call.
        op: &'static str,
        /// How long it was waited for.
        waited: Duration,
    },
    /// A collective enqueued on this backend had not completed on the device within
    /// the watchdog timeout; aborting the communicators ended the stuck kernels. Every
    /// later call on the backend fails with this.
    #[error(
        "watchdog: a {op} on communicator {comm} had not completed {waited:?} after it was \
         enqueued; the NCCL communicators were aborted: drop the pools and the backend and restart"
    )]
    NcclWatchdog {
        /// The collective.
        op: &'static str,
        /// Index of its communicator in the backend's list.
        comm: usize,
        /// How long it had been enqueued when the watchdog fired.
        waited: Duration,
    },
    /// The NCCL backend broke earlier (a deadline, an asynchronous NCCL error, a failed
    /// device) and its communicators were aborted; every later call fails with this.
    #[error("the NCCL backend is unusable: {reason}; drop the pools and the backend and restart")]
    NcclAborted {
        /// What broke it.
        reason: String,
    },
    // checked collectives
    /// The ranks' records of a collective (or of a step boundary) differ (see
    /// [`coll`](crate::coll), "Checked collectives"), on every rank. Under
    /// [`CheckMode::Async`](crate::CheckMode::Async) the diverging collectives may have
    /// run. From then on every collective and allocation fails with this, every
    /// collective pool operation (and `close`, which still releases the memory) with
    /// [`Error::PoolBroken`].
    #[error("{0}")]
    CollectiveDivergence(Box<CollectiveDivergence>),
}

/// The ranks a [`Error::Timeout`] waited for, in words (nothing if none is known).
fn missing(ranks: &[usize]) -> String {
    match ranks {
        [] => String::new(),
        _ => format!(": ranks {ranks:?} did not arrive"),
    }
}

/// `items`, each as `f` writes it, separated by `sep` (for the error messages that
/// list every rank's value, and the path policy's line).
pub(crate) fn joined<T>(items: &[T], sep: &str, f: impl Fn(&T) -> String) -> String {
    items.iter().map(f).collect::<Vec<_>>().join(sep)
}

impl Error {
    /// [`Error::Config`]: `setting` has `value`, where `expected` says what it may be.
    pub(crate) fn config(
        setting: &'static str,
        value: impl Into<String>,
        expected: &'static str,
    ) -> Error {
        Error::Config {
            setting,
            value: value.into(),
            expected,
        }
    }

    /// [`Error::Internal`]: `what` was found (a bug in symmpool).
    #[cold]
    pub(crate) fn internal(what: impl Into<String>) -> Error {
        Error::Internal { what: what.into() }
    }

    /// This error (or the one it defers) if it is a failure of the group, kept by the
    /// ledger to report again as it was: a loss (of kind [`ErrorKind::PeerLost`] or
    /// [`ErrorKind::GroupLost`]: [`Error::PeerLost`], [`Error::GroupBroken`],
    /// [`Error::DeclaredLost`], [`Error::NcclAborted`]), or [`Error::Shrunk`] (another
    /// thread's shrink).
    pub(crate) fn group_failure(&self) -> Option<&Error> {
        match self {
            Error::PeerLost { .. }
            | Error::GroupBroken { .. }
            | Error::DeclaredLost { .. }
            | Error::NcclAborted { .. }
            | Error::Shrunk { .. } => Some(self),
            Error::Deferred { source, .. } => source.group_failure(),
            _ => None,
        }
    }

    /// The error as a reason ([`Error::PoolBroken`]'s): that error's own reason, else
    /// the message.
    pub(crate) fn reason(&self) -> String {
        match self {
            Error::PoolBroken { reason } => reason.clone(),
            e => e.to_string(),
        }
    }

    /// [`Error::ShrinkFailed`] for `reason`; `retry`: after a second loss while agreeing.
    pub(crate) fn shrink_failed(reason: String, retry: bool) -> Error {
        Error::ShrinkFailed { reason, retry }
    }

    /// [`Error::Timeout`] of a wait in `op` that began at `started`, naming `missing`.
    #[cold]
    pub(crate) fn timeout_since(op: &'static str, started: Instant, missing: &[u32]) -> Error {
        Error::Timeout {
            op,
            waited: started.elapsed(),
            missing_ranks: missing.iter().map(|&r| r as usize).collect(),
        }
    }
}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::ZeroSize => Error::ZeroSize,
            AllocError::TooLarge {
                requested_bytes,
                max_bytes,
            } => Error::TooLarge {
                requested_bytes,
                max_bytes,
            },
            AllocError::BadAlignment {
                align_bytes,
                max_align_bytes,
            } => Error::BadAlignment {
                align_bytes,
                max_align_bytes,
            },
            AllocError::OutOfMemory {
                segment_bytes,
                would_reserve_bytes,
                max_reserved_bytes,
            } => Error::PoolLimit {
                segment_bytes,
                would_reserve_bytes,
                max_reserved_bytes,
            },
            AllocError::StaleBlock(b) => Error::DoubleFree {
                allocation_seq: b.seq,
            },
            // An expected outcome of the core that the pool handles itself: reaching
            // the caller is a bug.
            AllocError::NeedsGrowth(g) => Error::internal(format!(
                "the core asked for growth ({g:?}) where the pool cannot grow"
            )),
            other => Error::Core(other),
        }
    }
}

/// An NCCL version, as `ncclGetVersion` reports it (`major * 10000 + minor * 100 +
/// patch` for 2.9 and later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct NcclVersion {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        NcclVersion {
            major,
            minor,
            patch,
        }
    }

    /// Decode `ncclGetVersion`'s integer (`NCCL_VERSION_CODE`).
    pub fn from_code(code: i32) -> Self {
        let code = code.max(0) as u32;
        // Before 2.9: `major * 1000 + minor * 100 + patch`.
        let major = if code >= 10000 { 10000 } else { 1000 };
        NcclVersion::new(code / major, code % major / 100, code % 100)
    }

    /// Windows (`ncclCommWindowRegister`, symmetric kernels): NCCL 2.27.
    pub const WINDOWS: NcclVersion = NcclVersion::new(2, 27, 0);
    /// Copy-engine all-gather (`CTAPolicy = NCCL_CTA_POLICY_ZERO`): NCCL 2.28.
    pub const COPY_ENGINE: NcclVersion = NcclVersion::new(2, 28, 0);
    /// Copy-engine all-gather with only the output registered: NCCL 2.29.
    pub const CE_RECV_ONLY: NcclVersion = NcclVersion::new(2, 29, 0);
    /// `ncclAvg` in symmetric reduce-scatter kernels: NCCL 2.30.
    pub const SYMMETRIC_AVG: NcclVersion = NcclVersion::new(2, 30, 0);
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// Run `f` on every item in a thread of its own (one per rank of this process, since
/// each call blocks in a collective round) and return the results in order; a thread
/// that panicked is [`Error::Internal`] naming `what`.
///
/// # Errors
/// The first item's error, in order.
pub(crate) fn in_threads<T: Send, R: Send>(
    items: impl IntoIterator<Item = T>,
    what: &str,
    f: impl Fn(T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = items.into_iter().map(|t| s.spawn(move || f(t))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::internal(format!("{what} panicked"))))
            })
            .collect()
    })
}
