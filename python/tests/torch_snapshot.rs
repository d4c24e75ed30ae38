//! PyTorch's snapshot format (`src/torch.rs`, the Python package's
//! `torch_memory_snapshot`): the export of a pool's snapshot and history as the
//! dictionary `torch.cuda.memory._snapshot()` returns, checked against a sample of that
//! format and a snapshot PyTorch recorded (`tests/data/`). The file is plain Rust over
//! the crate's public types, included here by `#[path]`, so the test needs no Python.

#[path = "../src/torch.rs"]
mod torch;

use serde_json::Value;
use std::time::Duration;
use symmpool::{Group, GroupConfig, PoolConfig, Stream, SymmPool};

const MIB: u64 = 1 << 20;

fn pool() -> SymmPool {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(10));
    let group = Group::host(1, &config).unwrap().remove(0);
    SymmPool::new(&group, PoolConfig::default()).unwrap()
}

/// The export of `pool`'s snapshot and history, as device `device`.
fn export(pool: &SymmPool, device: u64) -> torch::TorchSnapshot {
    let (snap, history) = pool.memory_snapshot_with_history();
    torch::torch_snapshot(&snap, &history, device)
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
    let pool = pool();
    let stream = Stream::host();
    pool.record_memory_history(1000);
    let big = pool.alloc(5 * MIB, &stream).unwrap();
    let small = pool.alloc(1000, &stream).unwrap();
    let gone = pool.alloc(2 * MIB, &stream).unwrap();
    drop(gone);
    let snap = export(&pool, 1);
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
    let pool = pool();
    let stream = Stream::host();
    pool.record_memory_history(100);
    let kept = pool.alloc(3 * MIB, &stream).unwrap();
    drop(pool.alloc(MIB, &stream).unwrap());
    let ours = serde_json::to_value(export(&pool, 0)).unwrap();
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
