//! The ledger: everything the ranks of one communicator set compare, as one ordered
//! stream of typed records ([`Entry`]) on one exchange channel, with one verdict.
//!
//! Each rank appends its records in its call order; rounds of the exchange carry
//! batches of them, and every rank compares the heads of the same per-rank queues in
//! lock-step, so every rank finds the same first difference at the same record.
//! Collectives and step boundaries are compared field by field here; agreements go
//! back to their pool, which judges them ([`agree_records`](super::agree_records)); a
//! rank whose record is of another kind than its peers' is a divergence at once.
//!
//! Who drives the rounds: under [`CheckMode::Async`] a background thread (callers
//! post and return, at most `capacity` records of theirs uncompared); otherwise the
//! caller whose record needs a verdict, holding the queues of records while it is in a
//! round (one lock guards the life cycle, the queues and the verdict).

use super::agree::AgreementRecord;
use super::collective::CollectiveRecord;
use super::record::{self, Fields, first_difference};
use crate::control::{ChannelId, Exchange};
use crate::deadline::Deadline;
use crate::error::{CollectiveDivergence, Error, ErrorKind, Result};
#[cfg(not(all(test, shuttle)))]
use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(not(all(test, shuttle)))]
use std::thread::{self, JoinHandle};
// The model check's locks and threads (tests/unit/group/ledger_model.rs).
use std::time::Duration;
#[cfg(all(test, shuttle))]
use {
    shuttle::thread::{self, JoinHandle},
    tests::model::{Condvar, Mutex, MutexGuard},
};

/// How the ranks check that they make the same collectives on the same buffers (see
/// [`coll`](crate::coll), "Checked collectives"): a group's
/// [`GroupConfig::check`](crate::GroupConfig::check). Ranks whose groups use different
/// modes fail when they make them ([`Error::ChannelMismatch`](crate::Error::ChannelMismatch)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckMode {
    /// No per-collective check: a divergence is silent (NCCL reads peers at the
    /// caller's offsets) or a hang, exactly as without the crate.
    Off,
    /// The calling thread posts each collective's record and returns; a background
    /// thread compares the ranks' records. A mismatch makes the next call on the pool
    /// fail on every rank. The default (at world size 1 every pool runs as `Off`:
    /// there is no peer).
    #[default]
    Async,
    /// The ranks exchange and compare each collective's record before it is
    /// launched: a mismatch is an error on every rank and no data moves.
    Strict,
}

impl CheckMode {
    /// The mode's name, as in the channel name and the example's `--check` flag.
    pub fn name(self) -> &'static str {
        match self {
            CheckMode::Off => "off",
            CheckMode::Async => "async",
            CheckMode::Strict => "strict",
        }
    }
}

/// One record of the ledger.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Entry {
    /// A collective, or a step boundary.
    Collective(CollectiveRecord),
    /// A collective pool operation's agreement: the ranks' records go back to the
    /// pool, which judges them.
    Agreement(Box<AgreementRecord>),
}

/// The longest a ledger's drop waits for its thread's last round, and then again for
/// the round it abandons.
const DROP_WAIT: Duration = Duration::from_secs(2);
/// Most records one round carries per rank.
const MAX_BATCH: usize = 256;
/// Most records a queue allocates room for when it is made (a record is about 150
/// bytes): a queue up to this capacity never allocates when a record is posted.
pub(crate) const PREALLOCATED_RECORDS: usize = 4096;
/// More than the bytes of one encoded collective record (20 varints of at most 10
/// bytes, tags).
const MAX_RECORD_BYTES: usize = 256;

/// Where a ledger compares, and how: made once per communicator set.
pub(crate) struct LedgerConfig {
    pub(crate) exchange: Arc<dyn Exchange>,
    pub(crate) channel: ChannelId,
    /// How long one round waits for the peers.
    pub(crate) timeout: Duration,
    /// Under `Async`: most records of this rank not yet compared when a post returns.
    pub(crate) capacity: usize,
    /// Called once when a comparison finds a divergence: ends this rank's collectives
    /// that wait for peers who will not come (the backend's
    /// [`Collectives::abandon`](crate::backend::Collectives::abandon)).
    pub(crate) abandon: Box<dyn Fn() + Send + Sync>,
    /// The pools' names, by pool (channel ordinal), for the divergence report.
    pub(crate) users: super::set::Users,
}

