//! A careless (or hostile) user of the heal (`SymmPool::grow` / `SymmPool::join`):
//! newcomers of another job, for a rank still alive or out of range, two for one lost
//! rank, one started before the survivors shrank; a newcomer or a survivor killed
//! (`kill -9`) or frozen (SIGSTOP) at each phase of the grow (processes on the
//! shared-memory backend); ranks that disagree about the grow (some ask, some wait,
//! pools that differ, a newcomer's pools that differ or number more or fewer, pools
//! of one group regrouped differently); garbage on the store's port and the store lost
//! while a grow is pending; the old pool's buffers and the memory accounting after a
//! grow. Every attack ends in a clear error on every rank, or a consistent success,
//! within the documented timeouts, with nothing left in `/dev/shm`.

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};
use symmpool::control::{Launch, StoreConfig, StoreExchange, StoreServer};
use symmpool::{Deadline, Error, Exchange};

mod common;

/// Where every wait should succeed: no wait of a test comes near it.
const TIMEOUT: Duration = Duration::from_secs(30);
const TOKEN: &str = "grow-attack";
const JOB: &str = "grow-attack-job";

/// `f` on every item's thread; the results in order.
fn on_each<E: Sync, R: Send>(items: &[E], f: impl Fn(&E) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = items.iter().map(|x| s.spawn(|| f(x))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

// ---------------------------------------------------------------------------------
// The store's admission of newcomers: ranks as threads with exchanges of their own,
// the store in the test's process (outside the ranks).

/// Job rank `rank` of `world`, the store at `port` outside the ranks.
fn store_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = StoreConfig::new(Launch::explicit(rank, world, "127.0.0.1", port).unwrap());
    c.host_server = false;
    c.token = Some(TOKEN.into());
    c.job_id = Some(JOB.into());
    c.startup_timeout = TIMEOUT;
    c.heartbeat_interval = Duration::from_millis(100);
    c.heartbeat_timeout = Duration::from_millis(1000);
    c
}

/// A newcomer's settings: `store_config` with `join`.
fn newcomer_config(rank: usize, world: usize, port: u16) -> StoreConfig {
    let mut c = store_config(rank, world, port);
    c.join = true;
    c
}

/// A store for `world` ranks on a free port, and every rank's exchange.
fn store_group(world: usize) -> (StoreServer, Vec<StoreExchange>) {
    let server = StoreServer::bind("127.0.0.1:0", &store_config(0, world, 0)).unwrap();
    let port = server.local_addr().port();
    let ranks: Vec<usize> = (0..world).collect();
    let group = on_each(&ranks, |&r| {
        StoreExchange::connect(store_config(r, world, port)).unwrap()
    });
    (server, group)
}

/// Job rank `lost` of `group` leaves (closes its exchange); the others shrink past it.
fn lose_and_shrink(mut group: Vec<StoreExchange>, lost: usize) -> Vec<Arc<StoreExchange>> {
    if lost < group.len() {
        drop(group.remove(lost));
    }
    let deadline = Deadline::after(TIMEOUT);
    on_each(&group, |x| {
        loop {
            match x.shrink(deadline) {
                Err(Error::ShrinkFailed { retry: true, .. }) => {}
                other => break other.unwrap(),
            }
        }
    })
}

/// The newcomer's `connect` in `config`, with how long it took.
fn connect_timed(config: StoreConfig) -> (symmpool::Result<StoreExchange>, Duration) {
    let started = Instant::now();
    let r = StoreExchange::connect(config);
    (r, started.elapsed())
}

#[test]
fn newcomers_of_another_job_token_world_or_for_a_rank_out_of_range_are_refused_at_once() {
    let world = 3;
    let (server, group) = store_group(world);
    let port = server.local_addr().port();
    let survivors = lose_and_shrink(group, 2);
    let mut other_job = newcomer_config(2, world, port);
    other_job.job_id = Some("another-job".into());
    let mut other_token = newcomer_config(2, world, port);
    other_token.token = Some("wrong".into());
    let other_world = newcomer_config(2, world + 1, port);
    let out_of_range = {
        let mut c = newcomer_config(0, world, port);
        c.launch = Launch::explicit(0, world, "127.0.0.1", port).unwrap();
        // Launch refuses a rank >= world: the hello carries what the launcher says.
        c.launch.rank = world;
        c
    };
    let attempts = [
        ("job", other_job),
        ("token", other_token),
        ("world", other_world),
        ("range", out_of_range),
    ];
    for (what, config) in attempts {
        let (r, took) = connect_timed(config);
        let e = r.map(|_| ()).unwrap_err();
        println!("{what}: {e} ({took:?})");
        match what {
            "job" => assert!(matches!(e, Error::JobMismatch { .. }), "{e:?}"),
            _ => assert!(matches!(e, Error::StoreRejected { .. }), "{what}: {e:?}"),
        }
        assert!(took < Duration::from_secs(2), "{what}: {took:?}");
    }
    // The group never saw them: a grow finds no newcomer.
    let deadline = Deadline::after(TIMEOUT);
    for g in on_each(&survivors, |x| x.grow(false, deadline).map(|g| g.is_none())) {
        assert!(g.unwrap());
    }
}

#[test]
fn a_newcomer_for_a_rank_still_alive_is_refused_at_once_naming_the_holder() {
    let world = 3;
    let (server, group) = store_group(world);
    let port = server.local_addr().port();
    // Before any loss, and after rank 2's loss for rank 1, which lives on.
    let (r, took) = connect_timed(newcomer_config(1, world, port));
    let e = r.map(|_| ()).unwrap_err();
    assert!(matches!(e, Error::RankTaken { rank: 1, .. }), "{e:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    let survivors = lose_and_shrink(group, 2);
    let (r, took) = connect_timed(newcomer_config(1, world, port));
    let e = r.map(|_| ()).unwrap_err();
    println!("{e} ({took:?})");
    assert!(matches!(e, Error::RankTaken { rank: 1, .. }), "{e:?}");
    assert!(took < Duration::from_secs(2), "{took:?}");
    let deadline = Deadline::after(TIMEOUT);
    for g in on_each(&survivors, |x| x.grow(false, deadline).map(|g| g.is_none())) {
        assert!(g.unwrap());
    }
}

#[test]
fn two_newcomers_for_one_lost_rank_one_joins_the_other_is_refused_at_once() {
    let world = 3;
    let (server, group) = store_group(world);
    let port = server.local_addr().port();
    let survivors = lose_and_shrink(group, 2);
    let configs = [
        newcomer_config(2, world, port),
        newcomer_config(2, world, port),
    ];
    let (newcomers, grown) = thread::scope(|s| {
        let hs: Vec<_> = (configs.iter())
            .map(|c| s.spawn(|| connect_timed(c.clone())))
            .collect();
        let deadline = Deadline::after(TIMEOUT);
        let grown = on_each(&survivors, |x| x.grow(true, deadline).unwrap().unwrap());
        let n: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        (n, grown)
    });
    assert!(grown.iter().all(|x| x.world_size() == 3));
    let (mut joined, mut refused) = (0, 0);
    for (r, took) in newcomers {
        match r {
            Ok(x) => {
                assert_eq!((x.rank(), x.world_size()), (2, 3));
                joined += 1;
            }
            Err(Error::RankTaken { rank: 2, .. }) => {
                assert!(took < Duration::from_secs(2), "{took:?}");
                refused += 1;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
    assert_eq!((joined, refused), (1, 1));
}

#[test]
fn a_newcomer_started_before_the_survivors_shrank_waits_and_joins_the_grow() {
    let world = 3;
    let (server, mut group) = store_group(world);
    let port = server.local_addr().port();
    drop(group.remove(2));
    // The launcher restarts the lost rank at once: the survivors have not shrunk yet.
    let (joined, grown) = thread::scope(|s| {
        let newcomer = s.spawn(|| connect_timed(newcomer_config(2, world, port)));
        thread::sleep(Duration::from_millis(500));
        let deadline = Deadline::after(TIMEOUT);
        let shrunk = on_each(&group, |x| x.shrink(deadline).unwrap());
        let grown = on_each(&shrunk, |x| x.grow(true, deadline).unwrap().unwrap());
        (newcomer.join().unwrap(), grown)
    });
    let (x, took) = joined;
    let x = x.unwrap();
    assert_eq!((x.rank(), x.world_size()), (2, 3));
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(grown.iter().all(|x| x.world_size() == 3));
    println!("stats: {:?}", server.stats());
}

#[test]
fn a_newcomer_whose_rank_the_survivors_never_shrink_past_gives_up_at_its_startup_timeout() {
    let world = 3;
    let (server, mut group) = store_group(world);
    let port = server.local_addr().port();
    drop(group.remove(2));
    let mut c = newcomer_config(2, world, port);
    c.startup_timeout = Duration::from_secs(2);
    let (r, took) = connect_timed(c);
    let e = r.map(|_| ()).unwrap_err();
    println!("{e} ({took:?})");
    assert!(matches!(e, Error::StoreRejected { .. }), "{e:?}");
    assert!(took < Duration::from_secs(4), "{took:?}");
    // Shrunk past, never grown: a timeout naming the join.
    let survivors = lose_and_shrink(group, 99);
    let mut c = newcomer_config(2, world, port);
    c.startup_timeout = Duration::from_secs(2);
    let (r, took) = connect_timed(c);
    let e = r.map(|_| ()).unwrap_err();
    println!("{e} ({took:?})");
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(took < Duration::from_secs(4), "{took:?}");
    // It was forgotten: a grow finds no newcomer.
    let deadline = Deadline::after(TIMEOUT);
    for g in on_each(&survivors, |x| x.grow(false, deadline).map(|g| g.is_none())) {
        assert!(g.unwrap());
    }
}

#[test]
fn every_rank_waiting_for_a_newcomer_that_never_comes_gets_none_at_the_first_deadline() {
    let (_server, group) = store_group(3);
    let survivors = lose_and_shrink(group, 2);
    let started = Instant::now();
    // Deadlines a second apart: the first to pass ends the wait of every rank.
    let out = on_each(&[0, 1], |&r| {
        let deadline = Deadline::after(Duration::from_millis(1000 + 1000 * r as u64));
        let g = survivors[r].grow(true, deadline).map(|g| g.is_none());
        (g, started.elapsed())
    });
    for (g, took) in out {
        assert!(matches!(g, Ok(true)), "{g:?}");
        assert!(took < Duration::from_millis(1900), "{took:?}");
    }
}

#[test]
fn garbage_on_the_stores_port_while_the_ranks_wait_to_grow_changes_nothing() {
    use std::io::Read;
    let world = 3;
    let (server, group) = store_group(world);
    let port = server.local_addr().port();
    let survivors = lose_and_shrink(group, 2);
    let deadline = Deadline::after(TIMEOUT);
    let (grown, joined) = thread::scope(|s| {
        let growing = s.spawn(|| on_each(&survivors, |x| x.grow(true, deadline)));
        // Raw bytes, a wrong preface, a half preface, the protocol's magic then noise.
        for junk in [
            &b"GET / HTTP/1.1\r\n\r\n"[..],
            &[0u8; 64][..],
            &b"SYMMPOOL"[..],
            &b"SYMMPOOL\x09\x00\x00\x00\xff\xff\xff\xff garbage"[..],
        ] {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let _ = c.write_all(junk);
            let _ = c.shutdown(std::net::Shutdown::Write);
            let mut answer = Vec::new();
            let _ = c.read_to_end(&mut answer);
        }
        // A hostile newcomer (another token) for the lost rank, then the real one.
        let mut hostile = newcomer_config(2, world, port);
        hostile.token = Some("guess".into());
        let e = StoreExchange::connect(hostile).map(|_| ()).unwrap_err();
        assert!(matches!(e, Error::StoreRejected { .. }), "{e:?}");
        let joined = StoreExchange::connect(newcomer_config(2, world, port));
        (growing.join().unwrap(), joined)
    });
    let joined = joined.unwrap();
    assert_eq!((joined.rank(), joined.world_size()), (2, 3));
    for g in grown {
        assert_eq!(g.unwrap().unwrap().world_size(), 3);
    }
    let stats = server.stats();
    assert!(stats.connections_rejected >= 5, "{stats:?}");
    assert_eq!(stats.newcomers_joined, 1, "{stats:?}");
}

#[test]
fn the_store_lost_while_ranks_wait_to_grow_or_a_newcomer_waits_ends_every_wait_at_once() {
    let world = 3;
    // The ranks wait for a newcomer.
    let (server, group) = store_group(world);
    let survivors = lose_and_shrink(group, 2);
    let deadline = Deadline::after(TIMEOUT);
    let (grown, took) = thread::scope(|s| {
        let growing = s.spawn(|| on_each(&survivors, |x| x.grow(true, deadline).map(|_| ())));
        thread::sleep(Duration::from_millis(300));
        let killed = Instant::now();
        drop(server);
        (growing.join().unwrap(), killed.elapsed())
    });
    for g in grown {
        let e = g.unwrap_err();
        println!("a rank: {e} ({took:?})");
        assert_eq!(e.kind(), ErrorKind::PeerLost, "{e:?}");
    }
    assert!(took < Duration::from_secs(2), "{took:?}");
    // A newcomer waits for the ranks to grow.
    let (server, group) = store_group(world);
    let port = server.local_addr().port();
    let survivors = lose_and_shrink(group, 2);
    let (joined, took) = thread::scope(|s| {
        let joining = s.spawn(|| StoreExchange::connect(newcomer_config(2, world, port)));
        thread::sleep(Duration::from_millis(300));
        let killed = Instant::now();
        drop(server);
        (joining.join().unwrap(), killed.elapsed())
    });
    let e = joined.map(|_| ()).unwrap_err();
    println!("the newcomer: {e} ({took:?})");
    assert!(took < Duration::from_secs(2), "{took:?}");
    drop(survivors);
}

// ---------------------------------------------------------------------------------
// Processes on the shared-memory backend, the store in the test's process: a newcomer
// or a survivor killed (`kill -9`), frozen (SIGSTOP) or slow at each phase of the heal.

use common::procs::{CHILD, HEARTBEAT_TIMEOUT_MS, Job};
use common::shm::shm_entries;
use std::io::{BufRead, Write};
use symmpool::control::{ChannelId, LostPeer};
use symmpool::{
    Coll, CollectiveCalls, ErrorKind, Group, GroupConfig, PoolConfig, ReduceOp, ShmBackend,
    ShmConfig, Stream, SymmPool,
};

const ENTRY: &str = "grow_attack_child";
/// The processes' group timeout: every answer comes well before it.
const PROCESS_TIMEOUT: Duration = Duration::from_secs(20);

/// An exchange that stops this process at a phase of the heal (`CHILD_STALL`): it
/// prints `@@stalled PHASE` and waits for a line on its standard input (the test
/// kills it, freezes it, or lets it go on); the exchanges it grows or shrinks into
/// are watched too.
struct Stall {
    inner: Arc<dyn Exchange>,
    phase: Option<String>,
}

impl Stall {
    fn wrap(inner: Arc<dyn Exchange>) -> Arc<dyn Exchange> {
        Arc::new(Stall {
            inner,
            phase: std::env::var("CHILD_STALL").ok(),
        })
    }

    fn at(&self, what: &str) {
        stall_at(self.phase.as_deref(), what);
    }
}

/// Whether the stall is armed: on a newcomer from its start, on a survivor once it
/// goes on to grow; once only.
static ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Stop here if `what` is the `phase` to stop at (the first time only, once armed).
fn stall_at(phase: Option<&str>, what: &str) {
    if std::env::var_os("CHILD_TRACE").is_some() {
        println!("@@trace {what}");
    }
    if phase == Some(what) && ARMED.swap(false, std::sync::atomic::Ordering::SeqCst) {
        stall(what);
    }
}

/// Print `@@stalled WHAT` and wait for a line on standard input.
fn stall(what: &str) {
    println!("@@stalled {what}");
    let _ = std::io::stdout().flush();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    println!("@@resumed {what}");
}

impl std::fmt::Debug for Stall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stall").field("inner", &self.inner).finish()
    }
}

impl Exchange for Stall {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_gather(
        &self,
        channel: ChannelId,
        op: &'static str,
        payload: &[u8],
        deadline: Deadline,
    ) -> symmpool::Result<Vec<Vec<u8>>> {
        self.at(&format!("round:{op}"));
        self.inner.all_gather(channel, op, payload, deadline)
    }
    fn open_channel(&self, name: &str, deadline: Deadline) -> symmpool::Result<ChannelId> {
        self.at(&format!("open:{name}"));
        self.inner.open_channel(name, deadline)
    }
    fn lost_peer(&self) -> Option<LostPeer> {
        self.inner.lost_peer()
    }
    fn abandon(&self, channel: ChannelId) {
        self.inner.abandon(channel)
    }
    fn shrink(&self, deadline: Deadline) -> symmpool::Result<Arc<dyn Exchange>> {
        let next = self.inner.shrink(deadline)?;
        Ok(Arc::new(Stall {
            inner: next,
            phase: self.phase.clone(),
        }))
    }
    fn is_newcomer(&self) -> bool {
        self.inner.is_newcomer()
    }
    fn grow(&self, wait: bool, deadline: Deadline) -> symmpool::Result<Option<Arc<dyn Exchange>>> {
        self.at("ask:grow");
        let next = self.inner.grow(wait, deadline)?;
        Ok(next.map(|inner| {
            Arc::new(Stall {
                inner,
                phase: self.phase.clone(),
            }) as Arc<dyn Exchange>
        }))
    }
}

#[test]
fn grow_attack_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(()) => 0,
        Err(e) => {
            println!("@@error {:?} {e}", e.kind());
            2
        }
    };
    std::process::exit(code);
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// Every rank's `rank + 1` summed over the pool's ranks, in a fresh buffer.
fn sum_of_ranks(pool: &SymmPool, coll: &Coll) -> symmpool::Result<f32> {
    let stream = Stream::host();
    let b = pool.alloc(1024, &stream)?;
    b.write(&vec![(pool.rank() + 1) as f32; 256])?;
    coll.tagged(0)
        .all_reduce_in_place::<f32>(&b, ReduceOp::Sum, &stream)?;
    Ok(b.read::<f32>()?[0])
}

fn shrink_retrying(pool: &SymmPool) -> symmpool::Result<SymmPool> {
    loop {
        match pool.shrink() {
            Err(Error::ShrinkFailed { retry: true, .. }) => {}
            other => return other.map(|(p, _)| p),
        }
    }
}

/// A rank of the job. Job rank `CHILD_VICTIM` exits after the first step; the
/// survivors shrink, say `@@ready`, wait for a line on standard input, then grow
/// (`@@answer` for each attempt; after a loss they shrink and ask again, until an
/// attempt grows or returns `None`). A newcomer joins. Every rank ends with a step at
/// its world size (`@@final`) and closes its pool.
fn child() -> symmpool::Result<()> {
    let config = StoreConfig::from_env()?;
    let newcomer = config.join;
    let timeout = var("CHILD_TIMEOUT_MS").map_or(PROCESS_TIMEOUT, |ms| {
        Duration::from_millis(ms.parse().unwrap())
    });
    if newcomer {
        ARMED.store(true, std::sync::atomic::Ordering::SeqCst);
        println!("@@connecting");
    }
    let exchange = Stall::wrap(Arc::new(StoreExchange::connect(config)?));
    if newcomer {
        println!("@@admitted rank={}", exchange.rank());
        stall_at(var("CHILD_STALL").as_deref(), "admitted");
    }
    let backend = ShmBackend::join(exchange, ShmConfig::default())?;
    let group = Group::new(backend, GroupConfig::default().with_timeout(timeout))?;
    let pool_config = PoolConfig::default();
    let started = Instant::now();
    let pool = if newcomer {
        let joined = SymmPool::join(&group, pool_config);
        let ms = started.elapsed().as_millis();
        match &joined {
            Ok((_, r)) => println!(
                "@@answer Ok rank={} world={} took={ms}",
                r.rank, r.world_size
            ),
            Err(e) => println!("@@answer Err {:?} {e} took={ms}", e.kind()),
        }
        joined?.0
    } else {
        let pool = SymmPool::new(&group, pool_config)?;
        let coll = Coll::new(&pool)?;
        sum_of_ranks(&pool, &coll)?;
        if var("CHILD_VICTIM").and_then(|v| v.parse().ok()) == Some(pool.rank()) {
            println!("@@leaving");
            std::process::exit(0);
        }
        let lost = sum_of_ranks(&pool, &coll).unwrap_err();
        assert_eq!(lost.kind(), ErrorKind::PeerLost, "{lost}");
        drop(coll);
        let mut pool = shrink_retrying(&pool)?;
        println!("@@ready world={}", pool.world_size());
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).unwrap();
        let wait = line.trim() != "nowait";
        ARMED.store(true, std::sync::atomic::Ordering::SeqCst);
        loop {
            let started = Instant::now();
            let grown = pool.grow(wait);
            let ms = started.elapsed().as_millis();
            match grown {
                Ok(Some((next, r))) => {
                    println!(
                        "@@answer Ok world={} newcomers={:?} took={ms}",
                        r.world_size, r.newcomers
                    );
                    pool = next;
                    break;
                }
                Ok(None) => {
                    println!("@@answer None took={ms}");
                    break;
                }
                Err(e) if e.kind() == ErrorKind::PeerLost => {
                    println!("@@answer Err {:?} {e} took={ms}", e.kind());
                    pool = shrink_retrying(&pool)?;
                }
                Err(e) => {
                    println!("@@answer Err {:?} {e} took={ms}", e.kind());
                    return Err(e);
                }
            }
        }
        pool
    };
    let coll = Coll::new(&pool)?;
    let sum = sum_of_ranks(&pool, &coll)?;
    println!("@@final world={} sum={sum}", pool.world_size());
    drop(coll);
    pool.close()
}

/// A job of `world` processes (job rank `world - 1` leaves after its first step) with
/// the store in this process; once the survivors are ready to grow.
struct Heal {
    job: Job,
    server: StoreServer,
    world: usize,
    /// `/dev/shm` before the job.
    before: Vec<String>,
}

impl Heal {
    fn start(world: usize, env: impl Fn(usize) -> Vec<(&'static str, String)>) -> Heal {
        let before = shm_entries();
        let mut c = StoreConfig::new(Launch::explicit(0, world, "127.0.0.1", 0).unwrap());
        c.token = Some("job-token".into());
        c.heartbeat_interval = Duration::from_millis(common::procs::HEARTBEAT_MS);
        c.heartbeat_timeout = Duration::from_millis(HEARTBEAT_TIMEOUT_MS);
        c.startup_timeout = Duration::from_secs(60);
        let server = StoreServer::bind("127.0.0.1:0", &c).unwrap();
        let port = server.local_addr().port();
        let victim = world - 1;
        let mut job = Job::start_on_port(ENTRY, world, port, |r| {
            let mut v = vec![
                ("CHILD_VICTIM", victim.to_string()),
                ("SYMMPOOL_STORE_EXTERNAL", "1".into()),
            ];
            v.extend(env(r));
            v
        });
        job.expect(victim, "@@leaving", Duration::from_secs(60));
        for r in 0..victim {
            let ready = job.expect(r, "@@ready ", Duration::from_secs(60));
            assert_eq!(ready, format!("world={victim}"));
        }
        Heal {
            job,
            server,
            world,
            before,
        }
    }

    /// Start a newcomer as job rank `world - 1`: its child number.
    fn newcomer(&mut self, extra: &[(&'static str, String)]) -> usize {
        let mut env = vec![
            ("SYMMPOOL_STORE_EXTERNAL", "1".to_string()),
            ("SYMMPOOL_JOIN", "1".to_string()),
        ];
        env.extend_from_slice(extra);
        self.job.spawn(self.world - 1, self.world, &env);
        self.job.children.len() - 1
    }

    /// Write `line` to child `c`'s standard input.
    fn tell(&mut self, c: usize, line: &str) {
        let stdin = self.job.children[c].stdin.as_mut().unwrap();
        stdin.write_all(format!("{line}\n").as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// The survivors (job ranks `0..world - 1`) go on to grow.
    fn grow(&mut self, line: &str) {
        for r in 0..self.world - 1 {
            self.tell(r, line);
        }
    }

    fn signal(&self, c: usize, signal: i32) {
        let pid = self.job.children[c].id() as i32;
        // SAFETY: a plain kill(2) of a child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    }

    /// Child `c`'s `@@answer`s, in order.
    fn answers(&self, c: usize) -> Vec<String> {
        (self.job.seen.iter())
            .filter(|(at, l)| *at == c && l.starts_with("@@answer "))
            .map(|(_, l)| l["@@answer ".len()..].to_string())
            .collect()
    }

    /// Wait for children `cs` to exit: their codes.
    fn wait(&mut self, cs: &[usize]) -> Vec<i32> {
        self.job.wait(cs, PROCESS_TIMEOUT * 2)
    }

    /// End the job; nothing left in `/dev/shm`, and the store saw every rank go.
    fn end(self) {
        let Heal {
            job,
            server,
            before,
            ..
        } = self;
        drop(job);
        assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
        let end = server.wait_until_done(Deadline::after(Duration::from_secs(10)));
        assert_eq!(end, symmpool::control::JobEnd::Ended);
    }
}

/// The milliseconds an `@@answer` line says it took.
fn took(answer: &str) -> u64 {
    answer.rsplit("took=").next().unwrap().parse().unwrap()
}

/// Who a process attack stops, and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// `kill -9`.
    Kill,
    /// SIGSTOP; SIGCONT and let go once the others are done.
    Stop,
}

/// What the processes of an attack said: each child's answers, final line and exit
/// code (`None`: killed by the test), by child number.
#[derive(Debug)]
struct Outcome {
    answers: Vec<Vec<String>>,
    finals: Vec<Option<String>>,
    errors: Vec<Option<String>>,
    codes: Vec<Option<i32>>,
}

/// A job of 3 (job rank 2 lost, the survivors shrunk to 2) whose heal is attacked:
/// `target` (`None`: the newcomer; `Some(r)`: survivor `r`) stopped at `phase` (as
/// `Stall` names them; `"waiting"`: the newcomer while it waits at the store) and
/// killed or frozen there. The survivors ask to grow again after a failed grow, and a
/// second newcomer replaces the first once it is gone.
fn attack(target: Option<usize>, phase: &'static str, act: Act) -> Outcome {
    let started = Instant::now();
    let mut heal = Heal::start(3, |r| match target {
        Some(t) if t == r => vec![("CHILD_STALL", phase.to_string())],
        _ => vec![],
    });
    let stall = |mine: bool| match mine && phase != "waiting" {
        true => vec![("CHILD_STALL", phase.to_string())],
        false => vec![],
    };
    let first = heal.newcomer(&stall(target.is_none()));
    let victim = target.unwrap_or(first);
    let mut stopped = None;
    if phase == "waiting" {
        heal.job
            .expect(first, "@@connecting", Duration::from_secs(30));
        // Long enough for its handshake: it waits at the store.
        thread::sleep(Duration::from_millis(500));
        match act {
            Act::Kill => heal.signal(first, libc::SIGKILL),
            Act::Stop => {
                heal.signal(first, libc::SIGSTOP);
                stopped = Some(first);
            }
        }
        // Killed: the store forgets it at once, and a grow finds no newcomer.
        thread::sleep(Duration::from_millis(300));
        heal.grow(if act == Act::Kill { "nowait" } else { "go" });
    } else {
        heal.grow("go");
        heal.job.expect(
            victim,
            &format!("@@stalled {phase}"),
            Duration::from_secs(30),
        );
        match act {
            Act::Kill => heal.signal(victim, libc::SIGKILL),
            Act::Stop => {
                heal.signal(victim, libc::SIGSTOP);
                stopped = Some(victim);
            }
        }
    }
    let attacked = Instant::now();
    let survivors: Vec<usize> = (0..2).filter(|r| Some(*r) != target).collect();
    // The survivors' first answer.
    let mut firsts = Vec::new();
    for &r in &survivors {
        let a = heal.job.expect(r, "@@answer ", Duration::from_secs(30));
        heal.job.seen.push((r, format!("@@answer {a}")));
        firsts.push(a);
    }
    println!(
        "{target:?} {phase} {act:?}: first answers {firsts:?} after {:?}",
        attacked.elapsed()
    );
    let mut children: Vec<usize> = survivors.clone();
    if firsts.iter().all(|a| a.starts_with("Err ")) {
        // The first newcomer is gone (killed, declared lost, or failed): a second one.
        if target.is_some() && phase != "ask:grow" {
            let code = heal.wait(&[first]);
            assert_eq!(code, [2], "{:?}", heal.job.seen);
        }
        if target.is_none() || phase != "ask:grow" {
            children.push(heal.newcomer(&[]));
        } else {
            children.push(first);
        }
    } else if target.is_some() || act == Act::Stop {
        children.push(first);
    }
    let codes = heal.wait(&children);
    if let Some(s) = stopped {
        // The frozen one, let go: it must end, with an error.
        heal.signal(s, libc::SIGCONT);
        heal.tell(s, "go");
        children.push(s);
        heal.wait(&[s]);
    }
    let n = heal.job.children.len();
    let line = |c: usize, prefix: &str| {
        (heal.job.seen.iter())
            .find(|(at, l)| *at == c && l.starts_with(prefix))
            .map(|(_, l)| l[prefix.len()..].to_string())
    };
    let outcome = Outcome {
        answers: (0..n).map(|c| heal.answers(c)).collect(),
        finals: (0..n).map(|c| line(c, "@@final ")).collect(),
        errors: (0..n).map(|c| line(c, "@@error ")).collect(),
        codes: (0..n)
            .map(|c| {
                let exited = heal.job.children[c].try_wait().unwrap();
                exited.and_then(|s| s.code())
            })
            .collect(),
    };
    println!(
        "{target:?} {phase} {act:?}: {outcome:?} in {:?}",
        started.elapsed()
    );
    assert!(codes.iter().all(|c| *c == 0), "{outcome:?}");
    heal.end();
    outcome
}

/// The ranks that went on agree on the world and the sum (`world` ranks), every other
/// process was killed or ended with a loss's error (`PeerLost`, or `GroupLost` on the
/// one the store declared lost), and the survivors' failed grows ended within the
/// failure-detection bound.
fn check(outcome: &Outcome, world: usize) {
    let want = format!("world={world} sum={}", world * (world + 1) / 2);
    let finals = outcome.finals.iter().flatten().collect::<Vec<_>>();
    assert_eq!(finals.len(), world, "{outcome:?}");
    assert!(finals.iter().all(|f| **f == want), "{outcome:?}");
    for c in 0..outcome.codes.len() {
        if outcome.finals[c].is_some() {
            assert_eq!(outcome.codes[c], Some(0), "{outcome:?}");
            continue;
        }
        match (&outcome.codes[c], &outcome.errors[c]) {
            (None, _) => {}
            // The lost rank of the first world.
            (Some(0), None) if c == 2 => {}
            (Some(2), Some(e)) if e.starts_with("PeerLost ") || e.starts_with("GroupLost ") => {}
            other => panic!("child {c}: {other:?} in {outcome:?}"),
        }
    }
    let bound = HEARTBEAT_TIMEOUT_MS + 1000;
    for answers in &outcome.answers[..2] {
        for a in answers.iter().filter(|a| a.starts_with("Err ")) {
            assert!(took(a) <= bound, "{a}: {outcome:?}");
        }
    }
}

#[test]
fn a_newcomer_killed_or_frozen_at_each_phase_is_a_loss_the_survivors_shrink_past_and_heal_again() {
    let phases = [
        "waiting",
        "admitted",
        "open:shm:comm1",
        "open:pool:pool",
        "round:grow",
        "round:window registration",
    ];
    for phase in phases {
        for act in [Act::Kill, Act::Stop] {
            let outcome = attack(None, phase, act);
            // Killed while it waited: forgotten, and a grow finds no newcomer.
            let none = phase == "waiting" && act == Act::Kill;
            check(&outcome, if none { 2 } else { 3 });
            for answers in &outcome.answers[..2] {
                match none {
                    true => assert!(answers[0].starts_with("None"), "{outcome:?}"),
                    false => assert!(answers[0].starts_with("Err PeerLost "), "{outcome:?}"),
                }
            }
        }
    }
}

#[test]
fn a_survivor_killed_or_frozen_during_the_grow_is_a_loss_the_others_shrink_past() {
    let phases = [
        (1, "ask:grow"),
        (0, "open:shm:comm1"),
        (1, "round:grow"),
        (0, "round:window registration"),
    ];
    for (rank, phase) in phases {
        for act in [Act::Kill, Act::Stop] {
            let outcome = attack(Some(rank), phase, act);
            check(&outcome, 2);
            let other = 1 - rank;
            let first = &outcome.answers[other][0];
            assert!(first.starts_with("Err PeerLost "), "{outcome:?}");
        }
    }
}

// ---------------------------------------------------------------------------------
// Ranks as threads of one host world: ranks that disagree about the grow, a newcomer
// whose pools differ from the survivors', the old pool's buffers after the grow.

use symmpool::{Backend, CoreConfig, HostBackend, HostConfig, SymmBuffer};

fn host_group(backend: Backend, timeout: Duration) -> symmpool::Result<Group> {
    Group::new(backend, GroupConfig::default().with_timeout(timeout))
}

/// A host world of `world` ranks whose last rank is lost once every rank ran
/// `before(rank, pool)` on a default pool; the survivors shrink, then run
/// `survivor(rank, pool, kept)` while a newcomer (started with the world, joining
/// when they grow) runs `newcomer(group)` on its group. Their results, the survivors'
/// in rank order, then the newcomer's.
fn host_heal<S: Send, N: Send>(
    world: usize,
    timeout: Duration,
    before: impl Fn(usize, &SymmPool) -> Vec<SymmBuffer> + Sync,
    survivor: impl Fn(usize, SymmPool, Vec<SymmBuffer>) -> S + Sync,
    newcomer: impl FnOnce(symmpool::Result<Group>) -> N + Send,
) -> (Vec<S>, N) {
    let backends = HostBackend::world(HostConfig::new(world)).unwrap();
    let joining = HostBackend::newcomer(&backends[0]).unwrap();
    let (before, survivor) = (&before, &survivor);
    thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                s.spawn(move || {
                    let pool =
                        SymmPool::new(&host_group(b, timeout).unwrap(), PoolConfig::default())
                            .unwrap();
                    let kept = before(rank, &pool);
                    if rank == world - 1 {
                        return None;
                    }
                    let coll = Coll::new(&pool).unwrap();
                    let lost = sum_of_ranks(&pool, &coll).unwrap_err();
                    assert_eq!(lost.kind(), ErrorKind::PeerLost, "{lost}");
                    drop(coll);
                    let next = shrink_retrying(&pool).unwrap();
                    drop(pool);
                    Some(survivor(rank, next, kept))
                })
            })
            .collect();
        let n = s.spawn(move || {
            let backend =
                HostBackend::join(joining, HostConfig::new(world), Deadline::after(timeout));
            newcomer(backend.and_then(|b| host_group(b, timeout)))
        });
        let survivors = hs.into_iter().filter_map(|h| h.join().unwrap()).collect();
        (survivors, n.join().unwrap())
    })
}

/// A step at the pool's size and its close; the sum.
fn final_step(pool: &SymmPool) -> symmpool::Result<f32> {
    let coll = Coll::new(pool)?;
    let sum = sum_of_ranks(pool, &coll)?;
    drop(coll);
    pool.close()?;
    Ok(sum)
}

fn is_shrunk<T>(r: &symmpool::Result<T>) -> bool {
    matches!(r, Err(Error::Shrunk { .. }))
}

fn is_divergence<T>(r: &symmpool::Result<T>) -> bool {
    matches!(r, Err(e) if e.kind() == ErrorKind::Divergence)
}

#[test]
fn survivors_whose_pools_differ_and_their_newcomer_all_get_a_divergence() {
    let started = Instant::now();
    let (survivors, newcomer) = host_heal(
        3,
        TIMEOUT,
        |_, pool| vec![pool.alloc(4096, &Stream::host()).unwrap()],
        |rank, pool, mut kept| {
            // Survivor 1 allocates once more after the shrink.
            if rank == 1 {
                kept.push(pool.alloc(4096, &Stream::host()).unwrap());
            }
            pool.grow(true).map(|_| ())
        },
        |group| SymmPool::join(&group?, PoolConfig::default()).map(|_| ()),
    );
    for r in survivors.iter().chain([&newcomer]) {
        assert!(matches!(r, Err(Error::Divergence(_))), "{r:?}");
        // Each rank's digest of the pool it goes on from, not a size.
        let text = r.as_ref().unwrap_err().to_string();
        assert!(text.contains("layout and settings digest"), "{text}");
    }
    assert!(started.elapsed() < TIMEOUT / 4, "{:?}", started.elapsed());
}

#[test]
fn a_newcomer_whose_pool_settings_differ_fails_its_join_on_every_rank() {
    let small = CoreConfig::default().with_small(1 << 10, 4 << 20);
    let growth = CoreConfig::default().with_growth_percent(10);
    let cases = [
        ("name", PoolConfig::default().with_name("other")),
        (
            "untagged",
            PoolConfig::default().with_untagged_collectives(true),
        ),
        // Before: a join that went through, then a registration round that never
        // paired (a timeout of every rank).
        ("register", PoolConfig::default().with_register(false)),
        // Before: a join that went through, then a divergence at the next growth.
        ("small", PoolConfig::default().with_core(small)),
        ("growth", PoolConfig::default().with_core(growth)),
    ];
    for (what, config) in cases {
        let started = Instant::now();
        let (survivors, newcomer) = host_heal(
            3,
            TIMEOUT,
            |_, _| vec![],
            |_, pool, _| pool.grow(true).map(|_| ()),
            |group| SymmPool::join(&group?, config).map(|_| ()),
        );
        for r in survivors.iter().chain([&newcomer]) {
            assert!(is_divergence(r), "{what}: {r:?}");
        }
        assert!(
            started.elapsed() < TIMEOUT / 4,
            "{what}: {:?}",
            started.elapsed()
        );
    }
    // A setting that is this rank's own (how much call history it keeps) joins.
    let (survivors, newcomer) = host_heal(
        3,
        TIMEOUT,
        |_, _| vec![],
        |_, pool, _| final_step(&pool.grow(true)?.expect("the newcomer").0),
        |group| final_step(&SymmPool::join(&group?, PoolConfig::default().with_history_len(7))?.0),
    );
    for r in survivors.iter().chain([&newcomer]) {
        assert_eq!(*r.as_ref().unwrap(), 6.0);
    }
}

/// Ranks that keep their exchanges until every one has its answer (or `bound` has
/// passed): none is lost to a peer whose own wait ends a moment later and leaves.
struct AllAnswered {
    ranks: usize,
    answered: Mutex<usize>,
    cv: std::sync::Condvar,
}

impl AllAnswered {
    fn new(ranks: usize) -> Self {
        let (answered, cv) = (Mutex::new(0), std::sync::Condvar::new());
        AllAnswered {
            ranks,
            answered,
            cv,
        }
    }

    /// This rank has its answer: wait for the others, `bound` at most.
    fn answered(&self, bound: Duration) {
        let mut n = self.answered.lock().unwrap();
        *n += 1;
        self.cv.notify_all();
        let _ = (self.cv.wait_timeout_while(n, bound, |n| *n < self.ranks)).unwrap();
    }
}

#[test]
fn a_newcomer_that_joins_fewer_or_more_pools_than_the_survivors_grow_times_out_in_bound() {
    let timeout = Duration::from_secs(2);
    // More: the survivors grow one pool, the newcomer joins two; every rank stays
    // until all three have their answer.
    let all = AllAnswered::new(3);
    let started = Instant::now();
    let (survivors, newcomer) = host_heal(
        3,
        timeout,
        |_, _| vec![],
        |_, pool, _| {
            let (grown, _) = pool.grow(true)?.expect("the newcomer");
            let step = final_step(&grown);
            all.answered(timeout * 2);
            step
        },
        |group| {
            let group = group?;
            let (first, _) = SymmPool::join(&group, PoolConfig::default())?;
            let extra = SymmPool::join(&group, PoolConfig::default().with_name("extra"));
            all.answered(timeout * 2);
            drop(first);
            extra.map(drop)
        },
    );
    // (A newcomer whose wait ended first is gone: a loss to the survivors.)
    let timed_out = [ErrorKind::Timeout, ErrorKind::PeerLost];
    for r in survivors {
        assert!(
            matches!(r, Err(ref e) if timed_out.contains(&e.kind())),
            "{r:?}"
        );
    }
    assert!(
        matches!(newcomer, Err(ref e) if e.kind() == ErrorKind::Timeout),
        "{newcomer:?}"
    );
    assert!(started.elapsed() < timeout * 3, "{:?}", started.elapsed());
    // Fewer: the survivors grow two pools, the newcomer joins only the first (and,
    // alive, stays until the survivors have their answer: a rank that left would be
    // a loss).
    let all = AllAnswered::new(3);
    let started = Instant::now();
    let (survivors, newcomer) = host_heal(
        3,
        timeout,
        |_, _| vec![],
        |_, pool, _| {
            let second = SymmPool::new(pool.group(), PoolConfig::default().with_name("second"))?;
            let (_grown, _) = pool.grow(true)?.expect("the newcomer");
            let grown = second.grow(true).map(drop);
            all.answered(timeout * 2);
            grown
        },
        |group| {
            let group = group?;
            let joined = SymmPool::join(&group, PoolConfig::default()).map(drop);
            all.answered(timeout * 2);
            joined
        },
    );
    for r in survivors {
        assert!(
            matches!(r, Err(ref e) if e.kind() == ErrorKind::Timeout),
            "{r:?}"
        );
    }
    assert!(newcomer.is_ok(), "{newcomer:?}");
    assert!(started.elapsed() < timeout * 3, "{:?}", started.elapsed());
}

#[test]
fn a_grow_some_survivors_never_ask_for_times_out_on_the_askers_and_the_pools_go_on() {
    let timeout = Duration::from_secs(2);
    let asked = std::sync::Barrier::new(3);
    let started = Instant::now();
    let (survivors, newcomer) = host_heal(
        4,
        timeout,
        |_, _| vec![],
        |rank, pool, _| {
            let grown = (rank != 1).then(|| pool.grow(true).map(drop));
            asked.wait();
            (grown, final_step(&pool))
        },
        |group| group.map(drop),
    );
    for (rank, (grown, sum)) in survivors.into_iter().enumerate() {
        match (rank, grown) {
            (1, None) => {}
            (_, Some(Err(Error::Timeout { missing_ranks, .. }))) => {
                assert!(missing_ranks.contains(&1), "rank {rank}: {missing_ranks:?}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(sum.unwrap(), 6.0);
    }
    // The newcomer gave up at its own deadline.
    assert!(
        matches!(newcomer, Err(Error::Timeout { .. })),
        "{newcomer:?}"
    );
    assert!(started.elapsed() < timeout * 3, "{:?}", started.elapsed());
}

#[test]
fn grows_with_wait_on_some_ranks_only_or_on_every_rank_and_no_newcomer_are_none_everywhere() {
    for waits in [[true, false], [false, true], [true, true]] {
        let timeout = Duration::from_secs(1);
        let groups = Group::world(
            HostBackend::world(HostConfig::new(2)).unwrap(),
            &GroupConfig::default().with_timeout(timeout),
        )
        .unwrap();
        let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
        let started = Instant::now();
        let out = common::on_ranks(pools, |rank, pool| {
            let grown = pool.grow(waits[rank]).map(|g| g.is_none());
            (grown, started.elapsed(), final_step(&pool))
        });
        for (grown, took, sum) in out {
            // Before: with every rank waiting, `None` on the first rank whose deadline
            // passed, a timeout naming it on the other.
            assert!(matches!(grown, Ok(true)), "{waits:?}: {grown:?}");
            let bound = if waits == [true, true] {
                timeout * 2
            } else {
                timeout / 2
            };
            assert!(took < bound, "{waits:?}: {took:?}");
            assert_eq!(sum.unwrap(), 3.0);
        }
    }
}

#[test]
fn after_a_grow_old_buffers_refuse_collectives_stay_readable_and_pin_their_blocks() {
    let stats = std::sync::Mutex::new(Vec::new());
    let (survivors, newcomer) = host_heal(
        3,
        TIMEOUT,
        |_, _| vec![],
        |rank, pool, _| {
            let stream = Stream::host();
            let mut old: Vec<SymmBuffer> = (0..3)
                .map(|i| {
                    let b = pool.alloc(4096 << i, &stream).unwrap();
                    b.write(&[(10 * rank + i) as f32; 1024]).unwrap();
                    b
                })
                .collect();
            let coll = Coll::new(&pool).unwrap();
            let (grown, report) = pool.grow(true).unwrap().unwrap();
            assert_eq!((report.pinned_blocks, report.pinned_bytes), (3, 28 << 10));
            // The old pool, its handle and buffers: no collective, data kept.
            let reduce = |c: &Coll, b: &SymmBuffer| {
                c.tagged(0)
                    .all_reduce_in_place::<f32>(b, ReduceOp::Sum, &stream)
            };
            assert!(is_shrunk(&reduce(&coll, &old[0])));
            assert!(is_shrunk(&pool.alloc(64, &stream)));
            drop(coll);
            let new_coll = Coll::new(&grown).unwrap();
            assert!(is_shrunk(&reduce(&new_coll, &old[0])));
            assert_eq!(old[0].read::<f32>().unwrap(), [(10 * rank) as f32; 1024]);
            assert_eq!(
                old[2].read::<f32>().unwrap()[..1024],
                [(10 * rank + 2) as f32; 1024]
            );
            old[1].write(&[7.0f32; 1024]).unwrap();
            assert_eq!(old[1].read::<f32>().unwrap()[..1024], [7.0; 1024]);
            assert_eq!(sum_of_ranks(&grown, &new_coll).unwrap(), 6.0);
            drop(new_coll);
            // One old buffer dropped: its block stays allocated (the newcomer holds it).
            drop(old.remove(0));
            stats.lock().unwrap().push((rank, grown.memory_stats()));
            // Closing with old buffers alive is refused on every rank, naming only
            // the buffers still alive.
            let refused = grown.close();
            let Err(Error::BuffersAlive {
                live_per_rank,
                buffers,
            }) = refused
            else {
                panic!("{refused:?}");
            };
            assert_eq!(live_per_rank, [2, 2, 0]);
            assert_eq!(buffers.len(), 4, "{buffers:?}");
            assert!(
                buffers.iter().all(|(_, b)| !b.starts_with("4096 B")),
                "{buffers:?}"
            );
            drop(old);
            grown.close().unwrap();
            grown.memory_stats()
        },
        |group| {
            let (pool, report) = SymmPool::join(&group.unwrap(), PoolConfig::default()).unwrap();
            assert_eq!((report.pinned_blocks, report.pinned_bytes), (3, 28 << 10));
            let coll = Coll::new(&pool).unwrap();
            assert_eq!(sum_of_ranks(&pool, &coll).unwrap(), 6.0);
            drop(coll);
            stats.lock().unwrap().push((2, pool.memory_stats()));
            let refused = pool.close();
            assert!(
                matches!(refused, Err(Error::BuffersAlive { ref buffers, .. }) if buffers.len() == 4),
                "{refused:?}"
            );
            pool.close().unwrap();
            pool.memory_stats()
        },
    );
    // The newcomer's accounting is a survivor's: the pinned blocks are allocated on
    // both, dropped buffer or none.
    let stats = stats.into_inner().unwrap();
    let newcomers = &stats.iter().find(|(r, _)| *r == 2).unwrap().1;
    for (rank, s) in &stats {
        assert_eq!(s, newcomers, "rank {rank}");
    }
    assert!(
        newcomers
            .iter()
            .any(|(k, _)| k.starts_with("allocated_bytes")),
        "{newcomers:?}"
    );
    // Closed: the memory is back, the pinned blocks' too.
    for s in survivors.iter().chain([&newcomer]) {
        for key in ["reserved_bytes.all.current", "allocated_bytes.all.current"] {
            assert_eq!(s.get(key).and_then(|v| v.as_u64()), Some(0), "{key}: {s:?}");
        }
    }
}

#[test]
fn pools_of_one_group_regrouped_differently_are_refused_at_once() {
    // Pool a shrinks (no loss), then pool b of the same group asks to grow.
    let started = Instant::now();
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    let out = common::on_ranks(backends, |_, b| {
        let group = host_group(b, TIMEOUT).unwrap();
        let a = SymmPool::new(&group, PoolConfig::default().with_name("a")).unwrap();
        let z = SymmPool::new(&group, PoolConfig::default().with_name("b")).unwrap();
        let shrunk = a.shrink().map(drop);
        // Before: a "grow" into the shrunk group, with no newcomer.
        let grown = z.grow(false).map(drop);
        (shrunk, grown, z.shrink().map(|(p, _)| p.world_size()))
    });
    for (shrunk, grown, then) in out {
        assert!(shrunk.is_ok(), "{shrunk:?}");
        assert!(is_shrunk(&grown), "{grown:?}");
        assert_eq!(then.unwrap(), 2);
    }
    // Pool a grows with a newcomer, then pool b of the same group asks to shrink.
    let both = std::sync::Barrier::new(2);
    let (survivors, newcomer) = host_heal(
        3,
        TIMEOUT,
        |_, _| vec![],
        |_, pool, _| {
            let z = SymmPool::new(pool.group(), PoolConfig::default().with_name("b")).unwrap();
            let grown = pool.grow(true).map(drop);
            // Before: a "shrink" into the grown group, until the timeout.
            let shrunk = z.shrink().map(drop);
            both.wait();
            let (z, _) = z.grow(true).unwrap().unwrap();
            (grown, shrunk, final_step(&z))
        },
        |group| {
            let group = group.unwrap();
            let (a, _) = SymmPool::join(&group, PoolConfig::default()).unwrap();
            let (z, _) = SymmPool::join(&group, PoolConfig::default().with_name("b")).unwrap();
            drop(a);
            final_step(&z)
        },
    );
    for (grown, shrunk, sum) in survivors {
        assert!(grown.is_ok(), "{grown:?}");
        assert!(is_shrunk(&shrunk), "{shrunk:?}");
        assert_eq!(sum.unwrap(), 6.0);
    }
    assert_eq!(newcomer.unwrap(), 6.0);
    assert!(started.elapsed() < TIMEOUT / 4, "{:?}", started.elapsed());
}

/// The README's pattern for several pools of one group: `grow(false)` on the first
/// pool only, and the others only when it grew. Growing each with `grow(false)` races
/// with a newcomer that comes between two of them: the first stays, the second grows,
/// and the newcomer's first join meets the survivors' second pool.
#[test]
fn several_pools_of_one_group_grow_together_only_when_the_first_one_grew() {
    for careful in [false, true] {
        let backends = HostBackend::world(HostConfig::new(3)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let out: Vec<String> = thread::scope(|s| {
            let mut hs: Vec<_> = (backends.into_iter().enumerate())
                .map(|(rank, b)| {
                    let tx = tx.clone();
                    s.spawn(move || {
                        let group = host_group(b, TIMEOUT).unwrap();
                        let config = |name: &str| PoolConfig::default().with_name(name);
                        let a = SymmPool::new(&group, config("a")).unwrap();
                        let z = SymmPool::new(&group, config("b")).unwrap();
                        if rank == 2 {
                            return String::new();
                        }
                        let coll = Coll::with_pools(&[a.clone(), z.clone()]).unwrap();
                        assert!(sum_of_ranks(&a, &coll).is_err());
                        drop(coll);
                        let a = shrink_retrying(&a).unwrap();
                        let z = shrink_retrying(&z).unwrap();
                        let first = a.grow(false).map(|g| g.is_some());
                        // The newcomer comes now.
                        if rank == 0 {
                            tx.send(HostBackend::newcomer(z.backend()).unwrap())
                                .unwrap();
                        }
                        thread::sleep(Duration::from_millis(300));
                        let second = match (careful, &first) {
                            (true, Ok(false)) => Ok(false),
                            _ => z.grow(false).map(|g| g.is_some()),
                        };
                        format!("{first:?} {:?}", second.map_err(|e| e.kind()))
                    })
                })
                .collect();
            hs.push(s.spawn(move || {
                let newcomer = rx.recv().unwrap();
                let deadline = Deadline::after(Duration::from_secs(2));
                let Ok(backend) = HostBackend::join(newcomer, HostConfig::new(3), deadline) else {
                    return "not taken in".into();
                };
                let group = host_group(backend, TIMEOUT).unwrap();
                let a = SymmPool::join(&group, PoolConfig::default().with_name("a"));
                format!("{:?}", a.map(drop).map_err(|e| e.kind()))
            }));
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        if careful {
            assert_eq!(
                out,
                [
                    "Ok(false) Ok(false)",
                    "Ok(false) Ok(false)",
                    "",
                    "not taken in"
                ]
            );
        } else {
            // Pool a stays at 2 ranks, pool b grows: the survivors' pools are in two
            // worlds, and the newcomer's first join meets pool b (different names:
            // a channel mismatch on every rank).
            let mismatch = "Ok(false) Err(Divergence)";
            assert_eq!(out, [mismatch, mismatch, "", "Err(Divergence)"]);
        }
    }
}

#[test]
fn a_shrink_after_a_grow_counts_no_dropped_old_buffer_as_live() {
    let (survivors, newcomer) = host_heal(
        3,
        TIMEOUT,
        |_, _| vec![],
        |_, pool, _| {
            let old = pool.alloc(4096, &Stream::host()).unwrap();
            let (grown, report) = pool.grow(true).unwrap().unwrap();
            assert_eq!(report.pinned_blocks, 1);
            let kept = grown.alloc(8192, &Stream::host()).unwrap();
            drop(old);
            // The newcomer leaves: a loss the survivors shrink past.
            let coll = Coll::new(&grown).unwrap();
            let lost = sum_of_ranks(&grown, &coll).unwrap_err();
            assert_eq!(lost.kind(), ErrorKind::PeerLost, "{lost}");
            drop(coll);
            let (shrunk, report) = grown.shrink().unwrap();
            // Before: 2 live buffers (the pinned block of the dropped one counted).
            assert_eq!(
                (report.live_buffers, report.live_bytes),
                (1, 8192),
                "{report:?}"
            );
            drop(kept);
            final_step(&shrunk)
        },
        |group| {
            let group = group.unwrap();
            let (pool, _) = SymmPool::join(&group, PoolConfig::default()).unwrap();
            drop(pool.alloc(8192, &Stream::host()).unwrap());
        },
    );
    assert_eq!(newcomer, ());
    for s in survivors {
        assert_eq!(s.unwrap(), 3.0);
    }
}
