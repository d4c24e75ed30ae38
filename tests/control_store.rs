//! The control plane: the `Exchange` contract, run against `LocalExchange` and
//! `StoreExchange`, and the store with real processes (this test binary re-executes
//! itself as the ranks, selected by `SYMMPOOL_TEST_CHILD`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Mutex;
use std::thread;
use std::time::{Duration, Instant};
use symmpool::{Deadline, Error};

mod common;
use symmpool::control::{
    ChannelId, Exchange, JobEnd, Launch, LocalExchange, StoreConfig, StoreExchange, StoreServer,
};

// ---------------------------------------------------------------------------------
// The contract, one body per property, run against both implementations.

fn store_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = StoreConfig::new(Launch::explicit(rank, world, "127.0.0.1", port).unwrap());
    c.host_server = false;
    c.token = Some("contract".into());
    c.startup_timeout = Duration::from_secs(30);
    c.heartbeat_interval = Duration::from_millis(200);
    c.heartbeat_timeout = Duration::from_secs(5); // the default: loaded CI machines
    c.linger = Duration::from_secs(5);
    // The server's threads poll even where cores are short (2 on CI), so that its
    // hand-over of results between them runs here too.
    c.server_spin = Some(c.spin);
    c
}

/// The store without polling: every wait blocks at once, on both sides.
fn blocking_store_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = store_config(rank, world, port);
    c.spin = Duration::ZERO;
    c.server_spin = Some(Duration::ZERO);
    c
}

fn store_group(world: usize) -> Vec<StoreExchange> {
    store_group_with(world, store_config)
}

fn blocking_store_group(world: usize) -> Vec<StoreExchange> {
    store_group_with(world, blocking_store_config)
}

