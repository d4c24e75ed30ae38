"""One GPU, world size 1 (run by hand on the GPU machine; skipped elsewhere, with the
reason):

    python -m pytest -ra -v python/tests/test_gpu.py

- FSDP2 (``fully_shard``) on a small transformer-like model trains with the same
  losses (within bf16 tolerance) with symmpool's comm objects as with FSDP2's default;
- the pluggable allocator serves a ``torch.cuda.MemPool``, with no window registration
  after the first step;
- the process has exactly one NCCL library mapped (symmpool bound to PyTorch's).
"""

import copy
import os
import socket

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import symmpool  # noqa: E402


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        device_id=device,
    )
    yield dist.group.WORLD
    torch.cuda.synchronize()
    dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, vocab=512, dim=256, heads=4, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _shard(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _train(model, steps=6, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(seed)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (4, 64), device="cuda", generator=g)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses


def test_one_nccl_library_and_a_communicator(group):
    from symmpool._dist import comm_ptr

    assert comm_ptr(group) != 0
    version = symmpool.nccl_version()  # loads NCCL the crate's way
    assert version >= (2, 27, 0), version
    libs = symmpool.nccl_libraries()
    assert symmpool.nccl_mappings() == 1, libs


def test_fsdp2_losses_match_the_default(group):
    from symmpool.fsdp import install

    torch.manual_seed(0)
    base = Model().cuda()
    ours = copy.deepcopy(base)
    expected = _train(_shard(base))

    installed = install(_shard(ours), group, name="fsdp-test")
    got = _train(ours)
    paths = installed.paths()
    print("losses default", expected, "symmpool", got, "paths", paths)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=2e-2, atol=2e-3)

    # The second identical run registers nothing new.
    before = installed.pool.memory_stats()
    _train(ours, steps=2, seed=1)
    after = installed.pool.memory_stats()
    for key in ("registrations.symmetric", "registrations.copy_engine", "num_device_alloc"):
        assert after.get(key, 0) == before.get(key, 0), (key, before.get(key), after.get(key))
    assert symmpool.last_error() is None or "symmpool_free" not in symmpool.last_error()
    assert symmpool.nccl_mappings() == 1
    if sum(paths["all_gather"].values()) == 0 and dist.get_world_size(group) == 1:
        # Seen with torch 2.11: at world size 1 FSDP2 all-gathers nothing, so the comm
        # objects are never called; what they do needs two GPUs (the two-GPU run).
        pytest.skip("FSDP2 runs no all-gather at world size 1: the comm objects need 2 GPUs")
    assert sum(paths["all_gather"].values()) > 0, paths


def test_pluggable_allocator_serves_a_mem_pool(group):
    from symmpool.allocator import mem_pool

    pool = symmpool.from_group(group, mode="wrap", name="mempool-test")
    mp = mem_pool(pool)
    base_live = symmpool.live_buffers()
    symmpool.clear_error()

    def step():
        torch.manual_seed(1234)  # the same data every step: the result must repeat
        with torch.cuda.use_mem_pool(mp):
            a = torch.empty(1000, dtype=torch.uint8, device="cuda")
            b = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)  # 1.5 MiB
            c = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16)  # 6 MiB
            d = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # 64 MiB
            e = b @ c
            out = torch.empty(e.numel() * dist.get_world_size(group), dtype=e.dtype, device="cuda")
            dist.all_gather_into_tensor(out, e.reshape(-1), group=group)
            del a, d
            return out.float().sum().item()

    first = step()
    torch.cuda.synchronize()
    stats1 = pool.memory_stats()
    assert stats1["num_device_alloc"] >= 1
    assert stats1.get("registrations.symmetric", 0) + stats1.get("registrations.copy_engine", 0) >= 1
    assert symmpool.live_buffers() > base_live  # PyTorch's segments are pool buffers
    for _ in range(3):
        assert step() == pytest.approx(first, rel=1e-3)
    torch.cuda.synchronize()
    stats = pool.memory_stats()
    for key in ("registrations.symmetric", "registrations.copy_engine", "num_device_alloc"):
        assert stats.get(key, 0) == stats1.get(key, 0), key
    assert symmpool.last_error() is None, symmpool.last_error()
    snap = pool.memory_snapshot()
    assert snap["segments"] and "<svg" in pool.memory_map_svg()

    # PyTorch frees its segments when the MemPool goes: every buffer returns.
    del mp
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    assert symmpool.live_buffers() == base_live
    assert symmpool.last_error() is None, symmpool.last_error()
    assert pool.memory_stats()["allocation.all.current"] == 0
    symmpool.install_allocator(None)
    # A "wrap" pool's windows live on torch's communicator: close it (deregistering
    # them) before the process group is destroyed.
    pool.close()
    assert symmpool.nccl_mappings() == 1


