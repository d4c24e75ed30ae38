//! Surviving a lost rank: the survivors shrink the group and carry on.
//!
//! The store's side runs with ranks as threads (one `StoreExchange` each; a rank that
//! drops its exchange is lost to the others, as a killed process is); the pool's side
//! runs with one process per rank on the shared-memory backend, one of them killed
//! with `kill -9` in the middle of a collective or a window registration, and with
//! ranks as threads of one host world, one of them panicking there (a second one
//! while the survivors shrink).

use std::sync::Mutex;
use std::thread;
use std::time::Duration;
use symmpool::control::{Exchange, Launch, StoreConfig, StoreExchange, StoreServer};
use symmpool::{Deadline, Error, ErrorKind};

mod common;

use common::round::{LONG, round};

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
                    Err(Error::ShrinkFailed {
                        reason,
                        retry: true,
                    }) => {
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
            Err(e) => {
                let Error::ShrinkFailed {
                    retry: false,
                    reason,
                } = &e
                else {
                    panic!("{e:?}");
                };
                assert!(reason.contains("the store is gone"), "{reason}");
                assert!(reason.contains("SYMMPOOL_STORE_EXTERNAL=1"), "{reason}");
                // Shrinking again cannot help: a kind whose advice is a restart.
                assert_eq!(e.kind(), ErrorKind::GroupLost, "{e}");
                assert!(e.kind().needs_restart());
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(10));
}

// ---------------------------------------------------------------------------------
// A toy training that survives a lost rank: one process per rank on the shared-memory
// backend (one of them killed with `kill -9`), and ranks as threads of one host world
// (one of them panicking); the survivors shrink the pool and train on.

use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use common::watched::{Watch, Watched};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use symmpool::backend::{CollArgs, Collectives, Refused, Segment, SegmentProvider, Window};
use symmpool::{
    Backend, Coll, CollectiveCalls, Group, GroupConfig, HostBackend, HostConfig, PoolConfig,
    ReduceOp, ShrinkReport, Stream, SymmPool,
};

const ENTRY: &str = "child_process_entry";
/// Parameters of the toy model: divisible by 4 and by 3.
const N: usize = 12 * 256;
const STEPS: usize = 6;
/// The step in which the victim is lost (in its reduce-scatter, or in the window
/// registration of the growth every rank makes at its start).
const KILL_AT: usize = 3;
/// The registrations before the step `KILL_AT` (the first segment, on the two
/// communicators that register).
const REGISTRATIONS_BEFORE: usize = 2;
/// The pools' timeout: every wait of a test ends by it.
const POOL_TIMEOUT: Duration = Duration::from_secs(60);

/// How a victim stops where [`StopAt`] stops it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Say `@@stalled` and park for good (the test kills the process).
    Park,
    /// Panic: the rank's thread unwinds and drops its exchange.
    Panic,
}

/// A victim's segments or collectives (`P`): it stops in its call number `at` (from
/// 0) of window registration, or of reduce-scatter.
#[derive(Debug)]
struct StopAt<P: ?Sized> {
    inner: Arc<P>,
    at: usize,
    stop: Stop,
    calls: AtomicUsize,
}

impl<P: ?Sized> StopAt<P> {
    fn new(inner: Arc<P>, at: usize, stop: Stop) -> Arc<Self> {
        Arc::new(StopAt {
            inner,
            at,
            stop,
            calls: AtomicUsize::new(0),
        })
    }

    /// Count a call; stop in call `at`.
    fn call(&self) {
        if self.calls.fetch_add(1, Ordering::SeqCst) != self.at {
            return;
        }
        match self.stop {
            Stop::Panic => panic!("the victim's thread crashes here"),
            Stop::Park => {
                println!("@@stalled");
                loop {
                    thread::park();
                }
            }
        }
    }
}

impl SegmentProvider for StopAt<dyn SegmentProvider> {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        self.inner.allocate(size_bytes)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> symmpool::Result<Option<Window>> {
        self.call();
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.register(segment, comm, deadline) }
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.inner.free(segment) }
    }
}

