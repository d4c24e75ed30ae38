//! [`KvExchange`]: an [`Exchange`](super::Exchange) over a key-value store a runtime already
//! has, such as PyTorch's `c10d.Store` (`set`, `get`, `add`, `wait`), so that the crate's
//! agreement runs wherever the runtime runs, under any launcher. Its protocol and
//! failure-detection bound are on [`KvExchange`].

use super::waiting::{WAIT_WARNING_INTERVAL, WaitWarnings, Who, ranks};
use super::{ChannelId, GatherRounds, Round, Rounds, intern_op};
use crate::error::{Error, Result};
use parking_lot::Mutex;
use std::fmt;
use std::time::Duration;

/// The key-value store a [`KvExchange`] runs over: the operations of PyTorch's
/// `c10d.Store`. Implementations are called from any thread, one call at a time per
/// exchange round.
pub trait KvStore: Send + Sync + fmt::Debug {
    /// Set `key` to `value` (overwriting).
    ///
    /// # Errors
    /// The store's failure, as [`Error::Transport`] (or any other [`Error`]).
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, which the caller knows to exist.
    ///
    /// # Errors
    /// The store's failure.
    fn get(&self, key: &str) -> Result<Vec<u8>>;

    /// Add `delta` to the integer counter `key` (created at 0) and return the new value.
    ///
    /// # Errors
    /// The store's failure.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Wait until every key of `keys` exists, for at most `timeout`: `Ok(true)` once
    /// they all exist, `Ok(false)` if `timeout` passed first.
    ///
    /// # Errors
    /// The store's failure (other than the timeout).
    fn wait(&self, keys: &[String], timeout: Duration) -> Result<bool>;

    /// Whether every key of `keys` exists now, without waiting.
    ///
    /// # Errors
    /// The store's failure.
    fn check(&self, keys: &[String]) -> Result<bool> {
        self.wait(keys, Duration::from_millis(1))
    }

    /// Delete `key` if the store can (the default does nothing: keys stay).
    ///
    /// # Errors
    /// The store's failure.
    fn delete(&self, key: &str) -> Result<()> {
        let _ = key;
        Ok(())
    }
}

/// Settings of a [`KvExchange`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvConfig {
    /// Every key starts with this (then `/`). Two exchanges over one store need
    /// different prefixes.
    pub prefix: String,
    /// The longest single wait on the store: how often a waiting rank looks whether
    /// another rank broke the group (default 1 s).
    pub poll: Duration,
    /// How often a rank waiting in a round logs a warning naming the ranks whose keys
    /// are missing (default [`WAIT_WARNING_INTERVAL`], 30 s), and once more when they
    /// come. Each warning costs one `check` of the store per rank.
    pub wait_warning_interval: Duration,
}

impl KvConfig {
    /// Keys under `prefix`, polling every second.
    pub fn new(prefix: impl Into<String>) -> Self {
        KvConfig {
            prefix: prefix.into(),
            poll: Duration::from_secs(1),
            wait_warning_interval: WAIT_WARNING_INTERVAL,
        }
    }

    /// Set the longest single wait (at least 1 ms).
    pub fn with_poll(mut self, poll: Duration) -> Self {
        self.poll = poll.max(Duration::from_millis(1));
        self
    }

    /// Set how often a long wait warns (at least 1 ms).
    pub fn with_wait_warning_interval(mut self, interval: Duration) -> Self {
        self.wait_warning_interval = interval.max(Duration::from_millis(1));
        self
    }
}

