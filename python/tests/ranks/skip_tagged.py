"""A rank program for test_shm_ranks.py: layers all-gathered through one persistent
buffer (calls of the same shape), each call tagged with its layer (layer 0: tag 0);
the last rank skips layer 1. Under the check mode of argv[1] ("strict" or "async")
every rank must get a DivergenceError naming the field "tag" and every rank, before
it reads data that the checks have not passed (under async a rank reads a layer only
after wait_checks()); then it exits 0. A rank that reads wrong data exits 3."""

import sys

import symmpool

mode = sys.argv[1]
pool = symmpool.Pool.shm(name="skip", timeout_s=60.0, check=mode, check_queue=1)
rank, world = pool.rank, pool.world_size
assert pool.check == mode, pool.check
skipper = world - 1
n = 4096
gathered = pool.alloc(n * world)
try:
    for layer in range(4):
        if rank == skipper and layer == 1:
            continue
        # This rank's shard of the layer: bytes of the value layer + 1.
        gathered.write(bytes(n * rank) + bytes([layer + 1]) * n + bytes(n * (world - 1 - rank)))
        gathered.all_gather(tag=layer)
        pool.wait_checks()  # under async: the checks passed before the data is read
        data = gathered.read()
        if data != bytes([layer + 1]) * (n * world):
            print(f"rank {rank}: WRONG DATA read at layer {layer}", flush=True)
            sys.exit(3)
    pool.end_step()
except symmpool.DivergenceError as e:
    assert e.ranks == list(range(world)), (e.ranks, str(e))
    assert e.field == "tag", (e.field, str(e))
    assert sorted(e.values) == list(range(world)), e.values
    assert len(set(e.values.values())) > 1, e.values
    print(f"rank {rank}: divergence ok ({mode}): {e.field} {e.values}", flush=True)
    gathered.free()
    try:
        pool.close()  # a broken pool still releases its memory, on every rank
    except symmpool.SymmpoolError as closed:
        assert closed.kind in ("broken", "divergence"), str(closed)  # it may say why it broke
    sys.exit(0)
print(f"rank {rank}: no DivergenceError", flush=True)
sys.exit(1)
