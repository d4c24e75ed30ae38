"""One pool per process on a CPU machine: a toy FSDP-style step loop.

    torchrun --nproc-per-node 4 python/examples/train_cpu.py        # with torch
    python -m symmpool.launch --nproc-per-node 4 python/examples/train_cpu.py

Each rank joins the crate's store from the launcher's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), makes a pool on the shared-memory backend, and per step
all-gathers its parameter shard in place and reduce-scatters a gradient buffer; the
results are checked against what every rank wrote. Rank 0 prints the statistics.
"""

import argparse
import struct
import sys

import symmpool

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--shard-floats", type=int, default=64 * 1024)
args = parser.parse_args()

pool = symmpool.Pool.shm(name="train", timeout_s=60.0)
rank, world = pool.rank, pool.world_size
n = args.shard_floats
try:
    import torch

    dtype = torch.float32  # a torch dtype works wherever a dtype string does
except ImportError:
    dtype = "float32"

for step in range(args.steps):
    # Parameters: world shards of n floats; this rank owns shard `rank`.
    params = pool.alloc(4 * n * world)
    mine = struct.pack(f"<{n}f", *([float(rank + step)] * n))
    params.write(bytes(4 * n * rank) + mine)
    # Each collective carries its identity (tag=: here (step, op)), so that ranks
    # making different calls of the same shape fail at that call.
    params.all_gather(tag=2 * step)  # in place: every shard everywhere
    got = struct.unpack(f"<{n * world}f", params.read())
    assert all(got[r * n] == float(r + step) for r in range(world)), got[:: n]
    # Gradients: every rank holds a full buffer; after the reduce-scatter its shard
    # holds the sum over ranks.
    grads = pool.alloc(4 * n * world)
    grads.write(struct.pack(f"<{n * world}f", *([float(rank + 1)] * (n * world))))
    grads.reduce_scatter(dtype, "sum", tag=2 * step + 1)
    total = struct.unpack_from("<f", grads.read(), 4 * n * rank)[0]
    assert total == world * (world + 1) / 2, total
    params.free()
    grads.free()
    pool.end_step()  # every rank, once per step: the ranks compare their calls

stats = pool.memory_stats()
pool.close()  # collective: every rank, after its buffers are gone
if rank == 0:
    print(
        f"train_cpu: {world} ranks x {args.steps} steps ok; "
        f"{stats['num_device_alloc']} segments, peak {stats['allocated_bytes.all.peak']} bytes"
    )
sys.exit(0)
