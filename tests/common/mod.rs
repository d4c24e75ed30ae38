//! Helpers shared by the integration tests and benchmarks.
#![allow(dead_code)]
// The names `round` takes from here (it is shared with the library's unit tests).
use symmpool::control::{ChannelId, Exchange};
use symmpool::{Deadline, Error};

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
