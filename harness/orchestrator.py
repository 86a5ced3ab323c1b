"""Local runs: spawn the workers, serve their key/value table, watch them, clean up.

The coordinator (this module, in the ``kvconnect-validate`` process) listens on a Unix socket
inside a private 0700 directory, spawns ``N`` prefill and ``M`` decode workers
(``python -m kvconnect.harness.worker``), accepts only its own children (SO_PEERCRED pid
and uid), and then runs one event loop:

- worker messages (length-prefixed JSON, :mod:`kvconnect.framing`) update phases,
  collect checks and transfers, and implement publish / wait with per-wait deadlines;
- a worker that dies (socket EOF, exit status), stops sending heartbeats (hung or stopped),
  makes no progress for ``--timeout`` seconds outside a wait, or reports a fatal error
  fails the run at once: the report names the worker, its role and rank, its phase, and the
  tail of its log; every other worker is told to abort.

On every exit path all workers are killed if still running and reaped, sockets closed, and
the private directory removed.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kvconnect.framing import IpcError, peer_credentials, recv_json, send_message

from .config import DECODE, PREFILL, RunConfig, worker_name
from .display import Display
from .launch import (
    exit_signal_name,
    exit_text,
    fd_target,
    kill_process,
    launch_method,
    log_tail,
    open_fds,
    preload_worker_modules,
    proc_state,
    start_worker,
)
from .lifetime import InterruptSignals
from .report import FAIL, PASS, SKIP, Check, Report, Transfer, signal_name
from .rundir import run_dir

log = logging.getLogger(__name__)

#: seconds a worker gets to exit by itself after an abort before SIGKILL
EXIT_GRACE_S = 3.0
#: seconds a worker that reported "done" gets to exit (it releases NIXL, memory, sockets)
DONE_GRACE_S = 15.0
#: lines of a failed worker's log quoted in the report
LOG_TAIL_LINES = 12


@dataclass
class _Worker:
    role: str
    rank: int
    device: str
    proc: Any  # subprocess.Popen or launch.ForkedWorker
    log_path: str
    sock: socket.socket | None = None
    phase: str = "spawned"
    state: str = "starting"  # starting | running | done | failed | dead
    info: dict[str, Any] = field(default_factory=dict)
    last_seen: float = field(default_factory=time.monotonic)
    last_progress: float = field(default_factory=time.monotonic)
    waiting: int = 0
    reader: threading.Thread | None = None

    @property
    def name(self) -> str:
        return worker_name(self.role, self.rank)

    @property
    def who(self) -> str:
        return f"{self.role} rank {self.rank} ({self.name}, pid {self.proc.pid})"

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "dead")


@dataclass
class _Waiter:
    worker: _Worker
    rid: int
    key: str
    timeout: float
    deadline: float


def run_local(cfg: RunConfig, report: Report, display: Display,
              signals: InterruptSignals | None = None) -> None:
    """Run the whole validation with local worker processes, filling ``report``.

    A SIGINT / SIGTERM raised through ``signals`` (:class:`~.lifetime.InterruptSignals`)
    stops the run: the workers are told to abort, then stopped and reaped, and ``report``
    records the signal and every worker's phase (:meth:`Report.interrupt`)."""
    fds_before = open_fds()
    coordinator = Coordinator(cfg, report, display, signals or InterruptSignals())
    coordinator.run()
    coordinator.check_cleanup(fds_before)


