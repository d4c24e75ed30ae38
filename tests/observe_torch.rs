//! PyTorch's memory tools on the pool (issue 26, item 4): the allocation history
//! (`record_memory_history`), its export with the snapshot in the format of
//! `torch.cuda.memory._snapshot()` (checked against a sample of that format in
//! `tests/data/`), every rank's snapshot in one collective call, and the statistics
//! keys that keep PyTorch's meaning.

use serde_json::Value;
use std::thread;
use std::time::Duration;
use symmpool::observe::{MemoryAction, PoolSnapshot};
use symmpool::{PoolConfig, Stream, SymmPool};

const MIB: u64 = 1 << 20;

fn pools(world: usize) -> Vec<SymmPool> {
    SymmPool::host_group(
        world,
        PoolConfig::default().with_timeout(Duration::from_secs(10)),
    )
    .unwrap()
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

/// Every key of `sample` is in `ours` with a value of the same JSON type, recursively
/// (lists: every element of ours against the sample's first element); keys starting
/// with `_` are the sample's notes.
fn same_shape(path: &str, sample: &Value, ours: &Value) {
    match (sample, ours) {
        (Value::Object(s), Value::Object(o)) => {
            for (k, v) in s.iter().filter(|(k, _)| !k.starts_with('_')) {
                let got = o
                    .get(k)
                    .unwrap_or_else(|| panic!("{path}.{k} is missing from the export"));
                same_shape(&format!("{path}.{k}"), v, got);
            }
        }
        (Value::Array(s), Value::Array(o)) => {
            if let Some(first) = s.first() {
                for (i, v) in o.iter().enumerate() {
                    same_shape(&format!("{path}[{i}]"), first, v);
                }
            }
        }
        (Value::Number(_), Value::Number(_))
        | (Value::String(_), Value::String(_))
        | (Value::Bool(_), Value::Bool(_))
        | (Value::Null, Value::Null) => {}
        (s, o) => panic!("{path}: the sample has {s}, the export {o}"),
    }
}

#[test]
fn the_export_has_pytorchs_snapshot_format() {
    let pool = pools(1).remove(0);
    let stream = Stream::host();
    pool.record_memory_history(1000);
    let big = pool.alloc(5 * MIB, &stream).unwrap();
    let small = pool.alloc(1000, &stream).unwrap();
    let gone = pool.alloc(2 * MIB, &stream).unwrap();
    drop(gone);
    let snap = pool.torch_memory_snapshot(1);
    let ours = serde_json::to_value(&snap).unwrap();
    let sample: Value =
        serde_json::from_str(include_str!("data/torch_snapshot_sample.json")).unwrap();
    // The sample's frames are not empty: check them against an empty list's element
    // type only where ours has some (none).
    same_shape("snapshot", &sample, &ours);
    // What `torch.cuda._memory_viz` asserts and reads.
    assert_eq!(snap.device_traces.len(), 2, "device 1's list is the second");
    assert!(snap.device_traces[0].is_empty());
    let mut reserved = 0;
    let mut allocated = 0;
    for seg in &snap.segments {
        assert_eq!(seg.device, 1);
        assert_eq!(
            seg.blocks.iter().map(|b| b.size).sum::<u64>(),
            seg.total_size
        );
        let mut at = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, at, "blocks tile the segment");
            at += b.size;
            assert!(b.requested_size <= b.size);
            assert!(
                ["active_allocated", "active_awaiting_free", "inactive"]
                    .contains(&b.state.as_str())
            );
        }
        reserved += seg.total_size;
        allocated += seg.allocated_size;
        assert!(["small", "large"].contains(&seg.segment_type.as_str()));
    }
    let stats = pool.memory_stats();
    assert_eq!(Some(reserved), stats["reserved_bytes.all.current"].as_u64());
    assert_eq!(
        Some(allocated),
        stats["allocated_bytes.all.current"].as_u64()
    );
    let trace = &snap.device_traces[1];
    let actions: Vec<&str> = trace.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "alloc",
            "free_requested",
            "free_completed"
        ]
    );
    // Allocations lie inside a segment allocated before them.
    for e in trace.iter().filter(|e| e.action == "alloc") {
        assert!(trace.iter().any(|s| s.action == "segment_alloc"
            && s.addr <= e.addr
            && e.addr + e.size <= s.addr + s.size));
    }
    assert_eq!(trace[1].size, 5 * MIB);
    assert_eq!(trace[1].stream, stream.id().0);
    drop((big, small));
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

/// The keys of an object, sorted (`_` notes left out).
fn keys(v: &Value) -> Vec<&str> {
    let mut k: Vec<&str> = (v.as_object().unwrap().keys())
        .map(String::as_str)
        .filter(|k| !k.starts_with('_'))
        .collect();
    k.sort_unstable();
    k
}

#[test]
fn the_sample_and_the_export_have_the_keys_of_a_snapshot_pytorch_recorded() {
    // `torch.cuda.memory._snapshot()` recorded by torch 2.11 on one H200 (2026-12-02,
    // one-GPU run 20: a history of 100 entries, two allocations, one freed).
    let recorded: Value =
        serde_json::from_str(include_str!("data/torch_snapshot_recorded.json")).unwrap();
    let sample: Value =
        serde_json::from_str(include_str!("data/torch_snapshot_sample.json")).unwrap();
    let pool = pools(1).remove(0);
    let stream = Stream::host();
    pool.record_memory_history(100);
    let kept = pool.alloc(3 * MIB, &stream).unwrap();
    drop(pool.alloc(MIB, &stream).unwrap());
    let ours = serde_json::to_value(pool.torch_memory_snapshot(0)).unwrap();
    // What PyTorch writes that the export leaves out: the allocator's settings and
    // annotations, stack frames of a segment, and a trace entry's compile context and
    // user metadata (memory_viz reads none of them to draw).
    let left_out = [
        "allocator_settings",
        "external_annotations",
        "frames",
        "compile_context",
        "user_metadata",
    ];
    let levels = |v: &Value| {
        let seg = &v["segments"][0];
        [
            v.clone(),
            seg.clone(),
            seg["blocks"][0].clone(),
            (v["device_traces"].as_array().unwrap().iter())
                .find_map(|d| d.as_array().unwrap().first().cloned())
                .unwrap(),
        ]
    };
    for ((r, s), o) in levels(&recorded)
        .iter()
        .zip(levels(&sample))
        .zip(levels(&ours))
    {
        let r = keys(r);
        for k in keys(&s) {
            assert!(
                r.contains(&k),
                "the transcribed sample has {k}, PyTorch does not: {r:?}"
            );
        }
        let o = keys(&o);
        for k in r.iter().filter(|k| !left_out.contains(k)) {
            assert!(
                o.contains(k),
                "PyTorch writes {k}, the export does not: {o:?}"
            );
        }
    }
    drop(kept);
    pool.close().unwrap();
}
