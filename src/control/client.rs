//! [`StoreExchange`]: an [`Exchange`](super::Exchange) over the TCP store, one process per rank.

mod regroup;

use super::config::StoreConfig;
use super::join::{join_store, transport};
use super::store::{CLOSED, StoreServer};
use super::waiting::{WaitWarnings, Who, ranks};
use super::wire::{self, Broken, Cause, FrameReader, ReadError, SharedStream, ToClient, ToServer};
use super::{ChannelId, GatherRounds, LostPeer, Round, Rounds, SHRUNK, intern_op};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use serde_bytes::ByteBuf;
use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, Shutdown};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// An [`Exchange`](super::Exchange) among processes over the crate's TCP store.
///
/// Rank 0 hosts a [`StoreServer`]; every rank, rank 0 too, connects to it. A waiting
/// caller reads the socket itself when no other thread is (a round costs no thread
/// wake-up); a background thread per rank sends heartbeats and, when nobody has read
/// for half a heartbeat interval, reads, to watch the server's (the failure-detection
/// bound: [`control`](super)). A long wait warns ([`StoreConfig::wait_warning_interval`]).
///
/// Dropping the exchange says goodbye to the server: later calls on the other ranks
/// fail with [`Error::PeerLost`] naming it (leaving is final, like a crash). The
/// hosting rank's drop waits up to [`StoreConfig::linger`] for the others to leave
/// before stopping the server, so that they can read the last results; with several
/// ranks in one process (tests), drop the hosting rank's exchange last.
pub struct StoreExchange {
    shared: Arc<ClientShared>,
    /// The connection, shared by the exchanges a shrink makes of this one.
    connection: Arc<Connection>,
    /// This rank's place in the group, its payload limit and its round counters.
    rounds: Rounds,
    /// The group's epoch (0 at start, one more per shrink or grow).
    epoch: u64,
    /// The exchange of the group this one shrank or grew into (see
    /// [`StoreExchange::shrink`], [`StoreExchange::grow`]).
    successor: Mutex<Option<Arc<StoreExchange>>>,
}

/// What a rank's exchanges share and the last of them closes: the background thread,
/// the server it hosts, the goodbye.
struct Connection {
    shared: Arc<ClientShared>,
    reader: Option<JoinHandle<()>>,
    server: Option<StoreServer>,
}

struct ClientShared {
    server: String,
    /// The socket (one descriptor, shared with `reader`), for writing.
    writer: Mutex<SharedStream>,
    /// The socket's reader; whoever sets `Inbox::reader_busy` reads from it.
    reader: Mutex<FrameReader<SharedStream>>,
    inbox: Mutex<Inbox>,
    /// Signalled when the inbox changes (callers wait on it).
    cv: Condvar,
    /// Signalled only on close: the background thread waits on it, not woken by frames.
    bg_cv: Condvar,
    /// The settings (heartbeats, spin, linger).
    config: StoreConfig,
    closing: AtomicBool,
}

/// What the socket has delivered, and who is reading it.
///
/// Reading is leader/follower: a thread that needs a frame (a caller waiting for its
/// round, or the background thread when nobody has read for half a heartbeat
/// interval) reads and dispatches one itself when nobody else is reading, and
/// otherwise waits on the condition variable; so callers in a busy loop read their
/// results without waking another thread.
#[derive(Default)]
struct Inbox {
    results: HashMap<(u64, u64), Vec<ByteBuf>>,
    /// The server's word on rounds that wait long: the ranks that have not
    /// contributed, by (channel, round) (see [`ToClient::Waiting`]).
    waiting: HashMap<(u64, u64), Vec<u32>>,
    /// The channels this rank [abandoned](super::Exchange::abandon).
    abandoned: Vec<u64>,
    broken: Option<Broken>,
    /// When this rank learnt that the group broke (the verdict's wait counts from it).
    broken_at: Option<Instant>,
    /// The first loss the server told of, even after a timeout broke the group first:
    /// the store's verdict, which explains that timeout.
    lost: Option<Broken>,
    /// The store declared this rank lost and closed its connection (its reason).
    expelled: Option<String>,
    /// How this rank lost the store's server, if it did.
    server_gone: Option<String>,
    /// A call has waited out the verdict's window after the group broke (or read all
    /// that had arrived): later calls report what is known at once.
    settled: bool,
    /// Frames read and dispatched.
    frames: u64,
    present: Vec<u32>,
    all_joined: bool,
    reader_busy: bool,
    /// The connection ended (or failed); nobody reads any more.
    reader_done: bool,
    last_heard: Now,
    last_read: Now,
    /// The socket's current read timeout (set only when it changes).
    read_timeout: Duration,
    /// The group's epoch and its job ranks, as the server last said
    /// ([`ToClient::Regrouped`]); epoch 0 is the whole job.
    epoch: u64,
    group: Vec<u32>,
    /// Why this rank's latest request to shrink or grow failed, as the server said.
    shrink_failed: Option<(String, bool)>,
    /// The answer to this rank's latest ask to grow: no newcomer ([`ToClient::NotGrown`]).
    not_grown: bool,
    /// A withdrawn ask's answer (the group's ranks that had not asked); whether it is due.
    shrink_withdrawn: Option<Vec<u32>>,
    withdraw_pending: bool,
}

