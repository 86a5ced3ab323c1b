"""Starting a local run's workers: the coordinator's start-up half.

:class:`WorkerStartup` is a part of :class:`~.event_loop.Coordinator` (a mixin, like
:class:`~.restarts.Restarts`, to keep each file readable in one sitting): it spawns every
worker (and the standbys of restartable ones) with the coordinator's socket, then accepts
their connections, only from its own children (SO_PEERCRED pid and uid), each with a
``hello`` answered by the run's config (a standby: ``standby``). A worker that exits before
connecting, a bad hello, or ``--timeout`` seconds without every worker fails the run. What
it uses of the coordinator: :class:`~.part.CoordinatorPart`.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time

from kvconnect.child import exit_text
from kvconnect.errors import KvconnectError
from kvconnect.framing import IpcError, peer_credentials, recv_json, send_message
from kvconnect.verdicts import FAIL

from ..config import DECODE, PREFILL, worker_name
from ..rundir import process_start_ticks
from .launch import launch_method, preload_worker_modules, start_worker
from .part import CoordinatorPart
from .worker_records import LocalWorker

log = logging.getLogger("kvconnect.harness.coordinator.event_loop")


class _StartupFailed(KvconnectError):
    """A worker failed during start-up (its check says how): the run ends."""


class WorkerStartup(CoordinatorPart):
    """Spawning and admitting the workers (see the module docstring)."""

    def _spawn_all(self, path: str) -> None:
        if launch_method(self.cfg) == "fork":
            preload_worker_modules()
        standbys = []
        for role, count in ((PREFILL, self.cfg.num_prefill), (DECODE, self.cfg.num_decode)):
            for rank in range(count):
                name = worker_name(role, rank)
                device = self.cfg.device_for(role, rank)
                args = ["--connect", path, "--role", role, "--rank", str(rank)]
                w = self._start(role, rank, device, args, f"{name}.log")
                self.display.worker(name, w.proc.pid, device)
                if name in self.restartable:
                    standbys.append((role, rank, device, [*args, "--standby"], f"{name}.2.log"))
        for role, rank, device, args, log_name in standbys:
            standby = self._start(role, rank, device, args, log_name)
            standby.incarnation = 2
            standby.state = "standby"
        self.display.start()

    def _start(self, role: str, rank: int, device: str, args: list[str],
               log_name: str) -> LocalWorker:
        log_path = os.path.join(self.dir, log_name)
        proc = start_worker(launch_method(self.cfg), args, log_path, self.listener)
        w = LocalWorker(role, rank, device, proc, log_path,
                    start_ticks=process_start_ticks(proc.pid))
        self.workers.append(w)
        return w

    def _accept_all(self) -> bool:
        """Accept every worker's connection and hello; False (run failed) past the deadline
        or when a worker dies first."""
        listener = self.listener
        if listener is None:
            raise RuntimeError("workers are accepted before the listener was opened")
        by_pid = {w.proc.pid: w for w in self.workers}
        deadline = time.monotonic() + self.cfg.timeout
        pending = set(by_pid)
        while pending:
            if self._exited_during_startup([by_pid[p] for p in pending]):
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                self._startup_timeout([by_pid[p].name for p in sorted(pending)])
                return False
            ready, _, _ = select.select([listener], [], [], min(left, 0.2))
            if not ready:
                continue
            conn, _ = listener.accept()
            try:
                w = self._admit(conn, by_pid, left)
            except _StartupFailed:
                return False
            if w is not None:
                pending.discard(w.proc.pid)
        return True

    def _exited_during_startup(self, workers: list[LocalWorker]) -> bool:
        """Fail the run for the first of ``workers`` that exited before connecting."""
        for w in workers:
            if w.proc.poll() is not None:
                self._fail_worker(w, f"{w.who} exited with {exit_text(w.proc.returncode)} "
                                     "during start-up, before connecting", state="dead",
                                  cause="exited")
                return True
        return False

    def _startup_timeout(self, names: list[str]) -> None:
        self._add_check("startup", FAIL, f"workers {', '.join(names)} did not connect within "
                        f"--timeout {self.cfg.timeout:g} s (still importing? hung?)",
                        data={"cause": "startup_timeout", "workers": names,
                              "timeout": self.cfg.timeout})

    def _admit(self, conn: socket.socket, by_pid: dict[int, LocalWorker], left: float
               ) -> LocalWorker | None:
        """Take ``conn`` from one of our workers (SO_PEERCRED pid and uid) with its hello;
        answer with the config (a standby: ``standby``; :meth:`_restart` configures it).
        The worker; None for a connection not ours (closed). A bad hello fails the run."""
        w = None
        try:
            creds = peer_credentials(conn)
            w = by_pid.get(creds.pid)
            if w is None or creds.uid != os.getuid() or w.sock is not None:
                log.warning("rejected a connection from pid %d uid %d: not one of our "
                            "workers", creds.pid, creds.uid)
                conn.close()
                return None
            hello = recv_json(conn, timeout=max(1.0, min(left, 10.0)))
            standby = w.state == "standby"
            if (hello.get("op") != "hello" or hello.get("role") != w.role
                    or hello.get("rank") != w.rank or bool(hello.get("standby")) != standby):
                raise IpcError(f"unexpected hello {hello!r}")
            w.info = {**dict(hello.get("info") or {}), "device": w.device}
            send_message(conn, {"op": "standby"} if standby else
                         {"op": "config", "config": self.cfg.to_json(), "incarnation": 1})
        except (IpcError, OSError, KeyError, ValueError) as exc:
            conn.close()
            if w is None:
                return None
            self._fail_worker(w, f"{w.who}: bad start-up handshake: {exc}", state="dead",
                              cause="bad_handshake")
            raise _StartupFailed from None
        conn.settimeout(None)
        w.sock = conn
        if not standby:
            self._running(w)
        return w
