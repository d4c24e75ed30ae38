//! Checked collectives: every collective's record, compared across ranks before it is
//! launched ([`CheckMode::Strict`]) or off the calling thread ([`CheckMode::Async`]).
//! The collectives handle ([`Coll`](crate::coll::Coll)) makes the records; this module
//! exchanges and compares them.

use super::collective::CollectiveRecord;
use super::record::{self, first_difference};
use crate::control::{ChannelId, Exchange};
use crate::deadline::Deadline;
use crate::error::{CollectiveDivergence, Error, ErrorKind, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// How the ranks check that they make the same collectives on the same buffers
/// (see [`coll`](crate::coll), "Checked collectives"). Part of the collectives
/// handle's identity: ranks whose handles use different modes fail when they make it
/// ([`Error::ChannelMismatch`](crate::Error::ChannelMismatch)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckMode {
    /// No per-collective check: a divergence is silent (NCCL reads peers at the
    /// caller's offsets) or a hang, exactly as without the crate.
    Off,
    /// The calling thread posts each collective's record into a bounded queue and
    /// returns; a background thread compares the ranks' records. A mismatch makes the
    /// next call on the pool fail on every rank. The default (at world size 1 every
    /// handle runs as `Off`: there is no peer).
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

/// The longest a checker's drop waits for its thread's last round.
const DROP_WAIT: Duration = Duration::from_secs(2);

/// Most records one async round carries per rank.
const MAX_BATCH: usize = 256;
/// Most records an async queue allocates room for when it is made (a record is about
/// 150 bytes): a queue up to this capacity never allocates when a record is posted.
pub(crate) const PREALLOCATED_RECORDS: usize = 4096;
/// More than the bytes of one encoded record (20 varints of at most 10 bytes, tags).
const MAX_RECORD_BYTES: usize = 256;

/// The payload of a batch of records.
fn encode_batch(records: &[CollectiveRecord]) -> Result<Vec<u8>> {
    record::encode_sized(records, 16 + records.len() * MAX_RECORD_BYTES)
}

/// The first field where the ranks' records differ, as a divergence.
fn compare(
    records: &[CollectiveRecord],
    number: u64,
    pool: &str,
    found_by: &'static str,
) -> Option<Box<CollectiveDivergence>> {
    let (field, values) = first_difference(records)?;
    Some(Box::new(CollectiveDivergence {
        pool: pool.to_string(),
        found_by,
        record: number,
        field,
        values,
    }))
}

/// Why the checks broke a pool: what its later calls report.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    /// The ranks' records differed: later calls fail with
    /// [`Error::CollectiveDivergence`].
    Diverged(Box<CollectiveDivergence>),
    /// Another failure (a check that timed out or lost a peer, a collective that
    /// failed): later calls fail with [`Error::PoolBroken`].
    Broken(String),
}

impl Failure {
    /// The failure as a reason ([`Error::PoolBroken`]'s).
    pub(crate) fn reason(&self) -> String {
        match self {
            Failure::Diverged(d) => d.to_string(),
            Failure::Broken(reason) => reason.clone(),
        }
    }
}

/// What the checks found: shared by the calling threads and the background thread.
struct Verdict {
    broken: AtomicBool,
    divergence: OnceLock<Box<CollectiveDivergence>>,
    /// The failure slots of the pools checked (each pool turns its slot into its
    /// `broken` state).
    failures: Vec<Arc<OnceLock<Failure>>>,
    /// The peer whose loss failed the checks (rank, how it was noticed): reported as
    /// [`Error::PeerLost`], which a runtime restarts on, not as a broken pool.
    lost: OnceLock<(usize, String)>,
    /// The site's `abandon`, called by the first divergence (unless the checks
    /// failed before).
    abandon: Option<Arc<dyn Fn() + Send + Sync>>,
    /// The checker was dropped while its thread was still in a round: whatever that
    /// round finds no longer touches the pools (a new handle may use them).
    detached: AtomicBool,
}

impl Verdict {
    fn diverged(&self, d: Box<CollectiveDivergence>) {
        if self.detached.load(Ordering::Acquire) {
            return;
        }
        tracing::error!(target: "symmpool::coll", divergence = %d, "collective check failed");
        self.break_pools(Failure::Diverged(d.clone()));
        let _ = self.divergence.set(d);
        // The ranks are out of step: end the collectives that wait for peers who
        // will not come (once).
        if !self.broken.swap(true, Ordering::AcqRel)
            && let Some(abandon) = &self.abandon
        {
            abandon();
        }
    }

