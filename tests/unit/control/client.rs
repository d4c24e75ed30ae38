use super::*;
use crate::control::wire::PREFACE_BYTES;
use crate::control::{Exchange, Launch};
use std::io::{Read, Write};
use std::net::TcpStream;

/// Rank `rank` of `world` on the store at `port` (127.0.0.1), its heartbeats every
/// fifth of `timeout`.
fn config(rank: usize, world: usize, port: u16, timeout: Duration) -> StoreConfig {
    let mut c = StoreConfig::new(Launch::explicit(rank, world, "127.0.0.1", port).unwrap());
    c.host_server = false;
    c.token = Some("lost-peer".into());
    c.job_id = Some("lost-peer-job".into());
    c.startup_timeout = Duration::from_secs(30);
    c.heartbeat_interval = timeout / 5;
    c.heartbeat_timeout = timeout;
    c.linger = Duration::ZERO;
    c
}

/// Rank 0 (hosting) and the real ranks `1..real` of a world of `world`, joined
/// with `join_rest` standing in for the other ranks.
fn start<T: Send>(
    world: usize,
    real: usize,
    timeout: Duration,
    join_rest: impl FnOnce(u16) -> T + Send,
) -> (Vec<StoreExchange>, T) {
    let server = StoreServer::bind("127.0.0.1:0", &config(0, world, 0, timeout)).unwrap();
    let port = server.local_addr().port();
    let server = Mutex::new(Some(server));
    thread::scope(|s| {
        let hs: Vec<_> = (0..real)
            .map(|rank| {
                let server = &server;
                s.spawn(move || {
                    let cfg = config(rank, world, port, timeout);
                    match rank {
                        0 => StoreExchange::connect_hosting(cfg, server.lock().take().unwrap()),
                        _ => StoreExchange::connect(cfg),
                    }
                })
            })
            .collect();
        let rest = join_rest(port);
        let exchanges = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        (exchanges, rest)
    })
}

/// Poll `ex.lost_peer()` (no exchange call) for up to 20 s.
fn lost(ex: &StoreExchange) -> (LostPeer, Duration) {
    let t0 = Instant::now();
    let deadline = Deadline::after(Duration::from_secs(20));
    loop {
        if let Some(l) = Exchange::lost_peer(ex) {
            return (l, t0.elapsed());
        }
        assert!(!deadline.expired(), "no verdict after 20 s");
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn an_idle_rank_learns_of_a_frozen_peer_from_the_heartbeats() {
    // Rank 1 joins and then says nothing, its socket open: a frozen process
    // (SIGSTOP). Rank 0 makes no exchange call, as when it is blocked inside
    // NCCL; the server's verdict still reaches it.
    let timeout = Duration::from_secs(1);
    let (group, _frozen) = start(2, 1, timeout, |port| {
        let c = config(1, 2, port, timeout);
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut hello = wire::preface().to_vec();
        hello.extend(wire::encode(&ToServer::Hello {
            token: c.token.clone().unwrap().into_bytes(),
            job: c.job_id.clone().unwrap(),
            rank: 1,
            world_size: 2,
            host: "frozen".into(),
            pid: 1,
            joining: false,
        }));
        s.write_all(&hello).unwrap();
        let mut preface = [0u8; PREFACE_BYTES];
        s.read_exact(&mut preface).unwrap();
        s
    });
    assert_eq!(Exchange::lost_peer(&group[0]), None);
    let (loss, took) = lost(&group[0]);
    assert_eq!(loss.rank, 1);
    assert!(!loss.left);
    assert!(loss.detail.contains("no heartbeat"), "{}", loss.detail);
    // Declared at the first look after the timeout: timeout..timeout + interval,
    // with slack for a busy machine.
    assert!(took < timeout + Duration::from_secs(5), "{took:?}");
}

#[test]
fn an_idle_rank_learns_of_a_peer_that_left_and_of_the_servers_end() {
    // Heartbeats every 24 s: the background thread reads an idle socket only after
    // 12 s. The idle rank (in no exchange call, as when blocked in NCCL, whose call
    // then fails) asks for the verdict: it reads the server's word itself, long before.
    let timeout = Duration::from_secs(120);
    let (mut group, ()) = start(2, 2, timeout, |_| ());
    // Rank 1 closes its exchange: it left (a finished rank), said so.
    drop(group.pop());
    let (loss, took) = lost(&group[0]);
    assert_eq!((loss.rank, loss.left), (1, true), "{loss:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
    drop(group);
    // Rank 0, the server's host, closes its exchange (and stops the server).
    let (mut group, ()) = start(2, 2, timeout, |_| ());
    let idle = group.pop().unwrap();
    drop(group);
    let (loss, took) = lost(&idle);
    assert_eq!(loss.rank, 0, "{loss:?}");
    assert!(took < Duration::from_secs(10), "{took:?}");
}
