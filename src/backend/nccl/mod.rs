//! The NCCL backend: segments from `ncclMemAlloc`, one `ncclCommWindowRegister(..,
//! NCCL_WIN_COLL_SYMMETRIC)` per (segment, communicator), collectives through NCCL.
//!
//! Each rank has up to three communicators over the same ranks (see [`CommRole`]):
//! a default-policy one whose windows run NCCL's symmetric kernels, a
//! `CTAPolicy = NCCL_CTA_POLICY_ZERO` one (NCCL ≥ 2.28) whose windows run the
//! copy-engine all-gather, and a default-policy one where nothing is registered, for
//! the collectives that run faster on NCCL's ring. NCCL is loaded at run time (an
//! NCCL the process already has first, see `ffi`); a missing library or one older than
//! 2.27 is an error, never a panic.
//!
//! # Making a backend
//!
//! | how | ranks | communicators |
//! |---|---|---|
//! | [`NcclBackend::from_env`] / [`NcclBackend::launch`] | one process per GPU (torchrun, srun, mpirun) | created by the crate: rank 0 makes one `ncclUniqueId` per communicator and publishes them over the [`Exchange`] |
//! | [`NcclBackend::adopt`] | one process per GPU, with a runtime's communicator (PyTorch's `_comm_ptr()`) | split from it by the crate (`ncclCommSplit`), the parent untouched |
//! | [`NcclBackend::local_world`] | one thread per GPU of this process | created by the crate |
//! | [`NcclBackend::from_raw`] | any | used as they are (tests, interop) |
//!
//! # Deadlines, aborts and the watchdog
//!
//! The communicators the crate makes are **non-blocking**. Every NCCL call that can
//! wait on peers (creation, split, window registration and deregistration, a
//! collective's enqueue, which connects to the peers the first time) returns at once
//! and is polled with `ncclCommGetAsyncError` (pauses from 20 µs doubling to 5 ms)
//! until it is done or its deadline ([`NcclConfig::setup_timeout`] for creation,
//! [`NcclConfig::call_timeout`] for the rest) passes. At the deadline the rank aborts
//! **all** its communicators (`ncclCommAbort`) and the call fails with
//! [`Error::NcclTimeout`]; the backend is then broken for good: every later
//! allocation, registration, collective or new stream fails with
//! [`Error::NcclAborted`] (releases — deregister, free — still work once the aborts
//! have returned; memory whose abort has not returned in 10 s is leaked instead).
//!
//! A collective can also hang *after* its enqueue, on the device, when a peer dies
//! inside it. Each enqueued collective records a CUDA event; a watchdog thread per
//! backend looks every [`NcclConfig::watchdog_interval`] (100 ms) at the events and at
//! `ncclCommGetAsyncError` of each communicator. A collective still incomplete after
//! [`NcclConfig::watchdog_timeout`] (10 minutes), an asynchronous NCCL error or a
//! failed device aborts the communicators (which ends the stuck kernels) and breaks
//! the backend: the next call fails with [`Error::NcclWatchdog`] (or
//! [`Error::NcclAborted`]). So a surviving rank learns of a lost peer within
//! `watchdog_timeout + watchdog_interval` of the collective's enqueue, and within
//! `call_timeout` in a call that waits on peers.
//!
//! `ncclCommAbort` itself can block without bound when a peer was killed (it joins
//! NCCL's proxy threads; NVIDIA/nccl issue 1777). It runs on a thread of its own: the
//! call that breaks the backend returns at once (the abort flag it sets still ends the
//! stuck kernels); releasing a window of an aborted communicator waits for its abort
//! at most 10 s (after that the window and its segment are leaked, never freed under
//! a running abort); dropping a backend with no device work in flight waits for the
//! aborts at most 10 s, one with work in flight not at all, and aborts still running
//! then are left to their threads, their communicators leaked.
//!
//! Communicators passed to [`NcclBackend::from_raw`] are never aborted by the crate
//! (they are not its own), and a blocking one is not bounded by any deadline: a call
//! on it can wait forever.

mod config;
mod ffi;
mod health;
mod setup;

pub use config::{NcclConfig, NcclWorldConfig};

use super::{
    Backend, BackendInfo, BackendKind, CollArgs, Collectives, CommInfo, CommRole, DataMover,
    Refused, Region, Segment, SegmentMemory, SegmentProvider, StreamOps, Window,
};
use crate::control::{Exchange, LocalExchange, StoreExchange};
use crate::core::{Fence, StreamId};
use crate::error::{Error, NcclVersion, Result};
use crate::stream::Stream;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ffi::{RawComm, RawWindow, Status};
use health::{Backoff, Cause, Completion, Enqueued, Health, MAX_POLL_PAUSE, Watch};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

pub use cudarc::driver::sys::CUstream;
pub use cudarc::nccl::sys::ncclComm_t;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
        return Err(Error::LibraryUnavailable {
            library: "libcuda (CUDA driver)",
            hint: "no NVIDIA driver on this machine; use the host backend",
        });
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .map_err(ffi::cuda("cuDeviceGetCount"))
}

/// The primary context of `device`, checked to exist first (cudarc panics without a
/// driver).
fn context(device: usize) -> Result<Arc<CudaContext>> {
    let count = device_count()?;
    if device >= count {
        return Err(Error::InvalidConfig(format!(
            "device {device} not present ({count} visible)"
        )));
    }
    let ctx = CudaContext::new(device).map_err(ffi::cuda("cuDevicePrimaryCtxRetain"))?;
    ctx.bind_to_thread().map_err(ffi::cuda("cuCtxSetCurrent"))?;
    Ok(ctx)
}

/// `ncclGetVersion`'s code for a version.
fn version_code(v: NcclVersion) -> i32 {
    i32::try_from(v.major * 10000 + v.minor * 100 + v.patch).unwrap_or(i32::MAX)
}

/// The memory of one `ncclMemAlloc` segment. Dropping it without
/// [`SegmentProvider::free`] leaks the device memory on purpose (a pool does that when
/// its device cannot drain in time).
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

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Fences as CUDA events, garbage-collected once known complete; and the streams
/// that have recorded any, for draining.
#[derive(Default)]
struct FenceTable {
    next: BTreeMap<StreamId, u64>,
    events: BTreeMap<(StreamId, u64), CudaEvent>,
    /// Largest fence known complete, per stream: waits on it or earlier are skipped.
    done: BTreeMap<StreamId, u64>,
    streams: BTreeMap<StreamId, Arc<CudaStream>>,
    spare: Vec<CudaEvent>,
}

/// Events kept per stream before completed ones are collected.
const FENCES_PER_STREAM: usize = 64;

/// One communicator: its handle, whether the crate made it (and so aborts it), and
/// the mutex every NCCL call on it holds.
struct Comm {
    raw: RawComm,
    owned: bool,
    state: Mutex<CommState>,
    /// Set by the thread that runs its `ncclCommAbort` once that returned.
    abort_done: Arc<AbortDone>,
}

struct CommState {
    /// `ncclCommAbort` was handed to a thread (or has run): no call may start on it.
    aborted: bool,
}