/// An instant, by default the moment it is made (when the connection is).
struct Now(Instant);

impl Default for Now {
    fn default() -> Self {
        Now(Instant::now())
    }
}

impl Inbox {
    fn server_lost(&mut self, detail: String) {
        self.server_gone.get_or_insert_with(|| detail.clone());
        self.note_broken(Broken::lost(0, detail));
    }

    /// The group is broken by `b`: the first cause stays the group's; the first loss is
    /// kept too (it explains a timeout that came first).
    fn note_broken(&mut self, b: Broken) {
        if matches!(b.cause, Cause::Lost { .. }) && self.lost.is_none() {
            self.lost = Some(b.clone());
        }
        if self.broken.is_none() {
            self.broken = Some(b);
            self.broken_at = Some(Instant::now());
        }
    }

    /// Whether the store's word on a loss has come: a lost rank, or this rank expelled.
    fn verdict(&self) -> bool {
        self.lost.is_some() || self.expelled.is_some()
    }

    /// Take in a frame the server sent; `Some`: the server dropped this rank, why.
    fn dispatch(&mut self, msg: ToClient) -> Option<String> {
        match msg {
            ToClient::Result {
                channel,
                round,
                payloads,
            } => {
                self.results.insert((channel, round), payloads);
            }
            ToClient::Broken(b) => self.note_broken(b),
            ToClient::Expelled { reason } => self.expelled = Some(reason),
            ToClient::Joined { present } => self.present = present,
            ToClient::Waiting {
                channel,
                round,
                missing,
            } => {
                self.waiting.insert((channel, round), missing);
            }
            ToClient::AllJoined => self.all_joined = true,
            ToClient::Regrouped { epoch, group } => {
                // Everything of the old group came before, on this connection: the
                // group's state as of the new epoch, nothing broken.
                self.results.clear();
                self.waiting.clear();
                (self.broken, self.broken_at, self.lost) = (None, None, None);
                self.settled = false;
                (self.epoch, self.group) = (epoch, group);
                // A withdrawal the server had not read by then is not answered.
                self.withdraw_pending = false;
            }
            ToClient::ShrinkFailed { reason, retry } => self.shrink_failed = Some((reason, retry)),
            ToClient::Withdrawn { missing } => {
                (self.shrink_withdrawn, self.withdraw_pending) = (Some(missing), false);
            }
            // (Also the answer to a withdrawal.)
            ToClient::NotGrown => (self.not_grown, self.withdraw_pending) = (true, false),
            ToClient::Heartbeat | ToClient::Welcome => {}
            ToClient::Reject { reason, .. } => {
                return Some(format!("the store server dropped this rank: {reason}"));
            }
        }
        None
    }
}

impl fmt::Debug for StoreExchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreExchange")
            .field("rank", &self.rounds.rank)
            .field("world_size", &self.rounds.world_size)
            .field("server", &self.shared.server)
            .field("epoch", &self.epoch)
            .field("hosting", &self.connection.server.is_some())
            .finish()
    }
}

