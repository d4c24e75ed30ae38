//! Surviving a lost rank: the survivors shrink the group and carry on.
//!
//! The store's side runs with ranks as threads (one `StoreExchange` each; a rank that
//! drops its exchange is lost to the others, as a killed process is); the pool's side
//! runs with one process per rank on the shared-memory backend, one of them killed
//! with `kill -9` in the middle of a collective.

use std::sync::Mutex;
use std::thread;
use std::time::Duration;
use symmpool::control::{ChannelId, Exchange, Launch, StoreConfig, StoreExchange, StoreServer};
use symmpool::{Deadline, Error};

mod common;

const LONG: Duration = Duration::from_secs(30);

fn store_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = StoreConfig::new(Launch::explicit(rank, world, "127.0.0.1", port).unwrap());
    c.host_server = false;
    c.token = Some("shrink".into());
    c.startup_timeout = LONG;
    c.heartbeat_interval = Duration::from_millis(200);
    c.heartbeat_timeout = Duration::from_secs(5);
    c.linger = Duration::from_millis(200);
    c
}

/// `world` ranks as threads, rank 0 hosting the store.
fn store_group(world: usize) -> Vec<StoreExchange> {
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    let server = Mutex::new(Some(server));
    thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let server = &server;
                s.spawn(move || {
                    let cfg = store_config(rank, world, port);
                    match rank {
                        0 => StoreExchange::connect_hosting(
                            cfg,
                            server.lock().unwrap().take().unwrap(),
                        ),
                        _ => StoreExchange::connect(cfg),
                    }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

/// Run `f` on every exchange's thread; the results in order.
fn on_all<E: Sync, R: Send>(group: &[E], f: impl Fn(&E) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|x| s.spawn(|| f(x))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn round(ex: &dyn Exchange, payload: u8) -> symmpool::Result<Vec<Vec<u8>>> {
    ex.all_gather(
        ChannelId::CONTROL,
        "a round",
        &[payload],
        Deadline::after(LONG),
    )
}

#[test]
fn the_survivors_of_a_lost_rank_shrink_and_their_rounds_go_on() {
    let mut group = store_group(4);
    let gone = group.remove(2);
    drop(gone);
    // Every survivor learns of the loss, then shrinks.
    for out in on_all(&group, |x| round(x, 1)) {
        assert!(
            matches!(out, Err(Error::PeerLost { rank: 2, .. })),
            "{out:?}"
        );
    }
    let shrunk = on_all(&group, |x| x.shrink(Deadline::after(LONG)));
    let shrunk: Vec<_> = shrunk.into_iter().map(Result::unwrap).collect();
    // Dense ranks in the order of the old ones; asking again gives the same exchange.
    let ranks: Vec<(usize, usize)> = shrunk.iter().map(|x| (x.rank(), x.world_size())).collect();
    assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
    let again = group[1].shrink(Deadline::after(LONG)).unwrap();
    assert!(std::sync::Arc::ptr_eq(&again, &shrunk[1]));
    // The new group's rounds pair among the survivors, in their new order.
    let out = on_all(&shrunk, |x| round(x.as_ref(), 10 + x.rank() as u8));
    for r in out {
        assert_eq!(r.unwrap(), vec![vec![10], vec![11], vec![12]]);
    }
    // Channels open afresh in the new group.
    let opened = on_all(&shrunk, |x| x.open_channel("after", Deadline::after(LONG)));
    assert!(opened.iter().all(|c| c.as_ref().unwrap().ordinal() == 1));
    // The old exchanges refuse every call.
    assert!(matches!(round(&group[0], 0), Err(Error::Shrunk { .. })));
    assert!(matches!(
        group[0].shrink(Deadline::after(LONG)).map(|_| ()),
        Ok(())
    ));
    drop(shrunk);
    while let Some(x) = group.pop() {
        drop(x);
    }
}

#[test]
fn a_second_loss_while_the_survivors_agree_fails_their_shrink_and_they_can_ask_again() {
    let mut group = store_group(4);
    drop(group.remove(3));
    // The first loss is known everywhere before anyone asks.
    for out in on_all(&group, |x| round(x, 1)) {
        assert!(
            matches!(out, Err(Error::PeerLost { rank: 3, .. })),
            "{out:?}"
        );
    }
    let third = group.remove(2);
    // Ranks 0 and 1 ask; rank 2 is lost before it asks. A survivor whose ask was
    // pending when the loss came is told so and asks again, as a runtime does (an ask
    // that reaches the store after the loss waits for the others' second asks).
    let failures = Mutex::new(Vec::new());
    let sizes = thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|x| {
                let failures = &failures;
                s.spawn(move || match x.shrink(Deadline::after(LONG)) {
                    Err(Error::ShrinkFailed { reason }) => {
                        failures.lock().unwrap().push(reason);
                        x.shrink(Deadline::after(LONG)).map(|n| n.world_size())
                    }
                    other => other.map(|n| n.world_size()),
                })
            })
            .collect();
        drop(third);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(sizes.iter().all(|r| matches!(r, Ok(2))), "{sizes:?}");
    for reason in failures.into_inner().unwrap() {
        assert!(reason.contains("job rank 2 was lost"), "{reason}");
    }
    let out = on_all(&group, |x| {
        let next = x.shrink(Deadline::after(LONG)).unwrap();
        round(next.as_ref(), next.rank() as u8)
    });
    for r in out {
        assert_eq!(r.unwrap(), vec![vec![0], vec![1]]);
    }
    while let Some(x) = group.pop() {
        drop(x);
    }
}

#[test]
fn without_the_stores_host_a_shrink_fails_at_once() {
    let mut group = store_group(3);
    let host = group.remove(0);
    drop(host);
    let started = std::time::Instant::now();
    for out in on_all(&group, |x| x.shrink(Deadline::after(LONG)).map(|_| ())) {
        match out {
            Err(Error::ShrinkFailed { reason }) => {
                assert!(reason.contains("job rank 0, is gone"), "{reason}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}