fn store_group_with(
    world: usize,
    store_config: fn(usize, usize, u16) -> StoreConfig,
) -> Vec<StoreExchange> {
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    let server = Mutex::new(Some(server));
    thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let server = &server;
                s.spawn(move || {
                    let cfg = store_config(rank, world, port);
                    if rank == 0 {
                        let srv = server.lock().unwrap().take().unwrap();
                        StoreExchange::connect_hosting(cfg, srv)
                    } else {
                        StoreExchange::connect(cfg)
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    })
}

fn local_group(world: usize) -> Vec<LocalExchange> {
    LocalExchange::group(world)
}

/// Run `f` on every rank's thread; results in rank order.
fn on_all<E: Sync, R: Send>(group: &[E], f: impl Fn(&E) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = group.iter().map(|x| s.spawn(|| f(x))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

const LONG: Duration = Duration::from_secs(30);

fn rank_order<E: Exchange>(group: Vec<E>) {
    let out = on_all(&group, |x| {
        let payload = vec![x.rank() as u8; x.rank() + 1];
        x.all_gather(
            ChannelId::CONTROL,
            "rank order",
            &payload,
            Deadline::after(LONG),
        )
        .unwrap()
    });
    let expected: Vec<Vec<u8>> = (0..group.len()).map(|r| vec![r as u8; r + 1]).collect();
    for o in out {
        assert_eq!(o, expected);
    }
    assert_eq!(group[1].world_size(), group.len());
    drop_group(group);
}

fn channels_never_pair_across<E: Exchange>(group: Vec<E>) {
    let chans = on_all(&group, |x| {
        let a = x.open_channel("a", Deadline::after(LONG)).unwrap();
        let b = x.open_channel("b", Deadline::after(LONG)).unwrap();
        (a, b)
    });
    let (a, b) = chans[0];
    assert!(chans.iter().all(|c| *c == (a, b)));
    assert_eq!((a.ordinal(), b.ordinal()), (1, 2));
    // On every rank, one thread per channel, each doing its own rounds at its own pace.
    on_all(&group, |x| {
        thread::scope(|s| {
            for (tag, ch) in [(1u8, a), (2u8, b)] {
                s.spawn(move || {
                    for round in 0..25u8 {
                        let out = x
                            .all_gather(
                                ch,
                                "interleaved",
                                &[tag, round, x.rank() as u8],
                                Deadline::after(LONG),
                            )
                            .unwrap();
                        for (r, p) in out.iter().enumerate() {
                            assert_eq!(p, &vec![tag, round, r as u8]);
                        }
                    }
                });
            }
        });
    });
    drop_group(group);
}

fn a_timeout_breaks_every_rank_and_channel<E: Exchange>(group: Vec<E>) {
    assert_eq!(group.len(), 3);
    let ch = on_all(&group, |x| {
        x.open_channel("work", Deadline::after(LONG)).unwrap()
    })[0];
    let started = Instant::now();
    // Rank 1 waits (long timeout) with rank 0 (short); rank 2 never comes.
    let (a, b) = thread::scope(|s| {
        let a = s.spawn(|| {
            group[0].all_gather(
                ch,
                "lonely",
                &[0],
                Deadline::after(Duration::from_millis(300)),
            )
        });
        let b = s.spawn(|| group[1].all_gather(ch, "lonely", &[1], Deadline::after(LONG)));
        (a.join().unwrap(), b.join().unwrap())
    });
    match a {
        Err(Error::Timeout { missing_ranks, .. }) => assert_eq!(missing_ranks, vec![2]),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(b, Err(Error::GroupBroken { rank: 0, .. })),
        "{b:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waiters fail promptly"
    );
    // Every later call, on every channel and rank, fails.
    for x in &group {
        for c in [ch, ChannelId::CONTROL] {
            let r = x.all_gather(c, "lonely", &[9], Deadline::after(LONG));
            assert!(
                matches!(r, Err(Error::GroupBroken { rank: 0, .. })),
                "{r:?}"
            );
        }
        let r = x.open_channel("later", Deadline::after(LONG));
        assert!(
            matches!(r, Err(Error::GroupBroken { rank: 0, .. })),
            "{r:?}"
        );
    }
    drop_group(group);
}

fn an_endless_timeout_does_not_overflow<E: Exchange>(group: Vec<E>) {
    let out = on_all(&group, |x| {
        x.all_gather(ChannelId::CONTROL, "forever", &[5], Deadline::never())
            .unwrap()
    });
    assert!(out.iter().all(|o| o.iter().all(|p| p == &[5])));
    // The same through a channel opened without a deadline, and a deadline that never
    // passes.
    let out = on_all(&group, |x| {
        let ch = x.open_channel("forever", Deadline::never()).unwrap();
        let first = x
            .all_gather(ch, "forever", &[6], Deadline::never())
            .unwrap();
        let second = x
            .all_gather(ch, "forever", &[7], Deadline::never())
            .unwrap();
        (first, second)
    });
    for (first, second) in out {
        assert_eq!(first, vec![vec![6]; group.len()]);
        assert_eq!(second, vec![vec![7]; group.len()]);
    }
    drop_group(group);
}

fn open_channel_in_different_orders_fails_everywhere<E: Exchange>(group: Vec<E>) {
    assert_eq!(group.len(), 2);
    let out = on_all(&group, |x| {
        let names = if x.rank() == 0 {
            ["a", "b"]
        } else {
            ["b", "a"]
        };
        names.map(|n| x.open_channel(n, Deadline::after(LONG)))
    });
    for (rank, results) in out.into_iter().enumerate() {
        for (i, r) in results.into_iter().enumerate() {
            match r {
                Err(Error::ChannelMismatch { opened }) => {
                    let o = i as u64 + 1;
                    let (n0, n1) = if i == 0 { ("a", "b") } else { ("b", "a") };
                    assert_eq!(
                        opened,
                        vec![(0, o, n0.to_string()), (1, o, n1.to_string())],
                        "rank {rank}"
                    );
                }
                other => panic!("rank {rank}: {other:?}"),
            }
        }
    }
    // The mismatch is reported, not a break: the control channel still works.
    on_all(&group, |x| {
        x.all_gather(ChannelId::CONTROL, "after", &[1], Deadline::after(LONG))
            .unwrap()
    });
    drop_group(group);
}

/// Drop the ranks last to first: the rank hosting the store lingers in its drop until
/// the others have left.
fn drop_group<E>(mut group: Vec<E>) {
    while let Some(x) = group.pop() {
        drop(x);
    }
}

macro_rules! contract {
    ($($name:ident($world:expr);)*) => {
        mod local_contract {
            use super::*;
            $(#[test] fn $name() { super::$name(local_group($world)); })*
        }
        mod store_contract {
            use super::*;
            $(#[test] fn $name() { super::$name(store_group($world)); })*
        }
        mod blocking_store_contract {
            use super::*;
            $(#[test] fn $name() { super::$name(blocking_store_group($world)); })*
        }
    };
}

contract! {
    rank_order(3);
    channels_never_pair_across(3);
    a_timeout_breaks_every_rank_and_channel(3);
    an_endless_timeout_does_not_overflow(2);
    open_channel_in_different_orders_fails_everywhere(2);
}

#[test]
fn store_dropping_a_rank_mid_round_is_peer_lost_for_the_others() {
    let mut group = store_group(3);
    let gone = group.remove(2);
    let ch = ChannelId::CONTROL;
    let out = thread::scope(|s| {
        let hs: Vec<_> = group
            .iter()
            .map(|x| {
                s.spawn(move || x.all_gather(ch, "waiting for 2", &[1], Deadline::after(LONG)))
            })
            .collect();
        drop(gone);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for r in out {
        match r {
            Err(Error::PeerLost { rank: 2, op, .. }) => assert_eq!(op, "waiting for 2"),
            other => panic!("{other:?}"),
        }
    }
    drop_group(group);
}

/// The result of a round reaches every rank even when a rank leaves the moment it has
/// its own copy (its goodbye breaks the group): the server's threads write a round's
/// results in parallel, and nothing written later to a rank may overtake its result.
#[test]
fn store_ranks_leaving_right_after_the_last_round_cost_no_one_its_result() {
    for attempt in 0..20 {
        let group = store_group(4);
        let ch = ChannelId::CONTROL;
        let rounds = 20u8;
        thread::scope(|s| {
            let mut group = group.into_iter();
            let host = group.next().unwrap();
            for x in group {
                s.spawn(move || {
                    for i in 0..rounds {
                        let out = x.all_gather(ch, "last rounds", &[i], Deadline::after(LONG));
                        assert_eq!(out.unwrap(), vec![vec![i]; 4], "attempt {attempt}");
                    }
                    drop(x); // at once: its goodbye races the others' last results
                });
            }
            for i in 0..rounds {
                let out = host.all_gather(ch, "last rounds", &[i], Deadline::after(LONG));
                assert_eq!(out.unwrap(), vec![vec![i]; 4], "attempt {attempt}");
            }
            drop(host);
        });
    }
}

#[test]
fn store_refuses_oversized_payloads_without_using_a_round() {
    let group = store_group(2);
    let max = store_config(0, 2, 0).max_payload_bytes();
    let big = vec![0u8; max + 1];
    assert!(matches!(
        group[0].all_gather(ChannelId::CONTROL, "big", &big, Deadline::after(LONG)),
        Err(Error::PayloadTooLarge { .. })
    ));
    let out = on_all(&group, |x| {
        x.all_gather(
            ChannelId::CONTROL,
            "ok",
            &vec![7u8; max],
            Deadline::after(LONG),
        )
        .unwrap()
    });
    assert_eq!(out[1][0].len(), max);
    drop_group(group);
}

#[test]
fn store_start_up_times_out_naming_the_missing_ranks() {
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, 3, 0)).unwrap();
    let mut cfg = store_config(0, 3, 0);
    cfg.startup_timeout = Duration::from_millis(500);
    match StoreExchange::connect_hosting(cfg, server) {
        Err(Error::Timeout {
            op, missing_ranks, ..
        }) => {
            assert_eq!(op, "store start-up");
            assert_eq!(missing_ranks, vec![1, 2]);
        }
        other => panic!("{other:?}"),
    }
}

// ---------------------------------------------------------------------------------
// A rank that does not come is named while the others wait.

/// The warnings of this test binary, kept by one global subscriber.
mod capture {
    use std::sync::{Condvar, Mutex, Once};
    use std::time::{Duration, Instant};
    use tracing_subscriber::filter::LevelFilter;
    use tracing_subscriber::layer::{Context, SubscriberExt};
    use tracing_subscriber::{Layer, Registry};

    static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());
    static MORE: Condvar = Condvar::new();

    struct Keep;

    struct Message(String);

    impl tracing::field::Visit for Message {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            if field.name() == "message" {
                self.0 = format!("{value:?}");
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Keep {
        fn on_event(&self, e: &tracing::Event<'_>, _: Context<'_, S>) {
            let mut m = Message(String::new());
            e.record(&mut m);
            LINES.lock().unwrap().push(m.0);
            MORE.notify_all();
        }
    }

    /// Start keeping warnings (once).
    pub fn install() {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            tracing::subscriber::set_global_default(
                Registry::default().with(LevelFilter::WARN).with(Keep),
            )
            .expect("the only global subscriber of this test binary");
        });
    }

    /// The warnings so far that contain every one of `words`, in order.
    pub fn lines(words: &[&str]) -> Vec<String> {
        (LINES.lock().unwrap().iter())
            .filter(|l| words.iter().all(|w| l.contains(w)))
            .cloned()
            .collect()
    }

    /// Wait (up to `timeout`) for `n` warnings that contain every one of `words`.
    pub fn wait_for(words: &[&str], n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut lines = LINES.lock().unwrap();
        loop {
            let seen = (lines.iter())
                .filter(|l| words.iter().all(|w| l.contains(w)))
                .count();
            if seen >= n {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "no {n} warnings with {words:?} in {timeout:?}: {lines:#?}"
            );
            lines = MORE.wait_timeout(lines, left).unwrap().0;
        }
    }
}

/// `who`'s warnings in `op` (on the store `at`): at least two naming `late` as not
/// arrived, then one saying it arrived, and nothing after that.
fn warned_then_arrived(at: &str, op: &str, who: &str, late: &str) {
    let waited = format!("{who} ({at}) has waited");
    let said = format!("{who} ({at}): ");
    let mine: Vec<String> = (capture::lines(&[op]).into_iter())
        .filter(|l| l.contains(&waited) || l.contains(&said))
        .collect();
    let arrived = (mine.iter())
        .position(|l| l.contains(&format!("{said}{late} arrived in {op} after")))
        .unwrap_or_else(|| panic!("{who}: no arrival: {mine:#?}"));
    assert_eq!(arrived, mine.len() - 1, "{who} warned after it: {mine:#?}");
    assert!(arrived >= 2, "{who}: fewer than two warnings: {mine:#?}");
    for l in &mine[..arrived] {
        assert!(l.contains(&format!("for {late}, not arrived yet")), "{l}");
    }
}

#[test]
fn a_late_rank_is_named_while_the_others_wait_and_once_more_when_it_comes() {
    capture::install();
    let world = 3;
    let config = |rank: usize, port: u16| {
        let mut c = store_config(rank, world, port);
        c.startup_timeout = Duration::from_secs(120);
        c.wait_warning_interval = Duration::from_millis(100);
        c
    };
    let server = StoreServer::bind("127.0.0.1:0", &config(0, 0)).unwrap();
    let port = server.local_addr().port();
    let at = format!("store 127.0.0.1:{port}");
    let at = at.as_str();
    let startup = "store start-up";
    let op = "late-rank store round";
    let patience = Duration::from_secs(60);
    let round = |ex: &StoreExchange| {
        let mine = [ex.rank() as u8];
        ex.all_gather(ChannelId::CONTROL, op, &mine, Deadline::after(patience))
    };
    let all = vec![vec![0], vec![1], vec![2]];
    let (ex0, ex1, ex2) = thread::scope(|s| {
        // Ranks 0 and 1 start; rank 2 comes once both have named it twice.
        let r0 = s.spawn(|| StoreExchange::connect_hosting(config(0, port), server));
        let r1 = s.spawn(|| StoreExchange::connect(config(1, port)));
        for rank in 0..2 {
            let who = format!("rank {rank} ({at}) has waited");
            capture::wait_for(&[startup, &who, "for rank 2,"], 2, patience);
        }
        let ex2 = StoreExchange::connect(config(2, port)).unwrap();
        (
            r0.join().unwrap().unwrap(),
            r1.join().unwrap().unwrap(),
            ex2,
        )
    });
    thread::scope(|s| {
        // A round that rank 2 joins late, once both others have named it twice.
        let r0 = s.spawn(|| round(&ex0));
        let r1 = s.spawn(|| round(&ex1));
        for rank in 0..2 {
            let who = format!("rank {rank} ({at}) has waited");
            capture::wait_for(&[op, &who, "for rank 2,"], 2, patience);
        }
        assert_eq!(round(&ex2).unwrap(), all);
        assert_eq!(r0.join().unwrap().unwrap(), all);
        assert_eq!(r1.join().unwrap().unwrap(), all);
    });
    // A round nobody is late for says nothing.
    let quiet = "on-time store round";
    thread::scope(|s| {
        let hs: Vec<_> = [&ex0, &ex1, &ex2]
            .into_iter()
            .map(|ex| {
                s.spawn(move || {
                    ex.all_gather(ChannelId::CONTROL, quiet, &[], Deadline::after(patience))
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
    });
    for rank in 0..2 {
        let who = format!("rank {rank}");
        warned_then_arrived(at, startup, &who, "rank 2");
        warned_then_arrived(at, op, &who, "rank 2");
    }
    assert_eq!(capture::lines(&[at, "rank 2 ("]), Vec::<String>::new());
    assert_eq!(capture::lines(&[at, quiet]), Vec::<String>::new());
    drop((ex1, ex2));
    drop(ex0); // the host last
}

#[test]
fn a_rank_that_cannot_reach_the_store_says_so_until_it_can() {
    capture::install();
    // A port nobody listens on, until rank 0 binds it below.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let config = |rank: usize| {
        let mut c = store_config(rank, 2, port);
        c.startup_timeout = Duration::from_secs(120);
        c.wait_warning_interval = Duration::from_millis(100);
        c
    };
    let at = format!("store 127.0.0.1:{port}");
    let server = "the store server (rank 0 hosts it)";
    let (ex0, ex1) = thread::scope(|s| {
        let r1 = s.spawn(|| StoreExchange::connect(config(1)));
        let waited = format!("rank 1 ({at}) has waited");
        capture::wait_for(
            &["store start-up", &waited, server],
            2,
            Duration::from_secs(60),
        );
        let bound = StoreServer::bind(("127.0.0.1", port), &config(0)).unwrap();
        let ex0 = StoreExchange::connect_hosting(config(0), bound).unwrap();
        (ex0, r1.join().unwrap().unwrap())
    });
    // Warnings naming the server (then maybe rank 0, which joins after rank 1
    // connects), then one that says the wait is over, and nothing after it.
    let mine = capture::lines(&["store start-up", &format!("rank 1 ({at})")]);
    let (last, before) = mine.split_last().unwrap();
    assert!(
        last.contains(" arrived in store start-up after "),
        "{mine:#?}"
    );
    assert!(before.iter().all(|l| l.contains("has waited")), "{mine:#?}");
    assert!(before.len() >= 2 && before[1].contains(server), "{mine:#?}");
    drop(ex1);
    drop(ex0); // the host last
}

// ---------------------------------------------------------------------------------
// Processes. The child role: run when SYMMPOOL_TEST_CHILD is set, a no-op otherwise.

use common::procs::{CHILD, HEARTBEAT_MS, HEARTBEAT_TIMEOUT_MS, Job};

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = child_main();
    std::process::exit(code);
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn child_main() -> i32 {
    if let Some(ms) = var("CHILD_DELAY_MS") {
        thread::sleep(Duration::from_millis(ms.parse().unwrap()));
    }
    if var("CHILD_LOG").is_some() {
        // The server's warnings, on standard error (the parent reads them).
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_max_level(tracing::Level::WARN)
            .with_ansi(false)
            .try_init();
    }
    let mut cfg = StoreConfig::from_env().unwrap();
    let rank = cfg.launch.rank;
    let ex = if rank == 0 {
        let bind = var("CHILD_BIND").unwrap_or_else(|| "127.0.0.1:0".into());
        let server = match StoreServer::bind(bind.as_str(), &cfg) {
            Ok(s) => s,
            Err(e) => {
                println!("@@error {e}");
                return 2;
            }
        };
        println!("@@port {}", server.local_addr().port());
        cfg.host_server = true;
        StoreExchange::connect_hosting(cfg, server)
    } else {
        cfg.host_server = false;
        StoreExchange::connect(cfg)
    };
    let ex = match ex {
        Ok(ex) => ex,
        Err(e) => {
            println!("@@error {e}");
            println!(
                "@@variant {}",
                format!("{e:?}").split([' ', '{', '(']).next().unwrap()
            );
            return 2;
        }
    };
    println!("@@joined");
    let fds_base = open_fds();
    if rank == 0 && var("CHILD_WAIT_STDIN").is_some() {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
    }
    if let Some(target) = var("CHILD_UNTIL_ACCEPTED") {
        // Rounds, on every rank, until rank 0's server has accepted `target`
        // connections (rank 0 says when, in its payload), counting rank 0's open
        // descriptors after each round.
        let target: u64 = target.parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut fds_max = fds_base;
        let mut rounds = 0u64;
        loop {
            let more = match ex.server() {
                Some(s) => u8::from(s.stats().connections_accepted < target),
                None => 1,
            };
            let out = ex
                .all_gather(
                    ChannelId::CONTROL,
                    "flood round",
                    &[more],
                    Deadline::after(LONG),
                )
                .unwrap();
            rounds += 1;
            fds_max = fds_max.max(open_fds());
            if out[0] == [0] {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the connections never all arrived"
            );
        }
        if let Some(s) = ex.server() {
            let st = s.stats();
            println!(
                "@@flood rounds={rounds} fds_base={fds_base} fds_max={fds_max} busy={} rejected={}",
                st.connections_refused_busy, st.connections_rejected
            );
        }
    }
    let rounds: usize = var("CHILD_ROUNDS").map_or(20, |r| r.parse().unwrap());
    let victim: Option<usize> = var("CHILD_VICTIM").map(|v| v.parse().unwrap());
    let ch = ex.open_channel("child", Deadline::after(LONG)).unwrap();
    for i in 0..rounds {
        let c = if i % 2 == 0 { ch } else { ChannelId::CONTROL };
        let out = ex
            .all_gather(
                c,
                "child round",
                &[i as u8, rank as u8],
                Deadline::after(LONG),
            )
            .unwrap();
        for (r, p) in out.iter().enumerate() {
            assert_eq!(p, &vec![i as u8, r as u8]);
        }
    }
    if let Some(v) = victim {
        if v == rank {
            println!("@@stalled");
            thread::sleep(Duration::from_secs(300));
            return 9;
        }
        let t = Duration::from_secs(120);
        // Every round's result reached this rank: losing the victim now (even the
        // server's host) can only show up in the next call.
        println!("@@waiting");
        return match ex.all_gather(ch, "waiting for the victim", &[0], Deadline::after(t)) {
            Err(Error::PeerLost { rank, op, detail }) => {
                println!("@@lost rank={rank} op={op} detail={detail}");
                0
            }
            other => {
                println!("@@unexpected {other:?}");
                3
            }
        };
    }
    if let Some(s) = ex.server() {
        // Wait for the other ranks to leave, so the counters are final.
        let stats = s.stats();
        println!("@@stats rejected={}", stats.connections_rejected);
    }
    println!("@@ok");
    0
}

/// Descriptors this process holds open.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

fn no_env(_: usize) -> Vec<(&'static str, String)> {
    Vec::new()
}

#[test]
fn processes_2_4_and_8_complete_their_rounds() {
    for world in [2, 4, 8] {
        let mut job = Job::start("child_process_entry", world, no_env);
        let all: Vec<usize> = (0..world).collect();
        assert_eq!(
            job.wait(&all, Duration::from_secs(120)),
            vec![0; world],
            "world {world}"
        );
        for r in 0..world {
            job.expect(r, "@@ok", Duration::from_secs(5));
        }
    }
}

/// Kill (or stop) `victim` once it stalls mid-round; every other rank reports it lost.
fn lose_a_rank(world: usize, victim: usize, stop: bool) -> (Duration, Vec<String>) {
    let mut job = Job::start("child_process_entry", world, |_| {
        vec![("CHILD_VICTIM", victim.to_string())]
    });
    job.expect(victim, "@@stalled", Duration::from_secs(60));
    for r in (0..world).filter(|r| *r != victim) {
        job.expect(r, "@@waiting", Duration::from_secs(60));
    }
    let t0 = Instant::now();
    if stop {
        let pid = job.children[victim].id().to_string();
        let st = Command::new("kill").args(["-STOP", &pid]).status().unwrap();
        assert!(st.success());
    } else {
        job.children[victim].kill().unwrap();
    }
    let others: Vec<usize> = (0..world).filter(|r| *r != victim).collect();
    let codes = job.wait(&others, Duration::from_secs(60));
    let elapsed = t0.elapsed();
    println!("rank {victim} of {world} lost (stop: {stop}): survivors exited after {elapsed:?}");
    assert_eq!(codes, vec![0; others.len()], "{:?}", job.seen);
    let lines = others
        .iter()
        .map(|&r| job.expect(r, "@@lost ", Duration::from_secs(5)))
        .collect::<Vec<_>>();
    for l in &lines {
        assert!(l.starts_with(&format!("rank={victim} ")), "{l}");
        assert!(l.contains("op=waiting for the victim"), "{l}");
    }
    (elapsed, lines)
}

/// The stated bound: heartbeat timeout + interval, plus slack for a loaded 2-core CI.
fn bound() -> Duration {
    Duration::from_millis(HEARTBEAT_TIMEOUT_MS + HEARTBEAT_MS) + Duration::from_secs(4)
}

#[test]
fn kill_9_of_a_rank_mid_round_is_peer_lost_on_every_other_rank() {
    let (elapsed, _) = lose_a_rank(4, 2, false);
    assert!(elapsed < bound(), "{elapsed:?}");
}

#[test]
fn kill_9_of_the_server_host_is_peer_lost_rank_0() {
    let (elapsed, lines) = lose_a_rank(3, 0, false);
    assert!(elapsed < bound(), "{elapsed:?}");
    assert!(
        lines.iter().all(|l| l.contains("store server")),
        "{lines:?}"
    );
}

#[test]
fn a_frozen_rank_is_lost_by_missing_heartbeats() {
    let (elapsed, lines) = lose_a_rank(3, 1, true);
    assert!(elapsed < bound(), "{elapsed:?}");
    assert!(
        elapsed >= Duration::from_millis(HEARTBEAT_TIMEOUT_MS - HEARTBEAT_MS),
        "{elapsed:?}"
    );
    assert!(
        lines.iter().all(|l| l.contains("no heartbeat")),
        "{lines:?}"
    );
}

#[test]
fn a_rank_starting_10_s_late_still_completes() {
    let mut job = Job::start("child_process_entry", 3, |r| {
        if r == 2 {
            vec![("CHILD_DELAY_MS", "10000".to_string())]
        } else {
            Vec::new()
        }
    });
    assert_eq!(job.wait(&[0, 1, 2], Duration::from_secs(120)), vec![0; 3]);
}

/// Connect to the store, send `bytes`, and read until the server closes (at most
/// `within`); what the server sent.
fn abuse(port: u16, bytes: &[u8], within: Duration) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(within)).unwrap();
    let _ = s.write_all(bytes);
    read_to_close(&mut s, within)
}

fn read_to_close(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let deadline = Instant::now() + within;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return got,
            Err(e) => panic!("the server did not close the connection: {e}"),
        }
        assert!(Instant::now() < deadline, "not closed within {within:?}");
    }
}

fn preface(version: u16) -> Vec<u8> {
    let mut p = b"SYMMPOOL".to_vec();
    p.extend_from_slice(&version.to_le_bytes());
    p.extend_from_slice(&[0, 0]);
    p
}

/// The store's protocol version.
const VERSION: u16 = 9;

/// A hello frame as postcard encodes it (all numbers and lengths below 128): token,
/// job identity (none), rank, world size, host name, pid 1, not joining.
fn hello(token: &[u8], rank: u8, world: u8) -> Vec<u8> {
    hello_of_job(token, b"", rank, world)
}

fn hello_of_job(token: &[u8], job: &[u8], rank: u8, world: u8) -> Vec<u8> {
    let mut body = vec![0u8, token.len() as u8];
    body.extend_from_slice(token);
    body.push(job.len() as u8);
    body.extend_from_slice(job);
    body.extend_from_slice(&[rank, world, 4]);
    body.extend_from_slice(b"fake");
    body.extend_from_slice(&[1, 0]);
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend(body);
    f
}

#[test]
fn bad_clients_on_the_store_port_do_not_disturb_a_running_job() {
    let mut job = Job::start("child_process_entry", 3, |r| {
        if r == 0 {
            vec![("CHILD_WAIT_STDIN", "1".to_string())]
        } else {
            Vec::new()
        }
    });
    for r in 0..3 {
        job.expect(r, "@@joined", Duration::from_secs(60));
    }
    // Ranks 1 and 2 now wait mid-round for rank 0, which waits for us.
    let port = job.port;
    let within = Duration::from_secs(10);
    let mut half_open = TcpStream::connect(("127.0.0.1", port)).unwrap();
    half_open.set_read_timeout(Some(within)).unwrap();
    let text = |b: Vec<u8>| String::from_utf8_lossy(&b).into_owned();
    abuse(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", within);
    abuse(port, &[0xde, 0xad, 0xbe, 0xef], within);
    let got = text(abuse(port, &preface(99), within));
    assert!(got.contains("version 99"), "{got}");
    let mut msg = preface(VERSION);
    msg.extend(hello(b"wrong", 1, 3));
    assert!(text(abuse(port, &msg, within)).contains("token"));
    let mut msg = preface(VERSION);
    msg.extend(hello(b"job-token", 1, 3));
    assert!(text(abuse(port, &msg, within)).contains("already connected"));
    let mut msg = preface(VERSION);
    msg.extend(hello(b"job-token", 7, 3));
    assert!(text(abuse(port, &msg, within)).contains("out of range"));
    let mut msg = preface(VERSION);
    msg.extend(u32::MAX.to_le_bytes());
    assert!(text(abuse(port, &msg, within)).contains("exceeds the limit"));
    let mut msg = preface(VERSION);
    msg.extend(100u32.to_le_bytes());
    msg.extend([1, 2, 3]);
    {
        // A truncated frame: the client closes its side mid-frame.
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&msg).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        read_to_close(&mut s, within);
    }
    // The half-open connection is closed after the handshake timeout (2 s).
    read_to_close(&mut half_open, within);
    // Let the job go on: it completes.
    writeln!(job.children[0].stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(job.wait(&[0, 1, 2], Duration::from_secs(60)), vec![0; 3]);
    let rejected: u64 = job
        .expect(0, "@@stats rejected=", Duration::from_secs(5))
        .parse()
        .unwrap();
    assert_eq!(rejected, 9, "every bad client was counted");
}

// ---------------------------------------------------------------------------------
// A store that a hostile or careless client cannot break.

/// The first line of `rank` (from `job`) starting with `prefix` and containing
/// every one of `parts`, waiting up to `within`.
fn expect_containing(
    job: &mut Job,
    rank: usize,
    prefix: &str,
    parts: &[&str],
    within: Duration,
) -> String {
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = job.expect(rank, prefix, left);
        if parts.iter().all(|p| line.contains(p)) {
            return line;
        }
    }
}

/// Raise this process's soft limit on open descriptors to at least `want` (at most
/// the hard limit).
fn raise_open_file_limit(want: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for getrlimit to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 || lim.rlim_cur >= want {
        return;
    }
    lim.rlim_cur = want.min(lim.rlim_max);
    // SAFETY: `lim` is a valid rlimit; raising the soft limit up to the hard one is
    // always allowed.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
}

#[test]
fn a_thousand_idle_connections_during_a_job_cost_it_nothing() {
    const IDLE: usize = 1000;
    let world = 3;
    let mut job = Job::start("child_process_entry", world, |r| {
        let mut env = vec![("CHILD_UNTIL_ACCEPTED", (world + IDLE).to_string())];
        if r == 0 {
            env.push(("CHILD_WAIT_STDIN", "1".into()));
        }
        env
    });
    for r in 0..world {
        job.expect(r, "@@joined", Duration::from_secs(60));
    }
    // This process holds the client end of every idle connection: make room for
    // them where the soft limit is the common 1024.
    raise_open_file_limit(IDLE as u64 + 256);
    // Open the idle connections (never a byte sent), then let the job's rounds run
    // until the server has accepted every one of them.
    let idle: Vec<TcpStream> = (0..IDLE)
        .map(|i| {
            TcpStream::connect(("127.0.0.1", job.port)).unwrap_or_else(|e| {
                panic!("idle connection {i}: {e} (is `ulimit -n` above {IDLE}?)")
            })
        })
        .collect();
    writeln!(job.children[0].stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(
        job.wait(&[0, 1, 2], Duration::from_secs(60)),
        vec![0; world]
    );
    let flood = job.expect(0, "@@flood ", Duration::from_secs(5));
    println!("rank 0 under {IDLE} idle connections: {flood}");
    let field = |name: &str| -> u64 {
        flood
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap()
            .parse()
            .unwrap()
    };
    let (base, max) = (field("fds_base"), field("fds_max"));
    // At most `max_handshakes` (64) handshakes hold a descriptor each; the rest are
    // refused at once.
    assert!(
        max <= base + 64 + 8,
        "rank 0's descriptors grew from {base} to {max}: {flood}"
    );
    assert!(
        field("busy") >= (IDLE / 2) as u64,
        "the connections over the cap were refused as busy: {flood}"
    );
    drop(idle);
}

#[test]
fn a_second_job_on_the_same_port_is_refused_and_both_jobs_are_told() {
    let mut a = Job::start("child_process_entry", 2, |r| {
        let mut env = vec![("SYMMPOOL_JOB_ID", "job-a".to_string())];
        if r == 0 {
            env.push(("CHILD_WAIT_STDIN", "1".into()));
        }
        env
    });
    for r in 0..2 {
        a.expect(r, "@@joined", Duration::from_secs(60));
    }
    // Job B on job A's port: its rank 0 cannot bind it, its rank 1 reaches A's store.
    let port = a.port.to_string();
    let mut b = Job::start_on_free_port("child_process_entry", 2, |_| {
        vec![
            ("SYMMPOOL_JOB_ID", "job-b".to_string()),
            ("MASTER_PORT", port.clone()),
            ("CHILD_BIND", format!("127.0.0.1:{port}")),
        ]
    });
    let within = Duration::from_secs(30);
    assert_eq!(b.wait(&[0, 1], within), vec![2, 2]);
    b.expect(0, "@@error ", within);
    let refused = b.expect(1, "@@error ", within);
    assert!(
        refused.contains("\"job-b\"") && refused.contains("\"job-a\""),
        "{refused}"
    );
    assert_eq!(b.expect(1, "@@variant ", within), "JobMismatch");
    // Job A goes on, unaffected, and counted the refusal.
    writeln!(a.children[0].stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(a.wait(&[0, 1], Duration::from_secs(60)), vec![0, 0]);
    let rejected: u64 = a
        .expect(0, "@@stats rejected=", Duration::from_secs(5))
        .parse()
        .unwrap();
    assert_eq!(rejected, 1);
}

#[test]
fn a_duplicate_rank_names_both_processes_on_both_sides() {
    let mut job = Job::start("child_process_entry", 2, |r| {
        let mut env = vec![("CHILD_LOG", "1".to_string())];
        if r == 0 {
            env.push(("CHILD_WAIT_STDIN", "1".into()));
        }
        env
    });
    for r in 0..2 {
        job.expect(r, "@@joined", Duration::from_secs(60));
    }
    let holder = job.children[1].id().to_string();
    // A second process claiming rank 1 (same token, same job).
    let mut second = Job::start_on_free_port("child_process_entry", 0, no_env);
    second.spawn(1, 2, &[("MASTER_PORT", job.port.to_string())]);
    let claimant = second.children[0].id().to_string();
    let within = Duration::from_secs(30);
    assert_eq!(second.wait(&[0], within), vec![2]);
    let pids = [
        format!("pid {holder} on host"),
        format!("pid {claimant} on host"),
    ];
    let parts = [pids[0].as_str(), pids[1].as_str(), " UTC"];
    // (The second job's lines are its child 0's.)
    let refused = second.expect(0, "@@error ", within);
    assert!(parts.iter().all(|p| refused.contains(p)), "{refused}");
    assert_eq!(second.expect(0, "@@variant ", within), "RankTaken");
    // The server's warning names both too.
    expect_containing(&mut job, 0, "stderr: ", &parts, within);
    writeln!(job.children[0].stdin.as_mut().unwrap(), "go").unwrap();
    assert_eq!(job.wait(&[0, 1], Duration::from_secs(60)), vec![0, 0]);
}

/// A store with no ranks joined, for the handshake tests.
fn lone_server(configure: impl FnOnce(&mut StoreConfig)) -> StoreServer {
    let mut cfg = store_config(0, 2, 0);
    configure(&mut cfg);
    StoreServer::bind("127.0.0.1:0", &cfg).unwrap()
}

#[test]
fn garbage_is_refused_at_once_and_counted() {
    // A handshake timeout far above the test's bound: closing is not by timeout.
    let server = lone_server(|c| c.handshake_timeout = Duration::from_secs(60));
    let port = server.local_addr().port();
    let within = Duration::from_secs(10);
    let started = Instant::now();
    let garbage: [&[u8]; 4] = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        &[0xde; 64],
        b"SYMMPOOL\x02\x00\x00\x00\xff\xff\xff\xff",
        b"SYMMPOOL\x02\x00\x00\x00\x03\x00\x00\x00\xff\xff\xff",
    ];
    for _ in 0..5 {
        for g in garbage {
            abuse(port, g, within);
        }
    }
    assert!(started.elapsed() < within, "{:?}", started.elapsed());
    let stats = server.stats();
    assert_eq!(
        (stats.connections_accepted, stats.connections_rejected),
        (20, 20)
    );
}

#[test]
fn handshakes_over_the_cap_are_refused_as_busy_at_once() {
    let server = lone_server(|c| {
        c.max_handshakes = 4;
        c.handshake_timeout = Duration::from_secs(60);
    });
    let port = server.local_addr().port();
    // Four idle connections hold the four slots (accepted in order, before the next).
    let idle: Vec<TcpStream> = (0..4)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    let got = abuse(port, b"", Duration::from_secs(10));
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("busy"), "{text}");
    assert_eq!(server.stats().connections_refused_busy, 1);
    drop(idle);
}

#[test]
fn a_rank_of_another_job_and_a_second_claim_of_a_rank_are_told_what_they_are() {
    let config = |rank: usize, world: usize, port: u16| {
        let mut c = store_config(rank, world, port);
        c.job_id = Some("job-x".into());
        c
    };
    let group = store_group_with(2, config);
    let port = group[0].server().unwrap().local_addr().port();
    let mut other = config(1, 2, port);
    other.job_id = Some("job-y".into());
    match StoreExchange::connect(other) {
        Err(Error::JobMismatch { job, store_job }) => {
            assert_eq!((job.as_str(), store_job.as_str()), ("job-y", "job-x"));
        }
        other => panic!("{other:?}"),
    }
    let mut none = config(1, 2, port);
    none.job_id = None;
    assert!(matches!(
        StoreExchange::connect(none),
        Err(Error::JobMismatch { job, .. }) if job.is_empty()
    ));
    match StoreExchange::connect(config(1, 2, port)) {
        Err(e @ Error::RankTaken { rank: 1, .. }) => {
            let text = e.to_string();
            let me = format!("pid {} on host", std::process::id());
            assert_eq!(text.matches(&me).count(), 2, "{text}");
        }
        other => panic!("{other:?}"),
    }
    // The group is unaffected.
    on_all(&group, |ex| {
        ex.all_gather(ChannelId::CONTROL, "after", &[1], Deadline::after(LONG))
            .unwrap()
    });
    drop_group(group);
}

#[test]
fn once_every_rank_joined_a_host_running_none_of_them_is_refused_without_a_handshake() {
    use rustix::net::{AddressFamily, SocketType, bind, connect, ipproto, socket};
    use std::net::{Ipv4Addr, SocketAddr};
    let group = store_group(2);
    let server = group[0].server().unwrap();
    let port = server.local_addr().port();
    let before = server.stats();
    // A client on 127.0.0.2 (the ranks run on 127.0.0.1) that sends nothing.
    let fd = socket(AddressFamily::INET, SocketType::STREAM, Some(ipproto::TCP)).unwrap();
    bind(&fd, &SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 0))).unwrap();
    connect(&fd, &SocketAddr::from((Ipv4Addr::LOCALHOST, port))).unwrap();
    let mut stranger = TcpStream::from(fd);
    stranger
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let got = read_to_close(&mut stranger, Duration::from_secs(10));
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("runs none of them"), "{text}");
    let after = server.stats();
    assert_eq!(after.connections_rejected, before.connections_rejected + 1);
    on_all(&group, |ex| {
        ex.all_gather(ChannelId::CONTROL, "after", &[1], Deadline::after(LONG))
            .unwrap()
    });
    drop_group(group);
}

/// A store of its own (`SYMMPOOL_STORE_EXTERNAL`) is done once every rank joined and
/// left; a job that never assembles ends its wait at the ranks' start-up timeout, not
/// at the (far) deadline.
#[test]
fn an_external_store_is_done_when_its_ranks_left_or_never_came() {
    let mut cfg = store_config(0, 2, 0);
    cfg.startup_timeout = Duration::from_millis(300);
    let lonely = StoreServer::bind("127.0.0.1:0", &cfg).unwrap();
    let started = Instant::now();
    let end = lonely.wait_until_done(Deadline::after(Duration::from_secs(60)));
    assert_eq!(end, JobEnd::NotAssembled);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    drop(lonely);

    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, 2, 0)).unwrap();
    let port = server.local_addr().port();
    let ranks: Vec<StoreExchange> = thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| s.spawn(move || StoreExchange::connect(store_config(r, 2, port))))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    // Joined, not gone: not done yet.
    let end = server.wait_until_done(Deadline::after(Duration::from_millis(100)));
    assert_eq!(end, JobEnd::Deadline);
    drop(ranks);
    let end = server.wait_until_done(Deadline::after(Duration::from_secs(30)));
    assert_eq!(end, JobEnd::Ended);
    assert_eq!(server.stats().ranks_departed, 2);
}

