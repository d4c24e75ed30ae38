//! The pool on the host backend: determinism across 2, 4 and 8 ranks, registration
//! counts, divergence, bad input, scopes, trim and close.
mod common;

use common::figures::{count, per_comm, segments};
use common::rng::Rng;
use std::sync::Barrier;
use std::thread;
use std::time::Duration;
use symmpool::SegmentId;
use symmpool::{
    Coll, CollectiveCalls, Error, Group, GroupConfig, HostBackend, HostConfig, PoolConfig, Stream,
    SymmBuffer, SymmPool, coll,
};

const MIB: u64 = 1 << 20;

/// The groups' timeout, where a test sets none of its own.
const TIMEOUT: Duration = Duration::from_secs(5);

/// These tests count segments as PyTorch's caching policy grows them (a dedicated
/// segment per large request), so they pin it; the registered policy has its own tests.
fn config() -> PoolConfig {
    PoolConfig::default().with_core(symmpool::CoreConfig::default())
}

/// The groups' settings: waits on the other ranks end after `timeout`.
fn group_config(timeout: Duration) -> GroupConfig {
    GroupConfig::default().with_timeout(timeout)
}

/// One pool of `config` per rank of a new host world with `host`'s settings, in
/// groups whose timeout is `timeout`, in rank order.
fn host_pools_with(
    host: HostConfig,
    timeout: Duration,
    config: PoolConfig,
) -> symmpool::Result<Vec<SymmPool>> {
    let groups = Group::world(HostBackend::world(host)?, &group_config(timeout))?;
    SymmPool::world(&groups, &config)
}

/// One pool of `config` per rank of a new host world of `world` ranks (timeout
/// [`TIMEOUT`]).
fn host_pools(world: usize, config: PoolConfig) -> symmpool::Result<Vec<SymmPool>> {
    host_pools_with(HostConfig::new(world), TIMEOUT, config)
}

/// Run `f(pool)` on one thread per rank and collect the results in rank order.
fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn random_ops(seed: u64, n: usize) -> Vec<Op> {
    let mut rng = Rng(seed);
    let mut live = 0usize;
    (0..n)
        .map(|_| {
            if live > 0 && rng.next() % 5 < 2 {
                live -= 1;
                Op::Free((rng.next() % (live as u64 + 1)) as usize)
            } else {
                live += 1;
                let size = match rng.next() % 4 {
                    0 => 1 + rng.next() % 4096,
                    1 => 1 + rng.next() % MIB,
                    2 => MIB + rng.next() % (8 * MIB),
                    _ => 8 * MIB + rng.next() % (40 * MIB),
                };
                Op::Alloc(size)
            }
        })
        .collect()
}

/// Each rank runs the same calls; between calls it spins a rank- and call-dependent
/// amount, so frees happen at different wall-clock moments on different ranks.
fn placements(world: usize, seed: u64) {
    let pools = host_pools(world, config()).unwrap();
    let ops = random_ops(seed, 300);
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let mut rng = Rng(seed ^ ((pool.rank() as u64 + 1) * 0x1234_5678));
        let mut live: Vec<SymmBuffer> = Vec::new();
        let mut seen = Vec::new();
        for op in &ops {
            for _ in 0..rng.next() % 2000 {
                std::hint::spin_loop();
            }
            if rng.next().is_multiple_of(7) {
                thread::yield_now();
            }
            match *op {
                Op::Alloc(size) => {
                    let b = pool.alloc(size, &stream).unwrap();
                    seen.push((b.segment(), b.offset_bytes(), b.block_bytes()));
                    live.push(b);
                }
                Op::Free(i) => {
                    live.remove(i);
                }
            }
            pool.check_invariants().unwrap();
        }
        drop(live);
        let registrations = per_comm(pool, &pool.memory_stats(), "registrations");
        pool.close().unwrap();
        (seen, registrations)
    });
    for (rank, o) in out.iter().enumerate() {
        assert_eq!(o.0, out[0].0, "rank {rank} placed differently from rank 0");
        assert_eq!(o.1, out[0].1, "rank {rank} registered differently");
    }
    assert!(out[0].1[0] > 0, "the sequence grew the pool");
}

#[test]
fn identical_placement_on_2_ranks() {
    placements(2, 1);
    placements(2, 2);
}

#[test]
fn identical_placement_on_4_ranks() {
    placements(4, 3);
}

#[test]
fn identical_placement_on_8_ranks() {
    placements(8, 4);
}

