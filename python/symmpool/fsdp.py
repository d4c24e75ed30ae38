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

Safe by default: every collective the comm objects issue through the pool carries the
tag of its FSDP module, and the comm objects mark the step boundary themselves, so a
rank that skips (or adds) a module's all-gather or reduce-scatter fails with a
:class:`~symmpool.errors.DivergenceError` on every rank instead of pairing its calls
with another module's:

- **Tags**: :func:`install` gives each FSDP module (each ``FSDPParamGroup``: the
  comm objects are set per module, so one pair per module) its own comm objects,
  whose calls carry :func:`module_tag` of the module's fully-qualified name in the
  model (``""`` for the root): BLAKE2b over the name, the same on every rank and in
  every process. Under the pool's ``"strict"`` check the ranks compare each call's
  record, tag included, before it runs: a skipped module is a ``DivergenceError``
  naming the field ``"tag"`` on every rank and no data moves. Under ``"async"`` (the
  default) the comparison runs beside the calls: the error comes from a later call,
  at the latest the pool's ``check_queue`` + 1 collectives later, or from the step
  boundary; the diverging calls may have moved data by then.
- **Step boundary**: the first call of the comm objects in a backward pass queues an
  autograd callback (``Variable._execution_engine.queue_callback``) that calls
  ``pool.end_step()`` when the backward pass ends: after FSDP2's own
  end-of-backward callback (queued before, by FSDP2's root pre-backward), so after
  every reduce-scatter of the pass, and before ``loss.backward()`` returns, hence
  before an optimizer uses the gradients. Every rank reaches it once per backward
  pass. A divergence that the checks found is raised from ``loss.backward()``. A
  forward-only loop (evaluation) has no backward pass: call
  :meth:`Installed.end_step` there yourself, once per step on every rank.
- Turn either off with ``install(model, tags=False)`` (untagged calls, on a pool made
  with ``untagged_collectives=True``: a skipped module is caught only by the other
  fields of the records, for example a size, or at the step boundary) or ``install(model, end_step=False)`` (no automatic
  boundary: call :meth:`Installed.end_step`). Under the pool's ``check="off"``
  neither does anything.

Path choice: each collective takes the path the pool's automatic choice gives its size.
Its default thresholds were measured with every rank on its own GPU of one node; where
the crate says they may not hold (``Pool.needs_calibration``: NCCL with ranks that
share a GPU or span several nodes), :func:`install` first measures every path over
the sizes of the FSDP modules' all-gathers and reduce-scatters and keeps the fastest
per size (``calibrate="auto"``, the default; ``True``: always; ``False``: never), and
logs the thresholds chosen at INFO on the ``"symmpool.fsdp"`` logger.

Without a GPU (a pool on the shared-memory or host backend, ``pool.device`` is
None, and FSDP2 on CPU over gloo), ``allocate`` returns FSDP an ordinary CPU tensor
and each collective copies through a pool buffer (allocated, written, run, read,
freed): slower, but the same tags, checks and step boundary, for CPU jobs and tests.
"""

import ctypes
import hashlib
import json
import math
import time

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils.dlpack import from_dlpack

from ._calibrate import check_choice, collective_range, maybe_calibrate
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


def module_tag(fqn):
    """The tag of the collectives of the FSDP module at ``fqn``, its fully-qualified
    name in the model (``""`` for the root): the first 8 bytes of BLAKE2b over the
    UTF-8 name, as a little-endian int. The same on every rank and in every process
    (never Python's randomised ``hash()``)."""
    digest = hashlib.blake2b(fqn.encode(), digest_size=8, person=b"symmpool.fsdp").digest()
    return int.from_bytes(digest, "little")


def _in_backward():
    """The autograd graph task running on this thread (-1: none)."""
    return torch._C._current_graph_task_id()


class StepBoundary:
    """``pool.end_step()`` once at the end of each backward pass in which a comm
    object of the pool was called (see the module's documentation). ``steps`` counts
    the boundaries marked."""

    def __init__(self, pool):
        self.pool = pool
        #: Step boundaries marked so far.
        self.steps = 0
        self._armed = -1  # the graph task whose end is queued

    def arm(self):
        """Queue the boundary at the end of the running backward pass, once per pass
        (outside a backward pass: nothing)."""
        task = _in_backward()
        if task == -1 or task == self._armed:
            return
        self._armed = task
        Variable._execution_engine.queue_callback(self._end)

    def _end(self):
        self._armed = -1
        self.steps += 1
        self.pool.end_step()


def _host_bytes(tensor):
    """The bytes of a contiguous CPU tensor."""
    return ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def _host_fill(tensor, data):
    """Copy ``data`` into a contiguous CPU tensor of that many bytes."""
    if len(data) != tensor.numel() * tensor.element_size():
        raise ValueError(f"{len(data)} bytes for a tensor of {tensor.numel() * tensor.element_size()}")
    ctypes.memmove(tensor.data_ptr(), data, len(data))


class _Alloc:
    def __init__(self, pool, trace=None, *, tag=None, step=None):
        self.pool = pool
        #: The tag every collective of this object carries (None: untagged).
        self.tag = tag
        #: Paths taken, by name: {"copy_engine": n, ...}.
        self.paths = {}
        #: Calls handed to torch.distributed.
        self.fallbacks = 0
        #: A :class:`Trace`, or None.
        self.trace = trace
        #: The :class:`StepBoundary` the calls arm, or None.
        self.step = step
        # A pool without a GPU: CPU tensors, each collective through a pool buffer.
        self._host = pool.device is None
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
        current stream without a host synchronisation (a pool without a GPU: an
        ordinary tensor on ``device``)."""
        size = tuple(size) if not isinstance(size, int) else (size,)
        if self._host:
            return torch.empty(size, dtype=dtype, device=device)
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
        if self.step is not None:
            self.step.arm()
        if self.trace is None:
            return fn()
        if self._host:
            return self.trace.host(name, fn)
        return self.trace.call(name, name, fn)

    def _count(self, path):
        self.paths[path] = self.paths.get(path, 0) + 1

    def _ours(self, tensor):
        return tensor.is_cuda and tensor.is_contiguous() and tensor.storage_offset() == 0

    def _host_ok(self, *tensors):
        return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)

    def _through_buffers(self, name, input_tensor, output_tensor, collective):
        """Without a GPU: ``collective(input_buffer, output_buffer)`` on pool buffers
        holding ``input_tensor``'s bytes and ``output_tensor``'s size, then the output
        copied into ``output_tensor``. Nothing to move (no element, the same on every
        rank): no call."""
        in_nbytes = input_tensor.numel() * input_tensor.element_size()
        out_nbytes = output_tensor.numel() * output_tensor.element_size()
        if in_nbytes == 0 or out_nbytes == 0:
            return
        inb = self.pool.alloc(in_nbytes)
        try:
            outb = self.pool.alloc(out_nbytes)
            try:
                inb.write(_host_bytes(input_tensor))
                path = self._run(name, lambda: collective(inb, outb))
                _host_fill(output_tensor, outb.read())
            finally:
                outb.free()
        finally:
            inb.free()
        self._count(path)


class AllGather(_Alloc, _AllGatherBase):
    """FSDP2 ``AllGather`` over ``pool``: in-place all-gather on pool buffers, each
    call carrying ``tag`` (None: untagged) and arming ``step`` (a
    :class:`StepBoundary`, or None)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        rank, world = self._rank_world(group)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        if world != self.pool.world_size:
            return self._fallback(output_tensor, input_tensor, group, async_op)
        if self._host:
            if not self._host_ok(output_tensor, input_tensor):
                return self._fallback(output_tensor, input_tensor, group, async_op)
            self._through_buffers(
                "all-gather", input_tensor, output_tensor, lambda i, o: i.all_gather(out=o, tag=self.tag)
            )
            return None
        if not self._ours(output_tensor):
            return self._fallback(output_tensor, input_tensor, group, async_op)
        chunk = input_tensor.numel() * input_tensor.element_size()
        if input_tensor.data_ptr() != output_tensor.data_ptr() + rank * chunk:
            # Not FSDP's in-place layout: put this rank's shard in place first.
            output_tensor.view(-1).narrow(0, rank * input_tensor.numel(), input_tensor.numel()).copy_(
                input_tensor.view(-1)
            )
        ptr, stream, tag = output_tensor.data_ptr(), _stream(), self.tag
        try:
            path = self._run("all-gather", lambda: self.pool.all_gather_at(ptr, nbytes, stream, tag=tag))
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
    same stream. Each call carries ``tag`` and arms ``step``, as for
    :class:`AllGather`."""

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        rank, world = self._rank_world(group)
        name = _op_name(op)
        dtype = _DTYPES.get(input_tensor.dtype)
        if name is None or dtype is None or world != self.pool.world_size:
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        tag = self.tag
        if self._host:
            if not self._host_ok(output_tensor, input_tensor) or output_tensor.dtype != input_tensor.dtype:
                return self._fallback(output_tensor, input_tensor, group, op, async_op)
            self._through_buffers(
                "reduce-scatter",
                input_tensor,
                output_tensor,
                lambda i, o: i.reduce_scatter(dtype, name, out=o, tag=tag),
            )
            return None
        if not self._ours(input_tensor):
            return self._fallback(output_tensor, input_tensor, group, op, async_op)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        in_ptr, stream = input_tensor.data_ptr(), _stream()
        out_nbytes = output_tensor.numel() * output_tensor.element_size()
        if self._ours(output_tensor) and output_tensor.dtype == input_tensor.dtype and out_nbytes * world == nbytes:
            out_ptr = output_tensor.data_ptr()
            try:
                path = self._run(
                    "reduce-scatter",
                    lambda: self.pool.reduce_scatter_into(
                        in_ptr, nbytes, out_ptr, out_nbytes, dtype, name, stream, tag=tag
                    ),
                )
                self._count(path)
                return None
            except ValueError as e:  # the output is not a whole buffer of this pool
                _reraise_crate_error(e)
        try:
            path = self._run(
                "reduce-scatter", lambda: self.pool.reduce_scatter_at(in_ptr, nbytes, dtype, name, stream, tag=tag)
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
    """What :func:`install` returns: the pool, the comm objects of each FSDP module
    (by its fully-qualified name, ``""`` for the root), their tags and the step
    boundary."""

    def __init__(self, pool, all_gathers, reduce_scatters, modules, tags, step=None, trace=None, calibration=None):
        self.pool = pool
        #: ``{fqn: AllGather}``, one per FSDP module (installed or not).
        self.all_gathers = all_gathers
        #: ``{fqn: ReduceScatter}``, one per FSDP module (installed or not).
        self.reduce_scatters = reduce_scatters
        #: The FSDP modules, in the model's order.
        self.modules = modules
        #: ``{fqn: tag}`` (the tag is None with ``install(..., tags=False)``).
        self.tags = tags
        #: The :class:`StepBoundary`, or None (``install(..., end_step=False)``).
        self.step = step
        #: The :class:`Trace` (``install(..., trace=True)``), or None.
        self.trace = trace
        #: What the calibration chose (``Pool.calibrate``'s dict, with ``reason``),
        #: or None when ``install`` did not calibrate.
        self.calibration = calibration

    def end_step(self):
        """A step boundary, now: ``pool.end_step()`` (collective: every rank at the
        same point, e.g. once per step of a forward-only loop). The comm objects mark
        one at the end of each backward pass themselves (unless ``end_step=False``)."""
        self.pool.end_step()

    def write_trace(self, path):
        """Write the comm objects' timeline to ``path`` (Chrome-trace JSON; needs
        ``install(..., trace=True)``). Synchronises the device: call it after the steps."""
        if self.trace is None:
            raise RuntimeError("no trace: install the comm objects with trace=True")
        self.trace.write(path)

    def paths(self):
        """Paths taken so far, over every module: ``{"all_gather": {...},
        "reduce_scatter": {...}}``."""
        out = {}
        for kind, objs in (("all_gather", self.all_gathers), ("reduce_scatter", self.reduce_scatters)):
            total = out[kind] = {}
            for obj in objs.values():
                for path, n in obj.paths.items():
                    total[path] = total.get(path, 0) + n
        return out

    def fallbacks(self):
        """Calls handed to ``torch.distributed`` so far, over every module."""
        return sum(o.fallbacks for o in (*self.all_gathers.values(), *self.reduce_scatters.values()))


def _fsdp_modules(model):
    """``[(fqn, module)]`` of the FSDP2 modules of ``model`` in its order, one per
    FSDP state (``fully_shard([a, b])`` makes one state for both: the first name)."""
    from torch.distributed.fsdp import FSDPModule

    seen, out = set(), []
    for fqn, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        get_state = getattr(m, "_get_fsdp_state", None)
        state = id(get_state()) if get_state is not None else id(m)
        if state not in seen:
            seen.add(state)
            out.append((fqn, m))
    return out


def _param_group(module):
    """The ``FSDPParamGroup`` of an FSDP2 module (None: no parameters, or a torch
    without that private attribute)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    return getattr(get_state(), "_fsdp_param_group", None) if get_state is not None else None


def install(
    model,
    group=None,
    *,
    pool=None,
    all_gather=True,
    reduce_scatter=True,
    name="symmpool-fsdp",
    trace=False,
    tags=True,
    end_step=True,
    calibrate="auto",
    **pool_kwargs,
):
    """Install symmpool's comm objects on every FSDP2 module of ``model``.

    ``pool``: a :class:`symmpool.Pool` (by default one made with
    ``symmpool.from_group(group, mode="adopt", name=name, **pool_kwargs)``, which is
    collective over the group; ``check="strict"`` among ``pool_kwargs`` checks each
    call before it runs). Each FSDP module gets its own pair of comm objects, whose
    calls carry :func:`module_tag` of the module's fully-qualified name (``tags=False``:
    untagged, which needs a pool made with ``untagged_collectives=True``: the pool made
    here is, a ``pool`` given without it is a ``ValueError``) and mark the step boundary at the end of each backward pass
    (``end_step=False``: not; see the module's documentation). ``trace``: time every
    allocation and collective (``Installed.write_trace``).

    ``calibrate``: ``"auto"`` (the default) measures the pool's paths before the
    first step where the crate says the default thresholds may not hold
    (``pool.needs_calibration``: NCCL with ranks that share a GPU or span several
    nodes), ``True`` always, ``False`` never. It measures every path at the smallest
    and largest per-rank size of the FSDP modules' all-gathers and reduce-scatters
    (from FSDP2's parameter groups; 64 KiB to 64 MiB where they cannot be read) and
    the powers of two between, with cheap settings, in a temporary pool of (world + 1)
    x the largest size, applies the fastest path per size to the pool's collectives
    (a ``pool`` passed in included: its policy changes too) and logs the thresholds
    at INFO (``Installed.calibration`` has them). Returns an
    :class:`Installed`.

    Collective: every rank installs on the same model at the same point.
    """
    from . import from_group

    modules = _fsdp_modules(model)
    if not modules:
        raise ValueError("the model has no FSDP2 module (apply fully_shard first)")
    check_choice(calibrate)
    if pool is None:
        if not tags:
            # Untagged calls: the pool is made for them (on every rank alike).
            pool_kwargs.setdefault("untagged_collectives", True)
        pool = from_group(group, mode="adopt", name=name, **pool_kwargs)
    if not tags and not pool.untagged_collectives:
        raise ValueError(
            "install(tags=False) makes untagged collectives: give a pool made with "
            "untagged_collectives=True (on every rank), or keep tags=True"
        )
    sizes = collective_range(_param_group(m) for _, m in modules)
    stream = _stream(pool.device) if pool.device is not None else 0
    calibration = maybe_calibrate(pool, calibrate, sizes, stream)
    timeline = Trace(pool.rank) if trace else None
    step = StepBoundary(pool) if end_step else None
    ags, rss, tag_of = {}, {}, {}
    for fqn, m in modules:
        tag = tag_of[fqn] = module_tag(fqn) if tags else None
        ag = ags[fqn] = AllGather(pool, timeline, tag=tag, step=step)
        rs = rss[fqn] = ReduceScatter(pool, timeline, tag=tag, step=step)
        if all_gather:
            m.set_custom_all_gather(ag)
        if reduce_scatter:
            m.set_custom_reduce_scatter(rs)
    return Installed(pool, ags, rss, [m for _, m in modules], tag_of, step, timeline, calibration)
