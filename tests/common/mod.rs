//! Helpers shared by the integration tests and benchmarks.
#![allow(dead_code)]
// The names `round` takes from here (it is shared with the library's unit tests).
use symmpool::control::{ChannelId, Exchange};
use symmpool::{Deadline, Error};

pub mod capture;
pub mod checked;
pub mod figures;
pub mod fsdp_trace;
#[cfg(feature = "nccl")]
pub mod gpu;
pub mod identity;
pub mod procs;
pub mod rng;
pub mod round;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod two_pools;
pub mod watched;

/// `f(rank, item)` on a thread per item (a rank's pool, group or backend); the
/// results in rank order.
pub fn on_ranks<T: Send, R: Send>(items: Vec<T>, f: impl Fn(usize, T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let hs: Vec<_> = (items.into_iter().enumerate())
            .map(|(rank, item)| s.spawn(move || f(rank, item)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