impl ClientShared {
    /// Send `frame` (`what`: "writing to", say); `false` if that failed. Then, unless
    /// this rank is closing, the server is lost, unless what it sent before says
    /// otherwise. What has arrived is read first ([`drain`]): a rank the store declared
    /// lost finds its word there ([`ToClient::Expelled`]), and the reader then the
    /// connection's end.
    ///
    /// [`drain`]: Self::drain
    fn send_or_lose(&self, frame: &[u8], what: &str) -> bool {
        let Err(e) = self.writer.lock().send(frame) else {
            return true;
        };
        if !self.closing.load(Ordering::SeqCst) {
            let read_by = Deadline::after(self.config.heartbeat_interval);
            let why = format!("{what} the store server at {} failed: {e}", self.server);
            self.drain(self.inbox.lock(), read_by).server_lost(why);
            self.cv.notify_all();
        }
        false
    }

    /// Read and dispatch what has arrived, without waiting for more: polling while
    /// nobody else reads, and while another thread reads, waiting for it (until
    /// `deadline`: it dispatches what has arrived at once).
    fn drain<'a>(
        &'a self,
        mut inbox: MutexGuard<'a, Inbox>,
        deadline: Deadline,
    ) -> MutexGuard<'a, Inbox> {
        // Bounded: what has arrived is a few frames.
        for _ in 0..256 {
            if inbox.reader_done {
                break;
            } else if inbox.reader_busy {
                if deadline.expired() {
                    break;
                }
                self.cv.wait_until(&mut inbox, deadline.instant());
                continue;
            }
            let before = inbox.frames;
            inbox = self.read_once(inbox, Duration::ZERO, None);
            if inbox.frames == before {
                break;
            }
        }
        inbox
    }

    /// Read one frame (polling for up to `spin` first, then waiting at most `limit`;
    /// `None`: only what has arrived) and dispatch it. The caller has checked that
    /// nobody else is reading.
    fn read_once<'a>(
        &'a self,
        mut inbox: MutexGuard<'a, Inbox>,
        spin: Duration,
        limit: Option<Duration>,
    ) -> MutexGuard<'a, Inbox> {
        inbox.reader_busy = true;
        // Whole milliseconds (truncated, at least one), so that the socket option
        // rarely changes.
        let limit = limit.map(|l| Duration::from_millis(l.as_millis().max(1) as u64));
        let set_timeout = limit.filter(|l| inbox.read_timeout != *l);
        inbox.read_timeout = set_timeout.unwrap_or(inbox.read_timeout);
        drop(inbox);
        let (got, progressed) = {
            let mut reader = self.reader.lock();
            let before = reader.bytes_read;
            let got = (set_timeout.map_or(Ok(()), |t| reader.inner.set_read_timeout(Some(t))))
                .map_err(ReadError::Io)
                .and_then(|()| reader.spin_frame(spin, limit.is_some()));
            (got, reader.bytes_read > before)
        };
        let mut inbox = self.inbox.lock();
        inbox.reader_busy = false;
        let now = Instant::now();
        inbox.last_read = Now(now);
        let framed = matches!(got, Ok(Some(_)));
        // (Bytes of a large frame still arriving: the server is alive.)
        if progressed || framed {
            inbox.last_heard = Now(now);
        }
        inbox.frames += u64::from(framed);
        let ended = match got {
            Ok(Some(body)) => match wire::decode(&body) {
                Ok(msg) => inbox.dispatch(msg),
                Err(why) => Some(format!("the store server sent garbage: {why}")),
            },
            Ok(None) => None,
            Err(e) => {
                let why = match e {
                    ReadError::Eof { .. } => "closed".to_string(),
                    e => format!("failed: {e}"),
                };
                Some(format!(
                    "the connection to the store server at {} {why} (rank 0 exited, was killed or closed its exchange)",
                    self.server
                ))
            }
        };
        if let Some(detail) = ended {
            inbox.reader_done = true;
            // (Closing, this rank ends the connection itself.)
            if !self.closing.load(Ordering::SeqCst) {
                inbox.server_lost(detail);
            }
        }
        // Declare the server lost once it has been silent for over the heartbeat
        // timeout (also after a timeout broke the group: a frozen server explains it),
        // after a read, which took whatever had arrived.
        let silent = now.saturating_duration_since(inbox.last_heard.0);
        if silent > self.config.heartbeat_timeout && !inbox.verdict() && !inbox.reader_done {
            inbox.server_lost(format!(
                "no heartbeat from the store server at {} for {silent:?} (rank 0 is frozen, e.g. SIGSTOP, or unreachable)",
                self.server
            ));
        }
        self.cv.notify_all();
        inbox
    }

    /// Withdraw this rank's ask to regroup the group of `epoch` (or its join: 0), with
    /// `inbox` locked, and wait for the server's word (on this connection, in order:
    /// withdrawn, or `answered`) a heartbeat timeout and interval at most.
    fn withdraw<'a>(
        &'a self,
        mut inbox: MutexGuard<'a, Inbox>,
        epoch: u64,
        answered: impl Fn(&mut Inbox) -> bool,
    ) -> MutexGuard<'a, Inbox> {
        inbox.withdraw_pending = true;
        drop(inbox);
        let withdraw = wire::encode(&ToServer::Withdraw { epoch });
        let sent = self.writer.lock().send(&withdraw).is_ok();
        let answer_by = Deadline::after(self.config.detection_bound());
        self.wait_until(answer_by, |ib| {
            !sent || !ib.withdraw_pending || answered(ib)
        })
    }

    /// Wait until `done` holds or `deadline` passes, reading the socket when nobody
    /// else is.
    fn wait_until(
        &self,
        deadline: Deadline,
        mut done: impl FnMut(&mut Inbox) -> bool,
    ) -> MutexGuard<'_, Inbox> {
        let mut inbox = self.inbox.lock();
        loop {
            let left = deadline.remaining();
            if done(&mut inbox) || left.is_zero() {
                return inbox;
            }
            if !inbox.reader_busy && !inbox.reader_done {
                // The blocking read waits only for what polling leaves of `left`, so
                // the deadline is overshot by at most the socket timeout's floor (one
                // millisecond, which the kernel rounds up to a clock tick).
                let spin = self.config.spin.min(left);
                let limit = (left - spin).min(self.config.heartbeat_interval);
                inbox = self.read_once(inbox, spin, Some(limit));
            } else {
                self.cv.wait_for(&mut inbox, left);
            }
        }
    }
}

