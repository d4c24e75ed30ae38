//! Helpers for the GPU tests: trials that declare how many GPUs they need and are
//! reported as *ignored*, with the reason, where the machine has fewer; and local NCCL
//! worlds. `SYMMPOOL_REQUIRE_GPU=1` (set by the GPU check) turns every such skip into
//! a failure.

#![cfg(feature = "nccl")]

use libtest_mimic::{Completion, Failed, Trial};
use std::sync::OnceLock;
use symmpool::backend::{NcclBackend, NcclWorldConfig};
use symmpool::{PoolConfig, Stream, SymmPool};

/// GPUs visible with a working driver and NCCL, or why none are usable.
pub fn gpus() -> Result<usize, String> {
    static FOUND: OnceLock<Result<usize, String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            let n = symmpool::backend::nccl::device_count().map_err(|e| e.to_string())?;
            symmpool::backend::nccl::nccl_version().map_err(|e| e.to_string())?;
            Ok(n)
        })
        .clone()
}

/// Whether skips are failures here (`SYMMPOOL_REQUIRE_GPU=1`).
pub fn required() -> bool {
    std::env::var("SYMMPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// A trial that needs `need` GPUs: ignored with the reason where there are fewer
/// (a failure under `SYMMPOOL_REQUIRE_GPU=1`); a panic in `f` is a failure.
pub fn trial(name: &str, need: usize, f: fn()) -> Trial {
    let name = format!("{name} ({need} GPU{})", if need == 1 { "" } else { "s" });
    Trial::ignorable_test(name, move || {
        let reason = match gpus() {
            Ok(n) if n >= need => None,
            Ok(n) => Some(format!("needs {need} GPUs, found {n}")),
            Err(e) => Some(format!("no usable GPU: {e}")),
        };
        match reason {
            Some(r) if required() => Err(Failed::from(format!("SYMMPOOL_REQUIRE_GPU=1 but {r}"))),
            Some(r) => Ok(Completion::ignored_with(r)),
            None => {
                f();
                Ok(Completion::Completed)
            }
        }
    })
}

/// One pool per GPU `0..n` (one rank per GPU, threads of this process).
///
/// # Panics
/// If NCCL cannot build the world (the trial checked the GPUs first).
pub fn world(n: usize, config: PoolConfig) -> Vec<SymmPool> {
    let devices: Vec<usize> = (0..n).collect();
    let backends =
        NcclBackend::local_world(&devices, NcclWorldConfig::default()).expect("NCCL world");
    SymmPool::group(backends, &config).expect("pools")
}

/// Run `f(pool, stream)` on one thread per rank with a fresh stream each.
pub fn on_ranks<R: Send>(pools: &[SymmPool], f: impl Fn(&SymmPool, &Stream) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let f = &f;
                s.spawn(move || {
                    let stream = p.new_stream().expect("stream");
                    f(p, &stream)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}