// ---------------------------------------------------------------------------------
// Growing the group back: a newcomer (`SYMMPOOL_JOIN=1`) takes a lost job rank's
// place when the survivors grow the group. Ranks are threads, rank 0 hosting the store.

use common::round::round;
use std::borrow::Borrow;
use std::collections::HashMap;
use std::sync::Arc;
use symmpool::control::ServerStats;

/// The settings of the ranks of a growing group: heartbeats every 200 ms, a rank
/// silent for 2 s lost.
fn growing_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = store_config(rank, world, port);
    c.heartbeat_timeout = Duration::from_secs(2);
    c
}

/// A newcomer for job rank `rank` of `world`, started as a launcher starts it: the
/// job's variables (those of [`growing_config`]), `RANK` and `SYMMPOOL_JOIN=1`, and
/// `extra` over them; its exchange once a grow took it in.
fn newcomer(
    rank: usize,
    world: usize,
    port: u16,
    extra: &[(&str, &str)],
) -> symmpool::Result<StoreExchange> {
    let (rank, world, port) = (rank.to_string(), world.to_string(), port.to_string());
    let vars: HashMap<&str, &str> = [
        ("RANK", rank.as_str()),
        ("WORLD_SIZE", &world),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", &port),
        ("SYMMPOOL_TOKEN", "contract"),
        ("SYMMPOOL_JOIN", "1"),
        ("SYMMPOOL_HEARTBEAT_INTERVAL_MS", "200"),
        ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "2000"),
        ("SYMMPOOL_STARTUP_TIMEOUT_MS", "30000"),
    ]
    .into_iter()
    .chain(extra.iter().copied())
    .collect();
    StoreExchange::connect(StoreConfig::from_vars(&|k| {
        vars.get(k).map(|v| v.to_string())
    })?)
}