impl Collectives for StopAt<dyn Collectives> {
    fn all_gather(&self, args: &CollArgs<'_>) -> symmpool::Result<()> {
        self.inner.all_gather(args)
    }
    fn reduce_scatter(&self, args: &CollArgs<'_>) -> symmpool::Result<()> {
        self.call();
        self.inner.reduce_scatter(args)
    }
    fn all_reduce(&self, args: &CollArgs<'_>) -> symmpool::Result<()> {
        self.inner.all_reduce(args)
    }
    fn abandon(&self, why: &'static str) {
        self.inner.abandon(why)
    }
}

/// `backend` as the victim's in `phase`: it stops (`stop`) in its reduce-scatter of
/// step `KILL_AT` (`"collective"`), or in its window registration of the growth of
/// that step (`"registration"`).
fn victim(backend: Backend, phase: &str, stop: Stop) -> Backend {
    match phase {
        "collective" => backend.with_collectives(|c| StopAt::new(c, KILL_AT, stop)),
        _ => backend.with_segments(|s| StopAt::new(s, REGISTRATIONS_BEFORE, stop)),
    }
}

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(code) => code,
        Err(e) => {
            println!("@@error {e}");
            2
        }
    };
    std::process::exit(code);
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// One data-parallel step of a toy model, sharded as FSDP shards it: every rank's
/// gradient (a function of the parameters, its rank and the step) is reduce-scattered,
/// each rank updates its shard, and the shards are all-gathered. `w` changes only if
/// every collective succeeded.
fn step(pool: &SymmPool, coll: &Coll, w: &mut Vec<f32>, step: usize) -> symmpool::Result<()> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let n = N / world;
    // Every rank grows the pool at this step (a registration on every communicator).
    let _grown = (step == KILL_AT)
        .then(|| pool.alloc(48 << 20, &stream))
        .transpose()?;
    let g: Vec<f32> = (w.iter().enumerate())
        .map(|(i, x)| {
            x * 0.5 + (rank + 1) as f32 * 0.01 + step as f32 * 0.001 + (i % 7) as f32 * 1e-4
        })
        .collect();
    let grads = pool.alloc((N * 4) as u64, &stream)?;
    grads.write(&g)?;
    let shard = pool.alloc((n * 4) as u64, &stream)?;
    coll.tagged(0)
        .reduce_scatter::<f32>(&grads, &shard, ReduceOp::Sum, &stream)?;
    let s = shard.read::<f32>()?;
    let params = pool.alloc((N * 4) as u64, &stream)?;
    let mine: Vec<f32> = (0..n)
        .map(|i| w[rank * n + i] - 0.1 * s[i] / world as f32)
        .collect();
    params
        .view::<f32>()?
        .slice(rank * n, n)?
        .copy_from_host(&mine)?;
    coll.tagged(0)
        .all_gather_in_place::<f32>(&params, &stream)?;
    *w = params.read::<f32>()?;
    coll.end_step()
}

fn digest(w: &[f32]) -> u64 {
    w.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    })
}

/// The toy model's parameters at the start.
fn initial() -> (Vec<f32>, usize) {
    ((0..N).map(|i| i as f32 * 1e-3).collect(), 0)
}

/// What one rank's training did.
struct Trained {
    /// The error that told it of the loss, and its shrink.
    lost: Option<(String, ShrinkReport)>,
    /// The step and parameters it went on from at the new size.
    state: Option<(Vec<f32>, usize)>,
    /// From the loss's error to the first step done at the new size.
    first_step: Option<Duration>,
    /// The final parameters' digest.
    digest: u64,
}

