//! Whether an NCCL backend is still usable, the polling of non-blocking calls (the
//! control communicator, and data communicators configured non-blocking), and the
//! watchdog's bookkeeping. Device-free logic, tested without GPUs; the NCCL and CUDA
//! calls stay in the backend.

use crate::control::{Exchange, LostPeer};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

/// What a broken backend's errors name as the operation when no NCCL call of its own
/// is at hand (a later call found it broken).
pub(crate) const AN_NCCL_CALL: &str = "an NCCL call";

/// How long an NCCL failure (an asynchronous error, a failed call) waits for the
/// exchange's verdict on a lost peer before it is taken for NCCL's own: a peer's death
/// reaches NCCL's connections and the exchange in either order (on one H200, NCCL's
/// socket error came 26 ms before the store's); each poll reads what the store has
/// sent ([`Exchange::lost_peer`]). The lost rank is what the caller needs to know.
pub(crate) const PEER_VERDICT_WAIT: Duration = Duration::from_secs(1);

/// Why a backend broke, kept to describe it on every later call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cause {
    /// The NCCL call `op` ran past its deadline, after `waited`.
    Timeout { op: &'static str, waited: Duration },
    /// A collective `op` on communicator `comm` did not complete within the watchdog
    /// timeout (enqueued `waited` before the watchdog saw it).
    Watchdog {
        op: &'static str,
        comm: usize,
        waited: Duration,
    },
    /// NCCL or CUDA reported an error (an asynchronous one, or a failed call after
    /// which the communicators cannot be trusted).
    Failed(String),
    /// The application aborted the communicators (a shrink or grow replacing them,
    /// [`NcclBackend::abort`](super::NcclBackend::abort)): no failure of the backend's.
    Aborted(String),
    /// The exchange knows rank `rank` is lost (`detail`: its process ended, or it
    /// stopped answering heartbeats; see [`Exchange::lost_peer`]): work on the
    /// communicators may wait on it for ever.
    PeerLost { rank: usize, detail: String },
}

impl Cause {
    /// The error this cause is reported as, on the call that found it (`first`) and on
    /// every later call, when no lost peer explains it ([`Health::report`]).
    pub(crate) fn error(&self, first: bool) -> Error {
        match (self, first) {
            (Cause::Timeout { op, waited }, true) => Error::NcclTimeout {
                op,
                waited: *waited,
            },
            (Cause::Watchdog { op, comm, waited }, _) => Error::NcclWatchdog {
                op,
                comm: *comm,
                waited: *waited,
            },
            _ => Error::NcclAborted {
                reason: self.describe(),
            },
        }
    }

    /// The NCCL call the cause names, or [`AN_NCCL_CALL`].
    pub(crate) fn op(&self) -> &'static str {
        match self {
            Cause::Timeout { op, .. } | Cause::Watchdog { op, .. } => op,
            _ => AN_NCCL_CALL,
        }
    }

    fn describe(&self) -> String {
        match self {
            Cause::Timeout { op, waited } => format!("{op} did not finish within {waited:?}"),
            Cause::Watchdog { op, comm, waited } => format!(
                "a {op} on communicator {comm} had not completed {waited:?} after it was enqueued"
            ),
            Cause::Failed(m) | Cause::Aborted(m) => m.clone(),
            Cause::PeerLost { rank, detail } => format!("rank {rank} was lost: {detail}"),
        }
    }
}

/// A backend's health: fine until the first [`Cause`], broken for good afterwards. A
/// break is reported as the lost peer the exchange knows of, if any ([`report`]).
///
/// [`report`]: Self::report
#[derive(Default)]
pub(crate) struct Health {
    cause: OnceLock<Cause>,
    /// The exchange whose word on lost peers names the rank behind a break (not kept
    /// alive by the backend: a dropped exchange knows nothing).
    peers: Option<Weak<dyn Exchange>>,
}

impl Health {
    /// Healthy, naming lost peers as `exchange` knows them.
    pub(crate) fn watching(exchange: &Arc<dyn Exchange>) -> Self {
        Health {
            peers: Some(Arc::downgrade(exchange)),
            ..Health::default()
        }
    }

    /// The peer the exchange knows to be lost, if any (no round).
    pub(crate) fn lost_peer(&self) -> Option<LostPeer> {
        self.peers.as_ref()?.upgrade()?.lost_peer()
    }

