//! Criterion benchmarks of the allocator core on the host.
//!
//! - `alloc_free_pair`: one alloc + free pair served from the cache (mixed sizes
//!   512 B – 64 KiB, pre-grown, no growth in the timed loop) while 1 000, 10 000 or
//!   100 000 live blocks (and about as many free holes between them) sit beside it;
//!   `glibc_malloc_free` does the same with `malloc`/`free` and the same number of
//!   live `malloc`'d blocks.
//! - `fsdp_trace`: one step of the FSDP-like trace of `tests/common/fsdp_trace.rs`
//!   (time per step), for the Llama-like and the adversarial layer sizes. After the
//!   group, a 1 000-step replay of each prints the growths after the first step and
//!   peak reserved / peak allocated, under the caching and the registered growth
//!   policies.
//!
//! Run with `cargo bench --bench core`; the figures are in `BENCHMARKS.md`.

#![allow(missing_docs)] // criterion_group! generates undocumented public functions.

#[path = "../tests/common/fsdp_trace.rs"]
mod fsdp_trace;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use fsdp_trace::{TraceOp, buffers, layer_sizes, random_layer_sizes, trace_of};
use std::hint::black_box;
use symmpool::__core::{AllocError, AllocRequest, Allocator, CoreConfig, Placement, StreamId};

const LIVE: [usize; 3] = [1_000, 10_000, 100_000];
/// Sizes cycled through by the timed pair.
const PAIR_SIZES: usize = 256;

/// A deterministic generator (splitmix64).
#[path = "../tests/common/rng.rs"]
mod rng;
use rng::Rng;

trait Sizes {
    fn size(&mut self) -> u64;
}

impl Sizes for Rng {
    /// Log-uniform from 512 B to 64 KiB, not rounded.
    fn size(&mut self) -> u64 {
        let log2 = 9 + self.next() % 7; // 512 B .. 32 KiB octaves
        let base = 1u64 << log2;
        base + self.next() % base
    }
}

fn sizes(seed: u64, n: usize) -> Vec<u64> {
    let mut rng = Rng(seed);
    (0..n).map(|_| rng.size()).collect()
}

fn alloc_growing(core: &mut Allocator, req: AllocRequest) -> Placement {
    match core.alloc(req) {
        Err(AllocError::NeedsGrowth(g)) => {
            core.add_segment(g).unwrap();
            core.alloc(req).unwrap()
        }
        other => other.unwrap(),
    }
}

/// An allocator holding `live` blocks, with about as many free holes between them,
/// and already grown for every size of `pair`.
fn populated_core(live: usize, pair: &[u64]) -> (Allocator, Vec<Placement>) {
    let mut core = Allocator::new(CoreConfig::default()).unwrap();
    let mut held = Vec::with_capacity(live);
    let all: Vec<Placement> = sizes(1, 2 * live)
        .into_iter()
        .map(|size| alloc_growing(&mut core, AllocRequest::new(size, StreamId(0))))
        .collect();
    // Free every other block: `live` holes of mixed sizes between the live blocks.
    for (i, p) in all.into_iter().enumerate() {
        if i % 2 == 0 {
            held.push(p);
        } else {
            core.free(p.block, &[]).unwrap();
        }
    }
    // Warm up: every pair size once, so the timed loop never grows.
    for &size in pair {
        let p = alloc_growing(&mut core, AllocRequest::new(size, StreamId(0)));
        core.free(p.block, &[]).unwrap();
    }
    core.check_invariants().unwrap();
    (core, held)
}

