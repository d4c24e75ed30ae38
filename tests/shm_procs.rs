//! One process per rank on the shared-memory host backend, as real jobs run: 2, 4 and 8
//! processes place identically, move and reduce real data through each other's
//! memory, report a divergence on every rank naming the first differing call, and a
//! rank killed with `kill -9` in an agreement is reported by every survivor, naming
//! it, within the control plane's bound. Nothing is left in `/dev/shm`.

mod common;

use common::procs::{CHILD, Job};
use common::rng::Rng;
use std::sync::Arc;
use std::time::{Duration, Instant};
use symmpool::backend::{ShmBackend, ShmConfig};
use symmpool::control::{StoreConfig, StoreExchange, StoreServer};
use symmpool::{Error, PoolConfig, ReduceOp, Stream, SymmPool, coll};

const MIB: u64 = 1 << 20;
const ENTRY: &str = "child_process_entry";

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

/// Join the job: rank 0 hosts the store (and reports its port), everyone connects.
fn join() -> symmpool::Result<(usize, usize, symmpool::Backend)> {
    let mut cfg = StoreConfig::from_env()?;
    let rank = cfg.launch.rank;
    let world = cfg.launch.world_size;
    let ex = if rank == 0 {
        let server = StoreServer::bind("127.0.0.1:0", &cfg)?;
        println!("@@port {}", server.local_addr().port());
        cfg.host_server = true;
        StoreExchange::connect_hosting(cfg, server)?
    } else {
        cfg.host_server = false;
        StoreExchange::connect(cfg)?
    };
    let backend = ShmBackend::join(
        Arc::new(ex),
        ShmConfig::default().with_timeout(Duration::from_secs(60)),
    )?;
    Ok((rank, world, backend))
}

fn child() -> symmpool::Result<i32> {
    let (rank, world, backend) = join()?;
    // PyTorch's caching policy: every large request grows the pool (an agreement), so
    // the divergence test sees one at call 3.
    let config = PoolConfig::default()
        .with_timeout(Duration::from_secs(60))
        .with_core(symmpool::core::CoreConfig::default());
    let pool = SymmPool::new(backend, config)?;
    let stream = Stream::host();
    match var("CHILD_ROLE").as_deref() {
        Some("collectives") => {
            // The same seeded call sequence on every rank: placements must agree.
            let mut rng = Rng(7);
            let mut live = Vec::new();
            let mut digest = 0u64;
            for _ in 0..40 {
                if !live.is_empty() && rng.next().is_multiple_of(3) {
                    let i = (rng.next() % live.len() as u64) as usize;
                    live.swap_remove(i);
                } else {
                    let bytes = 1 + rng.next() % (24 * MIB);
                    let b = pool.alloc(bytes, &stream)?;
                    digest =
                        digest.rotate_left(7) ^ (b.segment().0 as u64) << 40 ^ b.offset_bytes();
                    live.push(b);
                }
            }
            drop(live);
            // All-gather in place: each rank's shard lands in every rank's buffer.
            // Odd sizes; smaller with more ranks (the plain path moves every rank's
            // input through the control plane).
            let n = 400_009 / world;
            let params = pool.alloc((world * n * 4) as u64, &stream)?;
            let shard: Vec<f32> = (0..n).map(|i| (rank * 1_000_000 + i) as f32).collect();
            params
                .view::<f32>()?
                .slice(rank * n, n)?
                .copy_from_host(&shard)?;
            let report = coll::all_gather_in_place::<f32>(&params, &stream)?;
            let all = params.read::<f32>()?;
            for r in 0..world {
                for i in [0, n / 2, n - 1] {
                    assert_eq!(
                        all[r * n + i],
                        (r * 1_000_000 + i) as f32,
                        "rank {r} element {i}"
                    );
                }
            }
            // Reduce-scatter (sum) out of place, on both paths.
            for plain in [false, true] {
                let input = pool.alloc((world * n * 4) as u64, &stream)?;
                let out = pool.alloc((n * 4) as u64, &stream)?;
                let mine: Vec<f32> = (0..world * n).map(|i| (i % 97 + rank) as f32).collect();
                input.write(&mine)?;
                let policy = coll::PathPolicy::default().with_choices(
                    coll::Choice::Auto,
                    if plain {
                        coll::Choice::Prefer(coll::Path::PlainKernel)
                    } else {
                        coll::Choice::Prefer(coll::Path::SymmetricKernel)
                    },
                );
                coll::set_path_policy(&pool, policy)?;
                let rs = coll::reduce_scatter::<f32>(&input, &out, ReduceOp::Sum, &stream)?;
                let got = out.read::<f32>()?;
                let ranks_sum = (world * (world - 1) / 2) as f32;
                for i in [0, n / 3, n - 1] {
                    let want = world as f32 * ((rank * n + i) % 97) as f32 + ranks_sum;
                    assert_eq!(got[i], want, "{:?} element {i}", rs.path);
                }
                println!("@@path {:?}", rs.path);
            }
            println!("@@placement {digest:016x} all-gather {:?}", report.path);
            drop(params);
            pool.close()?;
            Ok(0)
        }
        Some("diverge") => {
            // Rank 1 asks for another size at call 3; the growth agreement names it.
            let mut keep = Vec::new();
            for call in 1..=3u64 {
                let bytes = if call == 3 && rank == 1 {
                    48 * MIB
                } else {
                    32 * MIB
                };
                match pool.alloc(bytes, &stream) {
                    Ok(b) => keep.push(b),
                    Err(Error::Divergence(d)) => {
                        println!("@@divergence first={:?}", d.first_differing_call);
                        return Ok(0);
                    }
                    Err(e) => return Err(e),
                }
            }
            println!("@@no divergence");
            Ok(3)
        }
        Some("victim") => {
            let victim: usize = var("CHILD_VICTIM")
                .and_then(|v| v.parse().ok())
                .unwrap_or(1);
            let b = pool.alloc(4 * MIB, &stream)?;
            drop(b);
            if rank == victim {
                println!("@@stalled");
                std::thread::sleep(Duration::from_secs(300));
                return Ok(9);
            }
            println!("@@waiting");
            let t0 = Instant::now();
            match pool.trim() {
                Err(Error::PeerLost { rank: lost, op, .. }) => {
                    println!(
                        "@@lost rank={lost} op={op} after={}ms",
                        t0.elapsed().as_millis()
                    );
                    Ok(0)
                }
                other => {
                    println!("@@unexpected {other:?}");
                    Ok(3)
                }
            }
        }
        other => {
            println!("@@unknown role {other:?}");
            Ok(4)
        }
    }
}

