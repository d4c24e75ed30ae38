"""Several NCCL ranks on one GPU: the Python package on a world of simulated nodes.

Run as the ranks of one job, each rank with its own ``NCCL_HOSTID``: NCCL then treats
the ranks as separate nodes on one device, linked over NET/Socket (slow; no P2P, no
symmetric kernels, no copy engine), and the crate counts the nodes the same way::

    NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=0 python3 -m torch.distributed.run \\
        --standalone --nproc-per-node 2 --no-python bash -c \\
        'NCCL_HOSTID=simnode$LOCAL_RANK exec python3 -m pytest -ra -q -p no:cacheprovider "$@"' \\
        pytest python/tests/test_gpu_world.py

(``scripts/gpu-check.sh run python`` does this, and runs the same tests again as one
node: two ranks on one GPU with NCCL 2.32's ``NCCL_MULTI_RANK_GPU_ENABLE=1`` and no
``NCCL_HOSTID``, linked by P2P, where windows, symmetric kernels and the copy engine
run.) Every rank runs the same tests in the
same order, each rank on device ``LOCAL_RANK % device_count``. Launched any other way
(plain pytest, no GPU, no torch) every test is skipped with the reason; with
``SYMMPOOL_REQUIRE_GPU=1`` such a skip is a failure.

- Collectives against ``torch.distributed`` (the NCCL process group) on the same
  inputs: all-gather, reduce-scatter (sum) and all-reduce (sum), in place and out of
  place, float32 / bfloat16 / float16, several sizes, through the pool's by-address
  calls on DLPack tensors (FSDP2's way) and through ``Buffer``. The inputs are small
  integers (-30..30), so every sum of up to 8 ranks is exact in every dtype: the
  results must equal torch's and the exact sums bit for bit (tolerance 0). Across
  simulated nodes on NCCL < 2.29 every call must take the plain ring
  (``"plain_kernel"``).
- Adopt: ``Pool.nccl_adopt`` of the process group's own ``ncclComm_t`` (what
  ``symmpool.from_group`` and ``symmpool.fsdp.install`` do) gives a pool of the
  group's rank, size and device whose collectives are right, interleaved with torch's
  own collectives on the group, which go on working after the pool is closed.
- FSDP2 parity: a small transformer (3 blocks, d_model 128) trained for 4 steps with
  FSDP2 as it comes and with ``symmpool.fsdp.install`` (its defaults: a tag per
  module, the step boundary at the end of each backward pass), same seed and data, in
  fp32, in bf16 with fp32 reduction (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``, the usual recipe) and in bf16 with bf16 reduction. With two
  ranks each reduction is one addition (or an average of two, NCCL's ``avg`` in both
  runs), so the per-step losses and the final parameter shards must be equal bit for
  bit (tolerance 0); with more ranks the ring's order of summation may differ between
  communicators, and they must agree within ``rtol=1e-3, atol=1e-5``. The comm objects
  must have run: all-gather and reduce-scatter path counts above 0, no fallback to
  ``torch.distributed``, one step boundary per step. The model is built from matmuls,
  softmax, layer norms and GELU (no fused attention, whose backward may be
  non-deterministic) under ``torch.use_deterministic_algorithms``.

Bounds: each test at most ``TEST_TIMEOUT_S`` (``faulthandler`` then prints every
thread's stack and ends the rank; torchrun then stops the others), the process group's
timeout, the pools' deadlines (``timeout_s``, NCCL call timeouts).
"""

import copy
import faulthandler
import gc
import itertools
import os
from datetime import timedelta

import pytest

# Before any cuBLAS handle exists: cuBLAS's deterministic workspace (FSDP2 parity).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

torch = pytest.importorskip("torch", reason="torch is not installed")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.dlpack import from_dlpack  # noqa: E402

import symmpool  # noqa: E402

#: Seconds one test may take (a bound: each takes seconds).
TEST_TIMEOUT_S = 240
#: The process group's timeout.
PG_TIMEOUT_S = 120
#: The pools' timeouts (waits on other ranks).
POOL_TIMEOUT_S = 60.0

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: Elements per rank: one element, odd sizes, 4 MiB of float32 and then some.
SIZES = [1, 1023, 65536, (1 << 20) + 5]
#: The sizes also run through ``Buffer`` (its data crosses Python as bytes).
BUFFER_SIZES = SIZES[:3]

