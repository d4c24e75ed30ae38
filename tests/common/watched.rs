//! An exchange that tells a test of every round before it runs, so the test can count
//! the rounds of one pool call or act while a pool is inside one (no sleeps).

use std::sync::Arc;
use symmpool::{ChannelId, Deadline, Exchange, Result};

/// Wraps an exchange; calls `on_round(op)` before each all-gather it forwards.
pub struct Watched {
    inner: Arc<dyn Exchange>,
    on_round: Box<dyn Fn(&'static str) + Send + Sync>,
}

impl Watched {
    /// `inner` watched by `on_round`, ready for `Backend::with_exchange`.
    pub fn wrap(
        inner: Arc<dyn Exchange>,
        on_round: impl Fn(&'static str) + Send + Sync + 'static,
    ) -> Arc<dyn Exchange> {
        Arc::new(Watched {
            inner,
            on_round: Box::new(on_round),
        })
    }
}

impl std::fmt::Debug for Watched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("inner", &self.inner)
            .finish()
    }
}

impl Exchange for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(
        &self,
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        (self.on_round)(op);
        self.inner.all_gather(channel, op, payload, deadline)
    }
    fn open_channel(&self, name: &str, deadline: Deadline) -> Result<ChannelId> {
        self.inner.open_channel(name, deadline)
    }
}
