"""The control plane a worker sees: publish / wait for JSON values, report phases and results.

Two implementations share :class:`Control`'s contract:

- :class:`SocketControl` (local runs): a Unix-socket connection to the coordinator
  (:mod:`.event_loop`), which holds the key/value table, watches every worker and aborts
  the run when one dies or hangs.
- ``StoreControl`` (multi-host runs, :mod:`.rendezvous`): a ``torch.distributed.TCPStore``.

Keys are ``"<owner>/<name>"`` where owner is the worker that publishes them (``prefill0``),
so a waiter always knows whom it waits for. Values are JSON (never pickle). Every wait has
a deadline; a dead, hung or failed peer surfaces as :class:`PeerFailure` naming the peer and
its phase.
"""

from __future__ import annotations

import abc
import logging
import os
import socket
import threading
import time
from dataclasses import asdict
from typing import Any, TypedDict, cast

from kvconnect.errors import KvconnectError
from kvconnect.framing import IpcError, peer_credentials, recv_json, send_message
from kvconnect.verdicts import FAIL, PASS, SKIP, Check

from .config import RunConfig
from .faults import FaultEffects, FaultPlan, FaultSpec, specs_from_config
from .report import SweepPoint, Transfer

log = logging.getLogger(__name__)

#: seconds between heartbeats
HEARTBEAT_S = 0.5
#: a worker waits this long past a request's own timeout for the coordinator's answer (the
#: coordinator's deadline, with a better message, comes first) before giving up on it
COORDINATOR_GRACE_S = 5.0
#: :attr:`PeerFailure.data` ``cause`` of a worker that gave up on the coordinator's answer:
#: the coordinator's failure (stopped or starved), not the worker's
COORDINATOR_SILENT = "coordinator_silent"


class WorkerMessage(TypedDict, total=False):
    """A worker's message to the coordinator; ``op`` (always set) picks the coordinator's
    ``_op_*`` handler, which reads the fields of its kind."""

    op: str
    phase: str
    check: dict[str, Any]
    transfer: dict[str, Any]
    point: dict[str, Any]
    fault: dict[str, Any]
    key: str
    value: Any
    id: int
    timeout: float
    peer: str
    incarnation: int
    message: str
    data: dict[str, Any]


class CoordinatorMessage(TypedDict, total=False):
    """The coordinator's message to a worker: ``op`` ``config``, ``standby``, ``value`` or
    ``fail`` (answering request ``id``), ``abort``."""

    op: str
    config: dict[str, Any]
    incarnation: int
    id: int
    key: str
    value: Any
    message: str


