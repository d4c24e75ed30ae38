"""FSDP2 comm objects over a symmpool pool.

FSDP2's extension point (``FSDPModule.set_custom_all_gather`` /
``set_custom_reduce_scatter``) takes objects with ``allocate(size, *, dtype, device)``
and ``__call__``. Here:

- ``allocate`` carves the buffer from the pool (on the current stream: FSDP's
  all-gather copy-in stream, or its reduce-scatter stream) and returns a tensor over
  it, made from a DLPack capsule whose deleter returns the block to the pool when FSDP
  drops the tensor. The pool orders reuse on the device (a fence event at free, a
  stream wait at reuse): no host synchronisation, ever; a collective only when the pool
  must grow (a new segment, registered on every rank).
- ``__call__`` runs the crate's all-gather (in place, FSDP's layout) or reduce-scatter
  (from FSDP's input buffer straight into its output buffer, both the pool's, no copy)
  on the stream FSDP made current, on the communicators the crate split off the
  group's, with the path chosen per size (copy engine / symmetric kernel / ring) as
  the Rust API does. No stream, event or synchronisation of its own: FSDP2 orders its
  streams itself.

Host calls per collective (the blocking data communicators: a collective is its
enqueue plus one event record, on the caller's thread):

- ``allocate``: one call into the extension (``alloc_dlpack``: the pool's allocation,
  no CUDA call unless a freed block is reused across streams, then one
  ``cuStreamWaitEvent``), then ``from_dlpack`` and two ``view``.
- all-gather: ``torch.cuda.current_stream()`` and one call into the extension
  (``all_gather_at``: the buffer looked up by address, then the NCCL enqueue and one
  event record); group rank and size are cached per group.
- reduce-scatter: the same with ``reduce_scatter_into`` (input and output looked up).
  When FSDP's output is not a pool buffer, the in-place reduce-scatter
  (``reduce_scatter_at``) and one ``copy_`` of this rank's chunk instead.

With ``trace=True`` (``install(..., trace=True)``) every allocation and collective is
timed (host clock, and a CUDA timing-event pair on its stream, read only when the trace
is written) and ``Installed.write_trace(path)`` writes the same Chrome-trace JSON as the
Rust example's ``fsdp_step --trace``.

Calls the crate cannot run (a buffer that is not the pool's, a reduction other than
sum or average, an element type other than f32/bf16/f16) go to ``torch.distributed``'s
own collective, unchanged.
"""

import json
import math
import time

import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

from .errors import SymmpoolError

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


def _reraise_crate_error(e):
    """A buffer that is not the pool's is a plain ``ValueError`` (the call falls back
    to ``torch.distributed``); a ``ConfigurationError`` of the crate (also a
    ``ValueError``) is raised."""
    if isinstance(e, SymmpoolError):
        raise e


def _op_name(op):
    if op is None or op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    return None


#: The Chrome-trace rows (``tid``), as in the Rust example's timeline.
_ROWS = {"host": 0, "compute": 1, "all-gather": 2, "reduce-scatter": 3}


