//! `symmpool._ext`: the Python bindings of the `symmpool` crate (PyO3, abi3).
//!
//! - [`pool::Pool`]: one rank's pool (NCCL, adopted from a process group's
//!   communicator, or host for tests), DLPack tensors over its buffers, in-place
//!   collectives on them, statistics, snapshots, SVG memory maps, the shrink after
//!   a lost rank ([`pool::ShrinkReport`]) and the grow when newcomers replace it
//!   ([`pool::GrowReport`]; a newcomer's `Pool.shm()` joins);
//! - [`store::StoreExchange`]: the crate's agreement over a Python store object
//!   (`torch.distributed`'s default store); [`store::TcpStoreExchange`]: the crate's
//!   own TCP store, from the launcher's environment (one process per rank);
//! - [`capi`]: `symmpool_alloc` / `symmpool_free`, the C functions of
//!   `torch.cuda.memory.CUDAPluggableAllocator`, exported from this library;
//! - `last_error()`: the message of the last failure (a failed `symmpool_alloc` is only
//!   an out-of-memory error to PyTorch);
//! - [`logs`]: the crate's warnings through Python's `warnings` and `logging`
//!   (`flush_logs()` delivers the queued ones now).
//!
//! NCCL is loaded by the crate, which binds to a `libnccl.so.2` the process already has
//! (inside PyTorch: PyTorch's own).

#![warn(clippy::multiple_unsafe_ops_per_block)]

mod capi;
mod dlpack;
mod dtype;
mod errors;
mod live;
mod logs;
mod pool;
// The memory-map pictures, shared with the crate's examples.
#[path = "../../examples/support/render.rs"]
mod render;
mod store;
mod torch;

use pyo3::prelude::*;

pub use capi::{symmpool_alloc, symmpool_free};

/// The NCCL version this process's NCCL reports (loading it the crate's way: an
/// already-loaded `libnccl.so.2` first), as `(major, minor, patch)`.
#[pyfunction]
fn nccl_version() -> PyResult<(u32, u32, u32)> {
    let v = symmpool::backend::nccl::nccl_version().map_err(errors::to_py)?;
    Ok((v.major, v.minor, v.patch))
}

/// The module.
#[pymodule]
fn _ext(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<pool::Pool>()?;
    m.add_class::<pool::Buffer>()?;
    m.add_class::<pool::ShrinkReport>()?;
    m.add_class::<pool::GrowReport>()?;
    m.add_class::<store::StoreExchange>()?;
    m.add_class::<store::TcpStoreExchange>()?;
    m.add_class::<store::StoreServer>()?;
    m.add_function(wrap_pyfunction!(errors::last_error, m)?)?;
    m.add_function(wrap_pyfunction!(errors::clear_error, m)?)?;
    m.add_function(wrap_pyfunction!(capi::install_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(capi::live_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(pool::render_ranks_svg, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_version, m)?)?;
    m.add_function(wrap_pyfunction!(logs::flush_logs, m)?)?;
    logs::install(m)?;
    // The exception classes live in `symmpool.errors` (Python: some have two bases).
    m.add("SymmpoolError", errors::class(m.py(), "SymmpoolError")?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
