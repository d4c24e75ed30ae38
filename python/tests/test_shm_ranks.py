"""One process per rank on a CPU machine: the example as 4 ranks (torchrun where torch
is installed, ``python -m symmpool.launch`` otherwise), a rank that dies, a rank
killed in the middle of a step whose survivors shrink and go on, a newcomer that
replaces it and grows the job back to its size, and a rank that skips a tagged
all-gather. Each job runs under a timeout; the launcher kills every rank it started
when it returns."""

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "train_cpu.py"
#: Seconds a job may take in all (a bound; it takes seconds).
JOB_TIMEOUT_S = 180


def _torchrun():
    """torchrun's command, where torch is installed beside this Python."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def _run(cmd):
    return subprocess.run(
        cmd,
        cwd=HERE.parent.parent,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def test_the_example_runs_as_four_processes():
    torchrun = _torchrun()
    if torchrun:
        cmd = [*torchrun, "--standalone", "--nproc-per-node", "4", str(EXAMPLE)]
    else:
        cmd = [sys.executable, "-m", "symmpool.launch", "--nproc-per-node", "4",
               "--timeout-s", str(JOB_TIMEOUT_S - 30), str(EXAMPLE)]
    out = _run(cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "train_cpu: 4 ranks x 3 steps ok" in out.stdout, out.stdout + out.stderr


def test_a_dead_rank_is_a_peer_lost_error_on_the_others():
    out = _run([sys.executable, "-m", "symmpool.launch", "--nproc-per-node", "4",
                "--timeout-s", str(JOB_TIMEOUT_S - 30), str(HERE / "ranks" / "peer_lost.py")])
    # The launcher reports the dead rank's status; the survivors saw it lost.
    assert out.returncode == 7, out.stdout + out.stderr
    for rank in range(3):
        assert f"rank {rank}: peer lost ok" in out.stdout, out.stdout + out.stderr


def _shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("check", ["strict", "async"])
def test_survivors_of_a_killed_rank_shrink_and_go_on(check):
    world = 4
    before = _shm_entries()
    out = _run([sys.executable, "-m", "symmpool.launch", "--nproc-per-node", str(world),
                "--timeout-s", str(JOB_TIMEOUT_S - 30), "--grace-s", "90",
                str(HERE / "ranks" / "shrink.py"), check])
    text = out.stdout + out.stderr
    # The launcher reports the killed rank (-9: SIGKILL) and no other failure.
    assert f"rank {world - 1} exited with -{signal.SIGKILL.value}" in out.stderr, text
    assert out.returncode == (-signal.SIGKILL.value) & 0xFF, text
    assert "WRONG" not in out.stdout, text
    # A shrink the program asked for is no warning to act on.
    assert "SymmpoolWarning" not in out.stderr, text
    for rank in range(world - 1):
        assert f"rank {rank}: peer lost at step 2" in out.stdout, text
        assert f"rank {rank}: shrunk ok: ShrinkReport(rank {rank} of {world} -> {rank} of {world - 1}, " \
               f"lost_ranks=[{world - 1}]" in out.stdout, text
        assert f"rank {rank}: 5 steps ok, world {world} -> {world - 1} ({check})" in out.stdout, text
    # Nothing is left behind: every rank's process is gone, no shared-memory file stays.
    pids = [int(pid) for pid in re.findall(r"rank \d+: pid (\d+)", out.stdout)]
    assert len(pids) == world and all(_gone(pid) for pid in pids), (pids, text)
    assert not {e for e in _shm_entries() - before if "symmpool" in e or "shrink" in e}


@pytest.mark.parametrize("check", ["strict", "async"])
def test_a_skipped_tagged_all_gather_is_a_divergence_on_every_rank(check):
    world = 3
    out = _run([sys.executable, "-m", "symmpool.launch", "--nproc-per-node", str(world),
                "--timeout-s", str(JOB_TIMEOUT_S - 30), str(HERE / "ranks" / "skip_tagged.py"), check])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WRONG DATA" not in out.stdout, out.stdout
    for rank in range(world):
        assert f"rank {rank}: divergence ok ({check}): tag" in out.stdout, out.stdout + out.stderr


def test_the_launcher_refuses_bad_arguments():
    out = _run([sys.executable, "-m", "symmpool.launch", "--nproc-per-node", "0", "x.py"])
    assert out.returncode == 2 and "at least 1" in out.stderr
    out = _run([sys.executable, "-m", "symmpool.launch", "--nproc-per-node", "2"])
    assert out.returncode == 2 and "give a script" in out.stderr


def test_with_the_store_outside_the_ranks_rank_0_is_lost_like_any_other():
    """``python -m symmpool.store`` serves the job; the ranks run with
    ``SYMMPOOL_STORE_EXTERNAL=1``; rank 0 kills itself mid-step and the three others
    shrink past it (renumbered 0, 1, 2) and go on; the store exits 0 once every rank has
    joined and left."""
    from symmpool.launch import free_port, rank_env

    world, port, job = 4, free_port(), f"store-test-{os.getpid()}"
    base = dict(os.environ, SYMMPOOL_STORE_PORT=str(port), SYMMPOOL_JOB_ID=job,
                MASTER_ADDR="127.0.0.1")
    store = subprocess.Popen([sys.executable, "-m", "symmpool.store", "--world-size", str(world),
                              "--bind", "127.0.0.1", "--timeout-s", str(JOB_TIMEOUT_S)],
                             env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        assert "listening on 127.0.0.1:" in store.stdout.readline()
        for rank in range(world):
            env = rank_env(rank, world, master_addr="127.0.0.1", master_port=port, job_id=job,
                           base=dict(base, SYMMPOOL_STORE_EXTERNAL="1", SHRINK_VICTIM="0"))
            ranks.append(subprocess.Popen(
                [sys.executable, str(HERE / "ranks" / "shrink.py"), "async"], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.DEVNULL))
        outs = [p.communicate(timeout=JOB_TIMEOUT_S)[0] for p in ranks]
        codes = [p.returncode for p in ranks]
        text = "\n".join(outs)
        assert codes == [-signal.SIGKILL.value, 0, 0, 0], (codes, text)
        for old in range(1, world):
            new = old - 1
            assert f"rank {old}: peer lost at step 2" in text, text
            assert f"rank {old}: shrunk ok: ShrinkReport(rank {old} of {world} -> {new} of " \
                   f"{world - 1}, lost_ranks=[0]" in text, text
            assert f"rank {old}: 5 steps ok, world {world} -> {world - 1} (async)" in text, text
        rest, err = store.communicate(timeout=30)
        assert store.returncode == 0, rest + err
        assert "the job ended (4 ranks departed, " in rest, rest + err
    finally:
        for p in [*ranks, store]:
            if p.poll() is None:
                p.kill()
                p.wait()


def _lines(text, prefix):
    """The rest of each line of `text` that starts with `prefix`."""
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize(("victim", "check"), [(1, "async"), (0, "strict")])
def test_a_newcomer_replaces_the_lost_rank_and_the_world_grows_back(tmp_path, victim, check):
    """4 ranks (``ranks/grow.py``), the store outside them (``python -m symmpool.store``):
    ``grow(wait=False)`` at step 1 is ``None`` on every rank (no newcomer); job rank
    ``victim`` (rank 0 too: any rank can be replaced) kills itself in the middle of
    step 2, the three others shrink and train on; the test starts a newcomer as that
    job rank with ``SYMMPOOL_JOIN=1`` once the victim is gone (it waits in
    ``Pool.shm()``); at step 5 the shrunk group's rank 0 saves the state and every
    survivor calls ``grow(wait=True)``, the newcomer's ``Pool.shm()`` joins (its
    ``joined`` report) and it loads the state, and the four train to the end. Every
    rank's final parameters are bit-identical, and equal a fresh 4-rank job's from the
    saved state; the store exits 0; no process and nothing in /dev/shm is left."""
    from symmpool.launch import free_port, rank_env

    world, port, job = 4, free_port(), f"grow-test-{os.getpid()}-{victim}"
    state = tmp_path / "state"
    before = _shm_entries()
    base = dict(os.environ, SYMMPOOL_STORE_PORT=str(port), SYMMPOOL_JOB_ID=job,
                MASTER_ADDR="127.0.0.1", GROW_STATE=str(state))
    program = [sys.executable, str(HERE / "ranks" / "grow.py"), check]
    store = subprocess.Popen([sys.executable, "-m", "symmpool.store", "--world-size", str(world),
                              "--bind", "127.0.0.1", "--timeout-s", str(JOB_TIMEOUT_S)],
                             env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs, logs = [], []

    def start(rank, **extra):
        env = rank_env(rank, world, master_addr="127.0.0.1", master_port=port, job_id=job,
                       base=dict(base, SYMMPOOL_STORE_EXTERNAL="1", **extra))
        log = open(tmp_path / f"rank-{len(procs)}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(program, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, cwd=tmp_path))

    try:
        assert "listening on 127.0.0.1:" in store.stdout.readline()
        for rank in range(world):
            start(rank, GROW_VICTIM=str(victim))
        # A launcher restarts the lost rank at once: its replacement waits in
        # Pool.shm() (the store holds it) until the survivors grow.
        procs[victim].wait(timeout=JOB_TIMEOUT_S)
        start(victim, SYMMPOOL_JOIN="1")
        codes = [p.wait(timeout=JOB_TIMEOUT_S) for p in procs]
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
        text = "\n".join(outs)
        assert codes == [0 if r != victim else -signal.SIGKILL.value for r in range(world)] + [0], \
            (codes, text)
        assert "WRONG" not in text and "Traceback" not in text, text
        survivors = [r for r in range(world) if r != victim]
        for r in range(world):
            assert _lines(outs[r], f"job {r}: grow(wait=False): None"), outs[r]
        assert _lines(outs[victim], f"job {victim}: leaving"), outs[victim]
        for shrunk_rank, r in enumerate(survivors):
            out = outs[r]
            assert _lines(out, f"job {r}: peer lost at step 2: rank {victim}"), out
            assert _lines(out, f"job {r}: shrunk ShrinkReport(rank {r} of {world} -> "
                               f"{shrunk_rank} of {world - 1}, lost_ranks=[{victim}]"), out
            # Numbered by job rank again; the newcomer takes the lost rank's place.
            grown = _lines(out, f"job {r}: grown GrowReport(rank={r}, world_size 3 -> 4, "
                                f"newcomers=[{victim}], segments=")
            assert len(grown) == 1, out
            # The first pool's buffer, alive across both: its block stays allocated.
            assert "pinned_blocks=0," not in grown[0], out
        newcomer = outs[world]
        joined = _lines(newcomer, f"job {victim}: joined GrowReport(rank={victim}, "
                                  f"world_size 0 -> 4, newcomers=[{victim}], segments=")
        assert len(joined) == 1, newcomer
        assert _lines(newcomer, f"job {victim}: loaded step 5"), newcomer
        # The same segments and registrations on every rank of the grown group.
        layout = {line.split("segments=")[1].split(", pinned")[0]
                  for line in _lines(text, "") if "GrowReport(" in line}
        assert len(layout) == 1, text
        finals = {r: _lines(out, f"job {r if r < world else victim}: final ")
                  for r, out in enumerate(outs) if r != victim}
        assert all(len(f) == 1 for f in finals.values()), text
        digests = {f[0].split()[0] for f in finals.values()}
        assert len(digests) == 1, finals
        (healed,) = digests
        for r, f in finals.items():
            rank = r if r < world else victim
            assert f[0].endswith(f"rank {rank} of {world} ({check})"), finals
        rest, err = store.communicate(timeout=30)
        assert store.returncode == 0, rest + err
        assert "the job ended (" in rest, rest + err
        # A fresh 4-rank job from the state at the grow ends where the healed one did.
        fresh_env = {k: v for k, v in base.items()
                     if not k.startswith("SYMMPOOL_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
        out = subprocess.run(
            [sys.executable, "-m", "symmpool.launch", "--nproc-per-node", str(world),
             "--timeout-s", str(JOB_TIMEOUT_S - 30), *program[1:]],
            env=dict(fresh_env, GROW_FROM_STATE="1"), cwd=tmp_path, capture_output=True,
            text=True, timeout=JOB_TIMEOUT_S, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stdout + out.stderr
        fresh = [line.split(": final ")[1].split()[0] for line in out.stdout.splitlines()
                 if ": final " in line]
        assert fresh == [healed] * world, out.stdout
        # Nothing is left behind.
        pids = [int(pid) for pid in re.findall(r"job \d+: pid (\d+)", text + out.stdout)]
        assert len(pids) == 2 * world + 1 and all(_gone(pid) for pid in pids), (pids, text)
        assert not {e for e in _shm_entries() - before if "symmpool" in e or "grow" in e}
    finally:
        for p in [*procs, store]:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