#[test]
fn registers_once_per_segment_and_communicator() {
    let pools = host_pools(2, config()).unwrap();
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let step = || {
            let bufs: Vec<_> = [3 * MIB, 64 * MIB, 4096, 100 * MIB, 3 * MIB]
                .iter()
                .map(|&b| pool.alloc(b, &stream).unwrap())
                .collect();
            drop(bufs);
        };
        step();
        let first = pool.memory_stats();
        step();
        step();
        let later = pool.memory_stats();
        let per = |m: &symmpool::observe::MemoryStats, what: &str| per_comm(pool, m, what);
        (
            count(&first, "segment.all.current"),
            [&first, &later].map(|m| per(m, "registrations")),
            per(&first, "windows"),
            [&first, &later].map(|m| count(m, "num_device_alloc")),
            [&first, &later].map(|m| count(m, "agreements")),
        )
    });
    for (segments, registrations, windows, growths, agreements) in out {
        // Symmetric and copy-engine communicators register, the plain one never.
        assert_eq!(registrations[0], vec![segments, segments, 0]);
        assert_eq!(windows, vec![segments, segments, 0]);
        assert_eq!(registrations[1], registrations[0], "no new registrations");
        assert_eq!(growths[1], growths[0]);
        assert_eq!(agreements[1], agreements[0]);
    }
}

fn expect_divergence(e: &Error, call: u64) -> &symmpool::Divergence {
    match e {
        Error::Divergence(d) => {
            assert_eq!(d.first_differing_call, Some(call), "{d}");
            d
        }
        other => panic!("expected a divergence at call {call}, got {other:?}"),
    }
}

#[test]
fn different_size_at_call_k_is_a_divergence_on_every_rank() {
    let pools = host_pools(3, config()).unwrap();
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let a = pool.alloc(3 * MIB, &stream).unwrap(); // call 1: grows
        let b = pool.alloc(4096, &stream).unwrap(); // call 2: grows (small)
        drop(b); // call 3
        // Call 4 grows with a different size on rank 1.
        let size = if pool.rank() == 1 { 64 * MIB } else { 32 * MIB };
        let err = pool.alloc(size, &stream).unwrap_err();
        // The allocators now differ: even a cache hit is refused, since it would land
        // at an offset the peers do not share.
        assert!(matches!(
            pool.alloc(4096, &stream),
            Err(Error::Divergence(_))
        ));
        drop(a);
        err
    });
    for (rank, e) in out.iter().enumerate() {
        let d = expect_divergence(e, 4);
        let want = if rank == 1 { 64 * MIB } else { 32 * MIB };
        let mine = d.calls[rank].1.as_deref().unwrap();
        assert!(mine.contains(&format!("alloc({want} B")), "{mine}");
        assert!(e.to_string().contains("first differing call is #4"), "{e}");
    }
}

#[test]
fn an_extra_allocation_on_one_rank_is_an_error_on_every_rank() {
    let pools = host_pools_with(HostConfig::new(2), Duration::from_millis(500), config()).unwrap();
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let a = pool.alloc(3 * MIB, &stream).unwrap(); // call 1
        let mut errors = Vec::new();
        if pool.rank() == 0 {
            // Call 2 on rank 0 only: needs growth.
            errors.push(pool.alloc(64 * MIB, &stream).map(drop).unwrap_err());
        }
        // Both ranks then allocate something that needs growth.
        errors.push(pool.alloc(128 * MIB, &stream).map(drop).unwrap_err());
        drop(a);
        errors
    });
    // Rank 0's extra call 2 meets rank 1's call 2 (a different size): both ranks see
    // the divergence at call 2; rank 0's next growth then finds no partner in time.
    let d0 = expect_divergence(&out[0][0], 2);
    assert!(
        d0.calls[0]
            .1
            .as_deref()
            .unwrap()
            .contains("alloc(67108864 B")
    );
    assert!(
        d0.calls[1]
            .1
            .as_deref()
            .unwrap()
            .contains("alloc(134217728 B")
    );
    expect_divergence(&out[1][0], 2);
    assert!(
        matches!(out[0][1], Error::Timeout { .. } | Error::Divergence(_)),
        "{:?}",
        out[0][1]
    );
}

#[test]
fn one_rank_growing_alone_times_out_instead_of_hanging() {
    let pools = host_pools_with(HostConfig::new(2), Duration::from_millis(300), config()).unwrap();
    let stream = Stream::host();
    let started = std::time::Instant::now();
    let err = pools[0].alloc(MIB, &stream).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(3));
    match err {
        Error::Timeout { missing_ranks, .. } => assert_eq!(missing_ranks, vec![1]),
        other => panic!("{other:?}"),
    }
    // The ranks are now out of step: the late rank learns that rank 0 timed out
    // instead of pairing with a stale record, and so does rank 0 from then on.
    let err = pools[1].trim().unwrap_err();
    assert!(matches!(err, Error::GroupBroken { rank: 0, .. }), "{err:?}");
    let err = pools[0].trim().unwrap_err();
    assert!(matches!(err, Error::GroupBroken { rank: 0, .. }), "{err:?}");
    // Cache hits still work; dropping the pools releases their memory locally.
    assert!(pools[1].alloc(MIB, &stream).is_err());
}