/// `world` ranks of `config`, job rank `lost`'s exchange dropped, the others shrunk
/// past it: the old exchanges (rank 0, hosting, first), the shrunk ones, the port.
fn shrunk_past(
    world: usize,
    lost: usize,
    config: fn(usize, usize, u16) -> StoreConfig,
) -> (Vec<StoreExchange>, Vec<Arc<StoreExchange>>, u16) {
    let mut group = store_group_with(world, config);
    let port = group[0].server().unwrap().local_addr().port();
    drop(group.remove(lost));
    for out in on_all(&group, |x| round(x, 1)) {
        assert!(
            matches!(out, Err(Error::PeerLost { rank, .. }) if rank == lost),
            "{out:?}"
        );
    }
    let shrunk = on_all(&group, |x| x.shrink(Deadline::after(LONG)).unwrap());
    assert!(shrunk.iter().all(|x| x.world_size() == world - 1));
    (group, shrunk, port)
}

/// Every rank's round on the control channel (its payload its rank) gathers every
/// rank's, in rank order.
fn rounds_pair<E: Sync + Borrow<StoreExchange>>(group: &[E]) {
    let all: Vec<Vec<u8>> = (0..group.len() as u8).map(|r| vec![r]).collect();
    for out in on_all(group, |x| {
        let x: &StoreExchange = x.borrow();
        round(x, x.rank() as u8)
    }) {
        assert_eq!(out.unwrap(), all);
    }
}

