//! A rank's communicators and what bounds their NCCL calls (the two kinds and the table
//! of waits: see the [module](super)). A call on a non-blocking communicator is polled
//! ([`poll`]); while a thread is inside NCCL on a blocking one, the communicator's
//! [`Gate`] says since when, in which call and until which deadline, for the watchdog.
//!
//! **Serialisation.** NCCL needs the calls on one communicator not to overlap
//! ("NCCL primitives are generally not thread-safe", user guide, *Thread Safety*). Each
//! communicator has one lock, `calls`, held across the call and taken only by the
//! backend's callers. The watchdog and the aborts never take it: they read and set the
//! gate, a second lock held only briefly (never across a call, but for the watchdog's
//! `ncclCommGetAsyncError`, which on a blocking communicator reads two fields).
//!
//! The little CUDA this layer touches is behind [`Device`], so that it runs in tests
//! on a fake NCCL and a fake device.

use super::config::NcclConfig;
use super::ffi::{self, CollCall, RawComm, RawWindow, Syms};
use super::health::{Cause, Completion, Enqueued, Health, Watch};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use cudarc::nccl::sys;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

mod abort;
use abort::*;
pub(super) use abort::{ABORT_WAIT, AbortThreads, abort_together};
mod poll;
pub(super) use poll::finish_creation;
use poll::{Waited, poll};

/// A function that binds the rank's device to the calling thread (best effort).
pub(super) type Binder = Arc<dyn Fn() + Send + Sync>;

/// The CUDA the communicator layer needs (its errors are [`Error::Cuda`]). The real one
/// is the primary context, `Arc<CudaContext>` (in `mod.rs`); tests use a fake.
pub(super) trait Device: Send + Sync + 'static {
    /// A stream work is enqueued on.
    type Stream: ?Sized + Sync;
    /// A completion marker the watchdog asks about.
    type Event: Completion + Send + 'static;
    /// The raw stream handle NCCL takes.
    fn raw_stream(&self, stream: &Self::Stream) -> sys::cudaStream_t;
    /// Whether `stream` is capturing a CUDA graph (`cuStreamIsCapturing`).
    fn capturing(&self, stream: &Self::Stream) -> Result<bool>;
    /// Record a completion event after the work enqueued on `stream` so far (reusing
    /// `spare` when given).
    fn record(&self, stream: &Self::Stream, spare: Option<Self::Event>) -> Result<Self::Event>;
    /// Wait until the work enqueued on `stream` so far is done, polling, by `deadline`;
    /// whether it finished.
    fn wait_idle(&self, stream: &Self::Stream, deadline: Deadline) -> Result<bool>;
    /// What binds this device to a thread (abort threads, the watchdog).
    fn binder(&self) -> Binder;
}

/// Who is inside NCCL on a communicator: the call, since when, and until when it may
/// stay (`None`: a collective, bounded by the watchdog's completion events instead).
#[derive(Clone, Copy)]
pub(super) struct Inside {
    pub(super) op: &'static str,
    pub(super) since: Instant,
    pub(super) deadline: Option<Deadline>,
}

/// A communicator's gate: whether it was aborted (no call may start after that), who
/// is inside NCCL on it, and whether its abort returned.
#[derive(Default)]
struct Gate {
    aborted: bool,
    inside: Option<Inside>,
    /// Its `ncclCommAbort` returned: what must not touch what the abort releases (its
    /// windows, and so their segments) waits for this.
    abort_returned: bool,
    /// Waits for the abort end here at the latest (`None`: not handed off yet):
    /// [`ABORT_WAIT`] after it was handed to a thread, at once if no thread could run
    /// it, so that a release of many windows does not wait for each in turn.
    give_up_at: Option<Deadline>,
}

/// What a communicator shares with the threads that abort it.
#[derive(Default)]
struct CommState {
    gate: Mutex<Gate>,
    /// Notified when a thread leaves NCCL, and when the abort returns.
    changed: Condvar,
}

impl CommState {
    /// Wait until nobody is inside NCCL on it, or `deadline`; whether it is free.
    fn wait_left(&self, deadline: Deadline) -> bool {
        let mut gate = self.gate.lock();
        self.changed
            .wait_while_until(&mut gate, |g| g.inside.is_some(), deadline.instant());
        gate.inside.is_none()
    }

    /// Wait until its abort returned, or `deadline` or the give-up time passes;
    /// whether it returned.
    fn wait_aborted(&self, deadline: Deadline) -> bool {
        let mut gate = self.gate.lock();
        let until = gate.give_up_at.map_or(deadline, |g| g.min(deadline));
        self.changed
            .wait_while_until(&mut gate, |g| !g.abort_returned, until.instant());
        gate.abort_returned
    }

