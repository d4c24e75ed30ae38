//! A connection's thread: the handshake (preface and hello, checked against the job),
//! then that rank's frames until it leaves.

use super::{CLOSED, Conn, Link, Pending, Shared};
use crate::control::Ask;
use crate::control::admission::{HandshakeSlot, RefusalKind, Refused, describe_io, refused};
use crate::control::wire::{
    self, Broken, FrameReader, MAX_HANDSHAKE_FRAME_BYTES, Member, PREFACE_BYTES, ReadError,
    Refusal, SharedStream, ToClient, ToServer,
};
use crate::deadline::Deadline;
use parking_lot::Mutex;
use serde_bytes::ByteBuf;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Read and check the preface and the hello from `sock`, until the handshake deadline,
/// then join the rank the client asks for: its link.
fn join(
    shared: &Shared,
    sock: &SharedStream,
    reader: &mut FrameReader<SharedStream>,
    peer: SocketAddr,
) -> std::result::Result<Link, Box<Refused>> {
    let until = Deadline::after(shared.config.handshake_timeout);
    // (A client that sent a preface of this protocol is told why.)
    let failed = |told: bool| {
        move |e: ReadError| {
            let kind = match &e {
                ReadError::Io(io) => RefusalKind::of_io(io),
                _ => RefusalKind::Garbage,
            };
            refused(told, kind, format!("during the handshake: {e}"))
        }
    };
    let slow = |what: &str| {
        refused(
            false,
            RefusalKind::Slow,
            format!("no {what} within {:?}", shared.config.handshake_timeout),
        )
    };
    let preface = (reader.read_until(until, |r| r.raw(PREFACE_BYTES)))
        .map_err(failed(false))?
        .ok_or_else(|| slow("handshake"))?;
    if let Err(why) = wire::check_preface(&preface) {
        return Err(if preface[..8] == wire::MAGIC {
            refused(true, RefusalKind::Version, why)
        } else {
            refused(false, RefusalKind::Garbage, why)
        });
    }
    let body = (reader.read_until(until, |r| r.frame()))
        .map_err(failed(true))?
        .ok_or_else(|| slow("hello"))?;
    let garbage = |why: String| refused(true, RefusalKind::Garbage, why);
    let hello = wire::decode::<ToServer>(&body).map_err(garbage)?;
    let ToServer::Hello {
        token,
        job,
        rank,
        world_size,
        host,
        pid,
        joining,
    } = hello
    else {
        return Err(garbage(format!("expected a hello, got {hello:?}")));
    };
    let expected = shared.config.token.as_deref().unwrap_or_default();
    if !wire::constant_time_eq(&token, expected.as_bytes()) {
        return Err(refused(
            true,
            RefusalKind::Token,
            "wrong job token (set the same SYMMPOOL_TOKEN on every rank)".into(),
        ));
    }
    if job != shared.job {
        return Err(refused(
            true,
            RefusalKind::OtherJob,
            format!(
                "a client of job {} (pid {pid} on host {host:?}) reached the store of job {}: two jobs on one port (give each its own MASTER_PORT or SYMMPOOL_STORE_PORT)",
                show_job(&job),
                show_job(&shared.job)
            ),
        ));
    }
    let world = shared.world;
    let misfit = |why| Err(refused(true, RefusalKind::Misfit, why));
    if world_size as usize != world {
        return misfit(format!(
            "world size {world_size} differs from the store's {world} (check WORLD_SIZE on every rank)"
        ));
    }
    if rank as usize >= world {
        return misfit(format!(
            "rank {rank} is out of range for world size {world}"
        ));
    }
    let member = Member {
        host,
        pid,
        addr: peer.to_string(),
        at_unix_ms: (SystemTime::now().duration_since(UNIX_EPOCH))
            .map_or(0, |d| d.as_millis() as u64),
    };
    let rank = rank as usize;
    let mut st = shared.state.lock();
    // A newcomer for a job rank that no connection holds.
    let newcomer = joining && st.conns[rank].is_none();
    if newcomer && st.place(rank).is_some() {
        let why = format!(
            "job rank {rank} is still in the group: a newcomer waits until the survivors shrink past it"
        );
        return Err(refused(true, RefusalKind::Early, why));
    }
    if let Some(holder) = st.members[rank].as_ref().filter(|_| !newcomer) {
        let (holder, claimant) = (holder.clone(), member);
        let why = if st.conns[rank].is_some() {
            format!(
                "rank {rank} is already connected: held by {holder}; the claim of {claimant} is refused (check RANK)"
            )
        } else {
            format!(
                "rank {rank} was held by {holder}, which left, and a group cannot be rejoined (but by a newcomer, SYMMPOOL_JOIN=1); the claim of {claimant} is refused"
            )
        };
        return Err(Box::new(Refused {
            kind: RefusalKind::RankTaken,
            why,
            tell: Some(Refusal::RankTaken {
                rank: rank as u32,
                holder,
                claimant,
            }),
        }));
    }
    if let Some(b) = st.broken.as_ref().filter(|_| !newcomer) {
        let why = format!("the group is already broken ({b:?}); restart the job");
        return Err(refused(true, RefusalKind::Closed, why));
    }
    if let Err(e) = sock.send(&wire::with_preface(&ToClient::Welcome)) {
        let why = format!("writing the welcome failed: {}", describe_io(&e));
        return Err(refused(false, RefusalKind::Garbage, why));
    }
    let me = Link {
        rank,
        id: st.next_conn_id,
        writer: Arc::new(Mutex::new(sock.clone())),
        mailbox: Arc::default(),
    };
    st.next_conn_id += 1;
    let how = if newcomer { "waits to join" } else { "joined" };
    tracing::info!("symmpool store: job rank {rank} {how}: {member}");
    st.members[rank] = Some(member);
    st.conns[rank] = Some(Conn {
        link: me.clone(),
        sock: sock.clone(),
        last_heard: Instant::now(),
    });
    if newcomer {
        // The group's ranks may be waiting for it.
        shared.decide(&mut st);
        return Ok(me);
    }
    let present: Vec<u32> = (0..shared.world as u32)
        .filter(|r| st.members[*r as usize].is_some())
        .collect();
    let joined = if present.len() < shared.world {
        ToClient::Joined { present }
    } else {
        let hosts = (st.members.iter().flatten())
            .filter_map(|m| m.addr.parse::<SocketAddr>().ok())
            .map(|a| a.ip().to_canonical())
            .collect();
        let _ = shared.rank_hosts.set(hosts);
        ToClient::AllJoined
    };
    shared.send_to(&mut st, 0..shared.world, &wire::encode(&joined));
    Ok(me)
}