def test_comm_objects_write_a_trace_at_world_size_one(group, tmp_path):
    """The comm objects called as FSDP2 calls them (FSDP2 itself skips them at world
    size 1), with ``trace``: right data, and a Chrome trace with the allocations on the
    host row and each collective on its stream's row, timed on the device."""
    import gc
    import json

    from symmpool.fsdp import AllGather, ReduceScatter, Trace

    pool = symmpool.from_group(group, mode="adopt", name="trace-test")
    trace = Trace(pool.rank)
    # Tagged, as `install` tags them: untagged collectives are refused by default.
    ag, rs = AllGather(pool, trace, tag=1), ReduceScatter(pool, trace, tag=2)
    n = 1 << 20
    out = ag.allocate((n,), dtype=torch.bfloat16, device="cuda")
    out.copy_(torch.arange(n, device="cuda", dtype=torch.float32).to(torch.bfloat16))
    expected = out.clone()
    assert ag(out, out.narrow(0, 0, n), group) is None  # rank 0 of 1: in place
    rin = rs.allocate((n,), dtype=torch.float32, device="cuda")
    rin.fill_(2.0)
    rout = rs.allocate((n,), dtype=torch.float32, device="cuda")
    assert rs(rout, rin, group, op=dist.ReduceOp.SUM) is None
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
    assert torch.all(rout == 2.0)
    assert ag.fallbacks == 0 and rs.fallbacks == 0
    path = tmp_path / "trace.json"
    trace.write(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    rows = {(e["name"], e["tid"]) for e in spans}
    assert {("alloc", 0), ("all-gather", 2), ("reduce-scatter", 3)} <= rows, rows
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    del out, expected, rin, rout
    gc.collect()
    torch.cuda.synchronize()
    pool.close()


def test_a_thousand_small_tensors_take_few_segments(group):
    """1 000 live tensors of random sizes 64 KiB–4 MiB straight from a pool: the small
    class grows like the large one, so few segments and windows, little slack."""
    import gc
    import random

    from torch.utils.dlpack import from_dlpack

    pool = symmpool.from_group(group, mode="adopt", name="small-tensors")
    rng = random.Random(26)
    stream = torch.cuda.current_stream().cuda_stream
    live = [from_dlpack(pool.alloc_dlpack(rng.randrange(64 << 10, (4 << 20) + 1), stream)) for _ in range(1000)]
    stats = pool.memory_stats()
    windows = sum(v for k, v in stats.items() if k.startswith("windows."))
    print("segments", stats["segment.all.current"], "windows", windows,
          "reserved / peak allocated", stats["reserved_bytes.all.current"] / stats["allocated_bytes.all.peak"])
    assert stats["segment.all.current"] <= 8, stats
    assert windows <= 16, stats
    assert stats["reserved_bytes.all.current"] <= 1.5 * stats["allocated_bytes.all.peak"], stats
    del live
    gc.collect()
    torch.cuda.synchronize()
    pool.close()
