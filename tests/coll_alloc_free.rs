//! A collective call allocates nothing on the calling thread, under `CheckMode::Off`
//! and `CheckMode::Async` (the async check's exchange runs on its own thread): a
//! counting global allocator, two host ranks as threads whose collectives do nothing
//! (the host backend's own data movement is not the crate's call path), every public
//! collective, on the buffer's own stream and on two others in turn.
//!
//! A dedicated test binary: the global allocator counts per thread, so other tests'
//! threads cannot disturb it, but nothing else needs it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::hint::black_box;
use std::sync::Arc;
use symmpool::backend::{CollArgs, Collectives};
use symmpool::{
    CheckMode, Coll, CollectiveCalls, Group, GroupConfig, HostBackend, HostConfig, PoolConfig,
    ReduceOp, Result, Stream, SymmPool,
};

thread_local! {
    /// Allocations (and reallocations) made by this thread.
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's allocations.
struct Counting;

// SAFETY: every call is forwarded to `System` unchanged; the counter is a
// const-initialised thread-local `Cell` without a destructor, so counting neither
// allocates nor re-enters the allocator.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

/// Collectives that do nothing: what remains is the crate's call path.
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

const ROUNDS: usize = 100;

/// Allocations on each rank's calling thread over `ROUNDS` rounds of every collective
/// (after one round that lets each thread make its one-time state: `arc-swap`
/// registers a thread the first time it reads a policy).
fn allocations_per_rank(mode: CheckMode) -> Vec<u64> {
    let world: Vec<_> = HostBackend::world(HostConfig::new(2))
        .expect("world")
        .into_iter()
        .map(|b| b.with_collectives(|_| Arc::new(NullCollectives)))
        .collect();
    // Room for every record of the test: a post never waits for the checker thread.
    let config = GroupConfig::default()
        .with_check(mode)
        .with_check_queue(4 * (ROUNDS + 3));
    let groups = Group::world(world, &config).expect("groups");
    let pools = SymmPool::world(&groups, &PoolConfig::default()).expect("pools");
    let colls = Coll::world(&pools).expect("collectives");
    std::thread::scope(|s| {
        let ranks: Vec<_> = pools
            .iter()
            .zip(&colls)
            .map(|(pool, coll)| {
                s.spawn(move || {
                    let own = Stream::host();
                    let streams = [own.clone(), Stream::host(), Stream::host()];
                    let whole = pool.alloc(2 << 20, &own).expect("buffer");
                    let part = pool.alloc(1 << 20, &own).expect("buffer");
                    let round = |stream: &Stream| {
                        coll.tagged(0)
                            .all_gather_in_place::<u8>(&whole, stream)
                            .expect("ag");
                        coll.tagged(0)
                            .all_gather::<f32>(&part, &whole, stream)
                            .expect("ag");
                        coll.tagged(0)
                            .reduce_scatter::<symmpool::bf16>(&whole, &part, ReduceOp::Sum, stream)
                            .expect("rs");
                        coll.tagged(0)
                            .reduce_scatter_in_place::<f32>(&whole, ReduceOp::Max, stream)
                            .expect("rs");
                    };
                    // Each stream once: the first use on a stream records it.
                    for stream in &streams {
                        round(stream);
                    }
                    let before = allocations();
                    for i in 0..ROUNDS {
                        round(&streams[i % streams.len()]);
                    }
                    let made = allocations() - before;
                    coll.wait_checks().expect("checks");
                    made
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().expect("rank")).collect()
    })
}

#[test]
fn a_collective_allocates_nothing_with_the_check_off() {
    assert_eq!(allocations_per_rank(CheckMode::Off), [0, 0]);
}

#[test]
fn a_collective_allocates_nothing_on_the_calling_thread_with_the_async_check() {
    assert_eq!(allocations_per_rank(CheckMode::Async), [0, 0]);
}