/// An [`Exchange`](super::Exchange) over a [`KvStore`] (for example PyTorch's default `c10d.Store`,
/// reached through the Python bindings).
///
/// # Protocol
/// Round `r` of channel `c` on rank `k` is the key `PREFIX/c/r/k`. A rank sets its key,
/// waits (in slices of [`KvConfig::poll`]) until every rank's key of the round exists,
/// then reads them. Once round `r` completes every rank has read round `r - 1`, so a
/// rank then deletes its own key of round `r - 1` (where the store can delete).
/// A rank whose wait reaches its deadline writes its rank and operation to
/// `PREFIX/broken/reason`, then increments `PREFIX/broken` (so the reason exists
/// whenever the counter is non-zero), withdraws its key and fails with
/// [`Error::Timeout`]; every rank checks the counter before each round and between
/// slices, and fails with [`Error::GroupBroken`] once it is set. A long wait warns
/// ([`KvConfig::wait_warning_interval`]).
///
/// # Failure-detection bound
/// The store has no heartbeat: a dead or frozen rank is noticed through deadlines
/// only. A rank waiting for it fails with [`Error::Timeout`] when its own call's timeout
/// passes (the pool's [`GroupConfig::timeout`](crate::GroupConfig::timeout), 60 s by
/// default; the NCCL set-up's, 10 min), and every other rank fails with
/// [`Error::GroupBroken`] within [`KvConfig::poll`] (1 s by default) plus one store
/// round trip of that moment. A timeout on any rank breaks the group for good.
pub struct KvExchange<S: KvStore> {
    store: S,
    config: KvConfig,
    /// This rank's place in the group and the round counters of the channels.
    rounds: Rounds,
    /// Set once this rank knows the group is broken: (rank that timed out, its op).
    broken: Mutex<Option<(usize, &'static str)>>,
}

impl<S: KvStore> fmt::Debug for KvExchange<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvExchange")
            .field("rank", &self.rounds.rank)
            .field("world", &self.rounds.world_size)
            .field("prefix", &self.config.prefix)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<S: KvStore> KvExchange<S> {
    /// Rank `rank` of `world_size` over `store`.
    ///
    /// # Errors
    /// [`Error::Config`] if `rank >= world_size` or the prefix is empty.
    pub fn new(store: S, rank: usize, world_size: usize, config: KvConfig) -> Result<Self> {
        if rank >= world_size {
            return Err(Error::config(
                "rank",
                format!("{rank} in a world of {world_size}"),
                "a rank below the world size",
            ));
        }
        if config.prefix.is_empty() {
            return Err(Error::config(
                "KvConfig::prefix",
                "\"\"",
                "a non-empty key prefix",
            ));
        }
        Ok(KvExchange {
            store,
            config,
            rounds: Rounds::new(rank, world_size, usize::MAX),
            broken: Mutex::new(None),
        })
    }

    /// The settings.
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    fn key(&self, channel: ChannelId, round: u64, rank: usize) -> String {
        let (prefix, channel) = (&self.config.prefix, channel.ordinal());
        format!("{prefix}/{channel}/{round}/{rank}")
    }

    /// The key of the group's broken counter, then `tail` (`/reason`: of its reason).
    fn broken_key(&self, tail: &str) -> String {
        format!("{}/broken{tail}", self.config.prefix)
    }

    /// The group's broken state: this rank's memory first, then the store's counter.
    fn check_broken(&self) -> Result<()> {
        let mut broken = self.broken.lock();
        if broken.is_none() && self.store.add(&self.broken_key(""), 0)? > 0 {
            let reason = self.store.get(&self.broken_key("/reason"))?;
            let text = String::from_utf8_lossy(&reason);
            let (rank, op) = text.split_once(' ').unwrap_or(("0", "an exchange round"));
            *broken = Some((rank.parse().unwrap_or(0), intern_op(op)));
        }
        match *broken {
            Some((rank, op)) => Err(Error::GroupBroken { rank, op }),
            None => Ok(()),
        }
    }

    /// The ranks whose keys of a round (`keys`, by rank) are missing.
    fn missing(&self, keys: &[String]) -> Result<Vec<usize>> {
        let mut missing = Vec::new();
        for (k, key) in keys.chunks(1).enumerate() {
            if !self.store.check(key)? {
                missing.push(k);
            }
        }
        Ok(missing)
    }

    /// Break the group after this rank's timeout in `op`.
    fn break_group(&self, op: &'static str, own_key: &str) {
        *self.broken.lock() = Some((self.rounds.rank, op));
        let reason = format!("{} {op}", self.rounds.rank);
        // Best effort: the timeout is what this rank reports either way.
        let _ = (self.store).set(&self.broken_key("/reason"), reason.as_bytes());
        let _ = self.store.add(&self.broken_key(""), 1);
        let _ = self.store.delete(own_key);
    }
}

impl<S: KvStore> GatherRounds for KvExchange<S> {
    fn gather_round(&self, r: Round<'_>) -> Result<Vec<Vec<u8>>> {
        self.check_broken()?;
        // Keys number the rounds from 0.
        let round = r.number - 1;
        let keys: Vec<String> = (0..self.rounds.world_size)
            .map(|k| self.key(r.channel, round, k))
            .collect();
        let own = &keys[self.rounds.rank];
        self.store.set(own, r.payload)?;
        let mut warnings = WaitWarnings::new(r.op, r.started, self.config.wait_warning_interval);
        let who = Who(self.rounds.rank, "key-value store", &self.config.prefix);
        loop {
            let slice = (warnings.until(r.deadline).remaining())
                .min(self.config.poll)
                .max(Duration::from_millis(1));
            if self.store.wait(&keys, slice)? {
                break;
            }
            self.check_broken()?;
            let expired = r.deadline.expired();
            if expired || warnings.due() {
                let missing = self.missing(&keys)?;
                if missing.is_empty() {
                    break;
                }
                if expired {
                    self.break_group(r.op, own);
                    return Err(Error::Timeout {
                        op: r.op,
                        waited: r.started.elapsed(),
                        missing_ranks: missing,
                    });
                }
                warnings.warn(&who, ranks(&missing), r.deadline);
            }
        }
        warnings.arrived(&who);
        // A rank that timed out may have posted before it gave up: do not pair with it.
        self.check_broken()?;
        let out = (keys.iter().enumerate())
            .map(|(k, key)| match k == self.rounds.rank {
                true => Ok(r.payload.to_vec()),
                false => self.store.get(key),
            })
            .collect::<Result<Vec<_>>>()?;
        if round > 0 {
            (self.store).delete(&self.key(r.channel, round - 1, self.rounds.rank))?;
        }
        Ok(out)
    }

    fn rounds(&self) -> &Rounds {
        &self.rounds
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/kv.rs"]
mod tests;