fn stats(group: &[StoreExchange]) -> ServerStats {
    group[0].server().unwrap().stats()
}

#[test]
fn a_lost_rank_is_replaced_by_a_newcomer_and_the_group_grows_back_to_four() {
    let mut group = store_group_with(4, growing_config);
    let port = group[0].server().unwrap().local_addr().port();
    drop(group.remove(2));
    thread::scope(|s| {
        // Started the moment the old process is gone, as a launcher would: before
        // the survivors shrank past it (it retries until they have).
        let joining = s.spawn(|| newcomer(2, 4, port, &[]));
        for out in on_all(&group, |x| round(x, 1)) {
            assert!(
                matches!(out, Err(Error::PeerLost { rank: 2, .. })),
                "{out:?}"
            );
        }
        let shrunk = on_all(&group, |x| x.shrink(Deadline::after(LONG)).unwrap());
        let ranks: Vec<_> = shrunk.iter().map(|x| (x.rank(), x.world_size())).collect();
        assert_eq!(ranks, [(0, 3), (1, 3), (2, 3)]);
        // The newcomer waits longer than the heartbeat timeout: it is not lost.
        thread::sleep(Duration::from_secs(3));
        let grown = on_all(&shrunk, |x| {
            x.grow(true, Deadline::after(LONG)).unwrap().unwrap()
        });
        let joined = joining.join().unwrap().unwrap();
        // The newcomer takes job rank 2's place: ranks in the order of the job ranks.
        let ranks: Vec<_> = grown.iter().map(|x| (x.rank(), x.world_size())).collect();
        assert_eq!(ranks, [(0, 4), (1, 4), (3, 4)]);
        assert_eq!((joined.rank(), joined.world_size()), (2, 4));
        // Only the newcomer's exchange says so (its backends join the group's).
        assert!(joined.is_newcomer());
        assert!(!grown.iter().chain(&shrunk).any(|x| x.is_newcomer()));
        let mut all: Vec<&StoreExchange> = grown.iter().map(|x| &**x).collect();
        all.insert(2, &joined);
        rounds_pair(&all);
        let opened = on_all(&all, |x| x.open_channel("grown", Deadline::after(LONG)));
        assert!(opened.iter().all(|c| c.as_ref().unwrap().ordinal() == 1));
        // Asked again: the same exchange; the shrunk one is replaced.
        let again = shrunk[1]
            .grow(false, Deadline::after(LONG))
            .unwrap()
            .unwrap();
        assert!(Arc::ptr_eq(&again, &grown[1]));
        assert!(matches!(round(&*shrunk[0], 0), Err(Error::Shrunk { .. })));
        assert_eq!(stats(&group).newcomers_joined, 1);
        drop(joined);
    });
    drop_group(group);
}

