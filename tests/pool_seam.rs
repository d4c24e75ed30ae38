//! The promises of the provider seam, each with a test double that changes one part of
//! a host backend: bounded teardown, true statistics, the configuration in effect,
//! failures inside `Drop`, a panic under the pool's lock, and out-of-memory errors
//! that say whose memory ran out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};
use symmpool::backend::{Refused, Segment, SegmentProvider, StreamOps, Window};
use symmpool::{
    Coll, Error, Group, GroupConfig, HostBackend, HostConfig, PoolConfig, Result, Stream, SymmPool,
    coll,
};
use symmpool::{Fence, StreamId};

const MIB: u64 = 1 << 20;

/// The count under `key` in `pool`'s statistics now.
fn stat(pool: &SymmPool, key: &str) -> u64 {
    pool.memory_stats()[key].as_u64().unwrap()
}

fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Stream operations that forward to the host's, with one behaviour changed.
#[derive(Debug)]
struct Streams {
    inner: Arc<dyn StreamOps>,
    /// `drain` never completes: it waits until the deadline and says "not drained".
    stuck: bool,
    /// `record_fence` fails.
    failing_fences: bool,
    /// `completed_fence` panics once.
    panic_once: AtomicBool,
    /// `completed_fence` reports nothing complete.
    nothing_completes: bool,
}

impl Streams {
    fn wrap(inner: Arc<dyn StreamOps>) -> Self {
        Streams {
            inner,
            stuck: false,
            failing_fences: false,
            panic_once: AtomicBool::new(false),
            nothing_completes: false,
        }
    }
}

impl StreamOps for Streams {
    fn new_stream(&self) -> Result<Stream> {
        self.inner.new_stream()
    }
    fn record_fence(&self, s: &Stream) -> Result<Fence> {
        if self.failing_fences {
            return Err(Error::Cuda {
                op: "cuEventRecord",
                code: 999,
                message: "injected".into(),
            });
        }
        self.inner.record_fence(s)
    }
    fn wait_fence(&self, s: &Stream, on: StreamId, f: Fence) -> Result<()> {
        self.inner.wait_fence(s, on, f)
    }
    fn completed_fence(&self, s: StreamId) -> Result<Option<Fence>> {
        if self.panic_once.swap(false, Ordering::SeqCst) {
            panic!("injected panic under the pool's lock");
        }
        if self.nothing_completes {
            return Ok(None);
        }
        self.inner.completed_fence(s)
    }
    fn is_capturing(&self, s: &Stream) -> Result<bool> {
        self.inner.is_capturing(s)
    }
    fn drain(&self, deadline: symmpool::Deadline) -> Result<bool> {
        if self.stuck {
            // A device whose work never finishes: poll until the deadline, as a real
            // backend does (a test double may wait; the pool must not wait longer).
            while !deadline.expired() {
                thread::yield_now();
            }
            return Ok(false);
        }
        self.inner.drain(deadline)
    }
}

fn one_rank(timeout: Duration, f: impl FnOnce(Arc<dyn StreamOps>) -> Streams) -> SymmPool {
    let backend = HostBackend::world(HostConfig::new(1))
        .unwrap()
        .pop()
        .unwrap()
        .with_streams(|inner| Arc::new(f(inner)));
    let group = Group::new(backend, GroupConfig::default().with_timeout(timeout)).unwrap();
    SymmPool::new(&group, PoolConfig::default()).unwrap()
}

#[test]
fn a_pool_dropped_on_a_device_that_never_drains_returns_within_its_timeout() {
    let timeout = Duration::from_millis(300);
    let pool = one_rank(timeout, |inner| Streams {
        stuck: true,
        ..Streams::wrap(inner)
    });
    let stream = Stream::host();
    drop(pool.alloc(4 * MIB, &stream).unwrap());
    assert_eq!(stat(&pool, "segment.all.current"), 1);
    let started = Instant::now();
    drop(pool);
    let took = started.elapsed();
    assert!(took >= timeout, "the drop did try to drain ({took:?})");
    assert!(
        took < timeout + Duration::from_secs(2),
        "the drop waited {took:?}, more than the pool's timeout of {timeout:?}"
    );
}