class Trace:
    """One rank's timeline of the comm objects' calls: host times around each call and
    a CUDA timing-event pair on its stream, read only by :meth:`write` (after the
    steps; it synchronises the device then)."""

    def __init__(self, rank=0):
        self.rank = rank
        self._reference = None  # (event, host µs)
        self._host = []  # (name, start µs, duration µs)
        self._device = []  # (name, row, start event, end event)

    def _now_us(self):
        return time.time() * 1e6

    def call(self, name, row, fn):
        """Run ``fn()``, which enqueues ``name`` on the current stream, timed."""
        if self._reference is None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._reference = (ev, self._now_us())
        t0 = self._now_us()
        begin = torch.cuda.Event(enable_timing=True)
        begin.record()
        out = fn()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._host.append((name, t0, self._now_us() - t0))
        self._device.append((name, row, begin, end))
        return out

    def host(self, name, fn):
        """Run ``fn()`` (host work only), timed."""
        t0 = self._now_us()
        out = fn()
        self._host.append((name, t0, self._now_us() - t0))
        return out

    def events(self):
        """The Chrome-trace events so far (synchronises the device)."""
        events = [
            {"name": n, "cat": "fsdp2", "ph": "X", "ts": t, "dur": d, "pid": self.rank, "tid": 0, "args": {}}
            for n, t, d in self._host
        ]
        if self._reference is not None:
            torch.cuda.synchronize()
            ref, ref_us = self._reference
            for n, row, b, e in self._device:
                start = ref_us + ref.elapsed_time(b) * 1e3
                dur = max(b.elapsed_time(e) * 1e3, 0.0)
                events.append(
                    {"name": n, "cat": "fsdp2", "ph": "X", "ts": start, "dur": dur, "pid": self.rank, "tid": _ROWS[row], "args": {}}
                )
        origin = min((e["ts"] for e in events), default=0.0)
        for e in events:
            e["ts"] -= origin
        rows = sorted({e["tid"] for e in events})
        names = {v: k for k, v in _ROWS.items()}
        meta = [{"ph": "M", "name": "process_name", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        meta += [{"ph": "M", "name": "thread_name", "pid": self.rank, "tid": t, "args": {"name": names[t]}} for t in rows]
        return events + meta

    def write(self, path):
        """Write the timeline to ``path`` as Chrome-trace JSON (Perfetto,
        chrome://tracing)."""
        with open(path, "w") as f:
            json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms"}, f)


class _Alloc:
    def __init__(self, pool, trace=None):
        self.pool = pool
        #: Paths taken, by name: {"copy_engine": n, ...}.
        self.paths = {}
        #: Calls handed to torch.distributed.
        self.fallbacks = 0
        #: A :class:`Trace`, or None.
        self.trace = trace
        self._groups = {}

    def _rank_world(self, group):
        """(rank, size) of ``group``, asked once per group."""
        key = id(group) if group is not None else None
        rw = self._groups.get(key)
        if rw is None:
            rw = self._groups[key] = (dist.get_rank(group), dist.get_world_size(group))
        return rw

    def allocate(self, size, *, dtype, device):
        """A tensor of ``size`` and ``dtype`` over a pool buffer, allocated on the
        current stream without a host synchronisation."""
        size = tuple(size) if not isinstance(size, int) else (size,)
        numel = math.prod(size)
        itemsize = dtype.itemsize
        nbytes = max(numel * itemsize, 1)
        device = torch.device(device)
        stream = _stream(device)
        if self.trace is not None:
            capsule = self.trace.host("alloc", lambda: self.pool.alloc_dlpack(nbytes, stream))
        else:
            capsule = self.pool.alloc_dlpack(nbytes, stream)
        raw = from_dlpack(capsule)
        if numel == 0:
            return raw[:0].view(dtype).view(size)
        return raw.view(dtype).view(size)

    def _run(self, name, fn):
        if self.trace is None:
            return fn()
        return self.trace.call(name, name, fn)

    def _count(self, path):
        self.paths[path] = self.paths.get(path, 0) + 1

    def _ours(self, tensor):
        return tensor.is_cuda and tensor.is_contiguous() and tensor.storage_offset() == 0


class AllGather(_Alloc, _AllGatherBase):
    """FSDP2 ``AllGather`` over ``pool``: in-place all-gather on pool buffers."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rank, world = self._rank_world(group)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        if world != self.pool.world_size or not self._ours(output_tensor):
            return self._fallback(output_tensor, input_tensor, group, async_op)
        chunk = input_tensor.numel() * input_tensor.element_size()
        if input_tensor.data_ptr() != output_tensor.data_ptr() + rank * chunk:
            # Not FSDP's in-place layout: put this rank's shard in place first.
            output_tensor.view(-1).narrow(0, rank * input_tensor.numel(), input_tensor.numel()).copy_(
                input_tensor.view(-1)
            )
        ptr, stream = output_tensor.data_ptr(), _stream()
        try:
            path = self._run("all-gather", lambda: self.pool.all_gather_at(ptr, nbytes, stream))
        except ValueError as e:  # not a buffer of this pool
            _reraise_crate_error(e)
            return self._fallback(output_tensor, input_tensor, group, async_op)
        self._count(path)
        return None

    def _fallback(self, output_tensor, input_tensor, group, async_op):
        self.fallbacks += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class ReduceScatter(_Alloc, _ReduceScatterBase):
    """FSDP2 ``ReduceScatter`` over ``pool``: a reduce-scatter from the pool buffer
    FSDP allocated for the input straight into the pool buffer it allocated for the
    output (one call, no copy, the path chosen per size). An output that is not the
    pool's gets the in-place reduce-scatter and a copy of this rank's chunk, on the
    same stream."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        rank, world = self._rank_world(group)
        name = _op_name(op)
        dtype = _DTYPES.get(input_tensor.dtype)
        if name is None or dtype is None or world != self.pool.world_size or not self._ours(input_tensor):
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        in_ptr, stream = input_tensor.data_ptr(), _stream()
        out_nbytes = output_tensor.numel() * output_tensor.element_size()
        if self._ours(output_tensor) and output_tensor.dtype == input_tensor.dtype and out_nbytes * world == nbytes:
            out_ptr = output_tensor.data_ptr()
            try:
                path = self._run(
                    "reduce-scatter",
                    lambda: self.pool.reduce_scatter_into(in_ptr, nbytes, out_ptr, out_nbytes, dtype, name, stream),
                )
                self._count(path)
                return None
            except ValueError as e:  # the output is not a whole buffer of this pool
                _reraise_crate_error(e)
        try:
            path = self._run(
                "reduce-scatter", lambda: self.pool.reduce_scatter_at(in_ptr, nbytes, dtype, name, stream)
            )
        except ValueError as e:  # not a buffer of this pool
            _reraise_crate_error(e)
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

    def __init__(self, pool, all_gather, reduce_scatter, modules, trace=None):
        self.pool = pool
        self.all_gather = all_gather
        self.reduce_scatter = reduce_scatter
        self.modules = modules
        #: The :class:`Trace` (``install(..., trace=True)``), or None.
        self.trace = trace

    def write_trace(self, path):
        """Write the comm objects' timeline to ``path`` (Chrome-trace JSON; needs
        ``install(..., trace=True)``). Synchronises the device: call it after the steps."""
        if self.trace is None:
            raise RuntimeError("no trace: install the comm objects with trace=True")
        self.trace.write(path)

    def paths(self):
        """Paths taken so far: ``{"all_gather": {...}, "reduce_scatter": {...}}``."""
        return {"all_gather": dict(self.all_gather.paths), "reduce_scatter": dict(self.reduce_scatter.paths)}


def install(
    model, group=None, *, pool=None, all_gather=True, reduce_scatter=True, name="symmpool-fsdp", trace=False, **pool_kwargs
):
    """Install symmpool's comm objects on every FSDP2 module of ``model``.

    ``pool``: a :class:`symmpool.Pool` (by default one made with
    ``symmpool.from_group(group, mode="adopt", name=name, **pool_kwargs)``, which is
    collective over the group). ``trace``: time every allocation and collective
    (``Installed.write_trace``). Returns an :class:`Installed`.
    """
    from torch.distributed.fsdp import FSDPModule

    from . import from_group

    if pool is None:
        pool = from_group(group, mode="adopt", name=name, **pool_kwargs)
    timeline = Trace(pool.rank) if trace else None
    ag, rs = AllGather(pool, timeline), ReduceScatter(pool, timeline)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("the model has no FSDP2 module (apply fully_shard first)")
    for m in modules:
        if all_gather:
            m.set_custom_all_gather(ag)
        if reduce_scatter:
            m.set_custom_reduce_scatter(rs)
    return Installed(pool, ag, rs, modules, timeline)
