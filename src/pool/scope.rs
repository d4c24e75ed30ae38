//! `SymmPool::scope(|| ..)`: route the crate's free-function allocations to a pool,
//! like PyTorch's `with torch.cuda.use_mem_pool(pool):`.

use super::{SymmBuffer, SymmPool};
use crate::error::{Error, Result};
use crate::stream::Stream;
use std::cell::RefCell;

thread_local! {
    static ACTIVE: RefCell<Vec<SymmPool>> = const { RefCell::new(Vec::new()) };
}

/// Pops the scope's pool when dropped, also while unwinding from a panic.
struct ScopeGuard;

impl Drop for ScopeGuard {
    fn drop(&mut self) {
        // The pool leaves the list before it is dropped, out of the borrow.
        drop(ACTIVE.with_borrow_mut(Vec::pop));
    }
}

impl SymmPool {
    /// Run `f` with this pool active on the current thread: inside it,
    /// [`symmpool::alloc`](crate::alloc) allocates from this pool and
    /// [`symmpool::current`](crate::current) returns it.
    ///
    /// Scopes are per thread and nest (the innermost wins); the previous pool is
    /// restored when `f` returns or panics. Buffers allocated inside outlive the scope.
    pub fn scope<R>(&self, f: impl FnOnce() -> R) -> R {
        ACTIVE.with(|a| a.borrow_mut().push(self.clone()));
        let _guard = ScopeGuard;
        f()
    }
}

/// The pool of the innermost [`SymmPool::scope`] on this thread, if any: what a host
/// runtime's tensor allocator asks to decide whether to route an allocation here.
pub fn current() -> Option<SymmPool> {
    ACTIVE.with(|a| a.borrow().last().cloned())
}

/// Allocate `size_bytes` on `stream` from the current thread's active pool: the hook a
/// host runtime's own allocator calls.
///
/// # Collective
/// As [`SymmPool::alloc`].
///
/// # Errors
/// [`Error::NoActivePool`] outside any scope; otherwise as [`SymmPool::alloc`].
pub fn alloc(size_bytes: u64, stream: &Stream) -> Result<SymmBuffer> {
    alloc_aligned(size_bytes, 1, stream)
}

/// As [`alloc`], with an alignment (a power of two up to the segment granularity).
///
/// # Collective
/// As [`SymmPool::alloc`].
///
/// # Errors
/// [`Error::NoActivePool`] outside any scope; otherwise as [`SymmPool::alloc_aligned`].
pub fn alloc_aligned(size_bytes: u64, align_bytes: u64, stream: &Stream) -> Result<SymmBuffer> {
    current()
        .ok_or(Error::NoActivePool)?
        .alloc_aligned(size_bytes, align_bytes, stream)
}
