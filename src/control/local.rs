//! [`LocalExchange`]: the ranks are threads of one process.

use super::rendezvous::Lose;
use super::store::CLOSED;
use super::{Ask, ChannelId, GatherRounds, LostPeer, Rendezvous, Round, Rounds, SHRUNK};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex};
use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Instant;

/// An [`Exchange`](super::Exchange) among ranks that are threads of one process.
///
/// Made for a whole group at once with [`LocalExchange::group`]; hand one to each
/// rank's thread. Payloads have no size limit beyond memory. Dropping a rank's
/// exchange while the others go on (its thread ended, or unwound from a panic) loses
/// the rank: their waits, and those of the rendezvous made through the group (the host
/// backend's communicators), end with [`Error::PeerLost`] at once, and they may
/// [`shrink`](Self::shrink).
pub struct LocalExchange {
    group: Arc<Group>,
    rounds: Rounds,
    /// The exchange of the survivors this one shrank into.
    successor: Mutex<Option<Arc<LocalExchange>>>,
    /// The channels this rank [abandoned](super::Exchange::abandon).
    abandoned: Mutex<Vec<ChannelId>>,
}

/// What the ranks of one group share.
struct Group {
    /// The group's rounds, matched by (channel, round).
    rounds: Rendezvous<(ChannelId, u64), Vec<u8>>,
    state: Mutex<GroupState>,
    /// Notified when a rank asks to shrink, a shrink succeeds or fails.
    cv: Condvar,
    /// The group shrank: its exchanges fail with [`Error::Shrunk`].
    shrunk: AtomicBool,
}

#[derive(Default)]
struct GroupState {
    /// The ranks whose exchange is not dropped.
    alive: BTreeSet<usize>,
    /// The first rank lost.
    lost: Option<LostPeer>,
    /// The other rendezvous of these ranks, told of a loss.
    told: Vec<Weak<dyn Lose>>,
    /// Values the ranks share under a key, with how many ranks took them.
    shared: BTreeMap<u64, (Arc<dyn Any + Send + Sync>, usize)>,
    /// The ranks asking to shrink or grow now, and what they ask together.
    votes: BTreeSet<usize>,
    asked: Ask,
    /// The newcomers waiting to join ([`LocalNewcomer`]), in the order they came
    /// (one dropped is gone).
    newcomers: Vec<Weak<Seat>>,
    /// The group this one became (its waiting newcomers went on waiting there).
    next: Option<Arc<Group>>,
    /// The new group's exchanges once every rank asked, by old rank, until taken.
    made: BTreeMap<usize, LocalExchange>,
    /// The answer to a rank's ask that made no group, until it reads it: why it
    /// failed (a loss while they asked, asks of both kinds), or `None`: no newcomer.
    answered: BTreeMap<usize, Option<String>>,
}

/// A newcomer's place ([`LocalNewcomer`]), with what a grow made of it.
#[derive(Default)]
struct Seat {
    slot: Mutex<Slot>,
    cv: Condvar,
}

#[derive(Default)]
enum Slot {
    #[default]
    Waiting,
    /// Taken in by a grow: its exchange in the grown group, until it takes it.
    Made(LocalExchange),
    /// It gave up (its deadline passed): no grow takes it.
    Gone,
}

/// A thread waiting to join a group of [`LocalExchange`]s when its ranks
/// [grow](LocalExchange::grow) it: made by [`LocalExchange::newcomer`], it waits in
/// [`join`](Self::join). Dropped before it joined, it is forgotten (no loss to the
/// group); dropped after the group grew with it but before `join` returned, it is lost
/// to the grown group.
pub struct LocalNewcomer(Arc<Seat>);

impl LocalExchange {
    /// One exchange per rank for `world_size` ranks.
    ///
    /// # Panics
    /// If `world_size` is 0.
    #[track_caller]
    pub fn group(world_size: usize) -> Vec<LocalExchange> {
        assert!(world_size > 0, "a group needs at least one rank");
        let group = Arc::new(Group {
            rounds: Rendezvous::new(world_size),
            state: Mutex::new(GroupState {
                alive: (0..world_size).collect(),
                ..GroupState::default()
            }),
            cv: Condvar::new(),
            shrunk: AtomicBool::new(false),
        });
        (0..world_size)
            .map(|rank| LocalExchange {
                group: group.clone(),
                rounds: Rounds::new(rank, world_size, usize::MAX),
                successor: Mutex::new(None),
                abandoned: Mutex::default(),
            })
            .collect()
    }