    /// Waits for the abort give up `after` from now (it was handed to a thread, or no
    /// thread could run it).
    fn give_up_after(&self, after: Duration) {
        self.gate.lock().give_up_at = Some(Deadline::after(after));
    }

    /// The abort returned.
    fn abort_returned(&self) {
        self.gate.lock().abort_returned = true;
        self.changed.notify_all();
    }
}

/// One communicator: its handle, whether the crate made it (and so aborts it), whether
/// it is blocking, the lock its callers' NCCL calls hold, and its gate.
pub(super) struct Comm {
    pub(super) raw: RawComm,
    pub(super) owned: bool,
    pub(super) blocking: bool,
    nccl: &'static Syms,
    /// Held across every NCCL call of the backend's callers on it (see the module).
    pub(super) calls: Mutex<()>,
    state: Arc<CommState>,
    /// A registration on it returned a NULL window (logged once).
    null_window_seen: AtomicBool,
}

impl Comm {
    /// A communicator of `nccl`.
    pub(super) fn new(nccl: &'static Syms, raw: RawComm, owned: bool, blocking: bool) -> Self {
        Comm {
            raw,
            owned,
            blocking,
            nccl,
            calls: Mutex::new(()),
            state: Arc::default(),
            null_window_seen: AtomicBool::new(false),
        }
    }

    /// Mark a thread inside NCCL on it since `since`, unless it was aborted (`false`).
    fn enter(&self, op: &'static str, since: Instant, deadline: Option<Deadline>) -> bool {
        let mut gate = self.state.gate.lock();
        if gate.aborted {
            return false;
        }
        gate.inside = Some(Inside {
            op,
            since,
            deadline,
        });
        true
    }

    /// The thread left NCCL.
    fn leave(&self) {
        self.state.gate.lock().inside = None;
        self.state.changed.notify_all();
    }

    /// Whether it was aborted (or handed over for its abort).
    pub(super) fn is_aborted(&self) -> bool {
        self.state.gate.lock().aborted
    }

    /// Who is inside NCCL on it, if anyone.
    pub(super) fn inside(&self) -> Option<Inside> {
        self.state.gate.lock().inside
    }

    /// Run `f` with the handle while it is not aborted, holding the gate so that no
    /// abort starts meanwhile (for the watchdog's `ncclCommGetAsyncError`).
    pub(super) fn while_live<T>(&self, f: impl FnOnce(RawComm) -> T) -> Option<T> {
        let gate = self.state.gate.lock();
        (!gate.aborted).then(|| f(self.raw))
    }

    /// Run `f` (a split off this communicator, polled through it) holding its calls
    /// lock and marked as inside NCCL as `op`: two splits on one rank never overlap,
    /// and an abort waits (boundedly) for the thread to leave, as for any call. Fails
    /// with [`Error::NcclAborted`] if the communicator was aborted.
    pub(super) fn splitting<T>(
        &self,
        op: &'static str,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let _calls = self.calls.lock();
        if !self.enter(op, Instant::now(), None) {
            return Err(Error::NcclAborted {
                reason: format!("{op}: the communicator was aborted"),
            });
        }
        let out = f();
        self.leave();
        out
    }

    /// Mark it aborted, so that no NCCL call starts on it after this, and hand it over
    /// for `ncclCommAbort` if the crate made it and it was not marked before. Takes
    /// only the gate: a thread inside NCCL on it is not waited for here.
    fn take_for_abort(&self) -> Option<Taken> {
        let mut gate = self.state.gate.lock();
        (self.owned && !gate.aborted).then(|| {
            gate.aborted = true;
            Taken {
                nccl: self.nccl,
                raw: self.raw,
                blocking: self.blocking,
                state: self.state.clone(),
            }
        })
    }

    /// Abort it now on a thread of its own (if the crate made it and nobody did yet) and
    /// wait until `deadline` for that abort, or an earlier one, to return; whether it
    /// returned. For set-up, where nobody is inside NCCL on it.
    fn abort_and_wait(&self, deadline: Deadline) -> bool {
        let taken = self.take_for_abort().into_iter().collect();
        abort_off_thread(None, taken, AbortThreads::One);
        self.aborted_by(deadline).unwrap_or(false)
    }

