"""FSDP2 on CPU (gloo), step times: symmpool's comm objects with ``install``'s defaults
(tags, step boundary) on a shared-memory pool over torch's store
(``symmpool.store_exchange``), under the ``"async"`` and the ``"strict"`` check, against
FSDP2 as it comes. A benchmark, not a test: it prints figures and checks only that the
three runs computed the same losses.

    python -m symmpool.launch --nproc-per-node 2 python/bench/fsdp2_cpu.py
    torchrun --nproc-per-node 2 python/bench/fsdp2_cpu.py --model gpt2 --steps 4

``--model``: ``small`` (a stack of linear blocks, no other package), ``llama`` or
``gpt2`` (Hugging Face ``transformers``, a small randomly initialised model from its
config: nothing is downloaded). Each mode is a fresh model from the same seed; modes
run one after the other in one job, ``--repeat`` times, in the order given. Rank 0
prints one line per (mode, repeat): the total of the steps, each step's time, the
losses; then one JSON object per line with ``--json``.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import symmpool
from symmpool.fsdp import install


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["small", "llama", "gpt2"], default="small")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--modes", default="none,strict,async", help="comma-separated: none (FSDP2 as it comes), strict, async")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--poll-s", type=float, default=None, help="StoreExchange poll_s (default: the binding's)")
    p.add_argument("--json", action="store_true", help="also print one JSON object per run (rank 0)")
    return p.parse_args()


class Small(torch.nn.Module):
    def __init__(self, dim=256, layers=4, vocab=512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def make_model(kind):
    """(model, its repeated blocks, vocabulary size)."""
    if kind == "small":
        m = Small()
        return m, list(m.layers), 512
    import transformers

    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        )
        m = transformers.LlamaForCausalLM(cfg)
        return m, list(m.model.layers), cfg.vocab_size
    cfg = transformers.GPT2Config(vocab_size=1024, n_embd=256, n_layer=4, n_head=4, n_positions=256,
                                  bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg)
    return m, list(m.transformer.h), cfg.vocab_size


def logits_of(out):
    return out.logits if hasattr(out, "logits") else out


def run(args, mode, mesh, rank, world, run_id):
    torch.manual_seed(0)
    model, blocks, vocab = make_model(args.model)
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pool = installed = None
    if mode != "none":
        kwargs = {} if args.poll_s is None else {"poll_s": args.poll_s}
        ex = symmpool.store_exchange(name=f"bench-{run_id}", **kwargs)
        pool = symmpool.Pool.shm(ex, name=f"bench-{run_id}", timeout_s=120.0, check=mode)
        installed = install(model, pool=pool)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen)
    losses, times = [], []
    dist.barrier()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        logits = logits_of(model(ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    dist.barrier()
    if pool is not None:
        assert installed.fallbacks() == 0, installed.fallbacks()
        del installed, opt, model
        pool.close()
    return losses, times


def main():
    args = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    modes = args.modes.split(",")
    results = []
    run_id = 0
    for rep in range(args.repeat):
        for mode in modes:
            losses, times = run(args, mode, mesh, rank, world, run_id)
            run_id += 1
            results.append({"mode": mode, "repeat": rep, "losses": losses, "step_s": times, "total_s": sum(times)})
    ref = {tuple(r["losses"]) for r in results}
    if rank == 0:
        print(f"fsdp2_cpu: model {args.model}, {world} ranks (gloo), {args.steps} steps, torch {torch.__version__}, "
              f"symmpool {symmpool.__version__}")
        for r in results:
            steps = " ".join(f"{t:.3f}" for t in r["step_s"])
            print(f"  {r['mode']:>6} #{r['repeat']}: total {r['total_s']:7.3f} s, median step "
                  f"{statistics.median(r['step_s']):.3f} s (steps: {steps}), last loss {r['losses'][-1]:.6f}")
        print(f"  losses identical across modes: {len(ref) == 1}")
        if args.json:
            for r in results:
                print(json.dumps({"model": args.model, "world": world, **r}))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if len(ref) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