/// Train from parameters `w` at step `at` until `STEPS` on `backend`, shrinking the
/// pool when a rank is lost; `before` is told of each step before it runs.
fn train(
    backend: Backend,
    (mut w, mut at): (Vec<f32>, usize),
    before: &dyn Fn(&SymmPool, usize),
) -> symmpool::Result<Trained> {
    let group = Group::new(backend, GroupConfig::default().with_timeout(POOL_TIMEOUT))?;
    let mut pool = SymmPool::new(&group, PoolConfig::default())?;
    let mut coll = Coll::new(&pool)?;
    let mut trained = Trained {
        lost: None,
        state: None,
        first_step: None,
        digest: 0,
    };
    let mut lost_at: Option<Instant> = None;
    // A buffer of the old world that lives across the shrink.
    let kept = pool.alloc((N * 4) as u64, &Stream::host())?;
    let w0 = w.clone();
    kept.write(&w0)?;
    while at < STEPS {
        before(&pool, at);
        match step(&pool, &coll, &mut w, at) {
            Ok(()) => {
                if let Some(t) = lost_at.take() {
                    trained.first_step = Some(t.elapsed());
                }
                at += 1;
            }
            // A loss, as the README's loop sorts it: by kind.
            Err(e) if e.kind() == ErrorKind::PeerLost => {
                lost_at = Some(Instant::now());
                let (next, report) = pool.shrink()?;
                // Nothing of the old world answers with its data: its collectives and
                // its pool refuse; its memory is still this rank's to read.
                let refused = coll
                    .tagged(0)
                    .all_gather_in_place::<f32>(&kept, &Stream::host());
                assert!(matches!(refused, Err(Error::Shrunk { .. })), "{refused:?}");
                let refused = pool.alloc(4096, &Stream::host()).map(|_| ());
                assert!(matches!(refused, Err(Error::Shrunk { .. })), "{refused:?}");
                drop(coll);
                pool = next;
                coll = Coll::new(&pool)?;
                assert_eq!(kept.read::<f32>()?, w0);
                let refused = coll
                    .tagged(0)
                    .all_gather_in_place::<f32>(&kept, &Stream::host());
                assert!(matches!(refused, Err(Error::Shrunk { .. })), "{refused:?}");
                trained.lost = Some((e.to_string(), report));
                trained.state = Some((w.clone(), at));
            }
            Err(e) => return Err(e),
        }
    }
    trained.digest = digest(&w);
    drop((coll, kept));
    pool.close()?;
    Ok(trained)
}

fn child() -> symmpool::Result<i32> {
    let (rank, _, backend) = join()?;
    let victim_rank: Option<usize> = var("CHILD_VICTIM").and_then(|v| v.parse().ok());
    let phase = var("CHILD_PHASE").unwrap_or_default();
    let backend = match victim_rank == Some(rank) {
        true => victim(backend, &phase, Stop::Park),
        false => backend,
    };
    let state_file = var("CHILD_STATE").unwrap();
    // A fresh job starts from the survivors' state; the first job from the start.
    let start = match var("CHILD_FROM_STATE") {
        Some(_) => {
            let text = std::fs::read_to_string(&state_file).unwrap();
            let mut words = text.split_whitespace();
            let at: usize = words.next().unwrap().parse().unwrap();
            let w: Vec<f32> = words.map(|x| f32::from_bits(x.parse().unwrap())).collect();
            (w, at)
        }
        None => initial(),
    };
    let waiting = |pool: &SymmPool, at: usize| {
        if victim_rank.is_some_and(|v| v != pool.rank()) && at == KILL_AT && pool.world_size() == 4
        {
            println!("@@waiting");
        }
    };
    let trained = train(backend, start, &waiting)?;
    if let Some((lost, report)) = &trained.lost {
        println!("@@lost {lost}");
        println!(
            "@@shrunk rank={} world={} lost={:?} segments={} registrations={} live={} ms={}",
            report.rank,
            report.world_size,
            report.lost_ranks,
            report.segments,
            report.registrations,
            report.live_buffers,
            report.took.as_millis()
        );
        if let Some(t) = trained.first_step {
            println!("@@first_step_ms {}", t.as_millis());
        }
        if let (0, Some((w, at))) = (report.rank, &trained.state) {
            let words: Vec<String> = w.iter().map(|x| x.to_bits().to_string()).collect();
            std::fs::write(&state_file, format!("{at} {}", words.join(" "))).unwrap();
        }
    }
    println!("@@final {:016x}", trained.digest);
    Ok(0)
}

