//! Helpers for the GPU tests: a local NCCL world of two ranks, or a printed reason to
//! skip where there is none.

#![cfg(feature = "nccl")]

use symmpool::backend::{NcclBackend, NcclWorldConfig};
use symmpool::{PoolConfig, Stream, SymmPool};

/// Two pools on GPUs 0 and 1, or `None` after printing why the test is skipped.
pub fn world(config: PoolConfig) -> Option<Vec<SymmPool>> {
    let count = match symmpool::backend::nccl::device_count() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("skipped: no CUDA ({e})");
            return None;
        }
    };
    if count < 2 {
        eprintln!("skipped: needs 2 GPUs, found {count}");
        return None;
    }
    match NcclBackend::local_world(&[0, 1], NcclWorldConfig::default()) {
        Ok(backends) => Some(
            backends
                .into_iter()
                .map(|b| SymmPool::new(b, config.clone()).expect("pool"))
                .collect(),
        ),
        Err(e) => {
            eprintln!("skipped: NCCL unavailable ({e})");
            None
        }
    }
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
