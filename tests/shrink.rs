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

// ---------------------------------------------------------------------------------
// One process per rank on the shared-memory backend: a rank killed in a collective,
// the survivors shrink the pool and train on.

use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;
use symmpool::backend::{Refused, Segment, SegmentProvider, Window};
use symmpool::{Coll, CollectiveCalls, PoolConfig, ReduceOp, Stream, SymmPool};

const ENTRY: &str = "child_process_entry";
/// Parameters of the toy model: divisible by 4 and by 3.
const N: usize = 12 * 256;
const STEPS: usize = 6;
/// The step in which the victim is killed (in its reduce-scatter, or in the window
/// registration of the growth every rank makes at its start).
const KILL_AT: usize = 3;
/// The registrations before the step `KILL_AT` (the first segment, on the two
/// communicators that register).
const REGISTRATIONS_BEFORE: usize = 2;

/// The victim's segments in the registration scenario: it stops inside its registration
/// of the growth at step `KILL_AT`, where the test kills it.
#[derive(Debug)]
struct StopInRegistration(Arc<dyn SegmentProvider>, AtomicUsize);

impl SegmentProvider for StopInRegistration {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        self.0.allocate(size_bytes)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> symmpool::Result<Option<Window>> {
        if self.1.fetch_add(1, Ordering::SeqCst) == REGISTRATIONS_BEFORE {
            println!("@@stalled");
            loop {
                thread::park();
            }
        }
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.0.register(segment, comm, deadline) }
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.0.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: the caller's contract is passed on unchanged.
        unsafe { self.0.free(segment) }
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
fn step(
    pool: &SymmPool,
    coll: &Coll,
    w: &mut Vec<f32>,
    step: usize,
    stop_before_collective: bool,
) -> symmpool::Result<()> {
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
    if stop_before_collective {
        println!("@@stalled");
        loop {
            thread::park();
        }
    }
    let shard = pool.alloc((n * 4) as u64, &stream)?;
    coll.reduce_scatter::<f32>(&grads, &shard, ReduceOp::Sum, &stream)?;
    let s = shard.read::<f32>()?;
    let params = pool.alloc((N * 4) as u64, &stream)?;
    let mine: Vec<f32> = (0..n)
        .map(|i| w[rank * n + i] - 0.1 * s[i] / world as f32)
        .collect();
    params
        .view::<f32>()?
        .slice(rank * n, n)?
        .copy_from_host(&mine)?;
    coll.all_gather_in_place::<f32>(&params, &stream)?;
    *w = params.read::<f32>()?;
    coll.end_step()
}

fn digest(w: &[f32]) -> u64 {
    w.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    })
}