/// The segments and registrations a survivor's shrink keeps in `phase`: every segment,
/// registered once per new communicator that registers (two); the growth of step
/// `KILL_AT` went through before a loss in the collective, and was undone everywhere
/// after one in its registration.
fn kept_in(phase: &str) -> (usize, u64) {
    match phase {
        "collective" => (2, 4),
        _ => (1, 2),
    }
}

#[test]
fn a_rank_killed_in_a_collective_leaves_three_survivors_that_shrink_and_train_on() {
    killed_in("collective", 2, false);
}

#[test]
fn a_rank_killed_in_a_window_registration_leaves_three_survivors_that_shrink_and_train_on() {
    killed_in("registration", 2, false);
}

/// With the store in a process of its own (here the test's), rank 0 is lost like any
/// other: the survivors shrink past it, renumbered 0, 1, 2.
#[test]
fn with_the_store_outside_the_ranks_rank_0_killed_in_a_collective_is_survived() {
    killed_in("collective", 0, true);
}

#[test]
fn with_the_store_outside_the_ranks_rank_0_killed_in_a_registration_is_survived() {
    killed_in("registration", 0, true);
}

/// A 4-rank job whose rank `victim` is killed in `phase` at step `KILL_AT`: the
/// survivors shrink, finish the training, and end where a fresh 3-rank job from their
/// state does. With `external_store`, the test hosts the store and no rank does.
fn killed_in(phase: &'static str, victim: usize, external_store: bool) {
    let before = shm_entries();
    let dir = std::env::temp_dir().join(format!(
        "symmpool-shrink-{phase}-{victim}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state").display().to_string();
    let world = 4;
    let store = external_store.then(|| {
        let mut c = StoreConfig::new(Launch::explicit(0, world, "127.0.0.1", 0).unwrap());
        c.token = Some("job-token".into());
        c.heartbeat_interval = Duration::from_millis(common::procs::HEARTBEAT_MS);
        c.heartbeat_timeout = Duration::from_millis(common::procs::HEARTBEAT_TIMEOUT_MS);
        c.startup_timeout = Duration::from_secs(60);
        StoreServer::bind("127.0.0.1:0", &c).unwrap()
    });
    let env = |extra: Vec<(&'static str, String)>| {
        let state = state.clone();
        move |_| {
            let mut v = vec![("CHILD_STATE", state.clone())];
            v.extend(extra.clone());
            v
        }
    };
    let mut first = vec![
        ("CHILD_VICTIM", victim.to_string()),
        ("CHILD_PHASE", phase.to_string()),
    ];
    let mut job = match &store {
        Some(server) => {
            first.push(("SYMMPOOL_STORE_EXTERNAL", "1".into()));
            Job::start_on_port(ENTRY, world, server.local_addr().port(), env(first))
        }
        None => Job::start(ENTRY, world, env(first)),
    };
    job.expect(victim, "@@stalled", Duration::from_secs(120));
    let survivors: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    for &r in &survivors {
        job.expect(r, "@@waiting", Duration::from_secs(60));
    }
    job.children[victim].kill().unwrap();
    let codes = job.wait(&survivors, Duration::from_secs(120));
    assert_eq!(codes, vec![0; survivors.len()], "{:?}", job.seen);
    let mut finals = Vec::new();
    let (segments, registrations) = kept_in(phase);
    for (new_rank, &r) in survivors.iter().enumerate() {
        let lost = job.expect(r, "@@lost ", Duration::from_secs(5));
        assert!(lost.contains(&format!("rank {victim}")), "{lost}");
        let shrunk = job.expect(r, "@@shrunk ", Duration::from_secs(5));
        assert!(
            shrunk.starts_with(&format!(
                "rank={new_rank} world=3 lost=[{victim}] segments={segments} registrations={registrations} live=1 "
            )),
            "{shrunk}"
        );
        let took_ms: u64 = job
            .expect(r, "@@first_step_ms ", Duration::from_secs(5))
            .parse()
            .unwrap();
        println!("rank {r}: {shrunk}; first step at world size 3 after {took_ms} ms");
        finals.push(job.expect(r, "@@final ", Duration::from_secs(5)));
    }
    assert!(finals.iter().all(|f| *f == finals[0]), "{finals:?}");
    drop(job);
    if let Some(server) = store {
        // Every rank joined, then left (three ended, one was killed): the job is over.
        let end = server.wait_until_done(Deadline::after(Duration::from_secs(10)));
        assert_eq!(end, symmpool::control::JobEnd::Ended);
        assert_eq!(server.stats().ranks_departed, 4);
    }
    // A fresh 3-rank job from the survivors' state ends where they did.
    let mut fresh = Job::start(ENTRY, 3, env(vec![("CHILD_FROM_STATE", "1".into())]));
    let codes = fresh.wait(&[0, 1, 2], Duration::from_secs(120));
    assert_eq!(codes, vec![0; 3], "{:?}", fresh.seen);
    for r in 0..3 {
        assert_eq!(
            fresh.expect(r, "@@final ", Duration::from_secs(5)),
            finals[0]
        );
    }
    drop(fresh);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

/// Run `train` on each backend's thread from `start` (the backends `wrap` rewraps by
/// rank); every thread's outcome, in rank order (`Err` for a thread that panicked).
fn train_threads(
    backends: Vec<Backend>,
    start: &(Vec<f32>, usize),
    wrap: impl Fn(usize, Backend) -> Backend,
) -> Vec<thread::Result<symmpool::Result<Trained>>> {
    thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                let b = wrap(rank, b);
                s.spawn(move || train(b, start.clone(), &|_, _| ()))
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    })
}

