//! The control plane: a host-side all-gather of small byte payloads among the ranks,
//! on independent channels, with deadlines and failure detection.
//!
//! NCCL cannot report divergence, a dead peer or a frozen one: a collective simply
//! hangs. So before every collective pool operation the ranks agree over an
//! [`Exchange`]. Three implementations ship with the crate:
//!
//! * [`LocalExchange`]: ranks are threads of one process;
//! * [`StoreExchange`]: one process per rank (torchrun, `srun`, `mpirun`), over a small
//!   TCP rendezvous store that rank 0 hosts ([`StoreServer`]) and every rank (rank 0
//!   too) connects to. [`Launch`] reads the launcher's environment;
//! * [`KvExchange`]: over a key-value store the runtime already has ([`KvStore`], such
//!   as PyTorch's `c10d.Store`).
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
//!   cable) stops sending heartbeats; the server declares it lost once `T` has passed
//!   since the last it heard from it (its monitor looks then; at most `T + I` after its
//!   last heartbeat), and every waiting rank gets [`Error::PeerLost`] then. It tells
//!   the frozen rank too, before closing its connection: resumed, that rank's calls
//!   fail with [`Error::DeclaredLost`] (it cannot rejoin);
//! * if rank 0, the server's host, dies, every other rank sees its connection close and
//!   fails with [`Error::PeerLost`] `{ rank: 0, .. }` at once; if rank 0 freezes, the
//!   others notice the missing server heartbeats within `T + I`.
//!
//! So a surviving rank waiting in an exchange fails within **`T + I`** (6 s with the
//! defaults) of the loss, plus scheduling delays, whatever its own per-call timeout.
//! And it fails naming the loss whatever the order of the timeouts: a wait that runs
//! out first (a per-call timeout no longer than `T`), or that learns of another rank's
//! timeout, waits for the store's verdict until `T + I` past its start, and reports
//! the loss that explains the timeout ([`Error::PeerLost`]) rather than
//! [`Error::Timeout`] or [`Error::GroupBroken`] naming a rank that is alive.
//! A rank in no exchange call learns of the loss in the same time: its background
//! thread reads the server's word, and [`Exchange::lost_peer`] reads what has arrived.
//! The NCCL backend's watchdog asks it every interval and aborts the communicators a
//! collective may be blocked on (see the NCCL backend's table of waits).
//!
//! For a [`LocalExchange`] a rank is lost when its thread drops its exchange (the
//! thread ended, or unwound from a panic, without it): the other ranks fail with
//! [`Error::PeerLost`] at once, in its rounds and in the host backend's communicators.
//!
//! # A rank that does not come
//!
//! A rank that is alive but does not arrive (still starting, stuck elsewhere, never
//! launched) is not a loss: the others wait for it until their deadline (10 min at
//! start-up), naming it in a warning every [`WAIT_WARNING_INTERVAL`].
//!
//! # Why blocking sockets and threads
//!
//! The store carries a few hundred bytes per pool operation among at most a few
//! thousand ranks, whose callers block anyway (an agreement is a barrier). Blocking
//! `std::net` sockets with one reader thread per connection give small deterministic
//! latencies and read deadlines on every socket, with no runtime to embed in a host
//! application that may have its own (or none).

mod admission;
mod client;
mod config;
mod env;
mod join;
mod kv;
mod local;
mod mailbox;
mod rendezvous;
mod store;
mod waiting;
mod wire;

use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

