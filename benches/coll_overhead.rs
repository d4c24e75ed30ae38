//! Host-side cost of one collective call through the crate (checks, path choice,
//! dispatch), measured against a backend whose collectives do nothing, beside a
//! direct call of that backend: the difference is what the crate adds per call.
//!
//! Instruction counts (BENCHMARKS.md, "Lean call path"): with `SYMMPOOL_CALL_PAIRS=N`
//! set, the binary skips criterion and makes N pairs of `all_gather_in_place` +
//! `reduce_scatter` on the same set-up as `collective_call`, each call tagged (as every
//! collective must be on a pool with the default settings), for `valgrind
//! --tool=callgrind`; (Ir(11 000) − Ir(1 000)) / 10 000 is one pair, set-up and exit
//! cancelling.

#![allow(missing_docs)] // criterion_group! expands to an undocumented `pub fn`.
use criterion::{Criterion, criterion_group};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
use symmpool::backend::{CollArgs, Collectives};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Group, GroupConfig, HostBackend, HostConfig, PoolConfig,
    Result, Stream, SymmBuffer, SymmPool,
};

/// Collectives that do nothing: what remains is the crate's own cost per call.
#[derive(Debug)]
struct NullCollectives;

impl Collectives for NullCollectives {
    fn all_gather(&self, a: &CollArgs<'_>) -> Result<()> {
        black_box(a);
        Ok(())
    }
    fn reduce_scatter(&self, a: &CollArgs<'_>) -> Result<()> {
        black_box(a);
        Ok(())
    }
}

/// Rank 0 of two host ranks (growth agrees between them) whose collectives do
/// nothing, unchecked: its pool, handle, a 2 MiB and a 1 MiB buffer, and the rank's
/// stream; rank 1's buffers, to keep them until the end.
///
/// The buffers come first: they are dropped before the handles and pools.
struct NullRank {
    buf: SymmBuffer,
    out: SymmBuffer,
    _peer: Vec<(SymmBuffer, SymmBuffer)>,
    colls: Vec<Coll>,
    pools: Vec<SymmPool>,
    stream: Stream,
}

fn null_rank() -> NullRank {
    let mut world = HostBackend::world(HostConfig::new(2)).expect("world");
    let b1 = world.pop().expect("rank 1");
    let b0 = world
        .pop()
        .expect("rank 0")
        .with_collectives(|_| Arc::new(NullCollectives));
    // Rank 1 makes no collectives: no checks (see `bench_checks` for their cost).
    let config = GroupConfig::default().with_check(CheckMode::Off);
    let groups = Group::world(vec![b0, b1], &config).expect("groups");
    let pools = SymmPool::world(&groups, &PoolConfig::default()).expect("pools");
    let colls = Coll::world(&pools).expect("collectives");
    let stream = Stream::host();
    let mut bufs = std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let stream = &stream;
                s.spawn(move || {
                    (
                        p.alloc(2 << 20, stream).expect("buffer"),
                        p.alloc(1 << 20, stream).expect("buffer"),
                    )
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank"))
            .collect::<Vec<_>>()
    });
    let (buf, out) = bufs.swap_remove(0);
    NullRank {
        buf,
        out,
        _peer: bufs,
        colls,
        pools,
        stream,
    }
}

/// `pairs` pairs of tagged `all_gather_in_place` + `reduce_scatter` on [`null_rank`]:
/// the loop whose instructions BENCHMARKS.md counts.
fn call_pairs(pairs: u64) {
    let r = null_rank();
    for _ in 0..pairs {
        r.colls[0]
            .tagged(0)
            .all_gather_in_place::<u8>(black_box(&r.buf), &r.stream)
            .expect("call");
        r.colls[0]
            .tagged(0)
            .reduce_scatter::<symmpool::bf16>(
                black_box(&r.buf),
                &r.out,
                symmpool::ReduceOp::Sum,
                &r.stream,
            )
            .expect("call");
    }
}