    /// Whether it was aborted, and if so whether its abort returned by `deadline`.
    pub(super) fn aborted_by(&self, deadline: Deadline) -> Option<bool> {
        self.is_aborted().then(|| self.state.wait_aborted(deadline))
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Communicators made during a set-up that then failed end here (NCCL binds the
        // device itself in `ncclCommAbort`); the backend's own drop has marked the
        // others aborted already.
        abort_together([&*self]);
    }
}

/// How long an NCCL call may stay inside NCCL.
pub(super) enum Bound {
    /// A collective: the watchdog's completion events bound it (on a non-blocking
    /// communicator its enqueue is also polled until [`NcclConfig::call_timeout`]).
    Watchdog,
    /// Until this deadline (registration, deregistration, warm-up).
    By(Deadline),
}

/// What the backend and its watchdog share: the rank's communicators, the backend's
/// health, and the collectives the watchdog waits for.
pub(super) struct Shared<D: Device> {
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) device: D,
    pub(super) nccl: &'static Syms,
    /// The non-blocking control communicator (`None` for communicators given to
    /// [`from_raw`](super::NcclBackend::from_raw)).
    pub(super) control: Option<Comm>,
    /// The data communicators, in [`BackendInfo::communicators`](crate::backend::BackendInfo::communicators) order.
    pub(super) comms: Vec<Comm>,
    pub(super) health: Health,
    pub(super) watch: Mutex<Watch<D::Event>>,
    pub(super) config: NcclConfig,
}

impl<D: Device> Drop for Shared<D> {
    fn drop(&mut self) {
        // A backend's own drop has aborted every communicator already; what is left
        // here is a failed assembly's: abort them together, not one drop after another.
        abort_together(self.all_comms());
    }
}

impl<D: Device> Shared<D> {
    /// The deadline of one call that may wait on peers or on the device:
    /// [`NcclConfig::call_timeout`] from now.
    pub(super) fn call_deadline(&self) -> Deadline {
        Deadline::after(self.config.call_timeout)
    }

    /// Every communicator: the data ones, then the control one.
    pub(super) fn all_comms(&self) -> impl Iterator<Item = &Comm> {
        self.comms.iter().chain(self.control.iter())
    }

    /// Abort every communicator the crate made (once) and forget the watched events.
    /// Every later call on them fails at once; the aborts themselves run off this
    /// thread ([`abort_off_thread`]) and are not waited for here.
    pub(super) fn abort_all(&self, threads: AbortThreads) {
        let taken: Vec<_> = self.all_comms().filter_map(Comm::take_for_abort).collect();
        self.watch.lock().clear();
        abort_off_thread(Some(self.device.binder()), taken, threads);
    }

    /// Break the backend with `cause` (aborting the communicators if this is the first
    /// cause) and return the error for the call that found it.
    pub(super) fn fail(&self, cause: Cause) -> Error {
        if self.health.break_with(cause.clone()) {
            self.abort_all(AbortThreads::PerCommunicator);
            self.health.report(&cause, cause.op(), true)
        } else {
            self.health.error()
        }
    }

    /// The error of a call `op` that found the backend broken: [`Error::PeerLost`]
    /// when the exchange knows of a lost peer; [`Error::NcclTimeout`] when it broke
    /// because `op` itself ran past its deadline (the watchdog saw it inside NCCL);
    /// else the backend's error.
    pub(super) fn error_for(&self, op: &'static str) -> Error {
        match self.health.cause() {
            Some(c) => {
                let own = matches!(c, Cause::Timeout { op: o, .. } if *o == op);
                self.health.report(c, op, own)
            }
            None => self.health.error(),
        }
    }

    /// The error of a call `op` that failed (`e`). Once the backend is broken, the
    /// backend's error ([`error_for`](Self::error_for); `e` is only logged). Else
    /// argument errors are reported as they are; anything else means the
    /// communicator cannot be trusted, so the backend breaks, and the call reports the
    /// lost peer behind it when the exchange learns of one within
    /// [`PEER_VERDICT_WAIT`](super::health::PEER_VERDICT_WAIT) (a dead peer's connections
    /// fail NCCL's call too), else NCCL's error.
    fn failed(&self, op: &'static str, e: Error) -> Error {
        if self.health.is_broken() {
            tracing::debug!("symmpool: {op} failed after the backend broke: {e}");
            return self.error_for(op);
        }
        match &e {
            // ncclInvalidArgument, ncclInvalidUsage: nothing was started.
            Error::Nccl { code: 4 | 5, .. } => e,
            Error::Nccl { op, .. } => {
                let op = *op;
                let cause = self.health.failure(e.to_string());
                let lost = !matches!(cause, Cause::Failed(_));
                let _ = self.fail(cause);
                if lost { self.error_for(op) } else { e }
            }
            _ => e,
        }
    }

