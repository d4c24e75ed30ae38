//! [`StoreServer`]: the TCP rendezvous store that rank 0 hosts.
//!
//! One thread accepts connections; one per connection does the handshake, then reads
//! that rank's frames (`connection.rs`); a monitor thread sends heartbeats and declares
//! silent ranks lost. All state is behind one mutex; every write to a rank goes through
//! its own writer lock, so frames never interleave. A round's result is encoded once
//! and written to every rank with one write each: to a rank whose thread still polls
//! for it (up to [`StoreConfig::server_spin`] after contributing) by that thread, in
//! parallel with the others; to the rest by the thread of the last contributor.
//!
//! # What a client that is not one of the job's ranks can cost
//!
//! A handshake slot ([`StoreConfig::max_handshakes`]) for at most
//! [`StoreConfig::handshake_timeout`]. Once every rank has joined, and until one
//! departs, a connection from a host that runs none of them is refused without a
//! handshake; after that a newcomer may come from any host (`regroup.rs`). A handshake
//! is refused but a newcomer's (`SYMMPOOL_JOIN=1`) for a job rank that the group went
//! on without (a rank cannot rejoin otherwise). Refusals are counted
//! ([`ServerStats`]) and logged, rate-limited ([`REFUSAL_LOG_INTERVAL`](super::REFUSAL_LOG_INTERVAL)).

mod connection;
mod regroup;

use super::Ask;
use super::admission::{HandshakeSlot, RefusalKind, RefusalLog, Refused, describe_io, refused};
use super::config::StoreConfig;
use super::join::transport;
use super::mailbox::Mailbox;
use super::wire::{self, Broken, Cause, Member, SharedStream, ToClient};
use crate::deadline::Deadline;
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use connection::serve;
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How [`StoreServer::wait_until_done`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Every rank joined, then left: the job is over.
    Ended,
    /// Not every rank joined within the start-up timeout.
    NotAssembled,
    /// The deadline passed first.
    Deadline,
}

/// Counters of a [`StoreServer`], for logs and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// TCP connections accepted.
    pub connections_accepted: u64,
    /// Connections refused or dropped before or during the handshake (garbage, wrong
    /// magic, version, token or job, a rank already connected, no handshake in time,
    /// too many handshakes in flight, a stranger after every rank joined).
    pub connections_rejected: u64,
    /// Of those, refused at once because [`StoreConfig::max_handshakes`] handshakes
    /// were in flight.
    pub connections_refused_busy: u64,
    /// Ranks that joined and then left or were declared lost.
    pub ranks_departed: u64,
    /// Rounds completed.
    pub rounds_completed: u64,
    /// Newcomers (`SYMMPOOL_JOIN=1`) taken into the group when it grew.
    pub newcomers_joined: u64,
}

/// The store server: rank 0 hosts it (see [`StoreExchange::connect`](super::StoreExchange::connect)),
/// every rank connects to it. Dropping it shuts it down and closes every connection.
pub struct StoreServer {
    addr: SocketAddr,
    bound_at: Instant,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    world: usize,
    /// The job identity (empty: none).
    job: String,
    /// The settings (heartbeats, handshakes, frame limit, wait warnings).
    config: StoreConfig,
    /// [`StoreConfig::server_spin`] in effect.
    server_spin: Duration,
    state: Mutex<State>,
    /// Signalled on shutdown and when a rank departs.
    cv: Condvar,
    shutdown: AtomicBool,
    /// The counters but `rounds_completed` (in the state, whose lock a round holds).
    stats: Mutex<ServerStats>,
    /// Handshakes in flight.
    handshakes: AtomicUsize,
    /// The hosts of the ranks (`to_canonical`: IPv4-mapped IPv6 as IPv4), set once every
    /// rank has joined: later connections from elsewhere are refused without a handshake.
    rank_hosts: OnceLock<Vec<IpAddr>>,
    /// Rate-limited refusal warnings (its own lock: never taken on a round's path).
    refusals: Mutex<RefusalLog>,
}

