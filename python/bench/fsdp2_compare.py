"""FSDP2 on two (or more) GPUs, three ways, interleaved in one job:

- ``symmpool``: symmpool's comm objects (``symmpool.fsdp.install``: pool buffers as
  DLPack tensors, the crate's all-gather / reduce-scatter on communicators split off
  the group's, path per size);
- ``torch-symm``: a re-creation of PyTorch's own recipe as custom comm objects:
  ``MemPool`` from ``torch.distributed._symmetric_memory.get_mem_pool``,
  ``rendezvous``, then ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on a
  group whose NCCL config has ``cta_policy = NCCL_CTA_POLICY_ZERO``;
- ``default``: FSDP2 as it comes.

Reported per mode (one JSON line each on rank 0, then a table): the losses, the median
step time, the GEMM-beside-all-gather factor (bf16 GEMMs timed alone, then beside
all-gathers of ``--ag-mib`` MiB per rank issued through the mode's comm object on
another stream), the segments the mode's memory lives in, and the NCCL libraries mapped.

    NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 python/bench/fsdp2_compare.py
    ... --steps 30 --dim 2048 --layers 8 --modes symmpool,torch-symm,default --json out.json
"""

import argparse
import json
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import symmpool


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--ag-mib", type=int, default=256, help="all-gather size per rank for the GEMM factor")
    p.add_argument("--gemm", type=int, default=8192, help="GEMM size (n x n x n, bf16)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--modes", default="symmpool,torch-symm,default")
    p.add_argument("--json", default=None, help="write every mode's result here (rank 0)")
    p.add_argument(
        "--trace",
        default=None,
        help="with the symmpool mode: write each rank's comm-object timeline to TRACE.rankN.json "
        "(Chrome-trace JSON; the timing events add host time to each call)",
    )
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a.dim, a.heads) for _ in range(a.layers))
        self.norm, self.head = nn.LayerNorm(a.dim), nn.Linear(a.dim, a.vocab)

    def forward(self, tokens):
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


# ---- comm objects of the three modes -------------------------------------------------


class DefaultComm:
    """What FSDP2 does by default, as a comm object (for the GEMM factor only)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def torch_symm_comms(group, device):
    """PyTorch's symmetric-memory recipe as FSDP2 comm objects, on a ZERO-CTA group."""
    import torch.distributed._symmetric_memory as symm_mem
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    try:
        symm_mem.set_backend("NCCL")
    except Exception:  # noqa: BLE001 - already set, or not needed in this version
        pass
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    ce_group = dist.new_group(list(range(dist.get_world_size(group))), backend="nccl", pg_options=opts)
    dist.barrier(group=ce_group, device_ids=[device.index])
    mem_pool = symm_mem.get_mem_pool(device)

    class Alloc:
        def allocate(self, size, *, dtype, device):
            with torch.cuda.use_mem_pool(mem_pool):
                return torch.empty(size, dtype=dtype, device=device)

    class AG(Alloc, AllGather):
        # FSDP2 passes the tensors by keyword (torch 2.11): the names are its protocol's.
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            symm_mem.rendezvous(output_tensor, group=ce_group.group_name)
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=ce_group, async_op=async_op)

    class RS(Alloc, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
            symm_mem.rendezvous(input_tensor, group=ce_group.group_name)
            kw = {"group": ce_group, "async_op": async_op}
            if op is not None:
                kw["op"] = op
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, **kw)

    return AG(), RS(), mem_pool


# ---- measurements ----------------------------------------------------------------------