    /// The error of `cause` for a call `op` (`first`: the call that found it): the lost
    /// peer the exchange knows of, if any; else the cause's own error.
    pub(crate) fn report(&self, cause: &Cause, op: &'static str, first: bool) -> Error {
        // This rank was declared lost itself (it froze): no peer to name.
        let loss = self.lost_peer();
        if let Some(declared) = loss.as_ref().filter(|l| l.this_rank) {
            return declared.error(op);
        }
        let (rank, detail) = if let Cause::PeerLost { rank, detail } = cause {
            (*rank, detail.clone())
        } else if let Some(loss) = loss {
            let broke = cause.describe();
            let detail = format!(
                "{}; this rank's NCCL backend then broke: {broke}",
                loss.detail
            );
            (loss.rank, detail)
        } else {
            return cause.error(first);
        };
        Error::PeerLost { rank, op, detail }
    }

    /// The cause of an NCCL failure `what` (an asynchronous error, a failed call):
    /// [`Cause::PeerLost`] if the exchange knows of a lost peer by [`PEER_VERDICT_WAIT`]
    /// (polled; without an exchange, not waited for), else [`Cause::Failed`].
    pub(crate) fn failure(&self, what: String) -> Cause {
        let verdict_by = Deadline::after(PEER_VERDICT_WAIT);
        let loss = (self.peers.as_ref()).and_then(|_| poll_until(verdict_by, || self.lost_peer()));
        match loss {
            Some(loss) => Cause::PeerLost {
                rank: loss.rank,
                detail: format!("{}; {what}", loss.detail),
            },
            None => Cause::Failed(what),
        }
    }

    /// Fail if broken.
    ///
    /// # Errors
    /// The cause's error ([`report`](Self::report)).
    pub(crate) fn check(&self) -> Result<()> {
        self.cause
            .get()
            .map_or(Ok(()), |c| Err(self.report(c, c.op(), false)))
    }

    /// Why it broke, if it did.
    pub(crate) fn cause(&self) -> Option<&Cause> {
        self.cause.get()
    }

    /// Whether it is broken (a cheap load, for polling loops).
    pub(crate) fn is_broken(&self) -> bool {
        self.cause.get().is_some()
    }

    /// The error of a broken backend (of a healthy one: an internal error).
    pub(crate) fn error(&self) -> Error {
        self.check()
            .err()
            .unwrap_or_else(|| Error::internal("asked for the error of a healthy NCCL backend"))
    }

    /// Record `cause` unless an earlier one is recorded; returns whether this call
    /// broke it (and so must abort the communicators).
    pub(crate) fn break_with(&self, cause: Cause) -> bool {
        let broke = self.cause.set(cause).is_ok();
        // A lost peer is what its callers are told (they may shrink and go on): a
        // warning, once per rank; the application's own abort (a shrink or grow
        // replacing the communicators) is no failure; anything else is the backend's.
        if let (true, Some(c)) = (broke, self.cause.get()) {
            let d = c.describe();
            match c {
                Cause::PeerLost { .. } => tracing::warn!("symmpool: NCCL backend broken: {d}"),
                Cause::Aborted(_) => tracing::info!("symmpool: NCCL backend closed: {d}"),
                _ => tracing::error!("symmpool: NCCL backend broken: {d}"),
            }
        }
        broke
    }
}

/// Sleeps between polls of a non-blocking call: short at first (most calls finish in
/// microseconds to milliseconds), doubling to `max`. Never a busy loop.
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// From 20 µs up to `max`.
    pub(super) fn new(max: Duration) -> Self {
        let next = Duration::from_micros(20).min(max);
        Backoff { next, max }
    }

    /// The next pause, no later than `deadline` (from `now`).
    pub(super) fn pause(&mut self, now: Instant, deadline: Instant) -> Duration {
        let p = self.next.min(deadline.saturating_duration_since(now));
        self.next = (self.next * 2).min(self.max);
        p
    }
}

/// The longest pause between two polls of a non-blocking NCCL call.
pub(crate) const MAX_POLL_PAUSE: Duration = Duration::from_millis(5);