pub use admission::REFUSAL_LOG_INTERVAL;
pub use client::StoreExchange;
pub use config::StoreConfig;
pub use env::{Launch, LaunchSource};
pub use kv::{KvConfig, KvExchange, KvStore};
pub use local::{LocalExchange, LocalNewcomer};
pub(crate) use rendezvous::Rendezvous;
pub use store::{JobEnd, ServerStats, StoreServer};
pub use waiting::WAIT_WARNING_INTERVAL;

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
/// Both calls wait until a [`Deadline`], the calling operation's: one public call
/// makes it once from its timeout and hands it to every round it makes.
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
    /// payload of that round, in rank order, waiting for the other ranks until
    /// `deadline` (a [`Deadline::never`] waits forever; failure detection still
    /// applies). `op` names the operation waiting, for error messages on every rank.
    ///
    /// # Errors
    /// [`Error::Timeout`] if some rank does not contribute by `deadline` (which breaks
    /// the group; `waited` is how long this call waited); [`Error::GroupBroken`] or
    /// [`Error::PeerLost`] once the group is broken; [`Error::PayloadTooLarge`] if
    /// `payload` is over the implementation's limit (nothing is sent, no round is used).
    fn all_gather(
        &self,
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>>;

    /// Open the next channel, waiting for the other ranks until `deadline`. A
    /// per-exchange counter gives its ordinal (1, 2, ...); the ranks agree, in one
    /// round on [`ChannelId::CONTROL`], that they open the same ordinal with the same
    /// `name`.
    ///
    /// # Errors
    /// [`Error::ChannelMismatch`] on every rank, naming each rank's (ordinal, name),
    /// when they differ (the counter has still moved on, so later opens keep failing
    /// the same way); [`Error::Protocol`] naming a rank whose opening does not decode;
    /// the errors of [`all_gather`](Self::all_gather).
    fn open_channel(&self, name: &str, deadline: Deadline) -> Result<ChannelId>;

    /// The rank this exchange knows to be lost, if any: its process ended, it closed
    /// its exchange, or it stopped answering heartbeats (the [failure detection
    /// bound](self#failure-detection-bound)). No round and no wait (a [`StoreExchange`]
    /// reads what its server has sent). For watchdogs that must end work blocked
    /// on the lost rank outside the exchange (the NCCL backend's aborts its
    /// communicators). Exchanges without failure detection ([`KvExchange`]) answer `None`.
    fn lost_peer(&self) -> Option<LostPeer> {
        None
    }

    /// Stop waiting on `channel` on this rank: its round in progress, and every later
    /// one, ends with [`Error::Timeout`] (at once; on a [`StoreExchange`], within its
    /// heartbeat interval when the waiter is the one reading the socket) without
    /// breaking the group (what this rank contributed stays; the peers' rounds go on).
    /// For the owner of a channel that goes away while its thread waits
    /// ([`LocalExchange`] and [`StoreExchange`] can; by default the wait runs to its
    /// deadline).
    fn abandon(&self, channel: ChannelId) {
        let _ = channel;
    }

    /// The exchange of the ranks that survive a loss, numbered densely in the order of
    /// their ranks here; this exchange fails every later call with [`Error::Shrunk`].
    /// Asking again returns the same exchange. A [`StoreExchange`]
    /// ([`StoreExchange::shrink`]) and a [`LocalExchange`] ([`LocalExchange::shrink`])
    /// can; the default cannot.
    ///
    /// # Collective
    /// Every surviving rank calls it after the loss, waiting for the others until
    /// `deadline`.
    ///
    /// # Errors
    /// [`Error::ShrinkFailed`] (the default: this exchange cannot shrink); those of
    /// [`StoreExchange::shrink`] and [`LocalExchange::shrink`].
    fn shrink(&self, deadline: Deadline) -> Result<Arc<dyn Exchange>> {
        let _ = deadline;
        Err(cannot_shrink(self))
    }

    /// The exchange of this group grown by the newcomers waiting to join it, numbered
    /// densely: on a [`StoreExchange`] in the order of their job ranks (a newcomer
    /// takes the place of the job rank it was started as), on a [`LocalExchange`] this
    /// group's ranks first, then the newcomers in the order they came; this exchange then fails every later call with [`Error::Shrunk`], and asking
    /// again returns the same exchange. The outcome is decided once, for every rank,
    /// when all of them have asked: `None` on every rank if no newcomer waits then and
    /// some rank asked with `wait` false; with `wait` true on every rank, they wait
    /// for a newcomer until `deadline`. A [`StoreExchange`] (newcomers start with
    /// `SYMMPOOL_JOIN=1`, see [`StoreExchange::from_env`]) and a [`LocalExchange`]
    /// (newcomers come through [`LocalExchange::newcomer`]) can; the default cannot.
    ///
    /// # Collective
    /// Every rank of the group calls it, at the same point of its calls.
    ///
    /// # Errors
    /// [`Error::Config`] (the default: this exchange cannot grow);
    /// [`Error::PeerLost`] if the group lost a rank, before or while they ask (shrink
    /// past it, then grow); [`Error::Timeout`] naming the ranks that did not ask by
    /// `deadline` (this rank's ask is withdrawn; with every rank asking and no newcomer
    /// by then, `None` instead); [`Error::Shrunk`] on an exchange already replaced.
    fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<dyn Exchange>>> {
        let _ = (wait, deadline);
        Err(cannot_grow(self))
    }

    /// Whether this is a newcomer's exchange: the one its join returned
    /// ([`StoreExchange::connect`] with `SYMMPOOL_JOIN=1`, [`LocalNewcomer::join`]),
    /// not those its group later shrinks or grows into. A backend made over it joins
    /// the group's (on NCCL by `ncclCommGrow` where NCCL has it); its pools join the
    /// group's pools ([`SymmPool::join`](crate::SymmPool::join)). `false` by default.
    fn is_newcomer(&self) -> bool {
        false
    }
}

