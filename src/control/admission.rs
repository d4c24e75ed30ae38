//! Admission to the store: what refusing a connection costs and says. The kinds of
//! refusal, their rate-limited log, the descriptor limit named as what it is, and the
//! slots that cap the handshakes in flight.

#[cfg(doc)]
use super::StoreConfig;
use super::wire::Refusal;
use rustix::io::Errno;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How long refusals of one kind are summed up before their count is logged: the
/// first refusal of a kind in an interval is logged in full, the others counted.
pub const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Kinds of refused connections, for the rate-limited log (each in words:
/// [`describe`](Self::describe)).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum RefusalKind {
    Busy,
    Slow,
    /// Not the protocol: wrong magic, undecodable or oversized frames, a close or a
    /// reset mid-handshake.
    Garbage,
    Version,
    Token,
    OtherJob,
    Misfit,
    /// A rank already held (or held before).
    RankTaken,
    /// A newcomer for a job rank still in the group: it retries (logged at `debug`).
    Early,
    /// After every rank joined (and before one left), from a host that runs none of
    /// them; or the group is broken.
    Closed,
    /// Out of descriptors, threads or another resource of this process.
    Resources,
}

impl RefusalKind {
    /// The kind of a refusal for the I/O error `e`: out of descriptors, or garbage.
    pub(super) fn of_io(e: &std::io::Error) -> RefusalKind {
        if out_of_descriptors(e) {
            RefusalKind::Resources
        } else {
            RefusalKind::Garbage
        }
    }

    fn describe(self) -> &'static str {
        match self {
            RefusalKind::Busy => "too many handshakes in flight",
            RefusalKind::Slow => "no handshake in time",
            RefusalKind::Garbage => "not the store's protocol",
            RefusalKind::Version => "another protocol version",
            RefusalKind::Token => "wrong token",
            RefusalKind::OtherJob => "another job",
            RefusalKind::Misfit => "a world size or rank that does not fit",
            RefusalKind::RankTaken => "a rank already held",
            RefusalKind::Early => "a newcomer before the survivors shrank",
            RefusalKind::Closed => "the group is complete or broken",
            RefusalKind::Resources => "out of descriptors or threads",
        }
    }
}

/// A refused connection: what to log, and what to tell the client (if anything).
pub(super) struct Refused {
    pub(super) kind: RefusalKind,
    pub(super) why: String,
    /// Tell the client (not for garbage that does not even speak the protocol).
    pub(super) tell: Option<Refusal>,
}

/// A refusal of `kind`, told to the client if `told`.
pub(super) fn refused(told: bool, kind: RefusalKind, why: String) -> Box<Refused> {
    let tell = told.then_some(match kind {
        // (A newcomer early is told to retry, as when the store is busy.)
        RefusalKind::Busy | RefusalKind::Early => Refusal::Busy,
        RefusalKind::OtherJob => Refusal::OtherJob,
        _ => Refusal::Other,
    });
    Box::new(Refused { kind, why, tell })
}

/// Refusals logged at most once per kind per [`REFUSAL_LOG_INTERVAL`], the rest
/// counted and summed up in one line.
pub(super) struct RefusalLog {
    since: Instant,
    /// Kinds logged in full in this interval, with how many more were refused since.
    kinds: BTreeMap<RefusalKind, u64>,
}

impl RefusalLog {
    pub(super) fn new(since: Instant) -> Self {
        RefusalLog {
            since,
            kinds: BTreeMap::new(),
        }
    }

    /// The lines a refusal logs: the interval's summary once it is over, then the
    /// refusal itself if it is the first of its kind in the interval.
    pub(super) fn lines_for(
        &mut self,
        now: Instant,
        kind: RefusalKind,
        peer: SocketAddr,
        why: &str,
    ) -> Vec<String> {
        let mut lines = Vec::from_iter(self.summary(now, false));
        match self.kinds.get_mut(&kind) {
            Some(more) => *more += 1,
            None => {
                self.kinds.insert(kind, 0);
                lines.push(format!(
                    "symmpool store: refused a connection from {peer}: {why}"
                ));
            }
        }
        lines
    }

    /// Log the counts of the refusals not logged in full: once the interval is over,
    /// or (`now_anyway`: on shutdown) at once.
    pub(super) fn sum_up(&mut self, now: Instant, now_anyway: bool) {
        if let Some(line) = self.summary(now, now_anyway) {
            tracing::warn!("{line}");
        }
    }

    /// Once the interval is over (or `anyway`): the counts of refusals not logged in
    /// full, if any, and a new interval.
    fn summary(&mut self, now: Instant, anyway: bool) -> Option<String> {
        if !anyway && now.saturating_duration_since(self.since) < REFUSAL_LOG_INTERVAL {
            return None;
        }
        let counted: Vec<String> = (self.kinds.iter())
            .filter(|(_, more)| **more > 0)
            .map(|(kind, more)| format!("{more} {}", kind.describe()))
            .collect();
        let total: u64 = self.kinds.values().sum();
        let waited = now.saturating_duration_since(self.since);
        self.kinds.clear();
        self.since = now;
        (!counted.is_empty()).then(|| {
            format!(
                "symmpool store: refused {total} more connections in the last {waited:?}: {}",
                counted.join(", ")
            )
        })
    }
}

/// Whether `e` says this process (or the system) is out of descriptors.
pub(super) fn out_of_descriptors(e: &std::io::Error) -> bool {
    matches!(Errno::from_io_error(e), Some(Errno::MFILE | Errno::NFILE))
}

/// `e` (from accepting, connecting or creating something) described as what it is
/// when it is the descriptor limit.
pub(super) fn describe_io(e: &std::io::Error) -> String {
    if out_of_descriptors(e) {
        format!(
            "{e}: the open-file descriptor limit is reached (this process's `ulimit -n`, or the system's file-max): raise it, or find what holds descriptors (/proc/<pid>/fd)"
        )
    } else {
        e.to_string()
    }
}

/// Holds one of the [`StoreConfig::max_handshakes`] slots until dropped.
pub(super) struct HandshakeSlot<'a>(pub(super) &'a AtomicUsize);

impl Drop for HandshakeSlot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/admission.rs"]
mod tests;