/// Call `step` until it answers or `deadline` passes (`None`), pausing between calls
/// as [`Backoff`] does (up to [`MAX_POLL_PAUSE`]). `step` runs at least once.
pub(crate) fn poll_until<T>(deadline: Deadline, mut step: impl FnMut() -> Option<T>) -> Option<T> {
    #[cfg(test)]
    POLLS.with(|p| p.set(p.get() + 1));
    let mut backoff = Backoff::new(MAX_POLL_PAUSE);
    loop {
        if let Some(answer) = step() {
            return Some(answer);
        }
        let now = Instant::now();
        if now >= deadline.instant() {
            return None;
        }
        std::thread::sleep(backoff.pause(now, deadline.instant()));
    }
}

#[cfg(test)]
thread_local! {
    /// How many polling loops (the only place the NCCL backend sleeps) this thread
    /// entered, for tests that show a call path does not poll.
    pub(crate) static POLLS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Something whose completion the watchdog can ask about (a CUDA event).
pub(crate) trait Completion {
    /// Whether the work before it has completed; an error is a failed device.
    fn complete(&self) -> std::result::Result<bool, String>;
}

/// One enqueued collective the watchdog waits for.
pub(crate) struct Enqueued<E> {
    pub(crate) op: &'static str,
    pub(crate) comm: usize,
    pub(crate) at: Instant,
    pub(crate) done: E,
}

/// What [`sweep`] found: the collectives not complete (`kept`, oldest first), the
/// markers of those complete, and why the backend must break, if it must.
pub(crate) struct Swept<E> {
    pub(crate) kept: VecDeque<Enqueued<E>>,
    pub(crate) complete: Vec<E>,
    pub(crate) cause: Option<Cause>,
}

/// Query every collective of `pending` (taken with [`Watch::take`]): which are
/// complete, and whether one is older than `timeout` and not complete, or the device
/// failed.
pub(super) fn sweep<E: Completion>(
    pending: VecDeque<Enqueued<E>>,
    now: Instant,
    timeout: Duration,
) -> Swept<E> {
    let mut expired = None;
    let mut failed = None;
    let mut kept = VecDeque::with_capacity(pending.len());
    let mut complete = Vec::new();
    for e in pending {
        match e.done.complete() {
            Ok(true) => complete.push(e.done),
            Ok(false) => {
                let waited = now.saturating_duration_since(e.at);
                if waited > timeout {
                    expired.get_or_insert(Cause::Watchdog {
                        op: e.op,
                        comm: e.comm,
                        waited,
                    });
                }
                kept.push_back(e);
            }
            Err(m) => {
                failed.get_or_insert(Cause::Failed(format!(
                    "the device failed under a {} on communicator {}: {m}",
                    e.op, e.comm
                )));
                kept.push_back(e);
            }
        }
    }
    Swept {
        kept,
        complete,
        cause: failed.or(expired),
    }
}

/// The collectives enqueued and not yet seen complete, oldest first.
pub(crate) struct Watch<E> {
    pub(crate) pending: VecDeque<Enqueued<E>>,
    /// Completed markers, for reuse.
    pub(crate) spare: Vec<E>,
}

impl<E> Default for Watch<E> {
    fn default() -> Self {
        Watch {
            pending: VecDeque::new(),
            spare: Vec::new(),
        }
    }
}

/// Markers kept for reuse at most.
const SPARE: usize = 64;

impl<E: Completion> Watch<E> {
    /// The collectives pending so far, taken out of the list (to be queried without
    /// holding its lock, then handed back with [`restore`](Self::restore)).
    pub(crate) fn take(&mut self) -> VecDeque<Enqueued<E>> {
        std::mem::take(&mut self.pending)
    }

    /// Hand back what [`sweep`] kept (older than anything pushed since) and the markers
    /// it found complete, for reuse.
    pub(crate) fn restore(&mut self, mut kept: VecDeque<Enqueued<E>>, complete: Vec<E>) {
        kept.append(&mut self.pending);
        self.pending = kept;
        let room = SPARE.saturating_sub(self.spare.len());
        self.spare.extend(complete.into_iter().take(room));
    }

    /// Forget everything (after an abort, or at drop).
    pub(crate) fn clear(&mut self) {
        self.pending.clear();
        self.spare.clear();
    }
}

#[cfg(test)]
#[path = "../../../tests/unit/backend/nccl/health.rs"]
mod tests;
