//! The C functions `torch.cuda.memory.CUDAPluggableAllocator` calls, exported from the
//! extension module's shared library:
//!
//! ```c
//! void* symmpool_alloc(size_t size, int device, cudaStream_t stream);
//! void  symmpool_free(void* ptr, size_t size, int device, cudaStream_t stream);
//! ```
//!
//! They serve the pool installed with `symmpool._ext.install_allocator(pool)`. With
//! `torch.cuda.MemPool(allocator, no_split=True)` every segment PyTorch's caching
//! allocator asks for is one buffer carved deterministically from the pool's registered
//! segments. A failure (no pool installed, wrong device, divergence, timeout, out of
//! memory) returns NULL, which PyTorch reports as out of memory; the message is kept for
//! `symmpool.last_error()`.

use crate::errors::remember;
use crate::live;
use crate::pool::{Handle, Pool};
use parking_lot::RwLock;
use pyo3::prelude::*;
use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::Arc;

static INSTALLED: RwLock<Option<Arc<Handle>>> = RwLock::new(None);

fn installed() -> Option<Arc<Handle>> {
    INSTALLED.read().clone()
}

/// Serve the pluggable allocator's calls from `pool` (None: from no pool; `alloc`
/// then fails). Returns the previous pool's name, if any.
#[pyfunction]
#[pyo3(signature = (pool))]
pub(crate) fn install_allocator(pool: Option<&Pool>) -> Option<String> {
    let new = pool.map(|p| p.handle.clone());
    let old = std::mem::replace(&mut *INSTALLED.write(), new);
    old.map(|h| h.pool.config().name.clone())
}

/// How many buffers PyTorch (the pluggable allocator) and DLPack tensors hold.
#[pyfunction]
pub(crate) fn live_buffers() -> usize {
    live::count()
}

fn alloc(size: usize, device: c_int, stream: *mut c_void) -> Result<*mut c_void, String> {
    let handle = installed()
        .ok_or("symmpool_alloc: no pool installed (symmpool.install_allocator(pool))")?;
    match handle.device() {
        None => return Err("symmpool_alloc: the installed pool is a host pool".into()),
        Some(d) if d as c_int != device => {
            return Err(format!(
                "symmpool_alloc: asked for device {device}, the installed pool is on device {d}"
            ));
        }
        Some(_) => {}
    }
    // SAFETY: PyTorch passes its current stream on `device` (the pool's, checked above):
    // a stream of its pool or the legacy default stream, alive as long as the process.
    let s = unsafe { handle.stream(stream as usize) }.map_err(|e| e.to_string())?;
    let buf = handle.pool.alloc(size as u64, &s).map_err(|e| {
        format!(
            "symmpool_alloc({size} bytes): {}",
            crate::errors::message(&e)
        )
    })?;
    let ptr = live::insert(buf).map_err(|e| e.to_string())?;
    Ok(ptr as *mut c_void)
}

/// `void* symmpool_alloc(size_t size, int device, cudaStream_t stream)`: a buffer of at
/// least `size` bytes from the installed pool, or NULL (see `symmpool.last_error()`).
/// Collective when the pool grows: every rank must request the same sequence of sizes.
#[unsafe(no_mangle)]
pub extern "C" fn symmpool_alloc(size: usize, device: c_int, stream: *mut c_void) -> *mut c_void {
    match std::panic::catch_unwind(|| alloc(size, device, stream)) {
        Ok(Ok(ptr)) => ptr,
        Ok(Err(message)) => {
            remember(message);
            std::ptr::null_mut()
        }
        Err(_) => {
            remember("symmpool_alloc panicked".into());
            std::ptr::null_mut()
        }
    }
}

/// `void symmpool_free(void* ptr, size_t size, int device, cudaStream_t stream)`: return
/// the buffer at `ptr` to its pool (from any thread; never collective). An unknown
/// pointer is kept as the last error.
#[unsafe(no_mangle)]
pub extern "C" fn symmpool_free(ptr: *mut c_void, size: usize, device: c_int, stream: *mut c_void) {
    let _ = (device, stream);
    let done = std::panic::catch_unwind(|| live::remove(ptr as u64).map(drop).is_some());
    match done {
        Ok(true) => {}
        Ok(false) => remember(format!(
            "symmpool_free: {ptr:p} ({size} bytes) is not a symmpool buffer"
        )),
        Err(_) => remember("symmpool_free panicked".into()),
    }
}
