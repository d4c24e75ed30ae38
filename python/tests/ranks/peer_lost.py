"""A rank program for test_shm_ranks.py: the last rank dies after the pool is made;
every other rank must get a PeerLostError naming it, whose advice names Python's
Pool.shrink(), then exits 0."""

import os
import sys

import symmpool

pool = symmpool.Pool.shm(name="lost", timeout_s=60.0)
rank, world = pool.rank, pool.world_size
if rank == world - 1:
    sys.stdout.flush()
    os._exit(7)  # no goodbye: the store notices the closed socket
try:
    pool.alloc(4 << 20)  # a growth: an agreement the dead rank never joins
except symmpool.PeerLostError as e:
    assert e.rank == world - 1, (e.rank, str(e))
    # Its advice in Python's words: the method a Python survivor calls.
    assert "Pool.shrink()" in str(e) and "SymmPool::" not in str(e), str(e)
    print(f"rank {rank}: peer lost ok: {e.operation}: {e}", flush=True)
    sys.exit(0)
print(f"rank {rank}: no PeerLostError", flush=True)
sys.exit(1)
