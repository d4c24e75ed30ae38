"""A rank program for test_shm_ranks.py: a training-style loop of tagged all-gathers
and reduce-scatters on shared-memory pools (one process per rank, the crate's store),
checked as argv[1] says. At step LOSS_STEP the last rank (or SHRINK_VICTIM's: rank 0
needs the store outside the ranks, SYMMPOOL_STORE_EXTERNAL=1) kills itself (SIGKILL)
between the all-gather and the reduce-scatter, so the others are in a collective it
never joins. Every survivor must get a PeerLostError naming it (a message that names
Pool.shrink(), not the crate's Rust method), shrink (asking again on a ShrinkFailed
whose retry is set), and go on at the smaller world size with correct results: the
same step again, then the rest. A buffer of the old pool keeps its data but no
collective takes it; the old pool refuses every call. Then every survivor closes
its pool and exits 0 (a wrong result exits 3)."""

import os
import signal
import struct
import sys

import symmpool

mode = sys.argv[1]
STEPS = 5
LOSS_STEP = 2
N = 4096  # floats per shard

pool = symmpool.Pool.shm(name="shrink", timeout_s=60.0, check=mode)
rank, world = pool.rank, pool.world_size
victim = int(os.environ.get("SHRINK_VICTIM", world - 1))
print(f"rank {rank}: pid {os.getpid()}", flush=True)


def wrong(what):
    print(f"rank {rank}: WRONG {what}", flush=True)
    sys.exit(3)


def floats(values):
    return struct.pack(f"<{len(values)}f", *values)


def step(pool, step, epoch):
    """One step at the pool's world size; each call tagged with (epoch, step, op)."""
    r, w = pool.rank, pool.world_size
    tag = (epoch << 32) | (step << 1)
    params = pool.alloc(4 * N * w)
    grads = pool.alloc(4 * N * w)
    try:
        params.write(bytes(4 * N * r) + floats([float(r + step)] * N))
        params.all_gather(tag=tag)
        if epoch == 0 and step == LOSS_STEP and rank == victim:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # no goodbye, in the middle of the step
        got = struct.unpack(f"<{N * w}f", params.read())
        if any(got[q * N] != float(q + step) or got[q * N + N - 1] != float(q + step) for q in range(w)):
            wrong(f"all-gather at step {step}, world {w}")
        grads.write(floats([float(r + 1)] * (N * w)))
        grads.reduce_scatter("float32", "sum", tag=tag | 1)
        mine = struct.unpack_from(f"<{N}f", grads.read(), 4 * N * r)
        if set(mine) != {float(w * (w + 1) // 2)}:
            wrong(f"reduce-scatter at step {step}, world {w}: {sorted(set(mine))[:4]}")
        pool.end_step()
        pool.wait_checks()  # the checks passed before the step counts as done
    finally:
        params.free()
        grads.free()


# Data kept across the loss, in a buffer of the old pool.
kept = pool.alloc(64)
kept.write(bytes([rank]) * 64)

epoch, s = 0, 0
while s < STEPS:
    try:
        step(pool, s, epoch)
        s += 1
    except symmpool.PeerLostError as e:
        if e.rank != victim or "SymmPool::" in str(e):
            print(f"rank {rank}: PeerLostError names rank {e.rank}: {e}", flush=True)
            sys.exit(1)
        print(f"rank {rank}: peer lost at step {s} in {e.operation}: rank {e.rank}", flush=True)
        while True:  # every survivor; again after a second loss while agreeing
            try:
                new_pool, report = pool.shrink()
                break
            except symmpool.ShrinkFailed as failed:
                if not failed.retry:
                    raise
        assert (report.old_rank, report.old_world_size) == (rank, world), report
        assert report.lost_ranks == [victim] and report.world_size == world - 1, report
        assert (new_pool.rank, new_pool.world_size) == (report.rank, report.world_size), report
        assert report.live_buffers == 1 and report.live_bytes >= 64, report  # `kept`
        assert new_pool.check == pool.check and not new_pool.untagged_collectives
        # The old world is gone: its pool and its buffers' collectives refuse.
        try:
            pool.alloc(64)
            wrong("alloc on the old pool")
        except symmpool.UsageError as old:
            assert "before a shrink" in str(old), str(old)
        try:
            kept.all_gather(tag=99)
            wrong("collective on a buffer of the old pool")
        except symmpool.UsageError:
            pass
        if kept.read() != bytes([rank]) * 64:
            wrong("data of the old pool's buffer")
        print(f"rank {rank}: shrunk ok: {report!r}", flush=True)
        pool, epoch = new_pool, epoch + 1  # then the same step again, at the new size

kept.free()  # its block returns to the new pool
assert pool.world_size == world - 1
pool.close()
print(f"rank {rank}: {STEPS} steps ok, world {world} -> {pool.world_size} ({mode})", flush=True)
sys.exit(0)