/// The background thread: send heartbeats, and read (so that server heartbeats and
/// broken-group notices are seen, and the server's silence is noticed) whenever no
/// caller has read for half a heartbeat interval.
fn background_loop(shared: &ClientShared) {
    let heartbeat = wire::encode(&ToServer::Heartbeat);
    let interval = shared.config.heartbeat_interval;
    let mut last_sent = Instant::now();
    let mut inbox = shared.inbox.lock();
    loop {
        if shared.closing.load(Ordering::SeqCst) || inbox.reader_done {
            return;
        }
        let now = Instant::now();
        if now.saturating_duration_since(last_sent) >= interval {
            drop(inbox);
            last_sent = now;
            if !shared.send_or_lose(&heartbeat, "sending a heartbeat to") {
                return;
            }
            inbox = shared.inbox.lock();
            continue;
        }
        // (The server's silence is noticed by whoever reads, after reading: before
        // it, a long silence may be this process's own freeze, with the server's word
        // waiting in the socket.)
        let until_heartbeat = (last_sent + interval).saturating_duration_since(now);
        let unattended = now.saturating_duration_since(inbox.last_read.0) >= interval / 2;
        if !inbox.reader_busy && unattended {
            inbox = shared.read_once(inbox, Duration::ZERO, Some(until_heartbeat));
        } else {
            // Until the socket has gone unread for half an interval (while another
            // thread reads: half an interval): a frame waits at most that long.
            let unread = Some(inbox.last_read.0).filter(|_| !inbox.reader_busy);
            let nap = (unread.unwrap_or(now) + interval / 2).saturating_duration_since(now);
            let nap = until_heartbeat.min(nap).max(Duration::from_millis(1));
            shared.bg_cv.wait_for(&mut inbox, nap);
        }
    }
}

