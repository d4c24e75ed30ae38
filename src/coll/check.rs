//! Checked collectives: every collective's record, compared across ranks (see the
//! module documentation of [`coll`](crate::coll), "Checked collectives").

use crate::control::{ChannelId, Exchange};
use crate::error::{CollectiveDivergence, Error, Result};
use crate::pool::{CheckMode, SymmPool};
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Words of one record.
pub(crate) const WORDS: usize = 20;
/// One rank's record of one collective (or of one light agreement).
pub(crate) type Record = [u64; WORDS];

/// Most records one async round carries per rank.
const MAX_BATCH: usize = 256;
/// First word of every payload on a pool's check channel.
const MAGIC: u64 = 0x4348_4543_4b45_4431; // "CHECKED1"

/// Record kinds (word 0).
pub(crate) const COLLECTIVE: u64 = 1;
pub(crate) const LIGHT: u64 = 2;

/// Word indices of a record.
pub(crate) mod field {
    pub(crate) const KIND: usize = 0;
    pub(crate) const POOL: usize = 1;
    pub(crate) const POOL_COLLECTIVE: usize = 2;
    pub(crate) const OP: usize = 3;
    pub(crate) const DTYPE: usize = 4;
    pub(crate) const REDUCTION: usize = 5;
    pub(crate) const COUNT: usize = 6;
    pub(crate) const COMM: usize = 7;
    pub(crate) const COMM_SEQ: usize = 8;
    pub(crate) const PATH: usize = 9;
    pub(crate) const INPUT: usize = 10;
    pub(crate) const OUTPUT: usize = 14;
    pub(crate) const CALL_SEQ: usize = 18;
    pub(crate) const CALL_HASH: usize = 19;
}

/// Field names, in record order: the first differing one is reported.
const FIELDS: [&str; WORDS] = [
    "record kind",
    "pool (channel ordinal)",
    "pool collective number",
    "collective",
    "element type",
    "reduction",
    "count",
    "communicator",
    "communicator sequence number",
    "path",
    "input allocation",
    "input segment",
    "input offset",
    "input bytes",
    "output allocation",
    "output segment",
    "output offset",
    "output bytes",
    "pool call count",
    "pool call hash",
];

fn show(index: usize, v: u64) -> String {
    let named = |names: &[&str]| {
        usize::try_from(v)
            .ok()
            .and_then(|i| names.get(i))
            .map_or_else(|| v.to_string(), |s| (*s).to_string())
    };
    match index {
        field::KIND => named(&["?", "collective", "light agreement"]),
        field::OP => named(&["none (light agreement)", "all_gather", "reduce_scatter"]),
        field::DTYPE => named(&["f32", "f16", "bf16", "u8"]),
        field::REDUCTION => named(&["none", "sum", "prod", "max", "min", "avg"]),
        field::PATH => named(&["copy engine", "symmetric kernel", "plain kernel", "none"]),
        field::CALL_HASH => format!("{v:#018x}"),
        _ => v.to_string(),
    }
}

/// The first field where the ranks' records differ, as a divergence.
pub(crate) fn compare(
    records: &[Record],
    number: u64,
    pool: &str,
    found_by: &'static str,
) -> Option<Box<CollectiveDivergence>> {
    let first = records.first()?;
    let i = (0..WORDS).find(|&i| records.iter().any(|r| r[i] != first[i]))?;
    Some(Box::new(CollectiveDivergence {
        pool: pool.to_string(),
        found_by,
        record: number,
        field: FIELDS[i],
        values: records
            .iter()
            .enumerate()
            .map(|(rank, r)| (rank, show(i, r[i])))
            .collect(),
    }))
}

