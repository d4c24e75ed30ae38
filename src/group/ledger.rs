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
//! caller whose record needs a verdict, under the rounds lock.

use super::agree::AgreementRecord;
use super::collective::CollectiveRecord;
use super::record::{self, Fields, first_difference};
use crate::control::{ChannelId, Exchange};
use crate::deadline::Deadline;
use crate::error::{CollectiveDivergence, Error, ErrorKind, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Entry {
    /// A collective, or a step boundary.
    Collective(CollectiveRecord),
    /// A collective pool operation's agreement: the ranks' records go back to the
    /// pool, which judges them.
    Agreement(Box<AgreementRecord>),
}

/// Why the ledger broke: what later calls on its pools report.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The ranks' records differed: later calls fail with [`Error::CollectiveDivergence`].
    Diverged(Box<CollectiveDivergence>),
    /// A peer was lost, or the group broke (a round or a collective saw it): later
    /// calls fail with the same error, of the same kind, so that a runtime sorting by
    /// kind sees a loss as a loss whichever call met it first.
    Peer(PeerFailure),
    /// Another failure (a round that timed out, a collective that failed, an
    /// unreadable payload): later calls fail with [`Error::PoolBroken`].
    Broken(String),
}

/// An error of the group that broke a ledger (a loss, of kind [`ErrorKind::PeerLost`]
/// or [`ErrorKind::GroupLost`]; or the group shrank under it), kept to be reported
/// again.
#[derive(Debug, Clone)]
pub(crate) enum PeerFailure {
    /// [`Error::PeerLost`].
    Lost {
        rank: usize,
        op: &'static str,
        detail: String,
    },
    /// [`Error::GroupBroken`].
    GroupBroken { rank: usize, op: &'static str },
    /// [`Error::DeclaredLost`].
    DeclaredLost { rank: usize, detail: String },
    /// [`Error::NcclAborted`].
    NcclAborted { reason: String },
    /// [`Error::Shrunk`]: the group shrank under a round (another thread's shrink).
    Shrunk { what: &'static str },
}

impl PeerFailure {
    /// `e` (or the error it defers) as a failure of the group, if it is one.
    pub(crate) fn of(e: &Error) -> Option<PeerFailure> {
        Some(match e {
            Error::PeerLost { rank, op, detail } => PeerFailure::Lost {
                rank: *rank,
                op,
                detail: detail.clone(),
            },
            Error::GroupBroken { rank, op } => PeerFailure::GroupBroken { rank: *rank, op },
            Error::DeclaredLost { rank, detail } => PeerFailure::DeclaredLost {
                rank: *rank,
                detail: detail.clone(),
            },
            Error::NcclAborted { reason } => PeerFailure::NcclAborted {
                reason: reason.clone(),
            },
            Error::Shrunk { what } => PeerFailure::Shrunk { what },
            Error::Deferred { source, .. } => return Self::of(source),
            _ => return None,
        })
    }

    /// The error again.
    pub(crate) fn error(&self) -> Error {
        match self.clone() {
            PeerFailure::Lost { rank, op, detail } => Error::PeerLost { rank, op, detail },
            PeerFailure::GroupBroken { rank, op } => Error::GroupBroken { rank, op },
            PeerFailure::DeclaredLost { rank, detail } => Error::DeclaredLost { rank, detail },
            PeerFailure::NcclAborted { reason } => Error::NcclAborted { reason },
            PeerFailure::Shrunk { what } => Error::Shrunk { what },
        }
    }
}

impl Failure {
    /// The failure as a reason ([`Error::PoolBroken`]'s).
    pub(crate) fn reason(&self) -> String {
        match self {
            Failure::Diverged(d) => d.to_string(),
            Failure::Peer(p) => p.error().to_string(),
            Failure::Broken(reason) => reason.clone(),
        }
    }

    /// The error later calls report: the divergence, the group's failure again, or
    /// [`Error::PoolBroken`].
    pub(crate) fn error(&self) -> Error {
        match self {
            Failure::Diverged(d) => Error::CollectiveDivergence(d.clone()),
            Failure::Peer(p) => p.error(),
            Failure::Broken(reason) => Error::PoolBroken {
                reason: reason.clone(),
            },
        }
    }
}

/// The longest a ledger's drop waits for its thread's last round.
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
}

/// The ledger of one communicator set (see the module documentation).
pub(crate) struct Ledger {
    shared: Arc<Shared>,
    /// Held from a collective's record (its round under `Strict`, its post under
    /// `Async`) to its launch, so that the records' order is the launches' order.
    launch: Mutex<()>,
    /// The background thread, once started: joined on drop, so that its handles on
    /// the exchange are gone when the ledger is.
    worker: Mutex<Option<JoinHandle<()>>>,
}

/// What the callers and the background thread share.
struct Shared {
    config: LedgerConfig,
    /// The pools' names, by pool (channel ordinal), for the divergence report.
    names: Mutex<BTreeMap<u64, String>>,
    /// Set with the first failure: read lock-free on every collective.
    broken: AtomicBool,
    /// The thread runs (a pool over the communicators is checked under `Async`): the
    /// checks are the async checks, whoever drives a round.
    threaded: AtomicBool,
    failure: OnceLock<Failure>,
    /// The ledger was dropped while its thread was still in a round: what that round
    /// finds no longer counts.
    detached: AtomicBool,
    queue: Mutex<Queue>,
    /// The background thread waits here for records.
    posted: Condvar,
    /// Callers wait here for room, or for their records to be compared.
    progress: Condvar,
    /// The rounds' state: one round at a time on this rank.
    rounds: Mutex<Rounds>,
}

#[derive(Default)]
struct Queue {
    pending: VecDeque<Entry>,
    /// Records of this rank posted, and compared, in total.
    posted: u64,
    compared: u64,
    /// Agreements compared and not yet taken by their callers: (this rank's record
    /// number, every rank's record).
    agreed: Vec<(u64, Vec<AgreementRecord>)>,
    /// This rank has records sent and not yet compared (the thread then joins the
    /// next round at once).
    ahead: bool,
    /// The background thread waits on `posted` (only then does a post notify it).
    idle: bool,
    started: bool,
    stop: bool,
    /// The background thread has exited.
    done: bool,
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
        let shared = Arc::new(Shared {
            names: Mutex::default(),
            broken: AtomicBool::new(false),
            threaded: AtomicBool::new(false),
            failure: OnceLock::new(),
            detached: AtomicBool::new(false),
            queue: Mutex::default(),
            posted: Condvar::new(),
            progress: Condvar::new(),
            rounds: Mutex::new(Rounds {
                seen: vec![VecDeque::new(); world],
                compared: 0,
            }),
            config,
        });
        Ledger {
            shared,
            launch: Mutex::new(()),
            worker: Mutex::new(None),
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
        let mut q = s.queue.lock();
        if q.started {
            return Ok(());
        }
        q.pending
            .reserve(s.config.capacity.min(PREALLOCATED_RECORDS));
        let worker = Arc::clone(s);
        let handle = std::thread::Builder::new()
            .name("symmpool-ledger".into())
            .spawn(move || worker.run())
            .map_err(|e| Error::Internal {
                what: format!("could not start the ledger's thread: {e}"),
            })?;
        *self.worker.lock() = Some(handle);
        q.started = true;
        s.threaded.store(true, Ordering::Release);
        Ok(())
    }