impl StoreExchange {
    /// Connect to the store described by `config`, hosting the server first when
    /// `config.host_server` (rank 0 by default), and wait until every rank has
    /// joined, all within `config.startup_timeout`. A newcomer
    /// ([`StoreConfig::join`]) waits instead, as long, until the group's ranks grow
    /// the group ([`grow`](Self::grow)): its exchange is its place in the grown group
    /// (its rank, world size and epoch), as the old ranks' grown exchanges are.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for inconsistent settings; [`Error::Transport`] if the
    /// server cannot be bound or reached in time (at once, naming the descriptor
    /// limit, when this process is out of descriptors); [`Error::JobMismatch`] if
    /// the store serves another job ([`StoreConfig::job_id`]); [`Error::RankTaken`]
    /// if another process holds this rank (naming both); [`Error::Protocol`] or
    /// [`Error::StoreRejected`] if the handshake fails otherwise (a store busy with
    /// other handshakes is retried until the start-up timeout); [`Error::Timeout`] (op
    /// `"store start-up"`, naming the ranks that never joined) or
    /// [`Error::PeerLost`] if the group does not assemble. A newcomer: at once
    /// [`Error::RankTaken`] if a process holds its job rank, [`Error::JobMismatch`]
    /// or [`Error::StoreRejected`] (a wrong token) for another job's store;
    /// [`Error::StoreRejected`] if its job rank is still in the group at the timeout
    /// (the survivors never shrank past its loss; it retries until then);
    /// [`Error::Timeout`] (op `"join: ..."`) if no grow takes it in.
    pub fn connect(config: StoreConfig) -> Result<StoreExchange> {
        let every_interface = (Ipv4Addr::UNSPECIFIED, config.launch.master_port).into();
        let addr = config.bind_addr.unwrap_or(every_interface);
        let server = (config.host_server).then(|| StoreServer::bind(addr, &config));
        Self::start(config, server.transpose()?)
    }

    /// Connect to `server` (already bound, e.g. on port 0 to learn its port first),
    /// which this exchange then owns; otherwise as [`connect`](Self::connect).
    ///
    /// # Errors
    /// As [`connect`](Self::connect).
    pub fn connect_hosting(config: StoreConfig, server: StoreServer) -> Result<StoreExchange> {
        Self::start(config, Some(server))
    }

    /// [`StoreConfig::from_env`] then [`connect`](Self::connect): with
    /// `SYMMPOOL_JOIN=1`, a newcomer that replaces a lost job rank (`RANK`) and
    /// returns once the group's ranks grew the group with it.
    ///
    /// # Errors
    /// As both.
    pub fn from_env() -> Result<StoreExchange> {
        Self::connect(StoreConfig::from_env()?)
    }

    /// The server this rank hosts, if any.
    pub fn server(&self) -> Option<&StoreServer> {
        self.connection.server.as_ref()
    }