/// Whether a communicator's `ncclCommAbort` has returned, for those that must not
/// touch what the abort releases before then (its windows, and so their segments).
/// Its waits share one deadline, `ABORT_WAIT` after the abort was handed off: past
/// it (or when no thread could run the abort) every wait answers "not returned" at
/// once, so a release of many windows does not wait for each in turn.
#[derive(Default)]
struct AbortDone {
    state: Mutex<AbortState>,
    cv: Condvar,
}

#[derive(Default)]
struct AbortState {
    done: bool,
    /// Waits end here at the latest (`None`: not handed off yet).
    give_up_at: Option<Instant>,
}

impl AbortDone {
    /// The abort was handed to a thread now.
    fn handed_off(&self) {
        lock(&self.state).give_up_at =
            Some(crate::control::deadline_after(Instant::now(), ABORT_WAIT));
    }

    /// No thread will run the abort: waits give up at once.
    fn abandoned(&self) {
        lock(&self.state).give_up_at = Some(Instant::now());
    }

    fn set(&self) {
        lock(&self.state).done = true;
        self.cv.notify_all();
    }

    /// Wait until the abort returned, `deadline` or its own give-up time passes;
    /// whether it returned.
    fn wait(&self, deadline: Instant) -> bool {
        let st = lock(&self.state);
        let until = st.give_up_at.map_or(deadline, |g| g.min(deadline));
        let left = until.saturating_duration_since(Instant::now());
        let (st, _) = self
            .cv
            .wait_timeout_while(st, left, |st| !st.done)
            .unwrap_or_else(|p| p.into_inner());
        st.done
    }
}

impl Comm {
    fn new(raw: RawComm, owned: bool) -> Self {
        Comm {
            raw,
            owned,
            state: Mutex::new(CommState { aborted: false }),
            abort_done: Arc::default(),
        }
    }

    /// Mark it aborted, so that no NCCL call starts on it after this, and hand back
    /// its handle for `ncclCommAbort` (with the flag to set when it returned) if the
    /// crate made it and it was not marked before. Waits for a call in progress on
    /// it, which its poll bounds (a poll stops as soon as the backend is broken).
    fn take_for_abort(&self) -> Option<(RawComm, Arc<AbortDone>)> {
        let mut state = lock(&self.state);
        if self.owned && !state.aborted {
            state.aborted = true;
            Some((self.raw, self.abort_done.clone()))
        } else {
            None
        }
    }

    /// Whether it was aborted, and if so whether its abort returned by `deadline`.
    fn aborted_by(&self, deadline: Instant) -> Option<bool> {
        if !lock(&self.state).aborted {
            return None;
        }
        Some(self.abort_done.wait(deadline))
    }
}

/// How long a drop, or a communicator made during a failed set-up, waits for its
/// aborts before leaving them to their thread.
const ABORT_WAIT: Duration = Duration::from_secs(10);

/// How [`abort_off_thread`] spreads its aborts over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AbortThreads {
    /// One thread, the communicators one after another: a teardown with no device
    /// work in flight (what ran in the two-GPU trials with ranks as threads; one
    /// thread per communicator there was not shown to be safe).
    One,
    /// A thread per communicator, started together: device work may be stuck.
    PerCommunicator,
}

