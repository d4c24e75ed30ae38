//! Aborting communicators: off the calling thread, bounded, revoking first where NCCL
//! has `ncclCommRevoke`, and telling the windows' owners when an abort has returned.

use super::*;

/// A communicator handed over for its abort.
pub(super) struct Taken {
    pub(super) nccl: &'static Syms,
    pub(super) raw: RawComm,
    pub(super) blocking: bool,
    pub(super) state: Arc<CommState>,
}

/// How long a drop, or a communicator made during a failed set-up, waits for its
/// aborts before leaving them to their thread.
pub(in crate::backend::nccl) const ABORT_WAIT: Duration = Duration::from_secs(10);

/// How long an abort thread waits, after `ncclCommRevoke`, for the thread inside NCCL
/// on the communicator to leave before it aborts all the same.
pub(in crate::backend::nccl) const LEAVE_WAIT: Duration = Duration::from_millis(500);

/// How [`abort_off_thread`] spreads its aborts over threads.
#[derive(Clone, Copy, PartialEq)]
pub(in crate::backend::nccl) enum AbortThreads {
    /// One thread, the communicators one after another, no revoke: a teardown with no
    /// device work in flight and nobody inside NCCL (what ran in the two-GPU trials
    /// with ranks as threads; one thread per communicator there was not shown to be safe).
    One,
    /// A thread per communicator, started together; blocking ones are revoked first:
    /// device work may be stuck, a thread may be inside NCCL.
    PerCommunicator,
    /// A thread per communicator, started together, no revoke: a failed set-up, where
    /// nobody is inside NCCL on them but an abort may wait for the device.
    Apart,
}

/// Abort `comms` (those the crate made and nobody aborted yet) together, a thread
/// each, and wait for those aborts until one shared deadline, [`ABORT_WAIT`] from now:
/// the cleanup of a failed set-up, which must not wait [`ABORT_WAIT`] per
/// communicator in turn.
pub(in crate::backend::nccl) fn abort_together<'a>(comms: impl IntoIterator<Item = &'a Comm>) {
    let taken: Vec<_> = comms.into_iter().filter_map(Comm::take_for_abort).collect();
    let states: Vec<_> = taken.iter().map(|t| t.state.clone()).collect();
    abort_off_thread(None, taken, AbortThreads::Apart);
    let deadline = Deadline::after(ABORT_WAIT);
    let pending = states.iter().filter(|s| !s.wait_aborted(deadline)).count();
    if pending > 0 {
        tracing::warn!(
            "symmpool: {pending} ncclCommAbort calls of a failed set-up had not returned after {ABORT_WAIT:?}; their communicators are leaked"
        );
    }
}

/// How often [`revoke_then_abort`] revokes again while a thread is still marked inside
/// NCCL on the communicator.
pub(super) const REVOKE_AGAIN: Duration = Duration::from_millis(20);

/// Revoke (where `revoke` and NCCL has it), wait for the owner to leave, abort.
///
/// A thread is marked inside (in its gate) just before it calls into NCCL, so one
/// revoke may end before that thread's call starts; and `ncclCommRevoke` clears NCCL's
/// abort flags when it is done, so that call would then block. So the revoke is
/// repeated, every [`REVOKE_AGAIN`], until the thread left or [`LEAVE_WAIT`] passed.
pub(super) fn revoke_then_abort(t: &Taken, revoke: bool) {
    if revoke && t.blocking {
        let until = Deadline::after(LEAVE_WAIT);
        loop {
            // SAFETY: the crate made this communicator and it is not aborted yet (this
            // thread runs its abort, after this); another thread may be inside NCCL on
            // it, which is what revoking is for.
            match unsafe { ffi::comm_revoke(t.nccl, t.raw) } {
                Ok(true) => {}
                Ok(false) => {
                    if t.state.gate.lock().inside.is_some() {
                        tracing::warn!(
                            "symmpool: NCCL has no ncclCommRevoke (< 2.28.7): aborting a communicator a thread is inside of"
                        );
                    }
                    break;
                }
                Err(e) => {
                    tracing::error!("symmpool: ncclCommRevoke failed: {e}");
                    break;
                }
            }
            if t.state.wait_left(until.cap(REVOKE_AGAIN)) {
                break;
            }
            if until.expired() {
                tracing::warn!(
                    "symmpool: a thread was still inside NCCL {LEAVE_WAIT:?} after ncclCommRevoke; aborting all the same"
                );
                break;
            }
        }
    }
    // SAFETY: `take_for_abort` handed the communicator over once, for a communicator
    // the crate made, and marked it aborted under its gate, so no call starts on it
    // later. On a blocking communicator with `ncclCommRevoke`, a thread inside NCCL on
    // it was revoked out (again, until it left) and seen leaving above; otherwise
    // (no `ncclCommRevoke`, a failed revoke, or still inside after `LEAVE_WAIT`) this is
    // the documented race of aborting a blocking communicator from another thread.
    // Its windows are deregistered by nobody but this abort (`deregister` waits for
    // `done`), so their segments stay mapped.
    if let Err(e) = unsafe { ffi::comm_abort(t.nccl, t.raw) } {
        tracing::error!("symmpool: ncclCommAbort failed: {e}");
    }
    t.state.abort_returned();
}

