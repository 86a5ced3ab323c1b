"""The coordinator's records of its worker processes, and how they end.

:class:`LocalWorker` is one worker process (a replaced incarnation and an unused standby
included) as :mod:`.event_loop` tracks it; :func:`stop_all` makes every one exit (or kills
it) and reaps it; :func:`describe_workers` is the report's ``workers`` section.

Units: seconds (monotonic clock).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvconnect.child import Child

from ..config import worker_name

log = logging.getLogger(__name__)

#: seconds a worker gets to exit by itself after an abort before SIGKILL
EXIT_GRACE_S = 3.0
#: seconds a worker that reported "done" gets to exit (it releases NIXL, memory, sockets)
DONE_GRACE_S = 15.0


@dataclass
class LocalWorker:
    """One worker process of a local run, as the coordinator tracks it."""

    role: str
    rank: int
    device: str
    proc: Child
    log_path: str
    sock: socket.socket | None = None
    phase: str = "spawned"
    state: str = "starting"  # starting | running | done | failed | dead
    info: dict[str, Any] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    waiting: int = 0
    reader: threading.Thread | None = None
    #: 1, or 2 for the standby that replaces a worker killed by a ``restart-*`` fault
    incarnation: int = 1
    #: replaced by a standby after it died (not a failure of the run)
    replaced: bool = False
    start_ticks: int | None = None
    #: when the coordinator first saw the process gone (its last messages may still be queued)
    exited_at: float | None = None

    @property
    def name(self) -> str:
        return worker_name(self.role, self.rank)

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank} ({self.name}, pid {self.proc.pid})"

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "dead")

    @property
    def counted(self) -> bool:
        """Part of the run's outcome: not a replaced incarnation, not an unused standby."""
        return not self.replaced and self.state != "standby"


@dataclass
class PeerQuery:
    """A worker asks whether ``peer``'s ``incarnation`` was replaced (it failed with it)."""

    worker: LocalWorker
    rid: int
    peer: str
    incarnation: int
    answer_by: float


@dataclass
class Waiter:
    """A worker waiting for ``key`` until ``deadline`` (monotonic seconds)."""

    worker: LocalWorker
    rid: int
    key: str
    timeout: float
    deadline: float


def stop_all(workers: list[LocalWorker], clean: bool,
             still_running: Callable[[LocalWorker], None]) -> None:
    """Every worker exits (or is killed) and is reaped; every socket is closed. Workers get
    :data:`DONE_GRACE_S` (``clean`` runs) or :data:`EXIT_GRACE_S` to exit by themselves;
    ``still_running(w)`` is called for one that had not finished by then (it is then killed).
    An unused standby is killed at once."""
    for w in workers:
        if w.state == "standby":  # not needed: nothing to wait for
            w.proc.kill()
    deadline = time.monotonic() + (DONE_GRACE_S if clean else EXIT_GRACE_S)
    for w in workers:
        left = deadline - time.monotonic()
        try:
            w.proc.wait(timeout=max(0.05, left))
        except subprocess.TimeoutExpired:
            if not w.finished and w.state != "standby":
                still_running(w)
            w.proc.kill()
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            log.error("worker pid %d did not die after SIGKILL", w.proc.pid)
        if w.sock is not None:
            try:
                w.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    for w in workers:
        if w.reader is not None:
            w.reader.join(timeout=2)
        if w.sock is not None:
            w.sock.close()
            w.sock = None


def keep_logs(workers: list[LocalWorker]) -> str | None:
    """With ``KVCONNECT_KEEP_WORKER_LOGS`` set, copy the workers' logs to a directory that
    outlives the run (returned); the run directory goes away."""
    if not os.environ.get("KVCONNECT_KEEP_WORKER_LOGS"):
        return None
    keep = tempfile.mkdtemp(prefix="kvconnect-validate-logs-")
    for w in workers:
        if os.path.exists(w.log_path):
            shutil.copy(w.log_path, keep)
    return keep


def describe_workers(workers: list[LocalWorker], store: dict[str, Any]
                     ) -> list[dict[str, Any]]:
    """The report's ``workers``: one record per process (every incarnation, standbys)."""
    out = []
    for w in workers:
        published = store.get(f"{w.name}/hello")
        extra = {**w.info, **(published if isinstance(published, dict) else {})}
        out.append({
            **{k: v for k, v in extra.items() if k not in ("device", "pid")},
            "name": w.name, "role": w.role, "rank": w.rank, "pid": w.proc.pid,
            "device": w.device, "phase": w.phase,
            "state": "unused standby" if w.state == "standby" else w.state,
            "exit_code": w.proc.returncode, "incarnation": w.incarnation,
            "replaced": w.replaced,
        })
    return out