fn bench(c: &mut Criterion) {
    let r = null_rank();
    let (pool, coll, buf, out, stream) = (&r.pools[0], &r.colls[0], &r.buf, &r.out, &r.stream);
    let mut g = c.benchmark_group("collective_call");
    g.bench_function("backend_direct", |b| {
        // A segment of its own (pool memory is reachable only through the pool).
        let segment = pool
            .backend()
            .segments()
            .allocate(2 << 20)
            .expect("segment");
        let whole = segment.region(0, 2 << 20).expect("region");
        let args = CollArgs::new(
            0,
            whole.sub(0, 1 << 20).expect("chunk"),
            whole,
            1 << 20,
            symmpool::DType::U8,
            symmpool::ReduceOp::Sum,
            stream,
            (None, None),
            symmpool::Deadline::after(Duration::from_secs(60)),
        );
        b.iter(|| pool.backend().collectives().all_gather(black_box(&args)))
    });
    g.bench_function("all_gather_in_place", |b| {
        b.iter(|| {
            coll.tagged(0)
                .all_gather_in_place::<u8>(black_box(buf), stream)
                .expect("call")
        })
    });
    g.bench_function("reduce_scatter", |b| {
        b.iter(|| {
            coll.tagged(0)
                .reduce_scatter::<symmpool::bf16>(
                    black_box(buf),
                    out,
                    symmpool::ReduceOp::Sum,
                    stream,
                )
                .expect("call")
        })
    });
    g.finish();
}

/// The calling thread's cost per all-gather under each check mode: two ranks whose
/// collectives do nothing; rank 1 mirrors rank 0's iterations from its own thread (so
/// the async check's rounds and the strict check's round have a peer), and only rank
/// 0's loop is timed.
fn bench_checks(c: &mut Criterion) {
    let mut g = c.benchmark_group("checked_call");
    for mode in [CheckMode::Off, CheckMode::Async, CheckMode::Strict] {
        let world: Vec<_> = HostBackend::world(HostConfig::new(2))
            .expect("world")
            .into_iter()
            .map(|b| b.with_collectives(|_| Arc::new(NullCollectives)))
            .collect();
        let config = GroupConfig::default().with_check(mode);
        let groups = Group::world(world, &config).expect("groups");
        let pools = SymmPool::world(&groups, &PoolConfig::default()).expect("pools");
        let colls = Coll::world(&pools).expect("collectives");
        let bufs: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = pools
                .iter()
                .map(|p| s.spawn(move || p.alloc(2 << 20, &Stream::host()).expect("buffer")))
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank")).collect()
        });
        let (tx, rx) = std::sync::mpsc::channel::<u64>();
        let peer = std::thread::scope(|s| {
            let (peer_buf, peer) = (&bufs[1], &colls[1]);
            let h = s.spawn(move || {
                let stream = Stream::host();
                for n in rx {
                    for _ in 0..n {
                        peer.tagged(0)
                            .all_gather_in_place::<u8>(peer_buf, &stream)
                            .expect("peer call");
                    }
                }
                peer.wait_checks()
            });
            let stream = Stream::host();
            g.bench_function(format!("all_gather_in_place_{}", mode.name()), |b| {
                b.iter_custom(|iters| {
                    tx.send(iters).expect("peer");
                    let t = Instant::now();
                    for _ in 0..iters {
                        colls[0]
                            .tagged(0)
                            .all_gather_in_place::<u8>(black_box(&bufs[0]), &stream)
                            .expect("call");
                    }
                    let took = t.elapsed();
                    // Let the checks catch up outside the timed loop, so the next
                    // sample starts with an empty queue.
                    colls[0].wait_checks().expect("checks");
                    took
                })
            });
            drop(tx);
            h.join().expect("peer")
        });
        peer.expect("peer checks");
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3));
    targets = bench, bench_checks
}

#[path = "common/quiet.rs"]
mod quiet;

// `criterion_main!`, quiet under `cargo test` (see `common/quiet.rs`).
fn main() {
    if let Some(pairs) = std::env::var_os("SYMMPOOL_CALL_PAIRS") {
        let pairs = pairs.to_str().and_then(|n| n.parse().ok());
        call_pairs(pairs.expect("SYMMPOOL_CALL_PAIRS: a number of call pairs"));
        return;
    }
    quiet::in_test_mode();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