    fn start(config: StoreConfig, server: Option<StoreServer>) -> Result<StoreExchange> {
        config.check()?;
        let started = Instant::now();
        let deadline = Deadline::after_from(started, config.startup_timeout);
        let launch = &config.launch;
        let target = match server.as_ref().map(StoreServer::local_addr) {
            Some(mut a) => {
                // A server on every interface is reached on the loopback one.
                if a.ip().is_unspecified() {
                    a.set_ip(match a.is_ipv4() {
                        true => Ipv4Addr::LOCALHOST.into(),
                        false => Ipv6Addr::LOCALHOST.into(),
                    });
                }
                a.to_string()
            }
            None => format!("{}:{}", launch.master_addr, launch.master_port),
        };
        // One wait, warned about every interval: for the server, then for the ranks (a
        // newcomer: for the group to grow).
        let op = if config.join {
            "join"
        } else {
            "store start-up"
        };
        let mut warnings = WaitWarnings::new(op, started, config.wait_warning_interval);
        let reader = join_store(&config, &target, deadline, &mut warnings)?;
        let shared = Arc::new(ClientShared {
            server: target,
            writer: Mutex::new(reader.inner.clone()),
            reader: Mutex::new(reader),
            inbox: Mutex::default(),
            cv: Condvar::new(),
            bg_cv: Condvar::new(),
            config: config.clone(),
            closing: AtomicBool::new(false),
        });
        let s = shared.clone();
        let handle = thread::Builder::new()
            .name(format!("symmpool-store-client-{}", launch.rank))
            .spawn(move || background_loop(&s))
            .map_err(transport(
                "store start-up",
                "starting the reader thread".into(),
            ))?;
        let ex = StoreExchange {
            connection: Arc::new(Connection {
                shared: shared.clone(),
                reader: Some(handle),
                server,
            }),
            shared,
            rounds: Rounds::new(launch.rank, launch.world_size, config.max_payload_bytes()),
            epoch: 0,
            successor: Mutex::new(None),
        };
        // Wait for every rank to join (a newcomer: to be taken in), naming the missing
        // ones while waiting long. (A newcomer is told of nothing but its group, and of
        // the store's loss, which breaks it.)
        let me = launch.rank as u32;
        let joined =
            |ib: &mut Inbox| ib.all_joined || ib.broken.is_some() || ib.group.contains(&me);
        let mut inbox = loop {
            let mut inbox = (ex.shared).wait_until(warnings.until(deadline), joined);
            if joined(&mut inbox) || deadline.expired() {
                break inbox;
            }
            if warnings.due() {
                let missing = match config.join {
                    true => "the group to grow".into(),
                    false => ranks(&ex.missing(&inbox.present)),
                };
                drop(inbox);
                warnings.warn(&ex.who(), missing, deadline);
            }
        };
        if config.join && !joined(&mut inbox) && !inbox.reader_done {
            // Giving up: withdrawn, so that no grow the store decides after this takes
            // in a newcomer that is gone; one it decided before (its group on the way,
            // before the answer) takes it in after all.
            inbox = ex.shared.withdraw(inbox, 0, |ib| ib.reader_done);
        }
        let grown = (config.join)
            .then(|| ex.member_of(&inbox.group, inbox.epoch, "join", started))
            .flatten()
            .map(|mut ex| {
                ex.rounds.newcomer = true;
                ex
            });
        if !inbox.all_joined && grown.is_none() {
            if inbox.broken.is_some() {
                return Err(error_for(&inbox, launch.rank, op));
            }
            let (op, missing_ranks) = match config.join {
                true => ("join: the group's ranks never grew it", vec![]),
                false => (op, ex.missing(&inbox.present)),
            };
            return Err(Error::Timeout {
                op,
                waited: config.startup_timeout,
                missing_ranks,
            });
        }
        drop(inbox);
        warnings.arrived(&ex.who());
        let (rank, world, took) = (ex.rounds.rank, ex.rounds.world_size, started.elapsed());
        tracing::debug!("symmpool store: rank {rank} of {world} joined after {took:?}");
        Ok(grown.unwrap_or(ex))
    }

    /// The ranks of the group that are not in `present`, this one left out.
    fn missing(&self, present: &[u32]) -> Vec<usize> {
        (0..self.rounds.world_size)
            .filter(|r| *r != self.rounds.rank && !present.contains(&(*r as u32)))
            .collect()
    }