/// The ledger of one communicator set (see the module documentation).
pub(crate) struct Ledger {
    shared: Arc<Shared>,
    /// Held from a collective's record (its round under `Strict`, its post under
    /// `Async`) to its launch, so that the records' order is the launches' order.
    launch: Mutex<()>,
}

/// What the callers and the background thread share: one state under one lock.
struct Shared {
    config: LedgerConfig,
    /// The verdict's mirror for the collectives' path: set (once, never cleared) under
    /// the lock right after [`State::failure`], so that a call reads it without the lock.
    broken: AtomicBool,
    state: Mutex<State>,
    /// Notified on every change of the state: records posted or compared, a round
    /// begun or ended, the verdict, the drop, the thread's end.
    changed: Condvar,
}

struct State {
    life: Life,
    /// The one verdict, which every pool over the communicators reads: set once. What
    /// later calls on its pools report: [`Error::CollectiveDivergence`] (the ranks'
    /// records differed), a failure of the group again as it was ([`Error::group_failure`]:
    /// a runtime sorting by kind sees a loss as a loss whichever call met it first), or
    /// [`Error::PoolBroken`] (a round that timed out, a collective that failed, an
    /// unreadable payload).
    failure: Option<Error>,
    /// This rank's records not yet sent.
    pending: VecDeque<Entry>,
    /// Records of this rank posted, and compared, in total.
    posted: u64,
    compared: u64,
    /// Every rank's records not yet compared; `None` while a thread of this rank is
    /// in a round (it holds them: one round at a time).
    rounds: Option<Rounds>,
}

/// Who drives the rounds, from the ledger's making to the end of its thread.
enum Life {
    /// The callers that need a verdict (no thread: `Strict`, `Off`).
    Callers,
    /// The background thread (`Async`), and the callers that wait for a verdict.
    Thread(JoinHandle<()>),
    /// The ledger was dropped: the thread compares what this rank posted and ends
    /// (its round abandoned if the peers do not come); what it finds no longer counts.
    Dropped,
    /// The thread has ended; its handle, if it ended before the ledger was dropped
    /// (the drop joins it).
    Ended(Option<JoinHandle<()>>),
}

/// Every rank's records not yet compared, and the comparisons made.
struct Rounds {
    seen: Vec<VecDeque<Entry>>,
    compared: u64,
}

impl Ledger {
    /// The ledger of a communicator set, comparing on `config.channel`; no thread
    /// yet (see [`start`](Self::start)).
    pub(crate) fn new(mut config: LedgerConfig) -> Self {
        let world = config.exchange.world_size();
        config.capacity = config.capacity.max(1);
        let state = State {
            life: Life::Callers,
            failure: None,
            pending: VecDeque::new(),
            posted: 0,
            compared: 0,
            rounds: Some(Rounds {
                seen: vec![VecDeque::new(); world],
                compared: 0,
            }),
        };
        let shared = Shared {
            config,
            broken: AtomicBool::new(false),
            state: Mutex::new(state),
            changed: Condvar::new(),
        };
        Ledger {
            shared: Arc::new(shared),
            launch: Mutex::new(()),
        }
    }

    /// Start the thread that compares posted records (once; for the first pool
    /// checked under [`CheckMode::Async`]), with the queue allocated whole (up to
    /// [`PREALLOCATED_RECORDS`] records), so that posting a record neither starts a
    /// thread nor allocates.
    ///
    /// # Errors
    /// [`Error::Internal`] if the thread cannot be started.
    pub(crate) fn start(&self) -> Result<()> {
        let s = &self.shared;
        let mut st = s.state.lock();
        if !matches!(st.life, Life::Callers) {
            return Ok(());
        }
        st.pending
            .reserve(s.config.capacity.min(PREALLOCATED_RECORDS));
        let worker = Arc::clone(s);
        let handle = thread::Builder::new()
            .name("symmpool-ledger".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::internal(format!("could not start the ledger's thread: {e}")))?;
        st.life = Life::Thread(handle);
        Ok(())
    }