#[test]
fn a_thread_that_panics_in_a_collective_leaves_three_survivors_that_shrink_and_train_on() {
    panicked_in("collective");
}

#[test]
fn a_thread_that_panics_in_a_window_registration_leaves_three_survivors_that_shrink_and_train_on() {
    panicked_in("registration");
}

/// A 4-rank host world whose rank 2's thread panics in `phase` at step `KILL_AT`: the
/// others learn of it at once (not at the pool timeout), shrink, finish the training,
/// and end bit for bit where a fresh 3-rank world from their state does.
fn panicked_in(phase: &'static str) {
    let started = Instant::now();
    let backends = HostBackend::world(HostConfig::new(4)).unwrap();
    let out = train_threads(backends, &initial(), |rank, b| match rank {
        2 => victim(b, phase, Stop::Panic),
        _ => b,
    });
    let mut out = out.into_iter();
    let mut survivors: Vec<Trained> = Vec::new();
    for (rank, o) in (0..4).zip(&mut out) {
        match (rank, o) {
            (2, Err(_)) => {}
            (2, Ok(r)) => panic!("the victim did not panic: {:?}", r.map(|t| t.digest)),
            (_, Ok(t)) => survivors.push(t.unwrap()),
            (_, Err(_)) => panic!("survivor {rank} panicked"),
        }
    }
    assert!(
        started.elapsed() < POOL_TIMEOUT / 2,
        "the loss was seen late: {:?}",
        started.elapsed()
    );
    let (segments, registrations) = kept_in(phase);
    for (new_rank, t) in survivors.iter().enumerate() {
        let (lost, report) = t.lost.as_ref().expect("a shrink");
        assert!(lost.contains("rank 2"), "{lost}");
        let got = (report.rank, report.world_size, &report.lost_ranks[..]);
        assert_eq!(got, (new_rank, 3, &[2][..]));
        assert_eq!(
            (report.segments, report.registrations),
            (segments, registrations)
        );
        assert_eq!(report.live_buffers, 1);
        let first = t.first_step.expect("a step at the new size");
        println!(
            "rank {new_rank} of 3: shrunk in {:?}, first step at world size 3 {first:?} after the loss ({phase})",
            report.took
        );
    }
    assert!(survivors.iter().all(|t| t.digest == survivors[0].digest));
    let states: Vec<_> = survivors.iter().map(|t| t.state.clone()).collect();
    assert!(states.iter().all(|s| *s == states[0]));
    // A fresh 3-rank world from the survivors' state ends where they did.
    let fresh = HostBackend::world(HostConfig::new(3)).unwrap();
    for o in train_threads(fresh, &states[0].clone().unwrap(), |_, b| b) {
        let t = o.unwrap().unwrap();
        assert!(t.lost.is_none());
        assert_eq!(t.digest, survivors[0].digest);
    }
}