#[derive(Default)]
struct State {
    /// By job rank (the rank a process joined as).
    conns: Vec<Option<Conn>>,
    /// Who joined as each rank (kept after it leaves: only a newcomer takes its place).
    members: Vec<Option<Member>>,
    /// Rounds of the current epoch; a round's payloads are in the order of `alive`.
    rounds: HashMap<(u64, u64), Pending>,
    broken: Option<Broken>,
    /// A loss was told since the group broke (the cause itself, or the first loss
    /// after a timeout: it explains that timeout).
    lost_told: bool,
    next_conn_id: u64,
    /// How many times the group shrank or grew (`regroup.rs`).
    epoch: u64,
    /// The job ranks of the group now, ascending: a rank of the group is its place here.
    /// A connected job rank that is not here is a newcomer waiting to join.
    alive: Vec<usize>,
    /// The job ranks that asked to shrink or grow the current epoch, and what.
    votes: std::collections::BTreeSet<usize>,
    asked: Ask,
    /// [`ServerStats::rounds_completed`].
    rounds_completed: u64,
}

impl State {
    /// The rank in the current group of job rank `rank`, if it is in it.
    fn place(&self, rank: usize) -> Option<usize> {
        self.alive.binary_search(&rank).ok()
    }

    /// Write `frame` to `rank` if it is connected; on failure, the rank and why (it is
    /// for the caller to make it depart).
    fn write_to(&self, rank: usize, frame: &[u8]) -> Option<(usize, String)> {
        let c = self.conns[rank].as_ref()?;
        c.link.write(Some(frame)).err().map(|why| (rank, why))
    }
}

/// A round some ranks have contributed to.
struct Pending {
    /// Each rank's payload, once contributed.
    posted: Vec<Option<Vec<u8>>>,
    /// When the contributors are next told who they wait for
    /// ([`ToClient::Waiting`]): [`StoreConfig::wait_warning_interval`] after the first
    /// contribution, then every interval.
    notice: Instant,
}

impl Pending {
    /// The ranks that have not contributed.
    fn missing(&self) -> Vec<u32> {
        (0..self.posted.len() as u32)
            .filter(|r| self.posted[*r as usize].is_none())
            .collect()
    }
}

/// A rank's connection, in the state.
struct Conn {
    /// What its thread holds of it too.
    link: Link,
    /// The same socket (the same descriptor), for shutting it down without waiting
    /// for a writer.
    sock: SharedStream,
    last_heard: Instant,
}

/// What a connection's thread holds of its connection.
#[derive(Clone)]
struct Link {
    rank: usize,
    id: u64,
    /// Writes to the rank (a frame at a time).
    writer: Arc<Mutex<SharedStream>>,
    /// Results handed to the connection's thread.
    mailbox: Arc<Mailbox>,
}

impl Link {
    /// Write `frame` now or never: only if no other write is under way and the
    /// socket's buffer takes it whole at once (for a last word to a rank that may
    /// not be reading, e.g. one that is frozen). A partial write is left as it is:
    /// the connection closes next.
    fn tell_now(&self, frame: &[u8]) {
        if let Some(w) = self.writer.try_lock() {
            let _ = rustix::net::send(w.as_fd(), frame, rustix::net::SendFlags::DONTWAIT);
        }
    }

    /// Under the writer lock: write the result waiting in the mailbox, if any, then
    /// `frame`. Every write to a rank goes through here, so nothing written to it later
    /// (the next round's result, a broken-group notice after the last round) overtakes
    /// a result handed to its mailbox. `Err`: why writing failed.
    fn write(&self, frame: Option<&[u8]>) -> std::result::Result<(), String> {
        let w = self.writer.lock();
        let result = self.mailbox.take_delivered();
        (result.map_or(Ok(()), |r| w.send(&r)))
            .and_then(|()| frame.map_or(Ok(()), |f| w.send(f)))
            .map_err(|e| format!("writing to it failed: {e}"))
    }
}