    /// A rendezvous of this group's ranks for the layers above (the host backend's
    /// communicators) that fails with [`Error::PeerLost`] once a rank of the group
    /// is lost, as the exchange's own rounds do.
    pub(crate) fn rendezvous<K, T>(&self) -> Arc<Rendezvous<K, T>>
    where
        K: Ord + Copy + Send + 'static,
        T: Clone + Send + 'static,
    {
        let rv = Arc::new(Rendezvous::new(self.rounds.world_size));
        let mut st = self.group.state.lock();
        st.told.retain(|w| w.strong_count() > 0);
        st.told.push(Arc::downgrade(&rv) as Weak<dyn Lose>);
        if let Some(peer) = &st.lost {
            rv.lose(peer);
        }
        drop(st);
        rv
    }

    /// The value the ranks of this group share under `key` (the ordinal of a channel
    /// they opened together): made by `make` on the first rank to ask, forgotten once
    /// every rank took it.
    ///
    /// # Errors
    /// [`Error::Internal`] if the value under `key` is of another type.
    pub(crate) fn take_shared<T: Any + Send + Sync>(
        &self,
        key: u64,
        make: impl FnOnce() -> T,
    ) -> Result<Arc<T>> {
        let held = (self.group.state.lock().shared.get(&key)).map(|v| v.0.clone());
        // Made without the lock: `make` may ask the group for rendezvous.
        let made = held.unwrap_or_else(|| Arc::new(make()));
        let mut st = self.group.state.lock();
        let (value, taken) = st.shared.entry(key).or_insert((made, 0));
        let value = value.clone();
        *taken += 1;
        if *taken >= self.rounds.world_size {
            st.shared.remove(&key);
        }
        value.downcast().map_err(|_| {
            Error::internal(format!(
                "the value the ranks share under key {key} is of another type"
            ))
        })
    }

