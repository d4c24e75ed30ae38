"""The crate's rendezvous store in a process of its own, as a launcher's agent hosts
PyTorch's: no rank hosts it, so any rank, rank 0 included, can be lost while the
survivors shrink and go on.

    export MASTER_ADDR=$(hostname) SYMMPOOL_STORE_PORT=29511 SYMMPOOL_JOB_ID=job-$RANDOM
    python -m symmpool.store --world-size 8 &
    SYMMPOOL_STORE_EXTERNAL=1 torchrun --nproc-per-node 8 train.py

It reads the settings the ranks read (the port ``SYMMPOOL_STORE_PORT``, else
``MASTER_PORT``; ``SYMMPOOL_TOKEN``, the job identity, the heartbeats), serves the job,
and exits 0 once every rank has joined and left (ended or lost), 1 after
``--timeout-s``, when not every rank joined within the ranks' start-up timeout
(``SYMMPOOL_STARTUP_TIMEOUT_MS``), or on a bad setting.
"""

import argparse
import sys

from . import _ext


def main(argv=None) -> int:
    """Serve one job's store; the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m symmpool.store",
        description="The crate's rendezvous store of one job, in a process of its own: no rank "
                    "hosts it (run the ranks with SYMMPOOL_STORE_EXTERNAL=1), so any rank can be "
                    "lost while the survivors shrink and go on.")
    ap.add_argument("--world-size", type=int, required=True, help="how many ranks the job has (>= 1)")
    ap.add_argument("--bind", default="0.0.0.0", help="the address to listen on")
    ap.add_argument("--timeout-s", type=float, default=7 * 24 * 3600.0,
                    help="exit 1 if the job has not ended by then")
    args = ap.parse_args(argv)
    if args.world_size < 1:
        ap.error(f"--world-size must be at least 1, not {args.world_size}")
    try:
        server = _ext.StoreServer(args.world_size, args.bind)
    except Exception as e:  # a bad setting or an address in use: say it, exit 1
        print(f"store: {e}", file=sys.stderr)
        return 1
    print(f"store: listening on {server.address} for {args.world_size} ranks", flush=True)
    try:
        end = server.wait_until_done(args.timeout_s)
    except KeyboardInterrupt:
        print("store: interrupted", file=sys.stderr)
        return 130
    if end == "not_assembled":
        print("store: not every rank joined within the start-up timeout", file=sys.stderr)
        return 1
    if end != "ended":
        print(f"store: the job had not ended after {args.timeout_s} s", file=sys.stderr)
        return 1
    print(f"store: the job ended ({server.ranks_departed} ranks departed, "
          f"{server.rounds_completed} rounds)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