fn encode(records: &[Record]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + records.len() * WORDS * 8);
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.extend_from_slice(&(records.len() as u64).to_le_bytes());
    for r in records {
        for w in r {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
    out
}

fn decode(bytes: &[u8]) -> Option<Vec<Record>> {
    let word = |i: usize| -> Option<u64> {
        let b = bytes.get(i * 8..i * 8 + 8)?;
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        Some(u64::from_le_bytes(w))
    };
    if word(0)? != MAGIC {
        return None;
    }
    let n = usize::try_from(word(1)?).ok()?;
    if bytes.len() != n.checked_mul(WORDS * 8)?.checked_add(16)? {
        return None;
    }
    (0..n)
        .map(|k| {
            let mut r = [0u64; WORDS];
            for (j, w) in r.iter_mut().enumerate() {
                *w = word(2 + k * WORDS + j)?;
            }
            Some(r)
        })
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the checks found: shared by the calling threads and the background thread.
struct Verdict {
    broken: AtomicBool,
    divergence: OnceLock<Box<CollectiveDivergence>>,
    /// The pool's own failure slot (its `state()` turns it into `broken`).
    failure: Arc<OnceLock<String>>,
}

impl Verdict {
    fn diverged(&self, d: Box<CollectiveDivergence>) {
        tracing::error!(target: "symmpool::coll", divergence = %d, "collective check failed");
        let _ = self.failure.set(d.to_string());
        let _ = self.divergence.set(d);
        self.broken.store(true, Ordering::Release);
    }

    fn failed(&self, reason: String) {
        tracing::error!(target: "symmpool::coll", reason = %reason, "pool broken");
        let _ = self.failure.set(reason);
        self.broken.store(true, Ordering::Release);
    }

    fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    fn error(&self) -> Error {
        match self.divergence.get() {
            Some(d) => Error::CollectiveDivergence(d.clone()),
            None => Error::PoolBroken {
                reason: self
                    .failure
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "a collective check failed".into()),
            },
        }
    }

    fn check(&self) -> Result<()> {
        if self.is_broken() {
            return Err(self.error());
        }
        Ok(())
    }
}

/// The bounded queue between an async pool's calling threads and its checker thread.
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
    pending: VecDeque<Record>,
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

/// The collective checks of one pool (in the collectives' per-pool state).
pub(crate) struct Checker {
    mode: CheckMode,
    pool: String,
    channel: ChannelId,
    exchange: Arc<dyn Exchange>,
    timeout: Duration,
    /// Collectives this pool has issued (the records' pool collective number).
    collectives: AtomicU64,
    verdict: Arc<Verdict>,
    /// Strict mode: held from a record's round to its collective's launch; counts the
    /// records compared.
    strict: Mutex<u64>,
    queue: Arc<Queue>,
}

impl fmt::Debug for Checker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Checker")
            .field("mode", &self.mode)
            .field("pool", &self.pool)
            .finish_non_exhaustive()
    }
}

