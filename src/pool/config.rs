//! [`PoolConfig`]: the settings of a pool.

use crate::core::CoreConfig;
use crate::group::CheckMode;
use std::time::Duration;

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
    /// [`CheckMode::Async`]; [`from_env`](Self::from_env) reads it from
    /// `SYMMPOOL_CHECK`, code that sets it beats the environment): the mode of the
    /// collectives handles made from the pool ([`Coll::new`](crate::coll::Coll::new)).
    /// At world size 1 the handles run as [`CheckMode::Off`]: no peer to compare with.
    pub check: CheckMode,
    /// Under [`CheckMode::Async`], how many collectives a rank may launch after one
    /// whose check has not yet come back (default 1; 0 counts as 1): the bound on the
    /// damage of a divergence ([`coll`](crate::coll), "Checked collectives"). Larger
    /// values let a rank's host run further ahead of its peers' records, at that cost
    /// in the bound.
    pub check_queue: usize,
    /// Whether collectives on the pool may be made without an identity (default
    /// `false`: every collective needs one, [`Coll::tagged`](crate::coll::Coll::tagged),
    /// and an untagged call fails with [`Error::Untagged`](crate::Error::Untagged)
    /// before anything runs). A tag tells calls of the same shape apart, so that a rank
    /// skipping one of them (one persistent gather buffer for every layer) fails at that
    /// call instead of moving another call's data; untagged calls are compared by shape
    /// only. Set only in code ([`with_untagged_collectives`](Self::with_untagged_collectives);
    /// no environment variable reads it), alike on every rank: ranks that differ fail
    /// when they make the pool ([`Error::ChannelMismatch`](crate::Error::ChannelMismatch),
    /// the pool's channel name ending in `untagged_collectives` on the ranks that set it).
    pub untagged_collectives: bool,
    /// Whether the pool gets communicators of its own, split for it from the
    /// backend's when it is created ([`Backend::split`](crate::backend::Backend::split),
    /// under the pool's name; default `false`: the pool uses the backend's). Pools
    /// that are used from different threads (FSDP's parameter pool on the all-gather
    /// stream's thread, its gradient pool on the reduce-scatter stream's) need it:
    /// pools that share communicators must make their growths and collectives in the
    /// same order on every rank, which two threads do not.
    pub own_communicators: bool,
    /// A `SYMMPOOL_CHECK` value that names no mode, read by `from_env()` and cleared
    /// by `with_check`: reported by `Coll::new`.
    pub(crate) bad_check_env: Option<String>,
}

/// The environment variable that sets [`PoolConfig::check`]'s default.
const CHECK_ENV: &str = "SYMMPOOL_CHECK";

/// `SYMMPOOL_CHECK`: unset or empty → `Ok(None)`; `strict`, `async` or `off` (any
/// case, surrounding blanks ignored) → `Ok(Some(mode))`; anything else → `Err(value)`.
fn check_from_env() -> Result<Option<CheckMode>, String> {
    let value = match std::env::var(CHECK_ENV) {
        Err(std::env::VarError::NotPresent) => return Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => return Err(v.to_string_lossy().into_owned()),
        Ok(v) => v,
    };
    match value.trim().to_ascii_lowercase().as_str() {
        "" => Ok(None),
        "strict" => Ok(Some(CheckMode::Strict)),
        "async" => Ok(Some(CheckMode::Async)),
        "off" => Ok(Some(CheckMode::Off)),
        _ => Err(value),
    }
}

impl Default for PoolConfig {
    /// The defaults of the fields' documentation. Reads no environment variable (see
    /// [`from_env`](Self::from_env)).
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
            check: CheckMode::default(),
            check_queue: 1,
            untagged_collectives: false,
            bad_check_env: None,
            own_communicators: false,
        }
    }
}

impl PoolConfig {
    /// The [defaults](Self::default), with the check mode from the `SYMMPOOL_CHECK`
    /// environment variable (`strict`, `async` or `off`, any case) when it is set: what
    /// a program's entry point uses, so that the mode can be switched without touching
    /// the code (the crate's examples and the Python package do). A value that names
    /// no mode is not an error here: [`Coll::new`](crate::coll::Coll::new) fails with
    /// [`Error::Config`](crate::Error::Config) naming `SYMMPOOL_CHECK`, unless
    /// [`with_check`](Self::with_check) sets the mode. Nothing else is read:
    /// [`untagged_collectives`](Self::untagged_collectives) in particular is a property
    /// of the code's calls, set in the code.
    pub fn from_env() -> Self {
        let mut config = PoolConfig::default();
        match check_from_env() {
            Ok(mode) => config.check = mode.unwrap_or_default(),
            Err(bad) => config.bad_check_env = Some(bad),
        }
        config
    }

    setters! {
        with_timeout(timeout: Duration);
        with_untagged_collectives(untagged_collectives: bool);
        with_register(register: bool);
        with_require_symmetric(require_symmetric: bool);
        with_core(core: CoreConfig);
        with_own_communicators(own_communicators: bool);
        with_history_len(history_len: usize);
    }

    /// Set the pool's [name](Self::name).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Set the collective [check](Self::check) mode (beats `SYMMPOOL_CHECK`).
    pub fn with_check(mut self, check: CheckMode) -> Self {
        self.check = check;
        self.bad_check_env = None;
        self
    }

    /// Set [`check_queue`](Self::check_queue) (at least 1).
    pub fn with_check_queue(mut self, records: usize) -> Self {
        self.check_queue = records.max(1);
        self
    }

    /// The error for a `SYMMPOOL_CHECK` that names no mode, when the mode was not set
    /// with [`with_check`](Self::with_check).
    pub(crate) fn check_env_error(&self) -> Option<crate::Error> {
        self.bad_check_env.as_ref().map(|v| crate::Error::Config {
            setting: CHECK_ENV,
            value: format!("{v:?}"),
            expected: "strict, async or off (or unset: async)",
        })
    }
}
