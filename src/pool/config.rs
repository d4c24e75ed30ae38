//! [`PoolConfig`]: the settings of a pool.

use crate::core::CoreConfig;

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
}

impl Default for PoolConfig {
    /// The defaults of the fields' documentation.
    fn default() -> Self {
        PoolConfig {
            // Few large registered segments (see `CoreConfig::registered`): each
            // segment is a collective registration on every communicator.
            core: CoreConfig::registered(),
            history_len: 64,
            register: true,
            require_symmetric: false,
            name: "pool".into(),
            untagged_collectives: false,
        }
    }
}

impl PoolConfig {
    setters! {
        with_untagged_collectives(untagged_collectives: bool);
        with_register(register: bool);
        with_require_symmetric(require_symmetric: bool);
        with_core(core: CoreConfig);
        with_history_len(history_len: usize);
    }

    /// Set the pool's [name](Self::name).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}
