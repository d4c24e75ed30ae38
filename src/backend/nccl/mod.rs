//! The NCCL backend: segments from `ncclMemAlloc`, one `ncclCommWindowRegister(..,
//! NCCL_WIN_COLL_SYMMETRIC)` per (segment, communicator), collectives through NCCL.
//!
//! Each rank has one **control** communicator and up to three **data** communicators
//! over the same ranks (see [`CommRole`](super::CommRole)): a default-policy one whose
//! windows run NCCL's symmetric kernels, a `CTAPolicy = NCCL_CTA_POLICY_ZERO` one (NCCL
//! ≥ 2.28) whose windows run the copy-engine all-gather, and a default-policy one where
//! nothing is registered, for the collectives that run faster on NCCL's ring. NCCL is
//! loaded at run time (an NCCL the process already has first, see `ffi`); a missing
//! library or one older than 2.27 is an error, never a panic.
//!
//! # Making a backend
//!
//! | how | ranks | communicators |
//! |---|---|---|
//! | [`NcclBackend::from_env`] / [`NcclBackend::launch`] | one process per GPU (torchrun, srun, mpirun) | rank 0 makes the control communicator's `ncclUniqueId` and publishes it over the [`Exchange`](crate::control::Exchange); the data communicators are split off the control one |
//! | [`NcclBackend::adopt`] | one process per GPU, with a runtime's communicator (PyTorch's `_comm_ptr()`) | the control communicator is split off the runtime's (which stays untouched), the data ones off the control one |
//! | [`NcclBackend::local_world`] | one thread per GPU of this process | as `from_env`, one unique id shared in the process |
//! | [`NcclBackend::from_raw`] | any | used as they are (tests, interop): no control communicator, no warm-up |
//!
//! # Two kinds of communicator
//!
//! On a **non-blocking** communicator NCCL creates a thread for every `ncclGroupEnd`,
//! so for every collective, and the next call must wait for it (src/group.cc,
//! `groupLaunchNonBlocking`, NCCL 2.28.3 to 2.31): about 100 µs a call at 64 KiB on two
//! H200s, against about 10 µs on a blocking one. So the crate uses each kind where it
//! pays:
//!
//! - the **control** communicator is non-blocking, created (or split) and polled under
//!   the set-up deadline; nothing runs on it after set-up but the splits;
//! - the **data** communicators are split off it with `config.blocking = 1` (NCCL
//!   honours the child's config in `ncclCommSplit`; the split itself runs on NCCL's
//!   thread and is polled through the parent) and their collectives are called inline
//!   on the caller's thread: the NCCL enqueue and a completion event, nothing else (no
//!   `ncclCommGetAsyncError`, no sleep, no thread). Calls on one communicator are
//!   serialised by one lock that only the backend's callers take (uncontended when one
//!   thread drives the rank); the watchdog never takes it.
//!   [`NcclConfig::data_blocking`] `= false` makes them non-blocking again, for callers
//!   that need every call abortable at any point, at the cost above.
//!
//! # Warm-up
//!
//! NCCL connects an algorithm's channels at a communicator's first collective
//! (`NCCL_RUNTIME_CONNECT=1`, the default since 2.22), and the copy engine's first
//! all-gather registers a window (`ncclCeInit`): lazy work that waits on peers. So
//! set-up ends with a warm-up under the set-up deadline: on one registered segment
//! (world × 4 MiB, released after), every collective the path policy can choose on each
//! data communicator, at 4 KiB and 4 MiB per rank (NCCL picks its algorithms by size);
//! [`NcclBackend::warmed`] lists them. `NCCL_RUNTIME_CONNECT=0` would connect at
//! creation instead, but for every communicator of the process (PyTorch's too), and
//! only if set before NCCL is loaded; the crate does not set it.
//!
//! # What bounds each wait
//!
//! | wait | on | bounded by | on expiry |
//! |---|---|---|---|
//! | set-up: exchange round, control communicator's creation or split | non-blocking | [`NcclConfig::setup_timeout`], polled | [`Error::NcclTimeout`], communicators aborted |
//! | split of each data communicator | polled through the non-blocking parent | the same set-up deadline | the same |
//! | warm-up (registration, collectives, device wait) | blocking (default) | the set-up deadline: the watchdog sees the thread inside NCCL | revoke, abort, [`Error::NcclTimeout`] |
//! | window registration (collective: every rank must call) | blocking | [`NcclConfig::call_timeout`], through the watchdog | revoke, then abort; the call returns [`Error::NcclTimeout`] within `call_timeout` + interval + 0.5 s (`LEAVE_WAIT`) |
//! | window deregistration (local in NCCL 2.28–2.30) | blocking | the caller's deadline (the pool's release), capped by `call_timeout`, through the watchdog | as registration |
//! | collective enqueue | blocking | watched collectives: nothing of its own (the enqueue waits on peers only when work is stuck, NCCL's work FIFO full, which the completion watch below catches); unwatched ones (under CUDA graph capture, or `watchdog_timeout = Duration::MAX`): `call_timeout`, through the watchdog | revoke, abort, [`Error::NcclTimeout`] |
//! | collective completion (device) | — | [`NcclConfig::watchdog_timeout`] after the enqueue, seen within `watchdog_interval` | revoke, abort, [`Error::NcclWatchdog`] |
//! | any NCCL call or collective waiting on a lost peer (its process ended, or it stopped answering heartbeats: the exchange's verdict, [`Exchange::lost_peer`](crate::control::Exchange::lost_peer)) | — | the verdict (a dead process: at once, the watchdog reading the store's word itself; a frozen one, e.g. `SIGSTOP`: the heartbeat timeout + interval, 6 s by default), seen within `watchdog_interval`, + `LEAVE_WAIT` for a thread inside NCCL (`ncclCommRevoke` does not end a registration: the abort does), + the abort | revoke, abort, [`Error::PeerLost`] naming the rank |
//! | any call on a non-blocking data communicator ([`NcclConfig::data_blocking`] `= false`) | non-blocking | `call_timeout`, polled | abort, [`Error::NcclTimeout`] |
//! | abort (`ncclCommAbort` can block: NVIDIA/nccl issue 1777) | its own thread | not waited for; releases wait ≤ 10 s | window and segment leaked |
//! | drop | — | idle device: ≤ 10 s for the aborts; work in flight: not waited for | communicators leaked |
//! | draining (a pool's release, close or drop) once the backend is broken | — | 0.5 s (`DROP_DRAIN_WAIT`): aborted kernels end at once, and a copy-engine all-gather waiting on a lost peer (stream memory waits, which no abort ends) never does | its segments and windows leaked, the stream stays blocked |
//!
//! The watchdog (one thread per backend), on a deadline, a lost peer, an asynchronous
//! NCCL error or a failed device, **revokes** the blocking data communicators
//! (`ncclCommRevoke`, NCCL ≥ 2.28.7: stops their in-flight work and frees nothing, so a
//! thread stuck inside NCCL returns), waits at most 0.5 s (`LEAVE_WAIT`) for such a
//! thread to leave, then aborts every communicator on a thread of its own. Before
//! 2.28.7 it aborts directly (as PyTorch does): a thread still inside NCCL on a blocking
//! communicator then races with the abort, which NCCL documents as safe only on
//! non-blocking ones (user guide, *Communicators*, fault tolerance). After an abort the
//! backend is broken for good ([`NcclBackend::health`] says with which error); windows
//! of an aborted communicator are never deregistered (NCCL destroyed them), and
//! segments are freed only once the aborts returned (after 10 s they are leaked).
//!
//! # CUDA graphs
//!
//! Collectives on blocking communicators can be captured into a CUDA graph and
//! replayed (NCCL supports capture of its collectives; buffers reserved before the
//! capture): under capture the collective path makes the same NCCL call, and records
//! no completion event (an event recorded during capture is a node of the graph, not a
//! completion the watchdog can query), so replays are not watched. The pool's growth
//! stays refused while its stream captures.

