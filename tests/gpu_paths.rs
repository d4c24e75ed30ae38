//! The path each collective reports matches NCCL's own log (two GPUs).
//!
//! The runner sets `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,TUNING NCCL_DEBUG_FILE=<tmp>`
//! before any NCCL call (unless the caller set them). Rank 0 of each communicator
//! logs, per call: `<Coll> [Symmetric]: .. -> Kernel <name>` for a symmetric kernel,
//! `<Coll>: .. Bytes -> Algo <algo> proto ..` for a plain kernel, and `[Copy Engine]`
//! for the copy engine on NCCL 2.29+. NCCL 2.28 prints nothing per call for the copy
//! engine (only `Init CE` once): such a call is reported as *ignored*, "unverifiable on
//! this NCCL", never as passed on silence.

#[cfg(not(feature = "nccl"))]
fn main() {
    println!("the GPU tests need the `nccl` feature");
}

#[cfg(feature = "nccl")]
fn main() {
    paths::main();
}

#[cfg(feature = "nccl")]
#[path = "common/mod.rs"]
mod common;

#[cfg(feature = "nccl")]
mod paths {
    use super::common;
    use common::gpu::{gpus, on_ranks, required};
    use libtest_mimic::{Completion, Failed, Trial};
    use std::sync::Barrier;
    use std::time::Duration;
    use symmpool::coll::Path;
    use symmpool::{Coll, CollectiveCalls, GroupConfig, PoolConfig, ReduceOp, bf16};

    const MIB: u64 = 1 << 20;

    /// The calls checked: (name, bytes per rank).
    const CALLS: [(&str, u64); 9] = [
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

    /// What NCCL logged for one call, from the lines it appended: `None` when it logged
    /// nothing for it (no positive evidence of any path).
    fn classify(coll: &str, lines: &[String]) -> Option<Path> {
        let mine: Vec<&String> = lines
            .iter()
            .filter(|l| l.contains(&format!("NCCL INFO {coll}")))
            .collect();
        match mine.as_slice() {
            [l] if l.contains("[Copy Engine]") => Some(Path::CopyEngine),
            [l] if l.contains("[Symmetric]") && l.contains("Kernel") => Some(Path::SymmetricKernel),
            [l] if l.contains("Algo") => Some(Path::PlainKernel),
            _ => None,
        }
    }

    /// One call: the path reported, what NCCL logged for it, its log lines, and whether
    /// NCCL logged `Init CE` (the copy engine's one-time line on 2.28).
    type Checked = (Path, Option<Path>, Vec<String>, bool);

    fn log_file() -> String {
        std::env::var("NCCL_DEBUG_FILE").unwrap_or_default()
    }

    /// Run call `i` on two GPUs and read what NCCL logged for it.
    fn run_call(i: usize) -> Result<Checked, String> {
        let (name, bytes) = CALLS[i];
        let file = log_file();
        if file.is_empty() || file.contains('%') {
            return Err("NCCL_DEBUG_FILE must be a plain path".into());
        }
        let group = GroupConfig::default().with_timeout(Duration::from_secs(60));
        let pools = common::gpu::world(2, &group, PoolConfig::default());
        let barrier = Barrier::new(2);
        let log = |from: usize| -> (Vec<String>, usize) {
            let text = std::fs::read_to_string(&file).unwrap_or_default();
            let lines: Vec<String> = text.lines().map(str::to_owned).collect();
            (lines[from.min(lines.len())..].to_vec(), lines.len())
        };
        let coll_name = if name.starts_with("ReduceScatter") {
            "ReduceScatter"
        } else {
            "AllGather"
        };
        let results = on_ranks(&pools, |pool, stream| {
            let coll = Coll::new(pool).unwrap();
            let big = pool.alloc(2 * bytes, stream).unwrap();
            let small = pool.alloc(bytes, stream).unwrap();
            barrier.wait();
            let seen = log(0).1;
            barrier.wait();
            let report = match name {
                "AllGather" => coll.tagged(0).all_gather_in_place::<bf16>(&big, stream),
                "ReduceScatter" => {
                    coll.tagged(0)
                        .reduce_scatter::<bf16>(&big, &small, ReduceOp::Sum, stream)
                }
                _ => coll
                    .tagged(0)
                    .reduce_scatter::<bf16>(&big, &small, ReduceOp::Max, stream),
            }
            .unwrap();
            stream.cuda_stream().unwrap().synchronize().unwrap();
            barrier.wait();
            let (new, _) = log(seen);
            let lines: Vec<String> = new
                .iter()
                .filter(|l| l.contains(coll_name))
                .cloned()
                .collect();
            (report.path, classify(coll_name, &new), lines)
        });
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let ce_init = text.lines().any(|l| l.contains("Init CE"));
        let (path, logged, lines) = results.into_iter().next().ok_or("no rank 0")?;
        Ok((path, logged, lines, ce_init))
    }

    fn check(i: usize) -> Result<Completion, Failed> {
        let (name, bytes) = CALLS[i];
        let (reported, logged, lines, ce_init) = run_call(i).map_err(Failed::from)?;
        let (reported, logged, ce_init) = (&reported, &logged, &ce_init);
        for l in &lines {
            eprintln!("    {l}");
        }
        match logged {
            Some(logged) if logged == reported => Ok(Completion::Completed),
            Some(logged) => Err(format!(
                "{name} {bytes} B/rank: reported {reported:?}, NCCL logged {logged:?}"
            )
            .into()),
            None if *reported == Path::CopyEngine && *ce_init => Ok(Completion::ignored_with(
                "unverifiable on this NCCL: reported CopyEngine; NCCL logged `Init CE` but no per-call line (2.29+ prints `[Copy Engine]`)",
            )),
            None => Err(format!(
                "{name} {bytes} B/rank: reported {reported:?}, NCCL logged nothing for it"
            )
            .into()),
        }
    }

    pub fn main() {
        if std::env::var_os("NCCL_DEBUG_FILE").is_none() {
            let file =
                std::env::temp_dir().join(format!("symmpool-paths-{}.log", std::process::id()));
            // SAFETY: nothing else runs yet (the harness has not started a thread), so no
            // other thread reads the environment while it changes.
            unsafe {
                std::env::set_var("NCCL_DEBUG", "INFO");
                std::env::set_var("NCCL_DEBUG_SUBSYS", "INIT,TUNING");
                std::env::set_var("NCCL_DEBUG_FILE", &file);
            }
        }
        let (mut args, filters) = common::gpu::arguments(std::env::args());
        args.test_threads = Some(1);
        let mut trials: Vec<Trial> = CALLS
            .iter()
            .enumerate()
            .map(|(i, (name, bytes))| {
                Trial::ignorable_test(
                    format!("path_matches_nccl_log::{name}_{bytes}B (2 GPUs)"),
                    move || match gpus() {
                        Ok(n) if n >= 2 => check(i),
                        found => {
                            let why = match found {
                                Ok(n) => format!("needs 2 GPUs, found {n}"),
                                Err(e) => format!("no usable GPU: {e}"),
                            };
                            if required() {
                                Err(format!("SYMMPOOL_REQUIRE_GPU=1 but {why}").into())
                            } else {
                                Ok(Completion::ignored_with(why))
                            }
                        }
                    },
                )
            })
            .collect();
        common::gpu::keep_filtered(&mut trials, &filters, args.exact);
        let conclusion = libtest_mimic::run(&args, trials);
        let _ = std::fs::remove_file(log_file());
        conclusion.exit();
    }
}