/// A rank an [`Exchange`] knows to be lost ([`Exchange::lost_peer`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LostPeer {
    /// The rank.
    pub rank: usize,
    /// How the loss was noticed (the detail of [`Error::PeerLost`]).
    pub detail: String,
    /// Whether the rank closed its exchange itself (it finished, or dropped the
    /// exchange early) rather than dying or freezing. Such a rank takes part in
    /// nothing any more either, but work that no longer needs it is not lost.
    pub left: bool,
    /// Whether the rank lost is this one: the store declared it lost (it sent nothing
    /// for longer than the heartbeat timeout, e.g. frozen by `SIGSTOP`) and closed its
    /// connection; the others go on without it ([`Error::DeclaredLost`]).
    pub this_rank: bool,
}

impl LostPeer {
    /// The loss, as the error a call `op` that it ends reports: [`Error::PeerLost`],
    /// or [`Error::DeclaredLost`] where the rank lost is this one.
    pub fn error(&self, op: &'static str) -> Error {
        let (rank, detail) = (self.rank, self.detail.clone());
        if self.this_rank {
            return Error::DeclaredLost { rank, detail };
        }
        Error::PeerLost { rank, op, detail }
    }
}

/// One all-gather of serde records over `exchange`: `record` is encoded with postcard,
/// and every rank's record comes back decoded, in rank order.
///
/// # Errors
/// The errors of [`Exchange::all_gather`]; [`Error::Protocol`] naming the first
/// rank whose payload does not decode as a `T` (a rank of another version).
pub(crate) fn gather_records<T: Serialize + DeserializeOwned>(
    exchange: &dyn Exchange,
    channel: ChannelId,
    op: &'static str,
    record: &T,
    deadline: Deadline,
) -> Result<Vec<T>> {
    let payload = postcard::to_allocvec(record)
        .map_err(|e| Error::internal(format!("encoding the payload of {op}: {e}")))?;
    let all = exchange.all_gather(channel, op, &payload, deadline)?;
    let decode = |(rank, p): (usize, &Vec<u8>)| {
        postcard::from_bytes(p).map_err(|e| {
            let len = p.len();
            let detail = format!("rank {rank}'s payload of {len} bytes does not decode: {e}");
            Error::Protocol { op, detail }
        })
    };
    all.iter().enumerate().map(decode).collect()
}

/// An operation name that another rank sent (a store's broken-group notice), as
/// `&'static str`: a small, bounded set, the names the crate's own calls use.
fn intern_op(name: &str) -> &'static str {
    static NAMES: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut names = NAMES.lock();
    match names.get(name).copied() {
        Some(n) => n,
        None if names.len() >= 256 => "an exchange round",
        None => {
            let leaked: &'static str = Box::leak(name.into());
            names.insert(leaked);
            leaked
        }
    }
}

/// What a rank asks its group for, on a store and among threads (ordered: the least
/// of the asks of an epoch, all of one kind, is what the ranks ask together).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
enum Ask {
    /// To go on without the lost ranks.
    #[default]
    Shrink,
    /// To take in the newcomers; `wait`: for one, if none waits.
    Grow { wait: bool },
}

impl Ask {
    fn verb(self) -> &'static str {
        match self {
            Ask::Shrink => "shrink",
            Ask::Grow { .. } => "grow",
        }
    }
}

/// What a call on an exchange whose group has shrunk past it fails with.
const SHRUNK: Error = Error::Shrunk {
    what: "an exchange",
};

/// [`Exchange::shrink`]'s error for an exchange `ex` that cannot shrink.
fn cannot_shrink(ex: &(impl std::fmt::Debug + ?Sized)) -> Error {
    let reason = format!("{ex:?} cannot shrink (a StoreExchange or a LocalExchange can)");
    Error::shrink_failed(reason, false)
}

/// [`Exchange::grow`]'s error for an exchange `ex` that cannot grow.
fn cannot_grow(ex: &(impl std::fmt::Debug + ?Sized)) -> Error {
    let what = format!("{ex:?}");
    Error::config("Exchange::grow", what, "a StoreExchange or a LocalExchange")
}

/// One round of one of the crate's exchanges, numbered and checked by [`GatherRounds`]'
/// [`Exchange`] implementation.
struct Round<'a> {
    channel: ChannelId,
    /// The round's number on `channel`, from 1.
    number: u64,
    op: &'static str,
    /// At most the exchange's `max_payload_bytes`.
    payload: &'a [u8],
    deadline: Deadline,
    /// When the call began, for [`Error::Timeout`]'s `waited`.
    started: Instant,
}