/// A rank's ask to shrink, counted in `asks`; for the second victim (`panics`), a
/// panic in its ask: before asking the group (once two other ranks ask), or right after
/// (the group shrank with it).
struct Asking {
    asks: Arc<(Mutex<usize>, std::sync::Condvar)>,
    panics: Option<When>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    BeforeAsking,
    AfterAsking,
}

impl Watch for Asking {
    fn shrink(
        &self,
        inner: &dyn Exchange,
        deadline: Deadline,
    ) -> symmpool::Result<Arc<dyn Exchange>> {
        let (count, cv) = &*self.asks;
        match self.panics {
            None => {
                *count.lock().unwrap() += 1;
                cv.notify_all();
                inner.shrink(deadline)
            }
            Some(When::BeforeAsking) => {
                let asked = cv.wait_timeout_while(count.lock().unwrap(), LONG, |n| *n < 2);
                assert!(!asked.unwrap().1.timed_out());
                panic!("the second victim's thread crashes before it asks to shrink");
            }
            Some(When::AfterAsking) => {
                let _next = inner.shrink(deadline);
                panic!("the second victim's thread crashes after the group shrank");
            }
        }
    }
}

/// A 4-rank host world: rank 3's thread panics in a collective, rank 2's in its shrink
/// (`when`). Ranks 0 and 1 shrink, asking again once if it failed; each one's answers
/// (two at most): the world size of its new pool, or the error. They alone return,
/// and well before the pools' timeout.
fn second_loss(when: When) -> Vec<Vec<symmpool::Result<usize>>> {
    let started = Instant::now();
    let asks = Arc::new((Mutex::new(0), std::sync::Condvar::new()));
    let backends = HostBackend::world(HostConfig::new(4)).unwrap();
    let answers = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter().enumerate())
            .map(|(rank, b)| {
                let asking = Asking {
                    asks: asks.clone(),
                    panics: (rank == 2).then_some(when),
                };
                let b = b.with_exchange(|x| Watched::with(x, asking)).unwrap();
                let b = match rank {
                    3 => victim(b, "collective", Stop::Panic),
                    _ => b,
                };
                s.spawn(move || {
                    let config = GroupConfig::default().with_timeout(POOL_TIMEOUT);
                    let group = Group::new(b, config).unwrap();
                    let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
                    let coll = Coll::new(&pool).unwrap();
                    let mut w = initial().0;
                    let lost = (0..STEPS).find_map(|at| step(&pool, &coll, &mut w, at).err());
                    let lost = lost.expect("a lost rank");
                    assert!(lost.to_string().contains("rank 3"), "{lost}");
                    drop(coll);
                    let mut answers = Vec::new();
                    for _ in 0..2 {
                        let shrunk = pool.shrink().map(|(next, _)| next.world_size());
                        let done = shrunk.is_ok();
                        answers.push(shrunk);
                        if done {
                            break;
                        }
                    }
                    answers
                })
            })
            .collect();
        hs.into_iter()
            .filter_map(|h| h.join().ok())
            .collect::<Vec<_>>()
    });
    assert_eq!(answers.len(), 2, "ranks 0 and 1 alone return");
    assert!(started.elapsed() < POOL_TIMEOUT / 2);
    answers
}