/// Abort `comms` (handles from [`Comm::take_for_abort`]) off the calling thread (each
/// thread binds `ctx` first); each sets its communicator's [`AbortDone`] when its
/// abort returned, which is what callers wait on, boundedly.
///
/// `ncclCommAbort` sets the communicator's abort flag (which ends its kernels) and
/// then frees its memory, and a free waits for the device. Aborted one after another
/// while a kernel is stuck, the first communicator's free waits for a kernel stuck on
/// the third, whose flag is never set (seen on two H200s with NCCL 2.28.3: a survivor
/// hung in the abort after its peer was killed inside an all-gather): so where work
/// may be stuck, every communicator gets its own thread. And `ncclCommAbort` can
/// block without bound on its own (it joins NCCL's proxy threads; NVIDIA/nccl issue
/// 1777), so nobody waits for it without a deadline; a thread that never returns only
/// leaks its communicators.
fn abort_off_thread(
    ctx: Option<Arc<CudaContext>>,
    comms: Vec<(RawComm, Arc<AbortDone>)>,
    threads: AbortThreads,
) {
    let batches: Vec<Vec<(RawComm, Arc<AbortDone>)>> = match threads {
        AbortThreads::One if comms.is_empty() => Vec::new(),
        AbortThreads::One => vec![comms],
        AbortThreads::PerCommunicator => comms.into_iter().map(|c| vec![c]).collect(),
    };
    for batch in batches {
        for (_, flag) in &batch {
            flag.handed_off();
        }
        let flags: Vec<Arc<AbortDone>> = batch.iter().map(|(_, f)| f.clone()).collect();
        let ctx = ctx.clone();
        let spawned = std::thread::Builder::new()
            .name("symmpool-abort".into())
            .spawn(move || {
                if let Some(ctx) = ctx {
                    let _ = ctx.bind_to_thread();
                }
                for (raw, done) in batch {
                    // SAFETY: `take_for_abort` handed out each handle once, for a
                    // communicator the crate made, and marked it aborted under its
                    // mutex, so no other NCCL call is in progress on it or starts on it
                    // later; its windows are deregistered by nobody but this abort
                    // (`deregister` waits for `done`), so their segments stay mapped.
                    if let Err(e) = unsafe { ffi::comm_abort(raw) } {
                        tracing::error!("symmpool: ncclCommAbort failed: {e}");
                    }
                    done.set();
                }
            });
        if let Err(e) = spawned {
            flags.iter().for_each(|f| f.abandoned());
            tracing::error!(
                "symmpool: could not start an abort thread ({e}); communicators leaked"
            );
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Communicators made during a set-up that then failed end here (NCCL binds the
        // device itself in `ncclCommAbort`); the backend's own drop has marked the
        // others aborted already.
        if let Some(taken) = self.take_for_abort() {
            let done = taken.1.clone();
            abort_off_thread(None, vec![taken], AbortThreads::One);
            if !done.wait(crate::control::deadline_after(Instant::now(), ABORT_WAIT)) {
                tracing::warn!(
                    "symmpool: ncclCommAbort of a communicator from a failed set-up had not returned after {ABORT_WAIT:?}; it is leaked"
                );
            }
        }
    }
}

/// How polling a non-blocking call ended.
#[derive(Debug)]
enum Waited {
    Done,
    Failed(Error),
    Timeout(Duration),
    Broken,
}

/// Poll a non-blocking call on `comm` until it is done, fails, `timeout` passes since
/// `started`, or `broken()` says to stop.
///
/// # Safety
/// `comm` is live and the caller has exclusive use of it (holds its mutex, or made it
/// and shares it with nobody yet).
unsafe fn poll(
    comm: RawComm,
    op: &'static str,
    started: Instant,
    timeout: Duration,
    broken: &dyn Fn() -> bool,
) -> Waited {
    // A call that answered `ncclSuccess` may still be running: on a non-blocking
    // communicator NCCL 2.28 ends calls such as `ncclCommWindowRegister` with an
    // internal group end whose `ncclInProgress` it does not return, and writes the
    // window handle when the job finishes. So the communicator's asynchronous state is
    // always read until it is no longer in progress (seen on NCCL 2.28.3: a NULL window
    // read too early, then a late write into freed memory).
    let deadline = crate::control::deadline_after(started, timeout);
    let mut backoff = Backoff::new(MAX_POLL_PAUSE);
    loop {
        // SAFETY: the caller's contract.
        match unsafe { ffi::async_state(op, comm) } {
            Ok(Status::Done) => return Waited::Done,
            Ok(Status::InProgress) => {}
            Err(e) => return Waited::Failed(e),
        }
        if broken() {
            return Waited::Broken;
        }
        let now = Instant::now();
        if now >= deadline {
            return Waited::Timeout(now.saturating_duration_since(started));
        }
        std::thread::sleep(backoff.pause(now, deadline));
    }
}

/// Finish making a communicator: poll it (no backend exists yet), abort it on failure.
fn finish_creation(
    starting: Result<ffi::Starting>,
    op: &'static str,
    started: Instant,
    timeout: Duration,
) -> Result<Comm> {
    let starting = starting?;
    // SAFETY: the communicator was just made by this thread and is shared with nobody.
    let waited = unsafe { poll(starting.comm, op, started, timeout, &|| false) };
    match waited {
        Waited::Done => Ok(Comm::new(starting.finish(), true)),
        Waited::Failed(e) => {
            // Dropping the `Comm` aborts it; the call has ended, so the boxes are free.
            drop(Comm::new(starting.finish(), true));
            Err(e)
        }
        other => {
            let waited = match other {
                Waited::Timeout(w) => w,
                _ => timeout,
            };
            // The abort ends NCCL's work on it; the boxes are leaked all the same.
            drop(Comm::new(starting.abandon(), true));
            Err(Error::NcclTimeout { op, waited })
        }
    }
}

impl Completion for CudaEvent {
    fn complete(&self) -> std::result::Result<bool, String> {
        self.try_is_complete().map_err(|e| format!("{e:?}"))
    }
}

/// What the backend and its watchdog share.
struct Shared {
    rank: usize,
    ctx: Arc<CudaContext>,
    comms: Vec<Comm>,
    health: Health,
    watch: Mutex<Watch<CudaEvent>>,
    config: NcclConfig,
}

impl Shared {
    /// Abort every communicator the crate made (once) and forget the watched events.
    /// Every later call on them fails at once; the aborts themselves run off this
    /// thread ([`abort_off_thread`]) and are not waited for here.
    fn abort_all(&self, threads: AbortThreads) {
        let taken: Vec<_> = self.comms.iter().filter_map(Comm::take_for_abort).collect();
        lock(&self.watch).clear();
        abort_off_thread(Some(self.ctx.clone()), taken, threads);
    }

    /// Break the backend with `cause` (aborting the communicators if this is the first
    /// cause) and return the error for the call that found it.
    fn fail(&self, cause: Cause) -> Error {
        if self.health.break_with(cause.clone()) {
            self.abort_all(AbortThreads::PerCommunicator);
            cause.error(true)
        } else {
            self.health.error()
        }
    }

    /// A failed NCCL call: argument errors are reported as they are; anything else
    /// means the communicator cannot be trusted, so the backend breaks.
    fn on_error(&self, e: Error) -> Error {
        match &e {
            // ncclInvalidArgument, ncclInvalidUsage: nothing was started.
            Error::Nccl { code: 4 | 5, .. } => e,
            Error::Nccl { .. } => {
                if self.health.break_with(Cause::Failed(e.to_string())) {
                    self.abort_all(AbortThreads::PerCommunicator);
                }
                e
            }
            _ => e,
        }
    }

    /// The result of a poll, once the communicator's mutex is released.
    fn conclude(&self, waited: Waited, op: &'static str) -> Result<()> {
        match waited {
            Waited::Done => Ok(()),
            Waited::Failed(e) => Err(self.on_error(e)),
            Waited::Timeout(waited) => Err(self.fail(Cause::Timeout { op, waited })),
            Waited::Broken => Err(self.health.error()),
        }
    }

    fn comm(&self, c: usize) -> Result<&Comm> {
        self.comms.get(c).ok_or_else(|| Error::InvalidCollective {
            op: "NCCL call",
            detail: format!("no communicator {c}"),
        })
    }

    /// The communicator's mutex, unless it was aborted.
    fn lock_live<'a>(&self, c: &'a Comm) -> Result<MutexGuard<'a, CommState>> {
        let guard = lock(&c.state);
        if guard.aborted {
            return Err(self.health.error());
        }
        Ok(guard)
    }

    /// Run the NCCL call `start` on communicator `c` and poll it to completion within
    /// `timeout`; `start` gets the handle with the mutex held.
    fn call<S>(
        &self,
        c: usize,
        op: &'static str,
        timeout: Duration,
        start: impl FnOnce(RawComm) -> Result<S>,
    ) -> Result<(S, Waited)> {
        let comm = self.comm(c)?;
        let started = Instant::now();
        let (s, waited) = {
            let _guard = self.lock_live(comm)?;
            let s = match start(comm.raw) {
                Ok(s) => s,
                Err(e) => {
                    drop(_guard);
                    return Err(self.on_error(e));
                }
            };
            // SAFETY: the communicator is live (not aborted) and we hold its mutex.
            let waited =
                unsafe { poll(comm.raw, op, started, timeout, &|| self.health.is_broken()) };
            (s, waited)
        };
        Ok((s, waited))
    }

    /// One look of the watchdog.
    fn tick(&self) {
        if self.health.is_broken() {
            return;
        }
        let cause = lock(&self.watch).sweep(Instant::now(), self.config.watchdog_timeout);
        if let Some(cause) = cause {
            let _ = self.fail(cause);
            return;
        }
        for c in self.comms.iter().filter(|c| c.owned) {
            // A communicator busy in a call is looked at next time.
            let Ok(state) = c.state.try_lock() else {
                continue;
            };
            if state.aborted {
                continue;
            }
            // SAFETY: live (not aborted) and we hold its mutex.
            let result = unsafe { ffi::async_state("an earlier NCCL call", c.raw) };
            drop(state);
            if let Err(e) = result {
                if self.health.break_with(Cause::Failed(format!(
                    "NCCL reported an asynchronous error: {e}"
                ))) {
                    self.abort_all(AbortThreads::PerCommunicator);
                }
                return;
            }
        }
    }
}

/// Stops a watchdog thread.
#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl Stop {
    /// Wait up to `d`; whether the watchdog must stop.
    fn wait(&self, d: Duration) -> bool {
        let g = lock(&self.stopped);
        if *g {
            return true;
        }
        *self
            .cv
            .wait_timeout(g, d)
            .unwrap_or_else(|p| p.into_inner())
            .0
    }

    fn stop(&self) {
        *lock(&self.stopped) = true;
        self.cv.notify_all();
    }
}

fn spawn_watchdog(shared: &Arc<Shared>, stop: Arc<Stop>) {
    if !shared.config.watchdog_enabled() {
        return;
    }
    let weak: Weak<Shared> = Arc::downgrade(shared);
    let ctx = shared.ctx.clone();
    let interval = shared
        .config
        .watchdog_interval
        .max(Duration::from_millis(1));
    let spawned = std::thread::Builder::new()
        .name(format!("symmpool-watchdog-{}", shared.rank))
        .spawn(move || {
            let _ = ctx.bind_to_thread();
            drop(ctx);
            while !stop.wait(interval) {
                match weak.upgrade() {
                    Some(s) => s.tick(),
                    None => break,
                }
            }
        });
    if let Err(e) = spawned {
        tracing::error!(
            "symmpool: could not start the NCCL watchdog ({e}); collectives are not watched"
        );
    }
}