#[test]
fn bad_sizes_and_alignments_are_clear_errors_and_change_nothing() {
    let pools = host_pools(1, config()).unwrap();
    let pool = &pools[0];
    let stream = Stream::host();
    assert!(matches!(pool.alloc(0, &stream), Err(Error::ZeroSize)));
    assert!(matches!(
        pool.alloc(u64::MAX, &stream),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        pool.alloc(u64::MAX - 100, &stream),
        Err(Error::TooLarge { .. })
    ));
    assert!(matches!(
        pool.alloc_aligned(4096, 3, &stream),
        Err(Error::BadAlignment { align_bytes: 3, .. })
    ));
    assert!(matches!(
        pool.alloc_aligned(4096, 4 * MIB, &stream),
        Err(Error::BadAlignment { .. })
    ));
    assert!(matches!(pool.reserve(0), Err(Error::ZeroSize)));
    assert!(matches!(
        pool.reserve(u64::MAX),
        Err(Error::TooLarge { .. })
    ));
    let s = pool.memory_stats();
    assert_eq!(count(&s, "segment.all.current"), 0);
    assert_eq!(count(&s, "calls"), 0, "refused calls are not recorded");
    // Past the host backend's memory: an out-of-memory error, nothing lost.
    let small = host_pools_with(
        HostConfig::new(1).with_max_reserved_bytes(64 * MIB),
        TIMEOUT,
        config(),
    )
    .unwrap();
    let keep = small[0].alloc(40 * MIB, &stream).unwrap();
    keep.write(&[7u8; 16]).unwrap();
    assert!(matches!(
        small[0].alloc(40 * MIB, &stream),
        Err(Error::PoolLimit { .. })
    ));
    assert_eq!(keep.read::<u8>().unwrap()[..16], [7u8; 16]);
    assert!(small[0].alloc(4096, &stream).is_ok());
}

#[test]
fn buffers_of_another_pool_are_refused() {
    let a = host_pools(1, config()).unwrap();
    let b = host_pools(1, config()).unwrap();
    let stream = Stream::host();
    let x = a[0].alloc(4096, &stream).unwrap();
    let y = b[0].alloc(4096, &stream).unwrap();
    let coll = Coll::new(&a[0]).unwrap();
    assert!(matches!(
        coll.tagged(0).all_gather::<f32>(&x, &y, &stream),
        Err(Error::ForeignBuffer { .. })
    ));
    assert!(matches!(
        coll.tagged(0)
            .reduce_scatter::<f32>(&x, &y, symmpool::ReduceOp::Sum, &stream),
        Err(Error::ForeignBuffer { .. })
    ));
}

#[test]
fn use_after_close_is_an_error() {
    let pools = host_pools(2, config()).unwrap();
    on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let buf = pool.alloc(4096, &stream).unwrap();
        // Live buffers: close refuses on every rank, nothing released.
        match pool.close() {
            Err(Error::BuffersAlive { live_per_rank, .. }) => assert_eq!(live_per_rank, vec![1, 1]),
            other => panic!("{other:?}"),
        }
        buf.write(&[1.0f32; 4]).unwrap();
        let kept = buf.allocation_seq();
        drop(buf);
        pool.close().unwrap();
        assert!(pool.is_closed());
        pool.close().unwrap(); // idempotent
        assert!(matches!(pool.alloc(4096, &stream), Err(Error::PoolClosed)));
        assert!(matches!(pool.reserve(MIB), Err(Error::PoolClosed)));
        assert!(matches!(pool.trim(), Err(Error::PoolClosed)));
        let s = pool.memory_stats();
        assert_eq!(count(&s, "segment.all.current"), 0);
        assert_eq!(
            per_comm(pool, &s, "deregistrations"),
            per_comm(pool, &s, "registrations")
        );
        kept
    });
}

#[test]
fn buffers_kept_past_close_report_pool_closed() {
    let pools = host_pools(1, config()).unwrap();
    let pool = &pools[0];
    let stream = Stream::host();
    let buf = pool.alloc(4096, &stream).unwrap();
    assert!(pool.close().is_err());
    drop(buf);
    pool.close().unwrap();
    // A second pool's buffer still works while this one is closed.
    let other = host_pools(1, config()).unwrap();
    assert!(other[0].alloc(4096, &stream).is_ok());
}

#[test]
fn no_symmetric_support_degrades_to_plain_or_errors_when_required() {
    let host = HostConfig::new(2).with_symmetric(false);
    let pools = host_pools_with(host.clone(), TIMEOUT, config()).unwrap();
    let reports = on_ranks(&pools, |pool| {
        let coll = Coll::new(pool).unwrap();
        let stream = Stream::host();
        let buf = pool.alloc(8 * MIB, &stream).unwrap();
        let r = coll
            .tagged(0)
            .all_gather_in_place::<f32>(&buf, &stream)
            .unwrap();
        (r.path, per_comm(pool, &pool.memory_stats(), "windows"))
    });
    for (path, windows) in reports {
        assert_eq!(path, coll::Path::PlainKernel);
        assert_eq!(windows, vec![0, 0, 0]);
    }
    let strict = host_pools_with(host, TIMEOUT, config().with_require_symmetric(true)).unwrap();
    let errs = on_ranks(&strict, |pool| {
        pool.alloc(8 * MIB, &Stream::host()).unwrap_err()
    });
    for e in errs {
        assert!(matches!(e, Error::NoSymmetricSupport { comm: 0 }), "{e:?}");
    }
}