/// A job identity for messages.
fn show_job(job: &str) -> String {
    if job.is_empty() {
        "(none)".into()
    } else {
        format!("{job:?}")
    }
}

/// One connection: handshake (holding `slot` until it ends), then that rank's frames.
pub(super) fn serve(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    slot: HandshakeSlot<'_>,
) {
    let _ = stream.set_nodelay(true);
    let stream = SharedStream(Arc::new(stream));
    // A rank that stops reading must not block the server's writes (most made under
    // its state lock) without bound: a write that makes no progress for a heartbeat
    // timeout fails, and that rank departs.
    if let Err(e) = stream.set_write_timeout(Some(shared.config.heartbeat_timeout)) {
        let why = format!("could not set a write timeout: {}", describe_io(&e));
        return shared.reject(peer, RefusalKind::Resources, &why);
    }
    let mut reader = FrameReader::new(stream.clone(), MAX_HANDSHAKE_FRAME_BYTES);
    let me = match join(shared, &stream, &mut reader, peer) {
        Ok(me) => me,
        Err(refused) => return shared.refuse(&stream, peer, &refused),
    };
    drop(slot);
    let (rank, id) = (me.rank, me.id);
    reader.max_frame_bytes = shared.config.max_frame_bytes;
    // This connection ends, saying why (with the state lock not held).
    let depart = |why: &str| shared.depart(&mut shared.state.lock(), rank, Some(id), why);
    if stream
        .set_read_timeout(Some(shared.config.heartbeat_interval))
        .is_err()
    {
        return depart("could not set a read timeout");
    }
    loop {
        let before = reader.bytes_read;
        let msg = match reader.spin_frame(shared.server_spin, true) {
            Ok(None) if shared.shutdown.load(Ordering::SeqCst) => return,
            // Bytes of a large frame still arriving: the rank is alive.
            Ok(None) if reader.bytes_read > before => None,
            Ok(None) => continue,
            Ok(Some(body)) => match wire::decode::<ToServer>(&body) {
                Ok(m) => Some(m),
                Err(why) => return depart(&format!("protocol error: {why}")),
            },
            Err(ReadError::Eof { partial: false }) => {
                return depart("its connection closed (the process exited or was killed)");
            }
            Err(e) => return depart(&format!("its connection failed: {e}")),
        };
        let mut st = shared.state.lock();
        let heard = Instant::now();
        match st.conns[rank].as_mut() {
            Some(c) if c.link.id == id => c.last_heard = heard,
            _ => return,
        }
        let Some(msg) = msg else { continue };
        match msg {
            ToServer::Heartbeat => {}
            ToServer::Contribute {
                epoch,
                channel,
                round,
                payload,
                ..
            } => {
                if epoch != st.epoch {
                    // A round of a group that shrank (with this rank in it, or its
                    // connection would be gone): never paired with the new group's.
                    continue;
                }
                if let Some(b) = st.broken.clone() {
                    // (A rank this fails for departs, and its next read ends the loop.)
                    shared.send_to(&mut st, [rank], &wire::encode(&ToClient::Broken(b)));
                    continue;
                }
                let Some(place) = st.place(rank) else {
                    let why = "protocol error: contributed to a round of a group it is not in (shrunk without it)";
                    return shared.depart(&mut st, rank, Some(id), why);
                };
                let (world, interval) = (st.alive.len(), shared.config.wait_warning_interval);
                let posted = &mut (st.rounds.entry((channel, round)))
                    .or_insert_with(|| Pending {
                        posted: vec![None; world],
                        notice: Deadline::after_from(heard, interval).instant(),
                    })
                    .posted;
                if posted[place].is_some() {
                    let why = format!(
                        "protocol error: contributed twice to round {round} of channel {channel}"
                    );
                    return shared.depart(&mut st, rank, Some(id), &why);
                }
                posted[place] = Some(payload);
                if posted.iter().all(Option::is_some) {
                    let payloads = posted
                        .iter_mut()
                        .filter_map(Option::take)
                        .map(ByteBuf::from)
                        .collect();
                    st.rounds.remove(&(channel, round));
                    st.rounds_completed += 1;
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
                        return depart(&why);
                    }
                }
            }
            ToServer::Abandon {
                epoch,
                channel,
                round,
                op,
            } => {
                let Some(place) = st.place(rank).filter(|_| epoch == st.epoch) else {
                    continue;
                };
                let missing =
                    (st.rounds.get(&(channel, round))).map_or_else(Vec::new, Pending::missing);
                shared.break_group(&mut st, Broken::timeout(place as u32, op, missing));
            }
            ToServer::Bye => {
                return shared.depart(&mut st, rank, Some(id), CLOSED);
            }
            ToServer::Shrink { epoch } => shared.vote(&mut st, rank, epoch, Ask::Shrink),
            ToServer::Grow { epoch, wait } => shared.vote(&mut st, rank, epoch, Ask::Grow { wait }),
            ToServer::Withdraw { epoch } => shared.withdraw(&mut st, rank, epoch),
            ToServer::Hello { .. } => {
                return shared.depart(&mut st, rank, Some(id), "protocol error: a second hello");
            }
        }
    }
}