    /// The failure that broke the ledger, if any.
    #[inline]
    pub(crate) fn failure(&self) -> Option<Error> {
        if !self.shared.broken.load(Ordering::Acquire) {
            return None;
        }
        self.shared.state.lock().failure.clone()
    }

    /// Fail if a comparison (or a collective that failed) broke the ledger.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        // The verdict out of line (cold): a broken ledger is off the call path.
        if self.shared.broken.load(Ordering::Acquire) {
            return self.shared.state.lock().verdict();
        }
        Ok(())
    }

    /// The launch lock: held by the caller from a collective's record to its launch.
    pub(crate) fn launch_lock(&self) -> MutexGuard<'_, ()> {
        self.launch.lock()
    }

    /// Append a collective's (or a step's) record, as `mode` (its pool's) says: under
    /// `Strict` compared before this returns (the caller holds the launch lock until
    /// its launch), under `Async` posted (waiting, until `deadline`, while `capacity`
    /// of this rank's records are still to be compared), under `Off` nothing.
    ///
    /// `deadline` makes the call's deadline when a wait needs it, so that an async
    /// post that finds room does not read the clock.
    pub(crate) fn submit(
        &self,
        mode: CheckMode,
        record: CollectiveRecord,
        deadline: impl FnOnce() -> Deadline,
    ) -> Result<()> {
        match mode {
            CheckMode::Off => Ok(()),
            CheckMode::Strict => (self.settle(
                Some(Entry::Collective(record)),
                deadline(),
                "strict collective check",
            ))
            .map(drop),
            CheckMode::Async => self.post(Entry::Collective(record), deadline),
        }
    }

    /// Append an agreement record and return every rank's record of it (in rank
    /// order), once every record before it is compared, waiting until `deadline`.
    ///
    /// # Errors
    /// The ledger's failure ([`Error::CollectiveDivergence`] where a rank's record is
    /// of another kind, [`Error::PoolBroken`], [`Error::PeerLost`]); the exchange's
    /// errors (named `during`): [`Error::Timeout`] if a rank does not arrive by
    /// `deadline` (the exchange then fails later rounds with
    /// [`Error::GroupBroken`]: the ranks' rounds are out of step).
    pub(crate) fn agree(
        &self,
        mine: AgreementRecord,
        during: &'static str,
        deadline: Deadline,
    ) -> Result<Vec<AgreementRecord>> {
        let entry = Entry::Agreement(Box::new(mine));
        (self.settle(Some(entry), deadline, during)?).ok_or_else(|| {
            Error::internal("the ledger compared an agreement but kept no records of it")
        })
    }

    /// Wait until every record this rank appended is compared, at most until
    /// `deadline`, then return the verdict.
    ///
    /// # Errors
    /// The ledger's failure; [`Error::Timeout`] by `deadline`.
    pub(crate) fn wait_compared(&self, deadline: Deadline) -> Result<()> {
        self.settle(None, deadline, "waiting for the collective checks")
            .map(drop)
    }

    /// What a collective that failed with `e` reports: the divergence this rank's
    /// comparisons found, else `e` (breaking the ledger if the ranks are now out of
    /// step). A call failed by its peers (ended by a peer's failed comparison, or a
    /// peer gone after it found one) first waits until `deadline` for this rank's
    /// comparisons, which find the same divergence in the same round.
    pub(crate) fn call_failed(&self, e: Error, deadline: impl FnOnce() -> Deadline) -> Error {
        let peers = matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerLost)
            || matches!(
                e,
                Error::GroupBroken { .. } | Error::CollectiveMismatch { .. }
            );
        let diverged = || {
            self.failure()
                .filter(|e| matches!(e, Error::CollectiveDivergence(_)))
        };
        if peers && diverged().is_none() {
            let _ = self.wait_compared(deadline());
        }
        if let Some(d) = diverged() {
            return d;
        }
        if peers || e.group_failure().is_some() || matches!(e, Error::Nccl { .. }) {
            self.shared.failed_by("a collective on this pool", &e);
        }
        e
    }

    /// Async: post `entry` and return, once at most `capacity` of this rank's earlier
    /// records are still to be compared (waiting for that until the deadline `room`
    /// makes, capped at twice the round timeout). So the verdict on record *k* is known
    /// before record *k* + `capacity` + 1 is posted: after a mismatch, at most
    /// `capacity` further collectives of this rank are launched (and may return `Ok`).
    fn post(&self, entry: Entry, room: impl FnOnce() -> Deadline) -> Result<()> {
        let s = &self.shared;
        let mut st = s.state.lock();
        st.verdict()?;
        let capacity = s.config.capacity as u64;
        if st.posted - st.compared > capacity {
            let patience = s.config.timeout.saturating_mul(2);
            let deadline = room().cap(patience);
            while st.posted - st.compared > capacity {
                let late = s
                    .changed
                    .wait_until(&mut st, deadline.instant())
                    .timed_out();
                st.verdict()?;
                if late && st.posted - st.compared > capacity {
                    drop(st);
                    let why =
                        format!("the async collective check made no progress for {patience:?}");
                    return Err(s.fail(why));
                }
            }
        }
        st.pending.push_back(entry);
        st.posted += 1;
        drop(st);
        s.changed.notify_all();
        Ok(())
    }

    /// Append `entry` (if any) and drive the rounds on this thread until it (or, with
    /// none, every record of this rank posted so far) is compared, or the ledger
    /// broke, or `deadline`; every rank's records of the agreement `entry`, if it is
    /// one. The caller holds the rounds from before it appends its record until it is
    /// compared, so it compares its agreement itself. The exchange's rounds are named
    /// `what`. A round that fails breaks the ledger unless `entry` is an agreement and
    /// the round carried no collective's record (a collective's check lost with the
    /// round could never be made).
    fn settle(
        &self,
        entry: Option<Entry>,
        deadline: Deadline,
        what: &'static str,
    ) -> Result<Option<Vec<AgreementRecord>>> {
        let agreement = matches!(entry, Some(Entry::Agreement(_)));
        let s = &self.shared;
        let started = std::time::Instant::now();
        let mut st = s.state.lock();
        let posted = st.posted;
        // Another thread of this rank may be in a round: wait for its rounds, or for
        // it to compare what this call waits for.
        let mut rounds = loop {
            st.verdict()?;
            if entry.is_none() && st.compared >= posted {
                return Ok(None);
            }
            if let Some(rounds) = st.rounds.take() {
                break rounds;
            }
            if s.changed
                .wait_until(&mut st, deadline.instant())
                .timed_out()
            {
                st.verdict()?;
                return Err(Error::timeout_since(what, started, &[]));
            }
        };
        if let Some(entry) = entry {
            st.pending.push_back(entry);
            st.posted += 1;
        }
        let n = st.posted;
        let mut agreed = None;
        let out = loop {
            if let Err(e) = st.verdict() {
                break Err(e);
            }
            if st.compared >= n {
                break Ok(agreed);
            }
            let batch = st.take_batch();
            drop(st);
            // A round that fails loses the records it carried: if any was a
            // collective's, its check can never be made, so the ledger breaks with
            // the round's failure (an agreement's round alone fails only its call).
            let carried = batch.iter().any(|e| matches!(e, Entry::Collective(_)));
            let round = s.round(&mut rounds, batch, deadline, what);
            st = s.state.lock();
            match round {
                Ok(records) => agreed = records.or(agreed),
                Err(e) if st.failure.is_some() => break Err(e),
                Err(e) => {
                    if !agreement || carried {
                        drop(st);
                        s.failed_by(what, &e);
                        st = s.state.lock();
                    }
                    break Err(e);
                }
            }
        };
        st.rounds = Some(rounds);
        drop(st);
        s.changed.notify_all();
        out
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // The thread finishes the rounds of the records already posted (the peers post
        // theirs) and ends; wait for that, at most the timeout and `DROP_WAIT`, so
        // that its handle on the exchange is gone when the ledger is. A thread still
        // in a round then (its peers gone, or far behind) has its round abandoned and
        // is waited for once more; an exchange that cannot abandon a round leaves it
        // to end on its own, detached.
        let s = &self.shared;
        let mut st = s.state.lock();
        let handle = match std::mem::replace(&mut st.life, Life::Dropped) {
            Life::Thread(handle) => handle,
            // Ended on its own (a failure): joined below, without waiting for a state.
            Life::Ended(Some(handle)) => {
                st.life = Life::Ended(None);
                handle
            }
            _ => return,
        };
        s.changed.notify_all();
        let mut deadline = Deadline::after(s.config.timeout.min(DROP_WAIT));
        let mut abandoned = false;
        while !matches!(st.life, Life::Ended(_)) {
            if s.changed
                .wait_until(&mut st, deadline.instant())
                .timed_out()
            {
                if abandoned {
                    return;
                }
                abandoned = true;
                drop(st);
                s.config.exchange.abandon(s.config.channel);
                deadline = Deadline::after(DROP_WAIT);
                st = s.state.lock();
            }
        }
        drop(st);
        // Joined, so that whoever drops the ledger drops the exchange too, at once (a
        // hosting rank's exchange then waits for the others' goodbyes before the
        // process may exit), not the thread some time later.
        if handle.thread().id() != thread::current().id() {
            let _ = handle.join();
        }
    }
}