/// The communicators a backend makes, for NCCL `version` and `config`.
fn roles_for(version: NcclVersion, config: &NcclConfig) -> Vec<CommInfo> {
    let mut roles = vec![CommInfo::SYMMETRIC];
    if config.copy_engine && version >= NcclVersion::COPY_ENGINE {
        roles.push(CommInfo::COPY_ENGINE);
    }
    if config.plain {
        roles.push(CommInfo::PLAIN);
    }
    roles
}

/// The CTA policy NCCL will apply: `NCCL_CTA_POLICY` in the environment overrides the
/// config (NCCL `init.cc`, "Comm config CTAPolicy reset to NCCL_CTA_POLICY").
fn effective_policy(requested: i32) -> i32 {
    match std::env::var("NCCL_CTA_POLICY")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("2") | Some("ZERO") => ffi::NCCL_CTA_POLICY_ZERO,
        Some("0") | Some("DEFAULT") => ffi::NCCL_CTA_POLICY_DEFAULT,
        Some("1") | Some("EFFICIENCY") => 1,
        _ => requested,
    }
}

fn effective(info: CommInfo) -> CommInfo {
    CommInfo {
        cta_policy: effective_policy(info.cta_policy),
        ..info
    }
}

/// One rank of NCCL: a device context and its communicators. Segments and windows
/// belong to the pools (as owned handles); this type keeps no table of them.
///
/// Make it with [`NcclBackend::from_env`] (one process per GPU),
/// [`NcclBackend::adopt`] (a runtime's communicator), [`NcclBackend::local_world`]
/// (one thread per GPU) or [`NcclBackend::from_raw`]. All return [`Backend`]s; reach
/// this type again through [`Backend::downcast_ref`]. See the [module](self) for the
/// deadlines and the watchdog.
pub struct NcclBackend {
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    /// Registrations made per communicator (window ordinals).
    ordinals: Mutex<Vec<u64>>,
    fences: Mutex<FenceTable>,
    /// Streams adopted from raw handles, by handle: one [`StreamId`] per raw stream.
    raw_streams: Mutex<HashMap<usize, Stream>>,
    stop: Arc<Stop>,
}

impl fmt::Debug for NcclBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclBackend")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.shared.ctx.ordinal())
            .field("comms", &self.shared.comms.len())
            .field("broken", &self.shared.health.is_broken())
            .finish()
    }
}

impl NcclBackend {
    /// When a host wait on this device's work gives up: `NcclConfig::call_timeout`
    /// from now.
    fn deadline(&self) -> Instant {
        let now = Instant::now();
        crate::control::deadline_after(now, self.shared.config.call_timeout)
    }