#[test]
fn older_nccl_rules_pick_older_paths() {
    let host = HostConfig::new(2).with_nccl_version(symmpool::NcclVersion::new(2, 27, 3));
    let pools = host_pools_with(host, TIMEOUT, config()).unwrap();
    let paths = on_ranks(&pools, |pool| {
        let coll = Coll::new(pool).unwrap();
        let stream = Stream::host();
        let buf = pool.alloc(64 * MIB, &stream).unwrap();
        coll.tagged(0)
            .all_gather_in_place::<u8>(&buf, &stream)
            .unwrap()
            .path
    });
    // 2.27 has windows but no copy engine.
    assert_eq!(paths, vec![coll::Path::SymmetricKernel; 2]);
}

#[test]
fn trim_releases_free_segments_collectively() {
    let pools = host_pools(2, config()).unwrap();
    on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let keep = pool.alloc(4096, &stream).unwrap();
        let big = pool.alloc(100 * MIB, &stream).unwrap();
        drop(big);
        let released = pool.trim().unwrap();
        assert_eq!(released, 100 * MIB);
        let s = pool.memory_stats();
        assert_eq!(count(&s, "segment.all.current"), 1);
        assert_eq!(per_comm(pool, &s, "deregistrations"), vec![1, 1, 0]);
        drop(keep);
    });
}

#[test]
fn reserve_pre_grows_so_later_allocations_do_not_register() {
    let pools = host_pools(2, config()).unwrap();
    on_ranks(&pools, |pool| {
        let stream = Stream::host();
        assert_eq!(pool.reserve(300 * MIB).unwrap(), SegmentId(0));
        let registrations = || per_comm(pool, &pool.memory_stats(), "registrations");
        let before = registrations();
        // A reserved segment serves any large request, even small ones.
        let bufs: Vec<_> = [2 * MIB, 50 * MIB, 200 * MIB]
            .iter()
            .map(|&b| pool.alloc(b, &stream).unwrap())
            .collect();
        assert!(bufs.iter().all(|b| b.segment() == SegmentId(0)));
        assert_eq!(registrations(), before);
    });
}

#[test]
fn scopes_nest_restore_on_panic_and_are_per_thread() {
    let pools = host_pools(1, config()).unwrap();
    let others = host_pools(1, config()).unwrap();
    let (a, b) = (&pools[0], &others[0]);
    let stream = Stream::host();
    assert!(symmpool::current().is_none());
    assert!(matches!(
        symmpool::alloc(16, &stream),
        Err(Error::NoActivePool)
    ));
    let outer = a.scope(|| {
        assert!(symmpool::current().unwrap().same_pool(a));
        let inner = b.scope(|| {
            assert!(symmpool::current().unwrap().same_pool(b));
            symmpool::alloc(16, &stream).unwrap()
        });
        assert!(inner.pool().same_pool(b));
        assert!(symmpool::current().unwrap().same_pool(a));
        let x = symmpool::alloc(16, &stream).unwrap();
        assert!(x.pool().same_pool(a));
        (x, inner)
    });
    assert!(symmpool::current().is_none());
    // Buffers outlive their scope.
    outer.0.write(&[1u8, 2, 3]).unwrap();
    // A panic inside a scope restores the previous pool.
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        a.scope(|| {
            b.scope(|| panic!("boom"));
        })
    }));
    assert!(caught.is_err());
    assert!(symmpool::current().is_none());
    a.scope(|| {
        let _ =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| b.scope(|| panic!("inner"))));
        assert!(symmpool::current().unwrap().same_pool(a));
    });
    // Two threads, two scopes, at the same time.
    let barrier = Barrier::new(2);
    thread::scope(|s| {
        for p in [a, b] {
            let barrier = &barrier;
            s.spawn(move || {
                p.scope(|| {
                    barrier.wait();
                    let buf = symmpool::alloc(16, &Stream::host()).unwrap();
                    assert!(buf.pool().same_pool(p));
                    barrier.wait();
                    assert!(symmpool::current().unwrap().same_pool(p));
                });
            });
        }
    });
}

