//! Healing after a loss: the survivors of a lost rank shrink, a newcomer joins later,
//! and the grown group computes what a fresh group of its size computes from the same
//! state.
//!
//! Ranks as threads of one host world (a rank whose thread ends is lost to the
//! others), and as processes on the shared-memory backend with the store outside the
//! ranks (a rank that exits is lost; its replacement starts with `SYMMPOOL_JOIN=1`).

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};
use symmpool::backend::{Refused, Segment, SegmentProvider, Window};
use symmpool::{
    Backend, Coll, CollectiveCalls, Deadline, Error, ErrorKind, Group, GroupConfig, GrowReport,
    HostBackend, HostConfig, PoolConfig, ReduceOp, Stream, SymmPool,
};

/// Parameters of the toy model: divisible by 3 and by 4.
const N: usize = 12 * 1024;
const STEPS: usize = 8;
/// The step the lost rank does not reach.
const LOSS_AT: usize = 2;
/// The step at whose start the survivors grow.
const HEAL_AT: usize = 5;
const TIMEOUT: Duration = Duration::from_secs(30);

/// One data-parallel step, sharded as FSDP shards it: every rank's gradient is
/// reduce-scattered, each rank updates its shard, the shards are all-gathered.
fn step(pool: &SymmPool, coll: &Coll, w: &mut Vec<f32>, at: usize) -> symmpool::Result<()> {
    let (rank, world) = (pool.rank(), pool.world_size());
    let stream = Stream::host();
    let n = N / world;
    let g: Vec<f32> = (w.iter().enumerate())
        .map(|(i, x)| {
            x * 0.5 + (rank + 1) as f32 * 0.01 + at as f32 * 0.001 + (i % 7) as f32 * 1e-4
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

/// Train `pool` from `w` at step `at` to `STEPS`; the final parameters and the
/// placement of a buffer allocated at the end (the same on every rank).
fn train_from(
    pool: SymmPool,
    (mut w, mut at): (Vec<f32>, usize),
) -> symmpool::Result<(Vec<f32>, (u32, u64))> {
    let coll = Coll::new(&pool)?;
    while at < STEPS {
        step(&pool, &coll, &mut w, at)?;
        at += 1;
    }
    let last = pool.alloc(3 << 20, &Stream::host())?;
    let placed = (last.segment().0, last.offset_bytes());
    drop((coll, last));
    pool.close()?;
    Ok((w, placed))
}

fn initial() -> Vec<f32> {
    (0..N).map(|i| i as f32 * 1e-3).collect()
}

fn group(backend: Backend) -> symmpool::Result<Group> {
    Group::new(backend, GroupConfig::default().with_timeout(TIMEOUT))
}

/// What a survivor did.
struct Healed {
    report: GrowReport,
    /// The state at the grow.
    at_grow: (Vec<f32>, usize),
    out: (Vec<f32>, (u32, u64)),
}

/// A survivor: trains, shrinks past the loss, grows at `HEAL_AT` (rank 0 sends the
/// newcomer the state then), trains on at the full size.
fn survivor(
    backend: Backend,
    to_newcomer: mpsc::Sender<(Vec<f32>, usize)>,
) -> symmpool::Result<Healed> {
    let group = group(backend)?;
    let mut pool = SymmPool::new(&group, PoolConfig::default())?;
    let mut coll = Coll::new(&pool)?;
    // A buffer of the first world, alive across the shrink and the grow.
    let kept = pool.alloc(1 << 20, &Stream::host())?;
    kept.write(&[7u8; 1 << 20])?;
    let (mut w, mut at) = (initial(), 0);
    while at < HEAL_AT {
        match step(&pool, &coll, &mut w, at) {
            Ok(()) => at += 1,
            Err(e) if e.kind() == ErrorKind::PeerLost => {
                drop(coll);
                pool = pool.shrink()?.0;
                coll = Coll::new(&pool)?;
            }
            Err(e) => return Err(e),
        }
    }
    drop(coll);
    assert_eq!(pool.world_size(), 3);
    let (grown, report) = pool.grow(true)?.expect("a newcomer waits");
    if grown.rank() == 0 {
        to_newcomer.send((w.clone(), at)).unwrap();
    }
    // The old pool refuses; its buffer is still this rank's to read, and its block
    // stays allocated when it goes.
    assert!(matches!(
        pool.alloc(4096, &Stream::host()),
        Err(Error::Shrunk { .. })
    ));
    assert_eq!(kept.read::<u8>()?, vec![7u8; 1 << 20]);
    drop(kept);
    let at_grow = (w.clone(), at);
    let out = train_from(grown, (w, at))?;
    Ok(Healed {
        report,
        at_grow,
        out,
    })
}

#[test]
fn four_ranks_lose_one_shrink_to_three_grow_back_to_four_and_match_a_fresh_four() {
    let backends = HostBackend::world(HostConfig::new(4)).unwrap();
    let newcomer = HostBackend::newcomer(&backends[0]).unwrap();
    let (tx, rx) = mpsc::channel();
    let mut backends = backends.into_iter();
    let survivors: Vec<Backend> = backends.by_ref().take(3).collect();
    let lost = backends.next().unwrap();
    let (healed, joined) = thread::scope(|s| {
        // Rank 3 trains until `LOSS_AT`, then its thread ends: lost.
        s.spawn(move || {
            let group = group(lost).unwrap();
            let pool = SymmPool::new(&group, PoolConfig::default()).unwrap();
            let coll = Coll::new(&pool).unwrap();
            let _kept = pool.alloc(1 << 20, &Stream::host()).unwrap();
            let mut w = initial();
            for at in 0..LOSS_AT {
                step(&pool, &coll, &mut w, at).unwrap();
            }
        });
        let hs: Vec<_> = (survivors.into_iter())
            .map(|b| {
                let tx = tx.clone();
                s.spawn(move || survivor(b, tx))
            })
            .collect();
        let joined = s.spawn(move || {
            let backend =
                HostBackend::join(newcomer, HostConfig::new(4), Deadline::after(TIMEOUT))?;
            let (pool, report) = SymmPool::join(&group(backend)?, PoolConfig::default())?;
            let state = rx.recv_timeout(TIMEOUT).expect("the survivors' state");
            Ok::<_, Error>((report, train_from(pool, state)?))
        });
        let healed: Vec<Healed> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        (healed, joined.join().unwrap().unwrap())
    });
    // The grown group: the survivors keep their ranks, the newcomer is rank 3; every
    // segment registered once per registering communicator.
    let (joined_report, joined_out) = joined;
    for (r, h) in healed.iter().enumerate() {
        assert_eq!(
            (h.report.rank, h.report.world_size, h.report.old_world_size),
            (r, 4, 3)
        );
        assert_eq!(h.report.newcomers, [3]);
        assert_eq!(h.report.segments, joined_report.segments);
        assert_eq!(h.report.registrations, joined_report.registrations);
        assert!(h.report.pinned_blocks >= 1, "{:?}", h.report);
    }
    assert_eq!((joined_report.rank, joined_report.world_size), (3, 4));
    let registering = 2; // the symmetric and copy-engine communicators
    assert_eq!(
        joined_report.registrations,
        registering * joined_report.segments as u64
    );
    // Every rank, the newcomer included, ends with the same parameters and places
    // its last buffer at the same (segment, offset).
    for h in &healed {
        assert_eq!(h.out, joined_out);
    }
    // A fresh 4-rank world from the state at the grow computes the same.
    let at_grow = healed[0].at_grow.clone();
    let fresh = SymmPool::world(
        &Group::world(
            HostBackend::world(HostConfig::new(4)).unwrap(),
            &GroupConfig::default(),
        )
        .unwrap(),
        &PoolConfig::default(),
    )
    .unwrap();
    let fresh: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (fresh.into_iter())
            .map(|p| {
                let state = at_grow.clone();
                s.spawn(move || train_from(p, state).unwrap())
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for f in fresh {
        assert_eq!(f.0, joined_out.0, "the parameters after the heal");
    }
}

#[test]
fn a_grow_with_no_newcomer_is_none_on_every_rank_and_the_pools_go_on() {
    let pools = SymmPool::host_group(3, PoolConfig::default()).unwrap();
    let out: Vec<_> = thread::scope(|s| {
        let hs: Vec<_> = (pools.iter())
            .map(|p| s.spawn(move || p.grow(false).map(|g| g.is_none())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(out.iter().all(|r| matches!(r, Ok(true))), "{out:?}");
    thread::scope(|s| {
        for p in &pools {
            s.spawn(move || step(p, &Coll::new(p).unwrap(), &mut initial(), 0).unwrap());
        }
    });
}

/// A rank lost while the others ask to grow: they get `PeerLost`, shrink past it, and
/// grow with the newcomer that was waiting all along.
#[test]
fn a_rank_lost_while_the_others_grow_is_a_loss_they_shrink_past_then_grow() {
    let backends = HostBackend::world(HostConfig::new(3)).unwrap();
    let newcomer = HostBackend::newcomer(&backends[0]).unwrap();
    let mut backends = backends.into_iter();
    let ranks: Vec<Backend> = backends.by_ref().take(2).collect();
    let lost = backends.next().unwrap();
    let sizes = thread::scope(|s| {
        let hs: Vec<_> = (ranks.into_iter())
            .map(|b| {
                s.spawn(move || {
                    let pool = SymmPool::new(&group(b)?, PoolConfig::default())?;
                    let e = pool.grow(true).map(|_| ()).unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::PeerLost, "{e}");
                    let (shrunk, _) = pool.shrink()?;
                    let (grown, report) = shrunk.grow(true)?.expect("the newcomer");
                    assert_eq!(report.newcomers, [2]);
                    step(&grown, &Coll::new(&grown)?, &mut initial(), 0)?;
                    grown.close()?;
                    Ok::<_, Error>(grown.world_size())
                })
            })
            .collect();
        // Rank 2 makes its pool, then its thread ends while the others ask to grow.
        s.spawn(move || drop(SymmPool::new(&group(lost).unwrap(), PoolConfig::default())));
        let joined = s.spawn(move || {
            let backend =
                HostBackend::join(newcomer, HostConfig::new(3), Deadline::after(TIMEOUT))?;
            let (pool, _) = SymmPool::join(&group(backend)?, PoolConfig::default())?;
            step(&pool, &Coll::new(&pool)?, &mut initial(), 0)?;
            pool.close()?;
            Ok::<_, Error>(pool.world_size())
        });
        let mut sizes: Vec<usize> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        sizes.push(joined.join().unwrap().unwrap());
        sizes
    });
    assert_eq!(sizes, [3, 3, 3]);
}

/// A newcomer that dies after the group grew with it, before its pool joined: a loss
/// of the grown group, which the others shrink past back to their size.
#[test]
fn a_newcomer_that_dies_while_joining_is_a_loss_the_others_shrink_past() {
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    let newcomer = HostBackend::newcomer(&backends[0]).unwrap();
    let sizes = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter())
            .map(|b| {
                s.spawn(move || {
                    let pool = SymmPool::new(&group(b)?, PoolConfig::default())?;
                    let e = pool.grow(true).map(|_| ()).unwrap_err();
                    assert!(matches!(e, Error::PeerLost { rank: 2, .. }), "{e}");
                    // The shrink goes on from the grown group, without the newcomer
                    // (never a rank of this pool's world: none of its ranks is lost).
                    let (shrunk, report) = pool.shrink()?;
                    assert_eq!((report.world_size, report.lost_ranks.len()), (2, 0));
                    step(&shrunk, &Coll::new(&shrunk)?, &mut initial(), 0)?;
                    shrunk.close()?;
                    Ok::<_, Error>(shrunk.world_size())
                })
            })
            .collect();
        // Its backend is made with theirs; then its thread ends.
        s.spawn(move || {
            drop(HostBackend::join(
                newcomer,
                HostConfig::new(3),
                Deadline::after(TIMEOUT),
            ))
        });
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(sizes, [2, 2]);
}

/// A newcomer's segment provider: `allowed` allocations, then a full device; `live`
/// counts the segments it allocated and that were not freed.
#[derive(Debug)]
struct Short {
    inner: Arc<dyn SegmentProvider>,
    allowed: AtomicUsize,
    live: Arc<AtomicUsize>,
}

impl SegmentProvider for Short {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<Segment> {
        let take = |n: usize| n.checked_sub(1);
        if self.allowed.fetch_update(SeqCst, SeqCst, take).is_err() {
            return Err(Error::DeviceOutOfMemory {
                segment_bytes: size_bytes,
                op: "ncclMemAlloc",
                code: 2,
                message: "injected".into(),
            });
        }
        let segment = self.inner.allocate(size_bytes)?;
        self.live.fetch_add(1, SeqCst);
        Ok(segment)
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: Deadline,
    ) -> symmpool::Result<Option<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.register(segment, comm, deadline) }
    }
    unsafe fn deregister(&self, window: Window, deadline: Deadline) -> Result<(), Refused<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> Result<(), Refused<Segment>> {
        self.live.fetch_sub(1, SeqCst);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.free(segment) }
    }
}

/// A newcomer that cannot allocate every segment of the group's pool: the grow fails
/// at once on every rank with `PeerOutOfMemory` naming it, and the newcomer frees the
/// segments it did allocate (dropping one would leak device memory on NCCL).
#[test]
fn a_newcomer_short_of_memory_fails_the_grow_everywhere_and_frees_its_segments() {
    let backends = HostBackend::world(HostConfig::new(2)).unwrap();
    let newcomer = HostBackend::newcomer(&backends[0]).unwrap();
    let live = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let (ranks, joined) = thread::scope(|s| {
        let hs: Vec<_> = (backends.into_iter())
            .map(|b| {
                s.spawn(move || {
                    let pool = SymmPool::new(&group(b)?, PoolConfig::default())?;
                    // Two segments, a small and a large one.
                    let stream = Stream::host();
                    drop((pool.alloc(4096, &stream)?, pool.alloc(3 << 20, &stream)?));
                    Ok::<_, Error>(pool.grow(true).map(|_| ()).unwrap_err())
                })
            })
            .collect();
        let live = live.clone();
        let joined = s.spawn(move || {
            let backend =
                HostBackend::join(newcomer, HostConfig::new(3), Deadline::after(TIMEOUT))?;
            let backend = backend.with_segments(|inner| {
                let allowed = AtomicUsize::new(1);
                Arc::new(Short {
                    inner,
                    allowed,
                    live,
                })
            });
            SymmPool::join(&group(backend)?, PoolConfig::default()).map(|_| ())
        });
        let ranks: Vec<Error> = hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect();
        (ranks, joined.join().unwrap().unwrap_err())
    });
    assert!(
        started.elapsed() < TIMEOUT / 2,
        "no rank waited out a timeout"
    );
    for e in ranks.iter().chain([&joined]) {
        assert!(
            matches!(e, Error::PeerOutOfMemory { ranks, .. } if *ranks == [2]),
            "{e:?}"
        );
    }
    assert_eq!(live.load(SeqCst), 0, "the newcomer's segments are freed");
}

// One process per rank on the shared-memory backend, the store in the test's process.

mod common;

use common::procs::{CHILD, Job};
use common::shm::{join, shm_entries};
use symmpool::control::{JobEnd, Launch, StoreConfig, StoreServer};

const ENTRY: &str = "child_process_entry";

#[test]
fn child_process_entry() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let code = match child() {
        Ok(()) => 0,
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

fn digest(w: &[f32]) -> u64 {
    w.iter().fold(0xcbf2_9ce4_8422_2325, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    })
}

fn save(path: &str, (w, at): &(Vec<f32>, usize)) {
    let words: Vec<String> = w.iter().map(|x| x.to_bits().to_string()).collect();
    let tmp = format!("{path}.tmp");
    std::fs::write(&tmp, format!("{at} {}", words.join(" "))).unwrap();
    std::fs::rename(tmp, path).unwrap();
}

fn load(path: &str) -> (Vec<f32>, usize) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut words = text.split_whitespace();
    let at = words.next().unwrap().parse().unwrap();
    (
        words.map(|x| f32::from_bits(x.parse().unwrap())).collect(),
        at,
    )
}

/// A rank of the job: the victim leaves at `LOSS_AT`; the survivors shrink, and at
/// `HEAL_AT` save the state and grow; a newcomer joins, loads the state, and says how
/// long it took from its start to its first collective; a fresh job starts from the
/// state. Every rank prints its final parameters' digest.
fn child() -> symmpool::Result<()> {
    let started = Instant::now();
    let state_file = var("CHILD_STATE").unwrap();
    let (_, _, backend) = join()?;
    let group = group(backend)?;
    let (mut pool, mut state) = match (var("SYMMPOOL_JOIN"), var("CHILD_FROM_STATE")) {
        (Some(_), _) => {
            let (pool, report) = SymmPool::join(&group, PoolConfig::default())?;
            println!(
                "@@joined rank={} world={} segments={}",
                report.rank, report.world_size, report.segments
            );
            (pool, load(&state_file))
        }
        (None, Some(_)) => (
            SymmPool::new(&group, PoolConfig::default())?,
            load(&state_file),
        ),
        (None, None) => (
            SymmPool::new(&group, PoolConfig::default())?,
            (initial(), 0),
        ),
    };
    let victim: Option<usize> = var("CHILD_VICTIM").and_then(|v| v.parse().ok());
    let mut coll = Coll::new(&pool)?;
    while state.1 < STEPS {
        let at = state.1;
        if victim == Some(pool.rank()) && at == LOSS_AT && pool.world_size() == 4 {
            println!("@@leaving");
            std::process::exit(0);
        }
        if at == HEAL_AT && pool.world_size() == 3 {
            drop(coll);
            if pool.rank() == 0 {
                save(&state_file, &state);
            }
            println!("@@waiting_grow");
            let (grown, report) = pool.grow(true)?.expect("a newcomer");
            println!(
                "@@grown rank={} world={} newcomers={:?}",
                report.rank, report.world_size, report.newcomers
            );
            pool = grown;
            coll = Coll::new(&pool)?;
        }
        match step(&pool, &coll, &mut state.0, at) {
            Ok(()) => state.1 += 1,
            Err(e) if e.kind() == ErrorKind::PeerLost => {
                drop(coll);
                pool = pool.shrink()?.0;
                println!("@@shrunk rank={} world={}", pool.rank(), pool.world_size());
                coll = Coll::new(&pool)?;
                continue;
            }
            Err(e) => return Err(e),
        }
        if at == HEAL_AT && var("SYMMPOOL_JOIN").is_some() {
            println!("@@first_collective_ms {}", started.elapsed().as_millis());
        }
    }
    println!("@@final {:016x}", digest(&state.0));
    drop(coll);
    pool.close()
}

/// Four processes, rank 1 leaves, three shrink and train on; at `HEAL_AT` they grow
/// with a newcomer started as job rank 1: the four end where a fresh 4-rank job from
/// the state at the grow does, and nothing is left behind.
#[test]
fn four_processes_lose_rank_1_and_a_newcomer_heals_the_job_back_to_four() {
    let before = shm_entries();
    let dir = std::env::temp_dir().join(format!("symmpool-grow-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("state").display().to_string();
    let mut c = StoreConfig::new(Launch::explicit(0, 4, "127.0.0.1", 0).unwrap());
    c.token = Some("job-token".into());
    c.heartbeat_interval = Duration::from_millis(common::procs::HEARTBEAT_MS);
    c.heartbeat_timeout = Duration::from_millis(common::procs::HEARTBEAT_TIMEOUT_MS);
    c.startup_timeout = Duration::from_secs(60);
    let server = StoreServer::bind("127.0.0.1:0", &c).unwrap();
    let env = |extra: Vec<(&'static str, String)>| {
        let state = state.clone();
        move |_| {
            let mut v = vec![("CHILD_STATE", state.clone())];
            v.extend(extra.clone());
            v
        }
    };
    let port = server.local_addr().port();
    let first = vec![
        ("CHILD_VICTIM", "1".into()),
        ("SYMMPOOL_STORE_EXTERNAL", "1".into()),
    ];
    let mut job = Job::start_on_port(ENTRY, 4, port, env(first));
    job.expect(1, "@@leaving", Duration::from_secs(120));
    let survivors = [0, 2, 3];
    for (new_rank, &r) in survivors.iter().enumerate() {
        let shrunk = job.expect(r, "@@shrunk ", Duration::from_secs(60));
        assert_eq!(shrunk, format!("rank={new_rank} world=3"));
        job.expect(r, "@@waiting_grow", Duration::from_secs(60));
    }
    // The replacement: job rank 1 again, joining.
    let extra = [
        ("CHILD_STATE", state.clone()),
        ("SYMMPOOL_STORE_EXTERNAL", "1".into()),
        ("SYMMPOOL_JOIN", "1".into()),
    ];
    job.spawn(1, 4, &extra);
    let newcomer = 4;
    let joined = job.expect(newcomer, "@@joined ", Duration::from_secs(60));
    assert!(joined.starts_with("rank=1 world=4 "), "{joined}");
    for (r, rank) in [(0, 0), (2, 2), (3, 3)] {
        let grown = job.expect(r, "@@grown ", Duration::from_secs(60));
        assert_eq!(grown, format!("rank={rank} world=4 newcomers=[1]"));
    }
    let first_ms: u64 = job
        .expect(newcomer, "@@first_collective_ms ", Duration::from_secs(60))
        .parse()
        .unwrap();
    println!("from the newcomer's start to its first collective at world size 4: {first_ms} ms");
    assert!(first_ms <= 2000, "{first_ms} ms");
    let ranks = [0, 2, 3, newcomer];
    let codes = job.wait(&ranks, Duration::from_secs(120));
    assert_eq!(codes, vec![0; 4], "{:?}", job.seen);
    let finals: Vec<String> = ranks
        .iter()
        .map(|&r| job.expect(r, "@@final ", Duration::from_secs(5)))
        .collect();
    assert!(finals.iter().all(|f| *f == finals[0]), "{finals:?}");
    drop(job);
    assert_eq!(
        server.wait_until_done(Deadline::after(Duration::from_secs(10))),
        JobEnd::Ended
    );
    // A fresh 4-rank job from the state at the grow ends where the healed one did.
    let mut fresh = Job::start(ENTRY, 4, env(vec![("CHILD_FROM_STATE", "1".into())]));
    let codes = fresh.wait(&[0, 1, 2, 3], Duration::from_secs(120));
    assert_eq!(codes, vec![0; 4], "{:?}", fresh.seen);
    for r in 0..4 {
        assert_eq!(
            fresh.expect(r, "@@final ", Duration::from_secs(5)),
            finals[0]
        );
    }
    drop(fresh);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}