    /// Name pool `pool` (its channel ordinal) `name` in divergence reports.
    pub(crate) fn name_pool(&self, pool: u64, name: &str) {
        self.shared.names.lock().insert(pool, name.to_string());
    }

    /// The failure that broke the ledger, if any.
    pub(crate) fn failure(&self) -> Option<&Failure> {
        self.shared.failure.get()
    }

    /// Fail if a comparison (or a collective that failed) broke the ledger.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        if self.shared.broken.load(Ordering::Acquire) {
            return Err(self.shared.error());
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
            CheckMode::Strict => {
                let entry = Entry::Collective(record);
                self.settle(Some(entry), deadline(), "strict collective check")
                    .map(drop)
            }
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
        let n = self.settle(Some(Entry::Agreement(Box::new(mine))), deadline, during)?;
        let mut q = self.shared.queue.lock();
        let at = q.agreed.iter().position(|(k, _)| *k == n);
        at.map(|i| q.agreed.swap_remove(i).1)
            .ok_or_else(|| Error::Internal {
                what: format!("the ledger compared agreement #{n} but kept no records of it"),
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
        if peers && self.shared.divergence().is_none() {
            let _ = self.wait_compared(deadline());
        }
        if let Some(d) = self.shared.divergence() {
            return Error::CollectiveDivergence(Box::new(d.clone()));
        }
        if let Some(p) = PeerFailure::of(&e) {
            self.shared.break_with(Failure::Peer(p));
        } else if peers || matches!(e, Error::Nccl { .. }) {
            self.shared
                .fail(format!("a collective on this pool failed: {e}"));
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
        let mut q = s.queue.lock();
        self.check()?;
        let capacity = s.config.capacity as u64;
        if q.posted - q.compared > capacity {
            let patience = s.config.timeout.saturating_mul(2);
            let deadline = room().cap(patience);
            while q.posted - q.compared > capacity && !q.done {
                self.check()?;
                if s.progress
                    .wait_until(&mut q, deadline.instant())
                    .timed_out()
                    && q.posted - q.compared > capacity
                {
                    drop(q);
                    s.fail(format!(
                        "the async collective check made no progress for {patience:?}"
                    ));
                    return Err(s.error());
                }
            }
            self.check()?;
        }
        q.pending.push_back(entry);
        q.posted += 1;
        if q.idle {
            s.posted.notify_one();
        }
        Ok(())
    }

    /// Append `entry` (if any) and drive the rounds on this thread until it (or, with
    /// none, every record of this rank posted so far) is compared, or the ledger
    /// broke, or `deadline`; the record's number among this rank's records. The
    /// exchange's rounds are named `what`. A round that fails breaks the ledger unless
    /// `entry` is an agreement and the round carried no collective's record (a
    /// collective's check lost with the round could never be made).
    fn settle(&self, entry: Option<Entry>, deadline: Deadline, what: &'static str) -> Result<u64> {
        let agreement = matches!(entry, Some(Entry::Agreement(_)));
        let s = &self.shared;
        self.check()?;
        let started = std::time::Instant::now();
        let Some(mut rounds) = s.rounds.try_lock_until(deadline.instant()) else {
            // Another thread of this rank was in a round all along: its failure, if
            // it failed, else how long this call waited for it.
            self.check()?;
            return Err(Error::timeout_since(what, started, &[]));
        };
        let n = {
            let mut q = s.queue.lock();
            if let Some(entry) = entry {
                q.pending.push_back(entry);
                q.posted += 1;
            }
            q.posted
        };
        while s.queue.lock().compared < n {
            self.check()?;
            let batch = s.take_batch();
            // A round that fails loses the records it carried: if any was a
            // collective's, its check can never be made, so the ledger breaks with
            // the round's failure (an agreement's round alone fails only its call).
            let carried = batch.iter().any(|e| matches!(e, Entry::Collective(_)));
            if let Err(e) = s.round(&mut rounds, batch, deadline, what) {
                if s.broken.load(Ordering::Acquire) {
                    return Err(s.error());
                }
                if !agreement || carried {
                    s.failed_by(what, &e);
                }
                return Err(e);
            }
        }
        self.check()?;
        Ok(n)
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        // The thread finishes the rounds of the records already posted (the peers post
        // theirs) and exits; wait for that, at most the timeout and `DROP_WAIT`, so
        // that its handle on the exchange is gone when the ledger is. A thread still
        // in a round then (its peers gone, or far behind) is left to end it on its
        // own, detached: what it finds no longer counts.
        let s = &self.shared;
        let deadline = Deadline::after(s.config.timeout.min(DROP_WAIT));
        let mut q = s.queue.lock();
        q.stop = true;
        s.posted.notify_all();
        if q.started {
            while !q.done {
                if s.progress
                    .wait_until(&mut q, deadline.instant())
                    .timed_out()
                {
                    s.detached.store(true, Ordering::Release);
                    return;
                }
            }
        }
        drop(q);
        // Done: the thread only lets go of its handles (not the last: this ledger
        // holds one) and exits. Joined, so that whoever drops the ledger drops the
        // exchange too, at once (a hosting rank's exchange then waits for the others'
        // goodbyes before the process may exit), not the thread some time later.
        let worker = self.worker.get_mut().take();
        if let Some(h) = worker.filter(|h| h.thread().id() != std::thread::current().id()) {
            let _ = h.join();
        }
    }
}

impl Shared {
    fn divergence(&self) -> Option<&CollectiveDivergence> {
        match self.failure.get() {
            Some(Failure::Diverged(d)) => Some(d),
            _ => None,
        }
    }

    /// The error a broken ledger's calls return.
    fn error(&self) -> Error {
        match self.failure.get() {
            Some(failure) => failure.error(),
            None => Error::PoolBroken {
                reason: "a check failed".into(),
            },
        }
    }

    /// Break the ledger with `failure` (the first wins), wake every waiter, and on a
    /// divergence end the collectives waiting for peers who will not come.
    fn break_with(&self, failure: Failure) {
        if self.detached.load(Ordering::Acquire) {
            return;
        }
        let diverged = matches!(failure, Failure::Diverged(_));
        // Every call on the pools returns the failure from now on: the caller decides
        // what it deserves (a loss may be shrunk past). A divergence, a bug of the
        // program that a background thread may find, is a warning.
        match &failure {
            Failure::Diverged(d) => {
                tracing::warn!(target: "symmpool::coll", divergence = %d, "collective check failed");
            }
            f => {
                tracing::debug!(target: "symmpool::coll", reason = %f.reason(), "pool broken");
            }
        }
        let first = self.failure.set(failure).is_ok();
        self.broken.store(true, Ordering::Release);
        if first && diverged {
            (self.config.abandon)();
        }
        let _q = self.queue.lock();
        self.progress.notify_all();
    }

    fn fail(&self, reason: String) {
        self.break_with(Failure::Broken(reason));
    }

    /// A round named `what` failed with `e`: break the ledger, keeping a failure of
    /// the group (a lost peer, above all) to report again as it was.
    fn failed_by(&self, what: &str, e: &Error) {
        match PeerFailure::of(e) {
            Some(p) => self.break_with(Failure::Peer(p)),
            None => self.fail(format!("{what} failed: {e}")),
        }
    }

    /// The next batch of this rank's records (at most [`MAX_BATCH`]).
    fn take_batch(&self) -> Vec<Entry> {
        let mut q = self.queue.lock();
        let n = q.pending.len().min(MAX_BATCH);
        q.pending.drain(..n).collect()
    }

    /// One round: send `batch`, add every rank's records to the queues, compare what
    /// every rank has.
    fn round(
        &self,
        rounds: &mut Rounds,
        batch: Vec<Entry>,
        deadline: Deadline,
        what: &'static str,
    ) -> Result<()> {
        let c = &self.config;
        let payload = record::encode_sized(&batch, 16 + batch.len() * MAX_RECORD_BYTES)?;
        let all = c.exchange.all_gather(c.channel, what, &payload, deadline)?;
        let (me, world) = (c.exchange.rank(), rounds.seen.len());
        if all.len() != world {
            self.fail(format!("{} payloads for {world} ranks", all.len()));
            return Err(self.error());
        }
        // This rank's records as posted, never decoded again.
        rounds.seen[me].extend(batch);
        for (rank, p) in all.iter().enumerate().filter(|(rank, _)| *rank != me) {
            let Some(entries) = record::decode::<Vec<Entry>>(p) else {
                self.fail(format!("rank {rank} sent an unreadable check record"));
                return Err(self.error());
            };
            rounds.seen[rank].extend(entries);
        }
        while rounds.seen.iter().all(|q| !q.is_empty()) {
            let heads: Vec<Entry> = rounds
                .seen
                .iter_mut()
                .filter_map(VecDeque::pop_front)
                .collect();
            rounds.compared += 1;
            let number = rounds.compared;
            if let Some(d) = self.compare(&heads, number) {
                self.break_with(Failure::Diverged(d));
                return Err(self.error());
            }
            let mut q = self.queue.lock();
            if let Some(Entry::Agreement(_)) = heads.first() {
                let records = heads
                    .into_iter()
                    .filter_map(|e| match e {
                        Entry::Agreement(a) => Some(*a),
                        Entry::Collective(_) => None,
                    })
                    .collect();
                q.agreed.push((number, records));
            }
            q.compared = number;
        }
        self.queue.lock().ahead = !rounds.seen[me].is_empty();
        self.progress.notify_all();
        Ok(())
    }

    /// The first difference of the ranks' records `heads` (the `number`th compared),
    /// as a divergence; agreements of every rank are not compared here.
    fn compare(&self, heads: &[Entry], number: u64) -> Option<Box<CollectiveDivergence>> {
        let me = self.config.exchange.rank();
        let found_by = if self.threaded.load(Ordering::Acquire) {
            "async check"
        } else {
            "strict check"
        };
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
        let names = self.names.lock();
        Some(Box::new(CollectiveDivergence {
            pool: names.get(&pool).cloned().unwrap_or_default(),
            found_by,
            record: number,
            field,
            values,
        }))
    }

    /// The background thread of an `Async` ledger: rounds of posted records.
    ///
    /// A rank whose own queue of uncompared records is not empty (it is ahead) joins
    /// the next round at once, with whatever it has; the others join once they have
    /// a record to add. So no rank spins, and no round waits on a rank that has
    /// posted nothing unless a peer is ahead of it.
    fn run(self: Arc<Self>) {
        let _done = DoneOnDrop(Arc::clone(&self));
        let me = self.config.exchange.rank();
        let what = "async collective check";
        loop {
            {
                let mut q = self.queue.lock();
                loop {
                    if self.broken.load(Ordering::Acquire) {
                        return;
                    }
                    if q.ahead || !q.pending.is_empty() {
                        break;
                    }
                    if q.stop {
                        return;
                    }
                    q.idle = true;
                    self.posted.wait(&mut q);
                    q.idle = false;
                }
            }
            let mut rounds = self.rounds.lock();
            // A caller may have driven the rounds meanwhile.
            let ahead = !rounds.seen[me].is_empty();
            let batch = self.take_batch();
            if batch.is_empty() && !ahead {
                continue;
            }
            self.progress.notify_all();
            let deadline = Deadline::after(self.config.timeout);
            if let Err(e) = self.round(&mut rounds, batch, deadline, what) {
                if !self.broken.load(Ordering::Acquire) {
                    self.failed_by(what, &e);
                }
                return;
            }
        }
    }
}

/// Marks the background thread done, and wakes a drop waiting for it.
struct DoneOnDrop(Arc<Shared>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        self.0.queue.lock().done = true;
        self.0.progress.notify_all();
    }
}
