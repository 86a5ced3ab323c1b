"""The worker process: ``python -m kvconnect.harness.worker --connect SOCK --role R --rank N``
(:mod:`.__main__`; started by the coordinator of a local run, not meant to be run by hand).

The worker asks the kernel to SIGKILL it when its parent dies (no orphans even if the
coordinator is killed), connects to the coordinator, receives the run config, runs its
scenario and reports the outcome. Exit codes: 0 finished, 1 failed, 70 lost the coordinator.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import traceback

from kvconnect.framing import IpcError

from .. import environment
from ..config import ROLES
from ..control import Control, PeerFailure

log = logging.getLogger("kvconnect.harness.worker")

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits (Linux prctl PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(70)


def run_and_report(ctl: Control, role: str, rank: int, ipc_dir: str) -> int:
    """Run the scenario; report success or the fatal error through ``ctl``. Returns the exit
    code (0 or 1)."""
    from .scenario import run_worker

    try:
        run_worker(ctl, role, rank, ipc_dir)
    except PeerFailure as exc:
        ctl.finish(error=str(exc), data=exc.data)
        return 1
    except Exception as exc:  # noqa: BLE001 - report everything, with where it happened
        tb = traceback.format_exc(limit=8)
        log.error("%s%d failed: %s", role, rank, tb)
        short_tb = "\n".join(tb.rstrip().splitlines()[-8:])
        ctl.finish(error=f"{type(exc).__name__}: {exc}\n{short_tb}")
        return 1
    ctl.finish()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvconnect.harness.worker")
    parser.add_argument("--connect", required=True, help="the coordinator's Unix socket")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--standby", action="store_true",
                        help="wait, connected, until the coordinator needs a replacement")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    die_with_parent()
    from ..control import SocketControl

    info = {"hostname": environment.hostname(),
            "boot_id": environment.boot_id(f"{args.role}{args.rank}")}
    try:
        ctl = SocketControl.connect(args.connect, args.role, args.rank, info, timeout=30.0,
                                    standby=args.standby)
    except (OSError, PeerFailure, IpcError, ValueError) as exc:
        print(f"worker {args.role}{args.rank}: cannot join the run: {exc}", file=sys.stderr)
        return 70
    try:
        return run_and_report(ctl, args.role, args.rank, os.path.dirname(args.connect))
    finally:
        ctl.close()

