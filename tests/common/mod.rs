//! Helpers shared by the integration tests and benchmarks.
#![allow(dead_code)]
pub mod checked;
pub mod figures;
pub mod fsdp_trace;
#[cfg(feature = "nccl")]
pub mod gpu;
pub mod identity;
pub mod procs;
pub mod rng;
#[cfg(target_os = "linux")]
pub mod shm;
pub mod two_pools;
pub mod watched;