impl fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreServer")
            .field("addr", &self.addr)
            .field("world_size", &self.shared.world)
            .field("stats", &self.stats())
            .finish()
    }
}

impl StoreServer {
    /// Listen on `addr` (port 0: any free port, see [`local_addr`](Self::local_addr))
    /// for the `config.launch.world_size` ranks of the job `config.job_id`, with
    /// `config`'s token, heartbeat, handshake and frame-size settings.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if `config` is inconsistent (as
    /// [`StoreExchange::connect`](super::StoreExchange::connect) checks it);
    /// [`Error::Transport`] if the address does not resolve or cannot be bound, or a
    /// thread cannot be started.
    pub fn bind(
        addr: impl ToSocketAddrs + fmt::Debug,
        config: &StoreConfig,
    ) -> Result<StoreServer> {
        config.check()?;
        let bound = || -> std::io::Result<_> {
            let listener = TcpListener::bind(&addr)?;
            let local = listener.local_addr()?;
            listener.set_nonblocking(true)?;
            Ok((listener, local))
        };
        let (listener, local) = bound().map_err(transport(
            "starting the store server",
            format!("binding the store server to {addr:?}"),
        ))?;
        let world = config.launch.world_size;
        let shared = Arc::new(Shared {
            world,
            job: config.job_id.clone().unwrap_or_default(),
            config: config.clone(),
            server_spin: server_spin_in_effect(
                config,
                thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            state: Mutex::new(State {
                conns: (0..world).map(|_| None).collect(),
                members: vec![None; world],
                alive: (0..world).collect(),
                ..State::default()
            }),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            stats: Mutex::default(),
            handshakes: AtomicUsize::new(0),
            rank_hosts: OnceLock::new(),
            refusals: Mutex::new(RefusalLog::new(Instant::now())),
        });
        let mut server = StoreServer {
            addr: local,
            bound_at: Instant::now(),
            shared: shared.clone(),
            threads: Vec::new(),
        };
        let s = shared.clone();
        server.spawn("symmpool-store-accept", move || accept_loop(&s, &listener))?;
        server.spawn("symmpool-store-monitor", move || monitor_loop(&shared))?;
        tracing::info!("symmpool store listening on {local} for {world} ranks");
        Ok(server)
    }

    /// The store of a job of `world_size` ranks in a process of its own (on the
    /// launcher's host; the ranks run with `SYMMPOOL_STORE_EXTERNAL=1`, see
    /// [`StoreConfig::host_server`]), listening on `ip`, with the settings a rank reads
    /// ([`StoreConfig::from_env`], as rank 0: the port `SYMMPOOL_STORE_PORT`, else
    /// `MASTER_PORT`; the token, job identity and heartbeats). Serve it until
    /// [`wait_until_done`](Self::wait_until_done).
    ///
    /// # Errors
    /// As [`StoreConfig::from_env`] and [`bind`](Self::bind).
    pub fn bind_from_env(world_size: usize, ip: &str) -> Result<StoreServer> {
        let world = world_size.to_string();
        let vars = |k: &str| match k {
            "RANK" => Some("0".into()),
            "WORLD_SIZE" => Some(world.clone()),
            _ => (std::env::var(k).ok()).or_else(|| (k == "MASTER_ADDR").then(|| ip.into())),
        };
        let config = StoreConfig::from_vars(&vars)?;
        Self::bind((ip, config.launch.master_port), &config)
    }

    /// Start a thread of the server's, `name`, running `f`.
    fn spawn(&mut self, name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let started = thread::Builder::new().name(name.to_string()).spawn(f);
        let fail = transport("starting a store thread", name.to_string());
        self.threads.push(started.map_err(fail)?);
        Ok(())
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's counters.
    pub fn stats(&self) -> ServerStats {
        let rounds_completed = self.shared.state.lock().rounds_completed;
        ServerStats {
            rounds_completed,
            ..*self.shared.stats.lock()
        }
    }

    /// Wait until no rank is connected, or `timeout` passes; `true` if none is.
    pub(crate) fn wait_until_empty(&self, timeout: Duration) -> bool {
        self.wait_until(Deadline::after(timeout), |_| true)
    }

    /// For a store that runs in a process of its own (`SYMMPOOL_STORE_EXTERNAL`, see
    /// [`StoreConfig::host_server`]): wait until the job is over, every rank having
    /// joined and then left (ended, or lost; a newcomer waiting to join the group, see
    /// [`StoreConfig::join`], has not left), or until `deadline`, or until the
    /// start-up timeout ([`StoreConfig::startup_timeout`], from the bind) passed
    /// without every rank joined (the job did not assemble: its ranks gave up).
    pub fn wait_until_done(&self, deadline: Deadline) -> JobEnd {
        let all_joined = |st: &State| st.members.iter().all(Option::is_some);
        let start_up = Deadline::after_from(self.bound_at, self.shared.config.startup_timeout);
        if self.wait_until(deadline.min(start_up), all_joined) {
            JobEnd::Ended
        } else if !all_joined(&self.shared.state.lock()) && start_up.expired() {
            JobEnd::NotAssembled
        } else if self.wait_until(deadline, all_joined) {
            JobEnd::Ended
        } else {
            JobEnd::Deadline
        }
    }

    /// Wait until no rank is connected and `done` holds, or `deadline` passes.
    fn wait_until(&self, deadline: Deadline, done: impl Fn(&State) -> bool) -> bool {
        let mut st = self.shared.state.lock();
        while st.conns.iter().any(Option::is_some) || !done(&st) {
            if deadline.expired() {
                return false;
            }
            self.shared.cv.wait_until(&mut st, deadline.instant());
        }
        true
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        for c in self
            .shared
            .state
            .lock()
            .conns
            .iter_mut()
            .filter_map(Option::take)
        {
            let _ = c.sock.shutdown(Shutdown::Both);
        }
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.refusals.lock().sum_up(Instant::now(), true);
    }
}

/// [`StoreConfig::server_spin`], or where it is `None`, the client's spin where the
/// ranks number at most half of the host's `cores`, else zero.
fn server_spin_in_effect(config: &StoreConfig, cores: usize) -> Duration {
    config
        .server_spin
        .unwrap_or(if config.launch.world_size <= cores / 2 {
            config.spin
        } else {
            Duration::ZERO
        })
}

impl Shared {
    /// Count a refused connection and log it (rate-limited).
    fn reject(&self, peer: SocketAddr, kind: RefusalKind, why: &str) {
        let mut stats = self.stats.lock();
        stats.connections_rejected += 1;
        stats.connections_refused_busy += u64::from(kind == RefusalKind::Busy);
        drop(stats);
        if kind == RefusalKind::Early {
            // No failure: it retries until the survivors shrank past the loss.
            tracing::debug!("symmpool store: a newcomer from {peer} waits: {why}");
            return;
        }
        for line in (self.refusals.lock()).lines_for(Instant::now(), kind, peer, why) {
            tracing::warn!("{line}");
        }
    }

    /// Refuse `stream`: tell the client why (its preface and the verdict in one write),
    /// unless the refusal is silent; then count and log it.
    fn refuse(&self, mut stream: &TcpStream, peer: SocketAddr, refused: &Refused) {
        if let Some(kind) = refused.tell.clone() {
            let _ = stream.write_all(&wire::with_preface(&ToClient::Reject {
                reason: refused.why.clone(),
                kind,
                job: self.job.clone(),
            }));
        }
        self.reject(peer, refused.kind, &refused.why);
    }

    /// Refuse `stream` at once, without a handshake: one non-blocking write of the
    /// verdict (a client that does not read it loses nothing), then close.
    fn refuse_now(&self, stream: TcpStream, peer: SocketAddr, kind: RefusalKind, why: String) {
        let _ = stream.set_nonblocking(true);
        self.refuse(&stream, peer, &refused(true, kind, why));
    }

    /// Write `frame` to each of `ranks`; those it fails for depart, after all writes.
    fn send_to(&self, st: &mut State, ranks: impl IntoIterator<Item = usize>, frame: &[u8]) {
        let failed = ranks.into_iter().filter_map(|r| st.write_to(r, frame));
        self.depart_all(st, failed.collect());
    }

    /// The ranks of `failed` depart, each with why.
    fn depart_all(&self, st: &mut State, failed: Vec<(usize, String)>) {
        for (rank, why) in failed {
            self.depart(st, rank, None, &why);
        }
    }

    /// Break the group (once) and tell every connected rank; a rank that dies or
    /// freezes after a timeout broke it is told of too (once: the first), since it
    /// explains that timeout, and the ranks' calls report the loss rather than the
    /// timeout (not a rank that closes its exchange then: that is its end, not why the
    /// group broke).
    fn break_group(&self, st: &mut State, broken: Broken) {
        let left = matches!(&broken.cause, Cause::Lost { detail } if detail.starts_with(CLOSED));
        let loss = matches!(broken.cause, Cause::Lost { .. });
        if st.broken.is_some() && (st.lost_told || !loss || left) {
            return;
        }
        st.lost_told |= loss;
        // A rank that closes its exchange when no round is pending is the normal end of
        // a job (ranks finish one by one): not worth a warning.
        if st.rounds.is_empty() && left {
            tracing::debug!("symmpool store: rank {} left: {broken:?}", broken.rank);
        } else {
            let (rank, op) = (broken.rank, &broken.op);
            match &broken.cause {
                Cause::Lost { detail } => {
                    tracing::warn!("symmpool store: group broken: rank {rank} was lost: {detail}");
                }
                Cause::Timeout { missing } => tracing::warn!(
                    "symmpool store: group broken: rank {rank} timed out in {op} waiting for ranks {missing:?}"
                ),
            }
        }
        st.rounds.clear();
        if st.asked != Ask::Shrink {
            // The notice answers the asks to grow.
            st.votes.clear();
        }
        st.broken.get_or_insert_with(|| broken.clone());
        let group = st.alive.clone();
        self.send_to(st, group, &wire::encode(&ToClient::Broken(broken)));
    }

    /// `rank` (connection `id`, or any) left or was declared lost: close it and break
    /// the group, naming it (a newcomer waiting to join is forgotten).
    fn depart(&self, st: &mut State, rank: usize, id: Option<u64>, why: &str) {
        let Some(c) = st.conns[rank].take_if(|c| id.is_none_or(|id| c.link.id == id)) else {
            return;
        };
        let _ = c.sock.shutdown(Shutdown::Both);
        self.stats.lock().ranks_departed += 1;
        self.cv.notify_all();
        if !self.shutdown.load(Ordering::SeqCst) {
            tracing::info!("symmpool store: rank {rank} departed: {why}");
        }
        let Some(place) = st.place(rank) else {
            return;
        };
        self.lost_during_shrink(st, rank, why);
        self.break_group(st, Broken::lost(place as u32, why.to_string()));
    }

    /// Send a completed round's `frame` to every rank (the caller, `me`'s thread,
    /// holds the state lock `st`): into the mailbox of each rank whose thread polls for
    /// it, directly to the others, then, with the lock released, to `me` itself.
    fn deliver(&self, mut st: MutexGuard<'_, State>, me: &Link, frame: Vec<u8>) {
        let frame = Arc::new(frame);
        let mut failed = Vec::new();
        for &other in &st.alive {
            if other == me.rank {
                continue;
            }
            let handed = st.conns[other]
                .as_ref()
                .is_some_and(|c| c.link.mailbox.hand_over(&frame));
            if !handed {
                failed.extend(st.write_to(other, &frame));
            }
        }
        // This rank's own copy goes through its mailbox too, so that whatever another
        // thread writes to it once the lock is released comes after it.
        me.mailbox.put_own(frame);
        self.depart_all(&mut st, failed);
        drop(st);
        if let Err(why) = me.write(None) {
            self.depart(&mut self.state.lock(), me.rank, Some(me.id), &why);
        }
    }

    /// Poll `me`'s mailbox for up to the spin time; write a delivered result, or, if
    /// none came, leave it to the last contributor (who writes to an idle rank
    /// directly). `Err`: writing failed, with why.
    fn await_result(&self, me: &Link) -> std::result::Result<(), String> {
        let mailbox = &me.mailbox;
        let until = Instant::now() + self.server_spin;
        let mut polls = 0u32;
        while !mailbox.is_delivered()
            && Instant::now() < until
            && !self.shutdown.load(Ordering::Relaxed)
        {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(64) {
                // Let the thread this one waits for run, where cores are short.
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // Stop polling: from now on the last contributor writes the result itself.
        mailbox.stop_waiting();
        // A result delivered meanwhile (and not yet written by another writer).
        me.write(None)
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                shared.stats.lock().connections_accepted += 1;
                admit(shared, stream, peer);
            }
            Err(e) => {
                if e.kind() == std::io::ErrorKind::WouldBlock {
                    shared.refusals.lock().sum_up(Instant::now(), false);
                } else {
                    // The connection stays queued; try again after the pause below.
                    let why = format!("accepting failed: {}", describe_io(&e));
                    let kind = RefusalKind::of_io(&e);
                    shared.reject(SocketAddr::from(([0, 0, 0, 0], 0)), kind, &why);
                }
                let mut st = shared.state.lock();
                if shared.shutdown.load(Ordering::SeqCst) {
                    break;
                }
                // Woken early by shutdown; otherwise poll for new connections.
                shared.cv.wait_for(&mut st, Duration::from_millis(20));
            }
        }
    }
}

/// A new connection: refused at once (a stranger after every rank joined, or too many
/// handshakes in flight), else handed to a thread of its own for the handshake.
fn admit(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    if let Some(hosts) = shared.rank_hosts.get()
        && !hosts.contains(&peer.ip().to_canonical())
        && shared.stats.lock().ranks_departed == 0
    {
        let ip = peer.ip();
        let why = format!(
            "every rank has joined, none has left, and {ip} runs none of them (a rank cannot rejoin)"
        );
        return shared.refuse_now(stream, peer, RefusalKind::Closed, why);
    }
    let in_flight = shared.handshakes.fetch_add(1, Ordering::AcqRel);
    if in_flight >= shared.config.max_handshakes {
        shared.handshakes.fetch_sub(1, Ordering::AcqRel);
        let n = shared.config.max_handshakes;
        let why =
            format!("busy: {n} handshakes in flight (StoreConfig::max_handshakes); try again");
        return shared.refuse_now(stream, peer, RefusalKind::Busy, why);
    }
    // The thread owns the slot taken above (released when its handshake ends).
    let s = shared.clone();
    let started = thread::Builder::new()
        .name("symmpool-store-conn".into())
        .spawn(move || serve(&s, stream, peer, HandshakeSlot(&s.handshakes)));
    if let Err(e) = started {
        shared.handshakes.fetch_sub(1, Ordering::AcqRel);
        let why = format!("could not start a thread: {}", describe_io(&e));
        shared.reject(peer, RefusalKind::Resources, &why);
    }
}

/// Send heartbeats and declare silent ranks lost, every heartbeat interval; tell the
/// ranks waiting in a long round who they wait for, every wait-warning interval.
fn monitor_loop(shared: &Arc<Shared>) {
    let heartbeat = wire::encode(&ToClient::Heartbeat);
    let mut st = shared.state.lock();
    let mut next_heartbeat = Instant::now();
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = Instant::now();
        let beat = now >= next_heartbeat;
        if beat {
            next_heartbeat = Deadline::after_from(now, shared.config.heartbeat_interval).instant();
        }
        // Silent ranks are declared lost as soon as the timeout passes, not at the
        // next heartbeat: a rank waiting on a frozen one learns of it within the
        // heartbeat timeout of the rank's last word.
        let silent = (shared.heartbeats(&mut st, now, beat.then_some(&heartbeat[..])))
            .unwrap_or(next_heartbeat);
        // Awake at least every wait-warning interval too, so that a round that
        // begins while this thread sleeps gets its first notice on time.
        let look = Deadline::after_from(now, shared.config.wait_warning_interval).instant();
        let notice = shared.tell_the_waiting(&mut st, now).unwrap_or(look);
        let wake = next_heartbeat.min(look).min(notice).min(silent);
        shared.cv.wait_until(&mut st, wake);
    }
}

impl Shared {
    /// Declare lost the ranks silent for longer than the heartbeat timeout (each told
    /// so, if its socket takes the word at once: [`ToClient::Expelled`]); with
    /// `heartbeat`, send it to the others. When the next rank would fall silent for
    /// that long, if any rank is connected.
    fn heartbeats(
        &self,
        st: &mut State,
        now: Instant,
        heartbeat: Option<&[u8]>,
    ) -> Option<Instant> {
        let mut failed = Vec::new();
        let mut next_silent: Option<Instant> = None;
        for (rank, c) in st.conns.iter().enumerate() {
            let Some(c) = c else { continue };
            let silent = now.saturating_duration_since(c.last_heard);
            if silent > self.config.heartbeat_timeout {
                let why = format!(
                    "no heartbeat for {silent:?} (frozen or stopped, e.g. SIGSTOP, or its host is unreachable)"
                );
                let reason = format!("job rank {rank}: {why}");
                c.link
                    .tell_now(&wire::encode(&ToClient::Expelled { reason }));
                failed.push((rank, why));
                continue;
            }
            // Just past the timeout (`silent > timeout`).
            let due = c.last_heard + self.config.heartbeat_timeout + Duration::from_millis(1);
            next_silent = Some(next_silent.map_or(due, |n| n.min(due)));
            if let Some(heartbeat) = heartbeat {
                failed.extend(st.write_to(rank, heartbeat));
            }
        }
        self.depart_all(st, failed);
        next_silent
    }

