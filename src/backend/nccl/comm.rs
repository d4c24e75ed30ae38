//! A rank's communicators: each with the mutex its NCCL calls hold, the polling of
//! non-blocking calls against a [`Deadline`], and the abort machinery
//! (`ncclCommAbort` on threads of its own, waited for boundedly). See the
//! [module](super) for the rules.

use super::config::NcclConfig;
use super::ffi::{self, RawComm, Status};
use super::health::{Cause, Health, Watch, poll_until};
use crate::Deadline;
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One communicator: its handle, whether the crate made it (and so aborts it), and
/// the mutex every NCCL call on it holds.
pub(super) struct Comm {
    pub(super) raw: RawComm,
    pub(super) owned: bool,
    pub(super) state: Mutex<CommState>,
    /// Set by the thread that runs its `ncclCommAbort` once that returned.
    abort_done: Arc<AbortDone>,
}

pub(super) struct CommState {
    /// `ncclCommAbort` was handed to a thread (or has run): no call may start on it.
    pub(super) aborted: bool,
}

/// Whether a communicator's `ncclCommAbort` has returned, for those that must not
/// touch what the abort releases before then (its windows, and so their segments).
/// Its waits share one deadline, [`ABORT_WAIT`] after the abort was handed off: past
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
    give_up_at: Option<Deadline>,
}

impl AbortDone {
    /// The abort was handed to a thread now.
    fn handed_off(&self) {
        self.state.lock().give_up_at = Some(Deadline::after(ABORT_WAIT));
    }

    /// No thread will run the abort: waits give up at once.
    fn abandoned(&self) {
        self.state.lock().give_up_at = Some(Deadline::after(Duration::ZERO));
    }

    fn set(&self) {
        self.state.lock().done = true;
        self.cv.notify_all();
    }

    /// Wait until the abort returned, `deadline` or its own give-up time passes;
    /// whether it returned.
    fn wait(&self, deadline: Deadline) -> bool {
        let mut st = self.state.lock();
        let until = st.give_up_at.map_or(deadline, |g| g.min(deadline));
        self.cv
            .wait_while_until(&mut st, |st| !st.done, until.instant());
        st.done
    }
}

impl Comm {
    pub(super) fn new(raw: RawComm, owned: bool) -> Self {
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
        let mut state = self.state.lock();
        if self.owned && !state.aborted {
            state.aborted = true;
            Some((self.raw, self.abort_done.clone()))
        } else {
            None
        }
    }

    /// Whether it was aborted, and if so whether its abort returned by `deadline`.
    pub(super) fn aborted_by(&self, deadline: Deadline) -> Option<bool> {
        if !self.state.lock().aborted {
            return None;
        }
        Some(self.abort_done.wait(deadline))
    }
}

/// How long a drop, or a communicator made during a failed set-up, waits for its
/// aborts before leaving them to their thread.
pub(super) const ABORT_WAIT: Duration = Duration::from_secs(10);

/// How [`abort_off_thread`] spreads its aborts over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AbortThreads {
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
            if !done.wait(Deadline::after(ABORT_WAIT)) {
                tracing::warn!(
                    "symmpool: ncclCommAbort of a communicator from a failed set-up had not returned after {ABORT_WAIT:?}; it is leaked"
                );
            }
        }
    }
}

/// How polling a non-blocking call ended.
#[derive(Debug)]
pub(super) enum Waited {
    Done,
    Failed(Error),
    /// The deadline passed after polling this long.
    Timeout(Duration),
    Broken,
}

/// Poll a non-blocking call on `comm` until it is done, fails, `deadline` passes, or
/// `broken()` says to stop.
///
/// # Safety
/// `comm` is live and the caller has exclusive use of it (holds its mutex, or made it
/// and shares it with nobody yet).
unsafe fn poll(
    comm: RawComm,
    op: &'static str,
    deadline: Deadline,
    broken: &dyn Fn() -> bool,
) -> Waited {
    // A call that answered `ncclSuccess` may still be running: on a non-blocking
    // communicator NCCL 2.28 ends calls such as `ncclCommWindowRegister` with an
    // internal group end whose `ncclInProgress` it does not return, and writes the
    // window handle when the job finishes. So the communicator's asynchronous state is
    // always read until it is no longer in progress (seen on NCCL 2.28.3: a NULL window
    // read too early, then a late write into freed memory).
    let started = Instant::now();
    let answer = poll_until(deadline, || {
        // SAFETY: the caller's contract.
        let state = unsafe { ffi::async_state(op, comm) };
        match state {
            Ok(Status::Done) => Some(Waited::Done),
            Ok(Status::InProgress) => broken().then_some(Waited::Broken),
            Err(e) => Some(Waited::Failed(e)),
        }
    });
    answer.unwrap_or_else(|| Waited::Timeout(started.elapsed()))
}

