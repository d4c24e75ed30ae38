//! [`Deadline`], and [`CallDeadline`] that makes one at a call's first wait.

use std::cell::Cell;
use std::time::{Duration, Instant};

/// Far enough to mean "no deadline": about a century. `Instant` has no maximum, and
/// adding [`Duration::MAX`] to it overflows, so an endless timeout saturates here.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The instant by which a call must finish.
///
/// Each public call makes one from its configured timeout ([`Deadline::after`]) and
/// passes it down: a control-plane round, a registration, a drain and every other wait
/// inside the call take the same deadline, so the whole call ends within its timeout,
/// however many waits it makes. No layer below re-arms its own.
///
/// A timeout of [`Duration::MAX`] (or any timeout too large to add to the clock) means
/// *never*: the deadline saturates at about a century from now and
/// [`is_never`](Self::is_never) says so. Arithmetic on deadlines never panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline {
    at: Instant,
}

impl Deadline {
    /// `timeout` from now, saturating: [`Duration::MAX`] means never.
    pub fn after(timeout: Duration) -> Self {
        Self::after_from(Instant::now(), timeout)
    }

    /// `timeout` from `start`, saturating as [`after`](Self::after) does.
    pub fn after_from(start: Instant, timeout: Duration) -> Self {
        Deadline {
            at: start.checked_add(timeout.min(FOREVER)).unwrap_or(start),
        }
    }

    /// A deadline that never passes (about a century from now).
    pub fn never() -> Self {
        Self::after(Duration::MAX)
    }

    /// The deadline as an instant (about a century from its making for "never").
    pub fn instant(self) -> Instant {
        self.at
    }

    /// Whether this deadline means "never" (it lies at least 50 years ahead).
    pub fn is_never(self) -> bool {
        self.remaining() >= FOREVER / 2
    }

    /// Time left until the deadline; zero once it has passed.
    pub fn remaining(self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn expired(self) -> bool {
        Instant::now() >= self.at
    }

    /// The earlier of this deadline and `timeout` from now: a wait that has a bound of
    /// its own (a socket's read, one poll) inside a call that has a deadline.
    pub fn cap(self, timeout: Duration) -> Self {
        self.min(Self::after(timeout))
    }
}

/// A call's [`Deadline`], made when a wait first asks for it: a fixed deadline, or
/// one `timeout` after the first [`get`](Self::get).
///
/// A collective call carries one down to its backend ([`CollArgs`]): the pool's
/// checks and the backend's rounds share it, so the whole call ends at one deadline,
/// and a call that never waits on the host (an unchecked NCCL collective) never reads
/// the clock for it (about 60 instructions, a tenth of the crate's cost of such a
/// call). Clones share nothing: a clone made before the first [`get`](Self::get)
/// fixes its own.
///
/// [`CollArgs`]: crate::backend::CollArgs
#[derive(Debug, Clone)]
pub struct CallDeadline {
    /// Used once, when `at` is first read and still unset.
    timeout: Duration,
    /// A `Cell`, not a lock: a call's arguments live on its thread (a `Cell` costs
    /// nothing to make or drop on the call path).
    at: Cell<Option<Deadline>>,
}

impl CallDeadline {
    /// A deadline `timeout` after the first [`get`](Self::get) ([`Duration::MAX`]:
    /// never).
    pub fn from_first_wait(timeout: Duration) -> Self {
        CallDeadline {
            timeout,
            at: Cell::new(None),
        }
    }

    /// The deadline: fixed now if no wait asked for it before.
    pub fn get(&self) -> Deadline {
        if let Some(at) = self.at.get() {
            return at;
        }
        let at = Deadline::after(self.timeout);
        self.at.set(Some(at));
        at
    }
}

impl From<Deadline> for CallDeadline {
    fn from(deadline: Deadline) -> Self {
        CallDeadline {
            timeout: Duration::ZERO,
            at: Cell::new(Some(deadline)),
        }
    }
}

#[cfg(test)]
#[path = "../tests/unit/deadline.rs"]
mod tests;