#[test]
fn dropping_a_pool_without_close_never_blocks() {
    let pools = host_pools_with(HostConfig::new(2), Duration::from_secs(30), config()).unwrap();
    let stream = Stream::host();
    let started = std::time::Instant::now();
    // Rank 0 only: no growth, so nothing collective; drop everything.
    let cached = on_ranks(&pools, |p| {
        p.alloc(4096, &stream).map(|b| b.offset_bytes()).unwrap()
    });
    assert_eq!(cached, vec![0, 0]);
    drop(pools);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_close_that_times_out_on_one_rank_closes_no_rank() {
    let pools = host_pools_with(HostConfig::new(2), Duration::from_millis(200), config()).unwrap();
    let stream = Stream::host();
    on_ranks(&pools, |p| drop(p.alloc(4096, &stream).unwrap()));
    assert!(matches!(pools[0].close(), Err(Error::Timeout { .. })));
    assert!(matches!(
        pools[1].close(),
        Err(Error::GroupBroken { rank: 0, .. })
    ));
    assert!(!pools[0].is_closed() && !pools[1].is_closed());
}

/// Two host ranks whose rank 0 reports every stream as capturing a CUDA graph.
fn rank_0_capturing(timeout: Duration) -> Vec<SymmPool> {
    let mut world = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = world.pop().unwrap();
    let b0 = world
        .pop()
        .unwrap()
        .with_streams(|inner| std::sync::Arc::new(Capturing(inner)));
    let groups = Group::world(vec![b0, b1], &group_config(timeout)).unwrap();
    SymmPool::world(&groups, &config()).unwrap()
}

/// A host rank whose streams all pretend to capture a CUDA graph.
#[derive(Debug)]
struct Capturing(std::sync::Arc<dyn symmpool::backend::StreamOps>);

impl symmpool::backend::StreamOps for Capturing {
    fn new_stream(&self) -> symmpool::Result<Stream> {
        self.0.new_stream()
    }
    fn record_fence(&self, s: &Stream) -> symmpool::Result<symmpool::Fence> {
        self.0.record_fence(s)
    }
    fn wait_fence(
        &self,
        s: &Stream,
        on: symmpool::StreamId,
        f: symmpool::Fence,
    ) -> symmpool::Result<()> {
        self.0.wait_fence(s, on, f)
    }
    fn completed_fence(&self, s: symmpool::StreamId) -> symmpool::Result<Option<symmpool::Fence>> {
        self.0.completed_fence(s)
    }
    fn is_capturing(&self, _: &Stream) -> symmpool::Result<bool> {
        Ok(true)
    }
    fn any_capturing(&self) -> symmpool::Result<bool> {
        Ok(true)
    }
    fn drain(&self, deadline: symmpool::Deadline) -> symmpool::Result<bool> {
        self.0.drain(deadline)
    }
}

#[test]
fn dropping_a_buffer_never_waits_for_an_agreement_in_progress() {
    let timeout = Duration::from_secs(2);
    let mut world = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = world.pop().unwrap();
    let (tx, rx) = std::sync::mpsc::sync_channel(16);
    let b0 = world
        .pop()
        .unwrap()
        .with_exchange(|inner| {
            common::watched::Watched::wrap(inner, move |_| {
                let _ = tx.try_send(());
            })
        })
        .unwrap();
    let groups = Group::world(vec![b0, b1], &group_config(timeout)).unwrap();
    let mut pools = SymmPool::world(&groups, &config()).unwrap();
    let pool1 = pools.pop().unwrap();
    let pool0 = pools.pop().unwrap();
    let stream = Stream::host();
    // Grow together once, so that rank 0 holds a buffer.
    let (buf0, buf1) = thread::scope(|s| {
        let a = s.spawn(|| pool0.alloc(4096, &stream).unwrap());
        let b = s.spawn(|| pool1.alloc(4096, &stream).unwrap());
        (a.join().unwrap(), b.join().unwrap())
    });
    while rx.try_recv().is_ok() {}
    thread::scope(|s| {
        // Rank 0 grows alone: it holds its pool's state through a 2 s agreement.
        let grower = s.spawn(|| pool0.alloc(8 * MIB, &stream));
        rx.recv().unwrap(); // it is inside the agreement now
        let started = std::time::Instant::now();
        drop(buf0);
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "drop waited {:?}",
            started.elapsed()
        );
        assert!(matches!(grower.join().unwrap(), Err(Error::Timeout { .. })));
    });
    // The deferred free is applied, in order, by the next call on the pool.
    assert_eq!(count(&pool0.memory_stats(), "allocation.all.current"), 0);
    pool0.check_invariants().unwrap();
    drop(buf1);
}

/// Notes the name of the thread that drops it: inside a watched exchange, the thread
/// that drops the exchange.
struct DroppedOn(std::sync::Arc<std::sync::Mutex<Vec<Option<String>>>>);

impl common::watched::Watch for DroppedOn {}

impl Drop for DroppedOn {
    fn drop(&mut self) {
        let me = thread::current().name().map(String::from);
        self.0.lock().unwrap().push(me);
    }
}

#[test]
fn the_thread_that_drops_a_pool_drops_its_exchange_before_it_goes_on() {
    // The checks' background thread (`CheckMode::Async`) holds the exchange too; the
    // drop of the group's last pool (the last holder of the group) joins it, so the
    // exchange is gone when the drop returns, dropped by the caller (a hosting rank's
    // exchange waits there for its peers' goodbyes, which the process must not exit
    // before), not by that thread some time later.
    let dropped = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let backends: Vec<_> = (symmpool::HostBackend::world(HostConfig::new(2)).unwrap())
        .into_iter()
        .map(|b| {
            let watch = DroppedOn(dropped.clone());
            (b.with_exchange(|x| common::watched::Watched::with(x, watch))).unwrap()
        })
        .collect();
    // No group outlives the pools: the pools hold the rank's group, which holds the
    // ledger and its thread.
    let group = group_config(TIMEOUT).with_check(symmpool::CheckMode::Async);
    let pools = SymmPool::world(&Group::world(backends, &group).unwrap(), &config()).unwrap();
    on_ranks(&pools, |p| p.close().unwrap());
    drop(pools);
    let me = thread::current().name().map(String::from);
    assert_eq!(*dropped.lock().unwrap(), vec![me.clone(), me]);
}