LAUNCH = (
    "run it as the ranks of an NCCL world, each rank with its own NCCL_HOSTID: "
    "python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python bash -c "
    "'NCCL_HOSTID=simnode$LOCAL_RANK exec python3 -m pytest \"$@\"' pytest python/tests/test_gpu_world.py"
)


def _why_not():
    """Why this process cannot run the tests (None: it can)."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return "not launched as a rank (RANK, WORLD_SIZE unset): " + LAUNCH
    if int(os.environ["WORLD_SIZE"]) < 2:
        return "needs a world of 2 or more ranks: " + LAUNCH
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    # Two ranks per GPU as one node: NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1.
    shared = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1" and local <= 2 * torch.cuda.device_count()
    if local > torch.cuda.device_count() and not os.environ.get("NCCL_HOSTID") and not shared:
        return (
            f"{local} ranks on {torch.cuda.device_count()} GPU(s) need a distinct NCCL_HOSTID per rank "
            "(or, two per GPU, NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1): " + LAUNCH
        )
    return None


@pytest.fixture(autouse=True, scope="module")
def _runnable():
    why = _why_not()
    if why is not None:
        if os.environ.get("SYMMPOOL_REQUIRE_GPU") == "1":
            pytest.fail(f"SYMMPOOL_REQUIRE_GPU=1 and {why}", pytrace=False)
        pytest.skip(why)


class _Bounded:
    """At most ``seconds`` until ``cancel()``: then every thread's stack on standard
    error and the process ends (exit status 1)."""

    def __init__(self, seconds):
        faulthandler.dump_traceback_later(seconds, exit=True)

    def cancel(self):
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def _deadline(_runnable):
    bound = _Bounded(TEST_TIMEOUT_S)
    yield
    bound.cancel()


class World:
    """This rank's place in the job."""

    def __init__(self, group, device, nodes):
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        #: Distinct NCCL_HOSTID values (or hosts) over the ranks.
        self.nodes = nodes

    def exact(self):
        """Whether FSDP2's reductions are one rounding (two ranks): equality expected."""
        return self.size == 2


@pytest.fixture(scope="module")
def world(_runnable):
    bound = _Bounded(TEST_TIMEOUT_S)
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=timedelta(seconds=PG_TIMEOUT_S))
    node = os.environ.get("NCCL_HOSTID") or os.uname().nodename
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    w = World(dist.group.WORLD, device, len(set(nodes)))
    print(
        f"rank {w.rank}/{w.size}: device {device}, node {node!r} of {w.nodes}; torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, symmpool.nccl_version()))} (torch's {torch.cuda.nccl.version()}), "
        f"NCCL libraries mapped: {symmpool.nccl_mappings()}",
        flush=True,
    )
    bound.cancel()
    yield w
    bound = _Bounded(TEST_TIMEOUT_S)
    torch.cuda.synchronize()
    dist.destroy_process_group()
    bound.cancel()


def _stream():
    return torch.cuda.current_stream().cuda_stream


def _pattern(rank, numel, dtype, device, salt=0):
    """Small integers in -30..30, different per rank and element: exact in every dtype,
    and so are their sums over up to 8 ranks."""
    i = torch.arange(numel, device=device, dtype=torch.int64)
    return ((i * 7 + rank * 13 + salt * 5) % 61 - 30).to(dtype)


def _sum(parts):
    """The exact elementwise sum (in float64, then the parts' dtype: exact here)."""
    return torch.stack([p.double() for p in parts]).sum(0).to(parts[0].dtype)


def _dev(pool, numel, dtype):
    """A tensor of ``numel`` elements over a fresh pool buffer (as FSDP2 gets them)."""
    return from_dlpack(pool.alloc_dlpack(numel * dtype.itemsize, _stream())).view(dtype)


def _bytes(t):
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def _from_bytes(data, dtype, device):
    return torch.frombuffer(bytearray(data), dtype=dtype).to(device)


