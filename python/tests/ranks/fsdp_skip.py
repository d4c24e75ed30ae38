"""A rank program for test_fsdp_cpu.py: FSDP2 on CPU (gloo) with symmpool's comm
objects installed by default (tags, step boundary) over a shared-memory pool, checked
as argv[1] says ("strict" or "async"). One ordinary step (forward, backward,
optimizer), which must mark one step boundary; then the last rank skips block 1 in
its forward, so it never all-gathers that module. Every rank must get a
DivergenceError naming the field "tag" and every rank, from its forward or its
backward (under strict from the forward: the skipped all-gather's call is refused
before any data moves): before the optimizer uses any gradient, so every rank's
parameter shards are still bit for bit those of the first step and no gradient was
reduced from the mismatched calls. Then it exits 0."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import symmpool
from symmpool.fsdp import install, module_tag

mode = sys.argv[1]
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        # Blocks of one shape: their all-gathers differ only in the tag.
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.head = torch.nn.Linear(64, 8)
        self.skip = None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i != self.skip:
                x = torch.relu(block(x))
        return self.head(x)


torch.manual_seed(0)
model = Model()
for block in model.blocks:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
pool = symmpool.Pool.shm(symmpool.store_exchange(name="fsdp-cpu"), name="fsdp-cpu", timeout_s=60.0,
                         check=mode, check_queue=1)
installed = install(model, pool=pool)
assert installed.tags == {fqn: module_tag(fqn) for fqn in ("", "blocks.0", "blocks.1", "blocks.2", "blocks.3")}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1 + rank))


def loss_of(model):
    return model(x).square().mean()


loss = loss_of(model)
loss.backward()
assert installed.step.steps == 1, installed.step.steps  # the end of the backward pass
opt.step()
opt.zero_grad()
paths = installed.paths()
assert sum(paths["all_gather"].values()) > 0 and sum(paths["reduce_scatter"].values()) > 0, paths
assert installed.fallbacks() == 0, installed.fallbacks()
print(f"rank {rank}: step ok, loss {loss.item():.4f}, paths {paths}", flush=True)


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


# This rank's parameter shards after the first step, as the optimizer holds them (the
# sharded parameters; a module's attribute may be its unsharded parameter meanwhile):
# no wrong data may reach them.
sharded = [p for group in opt.param_groups for p in group["params"]]
shards = [local(p).detach().clone() for p in sharded]

if rank == world - 1:
    model.skip = 1
stage = "forward"
try:
    loss = loss_of(model)
    stage = "backward"
    loss.backward()
    stage = "optimizer"
except symmpool.DivergenceError as e:
    assert e.ranks == list(range(world)), (e.ranks, str(e))
    assert e.field == "tag", (e.field, str(e))
    assert len(set(e.values.values())) > 1, e.values
    if mode == "strict":
        assert stage == "forward", stage  # the first mismatched call, before it ran
    for p, before in zip(sharded, shards):
        if not torch.equal(local(p).detach(), before):
            print(f"rank {rank}: WRONG DATA: a parameter shard changed after the divergence", flush=True)
            sys.exit(3)
        if p.grad is not None and torch.count_nonzero(local(p.grad)) > 0:
            print(f"rank {rank}: WRONG DATA: a gradient reduced from the mismatched calls", flush=True)
            sys.exit(3)
    print(f"rank {rank}: divergence ok ({mode}) in {stage}: {e.field} {e.values}", flush=True)
    dist.barrier()  # every rank is here: none leaves while a peer still uses the store
    dist.destroy_process_group()
    sys.exit(0)
print(f"rank {rank}: no DivergenceError before the {stage} step", flush=True)
sys.exit(1)
