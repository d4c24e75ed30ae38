"""FSDP2 comm objects over a symmpool pool.

FSDP2's extension point (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``) takes objects with ``allocate(size, *, dtype, device)``
and ``__call__``. Here:

- ``allocate`` carves the buffer from the pool (on the current stream, FSDP's copy-in
  stream) and returns a tensor over it, made from a DLPack capsule whose deleter
  returns the block to the pool when FSDP drops the tensor;
- ``__call__`` runs the crate's in-place all-gather / reduce-scatter on the current
  stream, on the communicators the crate split off the group's, with the path chosen
  per size (copy engine / symmetric kernel / ring) as the Rust API does.

Calls the crate cannot run (a buffer that is not the pool's, a reduction other than
sum or average, an element type other than f32/bf16/f16) go to ``torch.distributed``'s
own collective, unchanged.
"""

import math

import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

try:  # torch >= 2.10
    from torch.distributed.fsdp._fully_shard._fsdp_api import (
        AllGather as _AllGatherBase,
        ReduceScatter as _ReduceScatterBase,
    )
except ImportError:  # pragma: no cover - older torch: duck typing is enough
    _AllGatherBase = object
    _ReduceScatterBase = object

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def _stream(device=None):
    return torch.cuda.current_stream(device).cuda_stream


def _op_name(op):
    if op is None or op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


class _Alloc:
    def __init__(self, pool):
        self.pool = pool
        #: Paths taken, by name: {"copy_engine": n, ...}.
        self.paths = {}
        #: Calls handed to torch.distributed.
        self.fallbacks = 0

    def allocate(self, size, *, dtype, device):
        """A tensor of ``size`` and ``dtype`` over a pool buffer."""
        size = tuple(size) if not isinstance(size, int) else (size,)
        numel = math.prod(size)
        itemsize = dtype.itemsize
        nbytes = max(numel * itemsize, 1)
        device = torch.device(device)
        capsule = self.pool.alloc_dlpack(nbytes, _stream(device))
        raw = from_dlpack(capsule)
        if numel == 0:
            return raw[:0].view(dtype).view(size)
        return raw.view(dtype).view(size)

    def _count(self, path):
        self.paths[path] = self.paths.get(path, 0) + 1

    def _ours(self, tensor):
        return tensor.is_cuda and tensor.is_contiguous() and tensor.storage_offset() == 0


class AllGather(_Alloc, _AllGatherBase):
    """FSDP2 ``AllGather`` over ``pool``: in-place all-gather on pool buffers."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        if world != self.pool.world_size or not self._ours(output_tensor):
            return self._fallback(output_tensor, input_tensor, group, async_op)
        chunk = input_tensor.numel() * input_tensor.element_size()
        if input_tensor.data_ptr() != output_tensor.data_ptr() + rank * chunk:
            # Not FSDP's in-place layout: put this rank's shard in place first.
            output_tensor.view(-1).narrow(0, rank * input_tensor.numel(), input_tensor.numel()).copy_(
                input_tensor.view(-1)
            )
        try:
            path = self.pool.all_gather_at(output_tensor.data_ptr(), nbytes, _stream())
        except ValueError:  # not a buffer of this pool
            return self._fallback(output_tensor, input_tensor, group, async_op)
        self._count(path)
        return None

    def _fallback(self, output_tensor, input_tensor, group, async_op):
        self.fallbacks += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ReduceScatter(_Alloc, _ReduceScatterBase):
    """FSDP2 ``ReduceScatter`` over ``pool``: in-place reduce-scatter on the pool
    buffer FSDP allocated for the input, then this rank's chunk is copied to the
    output (on the same stream)."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        world = dist.get_world_size(group)
        name = _op_name(op)
        dtype = _DTYPES.get(input_tensor.dtype)
        if name is None or dtype is None or world != self.pool.world_size or not self._ours(input_tensor):
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        rank = dist.get_rank(group)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        try:
            path = self.pool.reduce_scatter_at(input_tensor.data_ptr(), nbytes, dtype, name, _stream())
        except ValueError:
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        n = output_tensor.numel()
        output_tensor.view(-1).copy_(input_tensor.view(-1).narrow(0, rank * n, n))
        self._count(path)
        return None

    def _fallback(self, output_tensor, input_tensor, group, op, async_op):
        self.fallbacks += 1
        kwargs = {"group": group, "async_op": async_op}
        if op is not None:
            kwargs["op"] = op
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, **kwargs)


class Installed:
    """What :func:`install` returns: the pool and the two comm objects."""

    def __init__(self, pool, all_gather, reduce_scatter, modules):
        self.pool = pool
        self.all_gather = all_gather
        self.reduce_scatter = reduce_scatter
        self.modules = modules

    def paths(self):
        """Paths taken so far: ``{"all_gather": {...}, "reduce_scatter": {...}}``."""
        return {"all_gather": dict(self.all_gather.paths), "reduce_scatter": dict(self.reduce_scatter.paths)}


def install(model, group=None, *, pool=None, all_gather=True, reduce_scatter=True, name="symmpool-fsdp", **pool_kwargs):
    """Install symmpool's comm objects on every FSDP2 module of ``model``.

    ``pool``: a :class:`symmpool.Pool` (by default one made with
    ``symmpool.from_group(group, mode="adopt", name=name, **pool_kwargs)``, which is
    collective over the group). Returns an :class:`Installed`.
    """
    from torch.distributed.fsdp import FSDPModule

    from . import from_group

    if pool is None:
        pool = from_group(group, mode="adopt", name=name, **pool_kwargs)
    ag, rs = AllGather(pool), ReduceScatter(pool)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("the model has no FSDP2 module (apply fully_shard first)")
    for m in modules:
        if all_gather:
            m.set_custom_all_gather(ag)
        if reduce_scatter:
            m.set_custom_reduce_scatter(rs)
    return Installed(pool, ag, rs, modules)