mod build;
mod comm;
mod config;
#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl/fake/mod.rs"]
mod fake;
mod ffi;
mod health;
mod setup;
mod streams;
mod warmup;
mod watchdog;

pub use config::NcclConfig;
pub use warmup::{WarmCollective, WarmedPath};

use super::{
    CollArgs, Collectives, Refused, Region, Segment, SegmentMemory, SegmentProvider, StreamOps,
    Window,
};
use crate::deadline::Deadline;
use crate::error::{Error, NcclVersion, Result};
use comm::{ABORT_WAIT, AbortThreads, Binder, Bound, Device, Shared};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ffi::{CollCall, CollKind, RawWindow};
use health::Cause;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use streams::FenceTable;
pub(crate) use streams::{cuda_key, same_cuda_stream};
use watchdog::Watchdog;

pub use cudarc::driver::sys::CUstream;
pub use cudarc::nccl::sys::ncclComm_t;

/// The NCCL version found at run time.
///
/// # Errors
/// [`Error::LibraryUnavailable`] if the CUDA driver or NCCL cannot be loaded.
pub fn nccl_version() -> Result<NcclVersion> {
    ffi::load()
}

/// Number of CUDA devices visible, or an error if the driver is missing or fails.
///
/// # Errors
/// [`Error::LibraryUnavailable`], [`Error::Cuda`].
pub fn device_count() -> Result<usize> {
    if !ffi::driver_present() {
        return Err(ffi::NO_DRIVER);
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(ffi::cuda("cuDeviceGetCount"))
}

/// The memory of one `ncclMemAlloc` segment (leaked when dropped, as a [`Segment`] says).
#[derive(Debug)]
struct NcclMemory {
    ptr: u64,
    size_bytes: u64,
}

impl SegmentMemory for NcclMemory {
    fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn device_ptr(&self) -> Option<u64> {
        Some(self.ptr)
    }
}

/// The error of `what` (a handle of another backend) reaching the NCCL backend.
fn foreign(what: &str) -> Error {
    Error::internal(format!("{what} reached the NCCL backend"))
}

/// The CUDA device of a rank (its primary context), as the communicator layer sees it.
impl Device for Arc<CudaContext> {
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn raw_stream(&self, stream: &CudaStream) -> cudarc::nccl::sys::cudaStream_t {
        stream.cu_stream() as _
    }

    fn capturing(&self, stream: &CudaStream) -> Result<bool> {
        ffi::is_capturing(stream)
    }

    fn record(&self, stream: &CudaStream, spare: Option<CudaEvent>) -> Result<CudaEvent> {
        let event =
            (spare.map_or_else(|| self.new_event(None), Ok)).map_err(ffi::cuda("cuEventCreate"))?;
        event.record(stream).map_err(ffi::cuda("cuEventRecord"))?;
        Ok(event)
    }

    fn wait_idle(&self, stream: &CudaStream, deadline: Deadline) -> Result<bool> {
        let event = (stream.record_event(None)).map_err(ffi::cuda("cuEventRecord"))?;
        streams::all_complete(&[event], deadline)
    }

    fn binder(&self) -> Binder {
        let ctx = self.clone();
        Arc::new(move || {
            let _ = ctx.bind_to_thread();
        })
    }
}

/// One rank of NCCL: a device context and its communicators (segments and windows
/// belong to the pools). Its constructors (see the [module](self)) return
/// [`Backend`](super::Backend)s; reach this type again through
/// [`Backend::downcast_ref`](super::Backend::downcast_ref).
pub struct NcclBackend {
    shared: Arc<Shared<Arc<CudaContext>>>,
    /// Registrations made per communicator (window ordinals).
    ordinals: Mutex<Vec<u64>>,
    fences: Mutex<FenceTable>,
    /// Streams adopted from raw handles, by handle: one [`StreamId`](crate::core::StreamId) per raw stream.
    raw_streams: Mutex<HashMap<usize, crate::stream::Stream>>,
    /// What the warm-up ran.
    warmed: Vec<WarmedPath>,
    watchdog: Watchdog,
    /// A drain ran out of time: some stream is stuck, so the drop does not wait again.
    drain_timed_out: AtomicBool,
}

impl fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shared;
        let broken = if s.health.is_broken() { ", broken" } else { "" };
        write!(
            f,
            "NcclBackend(rank {} of {}, device {}, {} data communicators{broken})",
            s.rank,
            s.world,
            s.device.ordinal(),
            s.comms.len()
        )
    }
}