    /// Tell the ranks waiting in each round whose notice is due which ranks have not
    /// contributed ([`ToClient::Waiting`]; they log it), and schedule the next notice
    /// one wait-warning interval on. When the earliest next notice is due, if any round
    /// is pending.
    fn tell_the_waiting(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let mut notices = Vec::new();
        for (&(channel, round), pending) in &mut st.rounds {
            if pending.notice <= now {
                pending.notice =
                    Deadline::after_from(now, self.config.wait_warning_interval).instant();
                let missing = pending.missing();
                let waiting: Vec<usize> = (st.alive.iter().zip(&pending.posted))
                    .filter_map(|(&r, p)| p.as_ref().and(Some(r)))
                    .collect();

                tracing::debug!(
                    "symmpool store: round {round} of channel {channel} waits for ranks {missing:?}"
                );
                let frame = wire::encode(&ToClient::Waiting {
                    channel,
                    round,
                    missing,
                });
                notices.push((waiting, frame));
            }
        }
        let earliest = st.rounds.values().map(|p| p.notice).min();
        for (waiting, frame) in notices {
            self.send_to(st, waiting, &frame);
        }
        earliest
    }
}

/// Why a rank that said goodbye left (the start of its `Lost` detail).
pub(super) const CLOSED: &str =
    "it closed its exchange (it finished, or dropped the exchange early)";

#[cfg(test)]
#[path = "../../../tests/unit/control/store.rs"]
mod tests;