/// Abort `comms` (from [`Comm::take_for_abort`]) off the calling thread (each thread
/// binds the device first); each marks its communicator's gate when its abort
/// returned, which is what callers wait on, boundedly.
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
pub(super) fn abort_off_thread(bind: Option<Binder>, comms: Vec<Taken>, threads: AbortThreads) {
    if comms.is_empty() {
        return;
    }
    exit_waits_for_aborts();
    let revoke = threads == AbortThreads::PerCommunicator;
    let batches: Vec<_> = match threads {
        AbortThreads::One => vec![comms],
        AbortThreads::PerCommunicator | AbortThreads::Apart => {
            comms.into_iter().map(|c| vec![c]).collect()
        }
    };
    for batch in batches {
        for t in &batch {
            t.state.give_up_after(ABORT_WAIT);
        }
        let running = Running::start();
        let states: Vec<_> = batch.iter().map(|t| t.state.clone()).collect();
        let bind = bind.clone();
        let spawned = std::thread::Builder::new()
            .name("symmpool-abort".into())
            .spawn(move || {
                if let Some(bind) = bind {
                    bind();
                }
                let _running = running;
                for t in &batch {
                    revoke_then_abort(t, revoke);
                }
            });
        if let Err(e) = spawned {
            states.iter().for_each(|s| s.give_up_after(Duration::ZERO));
            tracing::error!(
                "symmpool: could not start an abort thread ({e}); communicators leaked"
            );
        }
    }
}

/// Abort threads that have not returned yet.
static RUNNING: Mutex<usize> = Mutex::new(0);

/// One abort thread counted in [`RUNNING`] until dropped (when the thread ends, even
/// by a panic, or when it could not be started).
struct Running;

impl Running {
    fn start() -> Running {
        *RUNNING.lock() += 1;
        Running
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        *RUNNING.lock() -= 1;
        FINISHED.notify_all();
    }
}
/// Notified each time an abort thread returns.
static FINISHED: Condvar = Condvar::new();

/// Make the process's exit wait, for at most [`ABORT_WAIT`], for the abort threads
/// still running (registered once, at the first abort handed to a thread).
///
/// A process that returns from `main` while an `ncclCommAbort` runs on another thread
/// tears down the CUDA driver and NCCL under it (seen on one H200 with NCCL 2.28.3: a
/// SIGSEGV at exit, one run in seven, after a drop left its aborts to their threads
/// because a stream was stuck). `atexit` handlers run in the reverse order of their
/// registration, so this one, registered after CUDA and NCCL were loaded, runs before
/// theirs. An abort that never returns (NVIDIA/nccl issue 1777) holds the exit up for
/// [`ABORT_WAIT`] at most.
fn exit_waits_for_aborts() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        if !ffi::at_exit(wait_for_aborts_at_exit) {
            tracing::warn!("symmpool: atexit failed; an exit during an abort may crash");
        }
    });
}

extern "C" fn wait_for_aborts_at_exit() {
    let deadline = Deadline::after(ABORT_WAIT);
    let mut running = RUNNING.lock();
    FINISHED.wait_while_until(&mut running, |n| *n > 0, deadline.instant());
}