class PeerFailure(KvconnectError, RuntimeError):
    """A peer died, hung, failed, or the run was aborted; the message says who and where,
    :attr:`data` the same for programs: ``peer``, its phase ``peer_phase`` and the ``cause``
    (``unresponsive``, ``wait_timeout``, ``aborted``, ``store_lost``, ``oversized``,
    :data:`COORDINATOR_SILENT`) where known."""

    def __init__(self, message: str, *, peer: str | None = None,
                 peer_phase: str | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.data: dict[str, Any] = {k: v for k, v in (("peer", peer), ("peer_phase", peer_phase),
                                                       ("cause", cause)) if v is not None}


class Control(abc.ABC):
    """What a worker uses to talk to the rest of the run (one per worker process).

    ``incarnation`` counts the processes that have run under this worker's name: 1, or 2
    for the replacement the coordinator starts after a ``restart-*`` fault."""

    def __init__(self, name: str, config: RunConfig, incarnation: int = 1) -> None:
        self.name = name
        self.config = config
        self.incarnation = incarnation
        self.current_phase = "start"
        #: what fired ``--inject`` faults changed in this worker (read by its steps)
        self.effects = FaultEffects()
        self._faults = FaultPlan(specs_from_config(config.faults), name, incarnation)

    # -- progress ----------------------------------------------------------------------------
    def phase(self, phase: str) -> None:
        """Enter ``phase`` (reported to the coordinator; named in every failure message).
        The phase boundary is where ``--inject`` faults aimed at this worker fire."""
        self.current_phase = phase
        self._send_phase(phase)
        self._faults.at_phase(phase, self)

    @property
    def stall_seconds(self) -> float:
        """How long a ``slow-*`` fault stalls this worker (seconds)."""
        return self.config.stall_seconds

    def fault_fired(self, spec: FaultSpec, phase: str) -> None:
        """Tell the run that fault ``spec`` fires now, in ``phase`` (before it acts)."""
        self._send_fault({"fault": spec.text, **spec.to_json(), "in_phase": phase,
                          "at": time.monotonic(), "at_unix": time.time()})

    def check(self, name: str, status: str, detail: str = "", seconds: float = 0.0,
              data: dict[str, Any] | None = None) -> Check:
        """Report a verdict: ``detail`` in words, ``data`` the same facts as JSON values."""
        c = Check(name=name, status=status, detail=detail, worker=self.name, seconds=seconds,
                  data=dict(data or {}))
        self._send_check(c)
        return c

    def passed(self, name: str, detail: str = "", seconds: float = 0.0,
               data: dict[str, Any] | None = None) -> Check:
        return self.check(name, PASS, detail, seconds, data)

    def failed(self, name: str, detail: str, seconds: float = 0.0,
               data: dict[str, Any] | None = None) -> Check:
        return self.check(name, FAIL, detail, seconds, data)

    def skipped(self, name: str, reason: str) -> Check:
        return self.check(name, SKIP, reason)

    @abc.abstractmethod
    def transfer(self, t: Transfer) -> None: ...

    @abc.abstractmethod
    def sweep(self, point: SweepPoint) -> None:
        """Report one size of a ``--sizes`` sweep."""

    def progress(self) -> None:
        """Say this worker moves on (inside a long step that reports nothing else, e.g. a
        sweep's fetches): the coordinator's progress deadline starts again. A multi-host
        run has no such deadline: nothing to send."""
        return None

    # -- key/value ---------------------------------------------------------------------------
    def publish(self, key: str, value: Any) -> None:
        """Publish ``value`` (JSON-able) as ``"<self.name>/<key>"``."""
        self._set(f"{self.name}/{key}", value)

    def wait(self, owner: str, key: str, timeout: float | None = None) -> Any:
        """The value ``owner`` published as ``key``; PeerFailure past ``timeout`` seconds
        (default: the run's ``--timeout``), or as soon as ``owner`` dies or the run aborts."""
        return self._get(f"{owner}/{key}", owner, self.config.timeout if timeout is None
                         else timeout)

    def peer_restarted(self, peer: str, incarnation: int, timeout: float) -> int | None:
        """After an operation with ``peer`` failed: the incarnation that replaced ``peer``'s
        ``incarnation`` when it died and was restarted under the same name, or None when it
        is alive (the failure was not its death) or no restart is possible. PeerFailure when
        the run aborts (it died for good). Waits at most ``timeout`` seconds."""
        return None

    # -- implementation ----------------------------------------------------------------------
    @abc.abstractmethod
    def _send_phase(self, phase: str) -> None: ...

    @abc.abstractmethod
    def _send_check(self, check: Check) -> None: ...

    @abc.abstractmethod
    def _send_fault(self, record: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def _set(self, key: str, value: Any) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str, owner: str, timeout: float) -> Any: ...

    @abc.abstractmethod
    def finish(self, error: str | None = None, data: dict[str, Any] | None = None) -> None:
        """Report the end of this worker: cleanly (``None``) or with a fatal ``error``
        (``data``: its facts as JSON values, e.g. :attr:`PeerFailure.data`)."""

    @abc.abstractmethod
    def close(self) -> None: ...


class SocketControl(Control):
    """Worker side of the coordinator connection (local runs).

    A reader thread dispatches replies and aborts; a heartbeat thread proves the process is
    alive (a process stopped or stuck while holding the GIL stops sending them). If the
    coordinator goes away the worker exits at once (there is nobody left to report to).
    """

    def __init__(self, sock: socket.socket, name: str, config: RunConfig,
                 incarnation: int = 1) -> None:
        super().__init__(name, config, incarnation)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._replies: dict[int, CoordinatorMessage] = {}
        self._abort: str | None = None
        self._next_id = 0
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, name="kvv-reader", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name="kvv-heartbeat", daemon=True)
        self._reader.start()
        self._beater.start()

    @classmethod
    def connect(cls, path: str, role: str, rank: int, info: dict[str, Any],
                timeout: float, standby: bool = False) -> SocketControl:
        """Connect to the coordinator at ``path``, say hello, receive the run config.

        A ``standby`` worker (started ahead of time to replace one that a ``restart-*``
        fault kills) is answered ``standby`` and then blocks until the coordinator sends the
        config, or closes the connection; it dies with the coordinator (PR_SET_PDEATHSIG)
        and is killed at the end of the run when it was not needed."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            creds = peer_credentials(sock)
            if creds.pid != os.getppid() or creds.uid != os.getuid():
                raise PeerFailure(f"the socket {path} is not served by our parent process "
                                  f"(peer pid {creds.pid} uid {creds.uid}, parent "
                                  f"{os.getppid()})")
            send_message(sock, {"op": "hello", "role": role, "rank": rank, "pid": os.getpid(),
                                "info": info, "standby": standby})
            reply = recv_json(sock, timeout=timeout)
            if standby and reply.get("op") == "standby":
                reply = recv_json(sock, timeout=None)  # bounded by the coordinator's life
            if reply.get("op") != "config":
                raise PeerFailure(f"coordinator answered hello with {reply.get('op')!r}: "
                                  f"{reply.get('message', '')}")
            config = RunConfig.from_json(reply["config"])
            incarnation = int(reply.get("incarnation", 1))
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        return cls(sock, f"{role}{rank}", config, incarnation)

    # -- sending ---------------------------------------------------------------------------
    def _send(self, msg: WorkerMessage) -> None:
        with self._send_lock:
            send_message(self._sock, msg)

    def _send_phase(self, phase: str) -> None:
        self._send({"op": "phase", "phase": phase})

    def _send_check(self, check: Check) -> None:
        self._send({"op": "check", "check": check.to_json()})

    def transfer(self, t: Transfer) -> None:
        self._send({"op": "transfer", "transfer": asdict(t)})

    def sweep(self, point: SweepPoint) -> None:
        self._send({"op": "sweep", "point": point.to_json()})

    def progress(self) -> None:
        self._send({"op": "progress"})

    def _send_fault(self, record: dict[str, Any]) -> None:
        self._send({"op": "fault", "fault": record})

    def _set(self, key: str, value: Any) -> None:
        self._send({"op": "set", "key": key, "value": value})

    def _get(self, key: str, owner: str, timeout: float) -> Any:
        reply = self._request({"op": "get", "key": key, "timeout": timeout}, timeout,
                              f"while waiting for {key}")
        if reply["op"] == "value":
            return reply["value"]
        raise PeerFailure(str(reply.get("message", "wait failed")))

    def peer_restarted(self, peer: str, incarnation: int, timeout: float) -> int | None:
        reply = self._request({"op": "peer", "peer": peer, "incarnation": incarnation,
                               "timeout": timeout}, timeout, f"while asking about {peer}")
        if reply["op"] != "value":
            raise PeerFailure(str(reply.get("message", "run aborted")), peer=peer,
                              cause="aborted")
        value = reply.get("value")
        return int(value) if isinstance(value, int) and value > incarnation else None

    def _request(self, msg: WorkerMessage, timeout: float, what: str) -> CoordinatorMessage:
        """Send ``msg`` with a fresh id; the coordinator's reply (``value`` or ``fail``)."""
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        self._send({**msg, "id": rid})
        # the coordinator enforces ``timeout`` with a better message; this is the backstop
        deadline = time.monotonic() + timeout + COORDINATOR_GRACE_S
        with self._cond:
            while rid not in self._replies:
                if self._abort is not None:
                    raise PeerFailure(self._abort)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerFailure(f"no answer from the coordinator within "
                                      f"{timeout + COORDINATOR_GRACE_S:.0f} s {what}",
                                      cause=COORDINATOR_SILENT)
                self._cond.wait(min(left, 0.5))
            return self._replies.pop(rid)

    def finish(self, error: str | None = None, data: dict[str, Any] | None = None) -> None:
        msg: WorkerMessage = {"op": "done"}
        if error is not None:
            msg = {"op": "error", "phase": self.current_phase, "message": error,
                   "data": dict(data or {})}
        try:
            self._send(msg)
        except OSError:
            pass

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=2)
        self._sock.close()

    # -- threads ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        while True:
            try:
                msg = recv_json(self._sock, timeout=None)
            except (IpcError, OSError, ValueError) as exc:
                if self._closing:
                    return
                # The coordinator is gone: nobody to report to, and it may not reap us.
                log.error("%s: lost the coordinator (%s); exiting", self.name, exc)
                os._exit(70)
            op = msg.get("op")
            with self._cond:
                if op in ("value", "fail"):
                    self._replies[int(msg.get("id", -1))] = cast(CoordinatorMessage, msg)
                elif op == "abort":
                    self._abort = str(msg.get("message", "run aborted by the coordinator"))
                self._cond.notify_all()

    def _beat_loop(self) -> None:
        while not self._closing:
            try:
                self._send({"op": "hb"})
            except OSError:
                return
            time.sleep(HEARTBEAT_S)
