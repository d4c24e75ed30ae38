//! The server's side of a regrouping: the survivors of a loss go on as a smaller group
//! (a shrink), or a group takes in the newcomers waiting to join it (a grow).
//!
//! The group of epoch *e* (0 at start) is the list `alive` of job ranks, ascending; a
//! rank of the group is its place in that list, and a round's payloads come in that
//! order. A rank of the group asks to shrink ([`ToServer::Shrink`](super::wire::ToServer))
//! or to grow ([`ToServer::Grow`](super::wire::ToServer)); the server notes its vote.
//! Once every rank of the group that is still connected has voted, the group of epoch
//! *e* + 1 is, for a shrink, those ranks; for a grow, those ranks and the newcomers
//! waiting, ascending by job rank. The server forgets the rounds of epoch *e*, clears
//! the broken state (a loss belongs to the old group), and tells each member the new
//! list ([`ToClient::Regrouped`]), after everything it sent them before (one connection,
//! in order), so a client never mixes rounds of two epochs.
//!
//! A newcomer is a process started with `SYMMPOOL_JOIN=1` for a job rank that no
//! connection holds and that the group has gone on without (it shrank past its loss):
//! the server admits it to wait, sends it heartbeats and nothing of the group, and
//! forgets it if it leaves or dies before a grow takes it in (no loss for the group).
//! For a job rank still in the group it is refused, as busy: it retries until the
//! survivors have shrunk past the loss (a launcher may start it the moment the old
//! process dies); for a job rank held by a connection, as [`RankTaken`](super::wire::Refusal).
//!
//! With no newcomer waiting when the last rank asks to grow: if some rank asked
//! without `wait`, every asker is told so ([`ToClient::NotGrown`]); otherwise they wait
//! for one, until the first of them gives up (its withdrawal then tells every asker
//! [`ToClient::NotGrown`]: the outcome is the same on every rank). Asks to shrink and to
//! grow never mix in one epoch: the odd one is refused ([`ToClient::ShrinkFailed`]). An
//! ask to grow a broken group is ignored: the broken-group notice, sent to every rank
//! of the group before, is its answer (shrink past the loss, then grow).
//!
//! A rank of the group lost while votes are pending fails a shrink for the ranks that
//! voted ([`ToClient::ShrinkFailed`], naming it): a second loss during a shrink is a
//! clear error on every survivor, never a smaller group that some of them did not see
//! coming. They may ask again; the next attempt starts from no votes. A loss (or a
//! timeout) that breaks the group while ranks ask to grow drops their asks: the
//! broken-group notice is their answer. A rank whose ask timed out withdraws it
//! ([`ToServer::Withdraw`](super::wire::ToServer)), so that the others' asks do not
//! regroup on its behalf.
//!
//! A server in job rank 0's process (the default) goes with it, so the survivors can
//! shrink past the loss of any rank but that one, and only other ranks can be
//! replaced; a server in a process of its own (`SYMMPOOL_STORE_EXTERNAL`) lets them
//! shrink past any, and any be replaced
//! ([`StoreExchange::shrink`](super::super::StoreExchange::shrink),
//! [`StoreExchange::grow`](super::super::StoreExchange::grow)).

use super::{Shared, State};
use crate::control::Ask;
use crate::control::wire::{self, ToClient};

impl State {
    /// Whether every connected rank of the group has asked (and one has).
    fn all_asked(&self) -> bool {
        let asked = |r: &usize| self.conns[*r].is_none() || self.votes.contains(r);
        !self.votes.is_empty() && self.alive.iter().all(asked)
    }
}

impl Shared {
    /// Job rank `rank` asks to shrink or grow (`ask`) the group of `epoch`.
    pub(super) fn vote(&self, st: &mut State, rank: usize, epoch: u64, ask: Ask) {
        let grow = ask != Ask::Shrink;
        if grow && st.broken.is_some() {
            // The broken-group notice, sent to the rank before, is the answer.
            return;
        }
        let verb = ask.verb();
        let why = if epoch != st.epoch || st.place(rank).is_none() {
            format!(
                "job rank {rank} asked to {verb} the group of epoch {epoch}, but the store's group is of epoch {} (ranks {:?})",
                st.epoch, st.alive
            )
        } else if !st.votes.is_empty() && grow != (st.asked != Ask::Shrink) {
            let (voters, theirs) = (&st.votes, st.asked.verb());
            format!("job rank {rank} asked to {verb} while job ranks {voters:?} asked to {theirs}")
        } else {
            String::new()
        };
        if !why.is_empty() {
            return self.send_to(st, [rank], &failed(why, false));
        }
        st.asked = if st.votes.is_empty() {
            ask
        } else {
            st.asked.min(ask)
        };
        st.votes.insert(rank);
        self.decide(st);
    }