#[test]
fn growing_without_a_newcomer_is_none_on_every_rank_and_the_group_goes_on() {
    let group = store_group(3);
    // One rank does not wait: no newcomer, none on every rank at once.
    let out = on_all(&group, |x| x.grow(x.rank() != 1, Deadline::after(LONG)));
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    rounds_pair(&group);
    // All waiting, none comes: the first deadline ends the wait, none everywhere.
    let started = Instant::now();
    let out = on_all(&group, |x| {
        let wait = Duration::from_millis(300 + 100 * x.rank() as u64);
        x.grow(true, Deadline::after(wait))
    });
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    rounds_pair(&group);
    assert_eq!(stats(&group).newcomers_joined, 0);
    drop_group(group);
}

#[test]
fn a_newcomer_of_another_job_or_token_is_refused_and_the_survivors_go_on() {
    fn config(rank: usize, world: usize, port: u16) -> StoreConfig {
        let mut c = growing_config(rank, world, port);
        c.job_id = Some("job-x".into());
        c
    }
    let (group, shrunk, port) = shrunk_past(3, 2, config);
    match newcomer(2, 3, port, &[("SYMMPOOL_JOB_ID", "job-y")]) {
        Err(Error::JobMismatch { job, store_job }) => {
            assert_eq!((job.as_str(), store_job.as_str()), ("job-y", "job-x"));
        }
        other => panic!("{other:?}"),
    }
    let wrong_token = [("SYMMPOOL_JOB_ID", "job-x"), ("SYMMPOOL_TOKEN", "wrong")];
    match newcomer(2, 3, port, &wrong_token) {
        Err(Error::StoreRejected { reason }) => assert!(reason.contains("token"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let out = on_all(&shrunk, |x| x.grow(false, Deadline::after(LONG)));
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    rounds_pair(&shrunk);
    drop(shrunk);
    drop_group(group);
}

#[test]
fn a_newcomer_for_a_job_rank_still_in_the_group_is_refused() {
    let mut group = store_group_with(3, growing_config);
    let port = group[0].server().unwrap().local_addr().port();
    // Held by a live rank: refused at once, naming both processes.
    match newcomer(1, 3, port, &[]) {
        Err(Error::RankTaken { rank: 1, .. }) => {}
        other => panic!("{other:?}"),
    }
    // Lost, but the survivors have not shrunk past it: the newcomer retries until
    // its start-up timeout, then says why.
    drop(group.remove(2));
    let started = Instant::now();
    match newcomer(2, 3, port, &[("SYMMPOOL_STARTUP_TIMEOUT_MS", "500")]) {
        Err(Error::StoreRejected { reason }) => {
            assert!(reason.contains("still in the group"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    for out in on_all(&group, |x| round(x, 1)) {
        assert!(
            matches!(out, Err(Error::PeerLost { rank: 2, .. })),
            "{out:?}"
        );
    }
    drop_group(group);
}

/// A newcomer's hello (`joining`), as [`hello`] encodes one.
fn joining_hello(token: &[u8], rank: u8, world: u8) -> Vec<u8> {
    let mut f = hello(token, rank, world);
    *f.last_mut().unwrap() = 1;
    f
}

#[test]
fn a_newcomer_that_dies_while_waiting_is_forgotten_and_another_takes_its_place() {
    let (group, shrunk, port) = shrunk_past(3, 2, growing_config);
    let departed = stats(&group).ranks_departed;
    {
        // A newcomer admitted (the store's preface and welcome read), then gone.
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        let mut msg = preface(VERSION);
        msg.extend(joining_hello(b"contract", 2, 3));
        s.write_all(&msg).unwrap();
        let mut welcome = [0u8; 12 + 5];
        s.read_exact(&mut welcome).unwrap();
        assert_eq!(welcome[..12], preface(VERSION)[..]);
    }
    // Wait (bounded) until the store has seen it go.
    let by = Instant::now() + LONG;
    while stats(&group).ranks_departed == departed {
        assert!(Instant::now() < by, "the store never saw the newcomer go");
        thread::sleep(Duration::from_millis(10));
    }
    // No newcomer waits, and the group is whole.
    let out = on_all(&shrunk, |x| x.grow(false, Deadline::after(LONG)));
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    rounds_pair(&shrunk);
    // Another newcomer takes job rank 2.
    thread::scope(|s| {
        let joining = s.spawn(|| newcomer(2, 3, port, &[]));
        let grown = on_all(&shrunk, |x| {
            x.grow(true, Deadline::after(LONG)).unwrap().unwrap()
        });
        let joined = joining.join().unwrap().unwrap();
        assert_eq!((joined.rank(), joined.world_size()), (2, 3));
        let mut all: Vec<&StoreExchange> = grown.iter().map(|x| &**x).collect();
        all.push(&joined);
        rounds_pair(&all);
        drop(joined);
    });
    drop(shrunk);
    drop_group(group);
}

#[test]
fn a_rank_lost_while_the_others_ask_to_grow_is_peer_lost_and_they_shrink_past_it() {
    let mut group = store_group_with(4, growing_config);
    let last = group.remove(3);
    let out = thread::scope(|s| {
        let hs: Vec<_> = (group.iter())
            .map(|x| s.spawn(move || x.grow(true, Deadline::after(LONG)).map(|g| g.is_some())))
            .collect();
        drop(last);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for o in out {
        assert!(matches!(o, Err(Error::PeerLost { rank: 3, .. })), "{o:?}");
    }
    let shrunk = on_all(&group, |x| x.shrink(Deadline::after(LONG)).unwrap());
    assert!(shrunk.iter().all(|x| x.world_size() == 3));
    rounds_pair(&shrunk);
    drop(shrunk);
    drop_group(group);
}

#[test]
fn an_ask_to_grow_that_a_rank_never_makes_times_out_naming_it() {
    let group = store_group(3);
    let out = on_all(&group[..2], |x| {
        x.grow(false, Deadline::after(Duration::from_millis(300)))
    });
    for o in out {
        match o {
            Err(Error::Timeout {
                op: "grow",
                missing_ranks,
                ..
            }) => {
                assert!(missing_ranks.contains(&2), "{missing_ranks:?}");
            }
            other => panic!("{other:?}"),
        }
    }
    // Withdrawn: nothing is pending, and the group goes on.
    rounds_pair(&group);
    let out = on_all(&group, |x| x.grow(false, Deadline::after(LONG)));
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    drop_group(group);
}

#[test]
fn a_newcomer_that_no_grow_takes_in_times_out_and_is_forgotten() {
    let (group, shrunk, port) = shrunk_past(3, 2, growing_config);
    let started = Instant::now();
    match newcomer(2, 3, port, &[("SYMMPOOL_STARTUP_TIMEOUT_MS", "500")]) {
        Err(Error::Timeout { op, .. }) => {
            assert!(op.starts_with("join") && op.contains("never grew"), "{op}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10));
    let out = on_all(&shrunk, |x| x.grow(false, Deadline::after(LONG)));
    assert!(out.iter().all(|o| matches!(o, Ok(None))), "{out:?}");
    rounds_pair(&shrunk);
    drop(shrunk);
    drop_group(group);
}