    fn failed(&self, reason: String) {
        tracing::error!(target: "symmpool::coll", reason = %reason, "pool broken");
        self.break_pools(Failure::Broken(reason));
        // (A timeout or a lost peer: a collective waiting for them meets the same.)
        self.broken.store(true, Ordering::Release);
    }

    /// Mark every pool checked broken (the first failure of each wins).
    fn break_pools(&self, failure: Failure) {
        if self.detached.load(Ordering::Acquire) {
            return;
        }
        for slot in &self.failures {
            let _ = slot.set(failure.clone());
        }
    }

    fn divergence_error(&self) -> Option<Error> {
        (self.divergence.get()).map(|d| Error::CollectiveDivergence(d.clone()))
    }

    /// The checks failed because peer `e` was lost (or `e` is another failure).
    fn failed_by(&self, context: &str, e: &Error) {
        if let Error::PeerLost { rank, detail, .. } = e {
            let _ = self.lost.set((*rank, detail.clone()));
        }
        self.failed(format!("{context}: {e}"));
    }

    fn error(&self) -> Error {
        if let (None, Some((rank, detail))) = (self.divergence.get(), self.lost.get()) {
            return Error::PeerLost {
                rank: *rank,
                op: "async collective check",
                detail: detail.clone(),
            };
        }
        match self.divergence.get() {
            Some(d) => Error::CollectiveDivergence(d.clone()),
            None => Error::PoolBroken {
                reason: (self.failures.iter().find_map(|f| f.get()))
                    .map_or_else(|| "a collective check failed".into(), Failure::reason),
            },
        }
    }

    #[inline]
    fn check(&self) -> Result<()> {
        if self.broken.load(Ordering::Acquire) {
            return Err(self.error());
        }
        Ok(())
    }
}

/// The bounded queue between the calling threads and the checker thread.
struct Queue {
    capacity: usize,
    state: Mutex<QueueState>,
    /// The checker thread waits here for records.
    posted: Condvar,
    /// Callers wait here for room, or for their records to be compared.
    progress: Condvar,
}

#[derive(Default)]
struct QueueState {
    pending: VecDeque<CollectiveRecord>,
    /// The checker thread waits on `posted` (only then does a post notify it).
    idle: bool,
    /// Records posted and records of this rank compared, in total.
    posted: u64,
    compared: u64,
    started: bool,
    stop: bool,
    /// The checker thread has exited.
    done: bool,
}

/// Where a checker compares: the name of what it checks (its pools' names), its check
/// channel, the exchange.
pub(crate) struct CheckSite {
    pub(crate) pool: String,
    pub(crate) channel: ChannelId,
    pub(crate) exchange: Arc<dyn Exchange>,
    /// How long a round waits for the peers.
    pub(crate) timeout: Duration,
    /// The failure slots of the pools checked: a failed check breaks them all.
    pub(crate) failures: Vec<Arc<OnceLock<Failure>>>,
    /// Called once when a check finds a divergence: ends this rank's collectives that
    /// wait for peers who will not come (the backend's [`Collectives::abandon`](crate::backend::Collectives::abandon)).
    pub(crate) abandon: Option<Arc<dyn Fn() + Send + Sync>>,
}

/// The collective checks of one pool.
pub(crate) struct Checker {
    mode: CheckMode,
    site: Arc<CheckSite>,
    verdict: Arc<Verdict>,
    /// Held from a record's round (Strict) or post (Async) to its collective's launch;
    /// counts the records compared under Strict.
    launch: Mutex<u64>,
    queue: Arc<Queue>,
}

impl Drop for Checker {
    fn drop(&mut self) {
        // The checker thread finishes the rounds of the records already posted (the
        // peers post theirs) and exits; wait for that, at most the timeout (a round
        // never waits longer) and at most `DROP_WAIT`, so that its handle on the
        // exchange is gone when the checker is. A thread still in a round then (its
        // peers have not posted: gone, or far behind) is left to end it on its own,
        // detached: what it finds no longer touches the pools.
        let deadline = Deadline::after(self.site.timeout.min(DROP_WAIT));
        let mut q = self.queue.state.lock();
        q.stop = true;
        self.queue.posted.notify_all();
        if q.started {
            while !q.done {
                if self
                    .queue
                    .progress
                    .wait_until(&mut q, deadline.instant())
                    .timed_out()
                {
                    self.verdict.detached.store(true, Ordering::Release);
                    break;
                }
            }
        }
    }
}

