//! An exchange that tells a test of every round before it runs, so the test can count
//! the rounds of one pool call, act while a pool is inside one (no sleeps), change a
//! round's payload or deadline, or act in a rank's ask to shrink.

use std::borrow::Cow;
use std::sync::Arc;
use symmpool::control::LostPeer;
use symmpool::{ChannelId, Deadline, Exchange, Result};

/// What a test does at a watched exchange's calls; each default passes the call on
/// unchanged.
pub trait Watch: Send + Sync + 'static {
    /// Before the all-gather `op` goes on: it may change the `payload` this rank sends
    /// and the `deadline` it waits by.
    fn round(&self, op: &'static str, payload: &mut Cow<'_, [u8]>, deadline: &mut Deadline) {
        let _ = (op, payload, deadline);
    }

    /// This rank's ask to shrink, which `inner` (the watched exchange) answers by
    /// default.
    ///
    /// # Errors
    /// Those of [`Exchange::shrink`].
    fn shrink(&self, inner: &dyn Exchange, deadline: Deadline) -> Result<Arc<dyn Exchange>> {
        inner.shrink(deadline)
    }
}

/// A closure told of each round's `op`.
struct OnRound<F>(F);

impl<F: Fn(&'static str) + Send + Sync + 'static> Watch for OnRound<F> {
    fn round(&self, op: &'static str, _: &mut Cow<'_, [u8]>, _: &mut Deadline) {
        (self.0)(op)
    }
}

/// Wraps an exchange; its [`Watch`] sees each all-gather and ask to shrink, every
/// other call goes to the exchange as it is.
pub struct Watched {
    inner: Arc<dyn Exchange>,
    watch: Box<dyn Watch>,
}

impl Watched {
    /// `inner` watched by `on_round(op)` before each all-gather it forwards, ready for
    /// `Backend::with_exchange`.
    pub fn wrap(
        inner: Arc<dyn Exchange>,
        on_round: impl Fn(&'static str) + Send + Sync + 'static,
    ) -> Arc<dyn Exchange> {
        Watched::with(inner, OnRound(on_round))
    }

    /// `inner` watched by `watch`, ready for `Backend::with_exchange`.
    pub fn with(inner: Arc<dyn Exchange>, watch: impl Watch) -> Arc<dyn Exchange> {
        Arc::new(Watched {
            inner,
            watch: Box::new(watch),
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
        mut deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let mut payload = Cow::Borrowed(payload);
        self.watch.round(op, &mut payload, &mut deadline);
        self.inner.all_gather(channel, op, &payload, deadline)
    }
    fn open_channel(&self, name: &str, deadline: Deadline) -> Result<ChannelId> {
        self.inner.open_channel(name, deadline)
    }
    fn lost_peer(&self) -> Option<LostPeer> {
        self.inner.lost_peer()
    }
    fn shrink(&self, deadline: Deadline) -> Result<Arc<dyn Exchange>> {
        self.watch.shrink(&*self.inner, deadline)
    }
    fn is_newcomer(&self) -> bool {
        self.inner.is_newcomer()
    }
}
