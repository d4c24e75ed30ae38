//! [`StoreExchange::shrink`]: this rank's side of a shrink (the server's is in
//! `store/shrink.rs`).

use super::{Inbox, Rounds, StoreExchange};
use crate::control::Exchange;
use crate::control::wire::{self, Cause, ToServer};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

impl StoreExchange {
    /// [`Exchange::shrink`](super::super::Exchange::shrink): every rank of this group
    /// that is still connected to the store asks, and once all have, the group is those
    /// ranks, numbered densely in their old order. The new exchange shares this
    /// one's connection and starts with no channel open but
    /// [`ChannelId::CONTROL`](super::super::ChannelId::CONTROL) and its rounds from 1.
    /// Every backend and pool of a rank that share this exchange may ask: asking again
    /// returns the same exchange, or, once its group lost a rank too or shrank in
    /// turn, its shrink.
    ///
    /// # Collective
    /// Every surviving rank calls it, after the loss (a [`Error::PeerLost`] from any
    /// call); it waits for them until `deadline`.
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`] at once when the store is gone (with its host, rank 0,
    /// unless it runs in a process of its own: `SYMMPOOL_STORE_EXTERNAL`), and when
    /// a rank of the group is lost while the survivors ask (they may ask again);
    /// [`Error::DeclaredLost`] at once on a rank the store declared lost;
    /// [`Error::Shrunk`] on an exchange that is itself replaced already;
    /// [`Error::Timeout`] if a connected rank does not ask by `deadline`: this rank's
    /// ask is withdrawn, and the store confirms it, naming the connected ranks of this
    /// group that had not asked (`missing_ranks`; empty if the confirmation does not
    /// come), within a heartbeat timeout and interval more (as for a round that times
    /// out); had the group shrunk before the withdrawal reached the store, the new
    /// exchange is returned instead.
    pub fn shrink(&self, deadline: Deadline) -> Result<Arc<StoreExchange>> {
        let mut successor = self.successor.lock();
        if let Some(next) = successor.clone() {
            drop(successor);
            // The survivors lost a rank too, or went on past such a loss: from there.
            if Exchange::lost_peer(&*next).is_some() || next.successor.lock().is_some() {
                return next.shrink(deadline);
            }
            return Ok(next);
        }
        let started = Instant::now();
        // This rank declared lost itself, or the server gone: no group to shrink with.
        let gone = |ib: &Inbox| {
            if let Some(reason) = &ib.expelled {
                return Error::DeclaredLost {
                    rank: self.rounds.rank,
                    detail: reason.clone(),
                };
            }
            let cause = ib.broken.as_ref().map(|b| match &b.cause {
                Cause::Lost { detail } => detail.clone(),
                Cause::Timeout { .. } => format!("the group broke in {}", b.op),
            });
            let detail = (ib.server_gone.clone().or(cause))
                .unwrap_or_else(|| "its connection closed".into());
            let reason = format!(
                "the store is gone ({detail}): the survivors cannot agree without it (a store that job rank 0 hosts goes with it; with SYMMPOOL_STORE_EXTERNAL=1 the store runs in a process of its own and any rank can be lost)"
            );
            Error::shrink_failed(reason, false)
        };
        drop(self.inbox()?);
        // An earlier ask's withdrawal not confirmed yet: its answer is not this ask's.
        let pending_done = |ib: &mut Inbox| !ib.withdraw_pending || ib.reader_done;
        let mut inbox = self.shared.wait_until(deadline, pending_done);
        if inbox.reader_done {
            return Err(gone(&inbox));
        } else if inbox.withdraw_pending {
            return Err(Error::timeout_since("shrink", started, &[]));
        }
        (inbox.shrink_failed, inbox.shrink_withdrawn) = (None, None);
        drop(inbox);
        let ask = wire::encode(&ToServer::Shrink { epoch: self.epoch });
        if !self.shared.send_or_lose(&ask, "writing to") {
            return Err(gone(&self.shared.inbox.lock()));
        }
        let over = |ib: &Inbox| ib.epoch != self.epoch || ib.reader_done;
        let answered = |ib: &mut Inbox| over(ib) || ib.shrink_failed.is_some();
        let mut inbox = self.shared.wait_until(deadline, answered);
        if !answered(&mut inbox) {
            // Timed out: withdraw the ask, so that the others' asks never shrink the
            // group with this rank counted as asking, and wait for the server's word
            // (on this connection, in order): withdrawn, or the group had shrunk.
            inbox.withdraw_pending = true;
            drop(inbox);
            let withdraw = wire::encode(&ToServer::Withdraw { epoch: self.epoch });
            let sent = self.shared.writer.lock().send(&withdraw).is_ok();
            let answer_by = Deadline::after(self.shared.config.detection_bound());
            let confirmed = |ib: &mut Inbox| !sent || over(ib) || !ib.withdraw_pending;
            inbox = self.shared.wait_until(answer_by, confirmed);
        }
        if inbox.epoch == self.epoch {
            if let Some((reason, retry)) = inbox.shrink_failed.take() {
                return Err(Error::ShrinkFailed { reason, retry });
            } else if inbox.reader_done {
                return Err(gone(&inbox));
            }
            let missing = inbox.shrink_withdrawn.take().unwrap_or_default();
            return Err(Error::timeout_since("shrink", started, &missing));
        }
        // This rank's exchange in the group the store shrank to (it fails if the group
        // goes on without this rank).
        let (survivors, epoch) = (inbox.survivors.clone(), inbox.epoch);
        drop(inbox);
        // The rank this process joined the store as.
        let job_rank = self.shared.config.launch.rank;
        let (world, took) = (survivors.len(), started.elapsed());
        let Some(rank) = survivors.iter().position(|&r| r as usize == job_rank) else {
            let reason = format!(
                "the store shrank the group to job ranks {survivors:?}, without this one ({job_rank})"
            );
            return Err(Error::shrink_failed(reason, false));
        };
        tracing::info!(
            "symmpool store: job rank {job_rank} is rank {rank} of {world} after the shrink (epoch {epoch}, {took:?})"
        );
        let next = Arc::new(StoreExchange {
            shared: self.shared.clone(),
            connection: self.connection.clone(),
            rounds: Rounds::new(rank, world, self.rounds.max_payload_bytes),
            epoch,
            successor: Mutex::new(None),
        });
        *successor = Some(next.clone());
        Ok(next)
    }
}
