"""Local runs: spawn the workers, serve their key/value table, watch them, clean up.

The coordinator (this module, in the ``kvconnect-validate`` process) listens on a Unix socket
inside a private 0700 directory, spawns ``N`` prefill and ``M`` decode workers
(``python -m kvconnect.harness.worker``), accepts only its own children (SO_PEERCRED pid
and uid), and then runs one event loop:

- worker messages (length-prefixed JSON, :mod:`kvconnect.framing`) update phases,
  collect checks and transfers, and implement publish / wait with per-wait deadlines;
- a worker that dies (socket EOF, exit status), stops sending heartbeats (hung or stopped),
  makes no progress for ``--timeout`` (+1 s) seconds outside a wait, or reports a fatal
  error fails the run at once: the report names the worker, its role and rank, its phase,
  and the tail of its log; every other worker is told to abort;
- ``--inject`` faults: workers say when one fires (:mod:`.faultwatch` times the report); a
  worker killed by a ``restart-*`` fault is replaced by its standby under the same name
  (:mod:`.restarts`): its keys are dropped from the table.

On every exit path all workers are killed if still running and reaped, sockets closed, and
the private directory removed; then :mod:`.cleanup` checks nothing was left behind. Why this
table and not a TCPStore on localhost (measured): :mod:`.rendezvous`.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from kvconnect.child import exit_signal_name, exit_text, log_tail
from kvconnect.framing import IpcError, recv_json, send_message
from kvconnect.interrupts import InterruptSignals
from kvconnect.leftovers import become_subreaper
from kvconnect.verdicts import FAIL, PASS, SKIP, Check

from ..config import RunConfig
from ..control import COORDINATOR_GRACE_S, COORDINATOR_SILENT, CoordinatorMessage, WorkerMessage
from ..display import Display
from ..faults import restarted_workers, specs_from_config
from ..report import Report, SweepPoint, Transfer, signal_name
from ..rundir import run_dir
from .cleanup import ProcessRecord, check_cleanup, take_baseline
from .faultwatch import FaultWatch
from .restarts import Restarts
from .startup import WorkerStartup
from .watchdog import UNRESPONSIVE, Judge, StallClock
from .worker_records import (
    EXIT_GRACE_S,
    LocalWorker,
    PeerQuery,
    Waiter,
    describe_workers,
    keep_logs,
    stop_all,
)

log = logging.getLogger(__name__)

#: lines of a failed worker's log quoted in the report
LOG_TAIL_LINES = 12
#: a worker making no progress outside a wait is failed this long after --timeout (its own
#: steps time out after --timeout: their specific error comes first)
PROGRESS_GRACE_S = 1.0
#: seconds a ``peer`` request waits for the peer's death before answering "alive"
PEER_QUERY_GRACE_S = 1.0
#: seconds an exited worker's connection may stay open before it is judged dead without its EOF
EXIT_DRAIN_S = 2.0


def run_local(cfg: RunConfig, report: Report, display: Display,
              signals: InterruptSignals | None = None) -> None:
    """Run the whole validation with local worker processes, filling ``report``.

    A SIGINT / SIGTERM raised through ``signals`` (:class:`kvconnect.interrupts.InterruptSignals`)
    stops the run: the workers are told to abort, then stopped and reaped, and ``report``
    records the signal and every worker's phase (:meth:`Report.interrupt`)."""
    before = take_baseline()
    subreaper = become_subreaper(True)  # a worker's orphaned child would come to us
    try:
        coordinator = Coordinator(cfg, report, display, signals or InterruptSignals())
        coordinator.run()
        check_cleanup(report, before, coordinator.process_records(), coordinator.dir,
                      cfg.device)
    finally:
        if subreaper:
            become_subreaper(False)
    coordinator.watch.finish(report)