impl NcclBackend {
    /// The raw handle of data communicator `comm` (index into
    /// [`BackendInfo::communicators`](super::BackendInfo::communicators)), for calling
    /// NCCL directly beside the pool (benchmarks, interop); `None` if there is no such
    /// communicator or it was aborted.
    ///
    /// Using the handle is `unsafe` on the caller's side: NCCL calls on it must not
    /// overlap with this backend's (it serialises its own calls only), and it must not
    /// be used after the backend is dropped or broken.
    pub fn raw_comm(&self, comm: usize) -> Option<ncclComm_t> {
        let c = self.shared.comms.get(comm)?;
        (!c.is_aborted()).then_some(c.raw.0)
    }

    /// Whether data communicator `comm` is blocking (`None` if there is none).
    pub fn is_blocking(&self, comm: usize) -> Option<bool> {
        self.shared.comms.get(comm).map(|c| c.blocking)
    }

    /// The (communicator, collective) pairs the set-up's warm-up ran, in order: every
    /// pair the path policy can choose (see the [module](self)). Empty for a backend
    /// made with [`from_raw`](Self::from_raw).
    pub fn warmed(&self) -> &[WarmedPath] {
        &self.warmed
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.device
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.context().ordinal()
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &NcclConfig {
        &self.shared.config
    }

    /// `Ok` while the backend is usable; the error every later call gets once it is
    /// broken (a deadline passed, the watchdog fired, a peer was lost, NCCL reported
    /// an error, or [`abort`](Self::abort) was called).
    ///
    /// # Errors
    /// [`Error::PeerLost`] naming the rank when the exchange knows of a lost peer;
    /// else [`Error::NcclWatchdog`] or [`Error::NcclAborted`].
    pub fn health(&self) -> Result<()> {
        self.shared.health.check()
    }

    /// Abort this rank's NCCL communicators now (for example when the application
    /// learnt of a lost peer elsewhere) and break the backend: later calls fail with
    /// [`Error::NcclAborted`] naming `reason`. Stuck collectives end. Local; returns at
    /// once: the aborts run on threads of their own (`ncclCommAbort` can block), and
    /// dropping the backend waits for them at most 10 s.
    pub fn abort(&self, reason: &str) {
        let _ = self.shared.fail(Cause::Aborted(format!(
            "aborted by the application: {reason}"
        )));
    }

    fn bind(&self) -> Result<()> {
        ffi::bind(self.context())
    }

    /// The device address of a region's first byte.
    fn ptr(region: &Region<'_>) -> Result<u64> {
        region.device_ptr().ok_or_else(|| foreign("a host segment"))
    }

    fn memory(segment: &Segment) -> Result<&NcclMemory> {
        (segment.memory::<NcclMemory>()).ok_or_else(|| foreign("a segment of another backend"))
    }

    /// Enqueue a collective: checks, then the communicator layer's call (inline on a
    /// blocking communicator) and the watchdog's event.
    fn collective(&self, a: &CollArgs<'_>, kind: CollKind) -> Result<()> {
        // An all-reduce has `count` elements on both sides (a world of one chunk).
        let (world, reduce) = match kind {
            CollKind::AllGather => (self.shared.world, false),
            CollKind::ReduceScatter(_) => (self.shared.world, true),
            CollKind::AllReduce(_) => (1, true),
        };
        let call = CollCall {
            kind,
            send: Self::ptr(&a.send)?,
            recv: Self::ptr(&a.recv)?,
            count: a.count,
            dtype: ffi::dtype(a.dtype),
        };
        a.check_counts(call.name(), world, reduce)?;
        let cs = self.cuda_of(a.stream)?;
        // SAFETY: both regions lie inside live segments of this device (regions are
        // checked against their segments, which the caller's buffers keep alive), with
        // the sizes checked above; the pool keeps the segments until the stream has
        // passed (frees are fenced); `cs` is a live stream of the caller's.
        unsafe { self.shared.collective(a.comm, &call, cs, Bound::Watchdog) }
    }
}

impl SegmentProvider for NcclBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        self.shared.health.check()?;
        self.bind()?;
        let ptr = ffi::mem_alloc(self.shared.nccl, size_bytes)?;
        Ok(Segment::new(Box::new(NcclMemory { ptr, size_bytes })))
    }

    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> Result<Option<Window>> {
        let mem = Self::memory(segment)?;
        self.bind()?;
        // SAFETY: the segment is one whole ncclMemAlloc allocation of this device (from
        // `allocate`), and the caller guarantees it is not registered on this
        // communicator yet and that every rank registers in the same order.
        let win = unsafe {
            self.shared.register(
                comm,
                mem.ptr,
                mem.size_bytes,
                self.shared.call_deadline().min(deadline),
            )
        }?;
        let mut ordinals = self.ordinals.lock();
        ordinals[comm] += 1;
        Ok(win.map(|w| Window::new(comm, ordinals[comm], Box::new(w))))
    }

    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        let (comm, ordinal) = (window.comm(), window.ordinal());
        let raw = window
            .into_handle::<RawWindow>()
            .map_err(|handle| Refused {
                handle,
                error: foreign("a window of another backend"),
            })?;
        let back = |(w, error)| Refused {
            handle: Window::new(comm, ordinal, Box::new(w)),
            error,
        };
        let deadline = self.shared.call_deadline().min(deadline);
        match self.bind() {
            // SAFETY: the window was registered on this communicator by `register` (the
            // caller's contract) and is consumed here; the caller guarantees no work
            // uses it.
            Ok(()) => unsafe { self.shared.deregister(comm, *raw, deadline) }.map_err(back),
            Err(error) => Err(back((*raw, error))),
        }
    }

    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // An abort still running may still release a window on this memory (one being
        // registered when the backend broke is in no pool's list): never free under it.
        let freed = Self::memory(&segment).and_then(|m| {
            self.shared.may_free()?;
            self.bind()?;
            // SAFETY: the caller guarantees the segment came from `allocate` (so `m.ptr`
            // is an ncclMemAlloc pointer), that no window covers it and no work uses
            // it; it is consumed here, so freed once.
            unsafe { ffi::mem_free(self.shared.nccl, m.ptr) }
        });
        freed.map_err(|error| Refused {
            handle: segment,
            error,
        })
    }
}