#[test]
fn alloc_and_alloc_aligned_to_the_default_are_the_same_call() {
    let pools = host_pools(2, config()).unwrap();
    let out = on_ranks(&pools, |p| {
        let stream = Stream::host();
        let a = if p.rank() == 0 {
            p.alloc(4096, &stream)
        } else {
            p.alloc_aligned(4096, 512, &stream)
        };
        let b = p.alloc(8 * MIB, &stream); // growth: the ranks agree
        (
            a.map(|x| x.offset_bytes()).unwrap(),
            b.map(|x| x.offset_bytes()),
        )
    });
    for (_, b) in out {
        assert!(b.is_ok(), "{b:?}");
    }
}

#[test]
fn absurd_settings_are_refused_or_handled() {
    let mut cfg = config();
    cfg.history_len = usize::MAX;
    assert!(matches!(host_pools(1, cfg), Err(Error::Config { .. })));
    // A timeout of Duration::MAX means "wait as long as it takes", without overflow.
    let pools = host_pools_with(HostConfig::new(1), Duration::MAX, config()).unwrap();
    let b = pools[0].alloc(4096, &Stream::host()).unwrap();
    assert_eq!(b.offset_bytes(), 0);
}

#[test]
fn one_rank_capturing_fails_growth_on_every_rank_without_a_timeout() {
    let timeout = Duration::from_secs(20);
    let pools = rank_0_capturing(timeout);
    let started = std::time::Instant::now();
    let errs = on_ranks(&pools, |p| p.alloc(MIB, &Stream::host()).unwrap_err());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no rank waited for a timeout"
    );
    for e in errs {
        assert!(matches!(e, Error::GraphCapture), "{e:?}");
    }
    // `reserve` registers too: refused on every rank while a stream the pool served
    // is capturing (reserve before capture).
    for e in on_ranks(&pools, |p| p.reserve(MIB).unwrap_err()) {
        assert!(matches!(e, Error::GraphCapture), "{e:?}");
    }
    // The ranks stayed in step: `trim` (no registration) works on both.
    let trimmed = on_ranks(&pools, |p| p.trim().unwrap());
    assert_eq!(trimmed[0], trimmed[1]);
}

