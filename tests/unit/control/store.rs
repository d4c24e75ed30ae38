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

/// Ranks 0 and 1 of three ask to grow, and wait: once the store holds both asks, rank
/// 2 is lost. The asks are dropped as the group breaks, and its notice is their
/// answer (`PeerLost`); the survivors then shrink past the loss.
#[test]
fn a_loss_while_ranks_ask_to_grow_drops_their_asks_and_is_their_answer() {
    use crate::control::{Exchange, StoreExchange};
    use crate::error::Error;
    let config = |rank: usize, port: u16| {
        let mut c = StoreConfig::new(Launch::explicit(rank, 3, "127.0.0.1", port).unwrap());
        c.host_server = false;
        c.heartbeat_interval = Duration::from_millis(200);
        c.linger = Duration::from_millis(200);
        c
    };
    let server = StoreServer::bind("127.0.0.1:0", &config(0, 0)).unwrap();
    let port = server.local_addr().port();
    let mut group: Vec<StoreExchange> = thread::scope(|s| {
        let one = s.spawn(|| StoreExchange::connect(config(1, port)));
        let two = s.spawn(|| StoreExchange::connect(config(2, port)));
        let host = StoreExchange::connect_hosting(config(0, port), server).unwrap();
        vec![
            host,
            one.join().unwrap().unwrap(),
            two.join().unwrap().unwrap(),
        ]
    });
    let lost = group.pop().unwrap();
    let shared = group[0].server().unwrap().shared.clone();
    let long = Deadline::after(Duration::from_secs(30));
    let answers = thread::scope(|s| {
        let asks: Vec<_> = (group.iter())
            .map(|x| s.spawn(move || x.grow(true, long).map(|g| g.is_some())))
            .collect();
        // Both asks held (bounded: the asks are a few frames away).
        let by = Instant::now() + Duration::from_secs(30);
        while shared.state.lock().votes.len() < 2 {
            assert!(Instant::now() < by, "the store never held both asks");
            thread::sleep(Duration::from_millis(1));
        }
        drop(lost);
        asks.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for a in answers {
        assert!(matches!(a, Err(Error::PeerLost { rank: 2, .. })), "{a:?}");
    }
    assert!(shared.state.lock().votes.is_empty());
    let shrunk: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|x| s.spawn(move || x.shrink(long).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(shrunk.iter().all(|x| x.world_size() == 2));
    drop(shrunk);
    while let Some(x) = group.pop() {
        drop(x);
    }
}
