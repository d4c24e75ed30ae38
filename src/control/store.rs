//! [`StoreServer`]: the TCP rendezvous store that rank 0 hosts.
//!
//! One thread accepts connections, one thread per connection does the handshake and
//! then reads that rank's frames, and one monitor thread sends heartbeats and declares
//! silent ranks lost. All state is behind one mutex; every write to a rank goes
//! through that rank's own writer lock, so frames never interleave. A round's result
//! is encoded once and written to every rank with one write each: to a rank whose
//! thread is still polling for it (for up to [`StoreConfig::server_spin`] after
//! contributing)
//! by that thread, in parallel with the others; to the rest by the thread of the last
//! rank to contribute.

use super::config::StoreConfig;
use super::mailbox::{Mailbox, write_after_result};
use super::wire::{
    self, Broken, Cause, FrameReader, MAX_HANDSHAKE_FRAME_BYTES, PREFACE_BYTES, ReadError,
    ToClient, ToServer,
};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use parking_lot::{Condvar, Mutex, MutexGuard};
use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Counters of a [`StoreServer`], for logs and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// TCP connections accepted.
    pub connections_accepted: u64,
    /// Connections refused or dropped before or during the handshake (garbage, wrong
    /// magic, version or token, a rank already connected, no handshake in time).
    pub connections_rejected: u64,
    /// Ranks that joined and then left or were declared lost.
    pub ranks_departed: u64,
    /// Rounds completed.
    pub rounds_completed: u64,
}

/// The store server: rank 0 hosts it (see [`StoreExchange::connect`](super::StoreExchange::connect)),
/// every rank connects to it. Dropping it shuts it down and closes every connection.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

struct Shared {
    world: usize,
    token: Vec<u8>,
    heartbeat_interval: Duration,
    heartbeat_timeout: Duration,
    handshake_timeout: Duration,
    max_frame_bytes: usize,
    /// [`StoreConfig::server_spin`] in effect.
    server_spin: Duration,
    state: Mutex<State>,
    /// Signalled on shutdown and when a rank departs.
    cv: Condvar,
    shutdown: AtomicBool,
    accepted: AtomicU64,
    rejected: AtomicU64,
    departed: AtomicU64,
    rounds: AtomicU64,
}

struct State {
    conns: Vec<Option<Conn>>,
    ever_joined: Vec<bool>,
    rounds: HashMap<(u64, u64), Vec<Option<Vec<u8>>>>,
    broken: Option<Broken>,
    next_conn_id: u64,
}

struct Conn {
    id: u64,
    /// Writes to the rank (a frame at a time); also held by its connection thread.
    writer: Arc<Mutex<TcpStream>>,
    /// The same socket, for shutting it down without waiting for a writer.
    sock: TcpStream,
    /// Results handed to the connection's thread; also held by that thread.
    mailbox: Arc<Mailbox>,
    last_heard: Instant,
}

/// What a connection's thread holds of its connection (the `Conn` in the state has
/// the same writer and mailbox).
struct Link {
    rank: usize,
    id: u64,
    writer: Arc<Mutex<TcpStream>>,
    mailbox: Arc<Mailbox>,
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
    /// for the `config.launch.world_size` ranks, with `config`'s token, heartbeat,
    /// handshake and frame-size settings.
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
        let detail = format!("binding the store server to {addr:?}");
        let listener = TcpListener::bind(&addr).map_err(|source| Error::Transport {
            op: "starting the store server",
            detail: detail.clone(),
            source,
        })?;
        let local = listener
            .local_addr()
            .and_then(|a| listener.set_nonblocking(true).map(|()| a))
            .map_err(|source| Error::Transport {
                op: "starting the store server",
                detail,
                source,
            })?;
        let world = config.launch.world_size;
        let shared = Arc::new(Shared {
            world,
            token: config.token.clone().unwrap_or_default().into_bytes(),
            heartbeat_interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            handshake_timeout: config.handshake_timeout,
            max_frame_bytes: config.max_frame_bytes,
            server_spin: server_spin_in_effect(
                config,
                thread::available_parallelism().map_or(1, |n| n.get()),
            ),
            state: Mutex::new(State {
                conns: (0..world).map(|_| None).collect(),
                ever_joined: vec![false; world],
                rounds: HashMap::new(),
                broken: None,
                next_conn_id: 0,
            }),
            cv: Condvar::new(),
            shutdown: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            departed: AtomicU64::new(0),
            rounds: AtomicU64::new(0),
        });
        let mut server = StoreServer {
            addr: local,
            shared: shared.clone(),
            threads: Vec::new(),
        };
        let s = shared.clone();
        server.threads.push(spawn("symmpool-store-accept", move || {
            accept_loop(&s, &listener)
        })?);
        let s = shared;
        server
            .threads
            .push(spawn("symmpool-store-monitor", move || monitor_loop(&s))?);
        tracing::info!("symmpool store listening on {local} for {world} ranks");
        Ok(server)
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's counters.
    pub fn stats(&self) -> ServerStats {
        let s = &self.shared;
        ServerStats {
            connections_accepted: s.accepted.load(Ordering::Relaxed),
            connections_rejected: s.rejected.load(Ordering::Relaxed),
            ranks_departed: s.departed.load(Ordering::Relaxed),
            rounds_completed: s.rounds.load(Ordering::Relaxed),
        }
    }