#[test]
fn a_thread_lost_while_the_survivors_ask_to_shrink_fails_their_ask_and_they_ask_again() {
    for a in &second_loss(When::BeforeAsking) {
        // Told of the second loss while asking, they ask again; or it came before their
        // ask reached the group, and the group shrank without it at once.
        let (last, failed) = a.split_last().unwrap();
        assert!(matches!(last, Ok(2)), "{a:?}");
        for f in failed {
            match f {
                Err(Error::ShrinkFailed {
                    reason,
                    retry: true,
                }) => {
                    assert!(reason.contains("rank 2 was lost"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }
}

#[test]
fn a_thread_lost_right_after_the_group_shrank_fails_the_shrink_cleanly() {
    for a in &second_loss(When::AfterAsking) {
        // The new group lost its rank 2 before it could agree: a clear error, then,
        // asked again, the survivors of both losses go on; never a hang.
        assert_eq!(a.len(), 2, "{a:?}");
        assert!(
            matches!(a[0], Err(Error::PeerLost { rank: 2, .. })),
            "{a:?}"
        );
        assert!(matches!(a[1], Ok(2)), "{a:?}");
    }
}

/// A host world of `world` ranks in groups with a 10 s timeout.
fn host_groups(world: usize) -> Vec<Group> {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(10));
    Group::world(HostBackend::world(HostConfig::new(world)).unwrap(), &config).unwrap()
}

/// The pools of `groups` after a reserve (collective) and `common` allocations of 1 MiB
/// on every rank, the last rank then lost (its pool, group and buffers dropped): the
/// survivors' pools and buffers.
fn lost_after(
    groups: Vec<Group>,
    common: usize,
) -> (Vec<SymmPool>, Vec<Vec<symmpool::SymmBuffer>>) {
    let mut pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    drop(groups);
    let stream = Stream::host();
    let mut held = on_all(&pools, |p| {
        p.reserve(16 << 20).unwrap();
        (0..common)
            .map(|_| p.alloc(1 << 20, &stream).unwrap())
            .collect::<Vec<_>>()
    });
    drop((held.pop(), pools.pop()));
    (pools, held)
}

#[test]
fn survivors_that_stopped_some_allocations_apart_catch_up_and_pin_those_blocks() {
    // Rank 1 learned of the loss later than rank 0: it allocated twice more and freed
    // the second of those before it shrank. Both shrink into pools at the same call:
    // the block rank 1 still holds is allocated on both (pinned), and their next
    // allocations land at the same places.
    let (pools, mut held) = lost_after(host_groups(3), 1);
    let stream = Stream::host();
    held[1].push(pools[1].alloc(256 << 10, &stream).unwrap());
    drop(pools[1].alloc(64 << 10, &stream).unwrap());
    let shrunk: Vec<_> = on_all(&pools, |p| p.shrink().unwrap());
    let reports: Vec<_> = shrunk
        .iter()
        .map(|(_, r)| (r.pinned_blocks, r.live_buffers))
        .collect();
    assert_eq!(reports, [(1, 1), (1, 2)]);
    let next = on_all(&shrunk, |(p, _)| {
        let b = p.alloc(512 << 10, &stream).unwrap();
        (b.segment(), b.offset_bytes(), b.allocation_seq())
    });
    assert_eq!(next[0], next[1]);
    // Rank 1's buffer of the pinned block goes without freeing it; the pools close.
    drop(held);
    assert!(
        on_all(&shrunk, |(p, _)| p.close())
            .iter()
            .all(Result::is_ok)
    );
}

#[test]
fn a_survivor_that_freed_a_buffer_another_still_holds_cannot_catch_up() {
    // Rank 1 freed a buffer after rank 0 had stopped (rank 0 still holds it): the
    // memory cannot be the same on both, and their shrink says so on both.
    let (pools, mut held) = lost_after(host_groups(3), 2);
    drop(held[1].pop());
    for out in on_all(&pools, |p| p.shrink().map(|_| ())) {
        assert!(matches!(out, Err(Error::Divergence(_))), "{out:?}");
    }
}

#[test]
fn a_shrink_that_fails_after_its_catch_up_keeps_the_pins_for_the_next_ask() {
    // Rank 1 allocated once more than rank 0 before the loss; their first shrink
    // catches up, then fails (a stream captures a graph). Asked again, the ranks stand
    // at one call already: the block rank 0 replayed stays pinned on both, and once
    // rank 1 drops its buffer their next allocations still land at the same places.
    use common::capture::{EVERY_STREAM, capturing_groups};
    use std::sync::atomic::Ordering::SeqCst;
    let config = GroupConfig::default().with_timeout(Duration::from_secs(10));
    let (capturing, groups) = capturing_groups(3, &config);
    let (pools, mut held) = lost_after(groups, 1);
    let stream = Stream::host();
    held[1].push(pools[1].alloc(256 << 10, &stream).unwrap());
    capturing.store(EVERY_STREAM, SeqCst);
    for out in on_all(&pools, |p| p.shrink().map(|_| ())) {
        assert!(matches!(out, Err(Error::GraphCapture)), "{out:?}");
    }
    capturing.store(0, SeqCst);
    let shrunk: Vec<_> = on_all(&pools, |p| p.shrink().unwrap());
    let live: Vec<_> = shrunk.iter().map(|(_, r)| r.live_buffers).collect();
    assert_eq!(live, [1, 2]);
    drop(held[1].pop());
    let next = on_all(&shrunk, |(p, _)| {
        let b = p.alloc(256 << 10, &stream).unwrap();
        (b.segment(), b.offset_bytes(), b.allocation_seq())
    });
    assert_eq!(next[0], next[1]);
}

#[test]
fn three_survivors_behind_between_and_ahead_catch_up_to_one_pool() {
    // Of four ranks, rank 3 is lost; rank 0 stopped first, rank 1 one allocation later,
    // rank 2 three allocations later (the last one freed again).
    let (pools, mut held) = lost_after(host_groups(4), 1);
    let stream = Stream::host();
    held[1].push(pools[1].alloc(256 << 10, &stream).unwrap());
    held[2].push(pools[2].alloc(256 << 10, &stream).unwrap());
    held[2].push(pools[2].alloc(128 << 10, &stream).unwrap());
    drop(pools[2].alloc(64 << 10, &stream).unwrap());
    let shrunk: Vec<_> = on_all(&pools, |p| p.shrink().unwrap());
    let reports: Vec<_> = shrunk
        .iter()
        .map(|(_, r)| (r.pinned_blocks, r.live_buffers))
        .collect();
    assert_eq!(reports, [(2, 1), (2, 2), (2, 3)]);
    drop(held);
    let next = on_all(&shrunk, |(p, _)| {
        let b = p.alloc(128 << 10, &stream).unwrap();
        (b.segment(), b.offset_bytes(), b.allocation_seq())
    });
    assert!(next.iter().all(|n| *n == next[0]), "{next:?}");
    assert!(
        on_all(&shrunk, |(p, _)| p.close())
            .iter()
            .all(Result::is_ok)
    );
}

#[test]
fn a_survivor_that_met_the_loss_in_a_trim_or_reserve_catches_up_too() {
    // Rank 1 learned of the loss in a `trim` (or a `reserve`), whose agreement it
    // records before the round that failed: the shrink makes that call up on rank 0 as
    // a record, no memory changed, and both go on from one pool.
    for reserve in [false, true] {
        let (pools, held) = lost_after(host_groups(3), 1);
        let met = match reserve {
            true => pools[1].reserve(4 << 20).map(|_| ()),
            false => pools[1].trim().map(|_| ()),
        };
        assert_eq!(met.unwrap_err().kind(), ErrorKind::PeerLost);
        let shrunk: Vec<_> = on_all(&pools, |p| p.shrink().unwrap());
        let stream = Stream::host();
        let next = on_all(&shrunk, |(p, _)| {
            let b = p.alloc(256 << 10, &stream).unwrap();
            (b.segment(), b.offset_bytes(), b.allocation_seq())
        });
        assert_eq!(next[0], next[1]);
        drop((held, next));
        assert!(
            on_all(&shrunk, |(p, _)| p.close())
                .iter()
                .all(Result::is_ok)
        );
    }
}
