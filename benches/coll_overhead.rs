//! Host-side cost of one collective call through the crate (checks, path choice,
//! dispatch), measured against a backend whose collectives do nothing, beside a
//! direct call of that backend: the difference is what the crate adds per call.

#![allow(missing_docs)] // criterion_group! expands to an undocumented `pub fn`.
use criterion::{Criterion, criterion_group};
use std::hint::black_box;
use std::sync::Arc;
use symmpool::backend::{CollArgs, Collectives};
use symmpool::{HostBackend, HostConfig, PoolConfig, Result, Stream, SymmPool, coll};

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

fn bench(c: &mut Criterion) {
    // Two host ranks (growth agrees between them); rank 0's collectives do nothing.
    let mut world = HostBackend::world(HostConfig::new(2)).expect("world");
    let b1 = world.pop().expect("rank 1");
    let b0 = world
        .pop()
        .expect("rank 0")
        .with_collectives(|_| Arc::new(NullCollectives));
    let pools = SymmPool::group(vec![b0, b1], &PoolConfig::default()).expect("pools");
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
    let pool = &pools[0];
    let mut g = c.benchmark_group("collective_call");
    g.bench_function("backend_direct", |b| {
        let whole = buf.region().expect("region");
        let args = CollArgs::new(
            0,
            whole.sub(0, 1 << 20).expect("chunk"),
            whole,
            1 << 20,
            symmpool::DType::U8,
            symmpool::ReduceOp::Sum,
            &stream,
            (buf.window(0), buf.window(0)),
        );
        b.iter(|| pool.backend().collectives().all_gather(black_box(&args)))
    });
    g.bench_function("all_gather_in_place", |b| {
        b.iter(|| coll::all_gather_in_place::<u8>(black_box(&buf), &stream).expect("call"))
    });
    g.bench_function("reduce_scatter", |b| {
        b.iter(|| {
            coll::reduce_scatter::<symmpool::bf16>(
                black_box(&buf),
                &out,
                symmpool::ReduceOp::Sum,
                &stream,
            )
            .expect("call")
        })
    });
    g.finish();
    drop((buf, out, bufs));
}

criterion_group!(benches, bench);

#[path = "common/quiet.rs"]
mod quiet;

// `criterion_main!`, quiet under `cargo test` (see `common/quiet.rs`).
fn main() {
    quiet::in_test_mode();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