def _cases(w, numel, dtype):
    """The inputs of each collective on this rank, the exact results, and torch's
    results (``torch.distributed`` on the group) from the same inputs."""
    d, r, n = w.device, w.rank, w.size
    ag_in = _pattern(r, numel, dtype, d)
    ag_want = torch.cat([_pattern(q, numel, dtype, d) for q in range(n)])
    rs_in = _pattern(r, numel * n, dtype, d, salt=1)
    rs_want = _sum([_pattern(q, numel * n, dtype, d, salt=1) for q in range(n)]).narrow(0, r * numel, numel)
    ar_in = _pattern(r, numel, dtype, d, salt=2)
    ar_want = _sum([_pattern(q, numel, dtype, d, salt=2) for q in range(n)])

    ag_torch = torch.empty(numel * n, dtype=dtype, device=d)
    dist.all_gather_into_tensor(ag_torch, ag_in, group=w.group)
    rs_torch = torch.empty(numel, dtype=dtype, device=d)
    dist.reduce_scatter_tensor(rs_torch, rs_in, op=dist.ReduceOp.SUM, group=w.group)
    ar_torch = ar_in.clone()
    dist.all_reduce(ar_torch, op=dist.ReduceOp.SUM, group=w.group)
    return {
        "all-gather": (ag_in, ag_want, ag_torch),
        "reduce-scatter": (rs_in, rs_want, rs_torch),
        "all-reduce": (ar_in, ar_want, ar_torch),
    }


def _by_address(pool, w, cases, tags):
    """Each collective through the pool's by-address calls on DLPack tensors (in place,
    and out of place where the pool has the call): ``{(name, mode): (result, path)}``."""
    r, n, s = w.rank, w.size, _stream()
    out = {}
    ag_in, _, _ = cases["all-gather"]
    numel, dtype = ag_in.numel(), ag_in.dtype
    buf = _dev(pool, numel * n, dtype)
    buf.fill_(-99)
    buf.narrow(0, r * numel, numel).copy_(ag_in)
    path = pool.all_gather_at(buf.data_ptr(), buf.numel() * dtype.itemsize, s, tag=next(tags))
    out[("all-gather", "in place")] = (buf.clone(), path)

    rs_in, _, _ = cases["reduce-scatter"]
    nbytes = rs_in.numel() * dtype.itemsize
    buf = _dev(pool, rs_in.numel(), dtype)
    buf.copy_(rs_in)
    path = pool.reduce_scatter_at(buf.data_ptr(), nbytes, dtype, "sum", s, tag=next(tags))
    out[("reduce-scatter", "in place")] = (buf.narrow(0, r * numel, numel).clone(), path)
    inb, outb = _dev(pool, rs_in.numel(), dtype), _dev(pool, numel, dtype)
    inb.copy_(rs_in)
    outb.fill_(-99)
    path = pool.reduce_scatter_into(
        inb.data_ptr(), nbytes, outb.data_ptr(), nbytes // n, dtype, "sum", s, tag=next(tags)
    )
    out[("reduce-scatter", "out of place")] = (outb.clone(), path)

    ar_in, _, _ = cases["all-reduce"]
    nbytes = numel * dtype.itemsize
    buf = _dev(pool, numel, dtype)
    buf.copy_(ar_in)
    path = pool.all_reduce_at(buf.data_ptr(), nbytes, dtype, "sum", s, tag=next(tags))
    out[("all-reduce", "in place")] = (buf.clone(), path)
    inb, outb = _dev(pool, numel, dtype), _dev(pool, numel, dtype)
    inb.copy_(ar_in)
    outb.fill_(-99)
    path = pool.all_reduce_into(inb.data_ptr(), outb.data_ptr(), nbytes, dtype, "sum", s, tag=next(tags))
    out[("all-reduce", "out of place")] = (outb.clone(), path)
    return out


