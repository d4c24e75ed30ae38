"""The pool as PyTorch's pluggable allocator.

``torch.cuda.memory.CUDAPluggableAllocator(symmpool._ext.__file__, "symmpool_alloc",
"symmpool_free")`` calls the extension's C functions::

    void* symmpool_alloc(size_t size, int device, cudaStream_t stream);
    void  symmpool_free(void* ptr, size_t size, int device, cudaStream_t stream);

With ``torch.cuda.MemPool(allocator, no_split=True)`` and ``torch.cuda.use_mem_pool``,
each segment PyTorch's caching allocator requests is one buffer carved from the
installed pool's registered segments (same sizes in the same order on every rank: same
offsets); PyTorch frees them when the ``MemPool`` is destroyed. A failed allocation is
an out-of-memory error to PyTorch; :func:`symmpool.last_error` has the reason.
"""

from . import _ext

ALLOC_FN = "symmpool_alloc"
FREE_FN = "symmpool_free"


def pluggable_allocator():
    """A ``CUDAPluggableAllocator`` over the extension's C functions."""
    from torch.cuda.memory import CUDAPluggableAllocator

    return CUDAPluggableAllocator(_ext.__file__, ALLOC_FN, FREE_FN)


def mem_pool(pool, *, no_split=True):
    """Install ``pool`` as the allocator's pool and return a ``torch.cuda.MemPool`` over
    it; allocate with ``with torch.cuda.use_mem_pool(mp): ...``. Only one pool serves the
    pluggable allocator at a time (the last installed)."""
    import torch

    _ext.install_allocator(pool)
    allocator = pluggable_allocator()
    return torch.cuda.MemPool(allocator.allocator(), no_split=no_split)
