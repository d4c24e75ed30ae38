"""One process per rank on a CPU machine: the example as 4 ranks (torchrun where torch
is installed, ``python -m symmpool.launch`` otherwise), a rank that dies, a rank
killed in the middle of a step whose survivors shrink and go on, and a rank that
skips a tagged all-gather. Each job runs under a timeout; the launcher kills every
rank it started when it returns."""

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
