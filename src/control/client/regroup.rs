//! [`StoreExchange::shrink`] and [`StoreExchange::grow`]: this rank's side of a
//! regrouping (the server's is in `store/regroup.rs`): one ask, withdrawn if it times
//! out, and this rank's exchange in the new group.

use super::{Inbox, Rounds, StoreExchange, error_for};
use crate::control::wire::{self, Cause, ToServer};
use crate::control::{Ask, Exchange, SHRUNK};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Instant;

impl StoreExchange {
    /// [`Exchange::shrink`]: every rank of this group that is still connected to the
    /// store asks, and once all have, the group is those ranks, numbered densely in
    /// their old order. The new exchange shares this one's connection and starts with
    /// no channel open but
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
        // (Only a grow is answered with no group.)
        self.regroup(Ask::Shrink, deadline)?.ok_or(SHRUNK)
    }

    /// [`Exchange::grow`]: every rank of this group asks, and once all have, the group
    /// is its ranks and the newcomers waiting to join it (processes started with
    /// `SYMMPOOL_JOIN=1` for job ranks this group went on without, see
    /// [`StoreConfig::join`](super::super::StoreConfig::join)), numbered densely in the
    /// order of their job ranks: a newcomer takes its job rank's place.
    /// `None` on every rank if no newcomer waits then and some rank asked with `wait`
    /// false; with `wait` true on every rank they wait for one, and the first rank
    /// whose `deadline` passes ends the wait for all of them (`None` everywhere). As
    /// for [`shrink`](Self::shrink), the new exchange shares this one's connection and
    /// starts afresh, this one fails every later call with [`Error::Shrunk`], and
    /// asking again returns the grown exchange.
    ///
    /// # Collective
    /// Every rank of the group calls it, at the same point of its calls (no round of
    /// this group in progress); it waits for them until `deadline`.
    ///
    /// # Errors
    /// [`Error::PeerLost`] (or [`Error::GroupBroken`], [`Error::DeclaredLost`]) at once
    /// when the group is broken, and on every rank that asked when a rank of the group
    /// is lost while they ask: shrink past the loss, then grow;
    /// [`Error::Shrunk`] on an exchange that a shrink replaced already;
    /// [`Error::CollectiveMismatch`] if other ranks asked to shrink meanwhile;
    /// [`Error::Timeout`] if a rank does not ask by `deadline`: this rank's ask is
    /// withdrawn, and the store confirms it, naming the ranks that had not asked (as
    /// for [`shrink`](Self::shrink)); had the group grown (or every rank asked)
    /// before the withdrawal reached the store, the outcome is returned instead.
    pub fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<StoreExchange>>> {
        self.regroup(Ask::Grow { wait }, deadline)
    }

    /// Ask the store for `ask` and wait for the answer until `deadline`: this rank's
    /// exchange in the new group, or `None` (a grow without a newcomer).
    fn regroup(&self, ask: Ask, deadline: Deadline) -> Result<Option<Arc<StoreExchange>>> {
        let mut successor = self.successor.lock();
        let (grow, op) = (ask != Ask::Shrink, ask.verb());
        if let Some(next) = successor.clone() {
            drop(successor);
            return match grow {
                true if next.rounds.world_size > self.rounds.world_size => Ok(Some(next)),
                true => Err(SHRUNK),
                // The survivors lost a rank too, or went on past such a loss: from there.
                false
                    if Exchange::lost_peer(&*next).is_some() || next.successor.lock().is_some() =>
                {
                    next.shrink(deadline).map(Some)
                }
                false => Ok(Some(next)),
            };
        }
        let started = Instant::now();
        // A grow is answered by the group breaking too.
        let broken = |ib: &Inbox| grow && ib.broken.is_some();
        // This rank declared lost itself, or the server gone (a grow: the group broken).
        let gone = |ib: &Inbox| match grow {
            true => error_for(ib, self.rounds.rank, op),
            false => self.gone(ib),
        };
        let inbox = self.inbox()?;
        if broken(&inbox) {
            return Err(gone(&inbox));
        }
        drop(inbox);
        // An earlier ask's withdrawal not confirmed yet: its answer is not this ask's.
        let pending_done = |ib: &mut Inbox| !ib.withdraw_pending || ib.reader_done;
        let mut inbox = self.shared.wait_until(deadline, pending_done);
        if inbox.reader_done {
            return Err(gone(&inbox));
        } else if inbox.withdraw_pending {
            return Err(Error::timeout_since(op, started, &[]));
        }
        (inbox.shrink_failed, inbox.shrink_withdrawn, inbox.not_grown) = (None, None, false);
        drop(inbox);
        let epoch = self.epoch;
        let ask = wire::encode(&match ask {
            Ask::Shrink => ToServer::Shrink { epoch },
            Ask::Grow { wait } => ToServer::Grow { epoch, wait },
        });
        if !self.shared.send_or_lose(&ask, "writing to") {
            return Err(gone(&self.shared.inbox.lock()));
        }
        let answered = |ib: &mut Inbox| {
            (ib.epoch != epoch || ib.reader_done || ib.shrink_failed.is_some() || ib.not_grown)
                || broken(ib)
        };
        let mut inbox = self.shared.wait_until(deadline, answered);
        if !answered(&mut inbox) {
            // Timed out: withdraw the ask, so that the others' asks never regroup with
            // this rank counted as asking, and wait for the server's word (on this
            // connection, in order): withdrawn, or the outcome.
            inbox = self.shared.withdraw(inbox, epoch, answered);
        }
        if inbox.epoch == epoch {
            if inbox.not_grown {
                return Ok(None);
            }
            return Err(match inbox.shrink_failed.take() {
                _ if broken(&inbox) => gone(&inbox),
                Some((reason, retry)) if !grow => Error::ShrinkFailed { reason, retry },
                Some((detail, _)) => Error::CollectiveMismatch { op, detail },
                None if inbox.reader_done => gone(&inbox),
                None => {
                    let missing = inbox.shrink_withdrawn.take().unwrap_or_default();
                    Error::timeout_since(op, started, &missing)
                }
            });
        }
        // This rank's exchange in the group the store regrouped to (a shrink fails if
        // the group goes on without this rank).
        let (group, epoch) = (inbox.group.clone(), inbox.epoch);
        drop(inbox);
        let Some(next) = self.member_of(&group, epoch, op, started) else {
            let job_rank = self.shared.config.launch.rank;
            let reason = format!(
                "the store shrank the group to job ranks {group:?}, without this one ({job_rank})"
            );
            return Err(Error::shrink_failed(reason, false));
        };
        let next = Arc::new(next);
        *successor = Some(next.clone());
        Ok(Some(next))
    }

    /// This rank's exchange in the group of `epoch`, the job ranks `group`, after `what`
    /// (a shrink, a grow, the join) that began at `started`; `None` if this rank's job
    /// rank is not one of them.
    pub(super) fn member_of(
        &self,
        group: &[u32],
        epoch: u64,
        what: &str,
        started: Instant,
    ) -> Option<StoreExchange> {
        let job_rank = self.shared.config.launch.rank;
        let rank = group.iter().position(|&r| r as usize == job_rank)?;
        let (world, took) = (group.len(), started.elapsed());
        tracing::info!(
            "symmpool store: job rank {job_rank} is rank {rank} of {world} after the {what} (epoch {epoch}, {took:?})"
        );
        Some(StoreExchange {
            shared: self.shared.clone(),
            connection: self.connection.clone(),
            rounds: Rounds::new(rank, world, self.rounds.max_payload_bytes),
            epoch,
            successor: Mutex::new(None),
        })
    }

    /// Why a shrink cannot be: this rank declared lost itself, or the server gone (as
    /// `ib` says).
    fn gone(&self, ib: &Inbox) -> Error {
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
        let detail =
            (ib.server_gone.clone().or(cause)).unwrap_or_else(|| "its connection closed".into());
        let reason = format!(
            "the store is gone ({detail}): the survivors cannot agree without it (a store that job rank 0 hosts goes with it; with SYMMPOOL_STORE_EXTERNAL=1 the store runs in a process of its own and any rank can be lost)"
        );
        Error::shrink_failed(reason, false)
    }
}