/// Finish making a communicator: poll it until `deadline` (no backend exists yet),
/// abort it on failure.
pub(super) fn finish_creation(
    starting: Result<ffi::Starting>,
    op: &'static str,
    deadline: Deadline,
) -> Result<Comm> {
    let starting = starting?;
    // SAFETY: the communicator was just made by this thread and is shared with nobody.
    match unsafe { poll(starting.comm, op, deadline, &|| false) } {
        Waited::Done => Ok(Comm::new(starting.finish(), true)),
        Waited::Failed(e) => {
            // Dropping the `Comm` aborts it; the call has ended, so the boxes are free.
            drop(Comm::new(starting.finish(), true));
            Err(e)
        }
        timeout => {
            // The abort ends NCCL's work on it; the boxes are leaked all the same.
            drop(Comm::new(starting.abandon(), true));
            // (`Broken` cannot happen here: nothing breaks a communicator being made.)
            let waited = match timeout {
                Waited::Timeout(waited) => waited,
                _ => Duration::ZERO,
            };
            Err(Error::NcclTimeout { op, waited })
        }
    }
}

/// What the backend and its watchdog share: the rank's communicators, the backend's
/// health, and the collectives the watchdog waits for.
pub(super) struct Shared {
    pub(super) rank: usize,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) comms: Vec<Comm>,
    pub(super) health: Health,
    pub(super) watch: Mutex<Watch<CudaEvent>>,
    pub(super) config: NcclConfig,
}

impl Shared {
    /// The deadline of one call that may wait on peers or on the device:
    /// [`NcclConfig::call_timeout`] from now.
    pub(super) fn call_deadline(&self) -> Deadline {
        Deadline::after(self.config.call_timeout)
    }

    /// Abort every communicator the crate made (once) and forget the watched events.
    /// Every later call on them fails at once; the aborts themselves run off this
    /// thread ([`abort_off_thread`]) and are not waited for here.
    pub(super) fn abort_all(&self, threads: AbortThreads) {
        let taken: Vec<_> = self.comms.iter().filter_map(Comm::take_for_abort).collect();
        self.watch.lock().clear();
        abort_off_thread(Some(self.ctx.clone()), taken, threads);
    }

    /// Break the backend with `cause` (aborting the communicators if this is the first
    /// cause) and return the error for the call that found it.
    pub(super) fn fail(&self, cause: Cause) -> Error {
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
                let _ = self.fail(Cause::Failed(e.to_string()));
                e
            }
            _ => e,
        }
    }

    /// The result of a poll, once the communicator's mutex is released.
    pub(super) fn conclude(&self, waited: Waited, op: &'static str) -> Result<()> {
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
        let guard = c.state.lock();
        if guard.aborted {
            return Err(self.health.error());
        }
        Ok(guard)
    }

    /// Run the NCCL call `start` on communicator `c` and poll it to completion by
    /// `deadline`; `start` gets the handle with the mutex held.
    pub(super) fn call<S>(
        &self,
        c: usize,
        op: &'static str,
        deadline: Deadline,
        start: impl FnOnce(RawComm) -> Result<S>,
    ) -> Result<(S, Waited)> {
        let comm = self.comm(c)?;
        let guard = self.lock_live(comm)?;
        let s = match start(comm.raw) {
            Ok(s) => s,
            Err(e) => {
                drop(guard);
                return Err(self.on_error(e));
            }
        };
        // SAFETY: the communicator is live (not aborted) and we hold its mutex.
        let waited = unsafe { poll(comm.raw, op, deadline, &|| self.health.is_broken()) };
        drop(guard);
        Ok((s, waited))
    }
}