impl Checker {
    /// The checks of one handle's pools under `mode`, compared at `site`. Under `Async` the
    /// checker thread starts here and the queue is allocated whole (up to
    /// [`PREALLOCATED_RECORDS`] records), so that posting a record neither starts a
    /// thread nor allocates.
    ///
    /// # Errors
    /// [`Error::Internal`] if the checker thread cannot be started.
    pub(crate) fn new(mode: CheckMode, site: CheckSite, queue_capacity: usize) -> Result<Self> {
        let capacity = queue_capacity.max(1);
        let pending = if mode == CheckMode::Async {
            VecDeque::with_capacity(capacity.min(PREALLOCATED_RECORDS))
        } else {
            VecDeque::new()
        };
        let checker = Checker {
            mode,
            verdict: Arc::new(Verdict {
                broken: AtomicBool::new(false),
                divergence: OnceLock::new(),
                lost: OnceLock::new(),
                failures: site.failures.clone(),
                abandon: site.abandon.clone(),
                detached: AtomicBool::new(false),
            }),
            site: Arc::new(site),
            launch: Mutex::new(0),
            queue: Arc::new(Queue {
                capacity,
                state: Mutex::new(QueueState {
                    pending,
                    ..QueueState::default()
                }),
                posted: Condvar::new(),
                progress: Condvar::new(),
            }),
        };
        if mode == CheckMode::Async {
            checker.start()?;
            checker.queue.state.lock().started = true;
        }
        Ok(checker)
    }

    pub(crate) fn mode(&self) -> CheckMode {
        self.mode
    }

    /// Fail if a check (or a collective that timed out) broke the pool.
    #[inline]
    pub(crate) fn check(&self) -> Result<()> {
        self.verdict.check()
    }