    /// This process's rank of a job launched with one process per GPU: the device is
    /// [`NcclConfig::device`], else the launcher's local rank (`LOCAL_RANK`,
    /// `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`), else 0 when the process sees a
    /// single GPU. Rank 0 creates one `ncclUniqueId` per communicator and publishes
    /// them over `exchange` (channel `"nccl:setup"`, with every rank's NCCL version and
    /// node identity); every rank then creates its communicators, non-blocking, each
    /// within [`NcclConfig::setup_timeout`].
    ///
    /// # Collective
    /// Every rank of `exchange` calls it at the same point with the same `config`
    /// (but for `device`).
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`] without a driver or NCCL; [`Error::NcclTooOld`]
    /// before NCCL 2.27; [`Error::InvalidConfig`] for no usable device, ranks on
    /// different NCCL versions or configurations; the exchange's errors
    /// ([`Error::Timeout`], [`Error::PeerLost`]); [`Error::NcclTimeout`] if a
    /// communicator is not made in time; [`Error::Cuda`] / [`Error::Nccl`].
    pub fn from_env(exchange: Arc<dyn Exchange>, config: NcclConfig) -> Result<Backend> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        let visible = device_count()?;
        let local = config::local_rank(&|k| std::env::var(k).ok());
        let device =
            config::pick_device(config.device, local, visible).map_err(Error::InvalidConfig)?;
        let ctx = context(device)?;
        let (rank, world) = (exchange.rank(), exchange.world_size());
        let roles = roles_for(version, &config);
        let ids = if rank == 0 {
            roles
                .iter()
                .map(|_| ffi::unique_id().map(Vec::from))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let hello = setup::Hello {
            version: version_code(version),
            node: setup::this_node(),
            unique_ids: ids,
        };
        let agreed = setup::agree(exchange.as_ref(), &hello, config.setup_timeout)?;
        if agreed.unique_ids.len() != roles.len() {
            return Err(Error::InvalidConfig(format!(
                "rank 0 creates {} communicators, this rank {} (ranks passed different NcclConfigs)",
                agreed.unique_ids.len(),
                roles.len()
            )));
        }
        let mut comms = Vec::with_capacity(roles.len());
        for (role, id) in roles.iter().zip(&agreed.unique_ids) {
            let started = Instant::now();
            let starting = ffi::comm_init(world, id, rank, role.cta_policy);
            comms.push(finish_creation(
                starting,
                "ncclCommInitRankConfig",
                started,
                config.setup_timeout,
            )?);
        }
        let infos = roles.into_iter().map(effective).collect();
        NcclBackend::assemble(
            rank,
            world,
            version,
            ctx,
            infos,
            comms,
            exchange,
            agreed.nodes,
            config,
        )
    }

    /// [`from_env`](Self::from_env) over a [`StoreExchange`] made from the environment
    /// ([`StoreExchange::from_env`]: torchrun's, slurm's or Open MPI's variables, with
    /// `MASTER_ADDR`/`MASTER_PORT`; rank 0 hosts the store).
    ///
    /// # Collective
    /// As [`from_env`](Self::from_env).
    ///
    /// # Errors
    /// As [`StoreExchange::from_env`] and [`from_env`](Self::from_env).
    pub fn launch(config: NcclConfig) -> Result<Backend> {
        let exchange: Arc<dyn Exchange> = Arc::new(StoreExchange::from_env()?);
        Self::from_env(exchange, config)
    }

    /// Adopt a runtime's communicator (for example PyTorch's
    /// `ProcessGroupNCCL._comm_ptr()`): the crate splits the communicators it needs from
    /// it (`ncclCommSplit(comm, 0, rank, ..)` with a non-blocking config carrying each
    /// role's CTA policy, resources not shared), each within
    /// [`NcclConfig::setup_timeout`]. The parent is only read and split, never
    /// destroyed or aborted by the crate; the children are the crate's own.
    ///
    /// `device` is the CUDA ordinal (as this process sees it) the communicator lives on.
    /// [`NcclConfig::device`] is ignored.
    ///
    /// # Collective
    /// Every rank of `comm` calls it at the same point (a split is collective on the
    /// parent), with the same `config`.
    ///
    /// # Safety
    /// - `comm` is a live `ncclComm_t` of the NCCL this crate loaded (inside PyTorch,
    ///   PyTorch's `libnccl.so.2` is found first; `SYMMPOOL_NCCL_LIBRARY` names another),
    ///   on CUDA device `device`;
    /// - it stays live for the duration of this call, and nothing else calls NCCL on it
    ///   (no collective of the runtime either) until this call returns;
    /// - `exchange` groups the same processes, with the same rank numbers, as `comm`.
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`], [`Error::NcclTooOld`]; [`Error::InvalidConfig`] if
    /// the communicator disagrees with the exchange on rank or size, or with `device`;
    /// the exchange's errors; [`Error::NcclTimeout`] if a split does not finish in time;
    /// [`Error::Nccl`] / [`Error::Cuda`].
    pub unsafe fn adopt(
        comm: ncclComm_t,
        device: usize,
        exchange: Arc<dyn Exchange>,
        config: NcclConfig,
    ) -> Result<Backend> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        let ctx = context(device)?;
        let parent = RawComm(comm);
        // SAFETY: the caller guarantees a live communicator nothing else uses now.
        let (rank, world, dev) = unsafe { ffi::comm_rank_size_device(parent) }?;
        if (rank, world) != (exchange.rank(), exchange.world_size()) || dev != device {
            return Err(Error::InvalidConfig(format!(
                "the communicator is rank {rank} of {world} on device {dev}; the exchange rank {} of {}, the device given {device}",
                exchange.rank(),
                exchange.world_size()
            )));
        }
        let hello = setup::Hello {
            version: version_code(version),
            node: setup::this_node(),
            unique_ids: Vec::new(),
        };
        let agreed = setup::agree(exchange.as_ref(), &hello, config.setup_timeout)?;
        let roles = roles_for(version, &config);
        let mut comms = Vec::with_capacity(roles.len());
        for role in &roles {
            let started = Instant::now();
            // SAFETY: the caller guarantees the parent is live and used by nobody else
            // during this call; every rank splits the same roles in the same order
            // (same version, checked by the exchange round, and the same config).
            let starting = unsafe { ffi::comm_split(parent, rank, role.cta_policy) };
            comms.push(finish_creation(
                starting,
                "ncclCommSplit",
                started,
                config.setup_timeout,
            )?);
        }
        let infos = roles.into_iter().map(effective).collect();
        NcclBackend::assemble(
            rank,
            world,
            version,
            ctx,
            infos,
            comms,
            exchange,
            agreed.nodes,
            config,
        )
    }

    /// One backend per listed GPU of this process, in rank order: rank `i` drives
    /// device `devices[i]`. Communicators are created non-blocking from one thread per
    /// rank with a shared `ncclUniqueId` per communicator. Hand each backend to its own
    /// thread. [`NcclConfig::device`] is ignored.
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`] without a driver or NCCL; [`Error::NcclTooOld`]
    /// before NCCL 2.27; [`Error::InvalidConfig`] for no devices, a device listed twice
    /// or one that is not present; [`Error::NcclTimeout`]; [`Error::Cuda`] /
    /// [`Error::Nccl`] from initialisation.
    pub fn local_world(devices: &[usize], config: NcclConfig) -> Result<Vec<Backend>> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        if devices.is_empty() {
            return Err(Error::InvalidConfig("no devices".into()));
        }
        let mut sorted = devices.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != devices.len() {
            return Err(Error::InvalidConfig("a device is listed twice".into()));
        }
        let roles = roles_for(version, &config);
        let ids = roles
            .iter()
            .map(|_| ffi::unique_id())
            .collect::<Result<Vec<_>>>()?;
        let n = devices.len();
        let exchanges = LocalExchange::group(n);
        // Every context first: a device that fails here fails the call before any rank
        // starts a communicator.
        let contexts = devices
            .iter()
            .map(|&dev| context(dev))
            .collect::<Result<Vec<_>>>()?;
        let results: Vec<Result<Backend>> = std::thread::scope(|s| {
            let handles: Vec<_> = contexts
                .into_iter()
                .zip(exchanges)
                .enumerate()
                .map(|(rank, (ctx, exchange))| {
                    let (roles, ids) = (&roles, &ids);
                    s.spawn(move || -> Result<Backend> {
                        ctx.bind_to_thread().map_err(ffi::cuda("cuCtxSetCurrent"))?;
                        let mut comms = Vec::new();
                        for (role, id) in roles.iter().zip(ids) {
                            let started = Instant::now();
                            let starting = ffi::comm_init(n, id, rank, role.cta_policy);
                            comms.push(finish_creation(
                                starting,
                                "ncclCommInitRankConfig",
                                started,
                                config.setup_timeout,
                            )?);
                        }
                        let infos = roles.iter().copied().map(effective).collect();
                        NcclBackend::assemble(
                            rank,
                            n,
                            version,
                            ctx,
                            infos,
                            comms,
                            Arc::new(exchange),
                            1,
                            config,
                        )
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::Internal {
                            what: "a rank's initialisation thread panicked".into(),
                        })
                    })
                })
                .collect()
        });
        results.into_iter().collect()
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        rank: usize,
        world: usize,
        version: NcclVersion,
        ctx: Arc<CudaContext>,
        infos: Vec<CommInfo>,
        comms: Vec<Comm>,
        exchange: Arc<dyn Exchange>,
        nodes: usize,
        config: NcclConfig,
    ) -> Result<Backend> {
        let info = BackendInfo::new(
            BackendKind::Nccl,
            rank,
            world,
            version,
            ffi::segment_granularity(ctx.ordinal()),
            infos,
        )?
        .with_nodes(nodes);
        let n = comms.len();
        let shared = Arc::new(Shared {
            rank,
            ctx,
            comms,
            health: Health::default(),
            watch: Mutex::new(Watch::default()),
            config,
        });
        let stop = Arc::new(Stop::default());
        spawn_watchdog(&shared, stop.clone());
        let parts = Arc::new(NcclBackend {
            rank,
            world,
            shared,
            ordinals: Mutex::new(vec![0; n]),
            fences: Mutex::new(FenceTable::default()),
            raw_streams: Mutex::new(HashMap::new()),
            stop,
        });
        Backend::new(info, exchange, parts)
    }

    /// Adopt communicators as they are (tests, interop): each with its role and the CTA
    /// policy it was created with, in the order segments are to be registered; every
    /// rank passes the same list. The backend never destroys or aborts them.
    ///
    /// Deadlines apply only to non-blocking communicators: a call on a **blocking** one
    /// (NCCL's default) waits as long as NCCL does, possibly forever, and a watchdog
    /// expiry marks the backend broken without ending the stuck collective. Prefer
    /// [`adopt`](Self::adopt), which splits non-blocking communicators off a runtime's.
    ///
    /// # Collective
    /// Every rank calls it at the same point (one exchange round, then
    /// [`Backend::new`]).
    ///
    /// # Safety
    /// - every handle is a live `ncclComm_t` of the NCCL this crate loaded, on CUDA
    ///   device `device`, and all have the same rank and size;
    /// - it stays live until this backend is dropped;
    /// - while this backend exists, nothing else calls NCCL on these communicators
    ///   concurrently with it (NCCL communicators are not thread-safe);
    /// - a communicator listed with role `CopyEngine` was created with
    ///   `CTAPolicy = NCCL_CTA_POLICY_ZERO` (else the reported path is wrong).
    ///
    /// # Errors
    /// [`Error::LibraryUnavailable`], [`Error::NcclTooOld`], [`Error::InvalidConfig`]
    /// if the communicators disagree on rank, size or device, or the exchange on rank or
    /// size; the exchange's errors.
    pub unsafe fn from_raw(
        device: usize,
        comms: Vec<(ncclComm_t, CommRole, i32)>,
        exchange: Arc<dyn Exchange>,
        config: NcclConfig,
    ) -> Result<Backend> {
        let version = ffi::load()?;
        ffi::require(version, NcclVersion::WINDOWS, "symmetric windows")?;
        let ctx = context(device)?;
        let mut rank_size = None;
        let mut infos = Vec::new();
        let mut adopted = Vec::new();
        for (raw, role, policy) in comms {
            let raw = RawComm(raw);
            // SAFETY: the caller guarantees a live communicator nobody else uses now.
            let (rank, size, dev) = unsafe { ffi::comm_rank_size_device(raw) }?;
            if *rank_size.get_or_insert((rank, size)) != (rank, size) || dev != device {
                return Err(Error::InvalidConfig(
                    "communicators differ in rank or size, or are not on the device given".into(),
                ));
            }
            infos.push(CommInfo {
                role,
                cta_policy: effective_policy(policy),
                registers: role != CommRole::Plain,
            });
            adopted.push(Comm::new(raw, false));
        }
        let Some((rank, world)) = rank_size else {
            return Err(Error::InvalidConfig("no communicators".into()));
        };
        if (rank, world) != (exchange.rank(), exchange.world_size()) {
            return Err(Error::InvalidConfig(format!(
                "the communicators are rank {rank} of {world}, the exchange rank {} of {}",
                exchange.rank(),
                exchange.world_size()
            )));
        }
        let hello = setup::Hello {
            version: version_code(version),
            node: setup::this_node(),
            unique_ids: Vec::new(),
        };
        let agreed = setup::agree(exchange.as_ref(), &hello, config.setup_timeout)?;
        NcclBackend::assemble(
            rank,
            world,
            version,
            ctx,
            infos,
            adopted,
            exchange,
            agreed.nodes,
            config,
        )
    }

    /// The raw handle of communicator `comm` (index into
    /// [`BackendInfo::communicators`]), for calling NCCL directly beside the pool
    /// (benchmarks, interop); `None` if there is no such communicator or it was
    /// aborted.
    ///
    /// Using the handle is `unsafe` on the caller's side: NCCL calls on it must not
    /// overlap with this backend's (it serialises its own calls only), and it must not
    /// be used after the backend is dropped or broken.
    pub fn raw_comm(&self, comm: usize) -> Option<ncclComm_t> {
        let c = self.shared.comms.get(comm)?;
        (!lock(&c.state).aborted).then_some(c.raw.0)
    }

    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// The CUDA device ordinal.
    pub fn device(&self) -> usize {
        self.shared.ctx.ordinal()
    }

    /// The configuration the backend was made with.
    pub fn config(&self) -> &NcclConfig {
        &self.shared.config
    }

    /// `Ok` while the backend is usable; the error every later call gets once it is
    /// broken (a deadline passed, the watchdog fired, NCCL reported an error, or
    /// [`abort`](Self::abort) was called).
    ///
    /// # Errors
    /// [`Error::NcclWatchdog`] or [`Error::NcclAborted`].
    pub fn health(&self) -> Result<()> {
        self.shared.health.check()
    }

    /// Abort this rank's NCCL communicators now (for example when the application
    /// learnt of a lost peer elsewhere) and break the backend: later calls fail with
    /// [`Error::NcclAborted`] naming `reason`. Stuck collectives end. Local; returns at
    /// once: the aborts run on threads of their own (`ncclCommAbort` can block), and
    /// dropping the backend waits for them at most 10 s.
    pub fn abort(&self, reason: &str) {
        let _ = self.shared.fail(Cause::Failed(format!(
            "aborted by the application: {reason}"
        )));
    }

    /// A new non-blocking cudarc stream on this rank's device.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn cuda_stream(&self) -> Result<Arc<CudaStream>> {
        self.shared
            .ctx
            .new_stream()
            .map_err(ffi::cuda("cuStreamCreate"))
    }

    /// A [`Stream`] for a runtime's own CUDA stream (for example PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`), for runtimes without cudarc. The same
    /// raw handle always gives the same stream (the same [`StreamId`]), so buffers
    /// allocated through different calls on one raw stream never wait on each other.
    ///
    /// Prefer non-blocking streams: NCCL 2.28's copy-engine collectives fail on the
    /// legacy default stream (handle 0).
    ///
    /// # Safety
    /// `cu_stream` is a live stream of this backend's device, in its primary context
    /// (the one PyTorch and cudarc use), and it stays alive until this backend is
    /// dropped (its handle must not be destroyed and reused for another stream while
    /// the backend may still see it).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the stream belongs to another context; [`Error::Cuda`];
    /// the backend's error once it is broken.
    pub unsafe fn stream_from_raw(&self, cu_stream: CUstream) -> Result<Stream> {
        self.shared.health.check()?;
        let mut streams = lock(&self.raw_streams);
        if let Some(s) = streams.get(&(cu_stream as usize)) {
            return Ok(s.clone());
        }
        self.bind()?;
        // SAFETY: the caller guarantees a live stream handle.
        let ctx = unsafe { ffi::stream_context(cu_stream) }?;
        if ctx != self.shared.ctx.cu_ctx() {
            return Err(Error::InvalidConfig(format!(
                "the stream belongs to another CUDA context than the primary context of device {}",
                self.device()
            )));
        }
        // SAFETY: the stream belongs to this context (checked above) and the caller keeps
        // it alive as long as this backend, which holds every wrapper it hands out.
        let wrapped = unsafe { self.shared.ctx.wrap_borrowed_stream(cu_stream) };
        let stream = Stream::cuda(wrapped);
        streams.insert(cu_stream as usize, stream.clone());
        Ok(stream)
    }

    fn bind(&self) -> Result<()> {
        self.shared
            .ctx
            .bind_to_thread()
            .map_err(ffi::cuda("cuCtxSetCurrent"))
    }

    fn cuda_of<'s>(&self, stream: &'s Stream) -> Result<&'s Arc<CudaStream>> {
        stream.cuda_stream().ok_or(Error::WrongStream)
    }

    /// The device address of a region's first byte.
    fn ptr(region: &Region<'_>) -> Result<u64> {
        region.device_ptr().ok_or(Error::Internal {
            what: "a host segment reached the NCCL backend".into(),
        })
    }

    fn memory(segment: &Segment) -> Result<&NcclMemory> {
        segment.memory::<NcclMemory>().ok_or(Error::Internal {
            what: "a segment of another backend reached the NCCL backend".into(),
        })
    }

    /// Enqueue a collective: checks, the call under the communicator's mutex, polling
    /// of an `ncclInProgress` within the call timeout, then the watchdog's event.
    fn collective(
        &self,
        name: &'static str,
        a: &CollArgs<'_>,
        reduce: bool,
        enqueue: impl FnOnce(RawComm, u64, u64, &Arc<CudaStream>) -> Result<Status>,
    ) -> Result<()> {
        self.shared.health.check()?;
        a.check_counts(name, self.world, reduce)?;
        let send = Self::ptr(&a.send)?;
        let recv = Self::ptr(&a.recv)?;
        let cs = self.cuda_of(a.stream)?;
        self.bind()?;
        let config = &self.shared.config;
        let (_, waited) = self.shared.call(a.comm, name, config.call_timeout, |raw| {
            enqueue(raw, send, recv, cs)
        })?;
        self.shared.conclude(waited, name)?;
        if config.watchdog_enabled() && !ffi::is_capturing(cs)? {
            self.watch(name, a.comm, cs)?;
        }
        Ok(())
    }

    /// Record the event the watchdog waits for after a collective on `cs`.
    fn watch(&self, op: &'static str, comm: usize, cs: &Arc<CudaStream>) -> Result<()> {
        let spare = lock(&self.shared.watch).spare();
        let event = match spare {
            Some(e) => e,
            None => self
                .shared
                .ctx
                .new_event(None)
                .map_err(ffi::cuda("cuEventCreate"))?,
        };
        event.record(cs).map_err(ffi::cuda("cuEventRecord"))?;
        lock(&self.shared.watch).push(Enqueued {
            op,
            comm,
            at: Instant::now(),
            done: event,
        });
        Ok(())
    }
}

