//! The path each collective reports matches NCCL's own log (two H200s).
//!
//! Needs `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE=<file>` in the
//! environment before the process starts (NCCL reads them once); skipped with a printed
//! reason otherwise. Rank 0 of each communicator logs, per call:
//! `<Coll> [Symmetric]: .. -> Kernel <name>` for a symmetric kernel,
//! `<Coll>: .. Bytes -> Algo <algo> proto ..` for a plain kernel, and nothing for the
//! copy engine on NCCL 2.28 (which logs `Init CE` once; 2.29+ logs `[Copy Engine]`).
#![cfg(feature = "nccl")]

mod common;

use common::gpu::{on_ranks, world};
use std::sync::Barrier;
use std::time::Duration;
use symmpool::coll::{self, Path};
use symmpool::{PoolConfig, ReduceOp, bf16};

const MIB: u64 = 1 << 20;

/// What NCCL logged for one call, from the lines it appended.
fn classify(coll: &str, lines: &[String]) -> Option<Path> {
    let mine: Vec<&String> = lines
        .iter()
        .filter(|l| l.contains(&format!("NCCL INFO {coll}")))
        .collect();
    let copy_engine_line = mine.iter().any(|l| l.contains("[Copy Engine]"));
    match mine.as_slice() {
        [] => Some(Path::CopyEngine),
        [l] if copy_engine_line => {
            let _ = l;
            Some(Path::CopyEngine)
        }
        [l] if l.contains("[Symmetric]") && l.contains("Kernel") => Some(Path::SymmetricKernel),
        [l] if l.contains("Algo") => Some(Path::PlainKernel),
        _ => None,
    }
}

#[test]
fn gpu_reported_paths_match_nccl_log_lines() {
    let Ok(file) = std::env::var("NCCL_DEBUG_FILE") else {
        eprintln!(
            "skipped: set NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE=<file>"
        );
        return;
    };
    if file.contains('%') {
        eprintln!("skipped: NCCL_DEBUG_FILE must be a plain path (no %h/%p)");
        return;
    }
    let Some(pools) = world(PoolConfig::default().with_timeout(Duration::from_secs(60))) else {
        return;
    };
    let barrier = Barrier::new(2);
    let log = |from: usize| -> (Vec<String>, usize) {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        (lines[from.min(lines.len())..].to_vec(), lines.len())
    };
    let results = on_ranks(&pools, |pool, stream| {
        let mut seen = 0usize;
        let mut checked = Vec::new();
        let calls: Vec<(&str, u64)> = vec![
            ("AllGather", 64 << 10),
            ("AllGather", MIB),
            ("AllGather", 64 * MIB),
            ("AllGather", 256 * MIB),
            ("ReduceScatter", 64 << 10),
            ("ReduceScatter", MIB),
            ("ReduceScatter", 64 * MIB),
            ("ReduceScatter", 256 * MIB),
            ("ReduceScatterMax", MIB),
        ];
        for (name, bytes) in calls {
            let big = pool.alloc(2 * bytes, stream).unwrap();
            let small = pool.alloc(bytes, stream).unwrap();
            barrier.wait();
            if pool.rank() == 0 {
                seen = log(0).1;
            }
            barrier.wait();
            let report = match name {
                "AllGather" => coll::all_gather_in_place::<bf16>(&big, stream),
                "ReduceScatter" => {
                    coll::reduce_scatter::<bf16>(&big, &small, ReduceOp::Sum, stream)
                }
                _ => coll::reduce_scatter::<bf16>(&big, &small, ReduceOp::Max, stream),
            }
            .unwrap();
            stream.cuda_stream().unwrap().synchronize().unwrap();
            barrier.wait();
            if pool.rank() == 0 {
                let (new, _) = log(seen);
                let coll_name = if name.starts_with("ReduceScatter") {
                    "ReduceScatter"
                } else {
                    "AllGather"
                };
                let logged = classify(coll_name, &new);
                eprintln!(
                    "{name} {bytes} B/rank: reported {:?}, NCCL logged {logged:?}",
                    report.path
                );
                for l in new.iter().filter(|l| l.contains(coll_name)) {
                    eprintln!("    {l}");
                }
                checked.push((name, bytes, report.path, logged));
            }
            barrier.wait();
        }
        checked
    });
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    let ce_init = text.lines().any(|l| l.contains("Init CE"));
    let checked = &results[0];
    assert_eq!(checked.len(), 9);
    for (name, bytes, reported, logged) in checked {
        assert_eq!(Some(*reported), *logged, "{name} {bytes} B/rank");
    }
    if checked.iter().any(|c| c.2 == Path::CopyEngine) {
        assert!(
            ce_init,
            "a copy-engine call was reported but NCCL never logged `Init CE`"
        );
    }
    // The automatic choice used every path.
    for p in [Path::CopyEngine, Path::SymmetricKernel, Path::PlainKernel] {
        assert!(checked.iter().any(|c| c.2 == p), "{p:?} never taken");
    }
}
