"""FSDP2 on CPU (gloo) with symmpool's comm objects over a shared-memory pool, as 2
processes (``python -m symmpool.launch``): with the defaults of ``install`` (a tag per
FSDP module, the step boundary at the end of each backward pass), a rank that skips
a module's all-gather gets a DivergenceError on every rank before the optimizer step,
under the strict and the async check: its parameter shards unchanged and no gradient
reduced from the mismatched calls (under strict from the forward, before the call
ran). Skipped (with the reason) where torch or its
FSDP2 is not installed; each job runs under a timeout and the launcher kills its
ranks."""

import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")

HERE = pathlib.Path(__file__).resolve().parent
#: Seconds a job may take in all (a bound; it takes seconds).
JOB_TIMEOUT_S = 300


@pytest.mark.parametrize("check", ["strict", "async"])
def test_a_rank_that_skips_a_modules_all_gather_gets_a_divergence(check):
    world = 2
    out = subprocess.run(
        [sys.executable, "-m", "symmpool.launch", "--nproc-per-node", str(world),
         "--timeout-s", str(JOB_TIMEOUT_S - 30), str(HERE / "ranks" / "fsdp_skip.py"), check],
        cwd=HERE.parent.parent, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "WRONG DATA" not in out.stdout, text
    for rank in range(world):
        assert f"rank {rank}: step ok" in out.stdout, text
        assert f"rank {rank}: divergence ok ({check}) in " in out.stdout, text