impl State {
    /// The verdict: the failure's error, if the ledger broke.
    #[cold]
    fn verdict(&self) -> Result<()> {
        self.failure.clone().map_or(Ok(()), Err)
    }

    /// The next batch of this rank's records (at most [`MAX_BATCH`]).
    fn take_batch(&mut self) -> Vec<Entry> {
        let n = self.pending.len().min(MAX_BATCH);
        self.pending.drain(..n).collect()
    }
}

impl Shared {
    /// Break the ledger with `failure` (the first wins; none once the ledger is
    /// dropped), wake every waiter, and on a divergence end the collectives waiting
    /// for peers who will not come; the verdict's error.
    fn break_with(&self, failure: Error) -> Error {
        let mut st = self.state.lock();
        if let Some(first) = &st.failure {
            return first.clone();
        }
        if matches!(st.life, Life::Dropped | Life::Ended(_)) {
            return failure;
        }
        // Every call on the pools returns the failure from now on: the caller decides
        // what it deserves (a loss may be shrunk past). A divergence, a bug of the
        // program that a background thread may find, is a warning.
        let diverged = matches!(failure, Error::CollectiveDivergence(_));
        if diverged {
            tracing::warn!(target: "symmpool::coll", divergence = %failure, "collective check failed");
        } else {
            tracing::debug!(target: "symmpool::coll", reason = %failure.reason(), "pool broken");
        }
        st.failure = Some(failure.clone());
        self.broken.store(true, Ordering::Release);
        drop(st);
        self.changed.notify_all();
        if diverged {
            (self.config.abandon)();
        }
        failure
    }