impl SegmentProvider for NcclBackend {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        self.shared.health.check()?;
        self.bind()?;
        let ptr = ffi::mem_alloc(size_bytes)?;
        Ok(Segment::new(Box::new(NcclMemory { ptr, size_bytes })))
    }

    unsafe fn register(&self, segment: &Segment, comm: usize) -> Result<Option<Window>> {
        self.shared.health.check()?;
        let mem = Self::memory(segment)?;
        self.bind()?;
        let op = "ncclCommWindowRegister";
        let (registering, waited) = self.shared.call(
            comm,
            op,
            self.shared.config.call_timeout,
            // SAFETY: `raw` is this backend's live communicator, held locked by `call`;
            // the segment is one whole ncclMemAlloc allocation of this device (from
            // `allocate`), and the caller guarantees it is not registered on this
            // communicator yet and that every rank registers in the same order.
            |raw| unsafe { ffi::window_register(raw, mem.ptr, mem.size_bytes) },
        )?;
        if !matches!(waited, Waited::Done) {
            registering.abandon();
            self.shared.conclude(waited, op)?;
            return Err(Error::Internal {
                what: "a registration neither finished nor failed".into(),
            });
        }
        let win = registering.finish();
        let mut ordinals = lock(&self.ordinals);
        ordinals[comm] += 1;
        Ok(win.map(|w| Window::new(comm, ordinals[comm], Box::new(w))))
    }

    unsafe fn deregister(&self, window: Window) -> std::result::Result<(), Refused<Window>> {
        let comm = window.comm();
        let ordinal = window.ordinal();
        let raw_window = match window.into_handle::<RawWindow>() {
            Ok(w) => *w,
            Err(window) => {
                return Err(Refused {
                    handle: window,
                    error: Error::Internal {
                        what: "a window of another backend reached the NCCL backend".into(),
                    },
                });
            }
        };
        let op = "ncclCommWindowDeregister";
        let handle = raw_window.0;
        let deadline = crate::control::deadline_after(Instant::now(), ABORT_WAIT);
        match self
            .shared
            .comms
            .get(comm)
            .and_then(|c| c.aborted_by(deadline))
        {
            // The window went with its communicator (ncclCommAbort releases it).
            Some(true) => return Ok(()),
            // The abort still runs and may still release this window: the caller must
            // not free the segment under it (it leaks it instead).
            Some(false) => {
                return Err(Refused {
                    handle: Window::new(comm, ordinal, Box::new(RawWindow(handle))),
                    error: Error::NcclAborted {
                        reason: format!(
                            "ncclCommAbort of communicator {comm} had not returned after {ABORT_WAIT:?}; the window and its segment are leaked"
                        ),
                    },
                });
            }
            None => {}
        }
        let result = self.bind().and_then(|()| {
            let (_, waited) = self.shared.call(
                comm,
                op,
                self.shared.config.call_timeout,
                // SAFETY: the window was registered on this communicator by `register`
                // (the caller's contract) and is consumed here; `raw` is live and held
                // locked by `call`; the caller guarantees no work uses it.
                |raw| unsafe { ffi::window_deregister(raw, RawWindow(handle)) },
            )?;
            self.shared.conclude(waited, op)
        });
        result.map_err(|error| Refused {
            handle: Window::new(comm, ordinal, Box::new(RawWindow(handle))),
            error,
        })
    }

    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        let ptr = match Self::memory(&segment) {
            Ok(m) => m.ptr,
            Err(error) => {
                return Err(Refused {
                    handle: segment,
                    error,
                });
            }
        };
        // An abort still running may still release a window on this memory (one being
        // registered when the backend broke is in no pool's list): never free under it.
        let deadline = crate::control::deadline_after(Instant::now(), ABORT_WAIT);
        if let Some(c) = self
            .shared
            .comms
            .iter()
            .position(|c| c.aborted_by(deadline) == Some(false))
        {
            return Err(Refused {
                handle: segment,
                error: Error::NcclAborted {
                    reason: format!(
                        "ncclCommAbort of communicator {c} had not returned after {ABORT_WAIT:?}; the segment is leaked"
                    ),
                },
            });
        }
        let result = self.bind().and_then(|()| {
            // SAFETY: the caller guarantees the segment came from `allocate` (so `ptr`
            // is an ncclMemAlloc pointer), that no window covers it and no work uses
            // it; it is consumed here, so freed once.
            unsafe { ffi::mem_free(ptr) }
        });
        result.map_err(|error| Refused {
            handle: segment,
            error,
        })
    }
}

