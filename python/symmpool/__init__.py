"""symmpool: a deterministic symmetric-memory pool for NCCL, from Python.

- :class:`Pool` (Rust): one rank's pool. :func:`from_group` makes one from a
  ``torch.distributed`` process group (its ``ncclComm_t`` and its default store).
- :mod:`symmpool.fsdp`: FSDP2 comm objects (``AllGather`` / ``ReduceScatter``) over the
  pool, and :func:`symmpool.fsdp.install` (a tag per FSDP module on every collective,
  a step boundary at the end of each backward pass).
- Collectives (``Buffer.all_gather`` / ``reduce_scatter`` / ``all_reduce``, or by
  address ``Pool.all_gather_at``, ...) take ``tag=`` (an int; without one, a
  ``UsageError`` unless the pool was made with ``untagged_collectives=True``) and are
  checked across ranks as the pool's ``check`` says (``"strict"``, ``"async"``,
  ``"off"``); ``Pool.end_step()`` marks a step boundary.
- :mod:`symmpool.allocator`: the pool as a ``torch.cuda.MemPool`` through
  ``CUDAPluggableAllocator`` (the C functions ``symmpool_alloc`` / ``symmpool_free`` of
  the extension module).
- :meth:`Pool.shm`: one pool per process without a GPU (torchrun or
  ``python -m symmpool.launch`` on a CPU machine), over the shared-memory backend and
  the crate's own store (:class:`TcpStoreExchange`) or a :class:`StoreExchange`.
- :meth:`Pool.shrink`: after a lost rank (:class:`PeerLostError`), the survivors' pool
  and a :class:`ShrinkReport` (:class:`ShrinkFailed` when the group cannot shrink).
- :meth:`Pool.grow`: the group grown back by newcomers, processes started with
  ``SYMMPOOL_JOIN=1`` as the lost job ranks (whose :meth:`Pool.shm` joins the group's
  pool, :attr:`Pool.joined` its report): the grown group's pool and a
  :class:`GrowReport`, or ``None`` when no newcomer waits.
- :mod:`symmpool.errors`: the exception classes (:class:`SymmpoolError` and its
  subclasses, sorted by what the caller can do), also importable from here.
- :func:`last_error`: the message of the last failure (PyTorch reports a failed
  pluggable allocation only as out of memory).
- :func:`nccl_mappings`: how many NCCL libraries this process has mapped (must be 1).
- The crate's warnings arrive through :mod:`warnings` (:class:`SymmpoolWarning`, about
  a pool the caller holds, e.g. one dropped without ``close()``) and :mod:`logging`
  (the ``"symmpool"`` logger and its children); :func:`flush_logs` delivers the queued
  ones now (a thread of the extension delivers them otherwise, within moments).

Importing the package does not import torch.
"""

from . import _ext
from ._ext import (
    Buffer,
    GrowReport,
    Pool,
    ShrinkReport,
    StoreExchange,
    StoreServer,
    TcpStoreExchange,
    clear_error,
    flush_logs,
    install_allocator,
    last_error,
    live_buffers,
    nccl_version,
    render_ranks_svg,
)
from ._maps import nccl_libraries, nccl_mappings
from .errors import (
    ConfigurationError,
    DivergenceError,
    GroupLostError,
    OutOfMemoryError,
    PeerLostError,
    ShrinkFailed,
    SymmpoolError,
    SymmpoolTimeoutError,
    SymmpoolWarning,
    UsageError,
)

__version__ = _ext.__version__

__all__ = [
    "Buffer",
    "ConfigurationError",
    "DivergenceError",
    "GroupLostError",
    "GrowReport",
    "OutOfMemoryError",
    "PeerLostError",
    "Pool",
    "ShrinkFailed",
    "ShrinkReport",
    "StoreExchange",
    "StoreServer",
    "SymmpoolError",
    "SymmpoolTimeoutError",
    "SymmpoolWarning",
    "TcpStoreExchange",
    "UsageError",
    "clear_error",
    "flush_logs",
    "from_group",
    "install_allocator",
    "last_error",
    "live_buffers",
    "nccl_libraries",
    "nccl_mappings",
    "nccl_version",
    "render_ranks_svg",
    "store_exchange",
]


def store_exchange(group=None, *, name="symmpool", poll_s=None):
    """A :class:`StoreExchange` over torch's default store for ``group`` (``poll_s``:
    see :class:`StoreExchange`; None, the default, waits for each round's keys in one
    blocking ``store.wait`` up to the call's deadline)."""
    from ._dist import store_exchange as _se

    return _se(group, name=name, poll_s=poll_s)


def from_group(group=None, *, mode="adopt", name="symmpool", **kwargs):
    """A :class:`Pool` for this rank of a ``torch.distributed`` NCCL group.

    ``mode="adopt"`` (default): the crate splits its own non-blocking communicators
    (symmetric, copy-engine, plain) off the group's ``ncclComm_t``: for the FSDP2 comm
    objects. ``mode="wrap"``: segments are registered as windows on the group's
    communicator itself, so PyTorch's own collectives on the group find them: for the
    pluggable allocator. Collective over the group.
    """
    from ._dist import pool_from_group

    return pool_from_group(group, mode=mode, name=name, **kwargs)