class Coordinator(WorkerStartup, Restarts):
    """One local run. Single-threaded except one reader thread per worker socket."""

    def __init__(self, cfg: RunConfig, report: Report, display: Display,
                 signals: InterruptSignals) -> None:
        self.cfg = cfg
        self.signals = signals
        #: what the coordinator is doing: ``startup`` (spawn, accept), ``run``, ``teardown``
        self.stage = "startup"
        self.report = report
        self.display = display
        self.workers: list[LocalWorker] = []
        self.store: dict[str, Any] = {}
        self.waiters: list[Waiter] = []
        self.events: queue.Queue[tuple[str, LocalWorker, Any]] = queue.Queue()
        self.aborted: str | None = None
        self.abort_deadline: float | None = None
        self.dir = ""
        self.listener: socket.socket | None = None
        self.watch = FaultWatch(specs_from_config(cfg.faults), cfg.timeout, time.monotonic())
        #: workers a ``restart-*`` fault replaces (once each) by a standby
        self.restartable = restarted_workers(cfg.faults)
        self.peer_queries: list[PeerQuery] = []
        #: who is to blame for a silent worker; the coordinator's own stalls (:mod:`.watchdog`).
        #: A worker's own steps time out after ``timeout``; the progress deadline, a backstop,
        #: comes later so the worker's specific error arrives first
        self.judge = Judge(cfg.heartbeat_timeout, cfg.timeout + PROGRESS_GRACE_S)
        self.clock = StallClock(time.monotonic())
        #: a worker gave up on the coordinator's answer: the run failed as the coordinator's
        self.coordinator_blamed = False

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
        self.report.interrupt(signum, self.stage,
                              {w.name: w.phase for w in self.workers if w.counted})
        self.display.message(f"interrupted by {signal_name(signum)} during {self.stage}; "
                             "stopping the workers")
        self._abort(f"interrupted by {signal_name(signum)}")

    def process_records(self) -> list[ProcessRecord]:
        """Every process this run started (for the cleanup check)."""
        return [ProcessRecord(w.name if w.incarnation == 1 else f"{w.name}.{w.incarnation}",
                              w.proc.pid, w.start_ticks) for w in self.workers]

    def _running(self, w: LocalWorker) -> None:
        """``w`` has its config: watch it and read its messages."""
        w.state = "running"
        w.phase = "connected"
        w.last_seen = w.last_progress = time.monotonic()
        w.reader = threading.Thread(target=self._read_loop, args=(w,), daemon=True,
                                    name=f"kvv-read-{w.name}.{w.incarnation}")
        w.reader.start()

    def _read_loop(self, w: LocalWorker) -> None:
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
        self.clock.last = time.monotonic()
        while True:
            if all(w.finished or w.state == "standby" for w in self.workers):
                return
            if self.abort_deadline is not None and time.monotonic() > self.abort_deadline:
                return
            try:
                kind, w, payload = self.events.get(timeout=0.1)
            except queue.Empty:
                kind = ""
            self._check_stall(time.monotonic())
            if kind == "msg":
                self._on_message(w, payload)
            elif kind == "eof":
                self._on_eof(w, payload)
            self._tick()

    def _on_message(self, w: LocalWorker, msg: WorkerMessage) -> None:
        now = time.monotonic()
        w.last_seen = now
        op = msg.get("op")
        if op == "hb":
            return
        w.last_progress = now
        try:
            handler = self._HANDLERS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ValueError(f"unknown op {op!r}")
            handler(self, w, msg, now)
        except (KeyError, TypeError, ValueError) as exc:
            self._fail_worker(w, f"{w.who} sent a malformed message ({exc}); killed it",
                              state="dead", kill=True, cause="malformed_message")

    # -- one handler per message op (_HANDLERS); KeyError / TypeError / ValueError: malformed
    def _op_phase(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        w.phase = str(msg["phase"])
        self.display.phase(w.name, w.phase)

    def _op_check(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        check = Check.from_json(msg["check"])
        check.worker = w.name
        self.report.checks.append(check)
        self.watch.observe(check, now)
        self.display.check(check)

    def _op_fault(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        record = msg["fault"]
        if self.watch.fired(w.name, record) is None:
            raise ValueError(f"no such fault aimed at {w.name}: {record!r}")
        self.display.message(f"{w.name}: --inject {record['fault']} fires in phase "
                             f"{record['in_phase']}")

    def _op_peer(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        self.peer_queries.append(PeerQuery(
            w, int(msg["id"]), str(msg["peer"]), int(msg["incarnation"]),
            now + min(PEER_QUERY_GRACE_S, max(0.0, float(msg["timeout"])))))
        self._answer_peer_queries()

    def _op_transfer(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        t = Transfer.from_json(msg["transfer"])
        self.report.transfers.append(t)
        self.display.transfer(t)

    def _op_sweep(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        point = SweepPoint.from_json(msg["point"])
        self.report.sweep.append(point)
        self.display.sweep(point)

    def _op_progress(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        """Nothing but progress (``last_progress`` moved on already)."""

    def _op_set(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        key = str(msg["key"])
        if not key.startswith(w.name + "/"):
            raise ValueError(f"{w.name} may only publish its own keys, not {key!r}")
        self.store[key] = msg.get("value")
        self._resolve(key)

    def _op_get(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        rid, key, timeout = int(msg["id"]), str(msg["key"]), float(msg["timeout"])
        if key in self.store:
            self._reply(w, {"op": "value", "id": rid, "key": key, "value": self.store[key]})
            return
        if self.aborted is not None:
            self._reply(w, {"op": "fail", "id": rid, "message": self.aborted})
            return
        timeout = min(max(timeout, 0.0), self.cfg.timeout * 10)
        w.waiting += 1
        self.waiters.append(Waiter(w, rid, key, timeout, time.monotonic() + timeout))

    def _op_done(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        w.state = "done"
        w.phase = "done"
        self.display.phase(w.name, "done")

    def _op_error(self, w: LocalWorker, msg: WorkerMessage, now: float) -> None:
        phase = str(msg.get("phase", w.phase))
        text = str(msg.get("message"))
        failure = msg.get("data")
        silent = isinstance(failure, dict) and failure.get("cause") == COORDINATOR_SILENT
        if (self.aborted is not None and text.startswith("run aborted")) or silent:
            # not its own failure: the run was aborted under it, or the coordinator (stopped
            # past the worker's wait for an answer) failed it
            w.state = "failed"
            self._add_check(f"worker/{w.name}", SKIP, f"{w.who} stopped in phase {phase}: "
                            + (f"{text} (the coordinator's failure: coordinator/stalls)"
                               if silent else f"because the {text}"),
                            data={**self._who(w), "phase": phase,
                                  "cause": "coordinator_stall" if silent else "aborted"})
            if silent and not self.coordinator_blamed:
                self.coordinator_blamed = True
                detail, data = self.clock.blame(w.who, phase, text,
                                                self.cfg.timeout + COORDINATOR_GRACE_S)
                self._add_check("coordinator/stalls", FAIL, detail, data=data)
                self.display.message(f"FAIL {detail}")
                self._abort(detail)
        else:
            w.phase = phase
            self._fail_worker(w, f"{w.who} failed in phase {phase}: {text}",
                              state="failed", tail=False, cause="error",
                              data={"failure": failure} if failure else None)

    _HANDLERS = {"phase": _op_phase, "check": _op_check, "fault": _op_fault, "peer": _op_peer,
                 "transfer": _op_transfer, "sweep": _op_sweep, "progress": _op_progress,
                 "set": _op_set, "get": _op_get, "done": _op_done, "error": _op_error}

    def _add_check(self, name: str, status: str, detail: str = "",
                   data: dict[str, Any] | None = None) -> Check:
        """A check of the coordinator's own (shown to the fault watch as it arrives)."""
        check = self.report.add_check(name, status, detail, data=data)
        self.watch.observe(check, time.monotonic())
        return check

    def _resolve(self, key: str) -> None:
        keep = []
        for wt in self.waiters:
            if wt.key == key:
                wt.worker.waiting -= 1
                wt.worker.last_progress = time.monotonic()  # a wait's end is progress
                self._reply(wt.worker, {"op": "value", "id": wt.rid, "key": key,
                                        "value": self.store[key]})
            else:
                keep.append(wt)
        self.waiters = keep

    def _reply(self, w: LocalWorker, msg: CoordinatorMessage) -> None:
        if w.sock is None or w.state in ("failed", "dead"):
            return
        try:
            send_message(w.sock, msg)
        except OSError as exc:
            log.debug("reply to %s failed: %s", w.name, exc)

    def _on_eof(self, w: LocalWorker, reason: str) -> None:
        if w.state in ("done", "failed", "dead"):
            return
        try:
            code = w.proc.wait(timeout=2.0)
            how = exit_text(code)
        except subprocess.TimeoutExpired:
            how = f"closed its connection ({reason}) but is still running; killed it"
            w.proc.kill()
        self._died(w, how)

    def _died(self, w: LocalWorker, how: str) -> None:
        """``w`` died: replace it when a ``restart-*`` fault says so, else fail the run."""
        if w.name in self.restartable and self._restart(w, how):
            return
        self._fail_worker(w, f"{w.who} died in phase {w.phase}: {how}", state="dead",
                          cause="died")

    def _stalled(self, gap: float) -> None:
        """The coordinator did not run for ``gap`` seconds: what workers sent meanwhile is
        still unread, so every watchdog and deadline moves on by ``gap`` (a stall of ours
        is never charged to a worker)."""
        for w in self.workers:
            w.last_seen += gap
            w.last_progress += gap
            if w.exited_at is not None:
                w.exited_at += gap
        for wt in self.waiters:
            wt.deadline += gap
        for q in self.peer_queries:
            q.answer_by += gap
        if self.abort_deadline is not None:
            self.abort_deadline += gap

    def _check_stall(self, now: float) -> None:
        """Before a watchdog looks at ``now``: did the coordinator itself stop since the
        last look? (A stop after ``now`` was read cannot inflate what is judged at it.)"""
        gap = self.clock.turn(now)
        if gap:
            self._stalled(gap)

    def _tick(self) -> None:
        now = time.monotonic()
        self._check_stall(now)  # a stop inside the message just handled counts too
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
            wt.worker.last_progress = now
            self._reply(wt.worker, {"op": "fail", "id": wt.rid, "message": msg})
            self._add_check(f"deadline/{wt.worker.name}", FAIL, msg, data={
                **self._who(wt.worker), "phase": wt.worker.phase, "cause": "wait_timeout",
                "key": wt.key, "owner": owner, "owner_phase": peer.phase if peer else None,
                "timeout": wt.timeout})
            self._abort(msg)
        for w in self.workers:
            if w.state != "running":
                continue
            verdict = self.judge(w, now)
            if verdict is not None and verdict.cause == UNRESPONSIVE:
                self._fail_worker(
                    w, f"{w.who} stopped responding in phase {w.phase}: no heartbeat for "
                       f"{verdict.silent:.1f} s (process state: {verdict.process_state}); "
                       "killed it", state="dead", kill=True, cause="unresponsive",
                    data={"process_state": verdict.process_state,
                          "silent_seconds": round(verdict.silent, 3)})
            elif verdict is not None:
                self._fail_worker(
                    w, f"{w.who} made no progress for {verdict.idle:.0f} s in phase "
                       f"{w.phase} (its own steps time out after --timeout "
                       f"{self.cfg.timeout:g} s); killed it", state="dead", kill=True,
                    cause="no_progress")
            elif w.proc.poll() is not None:
                # judged by its reader's EOF (queued behind its last messages, "done"); here
                # only if its connection outlives EXIT_DRAIN_S (a child holding it)
                if w.exited_at is None:
                    w.exited_at = now
                elif now - w.exited_at > EXIT_DRAIN_S:
                    self._died(w, exit_text(w.proc.returncode))
        self._answer_peer_queries()

    # -- failures --------------------------------------------------------------------------------
    @staticmethod
    def _who(w: LocalWorker) -> dict[str, Any]:
        return {"worker": w.name, "role": w.role, "rank": w.rank, "pid": w.proc.pid,
                "incarnation": w.incarnation}

    def _fail_worker(self, w: LocalWorker, message: str, *, state: str, cause: str,
                     kill: bool = False, tail: bool = True,
                     data: dict[str, Any] | None = None) -> None:
        """Fail the run because of ``w``: one ``worker/<name>`` check whose ``data`` names
        the worker, its role, rank and phase and the ``cause`` (``died``, ``unresponsive``,
        ``no_progress``, ``error``, ...), then abort every other worker."""
        w.state = state
        if kill:
            w.proc.kill()
        code = w.proc.poll() if state == "dead" else None
        detail = message
        if tail:
            lines = log_tail(w.log_path, LOG_TAIL_LINES)
            if lines:
                detail += "\n--- last lines of its log ---\n" + lines
        self._add_check(f"worker/{w.name}", FAIL, detail, data={
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
            wt.worker.last_progress = time.monotonic()  # its wait ends: not a stall
            self._reply(wt.worker, {"op": "fail", "id": wt.rid, "message": self.aborted})
        self.waiters = []
        self._answer_peer_queries()
        for w in self.workers:
            if not w.finished and w.state != "standby":
                self._reply(w, {"op": "abort", "message": self.aborted})

    # -- teardown ----------------------------------------------------------------------------------
    def _teardown(self) -> None:
        """Every worker exits (or is killed) and is reaped; every socket is closed."""
        clean = self.aborted is None and all(w.state == "done" for w in self.workers
                                             if w.counted)
        stop_all(self.workers, clean, lambda w: self._fail_worker(
            w, f"{w.who} was still running in phase {w.phase} when the run ended; killed it",
            state="dead", cause="still_running"))
        kept = keep_logs(self.workers)
        if kept:
            self.display.message(f"worker logs kept in {kept}")

    def _summarise(self) -> None:
        self.report.workers.extend(describe_workers(self.workers, self.store))
        stalls = self.clock.summary()
        if stalls and not self.coordinator_blamed:
            self._add_check("coordinator/stalls", PASS,
                            f"the coordinator did not run {stalls['count']} times, for "
                            f"{stalls['max_seconds']:.1f} s at most (stopped or starved of "
                            "CPU); no worker was blamed for it", data=stalls)
        counted = [w for w in self.workers if w.counted]
        bad = [w for w in counted if w.state != "done" or w.proc.returncode != 0]
        if not bad and counted:
            self._add_check("workers", PASS,
                            f"{len(counted)} workers ran to the end and exited 0"
                            + (f" ({len(self.report.recovery)} replaced on the way)"
                               if self.report.recovery else ""))
        elif bad and not any(c.status == FAIL for c in self.report.checks):
            names = ", ".join(f"{w.name} ({w.state}, {exit_text(w.proc.returncode)})"
                              for w in bad)
            self._add_check("workers", FAIL, f"workers did not finish cleanly: {names}")