impl StreamOps for NcclBackend {
    fn new_stream(&self) -> Result<Stream> {
        self.shared.health.check()?;
        Ok(Stream::cuda(self.cuda_stream()?))
    }

    fn record_fence(&self, stream: &Stream) -> Result<Fence> {
        let cs = self.cuda_of(stream)?;
        let mut t = lock(&self.fences);
        let event = match t.spare.pop() {
            Some(e) => e,
            None => self
                .shared
                .ctx
                .new_event(None)
                .map_err(ffi::cuda("cuEventCreate"))?,
        };
        event.record(cs).map_err(ffi::cuda("cuEventRecord"))?;
        let sid = stream.id();
        t.streams.entry(sid).or_insert_with(|| cs.clone());
        let next = t.next.entry(sid).or_insert(0);
        *next += 1;
        let fence = *next;
        t.events.insert((sid, fence), event);
        // Collect this stream's completed events once there are many: completion of
        // fence k means every earlier fence on the stream is complete too.
        let range = (sid, 0)..=(sid, u64::MAX);
        if t.events.range(range.clone()).count() > FENCES_PER_STREAM {
            let done = t
                .events
                .range(range)
                .rev()
                .find(|(_, e)| e.is_complete())
                .map(|(k, _)| k.1);
            if let Some(done) = done {
                let keep = t.events.split_off(&(sid, done + 1));
                let old = std::mem::replace(&mut t.events, keep);
                for ((s, f), e) in old {
                    if s == sid {
                        t.spare.push(e);
                    } else {
                        t.events.insert((s, f), e);
                    }
                }
                let w = t.done.entry(sid).or_insert(0);
                *w = (*w).max(done);
            }
        }
        Ok(Fence(fence))
    }

