//! [`PoolConfig`]: the settings of a pool.

use crate::core::CoreConfig;
use std::time::Duration;

/// How the ranks check that they make the same collectives on the same buffers
/// (see [`coll`](crate::coll), "Checked collectives"). Part of the pool's identity:
/// ranks whose pools use different modes fail at pool creation
/// ([`Error::ChannelMismatch`](crate::Error::ChannelMismatch)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CheckMode {
    /// No per-collective check and no light agreement: a divergence is silent (NCCL
    /// reads peers at the caller's offsets) or a hang, exactly as without the crate.
    Off,
    /// The calling thread posts each collective's record into a bounded queue and
    /// returns; a background thread of the pool compares the ranks' records. A
    /// mismatch makes the next call on the pool fail on every rank. The default.
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

/// Largest accepted [`PoolConfig::history_len`].
pub const MAX_HISTORY: usize = 1 << 16;

/// Settings of a pool.
///
/// [`SymmPool::config`](crate::SymmPool::config) returns the configuration in effect:
/// the core's granularity replaced by the backend's, and its small segments at least
/// one granularity long.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PoolConfig {
    /// The allocator core's sizes and growth policy (default: the registered-memory
    /// policy, few large segments). Its granularity is replaced by the backend's.
    pub core: CoreConfig,
    /// How long a wait on the other ranks (an agreement, a registration, a drain at
    /// teardown) may take (default 60 s).
    pub timeout: Duration,
    /// How many recent calls the agreement carries to name a divergence (default 64,
    /// at most [`MAX_HISTORY`]).
    pub history_len: usize,
    /// Whether segments are registered as windows (default `true`). A pool that does
    /// not register hands out plain buffers: the baseline its collectives run on
    /// NCCL's ring/tree kernels.
    pub register: bool,
    /// Fail growth with [`Error::NoSymmetricSupport`](crate::Error::NoSymmetricSupport)
    /// when a communicator returns no window, instead of carrying on with unregistered
    /// segments (default `false`).
    pub require_symmetric: bool,
    /// The pool's name (default `"pool"`): with its creation order, what identifies it
    /// to the other ranks (its agreements run on a channel of its own).
    pub name: String,
    /// How collectives on the pool are checked across ranks (default
    /// [`CheckMode::Async`]).
    pub check: CheckMode,
    /// The periodic light agreement: under `Async` and `Strict`, the pool's running
    /// call hash is compared across ranks at the first allocation once this many pool
    /// calls (allocations and frees) have passed since the last one, so that a loop
    /// of cache hits without collectives cannot drift unseen (default 1024; 0: never).
    pub check_every_calls: u64,
    /// Records an `Async` pool's calling threads may have posted and not yet seen
    /// compared (default 64): the detection bound in collectives. A caller that finds
    /// the queue full waits for room (at most the pool's timeout).
    pub check_queue: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            // Few large registered segments (see `CoreConfig::registered`): each
            // segment is a collective registration on every communicator.
            core: CoreConfig::registered(),
            timeout: Duration::from_secs(60),
            history_len: 64,
            register: true,
            require_symmetric: false,
            name: "pool".into(),
            check: CheckMode::Async,
            check_every_calls: 1024,
            check_queue: 64,
        }
    }
}

impl PoolConfig {
    /// Set the timeout of waits on other ranks.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set whether segments are registered.
    pub fn with_register(mut self, register: bool) -> Self {
        self.register = register;
        self
    }

    /// Set whether a missing symmetric window is an error.
    pub fn with_require_symmetric(mut self, require: bool) -> Self {
        self.require_symmetric = require;
        self
    }

    /// Set the core's configuration.
    pub fn with_core(mut self, core: CoreConfig) -> Self {
        self.core = core;
        self
    }

    /// Set the pool's name.
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Set the collective check mode.
    pub fn with_check(mut self, check: CheckMode) -> Self {
        self.check = check;
        self
    }

    /// Set the period of the light agreement in pool calls (0: never).
    pub fn with_check_every_calls(mut self, calls: u64) -> Self {
        self.check_every_calls = calls;
        self
    }

    /// Set the bound of an `Async` pool's record queue (at least 1).
    pub fn with_check_queue(mut self, records: usize) -> Self {
        self.check_queue = records.max(1);
        self
    }

    /// Set how many recent calls a divergence report can name.
    pub fn with_history_len(mut self, history_len: usize) -> Self {
        self.history_len = history_len;
        self
    }
}
