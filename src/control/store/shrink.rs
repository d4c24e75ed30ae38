//! The server's side of a shrink: the survivors of a loss go on as a smaller group.
//!
//! The group of epoch *e* (0 at start) is the list `alive` of job ranks; a rank of the
//! group is its place in that list, and a round's payloads come in that order. When a
//! rank of the group asks to shrink ([`ToServer::Shrink`](super::wire::ToServer)) the
//! server notes its vote. Once every rank of the group that is still connected has
//! voted, the group of epoch *e* + 1 is those ranks: the server forgets the rounds of
//! epoch *e*, clears the broken state (the loss belongs to the old group), and tells
//! each survivor the new list ([`ToClient::Shrunk`]), after everything it sent them
//! before (one connection, in order), so a client never mixes rounds of two epochs.
//!
//! A rank of the group lost while votes are pending fails the shrink for the ranks
//! that voted ([`ToClient::ShrinkFailed`], naming it): a second loss during a shrink is
//! a clear error on every survivor, never a smaller group that some of them did not
//! see coming. They may ask again; the next attempt starts from no votes. A rank
//! whose ask timed out withdraws it ([`ToServer::Withdraw`](super::wire::ToServer)), so
//! that the others' asks do not shrink the group on its behalf.
//!
//! A server in job rank 0's process (the default) goes with it, so the survivors can
//! shrink past the loss of any rank but that one; a server in a process of its own
//! (`SYMMPOOL_STORE_EXTERNAL`) lets them shrink past any
//! ([`StoreExchange::shrink`](super::super::StoreExchange::shrink)).

use super::{Shared, State};
use crate::control::wire::{self, ToClient};

impl Shared {
    /// Job rank `rank` asks to shrink the group of `epoch`.
    pub(super) fn vote_shrink(&self, st: &mut State, rank: usize, epoch: u64) {
        if epoch != st.epoch || st.place(rank).is_none() {
            let reason = format!(
                "job rank {rank} asked to shrink the group of epoch {epoch}, but the store's group is of epoch {} (ranks {:?})",
                st.epoch, st.alive
            );
            return self.send_to(st, [rank], &shrink_failed(reason, false));
        }
        st.votes.insert(rank);
        let connected: Vec<usize> = (st.alive.iter().copied())
            .filter(|r| st.conns[*r].is_some())
            .collect();
        if !connected.iter().all(|r| st.votes.contains(r)) {
            return;
        }
        st.epoch += 1;
        tracing::info!(
            "symmpool store: the group shrank from job ranks {:?} to {connected:?} (epoch {})",
            st.alive,
            st.epoch
        );
        st.votes.clear();
        st.rounds.clear();
        (st.broken, st.lost_told) = (None, false);
        let survivors = connected.iter().map(|&r| r as u32).collect();
        let frame = wire::encode(&ToClient::Shrunk {
            epoch: st.epoch,
            survivors,
        });
        st.alive = connected.clone();
        self.send_to(st, connected, &frame);
    }

    /// Job rank `rank` gave up its ask to shrink the group of `epoch` (its deadline
    /// passed): the vote is forgotten, and the rank told so with the ranks that had
    /// not asked ([`ToClient::Withdrawn`]), unless that group is over already (the
    /// rank was told of the new one first).
    pub(super) fn withdraw_shrink(&self, st: &mut State, rank: usize, epoch: u64) {
        if epoch != st.epoch {
            // The rank was sent the new group before this: its answer.
            return;
        }
        st.votes.remove(&rank);
        let missing = (st.alive.iter().enumerate())
            .filter(|&(_, &r)| r != rank && st.conns[r].is_some() && !st.votes.contains(&r))
            .map(|(place, _)| place as u32)
            .collect();
        self.send_to(st, [rank], &wire::encode(&ToClient::Withdrawn { missing }));
    }

    /// Job rank `rank` of the group departed (`why`): a shrink being voted on fails for
    /// the ranks that voted.
    pub(super) fn lost_during_shrink(&self, st: &mut State, rank: usize, why: &str) {
        if st.votes.is_empty() || st.place(rank).is_none() {
            return;
        }
        let voters = std::mem::take(&mut st.votes);
        let reason = format!(
            "job rank {rank} was lost while the survivors agreed to shrink ({why}); ask again to go on without it"
        );
        self.send_to(st, voters, &shrink_failed(reason, true));
    }
}

/// [`ToClient::ShrinkFailed`], encoded.
fn shrink_failed(reason: String, retry: bool) -> Vec<u8> {
    wire::encode(&ToClient::ShrinkFailed { reason, retry })
}