class Coordinator:
    """One local run. Single-threaded except one reader thread per worker socket."""

    def __init__(self, cfg: RunConfig, report: Report, display: Display,
                 signals: InterruptSignals) -> None:
        self.cfg = cfg
        self.signals = signals
        #: what the coordinator is doing: ``startup`` (spawn, accept), ``run``, ``teardown``
        self.stage = "startup"
        self.report = report
        self.display = display
        self.workers: list[_Worker] = []
        self.store: dict[str, Any] = {}
        self.waiters: list[_Waiter] = []
        self.events: queue.Queue[tuple[str, _Worker, Any]] = queue.Queue()
        self.aborted: str | None = None
        self.abort_deadline: float | None = None
        self.dir = ""
        self.listener: socket.socket | None = None
        #: a worker's own steps time out after ``timeout``; this backstop comes later so the
        #: worker's specific error arrives first
        self._progress_deadline = cfg.timeout * 1.5 + 5.0

    # -- top level -----------------------------------------------------------------------------
    def run(self) -> None:
        with run_dir() as directory:
            self.dir = directory
            path = os.path.join(directory, "coord.sock")
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.listener.bind(path)
                os.chmod(path, 0o600)
                self.listener.listen(self.cfg.num_prefill + self.cfg.num_decode + 4)
                self._spawn_all(path)
                if self._accept_all():
                    self.stage = "run"
                    self._event_loop()
            except KeyboardInterrupt as exc:
                self._interrupted(getattr(exc, "signum", signal.SIGINT))
            finally:
                self.signals.stop_raising()  # teardown must finish: later signals are noted
                if self.signals.signum is not None:
                    self._interrupted(self.signals.signum)
                self.stage = "teardown"
                try:
                    self._teardown()
                finally:
                    self.listener.close()
        self._summarise()

    def _interrupted(self, signum: int) -> None:
        """A signal stopped the run: record where everyone was, tell the workers to stop."""
        if self.report.interrupted is not None:
            return
        self.report.interrupt(signum, self.stage, {w.name: w.phase for w in self.workers})
        self.display.message(f"interrupted by {signal_name(signum)} during {self.stage}; "
                             "stopping the workers")
        self._abort(f"interrupted by {signal_name(signum)}")

    # -- spawning ------------------------------------------------------------------------------
    def _spawn_all(self, path: str) -> None:
        method = launch_method(self.cfg)
        if method == "fork":
            preload_worker_modules()
        for role, count in ((PREFILL, self.cfg.num_prefill), (DECODE, self.cfg.num_decode)):
            for rank in range(count):
                name = worker_name(role, rank)
                log_path = os.path.join(self.dir, f"{name}.log")
                device = self.cfg.device_for(role, rank)
                args = ["--connect", path, "--role", role, "--rank", str(rank)]
                proc = start_worker(method, args, log_path, self.listener)
                w = _Worker(role, rank, device, proc, log_path)
                self.workers.append(w)
                self.display.worker(name, proc.pid, device)
        self.display.start()

    def _accept_all(self) -> bool:
        """Accept every worker's connection and hello; False (run failed) past the deadline
        or when a worker dies first."""
        by_pid = {w.proc.pid: w for w in self.workers}
        deadline = time.monotonic() + self.cfg.timeout
        pending = set(by_pid)
        while pending:
            for pid in list(pending):
                w = by_pid[pid]
                if w.proc.poll() is not None:
                    self._fail_worker(w, f"{w.who} exited with {exit_text(w.proc.returncode)} "
                                         "during start-up, before connecting", state="dead",
                                      cause="exited")
                    return False
            left = deadline - time.monotonic()
            if left <= 0:
                names = ", ".join(by_pid[p].name for p in sorted(pending))
                self.report.add_check("startup", FAIL,
                                      f"workers {names} did not connect within --timeout "
                                      f"{self.cfg.timeout:g} s (still importing? hung?)",
                                      data={"cause": "startup_timeout",
                                            "workers": [by_pid[p].name for p in sorted(pending)],
                                            "timeout": self.cfg.timeout})
                return False
            ready, _, _ = select.select([self.listener], [], [], min(left, 0.2))
            if not ready:
                continue
            conn, _ = self.listener.accept()
            w = None
            try:
                creds = peer_credentials(conn)
                w = by_pid.get(creds.pid)
                if w is None or creds.uid != os.getuid() or w.sock is not None:
                    log.warning("rejected a connection from pid %d uid %d: not one of our "
                                "workers", creds.pid, creds.uid)
                    conn.close()
                    continue
                hello = recv_json(conn, timeout=max(1.0, min(left, 10.0)))
                if (hello.get("op") != "hello" or hello.get("role") != w.role
                        or hello.get("rank") != w.rank):
                    raise IpcError(f"unexpected hello {hello!r}")
                w.info = dict(hello.get("info") or {})
                w.info["device"] = w.device
                send_message(conn, {"op": "config", "config": self.cfg.to_json()})
            except (IpcError, OSError, KeyError, ValueError) as exc:
                conn.close()
                if w is not None:
                    self._fail_worker(w, f"{w.who}: bad start-up handshake: {exc}", state="dead",
                                      cause="bad_handshake")
                    return False
                continue
            conn.settimeout(None)
            w.sock = conn
            w.state = "running"
            w.phase = "connected"
            w.last_seen = w.last_progress = time.monotonic()
            w.reader = threading.Thread(target=self._read_loop, args=(w,), daemon=True,
                                        name=f"kvv-read-{w.name}")
            w.reader.start()
            pending.discard(w.proc.pid)
        return True

    def _read_loop(self, w: _Worker) -> None:
        sock = w.sock
        assert sock is not None
        while True:
            try:
                msg = recv_json(sock, timeout=None)
            except (IpcError, OSError, ValueError) as exc:
                self.events.put(("eof", w, str(exc)))
                return
            self.events.put(("msg", w, msg))

    # -- the event loop --------------------------------------------------------------------------
    def _event_loop(self) -> None:
        while True:
            if all(w.finished for w in self.workers):
                return
            if self.abort_deadline is not None and time.monotonic() > self.abort_deadline:
                return
            try:
                kind, w, payload = self.events.get(timeout=0.1)
            except queue.Empty:
                kind = ""
            if kind == "msg":
                self._on_message(w, payload)
            elif kind == "eof":
                self._on_eof(w, payload)
            self._tick()

    def _on_message(self, w: _Worker, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        w.last_seen = now
        op = msg.get("op")
        if op == "hb":
            return
        w.last_progress = now
        try:
            if op == "phase":
                w.phase = str(msg["phase"])
                self.display.phase(w.name, w.phase)
            elif op == "check":
                check = Check.from_json(msg["check"])
                check.worker = w.name
                self.report.checks.append(check)
                self.display.check(check)
            elif op == "transfer":
                t = Transfer.from_json(msg["transfer"])
                self.report.transfers.append(t)
                self.display.transfer(t)
            elif op == "set":
                key = str(msg["key"])
                if not key.startswith(w.name + "/"):
                    raise ValueError(f"{w.name} may only publish its own keys, not {key!r}")
                self.store[key] = msg.get("value")
                self._resolve(key)
            elif op == "get":
                self._on_get(w, int(msg["id"]), str(msg["key"]), float(msg["timeout"]))
            elif op == "done":
                w.state = "done"
                w.phase = "done"
                self.display.phase(w.name, "done")
            elif op == "error":
                phase = str(msg.get("phase", w.phase))
                text = str(msg.get("message"))
                if self.aborted is not None and text.startswith("run aborted"):
                    # not its own failure: the run was aborted under it
                    w.state = "failed"
                    self.report.add_check(f"worker/{w.name}", SKIP,
                                          f"{w.who} stopped in phase {phase} because the {text}",
                                          data={**self._who(w), "phase": phase,
                                                "cause": "aborted"})
                else:
                    w.phase = phase
                    failure = msg.get("data")
                    self._fail_worker(w, f"{w.who} failed in phase {phase}: {text}",
                                      state="failed", tail=False, cause="error",
                                      data={"failure": failure} if failure else None)
            else:
                raise ValueError(f"unknown op {op!r}")
        except (KeyError, TypeError, ValueError) as exc:
            self._fail_worker(w, f"{w.who} sent a malformed message ({exc}); killed it",
                              state="dead", kill=True, cause="malformed_message")

    def _on_get(self, w: _Worker, rid: int, key: str, timeout: float) -> None:
        if key in self.store:
            self._reply(w, {"op": "value", "id": rid, "key": key, "value": self.store[key]})
            return
        if self.aborted is not None:
            self._reply(w, {"op": "fail", "id": rid, "message": self.aborted})
            return
        timeout = min(max(timeout, 0.0), self.cfg.timeout * 10)
        w.waiting += 1
        self.waiters.append(_Waiter(w, rid, key, timeout, time.monotonic() + timeout))

    def _resolve(self, key: str) -> None:
        keep = []
        for wt in self.waiters:
            if wt.key == key:
                wt.worker.waiting -= 1
                self._reply(wt.worker, {"op": "value", "id": wt.rid, "key": key,
                                        "value": self.store[key]})
            else:
                keep.append(wt)
        self.waiters = keep

    def _reply(self, w: _Worker, msg: dict[str, Any]) -> None:
        if w.sock is None or w.state in ("failed", "dead"):
            return
        try:
            send_message(w.sock, msg)
        except OSError as exc:
            log.debug("reply to %s failed: %s", w.name, exc)

    def _on_eof(self, w: _Worker, reason: str) -> None:
        if w.state in ("done", "failed", "dead"):
            return
        try:
            code = w.proc.wait(timeout=2.0)
            how = exit_text(code)
        except subprocess.TimeoutExpired:
            how = f"closed its connection ({reason}) but is still running; killed it"
            kill_process(w.proc)
        self._fail_worker(w, f"{w.who} died in phase {w.phase}: {how}", state="dead",
                          cause="died")

    def _tick(self) -> None:
        now = time.monotonic()
        expired = [wt for wt in self.waiters if now > wt.deadline]
        for wt in expired:
            self.waiters.remove(wt)
            wt.worker.waiting -= 1
            owner = wt.key.split("/", 1)[0]
            peer = next((x for x in self.workers if x.name == owner), None)
            where = (f"{owner} is in phase {peer.phase} ({peer.state})" if peer
                     else f"no worker named {owner} exists")
            msg = (f"{wt.worker.who} timed out after {wt.timeout:g} s in phase "
                   f"{wt.worker.phase} waiting for {wt.key!r}: {where}")
            self._reply(wt.worker, {"op": "fail", "id": wt.rid, "message": msg})
            self.report.add_check(f"deadline/{wt.worker.name}", FAIL, msg, data={
                **self._who(wt.worker), "phase": wt.worker.phase, "cause": "wait_timeout",
                "key": wt.key, "owner": owner, "owner_phase": peer.phase if peer else None,
                "timeout": wt.timeout})
            self._abort(msg)
        for w in self.workers:
            if w.state != "running":
                continue
            silent = now - w.last_seen
            if silent > self.cfg.heartbeat_timeout:
                state = proc_state(w.proc.pid)
                self._fail_worker(
                    w, f"{w.who} stopped responding in phase {w.phase}: no heartbeat for "
                       f"{silent:.1f} s (process state: {state}); killed it",
                    state="dead", kill=True, cause="unresponsive",
                    data={"process_state": state, "silent_seconds": round(silent, 3)})
            elif w.waiting == 0 and now - w.last_progress > self._progress_deadline:
                self._fail_worker(
                    w, f"{w.who} made no progress for {now - w.last_progress:.0f} s in phase "
                       f"{w.phase} (its own steps time out after --timeout "
                       f"{self.cfg.timeout:g} s); killed it", state="dead", kill=True,
                    cause="no_progress")
            elif w.proc.poll() is not None:
                self._fail_worker(w, f"{w.who} died in phase {w.phase}: "
                                     f"{exit_text(w.proc.returncode)}", state="dead",
                                  cause="died")

    # -- failures --------------------------------------------------------------------------------
    @staticmethod
    def _who(w: _Worker) -> dict[str, Any]:
        return {"worker": w.name, "role": w.role, "rank": w.rank, "pid": w.proc.pid}

    def _fail_worker(self, w: _Worker, message: str, *, state: str, cause: str,
                     kill: bool = False, tail: bool = True,
                     data: dict[str, Any] | None = None) -> None:
        """Fail the run because of ``w``: one ``worker/<name>`` check whose ``data`` names
        the worker, its role, rank and phase and the ``cause`` (``died``, ``unresponsive``,
        ``no_progress``, ``error``, ...), then abort every other worker."""
        w.state = state
        if kill:
            kill_process(w.proc)
        code = w.proc.poll() if state == "dead" else None
        detail = message
        if tail:
            lines = log_tail(w.log_path, LOG_TAIL_LINES)
            if lines:
                detail += "\n--- last lines of its log ---\n" + lines
        self.report.add_check(f"worker/{w.name}", FAIL, detail, data={
            **self._who(w), "phase": w.phase, "cause": cause, "exit_code": code,
            "signal": exit_signal_name(code), **(data or {})})
        self.display.message(f"FAIL {message}")
        self._abort(message)

    def _abort(self, reason: str) -> None:
        if self.aborted is not None:
            return
        self.aborted = f"run aborted: {reason}"
        self.abort_deadline = time.monotonic() + EXIT_GRACE_S
        for wt in self.waiters:
            wt.worker.waiting -= 1
            self._reply(wt.worker, {"op": "fail", "id": wt.rid, "message": self.aborted})
        self.waiters = []
        for w in self.workers:
            if not w.finished:
                self._reply(w, {"op": "abort", "message": self.aborted})

    # -- teardown ----------------------------------------------------------------------------------
    def _teardown(self) -> None:
        """Every worker exits (or is killed) and is reaped; every socket is closed."""
        clean = self.aborted is None and all(w.state == "done" for w in self.workers)
        deadline = time.monotonic() + (DONE_GRACE_S if clean else EXIT_GRACE_S)
        for w in self.workers:
            left = deadline - time.monotonic()
            try:
                w.proc.wait(timeout=max(0.05, left))
            except subprocess.TimeoutExpired:
                if not w.finished:
                    self._fail_worker(w, f"{w.who} was still running in phase {w.phase} when "
                                         "the run ended; killed it", state="dead",
                                      cause="still_running")
                kill_process(w.proc)
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                log.error("worker pid %d did not die after SIGKILL", w.proc.pid)
            if w.sock is not None:
                try:
                    w.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for w in self.workers:
            if w.reader is not None:
                w.reader.join(timeout=2)
            if w.sock is not None:
                w.sock.close()
                w.sock = None
        # keep failing workers' logs only in the report (the directory goes away)
        if os.environ.get("KVCONNECT_KEEP_WORKER_LOGS"):
            keep = tempfile.mkdtemp(prefix="kvconnect-validate-logs-")
            for w in self.workers:
                if os.path.exists(w.log_path):
                    shutil.copy(w.log_path, keep)
            self.display.message(f"worker logs kept in {keep}")

    def check_cleanup(self, fds_before: set[int]) -> None:
        """Add the ``cleanup`` check: workers reaped, socket directory gone, no fd leaked."""
        problems = []
        alive = [f"{w.name} (pid {w.proc.pid})" for w in self.workers
                 if w.proc.returncode is None or os.path.exists(f"/proc/{w.proc.pid}")]
        if alive:
            problems.append("processes still present: " + ", ".join(alive))
        if self.dir and os.path.exists(self.dir):
            problems.append(f"socket directory {self.dir} still exists")
        leaked = sorted(open_fds() - fds_before)
        if leaked:
            problems.append(f"fds left open: {[fd_target(fd) for fd in leaked][:8]}")
        self.report.add_check(
            "cleanup", FAIL if problems else PASS, "; ".join(problems) if problems else
            f"{len(self.workers)} workers reaped, socket directory removed, no fd left open")

    def _summarise(self) -> None:
        for w in self.workers:
            published = self.store.get(f"{w.name}/hello")
            extra = {**w.info, **(published if isinstance(published, dict) else {})}
            self.report.workers.append({
                **{k: v for k, v in extra.items() if k not in ("device", "pid")},
                "name": w.name, "role": w.role, "rank": w.rank, "pid": w.proc.pid,
                "device": w.device, "phase": w.phase, "state": w.state,
                "exit_code": w.proc.returncode,
            })
        bad = [w for w in self.workers if w.state != "done" or w.proc.returncode != 0]
        if not bad and self.workers:
            self.report.add_check("workers", PASS,
                                  f"{len(self.workers)} workers ran to the end and exited 0")
        elif bad and not any(c.status == FAIL for c in self.report.checks):
            names = ", ".join(f"{w.name} ({w.state}, {exit_text(w.proc.returncode)})"
                              for w in bad)
            self.report.add_check("workers", FAIL, f"workers did not finish cleanly: {names}")
