//! The control plane: a host-side all-gather of small byte payloads among the ranks,
//! on independent channels, with deadlines and failure detection.
//!
//! NCCL cannot report divergence, a dead peer or a frozen one: a collective simply
//! hangs. So before every collective pool operation the ranks agree over an
//! [`Exchange`]. Two implementations ship with the crate:
//!
//! * [`LocalExchange`]: ranks are threads of one process;
//! * [`StoreExchange`]: one process per rank (torchrun, `srun`, `mpirun`), over a small
//!   TCP rendezvous store that rank 0 hosts ([`StoreServer`]) and every rank (rank 0
//!   too) connects to. [`Launch`] reads the launcher's environment.
//!
//! # Failure detection bound
//!
//! For a [`StoreExchange`] with heartbeat interval `I` and heartbeat timeout `T`
//! ([`StoreConfig::heartbeat_interval`], [`StoreConfig::heartbeat_timeout`]; 1 s and
//! 5 s by default):
//!
//! * a rank whose process dies (`kill -9`, the OOM killer, a crash) closes its socket;
//!   the server sees the end of stream at once, and every surviving rank that is in,
//!   or later enters, an exchange call gets [`Error::PeerLost`] naming it within
//!   milliseconds;
//! * a rank that stops without closing its socket (`SIGSTOP`, a hung host, a cut
//!   cable) stops sending heartbeats; the server declares it lost at most `T + I` after
//!   its last heartbeat, and every waiting rank gets [`Error::PeerLost`] then;
//! * if rank 0, the server's host, dies, every other rank sees its connection close and
//!   fails with [`Error::PeerLost`] `{ rank: 0, .. }` at once; if rank 0 freezes, the
//!   others notice the missing server heartbeats within `T + I`.
//!
//! So a surviving rank waiting in an exchange fails within **`T + I`** (6 s with the
//! defaults) of the loss, plus scheduling delays, whatever its own per-call timeout.
//!
//! # Why blocking sockets and threads
//!
//! The store carries a few hundred bytes per pool operation among at most a few
//! thousand ranks, and its callers block anyway (an agreement is a barrier). Blocking
//! `std::net` sockets with one reader thread per connection are the simplest design
//! that gives deterministic, small latencies, read deadlines on every socket and no
//! runtime to embed in a host application that may have its own (or none).
//! An async runtime would add a large dependency and its own threads for no gain at
//! this scale.

mod client;
mod config;
mod env;
mod kv;
mod local;
mod store;
mod wire;

use crate::error::{Error, Result};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use client::StoreExchange;
pub use config::StoreConfig;
pub use env::{Launch, LaunchSource};
pub use kv::{KvConfig, KvExchange, KvStore};
pub use local::LocalExchange;
pub use store::{ServerStats, StoreServer};

/// One independent sequence of all-gather rounds of an [`Exchange`].
///
/// Every channel has its own round counter on every rank, so rounds on different
/// channels never pair with each other. Channel 0, [`ChannelId::CONTROL`], exists from
/// the start and carries [`Exchange::open_channel`]'s agreement; other channels come
/// from [`Exchange::open_channel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelId(u64);

impl ChannelId {
    /// The control channel, ordinal 0, open from the start.
    pub const CONTROL: ChannelId = ChannelId(0);

    /// The channel's ordinal: 0 for [`ChannelId::CONTROL`], then 1, 2, ... in the order
    /// the channels were opened.
    pub const fn ordinal(self) -> u64 {
        self.0
    }
}

/// An all-gather of small byte payloads among the ranks of a group, on independent
/// channels, with deadlines.
///
/// # Collective
/// On each channel, every rank calls [`all_gather`](Self::all_gather) the same number
/// of times, in the same order; round *k* of a channel on one rank pairs with round
/// *k* of the same channel on every other rank. Calls on different channels may run
/// concurrently (from different threads) and interleave freely. Calls on one channel
/// must be ordered by the caller.
///
/// # A broken group stays broken (required of every implementation)
/// If a call times out on some rank, or a peer is lost, the ranks' round counters are
/// out of step: pairing later rounds would match different calls with each other. So
/// from then on **every later call, on every channel, on every rank fails** (with
/// [`Error::GroupBroken`] after a timeout, [`Error::PeerLost`] after a loss), and calls
/// already waiting fail as soon as they learn of it. The rank that timed out gets
/// [`Error::Timeout`] naming the ranks that had not arrived. Drop the exchange (and
/// everything built on it) and start again.
pub trait Exchange: Send + Sync + std::fmt::Debug {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Contribute `payload` to the next round of `channel` and return every rank's
    /// payload of that round, in rank order. `op` names the operation waiting, for
    /// error messages on every rank. A `timeout` of [`Duration::MAX`] waits forever
    /// (failure detection still applies).
    ///
    /// # Errors
    /// [`Error::Timeout`] if some rank does not contribute within `timeout` (which
    /// breaks the group); [`Error::GroupBroken`] or [`Error::PeerLost`] once the group
    /// is broken; [`Error::PayloadTooLarge`] if `payload` is over the implementation's
    /// limit (nothing is sent, no round is used).
    fn all_gather(
        &self,
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>>;

    /// Open the next channel. A per-exchange counter gives its ordinal (1, 2, ...);
    /// the ranks agree, in one round on [`ChannelId::CONTROL`], that they open the same
    /// ordinal with the same `name`.
    ///
    /// # Errors
    /// [`Error::ChannelMismatch`] on every rank, naming each rank's (ordinal, name),
    /// when they differ (the counter has still moved on, so later opens keep failing
    /// the same way); the errors of [`all_gather`](Self::all_gather).
    fn open_channel(&self, name: &str, timeout: Duration) -> Result<ChannelId>;
}

/// Far enough to mean "no deadline" for a `Duration::MAX` timeout.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `now + timeout`, saturating at about a century for endless timeouts.
pub(crate) fn deadline_after(now: Instant, timeout: Duration) -> Instant {
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FOREVER))
        .unwrap_or(now)
}

/// [`Exchange::open_channel`] for any implementation, with its channel counter.
fn open_channel_with(
    ex: &dyn Exchange,
    counter: &Mutex<u64>,
    name: &str,
    timeout: Duration,
) -> Result<ChannelId> {
    let mut next = counter.lock().unwrap_or_else(|p| p.into_inner());
    *next += 1;
    let ordinal = *next;
    let mut payload = Vec::with_capacity(8 + name.len());
    payload.extend_from_slice(&ordinal.to_le_bytes());
    payload.extend_from_slice(name.as_bytes());
    let all = ex.all_gather(ChannelId::CONTROL, "open_channel", &payload, timeout)?;
    if all.iter().all(|p| *p == payload) {
        return Ok(ChannelId(ordinal));
    }
    let opened = all
        .iter()
        .enumerate()
        .map(|(rank, p)| {
            let (ord, name) = p.split_at(p.len().min(8));
            let mut ord_bytes = [0u8; 8];
            ord_bytes[..ord.len()].copy_from_slice(ord);
            (
                rank,
                u64::from_le_bytes(ord_bytes),
                String::from_utf8_lossy(name).into_owned(),
            )
        })
        .collect();
    Err(Error::ChannelMismatch { opened })
}