def shard(model):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def train(model, a, rank):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    losses, times = [], []
    for step in range(a.warmup + a.steps):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device="cuda", generator=g)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, a.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= a.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def gemm_factor(comm, group, a, device):
    """GEMM time beside all-gathers through `comm` / GEMM time alone."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = a.gemm
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    numel = (a.ag_mib << 20) // 2
    out = comm.allocate((numel * world,), dtype=torch.bfloat16, device=device)
    shard_in = out.narrow(0, numel * rank, numel)
    side = torch.cuda.Stream(device)

    def gemms():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.reps):
            torch.mm(x, y)
        end.record()
        return start, end

    gemms()  # warm-up
    torch.cuda.synchronize()
    dist.barrier(group=group, device_ids=[device.index])
    s, e = gemms()
    torch.cuda.synchronize()
    alone = s.elapsed_time(e)
    dist.barrier(group=group, device_ids=[device.index])
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(a.reps):
            comm(out, shard_in, group, False)
    s, e = gemms()
    torch.cuda.synchronize()
    beside = s.elapsed_time(e)
    del out, shard_in
    return beside / alone


def segments_of(mode, installed, mem_pool):
    if mode == "symmpool":
        st = installed.pool.memory_stats()
        return {"segments": st.get("segment.all.current"), "reserved_bytes": st.get("reserved_bytes.all.current")}
    if mode == "torch-symm" and mem_pool is not None:
        try:
            snap = mem_pool.snapshot()
            return {"segments": len(snap), "reserved_bytes": sum(s["total_size"] for s in snap)}
        except Exception as e:  # noqa: BLE001
            return {"segments": None, "error": str(e)}
    st = torch.cuda.memory_stats()
    return {"segments": st.get("segment.all.current"), "reserved_bytes": st.get("reserved_bytes.all.current")}


def run_mode(mode, a, group, device, rank):
    torch.manual_seed(0)
    model = shard(Model(a).to(device))
    installed, mem_pool, ag = None, None, DefaultComm()
    if mode == "symmpool":
        from symmpool.fsdp import install

        installed = install(model, group, name=f"bench-{mode}", trace=a.trace is not None)
        ag = next(iter(installed.all_gathers.values()))  # the root module's: its tag
    elif mode == "torch-symm":
        ag, rs, mem_pool = torch_symm_comms(group, device)
        for m in model.modules():
            if hasattr(m, "set_custom_all_gather"):
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    losses, times = train(model, a, rank)
    factor = gemm_factor(ag, group, a, device)
    result = {
        "mode": mode,
        "world_size": dist.get_world_size(group),
        "losses": losses,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_min": 1e3 * min(times),
        "gemm_beside_all_gather": factor,
        "nccl_libraries": symmpool.nccl_libraries(),
        "nccl_mappings": symmpool.nccl_mappings(),
        **segments_of(mode, installed, mem_pool),
    }
    if installed is not None:
        result["paths"] = installed.paths()
        result["fallbacks"] = installed.fallbacks()
        st = installed.pool.memory_stats()
        result["registrations"] = {k: v for k, v in st.items() if k.startswith("registrations.")}
        result["last_error"] = symmpool.last_error()
        if a.trace is not None:
            installed.write_trace(f"{a.trace}.rank{rank}.json")
    del model
    torch.cuda.synchronize()
    return result


def main():
    a = parse()
    # Two ranks may share one GPU (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1).
    local = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device)
    group, rank = dist.group.WORLD, dist.get_rank()
    results = []
    for mode in a.modes.split(","):
        try:
            results.append(run_mode(mode, a, group, device, rank))
        except Exception as e:  # noqa: BLE001 - report and go on with the next mode
            results.append({"mode": mode, "error": f"{type(e).__name__}: {e}", "last_error": symmpool.last_error()})
        if rank == 0:
            print(json.dumps(results[-1]), flush=True)
        dist.barrier(device_ids=[local])
    if rank == 0:
        ref = next((r for r in results if r.get("mode") == "default" and "losses" in r), None)
        print(f"\n{'mode':<12} {'step ms':>9} {'gemm x':>7} {'segments':>9} {'nccl libs':>9} {'max |dloss|':>12}")
        for r in results:
            if "error" in r:
                print(f"{r['mode']:<12} error: {r['error']}")
                continue
            dl = max(abs(x - y) for x, y in zip(r["losses"], ref["losses"])) if ref else math.nan
            print(
                f"{r['mode']:<12} {r['step_ms_median']:>9.2f} {r['gemm_beside_all_gather']:>7.3f} "
                f"{str(r.get('segments')):>9} {r['nccl_mappings']:>9} {dl:>12.4g}"
            )
        if a.json:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