impl Collectives for NcclBackend {
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        self.collective(a, CollKind::AllGather)
    }

    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        self.collective(a, CollKind::ReduceScatter(ffi::red_op(a.op)))
    }

    fn all_reduce(&self, a: &CollArgs<'_>) -> Result<()> {
        self.collective(a, CollKind::AllReduce(ffi::red_op(a.op)))
    }
}

/// How long a drop, or a drain once the backend is broken, waits for the device work
/// already enqueued before it decides the device is busy (see the drop).
const DROP_DRAIN_WAIT: Duration = Duration::from_millis(500);

impl Drop for NcclBackend {
    fn drop(&mut self) {
        // The pools released their segments and windows before this (they hold the
        // backend), each after draining for at most its own timeout. Everything here is
        // local: `ncclCommAbort` (not the collective destroy), which also ends NCCL
        // operations still in flight, as is left when a peer died.
        self.watchdog.stop();
        let _ = self.bind();
        self.fences.lock().events.clear();
        // With nothing in flight, wait (boundedly) for the aborts to release NCCL's
        // resources; with work still running (a stuck collective, a kernel that never
        // ends) the aborts wait for the device, so leave them to their thread at once.
        // Work just enqueued gets `DROP_DRAIN_WAIT` to finish (an idle device answers at
        // once; a zero deadline would make the last collectives look stuck).
        let rank = self.shared.rank;
        let wait = if self.drain_timed_out.load(Ordering::Relaxed) {
            Duration::ZERO
        } else {
            DROP_DRAIN_WAIT
        };
        let drained = self.drain(Deadline::after(wait));
        if let Err(e) = &drained {
            tracing::warn!("symmpool: rank {rank}: draining at drop failed: {e}");
        }
        if !matches!(drained, Ok(true)) {
            tracing::warn!(
                "symmpool: rank {rank}: device work still in flight; aborting its communicators in the background"
            );
            self.shared.abort_all(AbortThreads::PerCommunicator);
            return;
        }
        let deadline = Deadline::after(ABORT_WAIT);
        self.shared.abort_all(AbortThreads::One);
        // These aborts and any started earlier (by a timeout, the watchdog or an NCCL
        // error) get the same bound.
        let pending = (self.shared.all_comms())
            .filter(|c| c.aborted_by(deadline) == Some(false))
            .count();
        if pending > 0 {
            tracing::warn!(
                "symmpool: rank {rank}: {pending} ncclCommAbort calls had not returned after {ABORT_WAIT:?}; they go on in the background and their communicators are leaked"
            );
        }
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl.rs"]
mod tests;