    fn wait_fence(&self, stream: &Stream, on: StreamId, fence: Fence) -> Result<()> {
        let cs = self.cuda_of(stream)?;
        let t = lock(&self.fences);
        if t.done.get(&on).is_some_and(|&d| fence.0 <= d) {
            return Ok(());
        }
        match t.events.get(&(on, fence.0)) {
            Some(e) => cs.wait(e).map_err(ffi::cuda("cuStreamWaitEvent")),
            // Only collected events are missing, and those are complete.
            None => Ok(()),
        }
    }

    fn completed_fence(&self, stream: StreamId) -> Result<Option<Fence>> {
        let t = lock(&self.fences);
        let range = (stream, 0)..=(stream, u64::MAX);
        let newest = t
            .events
            .range(range)
            .rev()
            .find(|(_, e)| e.is_complete())
            .map(|(k, _)| k.1);
        let collected = t.done.get(&stream).copied();
        Ok(newest.max(collected).map(Fence))
    }

    fn is_capturing(&self, stream: &Stream) -> Result<bool> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        ffi::is_capturing(cs)
    }

    fn drain(&self, deadline: Instant) -> Result<bool> {
        self.bind()?;
        // One event after everything enqueued so far on every stream that fenced.
        let streams: Vec<Arc<CudaStream>> = lock(&self.fences).streams.values().cloned().collect();
        let events = streams
            .iter()
            .map(|s| s.record_event(None).map_err(ffi::cuda("cuEventRecord")))
            .collect::<Result<Vec<CudaEvent>>>()?;
        // Poll, never block in the driver: a peer stuck in a collective would hold a
        // blocking synchronise forever.
        loop {
            if events.iter().all(CudaEvent::is_complete) {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

impl DataMover for NcclBackend {
    fn write(&self, region: Region<'_>, data: &[u8], stream: &Stream) -> Result<()> {
        let dst = Self::ptr(&region.sub(0, data.len() as u64)?)?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: `dst..dst+len` lies inside a live segment of this device (the region
        // is checked against its segment, which the caller's buffer keeps alive).
        unsafe { ffi::copy_to_device(dst, data, cs, self.deadline()) }
    }

    fn read(&self, region: Region<'_>, out: &mut [u8], stream: &Stream) -> Result<()> {
        let src = Self::ptr(&region.sub(0, out.len() as u64)?)?;
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        // SAFETY: as in `write`.
        unsafe { ffi::copy_to_host(src, out, cs, self.deadline()) }
    }

    fn time_ms(&self, stream: &Stream, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let cs = self.cuda_of(stream)?;
        self.bind()?;
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        f()?;
        let end = cs.record_event(timed).map_err(ffi::cuda("cuEventRecord"))?;
        ffi::wait_stream("timing device work", cs, self.deadline())?;
        start
            .elapsed_ms(&end)
            .map(f64::from)
            .map_err(ffi::cuda("cuEventElapsedTime"))
    }
}

impl Collectives for NcclBackend {
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        let (count, dt) = (a.count, ffi::dtype(a.dtype));
        self.collective("ncclAllGather", a, false, |raw, send, recv, cs| {
            // SAFETY: both regions lie inside live segments of this device (regions are
            // checked against their segments, which the caller's buffers keep alive),
            // with the sizes checked by `collective`; the pool keeps the segments until
            // the stream has passed (frees are fenced); `raw` is held locked.
            unsafe { ffi::all_gather(raw, send, recv, count, dt, cs.cu_stream() as _) }
        })
    }

    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        let (count, dt, op) = (a.count, ffi::dtype(a.dtype), ffi::red_op(a.op));
        self.collective("ncclReduceScatter", a, true, |raw, send, recv, cs| {
            // SAFETY: as in `all_gather`.
            unsafe { ffi::reduce_scatter(raw, send, recv, count, dt, op, cs.cu_stream() as _) }
        })
    }
}

impl Drop for NcclBackend {
    fn drop(&mut self) {
        // The pools released their segments and windows before this (they hold the
        // backend), each after draining for at most its own timeout. Everything here is
        // local: `ncclCommAbort` (not the collective destroy), which also ends NCCL
        // operations still in flight, as is left when a peer died.
        self.stop.stop();
        let _ = self.bind();
        lock(&self.fences).events.clear();
        lock(&self.shared.watch).clear();
        // With nothing in flight, wait (boundedly) for the aborts to release NCCL's
        // resources; with work still running (a stuck collective, a kernel that never
        // ends) the aborts wait for the device, so leave them to their thread at once.
        let idle = matches!(self.drain(Instant::now()), Ok(true));
        if !idle {
            tracing::warn!(
                "symmpool: rank {}: device work still in flight; aborting its communicators in the background",
                self.rank
            );
        }
        let (threads, wait) = if idle {
            (AbortThreads::One, ABORT_WAIT)
        } else {
            (AbortThreads::PerCommunicator, Duration::ZERO)
        };
        let deadline = crate::control::deadline_after(Instant::now(), wait);
        self.shared.abort_all(threads);
        // These aborts and any started earlier (by a timeout, the watchdog or an NCCL
        // error) get the same bound.
        let pending = (self.shared.comms.iter())
            .filter(|c| c.aborted_by(deadline) == Some(false))
            .count();
        if pending > 0 && idle {
            tracing::warn!(
                "symmpool: rank {}: {pending} ncclCommAbort calls had not returned after {wait:?}; they go on in the background and their communicators are leaked",
                self.rank
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_version_and_config() {
        let c = NcclConfig::default();
        assert_eq!(
            roles_for(NcclVersion::new(2, 28, 3), &c),
            CommInfo::STANDARD.to_vec()
        );
        assert_eq!(
            roles_for(NcclVersion::new(2, 27, 7), &c),
            vec![CommInfo::SYMMETRIC, CommInfo::PLAIN]
        );
        assert_eq!(
            roles_for(
                NcclVersion::new(2, 29, 0),
                &c.with_communicators(false, false)
            ),
            vec![CommInfo::SYMMETRIC]
        );
        assert_eq!(version_code(NcclVersion::new(2, 28, 9)), 22809);
        assert_eq!(
            NcclVersion::from_code(version_code(NcclVersion::new(2, 30, 3))),
            NcclVersion::new(2, 30, 3)
        );
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine without a driver every entry point returns LibraryUnavailable; on
        // a GPU machine they may succeed. Either way nothing panics.
        if ffi::driver_present() {
            return;
        }
        assert!(matches!(
            device_count(),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(
            nccl_version(),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(context(0), Err(Error::LibraryUnavailable { .. })));
        let ex: Arc<dyn Exchange> = Arc::new(LocalExchange::group(1).remove(0));
        assert!(matches!(
            NcclBackend::from_env(ex.clone(), NcclConfig::default()),
            Err(Error::LibraryUnavailable { .. })
        ));
        assert!(matches!(
            NcclBackend::local_world(&[0], NcclConfig::default()),
            Err(Error::LibraryUnavailable { .. })
        ));
        // SAFETY: fails before the handle is looked at (no driver).
        let adopted =
            unsafe { NcclBackend::adopt(std::ptr::null_mut(), 0, ex, NcclConfig::default()) };
        assert!(matches!(adopted, Err(Error::LibraryUnavailable { .. })));
    }
}