def _through_buffers(pool, w, cases, tags):
    """Each collective through ``Buffer`` (in place and out of place), its data written
    and read as bytes: ``{(name, mode): (result, path)}``."""
    r, n, d, s = w.rank, w.size, w.device, _stream()
    out = {}

    def reduction(name, full_in, numel_out, call, result_in_place):
        """``call(input, output)`` in place (output None) and out of place."""
        dtype = full_in.dtype
        b = pool.alloc(full_in.numel() * dtype.itemsize, s)
        b.write(_bytes(full_in))
        path = call(b, None)
        out[(name, "in place")] = (result_in_place(_from_bytes(b.read(), dtype, d)), path)
        b.free()
        b, o = pool.alloc(full_in.numel() * dtype.itemsize, s), pool.alloc(numel_out * dtype.itemsize, s)
        b.write(_bytes(full_in))
        o.write(_bytes(torch.full((numel_out,), -99, dtype=dtype)))
        path = call(b, o)
        out[(name, "out of place")] = (_from_bytes(o.read(), dtype, d), path)
        b.free()
        o.free()

    ag_in, _, _ = cases["all-gather"]
    numel, dtype = ag_in.numel(), ag_in.dtype
    # In place the buffer holds every rank's chunk; out of place, this rank's only.
    full = torch.full((numel * n,), -99, dtype=dtype, device=d)
    full.narrow(0, r * numel, numel).copy_(ag_in)
    b = pool.alloc(full.numel() * dtype.itemsize, s)
    b.write(_bytes(full))
    path = b.all_gather(tag=next(tags))
    out[("all-gather", "in place")] = (_from_bytes(b.read(), dtype, d), path)
    b.free()
    b, o = pool.alloc(numel * dtype.itemsize, s), pool.alloc(numel * n * dtype.itemsize, s)
    b.write(_bytes(ag_in))
    o.write(_bytes(torch.full((numel * n,), -99, dtype=dtype)))
    path = b.all_gather(out=o, tag=next(tags))
    out[("all-gather", "out of place")] = (_from_bytes(o.read(), dtype, d), path)
    b.free()
    o.free()

    rs_in, _, _ = cases["reduce-scatter"]
    reduction(
        "reduce-scatter",
        rs_in,
        numel,
        lambda b, o: b.reduce_scatter(dtype, "sum", out=o, tag=next(tags)),
        lambda got: got.narrow(0, r * numel, numel),
    )
    ar_in, _, _ = cases["all-reduce"]
    reduction(
        "all-reduce", ar_in, numel, lambda b, o: b.all_reduce(dtype, "sum", out=o, tag=next(tags)), lambda got: got
    )
    return out


def _compare(results, cases, label):
    """Mismatches of ``results`` with the exact results and torch's (a list of lines)."""
    bad = []
    for (name, mode), (got, path) in results.items():
        _, want, theirs = cases[name]
        torch_ok = torch.equal(theirs, want)
        ours_ok = torch.equal(got, want)
        if not (torch_ok and ours_ok):
            diff = (got.double() - want.double()).abs()
            bad.append(
                f"{label} {name} {mode} ({path}): ours equal {ours_ok} "
                f"(max |diff| {diff.max().item()}, {int((diff != 0).sum())} of {want.numel()} differ), "
                f"torch's equal {torch_ok}"
            )
    return bad


def _plain_only(w):
    """Whether every call must take the plain ring: across simulated nodes, NCCL < 2.29
    has neither the copy engine nor symmetric kernels."""
    return w.nodes > 1 and tuple(symmpool.nccl_version()) < (2, 29, 0)


@pytest.fixture(scope="module")
def pool(world):
    """A pool adopted from the group's communicator (``from_group``), every call
    checked before it runs and tagged."""
    p = symmpool.from_group(
        world.group, mode="adopt", name="world-coll", check="strict", timeout_s=POOL_TIMEOUT_S
    )
    yield p
    gc.collect()
    torch.cuda.synchronize()
    p.close()


APIS = {"dlpack": (_by_address, SIZES, 5), "buffer": (_through_buffers, BUFFER_SIZES, 6)}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("api", list(APIS))
def test_collectives_equal_torch_distributed(world, pool, api, dtype):
    run, sizes, calls = APIS[api]
    tags = itertools.count(1000 * (2 * DTYPES.index(dtype) + list(APIS).index(api)))
    bad, paths = [], {}
    for numel in sizes:
        cases = _cases(world, numel, dtype)
        results = run(pool, world, cases, tags)
        torch.cuda.synchronize()
        bad += _compare(results, cases, f"{numel} x {dtype}")
        for _, path in results.values():
            paths[path] = paths.get(path, 0) + 1
        del cases, results
    pool.wait_checks()
    print(f"rank {world.rank}: {api} {dtype} paths {paths}", flush=True)
    assert not bad, "\n".join(bad)
    assert sum(paths.values()) == calls * len(sizes), paths
    if _plain_only(world):
        assert set(paths) == {"plain_kernel"}, paths