fn shm_entries() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            let mut v: Vec<String> = d
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        })
        .unwrap_or_default()
}

fn role(role: &'static str) -> impl Fn(usize) -> Vec<(&'static str, String)> {
    // The store's default heartbeat timeout: 8 processes on 2 cores moving data
    // through the store must not look frozen.
    move |_| {
        vec![
            ("CHILD_ROLE", role.to_string()),
            ("SYMMPOOL_HEARTBEAT_TIMEOUT_MS", "5000".to_string()),
        ]
    }
}

#[test]
fn processes_place_identically_and_move_real_data() {
    let before = shm_entries();
    for world in [2, 4, 8] {
        let mut job = Job::start(ENTRY, world, role("collectives"));
        let all: Vec<usize> = (0..world).collect();
        let codes = job.wait(&all, Duration::from_secs(240));
        if codes != vec![0; world] {
            let errors: Vec<String> = all
                .iter()
                .map(|&r| job.expect(r, "@@error", Duration::from_secs(5)))
                .collect();
            panic!("world {world}: exit codes {codes:?}: {errors:?}");
        }
        let placements: Vec<String> = all
            .iter()
            .map(|&r| job.expect(r, "@@placement ", Duration::from_secs(5)))
            .collect();
        assert!(
            placements.iter().all(|p| *p == placements[0]),
            "world {world}: {placements:?}"
        );
        assert!(
            placements[0].contains("all-gather SymmetricKernel"),
            "{placements:?}"
        );
        let paths: Vec<String> = (0..2)
            .map(|_| job.expect(0, "@@path ", Duration::from_secs(5)))
            .collect();
        assert_eq!(paths, ["SymmetricKernel", "PlainKernel"]);
    }
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}

#[test]
fn a_divergence_between_processes_names_the_first_differing_call_on_every_rank() {
    let mut job = Job::start(ENTRY, 3, role("diverge"));
    let codes = job.wait(&[0, 1, 2], Duration::from_secs(120));
    assert_eq!(codes, vec![0; 3], "{:?}", job.seen);
    for r in 0..3 {
        assert_eq!(
            job.expect(r, "@@divergence ", Duration::from_secs(5)),
            "first=Some(3)"
        );
    }
}

#[test]
fn kill_9_in_an_agreement_is_reported_by_every_survivor_naming_the_rank() {
    let before = shm_entries();
    let world = 4;
    let victim = 2;
    let mut job = Job::start(ENTRY, world, |_| {
        vec![
            ("CHILD_ROLE", "victim".to_string()),
            ("CHILD_VICTIM", victim.to_string()),
        ]
    });
    job.expect(victim, "@@stalled", Duration::from_secs(120));
    let others: Vec<usize> = (0..world).filter(|&r| r != victim).collect();
    for &r in &others {
        job.expect(r, "@@waiting", Duration::from_secs(60));
    }
    let t0 = Instant::now();
    job.children[victim].kill().unwrap();
    let codes = job.wait(&others, Duration::from_secs(60));
    let took = t0.elapsed();
    assert_eq!(codes, vec![0; others.len()], "{:?}", job.seen);
    for &r in &others {
        let line = job.expect(r, "@@lost ", Duration::from_secs(5));
        assert!(
            line.starts_with(&format!("rank={victim} op=trim")),
            "{line}"
        );
    }
    // The control plane's bound for a dead process: its socket closes at once.
    assert!(took < Duration::from_secs(10), "survivors took {took:?}");
    drop(job);
    assert_eq!(shm_entries(), before, "nothing left in /dev/shm");
}
