//! The buffers Python (DLPack tensors) and PyTorch (the pluggable allocator) hold,
//! by device address: a concurrent map, so that a tensor's deleter or PyTorch's `free`
//! returns a block from any thread, and a collective finds the buffer of a tensor.

use dashmap::DashMap;
use std::sync::{Arc, LazyLock};
use symmpool::{Error, Result, SymmBuffer};

static LIVE: LazyLock<DashMap<u64, Arc<SymmBuffer>>> = LazyLock::new(DashMap::new);

/// Keep `buf` under its device address and return the address.
///
/// # Errors
/// [`Error::WrongStream`] for a buffer without a device address (a host pool).
pub(crate) fn insert(buf: SymmBuffer) -> Result<u64> {
    let ptr = buf.device_ptr().ok_or(Error::WrongStream)?;
    LIVE.insert(ptr, Arc::new(buf));
    Ok(ptr)
}

/// The buffer at device address `ptr` (a clone of the handle: no lock stays held).
pub(crate) fn get(ptr: u64) -> Option<Arc<SymmBuffer>> {
    LIVE.get(&ptr).map(|r| r.value().clone())
}

/// Forget the buffer at `ptr`; the block returns to its pool when the last handle goes.
pub(crate) fn remove(ptr: u64) -> Option<Arc<SymmBuffer>> {
    LIVE.remove(&ptr).map(|(_, b)| b)
}

/// How many buffers are held.
pub(crate) fn count() -> usize {
    LIVE.len()
}
