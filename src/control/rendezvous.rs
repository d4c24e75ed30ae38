//! [`Rendezvous`]: rounds of a gather among the threads of one process, what
//! [`LocalExchange`](super::LocalExchange) and the host backend pair their ranks with.

use super::LostPeer;
use super::waiting::{WAIT_WARNING_INTERVAL, WaitWarnings, Who, ranks};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Rounds of a gather among the threads of one process, matched by a key of the
/// caller's (a channel and round, a round number). A round is dropped once every rank
/// has read it.
///
/// A timeout breaks the group for good (as [`Exchange`](super::Exchange) explains): the
/// rank that timed out withdraws its post (so no late peer pairs with it) and every
/// later or still-waiting gather, under any key, fails with [`Error::GroupBroken`].
///
/// A lost rank ([`Lose::lose`]: its thread dropped its exchange) breaks it too: every
/// later or still-waiting gather fails with [`Error::PeerLost`] naming it, but for a
/// round that every rank had posted in before. Once the group shrank
/// ([`Lose::shrink`]) they fail with [`Error::Shrunk`].
///
/// A gather that waits longer than [`WAIT_WARNING_INTERVAL`] logs a warning naming the
/// ranks not yet posted, again every interval, and once more when they post.
pub(crate) struct Rendezvous<K, T> {
    world: usize,
    state: Mutex<RvState<K, T>>,
    cv: Condvar,
    /// How often a long wait warns ([`WAIT_WARNING_INTERVAL`]; shorter in tests).
    warn_every: Duration,
}

struct RvState<K, T> {
    rounds: BTreeMap<K, Round<T>>,
    /// The rank that timed out first, and in what.
    broken: Option<(usize, &'static str)>,
    /// The first rank lost.
    lost: Option<LostPeer>,
    /// The group shrank: this rendezvous belongs to the world before.
    shrunk: bool,
}

impl<K: Ord, T> RvState<K, T> {
    /// The error of a gather `op` on a broken rendezvous (the group shrank; a loss
    /// named first), if it is.
    fn broken(&self, op: &'static str) -> Option<Error> {
        if self.shrunk {
            return Some(Error::Shrunk {
                what: "an exchange or communicator",
            });
        }
        (self.lost.as_ref().map(|lost| lost.error(op))).or_else(|| {
            self.broken
                .map(|(rank, op)| Error::GroupBroken { rank, op })
        })
    }

    /// The ranks that have not posted in the round `key`.
    fn missing(&self, key: K) -> Vec<usize> {
        self.rounds.get(&key).map_or_else(Vec::new, |r| {
            (r.posted.iter().enumerate())
                .filter(|(_, p)| p.is_none())
                .map(|(i, _)| i)
                .collect()
        })
    }

    /// Take `rank`'s post out of the round `key` (dropping the round once empty).
    fn withdraw(&mut self, key: K, rank: usize) {
        if let Some(r) = self.rounds.get_mut(&key) {
            r.posted[rank] = None;
            if r.posted.iter().all(Option::is_none) {
                self.rounds.remove(&key);
            }
        }
    }
}

/// What learns that a rank of its group was lost, or that the group shrank: the
/// rendezvous of a group of threads.
pub(crate) trait Lose: Send + Sync {
    /// `peer` is lost: waiting and later gathers fail with [`Error::PeerLost`].
    fn lose(&self, peer: &LostPeer);

    /// The group shrank (the survivors of a loss, or every rank, went on as a new
    /// group): waiting and later gathers fail with [`Error::Shrunk`], whatever the
    /// ranks of the old group do after (drop their exchanges, say).
    fn shrink(&self);
}

struct Round<T> {
    posted: Vec<Option<T>>,
    read: usize,
}

impl<K: Ord + Copy, T: Clone> Rendezvous<K, T> {
    /// A rendezvous of `world` ranks.
    pub(crate) fn new(world: usize) -> Self {
        Rendezvous {
            world,
            state: Mutex::new(RvState {
                rounds: BTreeMap::new(),
                broken: None,
                lost: None,
                shrunk: false,
            }),
            cv: Condvar::new(),
            warn_every: WAIT_WARNING_INTERVAL,
        }
    }

    /// Post `value` for `rank` in the round `key` and wait until every rank has posted
    /// in that round, or `deadline` passes; every rank's value, in rank order. A long
    /// wait warns, naming the ranks not posted (see [`Rendezvous`]).
    ///
    /// # Errors
    /// [`Error::Timeout`] once `deadline` passes (which breaks the group; `waited` is
    /// how long this call waited); [`Error::GroupBroken`] if a rank timed out before or
    /// while waiting; [`Error::PeerLost`] if a rank was lost; [`Error::Timeout`] at once,
    /// the group unbroken and `value` left posted, once `abandoned` says so (looked at
    /// when the rendezvous is [woken](Self::wake)).
    pub(crate) fn gather(
        &self,
        op: &'static str,
        rank: usize,
        key: K,
        value: T,
        deadline: Deadline,
        abandoned: impl Fn() -> bool,
    ) -> Result<Vec<T>> {
        let started = Instant::now();
        let mut state = self.state.lock();
        if let Some(e) = state.broken(op) {
            return Err(e);
        }
        let world = self.world;
        let entry = state.rounds.entry(key).or_insert_with(|| Round {
            posted: vec![None; world],
            read: 0,
        });
        entry.posted[rank] = Some(value);
        self.cv.notify_all();
        let mut warnings = WaitWarnings::new(op, started, self.warn_every);
        let who = Who(rank, "", "");
        loop {
            if let Some(r) = state.rounds.get_mut(&key)
                && let Some(out) = r.posted.iter().cloned().collect::<Option<Vec<T>>>()
            {
                r.read += 1;
                if r.read == world {
                    state.rounds.remove(&key);
                }
                drop(state);
                warnings.arrived(&who);
                return Ok(out);
            }
            if let Some(e) = state.broken(op) {
                state.withdraw(key, rank);
                return Err(e);
            }
            if abandoned() {
                return Err(Error::timeout_since(op, started, &[]));
            }
            if deadline.expired() {
                let missing = state.missing(key);
                state.withdraw(key, rank);
                state.broken = Some((rank, op));
                self.cv.notify_all();
                return Err(Error::Timeout {
                    op,
                    waited: started.elapsed(),
                    missing_ranks: missing,
                });
            }
            if warnings.due() {
                let missing = ranks(&state.missing(key));
                // Logged without the lock, which the other ranks need to post.
                MutexGuard::unlocked(&mut state, || warnings.warn(&who, missing, deadline));
                continue; // the round may have completed meanwhile
            }
            self.cv
                .wait_until(&mut state, warnings.until(deadline).instant());
        }
    }

    /// Break the group as a timeout of `rank` in `op` would (unless it is broken
    /// already): every gather waiting now or later fails with [`Error::GroupBroken`].
    /// For a caller that learnt otherwise that the ranks are out of step.
    pub(crate) fn abandon(&self, rank: usize, op: &'static str) {
        self.state.lock().broken.get_or_insert((rank, op));
        self.cv.notify_all();
    }

    /// Wake every gather, to look again at what ends it.
    pub(crate) fn wake(&self) {
        let _state = self.state.lock();
        self.cv.notify_all();
    }
}

impl<K: Ord + Copy + Send, T: Clone + Send> Lose for Rendezvous<K, T> {
    fn lose(&self, peer: &LostPeer) {
        self.state.lock().lost.get_or_insert_with(|| peer.clone());
        self.cv.notify_all();
    }

    fn shrink(&self) {
        self.state.lock().shrunk = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/rendezvous.rs"]
mod tests;