impl Drop for Checker {
    fn drop(&mut self) {
        // The checker thread finishes the rounds of the records already posted (the
        // peers post theirs) and exits; wait for that, at most the pool's timeout (a
        // round never waits longer), so that its handle on the exchange is gone when
        // the pool is.
        let mut q = lock(&self.queue.state);
        q.stop = true;
        self.queue.posted.notify_all();
        if q.started {
            let _ = self
                .queue
                .progress
                .wait_timeout_while(q, self.timeout, |q| !q.done)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Checker {
    pub(crate) fn new(pool: &SymmPool) -> Self {
        let config = pool.config();
        Checker {
            mode: config.check,
            pool: config.name.clone(),
            channel: pool.check_channel(),
            exchange: pool.backend().exchange_handle(),
            timeout: config.timeout,
            collectives: AtomicU64::new(0),
            verdict: Arc::new(Verdict {
                broken: AtomicBool::new(false),
                divergence: OnceLock::new(),
                failure: pool.check_failure(),
            }),
            strict: Mutex::new(0),
            queue: Arc::new(Queue {
                capacity: config.check_queue.max(1),
                state: Mutex::new(QueueState::default()),
                posted: Condvar::new(),
                progress: Condvar::new(),
            }),
        }
    }

    pub(crate) fn mode(&self) -> CheckMode {
        self.mode
    }

    /// Fail if a check (or a collective that timed out) broke the pool.
    pub(crate) fn check(&self) -> Result<()> {
        self.verdict.check()
    }

    /// Break the pool after a collective failed in a way that leaves the ranks out of
    /// step (a timeout, a lost peer).
    pub(crate) fn break_on(&self, e: &Error) {
        if matches!(
            e,
            Error::Timeout { .. }
                | Error::GroupBroken { .. }
                | Error::PeerLost { .. }
                | Error::CollectiveMismatch { .. }
                | Error::Nccl { .. }
                | Error::NcclTimeout { .. }
                | Error::NcclWatchdog { .. }
                | Error::NcclAborted { .. }
        ) {
            self.verdict
                .failed(format!("a collective on this pool failed: {e}"));
        }
    }

    /// The pool's next collective number.
    pub(crate) fn next_collective(&self) -> u64 {
        self.collectives.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The strict lock: held by the caller from the record's round to the launch.
    pub(crate) fn strict_lock(&self) -> MutexGuard<'_, u64> {
        lock(&self.strict)
    }

    /// Strict: one round with `record`; a difference is an error on every rank.
    pub(crate) fn strict_round(&self, compared: &mut u64, record: &Record) -> Result<()> {
        self.verdict.check()?;
        let all = match self.exchange.all_gather(
            self.channel,
            "strict collective check",
            &encode(std::slice::from_ref(record)),
            self.timeout,
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
            match decode(p).as_deref() {
                Some([r]) => records.push(*r),
                _ => {
                    self.verdict
                        .failed(format!("rank {rank} sent an unreadable check record"));
                    return Err(self.verdict.error());
                }
            }
        }
        *compared += 1;
        if let Some(d) = compare(&records, *compared, &self.pool, "strict check") {
            self.verdict.diverged(d);
            return Err(self.verdict.error());
        }
        Ok(())
    }

    /// Async: post `record` (waiting for room if the queue is full) and return.
    pub(crate) fn post(&self, record: Record) -> Result<()> {
        let q = &self.queue;
        let mut st = lock(&q.state);
        self.verdict.check()?;
        if !st.started {
            self.start()?;
            st.started = true;
        }
        if st.pending.len() >= q.capacity {
            // The checker thread waits for the peers' records for at most the
            // timeout, then breaks the pool: wait a little longer than that.
            let deadline = Instant::now() + self.timeout.saturating_mul(2);
            while st.pending.len() >= q.capacity {
                self.verdict.check()?;
                let now = Instant::now();
                if now >= deadline {
                    self.verdict.failed(format!(
                        "the async collective check made no progress for {:?}",
                        self.timeout.saturating_mul(2)
                    ));
                    return Err(self.verdict.error());
                }
                st = q
                    .progress
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        st.pending.push_back(record);
        st.posted += 1;
        if st.idle {
            q.posted.notify_one();
        }
        Ok(())
    }

    /// Async: wait until every record posted so far is compared (or the checker thread
    /// stopped), then return the verdict.
    pub(crate) fn wait_compared(&self) -> Result<()> {
        let q = &self.queue;
        let mut st = lock(&q.state);
        let target = st.posted;
        let deadline = Instant::now() + self.timeout.saturating_mul(2);
        while st.compared < target && !st.done && self.verdict.divergence.get().is_none() {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "waiting for the async collective check",
                    waited: self.timeout.saturating_mul(2),
                    missing_ranks: Vec::new(),
                });
            }
            st = q
                .progress
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        self.verdict.check()
    }

    fn start(&self) -> Result<()> {
        let worker = Worker {
            pool: self.pool.clone(),
            channel: self.channel,
            exchange: self.exchange.clone(),
            timeout: self.timeout,
            verdict: self.verdict.clone(),
            queue: self.queue.clone(),
            _done: DoneOnDrop(self.queue.clone()),
        };
        std::thread::Builder::new()
            .name(format!("symmpool-check-{}", self.pool))
            .spawn(move || worker.run())
            .map(drop)
            .map_err(|e| Error::Internal {
                what: format!("could not start the pool's check thread: {e}"),
            })
    }
}

/// The background thread of an async pool: exchange rounds of posted records.
///
/// Every rank sees every rank's records, so every rank keeps the same per-rank queues
/// of records not yet compared and makes the same comparisons. A rank whose own queue
/// there is not empty (it is ahead) joins the next round at once, with whatever it has;
/// the others join once they have a record to add. So no rank spins, and no round
/// waits on a rank that has posted nothing unless a peer is ahead of it.
struct Worker {
    pool: String,
    channel: ChannelId,
    exchange: Arc<dyn Exchange>,
    timeout: Duration,
    verdict: Arc<Verdict>,
    queue: Arc<Queue>,
    /// Declared last, so dropped last: says the thread is done once the exchange is
    /// released, on every way out (a panic too).
    _done: DoneOnDrop,
}

/// Marks the checker thread done, and wakes the pool's drop waiting for it.
struct DoneOnDrop(Arc<Queue>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        lock(&self.0.state).done = true;
        self.0.progress.notify_all();
    }
}

impl Worker {
    fn run(self) {
        let me = self.exchange.rank();
        let world = self.exchange.world_size();
        let mut seen: Vec<VecDeque<Record>> = vec![VecDeque::new(); world];
        let mut compared = 0u64;
        loop {
            let ahead = !seen[me].is_empty();
            let batch: Vec<Record> = {
                let mut st = lock(&self.queue.state);
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
                    st = self
                        .queue
                        .posted
                        .wait(st)
                        .unwrap_or_else(|p| p.into_inner());
                    st.idle = false;
                }
                let n = st.pending.len().min(MAX_BATCH);
                st.pending.drain(..n).collect()
            };
            self.queue.progress.notify_all();
            let all = match self.exchange.all_gather(
                self.channel,
                "async collective check",
                &encode(&batch),
                self.timeout,
            ) {
                Ok(all) => all,
                Err(e) => return self.fail(format!("the async collective check failed: {e}")),
            };
            for (rank, p) in all.iter().enumerate() {
                match (decode(p), seen.get_mut(rank)) {
                    (Some(records), Some(q)) => q.extend(records),
                    _ => return self.fail(format!("rank {rank} sent an unreadable check record")),
                }
            }
            while seen.iter().all(|q| !q.is_empty()) {
                let records: Vec<Record> =
                    seen.iter_mut().filter_map(VecDeque::pop_front).collect();
                compared += 1;
                if let Some(d) = compare(&records, compared, &self.pool, "async check") {
                    self.verdict.diverged(d);
                    return self.exit();
                }
            }
            lock(&self.queue.state).compared = compared;
            self.queue.progress.notify_all();
        }
    }

    fn fail(self, reason: String) {
        self.verdict.failed(reason);
        self.exit();
    }

    /// Release the exchange, then say so (`DoneOnDrop`): a pool's drop waits for
    /// this, so that the exchange (and a store server rank 0 hosts in it) goes when
    /// the application drops its last handle, not whenever this thread gets to it.
    fn exit(self) {
        drop(self);
    }
}