#[test]
fn trim_on_a_device_that_never_drains_times_out_and_keeps_the_segment() {
    let timeout = Duration::from_millis(200);
    let pool = one_rank(timeout, |inner| Streams {
        stuck: true,
        ..Streams::wrap(inner)
    });
    drop(pool.alloc(4 * MIB, &Stream::host()).unwrap());
    match pool.trim() {
        Err(Error::Timeout { op, .. }) => assert!(op.contains("draining"), "{op}"),
        other => panic!("{other:?}"),
    }
    // The memory is still owned (not freed under running work), and a later trim on a
    // device that drains would release it.
    let m = pool.memory_stats();
    let windows: u64 = (["windows.symmetric", "windows.copy_engine", "windows.plain"].iter())
        .map(|k| m[*k].as_u64().unwrap())
        .sum();
    assert_eq!(windows, 2);
}

#[test]
fn active_bytes_fall_back_to_the_live_figure_once_the_streams_are_done() {
    let pools = SymmPool::host_group(1, PoolConfig::default()).unwrap();
    let pool = &pools[0];
    let stream = Stream::host();
    let keep = pool.alloc(MIB, &stream).unwrap();
    let gone = pool.alloc(MIB, &stream).unwrap();
    drop(gone);
    assert_eq!(stat(pool, "allocated_bytes.all.current"), MIB);
    assert_eq!(
        stat(pool, "active_bytes.all.current"),
        MIB,
        "host work is synchronous: the freed block's fence is complete"
    );
    drop(keep);
    assert_eq!(stat(pool, "active_bytes.all.current"), 0);
}

#[test]
fn active_bytes_count_freed_blocks_until_their_fences_complete() {
    let pool = one_rank(Duration::from_secs(5), |inner| Streams {
        nothing_completes: true,
        ..Streams::wrap(inner)
    });
    let stream = Stream::host();
    drop(pool.alloc(MIB, &stream).unwrap());
    let stats = pool.memory_stats();
    assert_eq!(stats["allocated_bytes.all.current"].as_u64(), Some(0));
    // The freed block (merged with the free rest of its segment) still counts.
    assert!(
        stats["active_bytes.all.current"].as_u64() >= Some(MIB),
        "the fence is not complete yet: {stats:?}"
    );
}

#[test]
fn config_reports_what_is_in_effect() {
    let mut requested = PoolConfig::default();
    requested.core = requested.core.with_granularity_bytes(64 << 10);
    let pool = SymmPool::host_group(1, requested).unwrap().remove(0);
    assert_eq!(
        pool.config().core.granularity_bytes,
        pool.backend().granularity_bytes(),
        "the backend's granularity replaces the requested one"
    );
    assert!(pool.config().core.small_segment_bytes >= pool.backend().granularity_bytes());
    // The path policy belongs to the collectives; what is set is what is used.
    let policy = coll::PathPolicy::default().with_ce_all_gather_min_bytes(7 * MIB);
    let coll = Coll::new(&pool).unwrap();
    coll.set_path_policy(policy.clone());
    assert_eq!(coll.path_policy(), policy);
}