    /// Data communicator `c`, for the call `op` ([`Error::InvalidCollective`] if none).
    pub(super) fn comm(&self, c: usize, op: &'static str) -> Result<&Comm> {
        self.comms.get(c).ok_or_else(|| Error::InvalidCollective {
            op,
            detail: format!(
                "communicator index {c} is out of range: this NCCL backend has {} data communicators",
                self.comms.len()
            ),
        })
    }

    /// Run the NCCL call `start` on `comm`, holding its calls lock, from `now`. On a
    /// blocking communicator the call runs inline, marked in the gate with `bound`'s
    /// deadline for the watchdog; on a non-blocking one it is then polled until done or
    /// its deadline. What `start` returned is leaked, never dropped, when the call did
    /// not finish (NCCL may still write into it).
    fn call<S>(
        &self,
        comm: &Comm,
        op: &'static str,
        bound: Bound,
        now: Instant,
        start: impl FnOnce(RawComm) -> Result<S>,
    ) -> Result<S> {
        let until = || match bound {
            Bound::By(d) => d,
            Bound::Watchdog => self.call_deadline(),
        };
        // The deadline is read only when the lock is taken (rare: one thread drives a rank).
        let serial = comm.calls.try_lock();
        let Some(_serial) = serial.or_else(|| comm.calls.try_lock_until(until().instant())) else {
            return Err(if self.health.is_broken() {
                self.error_for(op)
            } else {
                Error::timeout_since(op, now, &[])
            });
        };
        let marker = match bound {
            Bound::By(d) if comm.blocking => Some(d),
            _ => None,
        };
        if !comm.enter(op, now, marker) {
            return Err(self.error_for(op));
        }
        let started = start(comm.raw);
        let waited = match &started {
            // SAFETY: the communicator is live (not aborted: checked in `enter`, and
            // aborts do not free it while we are inside) and we hold its calls lock.
            Ok(_) if !comm.blocking => unsafe {
                poll(self.nccl, comm.raw, op, until(), &|| {
                    self.health.is_broken().then_some(())
                })
            },
            _ => Waited::Done,
        };
        comm.leave();
        let s = started.map_err(|e| self.failed(op, e))?;
        let result = match waited {
            Waited::Done if comm.blocking && self.health.is_broken() => Err(self.error_for(op)),
            Waited::Done => return Ok(s),
            Waited::Failed(e) => Err(self.failed(op, e)),
            Waited::Timeout(waited) => Err(self.fail(Cause::Timeout { op, waited })),
            Waited::Broken(()) => Err(self.error_for(op)),
        };
        std::mem::forget(s);
        result
    }

    /// Enqueue one collective on data communicator `c` and `stream`: the NCCL call
    /// (inline on a blocking communicator) and, unless the watchdog is off or the
    /// stream is capturing a CUDA graph (see the [module](super), *CUDA graphs*), the
    /// completion event the watchdog looks at. Whether the stream captures is asked
    /// before the enqueue: once NCCL took the collective, nothing may fail the call
    /// (the other ranks would have no match for their next call). A collective that
    /// records no event is marked in the gate with [`NcclConfig::call_timeout`] as its
    /// deadline instead, so that an enqueue stuck inside NCCL is still ended.
    ///
    /// # Safety
    /// The addresses of `call` are live device memory of this rank, of the sizes the
    /// collective touches, that stays allocated until `stream` passes; `stream` is a
    /// live stream of the rank's device.
    pub(super) unsafe fn collective(
        &self,
        c: usize,
        call: &CollCall,
        stream: &D::Stream,
        bound: Bound,
    ) -> Result<()> {
        self.health.check()?;
        let op = call.name();
        let comm = self.comm(c, op)?;
        let raw_stream = self.device.raw_stream(stream);
        let watched = self.config.watchdog_enabled() && !self.device.capturing(stream)?;
        let now = Instant::now();
        let bound = match bound {
            Bound::Watchdog if !watched => {
                Bound::By(Deadline::after_from(now, self.config.call_timeout))
            }
            b => b,
        };
        self.call(comm, op, bound, now, |raw| {
            // SAFETY: the caller guarantees the buffers and the stream; `raw` is live
            // and `call` holds its calls lock.
            unsafe { ffi::collective(self.nccl, raw, call, raw_stream) }
        })?;
        if watched && let Err(e) = self.watch(op, c, stream, now) {
            // The collective is enqueued but unwatched: its completion can no longer be
            // bounded, and a caller who retried would run it twice. The backend is broken
            // (its communicators aborted), so every rank's next call fails instead of
            // diverging.
            let what = format!("{op} enqueued, but its completion event failed: {e}");
            return Err(self.fail(Cause::Failed(what)));
        }
        Ok(())
    }