    /// [`Exchange::shrink`](super::Exchange::shrink): every rank whose exchange is not
    /// dropped asks, and once all have, the group is those ranks, with no channel open
    /// but [`ChannelId::CONTROL`] and rounds from 1 (every exchange of the old group
    /// fails with [`Error::Shrunk`]). Asking again returns the same exchange, or, once
    /// that group lost a rank too or shrank in turn, its shrink. With no rank lost, the
    /// group keeps its size.
    ///
    /// # Collective
    /// Every surviving rank calls it after the loss; it waits for them until
    /// `deadline`.
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`] naming the rank when a rank is lost while the survivors
    /// ask (they may ask again); [`Error::Timeout`] naming the ranks that did not ask
    /// by `deadline` (this rank's ask is withdrawn).
    pub fn shrink(&self, deadline: Deadline) -> Result<Arc<LocalExchange>> {
        if let Some(next) = self.successor.lock().clone() {
            // The survivors lost a rank too, or went on past such a loss: from there.
            if next.lost_peer().is_some() || next.successor.lock().is_some() {
                return next.shrink(deadline);
            }
            return Ok(next);
        }
        self.ask(Ask::Shrink, deadline)?.ok_or(SHRUNK)
    }

    /// [`Exchange::grow`](super::Exchange::grow) among threads: every rank of the group asks; the newcomers
    /// waiting then ([`newcomer`](Self::newcomer)) get the ranks after this group's.
    ///
    /// # Collective
    /// Every rank of the group calls it, waiting for the others (and with `wait` on
    /// every rank, for a newcomer) until `deadline`.
    ///
    /// # Errors
    /// As [`Exchange::grow`](super::Exchange::grow).
    pub fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<LocalExchange>>> {
        if let Some(next) = self.successor.lock().clone() {
            return Ok(Some(next));
        }
        self.ask(Ask::Grow { wait }, deadline)
    }

    /// A newcomer that waits to join the group this exchange is in now (or the one it
    /// shrank or grew into) when its ranks next [`grow`](Self::grow) it: hand it to
    /// the newcomer's thread, which calls [`LocalNewcomer::join`].
    pub fn newcomer(&self) -> LocalNewcomer {
        let seat = Arc::new(Seat::default());
        let mut group = self.group.clone();
        loop {
            let mut st = group.state.lock();
            let Some(next) = st.next.clone() else {
                st.newcomers.push(Arc::downgrade(&seat));
                group.settle(&mut st);
                group.cv.notify_all();
                return LocalNewcomer(seat);
            };
            drop(st);
            group = next;
        }
    }

    /// Ask the group for `ask`, and wait for the answer: the exchange of the new group
    /// (`None`: a grow found no newcomer).
    fn ask(&self, ask: Ask, deadline: Deadline) -> Result<Option<Arc<LocalExchange>>> {
        let mut successor = self.successor.lock();
        let (started, rank, group) = (Instant::now(), self.rounds.rank, &*self.group);
        let (grow, op) = (ask != Ask::Shrink, ask.verb());
        let mut st = group.state.lock();
        if let Some(lost) = st.lost.as_ref().filter(|_| grow) {
            return Err(lost.error(op));
        }
        st.answered.remove(&rank);
        let mixed = !st.votes.is_empty() && grow == (st.asked == Ask::Shrink);
        st.asked = if st.votes.is_empty() {
            ask
        } else {
            st.asked.min(ask)
        };
        st.votes.insert(rank);
        if mixed {
            let why =
                "the ranks asked to shrink and to grow at once (every rank makes the same call)";
            st.answer(Some(why.into()));
        }
        group.settle(&mut st);
        group.cv.notify_all();
        loop {
            if let Some(next) = st.made.remove(&rank) {
                let next = Arc::new(next);
                *successor = Some(next.clone());
                return Ok(Some(next));
            }
            if let Some(why) = st.answered.remove(&rank) {
                return match (why, &st.lost) {
                    (None, _) => Ok(None),
                    (Some(_), Some(lost)) if grow => Err(lost.error(op)),
                    (Some(reason), _) => Err(Error::shrink_failed(reason, true)),
                };
            }
            if deadline.expired() {
                if grow && st.alive.is_subset(&st.votes) {
                    // Every rank asked to grow and waits for a newcomer: the first
                    // whose wait ends ends it for all of them (as on a store).
                    st.answer(None);
                    group.cv.notify_all();
                    continue;
                }
                st.votes.remove(&rank);
                let missing = (st.alive.difference(&st.votes)).filter(|&&r| r != rank);
                let missing = Vec::from_iter(missing.map(|&r| r as u32));
                return Err(Error::timeout_since(op, started, &missing));
            }
            group.cv.wait_until(&mut st, deadline.instant());
        }
    }
}

impl LocalNewcomer {
    /// Wait until the group's ranks [grow](LocalExchange::grow) it with this newcomer:
    /// its exchange in the grown group.
    ///
    /// # Errors
    /// [`Error::Timeout`] (op `"join"`) if they do not by `deadline` (the newcomer is
    /// forgotten).
    pub fn join(self, deadline: Deadline) -> Result<Arc<LocalExchange>> {
        let started = Instant::now();
        let mut slot = self.0.slot.lock();
        let waiting = |s: &mut Slot| matches!(s, Slot::Waiting);
        self.0
            .cv
            .wait_while_until(&mut slot, waiting, deadline.instant());
        match std::mem::replace(&mut *slot, Slot::Gone) {
            Slot::Made(mut ex) => {
                ex.rounds.newcomer = true;
                Ok(Arc::new(ex))
            }
            _ => Err(Error::timeout_since("join", started, &[])),
        }
    }
}

impl fmt::Debug for LocalNewcomer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalNewcomer").finish_non_exhaustive()
    }
}

impl Group {
    /// Once every rank of the group asked: the new group (a shrink to the ranks that
    /// asked; a grow by the waiting newcomers), every rank's and newcomer's exchange of
    /// it in `made`; or, for a grow without newcomers, the ranks told so (unless every
    /// rank asked to wait for one). The caller notifies.
    fn settle(&self, st: &mut GroupState) {
        if st.votes.is_empty() || !st.alive.is_subset(&st.votes) {
            return;
        }
        // The newcomers still waiting (neither dropped nor gone), held until made.
        let seats: Vec<Arc<Seat>> = st.newcomers.iter().filter_map(Weak::upgrade).collect();
        let mut waiting: Vec<_> = (seats.iter().map(|s| s.slot.lock()))
            .filter(|s| matches!(**s, Slot::Waiting))
            .collect();
        match st.asked {
            Ask::Shrink => waiting.clear(),
            _ if !waiting.is_empty() => st.newcomers.clear(),
            Ask::Grow { wait: false } => return st.answer(None),
            Ask::Grow { wait: true } => return,
        }
        tracing::info!(
            "symmpool: a group of threads went on as its ranks {:?} and {} newcomers",
            st.alive,
            waiting.len()
        );
        let next = LocalExchange::group(st.alive.len() + waiting.len());
        let next_group = next[0].group.clone();
        let mut next = next.into_iter();
        st.made = st.alive.iter().copied().zip(next.by_ref()).collect();
        for (slot, ex) in waiting.iter_mut().zip(next) {
            **slot = Slot::Made(ex);
        }
        drop(waiting);
        for seat in &seats {
            seat.cv.notify_all();
        }
        st.votes.clear();
        // Newcomers still to come wait in the new group.
        next_group.state.lock().newcomers = std::mem::take(&mut st.newcomers);
        st.next = Some(next_group);
        self.shrunk.store(true, Ordering::Release);
        // Calls still waiting in the old group (another thread's collective) end
        // with `Shrunk`, not with the loss of a rank that merely leaves the old
        // group for the new one.
        self.rounds.shrink();
        for rv in st.told.iter().filter_map(Weak::upgrade) {
            rv.shrink();
        }
    }

    /// Rank `rank`'s exchange is dropped: the rank is lost to the others (it left, or
    /// its thread panicked), and a shrink they are asking for fails.
    fn lose(&self, rank: usize) {
        let left = !std::thread::panicking();
        let detail = if left { CLOSED } else { "its thread panicked" }.to_string();
        let peer = LostPeer {
            rank,
            detail,
            left,
            this_rank: false,
        };
        let told: Vec<Arc<dyn Lose>> = {
            let mut st = self.state.lock();
            st.alive.remove(&rank);
            if self.shrunk.load(Ordering::Acquire) {
                // The group is over: its ranks went on in the new one, where this is
                // no loss; every wait here ends with `Shrunk` already.
                return;
            }
            st.lost.get_or_insert_with(|| peer.clone());
            if !st.votes.is_empty() {
                let reason = format!(
                    "rank {rank} was lost while the survivors agreed to shrink ({}); ask again to go on without it",
                    peer.detail
                );
                st.answer(Some(reason));
                self.cv.notify_all();
            }
            st.told.iter().filter_map(Weak::upgrade).collect()
        };
        self.rounds.lose(&peer);
        for rv in told {
            rv.lose(&peer);
        }
    }
}

impl GroupState {
    /// Answer every rank asking now, with no new group: why their ask failed, or
    /// `None`: no newcomer waits.
    fn answer(&mut self, why: Option<String>) {
        for voter in std::mem::take(&mut self.votes) {
            self.answered.insert(voter, why.clone());
        }
    }
}

impl Drop for LocalExchange {
    fn drop(&mut self) {
        self.group.lose(self.rounds.rank);
    }
}

impl fmt::Debug for LocalExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalExchange")
            .field("rank", &self.rounds.rank)
            .field("world_size", &self.rounds.world_size)
            .finish()
    }
}

impl GatherRounds for LocalExchange {
    fn rounds(&self) -> &Rounds {
        &self.rounds
    }

    fn gather_round(&self, round: Round<'_>) -> Result<Vec<Vec<u8>>> {
        if self.group.shrunk.load(Ordering::Acquire) {
            return Err(SHRUNK);
        }
        (self.group.rounds).gather(
            round.op,
            self.rounds.rank,
            (round.channel, round.number),
            round.payload.to_vec(),
            round.deadline,
            || self.abandoned.lock().contains(&round.channel),
        )
    }

    fn abandon(&self, channel: ChannelId) {
        self.abandoned.lock().push(channel);
        self.group.rounds.wake();
    }

    fn lost_peer(&self) -> Option<LostPeer> {
        self.group.state.lock().lost.clone()
    }

    fn shrink(&self, deadline: Deadline) -> Result<Arc<dyn super::Exchange>> {
        Ok(LocalExchange::shrink(self, deadline)?)
    }

    fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<dyn super::Exchange>>> {
        Ok(LocalExchange::grow(self, wait, deadline)?.map(|e| e as _))
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/local.rs"]
mod tests;