    /// The inbox, while this exchange is the group's current one.
    ///
    /// # Errors
    /// [`Error::Shrunk`] once the group has shrunk past it.
    fn inbox(&self) -> Result<MutexGuard<'_, Inbox>> {
        let inbox = self.shared.inbox.lock();
        if inbox.epoch != self.epoch {
            return Err(SHRUNK);
        }
        Ok(inbox)
    }

    /// This rank, as a warning names it.
    fn who(&self) -> Who<'_> {
        Who(self.rounds.rank, "store", &self.shared.server)
    }

    /// What the call of round `r` (in `r.op`, waiting since `r.started`) reports on the broken group of
    /// `inbox`: [`Error::Timeout`] naming `missing` where its own wait timed out, else
    /// the error of the group's cause ([`error_for`]); but the store's verdict on a
    /// loss wins over a timeout it explains. A timeout is often the first sign of a
    /// frozen rank: the store declares it lost within the heartbeat timeout of its
    /// last word (`T`; its monitor looks when that passes), so a rank that froze
    /// before this wait began is named by `r.started` + `T` + the heartbeat interval
    /// (for the word to arrive), or, if the group broke before this call, that long
    /// after this rank learnt of it. So, unless the verdict is here, this waits for it
    /// until then, and then reads what has arrived (a rank resumed after a freeze finds
    /// the store's word on itself there; [`DRAIN_WAIT`]). Only the first call after
    /// the group broke waits; the later ones report what is known by then at once.
    fn explained<'a>(
        &'a self,
        mut inbox: MutexGuard<'a, Inbox>,
        r: &Round<'_>,
        missing: Option<Vec<u32>>,
    ) -> Error {
        if !inbox.verdict() && !inbox.settled {
            let c = &self.shared.config;
            let since = inbox
                .broken_at
                .map_or(r.started, |seen| seen.min(r.started));
            let window = Deadline::after_from(since, c.detection_bound());
            drop(inbox);
            inbox = (self.shared).wait_until(window, |ib| {
                ib.verdict() || ib.reader_done || ib.epoch != self.epoch
            });
            let read_by = Deadline::after(DRAIN_WAIT.min(c.heartbeat_interval));
            inbox = self.shared.drain(inbox, read_by);
            inbox.settled = true;
        }
        if inbox.epoch != self.epoch {
            return SHRUNK;
        }
        match missing {
            Some(missing) if !inbox.verdict() => Error::timeout_since(r.op, r.started, &missing),
            _ => error_for(&inbox, self.rounds.rank, r.op),
        }
    }
}

/// The longest a call reporting a broken group waits for another thread to dispatch
/// what has arrived (it does so at once, when it runs).
const DRAIN_WAIT: Duration = Duration::from_millis(100);

/// The loss the store told of in `inbox`, if any: this rank (`me`) expelled, or
/// another rank lost.
fn lost(inbox: &Inbox, me: usize) -> Option<LostPeer> {
    let (rank, detail, this_rank) = match (&inbox.expelled, &inbox.lost) {
        (Some(reason), _) => (me, reason, true),
        (
            None,
            Some(Broken {
                rank,
                cause: Cause::Lost { detail },
                ..
            }),
        ) => (*rank as usize, detail, false),
        _ => return None,
    };
    Some(LostPeer {
        rank,
        left: !this_rank && detail.starts_with(CLOSED),
        detail: detail.clone(),
        this_rank,
    })
}

/// The error a call in `op` on rank `me` reports on the broken group of `inbox`: the
/// store's verdict on a loss where it has one ([`Error::PeerLost`],
/// [`Error::DeclaredLost`]), else the timeout that broke it ([`Error::GroupBroken`]).
fn error_for(inbox: &Inbox, me: usize, op: &'static str) -> Error {
    if let Some(loss) = lost(inbox, me) {
        return loss.error(op);
    }
    match &inbox.broken {
        Some(b) => Error::GroupBroken {
            rank: b.rank as usize,
            op: intern_op(&b.op),
        },
        None => Error::internal(format!(
            "{op}: the group was reported broken without a cause"
        )),
    }
}