/// Two pools per rank in one group (on one backend's communicators): (a, b).
fn two_pools_per_rank() -> Vec<(SymmPool, SymmPool)> {
    let backends = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    thread::scope(|s| {
        let hs: Vec<_> = backends
            .into_iter()
            .map(|b| {
                s.spawn(move || {
                    let group = Group::new(b, group_config(TIMEOUT)).unwrap();
                    let a = SymmPool::new(&group, config().with_name("a")).unwrap();
                    let bb = SymmPool::new(&group, config().with_name("b")).unwrap();
                    (a, bb)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn two_pools_on_one_backend_used_interleaved_never_pair_their_rounds() {
    let per_rank = two_pools_per_rank();
    // Every allocation grows its pool (earlier buffers stay alive): an agreement and a
    // registration each, alternating between the pools, 20 times.
    let places = thread::scope(|s| {
        let hs: Vec<_> = per_rank
            .iter()
            .map(|(a, b)| {
                s.spawn(move || {
                    let stream = Stream::host();
                    let mut keep = Vec::new();
                    for i in 0..20 {
                        let pool = if i % 2 == 0 { a } else { b };
                        keep.push(pool.alloc((32 + i) * MIB, &stream).unwrap());
                    }
                    keep.iter()
                        .map(|x| (x.segment(), x.offset_bytes()))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(places[0], places[1]);
}

#[test]
fn pools_growing_in_different_orders_fail_before_any_window_pairs_wrongly() {
    let per_rank = two_pools_per_rank();
    // Each rank grows a and b from two racing threads: each pool's own agreement
    // matches, but the registrations on the shared communicators may come in different
    // orders on the two ranks, which would pair a's window with b's.
    let errs = thread::scope(|s| {
        let hs: Vec<_> = per_rank
            .iter()
            .enumerate()
            .map(|(rank, (a, b))| {
                s.spawn(move || {
                    // Pool a always takes 32 MiB and b 64 MiB; the threads race.
                    let _ = rank;
                    let stream = Stream::host();
                    thread::scope(|t| {
                        let x = t.spawn(|| a.alloc(32 * MIB, &stream).map(|_| ()));
                        let y = t.spawn(|| b.alloc(64 * MIB, &stream).map(|_| ()));
                        [x.join().unwrap(), y.join().unwrap()]
                    })
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    // Whatever the interleaving, no rank registered a window paired with the other
    // pool's: every growth either agreed on (pool, size) or failed on both ranks (the
    // two pools share one ledger, so agreements of one paired with the other's are a
    // divergence there; registrations out of order fail in their order round).
    for (rank, pair) in errs.iter().enumerate() {
        for r in pair {
            match r {
                Ok(()) | Err(Error::RegistrationOrder { .. }) => {}
                Err(Error::Divergence(d)) => {
                    assert!(d.to_string().contains("channel ordinal"), "{d}");
                }
                // Two threads of one rank used the two pools: the error says so.
                Err(Error::SharedCommunicators { pools, error })
                    if matches!(
                        **error,
                        Error::RegistrationOrder { .. } | Error::Divergence(_)
                    ) =>
                {
                    assert_eq!(pools.len(), 2, "{pools:?}");
                }
                Err(other) => panic!("rank {rank}: {other:?}"),
            }
        }
    }
    for (a, b) in &per_rank {
        for p in [a, b] {
            let s = p.memory_stats();
            let windows = per_comm(p, &s, "windows");
            assert_eq!(windows[0], count(&s, "segment.all.current"), "{s:?}");
        }
    }
}

#[test]
fn pools_created_in_different_orders_are_a_divergence_on_every_rank() {
    let backends = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    let errs: Vec<Error> = thread::scope(|s| {
        let hs: Vec<_> = backends
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                s.spawn(move || {
                    let name = if rank == 0 { "params" } else { "grads" };
                    let group = Group::new(b, group_config(TIMEOUT)).unwrap();
                    SymmPool::new(&group, config().with_name(name)).unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        match e {
            Error::ChannelMismatch { opened } => {
                assert_eq!(opened[0].2, "pool:params");
                assert_eq!(opened[1].2, "pool:grads");
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn fit_to_peak_replaces_growth_with_one_segment_and_the_next_step_does_not_grow() {
    // The registered policy (the default), two ranks, an FSDP-like step.
    let pools = host_pools(2, PoolConfig::default()).unwrap();
    let out = on_ranks(&pools, |p| {
        let stream = Stream::host();
        let shard = p.alloc(16 * MIB, &stream).unwrap(); // persistent
        p.reset_peak();
        let step = |p: &SymmPool| {
            let mut live = Vec::new();
            for layer in 0..8u64 {
                live.push(p.alloc((48 + layer) * MIB, &stream).unwrap());
                if live.len() > 2 {
                    live.remove(0);
                }
            }
            let small: Vec<_> = (0..50).map(|_| p.alloc(4096, &stream).unwrap()).collect();
            drop((live, small));
        };
        step(p);
        let figures = || (segments(p), per_comm(p, &p.memory_stats(), "registrations"));
        let before = figures();
        let report = p.fit_to_peak().unwrap();
        let after = figures();
        step(p);
        let again = figures();
        p.check_invariants().unwrap();
        drop(shard);
        (before, report, after, again)
    });
    for (before, report, after, again) in &out {
        assert!(after.0 <= before.0, "{report:?}");
        assert!(after.0 <= 3, "{report:?}: {after:?}");
        assert_eq!(again.1, after.1, "the next step registered nothing");
        assert_eq!(again.0, after.0);
    }
    assert_eq!(out[0].1, out[1].1, "every rank fitted alike");
}

#[test]
fn growth_under_a_dead_peer_returns_within_the_timeout() {
    // Rank 1 never arrives: every collective pool call of rank 0 (a growth, a
    // reservation) fails within the group's timeout and a second, however many
    // rounds it would make.
    let timeout = Duration::from_millis(400);
    let pools = host_pools_with(HostConfig::new(2), timeout, config()).unwrap();
    let stream = Stream::host();
    let started = std::time::Instant::now();
    let grown = pools[0].alloc(4096, &stream);
    let took = started.elapsed();
    assert!(matches!(grown, Err(Error::Timeout { .. })), "{grown:?}");
    assert!(took < timeout + Duration::from_secs(1), "{took:?}");
    let started = std::time::Instant::now();
    let reserved = pools[0].reserve(2 * MIB);
    assert!(reserved.is_err(), "{reserved:?}");
    assert!(started.elapsed() < timeout + Duration::from_secs(1));
}

#[test]
fn a_stalled_registration_fails_within_its_deadline() {
    // Rank 1 never registers: rank 0's registration stops at its caller's deadline,
    // not at the backend's own (longer) timeout.
    let world = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    let timeout = Duration::from_millis(500);
    let segment = world[0].segments().allocate(2 * MIB).unwrap();
    let started = std::time::Instant::now();
    // SAFETY: a new segment, registered once; rank 1 never registers, which is the
    // point (the registration times out instead of pairing anything).
    let window = unsafe {
        world[0]
            .segments()
            .register(&segment, 0, symmpool::Deadline::after(timeout))
    };
    let took = started.elapsed();
    assert!(matches!(window, Err(Error::Timeout { .. })), "{window:?}");
    assert!(
        took >= timeout && took < timeout + Duration::from_secs(1),
        "{took:?}"
    );
}

#[test]
fn a_buffer_dropped_late_on_one_rank_at_close_is_buffers_alive_naming_it() {
    let pools = host_pools(2, config()).unwrap();
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        let early = pool.alloc(4096, &stream).unwrap();
        let late = pool.alloc(8000, &stream).unwrap();
        drop(early);
        // Rank 0 drops its buffer before closing; rank 1 only after.
        let late = if pool.rank() == 0 {
            drop(late);
            None
        } else {
            Some(late)
        };
        let refused = pool.close();
        drop(late);
        // Now both have freed it: the ranks' histories agree again and close works.
        let closed = pool.close();
        (refused, closed)
    });
    for (rank, (refused, closed)) in out.into_iter().enumerate() {
        match refused {
            Err(Error::BuffersAlive {
                live_per_rank,
                buffers,
            }) => {
                assert_eq!(live_per_rank, vec![0, 1], "rank {rank}");
                assert_eq!(buffers.len(), 1, "{buffers:?}");
                assert_eq!(buffers[0].0, 1);
                assert!(
                    buffers[0].1.starts_with("8000 B at segment 0 offset "),
                    "{buffers:?}"
                );
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(closed.is_ok(), "rank {rank}: {closed:?}");
    }
}

#[test]
fn a_divergence_older_than_the_history_says_so_and_how_to_raise_it() {
    let pools = host_pools(2, config().with_history_len(4)).unwrap();
    let out = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        // Calls 1 and 2 grow the pool together; call 3 differs (a cache hit: no
        // agreement yet)...
        drop(pool.alloc(512, &stream).unwrap());
        let size = if pool.rank() == 0 { 4096 } else { 8192 };
        let _first = pool.alloc(size, &stream).unwrap();
        // ...then more matching calls than the history holds, then a growth.
        let hits: Vec<_> = (0..6).map(|_| pool.alloc(512, &stream).unwrap()).collect();
        let grown = pool.alloc(8 * MIB, &stream);
        drop(hits);
        grown.unwrap_err()
    });
    let texts: Vec<String> = out.iter().map(ToString::to_string).collect();
    for (e, text) in out.iter().zip(&texts) {
        let Error::Divergence(d) = e else {
            panic!("{e:?}")
        };
        assert_eq!(d.first_differing_call, None, "{d}");
        assert_eq!(d.history_gone, Some(4), "{d}");
        assert!(text.contains("older than the 4 calls"), "{text}");
        assert!(text.contains("raise PoolConfig::history_len"), "{text}");
        assert!(
            text.contains("rank 1: pool call count 10, hash 0x"),
            "{text}"
        );
    }
    assert_eq!(texts[0], texts[1], "the same message on every rank");
}

/// A provider whose registrations fail at once on its rank (before the round the
/// peers wait in), forwarding the rest.
#[derive(Debug)]
struct RegistrationFails(std::sync::Arc<dyn symmpool::backend::SegmentProvider>);

impl symmpool::backend::SegmentProvider for RegistrationFails {
    fn allocate(&self, size_bytes: u64) -> symmpool::Result<symmpool::backend::Segment> {
        self.0.allocate(size_bytes)
    }
    unsafe fn register(
        &self,
        _segment: &symmpool::backend::Segment,
        _comm: usize,
        _deadline: symmpool::Deadline,
    ) -> symmpool::Result<Option<symmpool::backend::Window>> {
        Err(Error::Nccl {
            op: "ncclCommWindowRegister",
            code: 1,
            message: "injected".into(),
        })
    }
}

#[test]
fn a_registration_failure_names_the_rank_that_failed() {
    // Rank 1 fails before its round; rank 0 waits out its registration. Every rank
    // names rank 1, now and in the growth refused later.
    let timeout = Duration::from_millis(600);
    let mut world = symmpool::HostBackend::world(HostConfig::new(2)).unwrap();
    let b1 = world
        .pop()
        .unwrap()
        .with_segments(|inner| std::sync::Arc::new(RegistrationFails(inner)));
    world.push(b1);
    let groups = Group::world(world, &group_config(timeout)).unwrap();
    let pools = SymmPool::world(&groups, &PoolConfig::default()).unwrap();
    let out = on_ranks(&pools, |p| {
        let first = p.alloc(MIB, &Stream::host()).unwrap_err();
        let later = p.alloc(MIB, &Stream::host()).unwrap_err();
        (first, later)
    });
    match &out[0].0 {
        Error::RegistrationBroken { rank: 1, .. } => {}
        other => panic!("rank 0: {other:?}"),
    }
    assert!(matches!(&out[1].0, Error::Nccl { .. }), "{:?}", out[1].0);
    for (rank, (_, later)) in out.iter().enumerate() {
        match later {
            Error::RegistrationBroken { rank: 1, .. } => {}
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn reserve_on_a_never_used_pool_during_capture_is_refused_on_every_rank() {
    // Rank 0's device is capturing (a stream the pool never saw): a reservation, the
    // pool's first call, registers nothing on any rank.
    let timeout = Duration::from_secs(20);
    let pools = rank_0_capturing(timeout);
    let started = std::time::Instant::now();
    for e in on_ranks(&pools, |p| p.reserve(MIB).unwrap_err()) {
        assert!(matches!(e, Error::GraphCapture), "{e:?}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "no rank waited"
    );
    for p in &pools {
        let s = p.memory_stats();
        assert_eq!(count(&s, "segment.all.current"), 0, "{s:?}");
        assert!(
            per_comm(p, &s, "registrations").iter().all(|&r| r == 0),
            "{s:?}"
        );
    }
}