fn child() -> symmpool::Result<i32> {
    let (rank, _, backend) = join()?;
    let victim: Option<usize> = var("CHILD_VICTIM").and_then(|v| v.parse().ok());
    let in_registration = var("CHILD_PHASE").as_deref() == Some("registration");
    let backend = if in_registration && victim == Some(rank) {
        backend.with_segments(|inner| Arc::new(StopInRegistration(inner, AtomicUsize::new(0))))
    } else {
        backend
    };
    let state_file = var("CHILD_STATE").unwrap();
    let config = PoolConfig::default().with_timeout(Duration::from_secs(60));
    let mut pool = SymmPool::new(backend, config)?;
    let mut coll = Coll::new(&pool)?;
    // A fresh job starts from the survivors' state; the first job from the start.
    let (mut w, mut at) = match var("CHILD_FROM_STATE") {
        Some(_) => {
            let text = std::fs::read_to_string(&state_file).unwrap();
            let mut words = text.split_whitespace();
            let at: usize = words.next().unwrap().parse().unwrap();
            let w: Vec<f32> = words.map(|x| f32::from_bits(x.parse().unwrap())).collect();
            (w, at)
        }
        None => ((0..N).map(|i| i as f32 * 1e-3).collect(), 0),
    };
    let mut shrunk_at: Option<Instant> = None;
    let job_rank = pool.rank();
    // A buffer of the old world that lives across the shrink.
    let kept = pool.alloc((N * 4) as u64, &Stream::host())?;
    let w0 = w.clone();
    kept.write(&w0)?;
    while at < STEPS {
        let killed_here = victim.is_some() && at == KILL_AT && pool.world_size() == 4;
        if killed_here && victim != Some(job_rank) {
            println!("@@waiting");
        }
        let stop = killed_here && victim == Some(job_rank) && !in_registration;
        match step(&pool, &coll, &mut w, at, stop) {
            Ok(()) => {
                if let Some(t) = shrunk_at.take() {
                    println!("@@first_step_ms {}", t.elapsed().as_millis());
                }
                at += 1;
            }
            Err(e @ (Error::PeerLost { .. } | Error::PoolBroken { .. })) => {
                println!("@@lost {e}");
                let t = Instant::now();
                let (next, report) = pool.shrink()?;
                drop(coll);
                pool = next;
                coll = Coll::new(&pool)?;
                shrunk_at = Some(t);
                // Its memory is still this rank's to read; no collective takes it.
                assert_eq!(kept.read::<f32>()?, w0);
                let refused = coll.all_gather_in_place::<f32>(&kept, &Stream::host());
                assert!(matches!(refused, Err(Error::Shrunk { .. })), "{refused:?}");
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
                if report.rank == 0 {
                    let words: Vec<String> = w.iter().map(|x| x.to_bits().to_string()).collect();
                    std::fs::write(&state_file, format!("{at} {}", words.join(" "))).unwrap();
                }
            }
            Err(e) => return Err(e),
        }
    }
    println!("@@final {:016x}", digest(&w));
    drop((coll, kept));
    pool.close()?;
    Ok(0)
}

#[test]
fn a_rank_killed_in_a_collective_leaves_three_survivors_that_shrink_and_train_on() {
    killed_in("collective");
}

#[test]
fn a_rank_killed_in_a_window_registration_leaves_three_survivors_that_shrink_and_train_on() {
    killed_in("registration");
}

/// A 4-rank job whose rank 2 is killed in `phase` at step `KILL_AT`: the survivors
/// shrink, finish the training, and end where a fresh 3-rank job from their state does.
fn killed_in(phase: &'static str) {
    let before = shm_entries();
    let dir = std::env::temp_dir().join(format!("symmpool-shrink-{phase}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state").display().to_string();
    let (world, victim) = (4, 2);
    let env = |extra: Vec<(&'static str, String)>| {
        let state = state.clone();
        move |_| {
            let mut v = vec![("CHILD_STATE", state.clone())];
            v.extend(extra.clone());
            v
        }
    };
    let mut job = Job::start(
        ENTRY,
        world,
        env(vec![
            ("CHILD_VICTIM", victim.to_string()),
            ("CHILD_PHASE", phase.to_string()),
        ]),
    );
    job.expect(victim, "@@stalled", Duration::from_secs(120));
    let survivors: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    for &r in &survivors {
        job.expect(r, "@@waiting", Duration::from_secs(60));
    }
    job.children[victim].kill().unwrap();
    let codes = job.wait(&survivors, Duration::from_secs(120));
    assert_eq!(codes, vec![0; survivors.len()], "{:?}", job.seen);
    let mut finals = Vec::new();
    for (new_rank, &r) in survivors.iter().enumerate() {
        let lost = job.expect(r, "@@lost ", Duration::from_secs(5));
        assert!(lost.contains("rank 2"), "{lost}");
        let shrunk = job.expect(r, "@@shrunk ", Duration::from_secs(5));
        // Dense ranks; every segment kept, registered once per new communicator that
        // registers (two); the growth of step KILL_AT went through before a kill in
        // the collective, and was undone everywhere after one in its registration.
        let (segments, registrations) = if phase == "collective" {
            (2, 4)
        } else {
            (1, 2)
        };
        assert!(
            shrunk.starts_with(&format!(
                "rank={new_rank} world=3 lost=[2] segments={segments} registrations={registrations} live=1 "
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