    fn fail(&self, reason: String) -> Error {
        self.break_with(Error::PoolBroken { reason })
    }

    /// A round named `what` failed with `e`: break the ledger, keeping a failure of
    /// the group (a lost peer, above all) to report again as it was.
    fn failed_by(&self, what: &str, e: &Error) {
        match e.group_failure() {
            Some(f) => self.break_with(f.clone()),
            None => self.fail(format!("{what} failed: {e}")),
        };
    }

    /// One round: send `batch`, add every rank's records to the queues, compare what
    /// every rank has; every rank's records of an agreement compared, if any.
    fn round(
        &self,
        rounds: &mut Rounds,
        batch: Vec<Entry>,
        deadline: Deadline,
        what: &'static str,
    ) -> Result<Option<Vec<AgreementRecord>>> {
        let c = &self.config;
        let payload = record::encode_sized(&batch, 16 + batch.len() * MAX_RECORD_BYTES)?;
        let all = c.exchange.all_gather(c.channel, what, &payload, deadline)?;
        let (me, world) = (c.exchange.rank(), rounds.seen.len());
        if all.len() != world {
            return Err(self.fail(format!("{} payloads for {world} ranks", all.len())));
        }
        // This rank's records as posted, never decoded again.
        rounds.seen[me].extend(batch);
        for (rank, p) in all.iter().enumerate().filter(|(rank, _)| *rank != me) {
            let Some(entries) = record::decode::<Vec<Entry>>(p) else {
                return Err(self.fail(format!("rank {rank} sent an unreadable check record")));
            };
            rounds.seen[rank].extend(entries);
        }
        let mut agreed = None;
        while rounds.seen.iter().all(|q| !q.is_empty()) {
            let heads: Vec<Entry> = rounds
                .seen
                .iter_mut()
                .filter_map(VecDeque::pop_front)
                .collect();
            rounds.compared += 1;
            if let Some(d) = self.compare(&heads, rounds.compared) {
                return Err(self.break_with(Error::CollectiveDivergence(d)));
            }
            if let Some(Entry::Agreement(_)) = heads.first() {
                let records = heads.into_iter().filter_map(|e| match e {
                    Entry::Agreement(a) => Some(*a),
                    Entry::Collective(_) => None,
                });
                agreed = Some(records.collect());
            }
        }
        self.state.lock().compared = rounds.compared;
        self.changed.notify_all();
        Ok(agreed)
    }