/// What each of the crate's exchanges provides; [`Exchange`] follows, with what every
/// implementation needs done once: the payload limit (checked before anything is sent
/// or a round is used), the round numbers per channel, the channel openings.
trait GatherRounds: Send + Sync + std::fmt::Debug {
    /// This rank's place in the group and its round counters.
    fn rounds(&self) -> &Rounds;

    /// Contribute `round.payload` to `round` and return every rank's payload of it, in
    /// rank order; the errors are those of [`Exchange::all_gather`].
    fn gather_round(&self, round: Round<'_>) -> Result<Vec<Vec<u8>>>;

    /// [`Exchange::lost_peer`].
    fn lost_peer(&self) -> Option<LostPeer> {
        None
    }

    /// [`Exchange::abandon`].
    fn abandon(&self, _channel: ChannelId) {}

    /// [`Exchange::shrink`].
    fn shrink(&self, _deadline: Deadline) -> Result<Arc<dyn Exchange>> {
        Err(cannot_shrink(self))
    }

    /// [`Exchange::grow`].
    fn grow(&self, _wait: bool, _deadline: Deadline) -> Result<Option<Arc<dyn Exchange>>> {
        Err(cannot_grow(self))
    }
}

impl<T: GatherRounds> Exchange for T {
    fn rank(&self) -> usize {
        self.rounds().rank
    }

    fn world_size(&self) -> usize {
        self.rounds().world_size
    }

    fn all_gather(
        &self,
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        deadline: Deadline,
    ) -> Result<Vec<Vec<u8>>> {
        let started = Instant::now();
        let rounds = self.rounds();
        if payload.len() > rounds.max_payload_bytes {
            return Err(Error::PayloadTooLarge {
                payload_bytes: payload.len(),
                max_bytes: rounds.max_payload_bytes,
            });
        }
        self.gather_round(Round {
            channel,
            number: rounds.next(channel),
            op,
            payload,
            deadline,
            started,
        })
    }

    fn open_channel(&self, name: &str, deadline: Deadline) -> Result<ChannelId> {
        self.rounds().open(self, name, deadline)
    }

    fn lost_peer(&self) -> Option<LostPeer> {
        GatherRounds::lost_peer(self)
    }

    fn abandon(&self, channel: ChannelId) {
        GatherRounds::abandon(self, channel);
    }

    fn shrink(&self, deadline: Deadline) -> Result<Arc<dyn Exchange>> {
        GatherRounds::shrink(self, deadline)
    }

    fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<dyn Exchange>>> {
        GatherRounds::grow(self, wait, deadline)
    }

    fn is_newcomer(&self) -> bool {
        self.rounds().newcomer
    }
}

/// A rank's place in the group and the round counters every [`GatherRounds`]
/// implementation keeps: one per channel, and the counter of opened channels.
#[derive(Default)]
struct Rounds {
    /// This rank, in `0..world_size`.
    rank: usize,
    world_size: usize,
    /// The largest payload a round takes (`usize::MAX`: no limit beyond memory).
    max_payload_bytes: usize,
    /// [`Exchange::is_newcomer`].
    newcomer: bool,
    per_channel: Mutex<HashMap<ChannelId, u64>>,
    opened: Mutex<u64>,
}

impl Rounds {
    /// No rounds yet, for `rank` of `world_size` ranks.
    fn new(rank: usize, world_size: usize, max_payload_bytes: usize) -> Self {
        Rounds {
            rank,
            world_size,
            max_payload_bytes,
            ..Rounds::default()
        }
    }

    /// The number of the next round of `channel` on this rank (1, 2, ...).
    fn next(&self, channel: ChannelId) -> u64 {
        let mut rounds = self.per_channel.lock();
        let r = rounds.entry(channel).or_insert(0);
        *r += 1;
        *r
    }

    /// [`Exchange::open_channel`] for any implementation.
    fn open(&self, ex: &dyn Exchange, name: &str, deadline: Deadline) -> Result<ChannelId> {
        let mut opened = self.opened.lock();
        *opened += 1;
        // What a rank opens: the ordinal and the name.
        let mine = (*opened, name.to_owned());
        let all = gather_records(ex, ChannelId::CONTROL, "open_channel", &mine, deadline)?;
        if all.iter().all(|o| *o == mine) {
            return Ok(ChannelId(mine.0));
        }
        let opened = (all.into_iter().enumerate())
            .map(|(rank, (ordinal, name))| (rank, ordinal, name))
            .collect();
        Err(Error::ChannelMismatch { opened })
    }
}

/// The store's frame decoder, for the fuzz target (`fuzz/fuzz_targets/store_frames.rs`);
/// not part of the crate's API.
#[doc(hidden)]
pub mod fuzzing {
    pub use super::wire::fuzz_frames;
}