    /// Record the event the watchdog waits for after a collective `op` on
    /// communicator `comm`, enqueued on `stream` at `at`. The watch list's lock is held
    /// across the record (the watchdog holds it only to swap the list out and back).
    fn watch(&self, op: &'static str, comm: usize, stream: &D::Stream, at: Instant) -> Result<()> {
        let mut watch = self.watch.lock();
        let event = self.device.record(stream, watch.spare.pop())?;
        watch.pending.push_back(Enqueued {
            op,
            comm,
            at,
            done: event,
        });
        Ok(())
    }

    /// Register `ptr..ptr + size_bytes` on data communicator `c` by `deadline`
    /// (collective: every rank, same order). `None`: NCCL answered with a NULL window
    /// (no symmetric memory on the communicator: NCCL 2.29+ across `NCCL_HOSTID`
    /// "nodes", for one), logged once per communicator; the segment is not registered
    /// there and its collectives take the plain path.
    ///
    /// # Safety
    /// The allocation is one whole `ncclMemAlloc` allocation of this rank's device,
    /// not registered on `c` yet.
    pub(super) unsafe fn register(
        &self,
        c: usize,
        ptr: u64,
        size_bytes: u64,
        deadline: Deadline,
    ) -> Result<Option<RawWindow>> {
        self.health.check()?;
        let op = "ncclCommWindowRegister";
        let comm = self.comm(c, op)?;
        let registering = self.call(comm, op, Bound::By(deadline), Instant::now(), |raw| {
            // SAFETY: `raw` is live and held by `call`; the caller guarantees the
            // allocation and the order.
            unsafe { ffi::window_register(self.nccl, raw, ptr, size_bytes) }
        })?;
        let window = registering.finish(comm.blocking);
        if window.is_none() && !comm.null_window_seen.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "symmpool: rank {}: NCCL returned a NULL window on data communicator {c} (no symmetric memory there, e.g. NCCL 2.29+ across NCCL_HOSTID nodes): its segments stay unregistered and their collectives take the plain path",
                self.rank
            );
        }
        Ok(window)
    }

    /// Deregister `window` from data communicator `c` by `deadline`, unless the
    /// communicator was aborted: then NCCL destroyed the window with it, and nothing is
    /// called once the abort returned (waited for until `deadline`, at most
    /// [`ABORT_WAIT`]; before that the window comes back with [`Error::NcclAborted`],
    /// to be leaked with its segment).
    ///
    /// # Safety
    /// `window` was registered on `c` (and is consumed); no device work uses it.
    pub(super) unsafe fn deregister(
        &self,
        c: usize,
        window: RawWindow,
        deadline: Deadline,
    ) -> std::result::Result<(), (RawWindow, Error)> {
        let op = "ncclCommWindowDeregister";
        let RawWindow(handle) = window;
        let back = |e| (RawWindow(handle), e);
        let comm = self.comm(c, op).map_err(back)?;
        match comm.aborted_by(deadline.cap(ABORT_WAIT)) {
            // The window went with its communicator (ncclCommAbort releases it).
            Some(true) => return Ok(()),
            Some(false) => {
                return Err(back(Error::NcclAborted {
                    reason: format!(
                        "ncclCommAbort of communicator {c} had not returned by the deadline (at most {ABORT_WAIT:?}); the window and its segment are leaked"
                    ),
                }));
            }
            None => {}
        }
        self.call(comm, op, Bound::By(deadline), Instant::now(), |raw| {
            // SAFETY: the caller's contract; `raw` is live and held by `call`.
            unsafe { ffi::window_deregister(self.nccl, raw, RawWindow(handle)) }
        })
        .map_err(back)
    }

    /// Whether segments may be freed: every abort started has returned (an abort still
    /// running may still release a window on the memory). `Err` names the one still
    /// running after [`ABORT_WAIT`].
    pub(super) fn may_free(&self) -> Result<()> {
        let deadline = Deadline::after(ABORT_WAIT);
        match (self.comms.iter()).position(|c| c.aborted_by(deadline) == Some(false)) {
            Some(c) => Err(Error::NcclAborted {
                reason: format!(
                    "ncclCommAbort of communicator {c} had not returned after {ABORT_WAIT:?}; the segment is leaked"
                ),
            }),
            None => Ok(()),
        }
    }
}