def test_adopt_the_groups_communicator(world):
    from symmpool._dist import comm_ptr, store_exchange

    ptr = comm_ptr(world.group)
    torch.cuda.synchronize()
    p = symmpool.Pool.nccl_adopt(
        ptr,
        world.device.index,
        store_exchange(world.group, name="world-adopt"),
        name="world-adopt",
        check="strict",
        timeout_s=POOL_TIMEOUT_S,
    )
    assert (p.rank, p.world_size, p.device) == (world.rank, world.size, world.device.index)
    assert p.check == "strict"
    # The pool's collectives and torch's on the same group, interleaved.
    tags = itertools.count()
    bad, paths = [], {}
    for dtype in DTYPES:
        for numel in (4096, (1 << 18) + 1):
            cases = _cases(world, numel, dtype)
            results = _by_address(p, world, cases, tags)
            again = cases["all-reduce"][0].clone()
            dist.all_reduce(again, group=world.group)
            torch.cuda.synchronize()
            bad += _compare(results, cases, f"adopted {numel} x {dtype}")
            if not torch.equal(again, cases["all-reduce"][1]):
                bad.append(f"torch's all-reduce after the pool's calls: wrong ({numel} x {dtype})")
            for _, path in results.values():
                paths[path] = paths.get(path, 0) + 1
            del cases, results, again
    p.end_step()
    p.wait_checks()
    stats = p.memory_stats()
    print(f"rank {world.rank}: adopted pool paths {paths}, segments {stats['segment.all.current']}", flush=True)
    assert not bad, "\n".join(bad)
    if _plain_only(world):
        assert set(paths) == {"plain_kernel"}, paths
    gc.collect()
    torch.cuda.synchronize()
    p.close()
    # The group's communicator is torch's still, and works after the pool is gone.
    t = torch.full((1000,), world.rank + 1.0, device=world.device)
    dist.all_reduce(t, group=world.group)
    assert torch.all(t == world.size * (world.size + 1) / 2), t[:4]


# ---- FSDP2 parity -----------------------------------------------------------------------

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, STEPS = 256, 128, 4, 3, 32, 4, 4


class Block(nn.Module):
    """A pre-norm transformer block; attention from matmuls and softmax (deterministic
    forward and backward)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


PRECISIONS = {
    "fp32": {},
    "bf16-reduce-fp32": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
    "bf16-reduce-bf16": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
}


def _shard(model, mesh, precision):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(**PRECISIONS[precision])
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _train(model, rank, device):
    """``STEPS`` steps of AdamW on this rank's data (the same in every run): the
    per-step losses (a tensor) and the final local parameter shards."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device=device).manual_seed(100 + rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device, generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    shards = [p.to_local().detach().clone() for p in model.parameters()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return torch.stack(losses).cpu(), shards


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_fsdp2_parity_with_the_default(world, precision):
    from torch.distributed.device_mesh import init_device_mesh

    from symmpool.fsdp import install

    mesh = init_device_mesh("cuda", (world.size,))
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        torch.manual_seed(0)
        base = Model().to(world.device)
        ours = copy.deepcopy(base)
        want_losses, want_shards = _train(_shard(base, mesh, precision), world.rank, world.device)
        installed = install(_shard(ours, mesh, precision), world.group, name=f"world-fsdp-{precision}")
        got_losses, got_shards = _train(ours, world.rank, world.device)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    paths, fallbacks, steps = installed.paths(), installed.fallbacks(), installed.step.steps
    print(
        f"rank {world.rank} {precision}: losses default {want_losses.tolist()} symmpool {got_losses.tolist()}; "
        f"paths {paths}, fallbacks {fallbacks}, step boundaries {steps}, check {installed.pool.check}",
        flush=True,
    )
    if world.exact():
        bad = [i for i, (a, b) in enumerate(zip(got_shards, want_shards, strict=True)) if not torch.equal(a, b)]
        diffs = [float((got_shards[i].double() - want_shards[i].double()).abs().max()) for i in bad]
        assert torch.equal(got_losses, want_losses), (got_losses.tolist(), want_losses.tolist())
        assert not bad, f"parameter shards {bad} differ (max |diff| {diffs})"
    else:
        torch.testing.assert_close(got_losses, want_losses, rtol=1e-3, atol=1e-5)
        for a, b in zip(got_shards, want_shards, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # The comm objects ran every collective, with install's defaults.
    assert sum(paths["all_gather"].values()) > 0, paths
    assert sum(paths["reduce_scatter"].values()) > 0, paths
    assert fallbacks == 0, fallbacks
    assert steps == STEPS, steps
    assert all(tag is not None for tag in installed.tags.values()), installed.tags
    assert len(set(installed.tags.values())) == LAYERS + 1, installed.tags
    if _plain_only(world):
        assert set(paths["all_gather"]) | set(paths["reduce_scatter"]) == {"plain_kernel"}, paths
    # Every buffer FSDP2 held goes back: the pool closes (collective).
    pool = installed.pool
    del base, ours, installed, want_shards, got_shards
    gc.collect()
    torch.cuda.synchronize()
    pool.close()