fn alloc_free_pair(c: &mut Criterion) {
    let pair = sizes(2, PAIR_SIZES);
    let mut group = c.benchmark_group("alloc_free_pair");
    group.throughput(Throughput::Elements(1));
    for live in LIVE {
        let (mut core, held) = populated_core(live, &pair);
        let growths = core.stats().num_growths;
        let reqs: Vec<AllocRequest> = pair
            .iter()
            .map(|&s| AllocRequest::new(s, StreamId(0)))
            .collect();
        let mut i = 0;
        group.bench_function(BenchmarkId::new("symmpool", live), |b| {
            b.iter(|| {
                let req = reqs[i % PAIR_SIZES];
                i = i.wrapping_add(1);
                let p = core.alloc(black_box(req)).unwrap();
                core.free(black_box(p.block), &[]).unwrap();
            })
        });
        assert_eq!(core.stats().num_growths, growths, "grew in the timed loop");
        assert_eq!(core.stats().allocated_blocks.current, held.len() as u64);
        core.check_invariants().unwrap();

        // glibc with the same sizes and the same live (and freed) blocks.
        let mut held_malloc = Vec::with_capacity(live);
        let mut freed = Vec::with_capacity(live);
        for (k, size) in sizes(1, 2 * live).into_iter().enumerate() {
            // SAFETY: malloc may be called with any size; the result is checked.
            let ptr = unsafe { libc::malloc(size as usize) };
            assert!(!ptr.is_null());
            if k % 2 == 0 {
                held_malloc.push(ptr);
            } else {
                freed.push(ptr);
            }
        }
        for ptr in freed {
            // SAFETY: `ptr` came from malloc above and is freed once.
            unsafe { libc::free(ptr) };
        }
        let mut j = 0;
        group.bench_function(BenchmarkId::new("glibc_malloc_free", live), |b| {
            b.iter(|| {
                let size = pair[j % PAIR_SIZES] as usize;
                j = j.wrapping_add(1);
                // SAFETY: malloc with a non-zero size; the block is freed right away.
                let ptr = unsafe { libc::malloc(black_box(size)) };
                assert!(!ptr.is_null());
                // SAFETY: `ptr` came from malloc just above and is freed once.
                unsafe { libc::free(black_box(ptr)) };
            })
        });
        for ptr in held_malloc {
            // SAFETY: `ptr` came from malloc above and is freed once.
            unsafe { libc::free(ptr) };
        }
    }
    group.finish();
}

/// Replay trace ops, growing as the core asks.
fn replay(core: &mut Allocator, ops: &[TraceOp], live: &mut [Option<Placement>]) {
    for op in ops {
        match *op {
            TraceOp::Alloc { id, bytes } => {
                let p = alloc_growing(core, AllocRequest::new(bytes, StreamId(0)));
                live[id] = Some(p);
            }
            TraceOp::Free { id } => {
                let p = live[id].take().unwrap();
                core.free(p.block, &[]).unwrap();
            }
        }
    }
}

const TRACE_STEPS: usize = 1_000;

fn fsdp_trace(c: &mut Criterion) {
    let models: [(&str, Vec<u64>); 2] = [
        ("layer_sizes", layer_sizes()),
        ("random_layer_sizes", random_layer_sizes()),
    ];
    let mut group = c.benchmark_group("fsdp_trace");
    group.throughput(Throughput::Elements(1));
    for (name, sizes) in &models {
        let step = trace_of(sizes, 1);
        let mut core = Allocator::new(CoreConfig::default()).unwrap();
        let mut live = vec![None; buffers()];
        replay(&mut core, &step, &mut live);
        let growths = core.stats().num_growths;
        group.bench_function(BenchmarkId::new("step", name), |b| {
            b.iter(|| replay(&mut core, black_box(&step), &mut live))
        });
        assert_eq!(
            core.stats().num_growths,
            growths,
            "grew after the first step"
        );
    }
    group.finish();

    // The figures of a 1 000-step run on a fresh allocator, under both growth policies.
    let policies = [
        ("caching", CoreConfig::default()),
        ("registered", CoreConfig::registered()),
    ];
    for ((name, sizes), (policy, cfg)) in models
        .iter()
        .flat_map(|m| policies.iter().map(move |p| (m, p)))
    {
        let step = trace_of(sizes, 1);
        let mut core = Allocator::new(*cfg).unwrap();
        let mut live = vec![None; buffers()];
        replay(&mut core, &step, &mut live);
        let first = core.stats().num_growths;
        let start = std::time::Instant::now();
        for _ in 1..TRACE_STEPS {
            replay(&mut core, &step, &mut live);
        }
        let per_step = start.elapsed() / (TRACE_STEPS as u32 - 1);
        core.check_invariants().unwrap();
        let s = core.stats();
        println!(
            "fsdp_trace/{name}/{policy}: {TRACE_STEPS} steps, {} ops/step, {:?}/step; segments {} \
             (growths in step 1: {first}, after step 1: {}); peak reserved {} MiB / peak \
             allocated {} MiB = {:.3}",
            step.len(),
            per_step,
            s.segments.current,
            s.num_growths - first,
            s.reserved_bytes.peak >> 20,
            s.allocated_bytes.peak >> 20,
            s.reserved_bytes.peak as f64 / s.allocated_bytes.peak as f64
        );
    }
}

criterion_group!(benches, alloc_free_pair, fsdp_trace);

#[path = "common/quiet.rs"]
mod quiet;

// `criterion_main!`, quiet under `cargo test` (see `common/quiet.rs`).
fn main() {
    quiet::in_test_mode();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
