//! PyTorch's memory tools on the pool: the allocation history
//! (`record_memory_history`, and with the snapshot under one lock), every rank's
//! snapshot in one collective call, and the statistics keys that keep PyTorch's
//! meaning. The export in the format of `torch.cuda.memory._snapshot()` is the Python
//! package's (`python/src/torch.rs`), tested in `python/tests/torch_snapshot.rs`.

use std::thread;
use std::time::Duration;
use symmpool::observe::{MemoryAction, PoolSnapshot};
use symmpool::{Group, GroupConfig, PoolConfig, Stream, SymmPool};

const MIB: u64 = 1 << 20;

fn pools(world: usize) -> Vec<SymmPool> {
    let groups = Group::host(
        world,
        &GroupConfig::default().with_timeout(Duration::from_secs(10)),
    )
    .unwrap();
    SymmPool::world(&groups, &PoolConfig::default()).unwrap()
}

fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool) -> R + Sync) -> Vec<R> {
    thread::scope(|s| {
        let hs: Vec<_> = pools.iter().map(|p| s.spawn(|| f(p))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn the_history_records_allocs_frees_and_segments_in_a_ring() {
    let pool = pools(1).remove(0);
    let stream = Stream::host();
    // Not recording: nothing kept.
    drop(pool.alloc(MIB, &stream).unwrap());
    assert!(pool.memory_history().is_empty());
    pool.record_memory_history(100);
    let a = pool.alloc(3 * MIB, &stream).unwrap(); // large: grows
    let b = pool.alloc(4096, &stream).unwrap(); // small: a cache hit
    let a_seq = a.allocation_seq();
    drop(a);
    pool.trim().unwrap();
    let h = pool.memory_history();
    let actions: Vec<MemoryAction> = h.iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        [
            MemoryAction::SegmentAlloc,
            MemoryAction::Alloc,
            MemoryAction::Alloc,
            MemoryAction::Free,
            MemoryAction::SegmentFree,
        ]
    );
    assert_eq!(h.iter().map(|e| e.seq).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    let (grow, alloc, free, release) = (&h[0], &h[1], &h[3], &h[4]);
    assert_eq!(alloc.requested_bytes, 3 * MIB);
    assert_eq!(alloc.allocation_seq, Some(a_seq));
    assert_eq!(alloc.stream, Some(stream.id()));
    assert_eq!(alloc.segment, grow.segment);
    assert_eq!(free.allocation_seq, Some(a_seq));
    assert_eq!(
        (free.segment, free.offset_bytes, free.size_bytes),
        (alloc.segment, alloc.offset_bytes, alloc.size_bytes)
    );
    assert_eq!(free.requested_bytes, 3 * MIB);
    assert_eq!(free.stream, Some(stream.id()));
    assert_eq!(
        (release.segment, release.size_bytes),
        (grow.segment, grow.size_bytes)
    );
    assert!(h.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    // A ring: the newest entries stay, their sequence numbers say how many went.
    pool.record_memory_history(2);
    assert_eq!(
        pool.memory_history()
            .iter()
            .map(|e| e.seq)
            .collect::<Vec<_>>(),
        [4, 5]
    );
    for _ in 0..3 {
        drop(pool.alloc(4096, &stream).unwrap());
    }
    let h = pool.memory_history();
    assert_eq!(h.len(), 2);
    assert_eq!(h[1].seq, 11);
    // 0 stops and drops it.
    pool.record_memory_history(0);
    assert!(pool.memory_history().is_empty());
    drop(b);
    pool.close().unwrap();
}

#[test]
fn every_ranks_map_in_one_call() {
    let pools = pools(3);
    let out: Vec<Vec<PoolSnapshot>> = on_ranks(&pools, |pool| {
        let stream = Stream::host();
        // The same calls on every rank (allocations are collective).
        let bufs: Vec<_> = (1..=3)
            .map(|i| pool.alloc(i * MIB, &stream).unwrap())
            .collect();
        let all = pool.gather_memory_snapshots().unwrap();
        drop(bufs);
        // The pool goes on: a growth agreement after the gather.
        drop(pool.alloc(600 * MIB, &stream).unwrap());
        pool.close().unwrap();
        all
    });
    for (rank, all) in out.iter().enumerate() {
        assert_eq!(all.len(), 3);
        for (r, snap) in all.iter().enumerate() {
            assert_eq!(snap.rank, r);
            assert_eq!(snap.world_size, 3);
            assert_eq!(
                snap.stats["allocation.all.current"].as_u64(),
                Some(3),
                "seen from rank {rank}"
            );
            // The same placement on every rank (streams are per rank).
            let placement = |s: &PoolSnapshot| -> Vec<_> {
                s.blocks()
                    .map(|(seg, b)| (seg.id, b.offset_bytes, b.size_bytes, b.allocation_seq))
                    .collect()
            };
            assert_eq!(placement(snap), placement(&all[0]));
        }
        assert_eq!(all, &out[0], "every rank sees the same maps");
    }
}

#[test]
fn statistics_keep_pytorchs_meaning() {
    let pool = pools(1).remove(0);
    let stream = Stream::host();
    let a = pool.alloc(MIB, &stream).unwrap();
    let b = pool.alloc(MIB, &stream).unwrap();
    let m = pool.memory_stats();
    // PyTorch: failed device allocations followed by a cache flush and a retry.
    assert_eq!(m["num_alloc_retries"].as_u64(), Some(0));
    // The allocations that missed the cache (one growth of the small class).
    assert_eq!(m["num_cache_misses"].as_u64(), Some(1));
    assert_eq!(m["num_device_alloc"].as_u64(), Some(1));
    drop((a, b));
    pool.close().unwrap();
}

#[test]
fn the_snapshot_and_the_history_come_together() {
    let pool = pools(1).remove(0);
    let stream = Stream::host();
    pool.record_memory_history(10);
    let buf = pool.alloc(3 * MIB, &stream).unwrap();
    let (snap, history) = pool.memory_snapshot_with_history();
    // Nothing happened between: the same as the two calls one after the other.
    assert_eq!(snap, pool.memory_snapshot());
    assert_eq!(history, pool.memory_history());
    let last = history.last().unwrap();
    assert_eq!(last.action, MemoryAction::Alloc);
    assert_eq!(last.allocation_seq, Some(buf.allocation_seq()));
    assert_eq!(snap.segments[0].id, buf.segment());
    // The host backends' segments have no device address.
    assert!(snap.segments.iter().all(|s| s.address.is_none()));
    drop(buf);
    pool.close().unwrap();
}
