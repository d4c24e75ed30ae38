//! Non-blocking calls: polling one until it is done, and finishing a communicator's
//! creation (polled, then aborted on failure).

use super::{ABORT_WAIT, Comm};
use crate::backend::nccl::ffi::{self, RawComm, Status, Syms};
use crate::backend::nccl::health::poll_until;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// How polling a non-blocking call ended.
pub(super) enum Waited<B> {
    Done,
    Failed(Error),
    /// The deadline passed after polling this long.
    Timeout(Duration),
    /// What `broken()` said when it stopped the polling.
    Broken(B),
}

/// Poll a non-blocking call on `comm` until it is done, fails, `deadline` passes, or
/// `broken()` says to stop (with what it answers).
///
/// # Safety
/// `comm` is live and the caller has exclusive use of it (holds its calls lock, or
/// made it and shares it with nobody yet).
pub(super) unsafe fn poll<B>(
    nccl: &Syms,
    comm: RawComm,
    op: &'static str,
    deadline: Deadline,
    broken: &dyn Fn() -> Option<B>,
) -> Waited<B> {
    // A call that answered `ncclSuccess` may still be running: on a non-blocking
    // communicator NCCL 2.28 ends calls such as `ncclCommWindowRegister` with an
    // internal group end whose `ncclInProgress` it does not return, and writes the
    // window handle when the job finishes. So the communicator's asynchronous state is
    // always read until it is no longer in progress (seen on NCCL 2.28.3: a NULL window
    // read too early, then a late write into freed memory).
    let started = Instant::now();
    let answer = poll_until(deadline, || {
        // SAFETY: the caller's contract.
        let state = unsafe { ffi::async_state(nccl, op, comm) };
        match state {
            Ok(Status::Done) => Some(Waited::Done),
            Ok(Status::InProgress) => broken().map(Waited::Broken),
            Err(e) => Some(Waited::Failed(e)),
        }
    });
    answer.unwrap_or_else(|| Waited::Timeout(started.elapsed()))
}

/// Finish making a communicator (`blocking` as configured): poll what
/// [`ffi::Starting::poll`] names until `deadline`, abort it on failure. On a timeout of
/// a split off a non-blocking `parent` (one the crate made), the parent is aborted,
/// which also ends the child's initialisation (`setCommAbortFlags`, src/init.cc 2.28.3
/// 2320–2329), waiting at most [`ABORT_WAIT`]; once that abort returned, the child, if
/// NCCL wrote one, is aborted too. Otherwise the child and the boxes are leaked. A
/// peer lost meanwhile (`lost`) ends the wait as a timeout does, reported as the loss.
pub(in crate::backend::nccl) fn finish_creation(
    nccl: &'static Syms,
    starting: Result<ffi::Starting>,
    op: &'static str,
    blocking: bool,
    deadline: Deadline,
    parent: Option<&Comm>,
    lost: &dyn Fn() -> Option<Error>,
) -> Result<Comm> {
    let starting = starting?;
    let started = Instant::now();
    // SAFETY: the communicator (or the parent of a split) is used by this thread only
    // until the call is done.
    let (waited, loss) = match unsafe { poll(nccl, starting.poll, op, deadline, lost) } {
        Waited::Timeout(waited) => (waited, None),
        // A peer lost ends it as a timeout does, reported as the loss.
        Waited::Broken(loss) => (started.elapsed(), Some(loss)),
        ended => {
            // SAFETY: the poll says the call is done or failed: NCCL writes the slot no
            // more.
            let made = unsafe { starting.finish() }.map(|raw| Comm::new(nccl, raw, true, blocking));
            return match (ended, made) {
                // Dropping the `Comm` aborts it.
                (Waited::Failed(e), _) => Err(e),
                (_, made) => made.ok_or_else(|| ffi::no_comm(op, 0)),
            };
        }
    };
    let (making, polled) = (starting.making, starting.poll);
    let slot = starting.abandon();
    match making {
        // The polled handle is the new communicator: its abort ends NCCL's work on it;
        // the boxes are leaked.
        ffi::Making::Init => drop(Comm::new(nccl, polled, true, blocking)),
        ffi::Making::Split => {
            let ended = parent.is_some_and(|p| p.abort_and_wait(Deadline::after(ABORT_WAIT)));
            // SAFETY: the slot is leaked, so it stays valid; the parent's abort returned,
            // so NCCL's split job ended and writes it no more.
            match ended.then(|| unsafe { ffi::read_slot(slot) }) {
                Some(Some(child)) => drop(Comm::new(nccl, child, true, blocking)),
                Some(None) => {}
                None => tracing::warn!(
                    "symmpool: {op} timed out and its parent's abort did not end it; the new communicator, if any, is leaked"
                ),
            }
        }
    }
    Err(loss.unwrap_or(Error::NcclTimeout { op, waited }))
}