    /// Break the pool after a collective failed in a way that leaves the ranks out of
    /// step: a wait that timed out or a lost peer (by [`Error::kind`]), a mismatched
    /// collective, an NCCL failure.
    pub(crate) fn break_on(&self, e: &Error) {
        if matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerLost)
            || matches!(e, Error::CollectiveMismatch { .. } | Error::Nccl { .. })
        {
            self.verdict
                .failed(format!("a collective on this pool failed: {e}"));
        }
    }

    /// What a collective that failed with `e` reports: the divergence this rank's
    /// checks found, else `e` (breaking the checks as [`break_on`](Self::break_on)
    /// says). A call failed by its peers (ended by a peer's failed check, or a peer
    /// gone after it found one) first waits until `deadline` for this rank's checks,
    /// which find the same divergence in the same round.
    pub(crate) fn call_failed(&self, e: Error, deadline: impl FnOnce() -> Deadline) -> Error {
        // By kind, as `break_on`: NCCL's watchdog and timeouts count with the host
        // backends' timeouts and lost peers.
        let peers = matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerLost)
            || matches!(
                e,
                Error::GroupBroken { .. } | Error::CollectiveMismatch { .. }
            );
        if peers && self.verdict.divergence_error().is_none() {
            let _ = self.wait_compared(deadline());
        }
        if let Some(d) = self.verdict.divergence_error() {
            return d;
        }
        self.break_on(&e);
        e
    }

    /// The launch lock: held by the caller from the record's round (Strict) or post
    /// (Async) to the launch, so the records' order is the launches' order.
    pub(crate) fn launch_lock(&self) -> MutexGuard<'_, u64> {
        self.launch.lock()
    }

    /// Check `record` as the mode says: under `Strict` one round before returning
    /// (the caller holds [`launch_lock`](Self::launch_lock) until its launch), under
    /// `Async` posted to the checker thread, under `Off` nothing.
    ///
    /// `deadline` makes the call's deadline when a wait needs it (a strict round, a
    /// full queue), so that an async post that finds room does not read the clock.
    pub(crate) fn submit(
        &self,
        launch: Option<&mut MutexGuard<'_, u64>>,
        record: CollectiveRecord,
        deadline: impl FnOnce() -> Deadline,
    ) -> Result<()> {
        match (self.mode, launch) {
            (CheckMode::Off, _) => Ok(()),
            (CheckMode::Strict, Some(compared)) => self.strict_round(compared, &record, deadline()),
            (CheckMode::Strict, None) => {
                let mut compared = self.launch_lock();
                self.strict_round(&mut compared, &record, deadline())
            }
            (CheckMode::Async, _) => self.post(record, deadline),
        }
    }

    /// Strict: one round with `record`; a difference is an error on every rank.
    fn strict_round(
        &self,
        compared: &mut u64,
        record: &CollectiveRecord,
        deadline: Deadline,
    ) -> Result<()> {
        self.verdict.check()?;
        let payload = encode_batch(std::slice::from_ref(record))?;
        let all = match self.site.exchange.all_gather(
            self.site.channel,
            "strict collective check",
            &payload,
            deadline,
        ) {
            Ok(all) => all,
            Err(e) => {
                self.verdict
                    .failed(format!("the strict collective check failed: {e}"));
                return Err(e);
            }
        };
        let mut records = Vec::with_capacity(all.len());
        for (rank, p) in all.iter().enumerate() {
            match record::decode::<Vec<CollectiveRecord>>(p).as_deref() {
                Some([r]) => records.push(*r),
                _ => {
                    self.verdict
                        .failed(format!("rank {rank} sent an unreadable check record"));
                    return Err(self.verdict.error());
                }
            }
        }
        *compared += 1;
        if let Some(d) = compare(&records, *compared, &self.site.pool, "strict check") {
            self.verdict.diverged(d);
            return Err(self.verdict.error());
        }
        Ok(())
    }

    /// Async: post `record` and return, once at most `capacity` of this rank's earlier
    /// records are still to be compared (waiting for that until `deadline`, capped at
    /// twice the timeout). So the verdict on record *k* is known before record
    /// *k* + `capacity` + 1 is posted: after a mismatch, at most `capacity` further
    /// collectives of this rank are launched (and may return `Ok`).
    fn post(&self, record: CollectiveRecord, deadline: impl FnOnce() -> Deadline) -> Result<()> {
        let q = &self.queue;
        let mut st = q.state.lock();
        self.verdict.check()?;
        if st.posted - st.compared > q.capacity as u64 {
            // The checker thread waits for the peers' records for at most the
            // timeout, then breaks the pool: wait a little longer than that.
            let patience = self.site.timeout.saturating_mul(2);
            let deadline = deadline().cap(patience);
            while st.posted - st.compared > q.capacity as u64 && !st.done {
                self.verdict.check()?;
                if q.progress
                    .wait_until(&mut st, deadline.instant())
                    .timed_out()
                    && st.posted - st.compared > q.capacity as u64
                {
                    self.verdict.failed(format!(
                        "the async collective check made no progress for {patience:?}"
                    ));
                    return Err(self.verdict.error());
                }
            }
            self.verdict.check()?;
        }
        st.pending.push_back(record);
        st.posted += 1;
        if st.idle {
            q.posted.notify_one();
        }
        Ok(())
    }

    /// Wait until every record posted so far is compared (or the checker thread
    /// stopped), at most until `deadline`, then return the verdict. At once unless
    /// `Async`.
    pub(crate) fn wait_compared(&self, deadline: Deadline) -> Result<()> {
        if self.mode != CheckMode::Async {
            return self.verdict.check();
        }
        let q = &self.queue;
        let started = std::time::Instant::now();
        let mut st = q.state.lock();
        let target = st.posted;
        while st.compared < target && !st.done && self.verdict.divergence.get().is_none() {
            if q.progress
                .wait_until(&mut st, deadline.instant())
                .timed_out()
                && st.compared < target
                && !st.done
            {
                return Err(Error::Timeout {
                    op: "waiting for the async collective check",
                    waited: started.elapsed(),
                    missing_ranks: Vec::new(),
                });
            }
        }
        drop(st);
        self.verdict.check()
    }

    fn start(&self) -> Result<()> {
        let worker = Worker {
            site: self.site.clone(),
            verdict: self.verdict.clone(),
            queue: self.queue.clone(),
            _done: DoneOnDrop(self.queue.clone()),
        };
        std::thread::Builder::new()
            .name(format!("symmpool-check-{}", self.site.pool))
            .spawn(move || worker.run())
            .map(drop)
            .map_err(|e| Error::Internal {
                what: format!("could not start the pool's check thread: {e}"),
            })
    }
}