    /// Wait until no rank is connected, or `timeout` passes; `true` if none is.
    pub(crate) fn wait_until_empty(&self, timeout: Duration) -> bool {
        let deadline = Deadline::after(timeout);
        let mut st = self.shared.state.lock();
        loop {
            if st.conns.iter().all(Option::is_none) {
                return true;
            }
            if deadline.expired() {
                return false;
            }
            self.shared.cv.wait_until(&mut st, deadline.instant());
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let mut st = self.shared.state.lock();
            for c in st.conns.iter_mut().filter_map(Option::take) {
                let _ = c.sock.shutdown(Shutdown::Both);
            }
        }
        self.shared.cv.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
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

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>> {
    thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .map_err(|source| Error::Transport {
            op: "starting a store thread",
            detail: name.to_string(),
            source,
        })
}

impl Shared {
    fn reject(&self, peer: SocketAddr, why: &str) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("symmpool store: refused connection from {peer}: {why}");
    }

    /// Write `frame` to `rank`; on failure the rank departs (by the caller, who gets it
    /// back in `failed`).
    fn write_to(
        &self,
        st: &mut State,
        rank: usize,
        frame: &[u8],
        failed: &mut Vec<(usize, String)>,
    ) {
        if let Some(c) = st.conns[rank].as_mut()
            && let Err(e) = write_after_result(&c.mailbox, &c.writer, Some(frame))
        {
            failed.push((rank, format!("writing to it failed: {e}")));
        }
    }

    fn broadcast(&self, st: &mut State, frame: &[u8]) {
        let mut failed = Vec::new();
        for rank in 0..self.world {
            self.write_to(st, rank, frame, &mut failed);
        }
        for (rank, why) in failed {
            self.depart(st, rank, None, &why);
        }
    }

    /// Break the group (once) and tell every connected rank.
    fn break_group(&self, st: &mut State, broken: Broken) {
        if st.broken.is_some() {
            return;
        }
        // A rank that closes its exchange when no round is pending is the normal end of
        // a job (ranks finish one by one): not worth a warning.
        let clean_end = st.rounds.is_empty()
            && matches!(&broken.cause, Cause::Lost { detail } if detail.starts_with(CLOSED));
        if clean_end {
            tracing::debug!("symmpool store: rank {} left: {broken:?}", broken.rank);
        } else {
            tracing::warn!("symmpool store: group broken: {broken:?}");
        }
        st.rounds.clear();
        st.broken = Some(broken.clone());
        self.broadcast(st, &wire::encode(&ToClient::Broken(broken)));
    }

    /// `rank` (connection `id`, or any) left or was declared lost: close it and break
    /// the group, naming it.
    fn depart(&self, st: &mut State, rank: usize, id: Option<u64>, why: &str) {
        let matches = st.conns[rank]
            .as_ref()
            .is_some_and(|c| id.is_none_or(|id| c.id == id));
        if !matches {
            return;
        }
        if let Some(c) = st.conns[rank].take() {
            let _ = c.sock.shutdown(Shutdown::Both);
        }
        self.departed.fetch_add(1, Ordering::Relaxed);
        self.cv.notify_all();
        if !self.shutdown.load(Ordering::SeqCst) {
            tracing::info!("symmpool store: rank {rank} departed: {why}");
        }
        self.break_group(
            st,
            Broken {
                rank: rank as u32,
                op: String::new(),
                cause: Cause::Lost {
                    detail: why.to_string(),
                },
            },
        );
    }

    /// Send a completed round's `frame` to every rank (the caller, `me`'s thread,
    /// holds the state lock `st`): into the mailbox of each rank whose thread polls for
    /// it, directly to the others, then, with the lock released, to `me` itself.
    fn deliver(&self, mut st: MutexGuard<'_, State>, me: &Link, frame: Vec<u8>) {
        let frame = Arc::new(frame);
        let mut failed = Vec::new();
        for other in (0..self.world).filter(|r| *r != me.rank) {
            let handed = st.conns[other]
                .as_ref()
                .is_some_and(|c| c.mailbox.hand_over(&frame));
            if !handed {
                self.write_to(&mut st, other, &frame, &mut failed);
            }
        }
        // This rank's own copy goes through its mailbox too, so that whatever another
        // thread writes to it once the lock is released comes after it.
        me.mailbox.put_own(frame);
        for (other, why) in failed {
            self.depart(&mut st, other, None, &why);
        }
        drop(st);
        if let Err(e) = write_after_result(&me.mailbox, &me.writer, None) {
            let mut st = self.state.lock();
            self.depart(
                &mut st,
                me.rank,
                Some(me.id),
                &format!("writing to it failed: {e}"),
            );
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
        write_after_result(mailbox, &me.writer, None)
            .map_err(|e| format!("writing to it failed: {e}"))
    }

    fn joined_message(&self, st: &State) -> ToClient {
        if st.ever_joined.iter().all(|j| *j) {
            ToClient::AllJoined
        } else {
            ToClient::Joined {
                present: (0..self.world as u32)
                    .filter(|r| st.ever_joined[*r as usize])
                    .collect(),
            }
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: &TcpListener) {
    while !shared.shutdown.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                shared.accepted.fetch_add(1, Ordering::Relaxed);
                let s = shared.clone();
                if let Err(e) = spawn("symmpool-store-conn", move || serve(&s, stream, peer)) {
                    shared.reject(peer, &e.to_string());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let mut st = shared.state.lock();
                if shared.shutdown.load(Ordering::SeqCst) {
                    break;
                }
                // Woken early by shutdown; otherwise poll for new connections.
                shared.cv.wait_for(&mut st, Duration::from_millis(20));
            }
            Err(e) => {
                tracing::warn!("symmpool store: accept failed: {e}");
                thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

fn monitor_loop(shared: &Arc<Shared>) {
    let heartbeat = wire::encode(&ToClient::Heartbeat);
    let mut st = shared.state.lock();
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = Instant::now();
        let mut failed = Vec::new();
        for rank in 0..shared.world {
            let Some(c) = st.conns[rank].as_ref() else {
                continue;
            };
            let silent = now.saturating_duration_since(c.last_heard);
            if silent > shared.heartbeat_timeout {
                failed.push((
                    rank,
                    format!(
                        "no heartbeat for {silent:?} (frozen or stopped, e.g. SIGSTOP, or its host is unreachable)"
                    ),
                ));
            } else {
                shared.write_to(&mut st, rank, &heartbeat, &mut failed);
            }
        }
        for (rank, why) in failed {
            shared.depart(&mut st, rank, None, &why);
        }
        shared.cv.wait_for(&mut st, shared.heartbeat_interval);
    }
}

/// One connection: handshake, then that rank's frames.
fn serve(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let _ = stream.set_nodelay(true);
    // A rank that stops reading must not block the server's writes (most made under
    // its state lock) without bound: a write that makes no progress for a heartbeat
    // timeout fails, and that rank departs.
    if stream
        .set_write_timeout(Some(shared.heartbeat_timeout))
        .is_err()
    {
        shared.reject(peer, "could not set a write timeout");
        return;
    }
    let Ok(read_half) = stream.try_clone() else {
        shared.reject(peer, "could not clone the socket");
        return;
    };
    let mut writer = stream;
    let mut reader = FrameReader::new(read_half, MAX_HANDSHAKE_FRAME_BYTES);
    let until = Deadline::after(shared.handshake_timeout);
    let sock = writer.try_clone();
    let Ok(sock) = sock else {
        shared.reject(peer, "could not clone the socket");
        return;
    };
    // Preface.
    let preface = match wire::read_until(&sock, until, || reader.raw(PREFACE_BYTES)) {
        Ok(Some(p)) => p,
        Ok(None) => {
            return shared.reject(
                peer,
                &format!("no handshake within {:?}", shared.handshake_timeout),
            );
        }
        Err(e) => return shared.reject(peer, &format!("during the handshake: {e}")),
    };
    if let Err(why) = wire::check_preface(&preface) {
        if preface[..8] == wire::MAGIC {
            let mut reply = wire::preface().to_vec();
            reply.extend(wire::encode(&ToClient::Reject {
                reason: why.clone(),
            }));
            let _ = writer.write_all(&reply);
        }
        return shared.reject(peer, &why);
    }
    let mut reply = wire::preface().to_vec();
    // Hello.
    let hello = match wire::read_until(&sock, until, || reader.frame()) {
        Ok(Some(body)) => wire::decode::<ToServer>(&body),
        Ok(None) => Err(format!("no hello within {:?}", shared.handshake_timeout)),
        Err(e) => Err(format!("during the handshake: {e}")),
    };
    let refuse = |mut reply: Vec<u8>, mut writer: TcpStream, why: String| {
        reply.extend(wire::encode(&ToClient::Reject {
            reason: why.clone(),
        }));
        let _ = writer.write_all(&reply);
        shared.reject(peer, &why);
    };
    let (rank, pid) = match hello {
        Ok(ToServer::Hello {
            token,
            rank,
            world_size,
            pid,
        }) => {
            if !wire::constant_time_eq(&token, &shared.token) {
                return refuse(
                    reply,
                    writer,
                    "wrong job token (set the same SYMMPOOL_TOKEN on every rank)".into(),
                );
            }
            if world_size as usize != shared.world {
                return refuse(
                    reply,
                    writer,
                    format!(
                        "world size {world_size} differs from the store's {} (check WORLD_SIZE on every rank)",
                        shared.world
                    ),
                );
            }
            if rank as usize >= shared.world {
                return refuse(
                    reply,
                    writer,
                    format!(
                        "rank {rank} is out of range for world size {}",
                        shared.world
                    ),
                );
            }
            (rank as usize, pid)
        }
        Ok(other) => {
            return refuse(reply, writer, format!("expected a hello, got {other:?}"));
        }
        Err(why) => return refuse(reply, writer, why),
    };
    // Join.
    let me = {
        let mut st = shared.state.lock();
        if st.ever_joined[rank] {
            drop(st);
            return refuse(
                reply,
                writer,
                format!(
                    "rank {rank} is already connected (or was, and a group cannot be rejoined); check RANK"
                ),
            );
        }
        if let Some(b) = &st.broken {
            let why = format!("the group is already broken ({b:?}); restart the job");
            drop(st);
            return refuse(reply, writer, why);
        }
        reply.extend(wire::encode(&ToClient::Welcome));
        if let Err(e) = writer.write_all(&reply) {
            drop(st);
            return shared.reject(peer, &format!("writing the welcome failed: {e}"));
        }
        let Ok(conn_sock) = writer.try_clone() else {
            drop(st);
            return shared.reject(peer, "could not clone the socket");
        };
        let me = Link {
            rank,
            id: st.next_conn_id,
            writer: Arc::new(Mutex::new(writer)),
            mailbox: Arc::default(),
        };
        st.next_conn_id += 1;
        st.ever_joined[rank] = true;
        st.conns[rank] = Some(Conn {
            id: me.id,
            writer: me.writer.clone(),
            sock: conn_sock,
            mailbox: me.mailbox.clone(),
            last_heard: Instant::now(),
        });
        tracing::info!("symmpool store: rank {rank} (pid {pid}) joined from {peer}");
        let joined = wire::encode(&shared.joined_message(&st));
        shared.broadcast(&mut st, &joined);
        me
    };
    let id = me.id;
    reader.max_frame_bytes = shared.max_frame_bytes;
    if sock
        .set_read_timeout(Some(shared.heartbeat_interval))
        .is_err()
    {
        let mut st = shared.state.lock();
        return shared.depart(&mut st, rank, Some(id), "could not set a read timeout");
    }
    loop {
        let before = reader.bytes_read();
        let got = match reader.spin_frame(shared.server_spin) {
            Ok(None) => reader.frame(),
            polled => polled,
        };
        let msg = match got {
            Ok(None) => {
                if shared.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                if reader.bytes_read() > before {
                    // Bytes of a large frame still arriving: the rank is alive.
                    let mut st = shared.state.lock();
                    match st.conns[rank].as_mut() {
                        Some(c) if c.id == id => c.last_heard = Instant::now(),
                        _ => return,
                    }
                }
                continue;
            }
            Ok(Some(body)) => match wire::decode::<ToServer>(&body) {
                Ok(m) => m,
                Err(why) => {
                    let mut st = shared.state.lock();
                    return shared.depart(
                        &mut st,
                        rank,
                        Some(id),
                        &format!("protocol error: {why}"),
                    );
                }
            },
            Err(e) => {
                let why = match e {
                    ReadError::Eof { partial: false } => {
                        "its connection closed (the process exited or was killed)".to_string()
                    }
                    e => format!("its connection failed: {e}"),
                };
                let mut st = shared.state.lock();
                return shared.depart(&mut st, rank, Some(id), &why);
            }
        };
        let mut st = shared.state.lock();
        match st.conns[rank].as_mut() {
            Some(c) if c.id == id => c.last_heard = Instant::now(),
            _ => return,
        }
        match msg {
            ToServer::Heartbeat => {}
            ToServer::Contribute {
                channel,
                round,
                op: _,
                payload,
            } => {
                if let Some(b) = st.broken.clone() {
                    let mut failed = Vec::new();
                    shared.write_to(
                        &mut st,
                        rank,
                        &wire::encode(&ToClient::Broken(b)),
                        &mut failed,
                    );
                    if let Some((_, why)) = failed.pop() {
                        return shared.depart(&mut st, rank, Some(id), &why);
                    }
                    continue;
                }
                let world = shared.world;
                let posted = st
                    .rounds
                    .entry((channel, round))
                    .or_insert_with(|| vec![None; world]);
                if posted[rank].is_some() {
                    return shared.depart(
                        &mut st,
                        rank,
                        Some(id),
                        &format!("protocol error: contributed twice to round {round} of channel {channel}"),
                    );
                }
                posted[rank] = Some(payload);
                if posted.iter().all(Option::is_some) {
                    let payloads = st
                        .rounds
                        .remove(&(channel, round))
                        .unwrap_or_default()
                        .into_iter()
                        .flatten()
                        .collect();
                    shared.rounds.fetch_add(1, Ordering::Relaxed);
                    let frame = wire::encode(&ToClient::Result {
                        channel,
                        round,
                        payloads,
                    });
                    shared.deliver(st, &me, frame);
                } else if !shared.server_spin.is_zero() {
                    // Poll for the result: the last rank to contribute hands it over
                    // instead of writing it, and this thread writes it.
                    me.mailbox.start_waiting();
                    drop(st);
                    if let Err(why) = shared.await_result(&me) {
                        let mut st = shared.state.lock();
                        return shared.depart(&mut st, rank, Some(id), &why);
                    }
                }
            }
            ToServer::Abandon { channel, round, op } => {
                let missing = st.rounds.get(&(channel, round)).map_or_else(Vec::new, |p| {
                    (0..shared.world as u32)
                        .filter(|r| p[*r as usize].is_none())
                        .collect()
                });
                shared.break_group(
                    &mut st,
                    Broken {
                        rank: rank as u32,
                        op,
                        cause: Cause::Timeout { missing },
                    },
                );
            }
            ToServer::Bye => {
                return shared.depart(&mut st, rank, Some(id), CLOSED);
            }
            ToServer::Hello { .. } => {
                return shared.depart(&mut st, rank, Some(id), "protocol error: a second hello");
            }
        }
    }
}

/// Why a rank that said goodbye left (the start of its `Lost` detail).
const CLOSED: &str = "it closed its exchange (it finished, or dropped the exchange early)";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::Launch;

    #[test]
    fn the_server_polls_only_where_the_ranks_leave_it_cores() {
        let spin = Duration::from_micros(40);
        let config = |world: usize, server_spin: Option<Duration>| {
            let mut c = StoreConfig::new(Launch::explicit(0, world, "127.0.0.1", 1).unwrap());
            c.spin = spin;
            c.server_spin = server_spin;
            c
        };
        // Default: the client's spin where world <= cores / 2.
        assert_eq!(server_spin_in_effect(&config(8, None), 16), spin);
        assert_eq!(server_spin_in_effect(&config(8, None), 17), spin);
        assert_eq!(server_spin_in_effect(&config(9, None), 16), Duration::ZERO);
        assert_eq!(server_spin_in_effect(&config(1, None), 1), Duration::ZERO);
        assert_eq!(server_spin_in_effect(&config(2, None), 2), Duration::ZERO);
        // An explicit setting wins either way.
        let set = Duration::from_micros(7);
        assert_eq!(server_spin_in_effect(&config(64, Some(set)), 2), set);
        assert_eq!(
            server_spin_in_effect(&config(2, Some(Duration::ZERO)), 64),
            Duration::ZERO
        );
    }
}