impl GatherRounds for StoreExchange {
    fn gather_round(&self, r: Round<'_>) -> Result<Vec<Vec<u8>>> {
        {
            let inbox = self.inbox()?;
            if inbox.broken.is_some() {
                return Err(self.explained(inbox, &r, None));
            }
        }
        let round = r.number;
        let key = (r.channel.ordinal(), round);
        let wire_op: String = r.op.chars().take(200).collect();
        let frame = wire::encode(&ToServer::Contribute {
            epoch: self.epoch,
            channel: key.0,
            round,
            op: wire_op.clone(),
            payload: r.payload.to_vec(),
        });
        self.shared.send_or_lose(&frame, "writing to");
        // The server says when the round has waited long, naming who has not
        // contributed (`ToClient::Waiting`): this rank warns then, not on a timer.
        let mut warnings = WaitWarnings::new(r.op, r.started, Duration::MAX);
        let mut inbox = loop {
            let mut inbox = self.shared.wait_until(r.deadline, |ib| {
                ib.results.contains_key(&key)
                    || ib.broken.is_some()
                    || ib.abandoned.contains(&key.0)
                    || ib.waiting.contains_key(&key)
                    || ib.epoch != self.epoch
            });
            // (An empty map is not hashed into: nothing on a round's usual path.)
            let notice = (!inbox.waiting.is_empty())
                .then(|| inbox.waiting.remove(&key))
                .flatten();
            match notice {
                Some(missing) if !inbox.results.contains_key(&key) && inbox.broken.is_none() => {
                    drop(inbox);
                    warnings.warn(&self.who(), ranks(&missing), r.deadline);
                }
                _ => break inbox,
            }
        };
        if inbox.epoch != self.epoch {
            // The group shrank (another pool of this rank asked) under this round.
            return Err(SHRUNK);
        }
        if let Some(result) = inbox.results.remove(&key) {
            drop(inbox);
            warnings.arrived(&self.who());
            return Ok(result.into_iter().map(ByteBuf::into_vec).collect());
        }
        if inbox.broken.is_some() {
            return Err(self.explained(inbox, &r, None));
        }
        if inbox.abandoned.contains(&key.0) {
            return Err(Error::timeout_since(r.op, r.started, &[]));
        }
        // Timed out: tell the server, which breaks the group for every rank and
        // names the ranks that had not contributed.
        drop(inbox);
        let _ = self
            .shared
            .writer
            .lock()
            .send(&wire::encode(&ToServer::Abandon {
                epoch: self.epoch,
                channel: key.0,
                round,
                op: wire_op,
            }));
        let answer_by = Deadline::after(self.shared.config.detection_bound());
        let mut inbox = self.shared.wait_until(answer_by, |ib| ib.broken.is_some());
        inbox.results.remove(&key);
        let missing = match &inbox.broken {
            Some(Broken {
                rank,
                cause: Cause::Timeout { missing },
                ..
            }) if *rank as usize == self.rounds.rank => Some(missing.clone()),
            Some(_) => None,
            None => {
                // No answer from the server: break the group here.
                let broken = Broken::timeout(self.rounds.rank as u32, r.op.into(), vec![]);
                inbox.note_broken(broken);
                self.shared.cv.notify_all();
                Some(vec![])
            }
        };
        Err(self.explained(inbox, &r, missing))
    }

    fn rounds(&self) -> &Rounds {
        &self.rounds
    }

    fn abandon(&self, channel: ChannelId) {
        self.shared.inbox.lock().abandoned.push(channel.ordinal());
        self.shared.cv.notify_all();
    }

    fn lost_peer(&self) -> Option<LostPeer> {
        // A frame that has arrived is read first, without waiting (if nobody else
        // reads): a failure polling for the verdict has it as soon as it is here.
        let mut inbox = self.inbox().ok()?;
        if !inbox.reader_busy && !inbox.reader_done {
            inbox = self.shared.read_once(inbox, Duration::ZERO, None);
        }
        lost(&inbox, self.rounds.rank)
    }

    fn shrink(&self, deadline: Deadline) -> Result<Arc<dyn super::Exchange>> {
        Ok(StoreExchange::shrink(self, deadline)?)
    }

    fn grow(&self, wait: bool, deadline: Deadline) -> Result<Option<Arc<dyn super::Exchange>>> {
        Ok(StoreExchange::grow(self, wait, deadline)?.map(|x| x as _))
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.shared.cv.notify_all();
        self.shared.bg_cv.notify_all();
        let _ = self
            .shared
            .writer
            .lock()
            .send(&wire::encode(&ToServer::Bye));
        let _ = self.shared.writer.lock().shutdown(Shutdown::Write);
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
        if let Some(server) = self.server.take()
            && !server.wait_until_empty(self.shared.config.linger)
        {
            tracing::warn!(
                "symmpool store: stopping the server with ranks still connected after {:?}",
                self.shared.config.linger
            );
        }
    }
}

#[cfg(test)]
#[path = "../../tests/unit/control/client.rs"]
mod tests;