/// The background thread of an async checker: exchange rounds of posted records.
///
/// Every rank sees every rank's records, so every rank keeps the same per-rank queues
/// of records not yet compared and makes the same comparisons. A rank whose own queue
/// there is not empty (it is ahead) joins the next round at once, with whatever it has;
/// the others join once they have a record to add. So no rank spins, and no round
/// waits on a rank that has posted nothing unless a peer is ahead of it.
struct Worker {
    site: Arc<CheckSite>,
    verdict: Arc<Verdict>,
    queue: Arc<Queue>,
    /// Declared last, so dropped last: says the thread is done once the exchange is
    /// released, on every way out (a panic too).
    _done: DoneOnDrop,
}

/// Marks the checker thread done, and wakes a drop waiting for it.
struct DoneOnDrop(Arc<Queue>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        self.0.state.lock().done = true;
        self.0.progress.notify_all();
    }
}

impl Worker {
    fn run(self) {
        let me = self.site.exchange.rank();
        let world = self.site.exchange.world_size();
        let mut seen: Vec<VecDeque<CollectiveRecord>> = vec![VecDeque::new(); world];
        let mut compared = 0u64;
        let mut records: Vec<CollectiveRecord> = Vec::with_capacity(world);
        loop {
            let ahead = !seen[me].is_empty();
            let batch: Vec<CollectiveRecord> = {
                let mut st = self.queue.state.lock();
                loop {
                    // A collective that timed out breaks the pool but not the check:
                    // the records posted so far are still compared, so every rank
                    // learns the same divergence.
                    if self.verdict.divergence.get().is_some() {
                        drop(st);
                        return self.exit();
                    }
                    if ahead || !st.pending.is_empty() {
                        break;
                    }
                    if st.stop {
                        drop(st);
                        return self.exit();
                    }
                    st.idle = true;
                    self.queue.posted.wait(&mut st);
                    st.idle = false;
                }
                let n = st.pending.len().min(MAX_BATCH);
                st.pending.drain(..n).collect()
            };
            self.queue.progress.notify_all();
            let payload = match encode_batch(&batch) {
                Ok(p) => p,
                Err(e) => return self.fail(e.to_string()),
            };
            let all = match self.site.exchange.all_gather(
                self.site.channel,
                "async collective check",
                &payload,
                Deadline::after(self.site.timeout),
            ) {
                Ok(all) => all,
                Err(e) => {
                    self.verdict
                        .failed_by("the async collective check failed", &e);
                    return self.exit();
                }
            };
            if all.len() != world {
                return self.fail(format!("{} check payloads for {world} ranks", all.len()));
            }
            for (rank, (p, q)) in all.iter().zip(seen.iter_mut()).enumerate() {
                if rank == me {
                    // This rank's own records, as posted (not decoded again).
                    q.extend(batch.iter().copied());
                    continue;
                }
                match record::decode::<Vec<CollectiveRecord>>(p) {
                    Some(records) => q.extend(records),
                    None => {
                        return self.fail(format!("rank {rank} sent an unreadable check record"));
                    }
                }
            }
            while seen.iter().all(|q| !q.is_empty()) {
                records.clear();
                records.extend(seen.iter_mut().filter_map(VecDeque::pop_front));
                compared += 1;
                if let Some(d) = compare(&records, compared, &self.site.pool, "async check") {
                    self.verdict.diverged(d);
                    return self.exit();
                }
            }
            self.queue.state.lock().compared = compared;
            self.queue.progress.notify_all();
        }
    }

    fn fail(self, reason: String) {
        self.verdict.failed(reason);
        self.exit();
    }

    /// Release the exchange, then say so (`DoneOnDrop`): a checker's drop waits for
    /// this, so that the exchange (and a store server rank 0 hosts in it) goes when
    /// the application drops its last handle, not whenever this thread gets to it.
    fn exit(self) {
        drop(self);
    }
}