    /// The first difference of the ranks' records `heads` (the `number`th compared),
    /// as a divergence; agreements of every rank are not compared here.
    fn compare(&self, heads: &[Entry], number: u64) -> Option<Box<CollectiveDivergence>> {
        let me = self.config.exchange.rank();
        let collectives: Option<Vec<CollectiveRecord>> = (heads.iter())
            .map(|e| match e {
                Entry::Collective(r) => Some(*r),
                Entry::Agreement(_) => None,
            })
            .collect();
        let (field, values) = match collectives {
            Some(records) => first_difference(&records)?,
            None if heads.iter().all(|e| matches!(e, Entry::Agreement(_))) => return None,
            None => {
                // The record kind with where the rank is.
                let describe = |e: &Entry| match e {
                    Entry::Collective(r) => r.describe(0),
                    Entry::Agreement(a) => a.describe_kind(),
                };
                (
                    "record kind",
                    heads.iter().map(describe).enumerate().collect(),
                )
            }
        };
        let pool = match &heads[me] {
            Entry::Collective(r) => r.pool,
            Entry::Agreement(a) => a.pool,
        };
        let found_by = match self.state.lock().life {
            Life::Callers => "strict check",
            _ => "async check",
        };
        Some(Box::new(CollectiveDivergence {
            pool: (self.config.users.lock().get(&pool)).map_or_else(String::new, |u| u.0.clone()),
            found_by,
            record: number,
            field,
            values,
        }))
    }

    /// The background thread of an `Async` ledger: rounds of posted records, until the
    /// ledger breaks or is dropped.
    ///
    /// A rank whose own queue of uncompared records is not empty (it is ahead) joins
    /// the next round at once, with whatever it has; the others join once they have
    /// a record to add. So no rank spins, and no round waits on a rank that has
    /// posted nothing unless a peer is ahead of it.
    fn run(self: Arc<Self>) {
        let me = self.config.exchange.rank();
        let what = "async collective check";
        let mut st = self.state.lock();
        while st.failure.is_none() {
            // Work: this rank's records to send, or its records sent and not yet
            // compared (`None` while a caller is in a round).
            let rounds = st.rounds.as_ref();
            let work = rounds.map(|r| !r.seen[me].is_empty() || !st.pending.is_empty());
            match (work, &st.life) {
                (Some(true), _) => {}
                (Some(false), Life::Dropped) => break,
                _ => {
                    self.changed.wait(&mut st);
                    continue;
                }
            }
            let Some(mut rounds) = st.rounds.take() else {
                continue;
            };
            let batch = st.take_batch();
            drop(st);
            let deadline = Deadline::after(self.config.timeout);
            let round = self.round(&mut rounds, batch, deadline, what);
            if let Err(e) = &round {
                self.failed_by(what, e);
            }
            st = self.state.lock();
            st.rounds = Some(rounds);
            self.changed.notify_all();
            if round.is_err() {
                break;
            }
        }
        // The handle stays for the drop to join (the thread may still hold the
        // exchange when it gets there).
        if let Life::Thread(handle) = std::mem::replace(&mut st.life, Life::Ended(None)) {
            st.life = Life::Ended(Some(handle));
        }
        self.changed.notify_all();
    }
}

#[cfg(test)]
#[path = "../../tests/unit/group/ledger.rs"]
mod tests;
