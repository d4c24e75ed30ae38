//! [`WaitWarnings`]: a wait on other ranks that lasts says so
//! ([`WAIT_WARNING_INTERVAL`]), so that a rank that never comes is seen while the
//! others wait for it, not only at the end of a start-up timeout of minutes.

use crate::deadline::Deadline;
use std::fmt;
use std::time::{Duration, Instant};

/// How often a wait on other ranks that lasts (the store's start-up and rounds, a
/// [`KvExchange`](super::KvExchange)'s rounds, a [`LocalExchange`](super::LocalExchange)'s
/// and the host backend's) logs a warning (`tracing`, target `symmpool::control`) naming
/// the ranks not yet arrived and how long it has waited; once more when they arrive. A
/// shorter wait logs nothing. The default of
/// [`StoreConfig::wait_warning_interval`](super::StoreConfig::wait_warning_interval) and
/// [`KvConfig::wait_warning_interval`](super::KvConfig::wait_warning_interval).
pub const WAIT_WARNING_INTERVAL: Duration = Duration::from_secs(30);

/// The warnings of one wait on other ranks: made when the wait starts (no allocation,
/// no clock read beyond the caller's), it says when the next warning is due; the
/// waiter wakes then ([`until`](Self::until)), warns ([`warn`](Self::warn)), waits on,
/// and once the ranks arrive says so ([`arrived`](Self::arrived)) if it warned.
pub(crate) struct WaitWarnings {
    op: &'static str,
    started: Instant,
    interval: Duration,
    /// When the next warning is due.
    next: Deadline,
    /// Who the last warning named (empty: no warning yet).
    named: String,
}

impl WaitWarnings {
    /// The warnings of a wait in `op` that began at `started`: the first is due
    /// `interval` after it, the next ones `interval` after each.
    pub(crate) fn new(op: &'static str, started: Instant, interval: Duration) -> Self {
        WaitWarnings {
            op,
            started,
            interval,
            next: Deadline::after_from(started, interval),
            named: String::new(),
        }
    }

    /// How long to wait before looking again: until `deadline`, or the next warning
    /// if that comes first.
    pub(crate) fn until(&self, deadline: Deadline) -> Deadline {
        deadline.min(self.next)
    }

    /// Whether a warning is due.
    pub(crate) fn due(&self) -> bool {
        self.next.expired()
    }

    /// Warn that `who` (this rank, as the log should name it) has waited in this
    /// wait's op for `missing` (the ranks not arrived, [`ranks`]), which it gives up on
    /// at `deadline`; the next warning is due one interval from now.
    pub(crate) fn warn(&mut self, who: &dyn fmt::Display, missing: String, deadline: Deadline) {
        let ends = if deadline.is_never() {
            "no deadline".to_string()
        } else {
            format!("gives up in {:.1?}", deadline.remaining())
        };
        tracing::warn!(
            target: "symmpool::control",
            "symmpool: {who} has waited {:.1?} in {} for {missing}, not arrived yet ({ends})",
            self.started.elapsed(),
            self.op,
        );
        self.named = missing;
        self.next = Deadline::after(self.interval);
    }

    /// The wait is over, everyone arrived: if it warned, say so once more.
    pub(crate) fn arrived(&self, who: &dyn fmt::Display) {
        if !self.named.is_empty() {
            tracing::warn!(
                target: "symmpool::control",
                "symmpool: {who}: {} arrived in {} after {:.1?}",
                self.named,
                self.op,
                self.started.elapsed(),
            );
        }
    }
}

/// A waiting rank as a warning names it: the rank, what it waits on (`store`, or empty)
/// and which one (an address, a key prefix): `rank 1`, or `rank 1 (store
/// 10.0.0.1:29500)` (formatted only when a warning is logged).
pub(crate) struct Who<'a>(
    pub(crate) usize,
    pub(crate) &'static str,
    pub(crate) &'a str,
);

impl fmt::Display for Who<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)?;
        if !self.1.is_empty() {
            write!(f, " ({} {})", self.1, self.2)?;
        }
        Ok(())
    }
}

/// `missing` ranks as a warning names them: `rank 2`, `ranks 1, 2` (none known: `the
/// other ranks`).
pub(crate) fn ranks<R: fmt::Display>(missing: &[R]) -> String {
    match missing {
        [] => "the other ranks".into(),
        [one] => format!("rank {one}"),
        many => {
            let list: Vec<String> = many.iter().map(R::to_string).collect();
            format!("ranks {}", list.join(", "))
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/waiting/capture.rs"]
pub(crate) mod capture;

#[cfg(test)]
#[path = "../../tests/unit/control/waiting.rs"]
pub(crate) mod tests;
