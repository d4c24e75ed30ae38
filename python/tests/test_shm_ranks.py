"""One process per rank on a CPU machine: the example as 4 ranks (torchrun where torch
is installed, ``python -m symmpool.launch`` otherwise), a rank that dies, and a rank
that skips a tagged all-gather. Each job runs under a timeout; the launcher kills
every rank it started when it returns."""

import os
import pathlib
import shutil
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
