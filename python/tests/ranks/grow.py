"""A rank program for test_shm_ranks.py: a newcomer heals a job that lost a rank.

A toy data-parallel model of N float32 parameters, sharded as FSDP shards it: each
step every rank reduce-scatters its gradient (which depends on its rank), updates its
shard and all-gathers the parameters, on a shared-memory pool (one process per rank,
the crate's store outside the ranks), checked as argv[1] says. Every rank prints what
it saw as ``job <RANK>: ...`` lines; a wrong result exits 3.

- The job's ranks: at step 1 every rank asks ``grow(wait=False)`` with no newcomer
  waiting (``None`` on every rank). At ``LOSS_AT`` job rank ``GROW_VICTIM`` kills itself
  (SIGKILL) between the reduce-scatter and the all-gather; the survivors get a
  ``PeerLostError``, shrink, and redo the step at world size 3. At ``HEAL_AT`` the
  rank 0 of the shrunk group saves the state (parameters and step) to ``GROW_STATE``,
  then every survivor calls ``grow(wait=True)``, and all go on at world size 4. A
  buffer of the first pool (``kept``) lives across the shrink and the grow.
- The newcomer (started by the test with ``SYMMPOOL_JOIN=1`` and the victim's
  ``RANK``): the same ``Pool.shm()`` joins the survivors' pool (``pool.joined``), then
  it loads the state the survivors saved and trains on with them.
- ``GROW_FROM_STATE=1``: a fresh job that starts from the saved state.

Every rank ends with ``job <RANK>: final <sha256 of the parameters' bytes> ...``, closes
its pool and exits 0.
"""

import array
import hashlib
import os
import signal
import struct
import sys
import time

import symmpool

mode = sys.argv[1]
N = 12 * 1024  # parameters: divisible by 3 and by 4
STEPS, LOSS_AT, HEAL_AT = 8, 2, 5
STATE = os.environ["GROW_STATE"]
VICTIM = int(os.environ.get("GROW_VICTIM", "-1"))
JOB_RANK = int(os.environ["RANK"])
started = time.monotonic()


def say(text):
    # One write per line: the ranks of a launcher share its stdout.
    sys.stdout.write(f"job {JOB_RANK}: {text}\n")
    sys.stdout.flush()


def wrong(what):
    say(f"WRONG {what}")
    sys.exit(3)


def save(w, at):
    tmp = f"{STATE}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", at) + w.tobytes())
    os.replace(tmp, STATE)  # whole or absent: the newcomer reads it after its join


def load():
    with open(STATE, "rb") as f:
        data = f.read()
    w = array.array("f")
    w.frombytes(data[8:])
    return w, struct.unpack_from("<Q", data)[0]


def floats(values):
    return array.array("f", values)


def grad(w, rank, at, i):
    """Rank `rank`'s gradient of parameter `i` at step `at`."""
    return w[i] * 0.5 + (rank + 1) * 0.01 + at * 0.001 + (i % 7) * 1e-4


def step(pool, w, at):
    """One step at the pool's world size from the parameters `w`; the new parameters."""
    r, world = pool.rank, pool.world_size
    n = N // world
    tag = (world << 40) | (at << 8)
    grads, shard, params = pool.alloc(4 * N), pool.alloc(4 * n), pool.alloc(4 * N)
    try:
        grads.write(floats(grad(w, r, at, i) for i in range(N)).tobytes())
        grads.reduce_scatter("float32", "sum", out=shard, tag=tag | 1)
        if JOB_RANK == VICTIM and at == LOSS_AT and pool.joined is None and world == 4:
            say("leaving")
            os.kill(os.getpid(), signal.SIGKILL)  # no goodbye, in the middle of the step
        s = floats(())
        s.frombytes(shard.read())
        # Every rank's gradient summed (up to float32 rounding): this rank's shard.
        for i in (0, n // 2, n - 1):
            expected = sum(floats(grad(w, q, at, r * n + i) for q in range(world)))
            if abs(s[i] - expected) > 1e-5 * abs(expected):
                wrong(f"reduce-scatter at step {at}, world {world}: {s[i]} != {expected}")
        mine = floats(w[r * n + i] - 0.1 * s[i] / world for i in range(n))
        params.write(bytes(4 * r * n) + mine.tobytes())
        params.all_gather(tag=tag | 2)
        out = floats(())
        out.frombytes(params.read())
        pool.end_step()
        pool.wait_checks()  # the checks passed before the step counts as done
        return out
    finally:
        for b in (grads, shard, params):
            b.free()


pool = symmpool.Pool.shm(name="grow", timeout_s=60.0, check=mode)
say(f"pid {os.getpid()}")
kept = None
if pool.joined is not None:
    say(f"joined {pool.joined!r}")
    w, at = load()
    say(f"loaded step {at}")
elif os.environ.get("GROW_FROM_STATE"):
    w, at = load()
else:
    w, at = floats(i * 1e-3 for i in range(N)), 0
    # A buffer of the first world, alive across the shrink and the grow.
    kept = pool.alloc(1 << 16)
    kept.write(bytes([7]) * (1 << 16))

while at < STEPS:
    if at == 1 and pool.world_size == 4 and kept is not None:
        # Every rank asks, no newcomer waits: None on every rank; the pool goes on.
        grown = pool.grow(wait=False)
        if grown is not None:
            wrong(f"grow(wait=False) with no newcomer: {grown!r}")
        say("grow(wait=False): None")
    if at == HEAL_AT and pool.world_size == 3:
        if pool.rank == 0:
            save(w, at)
        say("waiting for a newcomer")
        grown = pool.grow(wait=True)
        if grown is None:
            wrong("grow(wait=True) returned None")
        new_pool, report = grown
        if (new_pool.rank, new_pool.world_size) != (report.rank, report.world_size):
            wrong(f"the grown pool is rank {new_pool.rank} of {new_pool.world_size}: {report!r}")
        # The old pool is done; the data of its buffers stays this rank's.
        try:
            pool.alloc(64)
            wrong("alloc on the pool before the grow")
        except symmpool.UsageError:
            pass
        if kept.read() != bytes([7]) * (1 << 16):
            wrong("data of the first pool's buffer")
        say(f"grown {report!r}")
        pool = new_pool
    try:
        w = step(pool, w, at)
        at += 1
    except symmpool.PeerLostError as e:
        say(f"peer lost at step {at}: rank {e.rank}")
        while True:  # every survivor; again after a second loss while agreeing
            try:
                pool, report = pool.shrink()
                break
            except symmpool.ShrinkFailed as failed:
                if not failed.retry:
                    raise
        say(f"shrunk {report!r}")
        continue
    if at == HEAL_AT + 1 and pool.joined is not None:
        say(f"first step in {1000 * (time.monotonic() - started):.0f} ms from its start")

if kept is not None:
    kept.free()
digest = hashlib.sha256(w.tobytes()).hexdigest()
say(f"final {digest} rank {pool.rank} of {pool.world_size} ({mode})")
pool.close()
sys.exit(0)