#[test]
fn a_failure_inside_drop_is_returned_by_the_next_call() {
    let pool = one_rank(Duration::from_secs(5), |inner| Streams {
        failing_fences: true,
        ..Streams::wrap(inner)
    });
    let stream = Stream::host();
    let buf = pool.alloc(MIB, &stream).unwrap();
    let seq = buf.allocation_seq();
    drop(buf); // cannot fail; records the failure
    let err = pool.alloc(MIB, &stream).unwrap_err();
    assert!(
        std::error::Error::source(&err).is_some(),
        "the cause is a #[source]"
    );
    match err {
        Error::Deferred { during, source } => {
            assert!(during.contains(&format!("allocation #{seq}")), "{during}");
            assert!(
                matches!(*source, Error::Cuda { code: 999, .. }),
                "{source:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Reported once; the block was freed in step with the peers, so the pool goes on.
    assert_eq!(stat(&pool, "allocation.all.current"), 0);
    let again = pool.alloc(MIB, &stream).unwrap();
    assert_eq!(again.offset_bytes(), 0);
}

#[test]
fn a_panic_under_the_pools_lock_breaks_the_pool_on_every_rank() {
    let timeout = Duration::from_secs(10);
    let mut world = HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = world.pop().unwrap();
    let b0 = world.pop().unwrap().with_streams(|inner| {
        Arc::new(Streams {
            panic_once: AtomicBool::new(true),
            ..Streams::wrap(inner)
        })
    });
    let config = GroupConfig::default().with_timeout(timeout);
    let groups = Group::world(vec![b0, b1], &config).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let stream = Stream::host();
    let bufs = on_ranks(&pools, |p| p.alloc(MIB, &stream).unwrap());
    drop(bufs);
    // Rank 0 panics inside `stats()`, while it holds its pool's state.
    let panicked =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| pools[0].memory_stats()));
    assert!(panicked.is_err());
    // Locally, every later call fails instead of using a half-mutated core.
    assert!(matches!(
        pools[0].alloc(MIB, &stream),
        Err(Error::PoolBroken { .. })
    ));
    // Collectively, the next collective operation fails on every rank alike.
    let started = Instant::now();
    let errs = on_ranks(&pools, |p| p.trim().unwrap_err());
    assert!(started.elapsed() < timeout, "no rank waited for a timeout");
    for e in &errs {
        assert!(matches!(e, Error::PoolBroken { .. }), "{e:?}");
        assert!(e.to_string().contains("drop it"), "says what to do: {e}");
    }
    // The healthy rank's pool is now broken too.
    assert!(matches!(
        pools[1].alloc(MIB, &stream),
        Err(Error::PoolBroken { .. })
    ));
}

/// A provider that cannot allocate (a full device), forwarding the rest.
#[derive(Debug)]
struct Full(Arc<dyn SegmentProvider>);

impl SegmentProvider for Full {
    fn allocate(&self, size_bytes: u64) -> Result<Segment> {
        Err(Error::DeviceOutOfMemory {
            segment_bytes: size_bytes,
            op: "ncclMemAlloc",
            code: 2,
            message: "injected".into(),
        })
    }
    unsafe fn register(
        &self,
        segment: &Segment,
        comm: usize,
        deadline: symmpool::Deadline,
    ) -> Result<Option<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.register(segment, comm, deadline) }
    }
    unsafe fn deregister(
        &self,
        window: Window,
        deadline: symmpool::Deadline,
    ) -> std::result::Result<(), Refused<Window>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.deregister(window, deadline) }
    }
    unsafe fn free(&self, segment: Segment) -> std::result::Result<(), Refused<Segment>> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.0.free(segment) }
    }
}

#[test]
fn out_of_memory_says_whose_memory_ran_out() {
    let timeout = Duration::from_secs(10);
    let mut world = HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = world
        .pop()
        .unwrap()
        .with_segments(|inner| Arc::new(Full(inner)));
    let b0 = world.pop().unwrap();
    let config = GroupConfig::default().with_timeout(timeout);
    let groups = Group::world(vec![b0, b1], &config).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let errs = on_ranks(&pools, |p| p.alloc(MIB, &Stream::host()).unwrap_err());
    match &errs[0] {
        Error::PeerOutOfMemory { ranks, .. } => assert_eq!(ranks, &[1]),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(errs[1], Error::DeviceOutOfMemory { code: 2, .. }),
        "{:?}",
        errs[1]
    );
    // Nothing grew on either rank, and the ranks are still in step.
    for p in &pools {
        assert_eq!(stat(p, "segment.all.current"), 0);
    }
    let limit = PoolConfig::default()
        .with_core(symmpool::CoreConfig::default().with_max_reserved_bytes(2 * MIB));
    let small = SymmPool::host_group(1, limit).unwrap().remove(0);
    let _first = small.alloc(MIB, &Stream::host()).unwrap();
    match small.alloc(4 * MIB, &Stream::host()) {
        Err(Error::PoolLimit {
            max_reserved_bytes, ..
        }) => assert_eq!(max_reserved_bytes, 2 * MIB),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_double_free_is_reported_as_such() {
    let e: Error = symmpool::AllocError::StaleBlock(symmpool::BlockId { slot: 0, seq: 7 }).into();
    assert!(
        matches!(e, Error::DoubleFree { allocation_seq: 7 }),
        "{e:?}"
    );
}