    /// Once every connected rank of the group has asked: regroup, or tell them that no
    /// newcomer waits (unless they wait for one). Also when a newcomer arrives.
    pub(super) fn decide(&self, st: &mut State) {
        if !st.all_asked() {
            return;
        }
        let mut group: Vec<usize> = (st.alive.iter().copied())
            .filter(|r| st.conns[*r].is_some())
            .collect();
        if let Ask::Grow { wait } = st.asked {
            let before = group.len();
            let newcomers =
                (0..self.world).filter(|&r| st.conns[r].is_some() && st.place(r).is_none());
            group.extend(newcomers);
            if group.len() == before {
                if !wait {
                    let voters = std::mem::take(&mut st.votes);
                    self.send_to(st, voters, &wire::encode(&ToClient::NotGrown));
                }
                return;
            }
            group.sort_unstable();
            self.stats.lock().newcomers_joined += (group.len() - before) as u64;
        }
        st.epoch += 1;
        let (was, asked, epoch) = (&st.alive, st.asked.verb(), st.epoch);
        tracing::info!(
            "symmpool store: job ranks {was:?} asked to {asked}: {group:?} (epoch {epoch})"
        );
        st.votes.clear();
        st.rounds.clear();
        (st.broken, st.lost_told) = (None, false);
        let frame = wire::encode(&ToClient::Regrouped {
            epoch: st.epoch,
            group: group.iter().map(|&r| r as u32).collect(),
        });
        st.alive = group.clone();
        self.send_to(st, group, &frame);
    }

    /// Job rank `rank` gave up its ask to regroup the group of `epoch` (its deadline
    /// passed): the vote is forgotten, and the rank told so with the ranks that had
    /// not asked ([`ToClient::Withdrawn`]), unless that group is over already (the
    /// rank was told of the new one first). Where every rank had asked to grow and
    /// waits for a newcomer, the first to give up ends the wait for all of them
    /// ([`ToClient::NotGrown`]).
    pub(super) fn withdraw(&self, st: &mut State, rank: usize, epoch: u64) {
        if st.place(rank).is_none() {
            // A newcomer that gives up waiting: told so, then gone (no grow after this
            // takes it in; one before did, and told it first).
            let frame = wire::encode(&ToClient::Withdrawn { missing: vec![] });
            self.send_to(st, [rank], &frame);
            return self.depart(st, rank, None, "a newcomer gave up waiting to join");
        }
        if epoch != st.epoch {
            // The rank was sent the new group before this: its answer.
            return;
        }
        if st.asked == (Ask::Grow { wait: true }) && st.votes.contains(&rank) && st.all_asked() {
            let voters = std::mem::take(&mut st.votes);
            return self.send_to(st, voters, &wire::encode(&ToClient::NotGrown));
        }
        st.votes.remove(&rank);
        let missing = (st.alive.iter().enumerate())
            .filter(|&(_, &r)| r != rank && st.conns[r].is_some() && !st.votes.contains(&r))
            .map(|(place, _)| place as u32)
            .collect();
        self.send_to(st, [rank], &wire::encode(&ToClient::Withdrawn { missing }));
    }

    /// Job rank `rank` of the group departed (`why`): a shrink being voted on fails for
    /// the ranks that voted (asks to grow are dropped as the group breaks).
    pub(super) fn lost_during_shrink(&self, st: &mut State, rank: usize, why: &str) {
        if st.votes.is_empty() || st.asked != Ask::Shrink {
            return;
        }
        let voters = std::mem::take(&mut st.votes);
        let reason = format!(
            "job rank {rank} was lost while the survivors agreed to shrink ({why}); ask again to go on without it"
        );
        self.send_to(st, voters, &failed(reason, true));
    }
}

/// [`ToClient::ShrinkFailed`], encoded.
fn failed(reason: String, retry: bool) -> Vec<u8> {
    wire::encode(&ToClient::ShrinkFailed { reason, retry })
}
