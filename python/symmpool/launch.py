"""A launcher for one process per rank on this machine, with torchrun's variables.

::

    python -m symmpool.launch --nproc-per-node 4 train.py [args...]
    python -m symmpool.launch --nproc-per-node 4 -m mypackage.train [args...]

starts ``--nproc-per-node`` Python processes of the script (or module), each with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
(127.0.0.1) and ``MASTER_PORT`` (a free port) set as torchrun sets them, and a random
``SYMMPOOL_JOB_ID`` so that two jobs that happen to share a port never merge. In the
script, ``symmpool.Pool.shm()`` (or ``symmpool.TcpStoreExchange.from_env()``) joins
the crate's store from those variables. It is what ``torchrun --nproc-per-node N``
does for a CPU job, for machines without torch.

The launcher waits for every rank; when one fails, the others get ``--grace-s``
seconds (default 20) to notice through the store and leave, then are killed; the whole
job is killed after ``--timeout-s`` (default: none). It exits with the first failing
rank's exit status (0 when every rank succeeded; 124 on the job timeout). The ranks die
with the launcher (``PR_SET_PDEATHSIG`` on Linux): none is left behind.
"""

import argparse
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time

__all__ = ["free_port", "launch", "main", "rank_env"]


def free_port(host="127.0.0.1"):
    """A TCP port free on ``host`` now (the kernel's choice; released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_env(rank, world_size, *, master_addr, master_port, job_id, base=None):
    """The environment of rank ``rank`` of ``world_size`` (torchrun's variables on
    one node), on top of ``base`` (default: this process's environment)."""
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        SYMMPOOL_JOB_ID=job_id,
    )
    return env


def _die_with_parent():
    """In the child, before exec: be killed when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup remains
        pass


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def launch(argv, nproc, *, timeout_s=None, grace_s=20.0, master_addr="127.0.0.1", python=None):
    """Run ``python argv...`` as ``nproc`` ranks; return the job's exit status (the
    first failing rank's, 0 if all succeeded, 124 if ``timeout_s`` passed first)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, not {nproc}")
    if timeout_s is not None and timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 or None, not {timeout_s}")
    if grace_s < 0:
        raise ValueError(f"grace_s must be >= 0, not {grace_s}")
    port = free_port(master_addr)
    job_id = f"symmpool-launch-{secrets.token_hex(16)}"
    python = python or sys.executable
    procs = []
    try:
        for rank in range(nproc):
            env = rank_env(rank, nproc, master_addr=master_addr, master_port=port, job_id=job_id)
            procs.append(
                subprocess.Popen(
                    [python, *argv],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
            )
        start = time.monotonic()
        failed_at = None
        status = 0
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and failed_at is None:
                    print(f"symmpool.launch: rank {rank} exited with {code}", file=sys.stderr)
                    failed_at, status = time.monotonic(), code
            if all(c is not None for c in codes):
                return status
            now = time.monotonic()
            if timeout_s is not None and now - start > timeout_s:
                print(f"symmpool.launch: the job ran past {timeout_s} s; killing it", file=sys.stderr)
                return 124
            if failed_at is not None and now - failed_at > grace_s:
                print("symmpool.launch: killing the ranks still running", file=sys.stderr)
                return status
            # Wait on the first rank still running, briefly, then look at all of them.
            running = next(p for p in procs if p.returncode is None)
            try:
                running.wait(0.1)
            except subprocess.TimeoutExpired:
                pass
    finally:
        _stop(procs)


def main(args=None):
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m symmpool.launch",
        description="Run a Python script as N ranks on this machine, with torchrun's variables.",
    )
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True, dest="nproc")
    parser.add_argument("--timeout-s", type=float, default=None, help="kill the job after this many seconds")
    parser.add_argument("--grace-s", type=float, default=20.0, help="after a rank fails, how long the others get")
    parser.add_argument("-m", dest="module", default=None, help="run a module (as python -m) instead of a script")
    parser.add_argument("script_and_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    argv = list(ns.script_and_args)
    if ns.module is not None:
        argv = ["-m", ns.module, *argv]
    if not argv:
        parser.error("give a script (or -m module) to run")
    try:
        return launch(argv, ns.nproc, timeout_s=ns.timeout_s, grace_s=ns.grace_s)
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
