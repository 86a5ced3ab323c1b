"""Multi-host runs: one process per worker, rendezvous through ``torch.distributed.TCPStore``.

Membership comes from ``--rendezvous HOST:PORT --role R --rank N`` or from the variables
torchrun / srun set (RANK or SLURM_PROCID, WORLD_SIZE or SLURM_NTASKS, MASTER_ADDR,
MASTER_PORT; global ranks ``0..N-1`` are prefill, ``N..N+M-1`` decode). Prefill rank 0 hosts
the store (unless torchrun's agent already does: TORCHELASTIC_USE_AGENT_STORE) and writes the
report of the whole run; every other process reports its own checks plus the final verdict.

Store values are JSON. Each process bumps a heartbeat counter every 0.5 s from its own store
connection; a waiter watches the counter of the peer it waits for, so a dead or stopped
peer is reported after ``heartbeat_timeout`` seconds with its last phase, and a failing
worker sets an ``abort`` key that ends every wait at once.

Local runs do not use a TCPStore: their coordinator's own table (:mod:`.event_loop`) is
kept on a measured reason (``benchmarks/bench_rendezvous.py``, docs/validate.md): an
all-to-all exchange of 16P16D took 2.8-3.0 s through it, 12-17 s through this module's
polling waits on a local TCPStore and 4.6-7.8 s with TCPStore's blocking ``wait``; and it
blames waits on workers, fails them on an abort, sees deaths by EOF and moves deadlines
when it stalled itself, which a store cannot.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kvconnect.checks import parse_whole_number
from kvconnect.verdicts import FAIL, PASS, Check

from ..config import DECODE, PREFILL, RunConfig, worker_name
from ..control import HEARTBEAT_S, Control, PeerFailure
from ..display import Display
from ..environment import EnvironmentProblem
from ..report import Report, SweepPoint, Transfer, signal_name
from ..rundir import run_dir
from .store_auth import (
    RendezvousRefused,
    Sealer,
    TamperedValue,
    authenticate_member,
    authenticate_reporter,
)

log = logging.getLogger(__name__)

PREFIX = "kvconnect-validate/"
#: config fields that legitimately differ between hosts
_LOCAL_FIELDS = ("device", "num_gpus", "local_device", "skipped_transports")
#: bound on one value read from the store (bytes)
MAX_VALUE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Membership:
    """Where this process fits: the store address, its role and rank within the role."""

    host: str
    port: int
    role: str
    rank: int
    num_prefill: int
    num_decode: int
    use_agent_store: bool = False
    local_rank: int | None = None
    #: the shared rendezvous token (:mod:`.store_auth`); never printed or reported
    token: bytes | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return worker_name(self.role, self.rank)

    @property
    def world_size(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def is_reporter(self) -> bool:
        return self.role == PREFILL and self.rank == 0

    @property
    def hosts_store(self) -> bool:
        return self.is_reporter and not self.use_agent_store


def parse_hostport(text: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> ``(host, port)``; ValueError if malformed."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host, parse_whole_number("the port", port, minimum=1, maximum=65535)


def membership_from_env(env: Mapping[str, str], num_prefill: int, num_decode: int,
                        ) -> Membership | None:
    """Membership from torchrun / srun variables, or None when they are not set."""
    rank = env.get("RANK", env.get("SLURM_PROCID"))
    world = env.get("WORLD_SIZE", env.get("SLURM_NTASKS"))
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if rank is None or world is None or addr is None or port is None:
        return None
    grank = parse_whole_number("RANK (or SLURM_PROCID)", rank, minimum=0)
    wsize = parse_whole_number("WORLD_SIZE (or SLURM_NTASKS)", world)
    p = parse_whole_number("MASTER_PORT", port, maximum=65535)
    if not 0 <= grank < wsize:
        raise ValueError(f"RANK {grank} is outside WORLD_SIZE {wsize}")
    if wsize != num_prefill + num_decode:
        raise ValueError(f"WORLD_SIZE {wsize} from the launcher does not match --prefill "
                         f"{num_prefill} + --decode {num_decode} = {num_prefill + num_decode}")
    role, r = (PREFILL, grank) if grank < num_prefill else (DECODE, grank - num_prefill)
    local = env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))
    return Membership(host=addr, port=p, role=role, rank=r, num_prefill=num_prefill,
                      num_decode=num_decode,
                      use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                      local_rank=int(local) if local is not None and local.isascii()
                      and local.isdigit() and len(local) < 7 else None)


class RendezvousUnreachable(EnvironmentProblem):
    """The TCPStore could not be hosted or reached within ``--timeout`` (exit code 3).
    ``cause``: ``unresolvable``, ``refused`` (nothing accepted a connection), ``no_answer``
    (something accepted but did not answer as a TCPStore) or ``error``."""

    def __init__(self, message: str, cause: str, waited: float) -> None:
        super().__init__(message)
        self.cause = cause
        self.waited = waited


def open_store(m: Membership, timeout: float, master: bool) -> Any:
    """A ``torch.distributed.TCPStore`` client (or the server, ``master``) within ``timeout``
    seconds, or :class:`RendezvousUnreachable` with one line saying why.

    TCPStore alone cannot keep that deadline: to a closed port it retries past its timeout and
    throws 40 lines of C++ frames; to a listener that never answers it blocks until the
    listener goes away. So a client first waits (retrying) until something accepts a TCP
    connection at the address, then builds the store in a helper thread and waits for it
    until the deadline. Past it the helper thread is abandoned (a daemon, blocked in C++; it
    ends when the listener goes away) and the process reports and exits.
    """
    from torch.distributed import TCPStore

    start = time.monotonic()
    deadline = start + timeout
    where = f"{m.host}:{m.port}"
    if not master:
        _wait_for_listener(m.host, m.port, start, deadline)

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            left = deadline - time.monotonic()
            box["store"] = TCPStore(m.host, m.port, world_size=None, is_master=master,
                                    timeout=datetime.timedelta(seconds=max(left, 0.1)),
                                    wait_for_workers=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    helper = threading.Thread(target=target, name="kvv-store-connect", daemon=True)
    helper.start()
    helper.join(max(0.0, deadline - time.monotonic()))
    waited = time.monotonic() - start
    if "store" in box:
        return box["store"]
    if "error" in box:
        what = "host the rendezvous store" if master else "join the rendezvous store"
        raise RendezvousUnreachable(f"cannot {what} at {where}: "
                                    f"{_first_line(box['error'])}", "error", waited) from None
    raise RendezvousUnreachable(
        f"{where} accepted a connection but did not answer as a TCPStore within --timeout "
        f"{timeout:g} s (is something else listening on that port?)", "no_answer", waited)


def _wait_for_listener(host: str, port: int, start: float, deadline: float) -> None:
    """Return once a TCP connection to ``host:port`` is accepted; retry refusals (the host
    may start later) until ``deadline`` (monotonic seconds)."""
    last = ""
    pause = 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousUnreachable(
                f"nothing accepted a connection at {host}:{port} within --timeout "
                f"{deadline - start:g} s ({last or 'no answer'}); is prefill rank 0 running "
                "and the address right?", "refused", time.monotonic() - start)
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return
        except socket.gaierror as exc:
            raise RendezvousUnreachable(f"cannot resolve the rendezvous host {host!r}: "
                                        f"{exc.strerror or exc}", "unresolvable",
                                        time.monotonic() - start) from None
        except OSError as exc:
            last = exc.strerror or str(exc)
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(pause * 2, 0.5)


def _first_line(exc: BaseException) -> str:
    """An exception's first line (torch's C++ errors append dozens of stack frames)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class StoreControl(Control):
    """:class:`~.control.Control` over a TCPStore (see the module docstring)."""

    def __init__(self, name: str, config: RunConfig, store: Any,
                 store_factory: Callable[[], Any], display: Display,
                 sealer: Sealer | None = None) -> None:
        super().__init__(name, config)
        self.store = store
        #: seals what this process writes and checks what it reads (with a token)
        self.sealer = sealer or Sealer()
        self.display = display
        self.checks: list[Check] = []
        self.transfers: list[Transfer] = []
        self.sweep_points: list[SweepPoint] = []
        #: this process's own fatal error as a check (set by :meth:`finish`)
        self.failure: Check | None = None
        self._closing = False
        self._hb_store = store_factory()
        self._beater = threading.Thread(target=self._beat_loop, daemon=True, name="kvv-hb")
        self._beater.start()

    # -- Control --------------------------------------------------------------------------------
    def _send_phase(self, phase: str) -> None:
        self.store.set(PREFIX + f"phase/{self.name}", phase)
        self.display.phase(self.name, phase)

    def _send_check(self, check: Check) -> None:
        self.checks.append(check)
        self.display.check(check)

    def transfer(self, t: Transfer) -> None:
        self.transfers.append(t)
        self.display.transfer(t)

    def sweep(self, point: SweepPoint) -> None:
        self.sweep_points.append(point)

    def _send_fault(self, record: dict[str, Any]) -> None:
        """A multi-host run has no coordinator to time the report: the fault is logged and
        shown; the failure it causes is reported as usual."""
        self.display.message(f"{self.name}: --inject {record['fault']} fires in phase "
                             f"{record['in_phase']}")

    def _set(self, key: str, value: Any) -> None:
        self.put_raw("kv/" + key, json.dumps(value))

    def put_raw(self, key: str, text: str) -> None:
        """Set store key ``PREFIX + key`` to ``text`` (sealed with a token)."""
        self.store.set(PREFIX + key, self.sealer.seal(PREFIX + key, text))

    def _open(self, key: str, raw: bytes, owner: str) -> str:
        try:
            return self.sealer.open(key, raw)
        except TamperedValue as exc:
            raise PeerFailure(f"{exc} (expected from {owner})", peer=owner,
                              cause="tampered") from None

    def _get(self, key: str, owner: str, timeout: float) -> Any:
        return self.get_raw("kv/" + key, owner, timeout, what=repr(key))

    def get_raw(self, key: str, owner: str, timeout: float, what: str) -> Any:
        """Wait for store key ``PREFIX + key`` published by ``owner`` (JSON)."""
        full = PREFIX + key
        deadline = time.monotonic() + timeout
        last_hb: int | None = None
        changed = time.monotonic()
        pause = 0.02
        try:
            while True:
                if self.store.check([full]):
                    raw = self.store.get(full)
                    if len(raw) > MAX_VALUE_BYTES:
                        raise PeerFailure(f"{owner} published {len(raw)} bytes for {what}, over "
                                          f"the {MAX_VALUE_BYTES}-byte limit", peer=owner,
                                          cause="oversized")
                    return json.loads(self._open(full, raw, owner))
                if self.store.check([PREFIX + "abort"]):
                    text = self._open(PREFIX + "abort", self.store.get(PREFIX + "abort"),
                                      "a member")
                    raise PeerFailure("run aborted: " + text, cause="aborted")
                now = time.monotonic()
                hb = int(self.store.add(PREFIX + f"hb/{owner}", 0))
                if hb != last_hb:
                    last_hb, changed = hb, now
                elif hb > 0 and now - changed > self.config.heartbeat_timeout:
                    phase = self.peer_phase(owner)
                    raise PeerFailure(
                        f"{owner} stopped responding in phase {phase}: no "
                        f"heartbeat for {now - changed:.1f} s (died or hung) while "
                        f"{self.name} waited in phase {self.current_phase} for {what}",
                        peer=owner, peer_phase=phase, cause="unresponsive")
                if now > deadline:
                    state = self.peer_phase(owner) if hb > 0 else "never started"
                    raise PeerFailure(f"{self.name} timed out after {timeout:g} s in phase "
                                      f"{self.current_phase} waiting for {owner}'s {what} "
                                      f"({owner}: {state})", peer=owner, peer_phase=state,
                                      cause="wait_timeout")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.2)
        except PeerFailure:
            raise
        except (RuntimeError, OSError) as exc:  # DistStoreError, connection reset
            raise PeerFailure(f"lost the rendezvous store while waiting for {owner}'s {what} "
                              f"(its host, prefill0, may have died): {exc}", peer=owner,
                              cause="store_lost") from exc

    def peer_phase(self, owner: str) -> str:
        try:
            if self.store.check([PREFIX + f"phase/{owner}"]):
                return self.store.get(PREFIX + f"phase/{owner}").decode()
        except (RuntimeError, OSError):
            pass
        return "unknown"

    def finish(self, error: str | None = None, data: dict[str, Any] | None = None) -> None:
        if error is not None:
            self.failure = Check(f"worker/{self.name}", FAIL, f"{self.name} failed in phase "
                                 f"{self.current_phase}: {error}", self.name,
                                 data={"phase": self.current_phase, **(data or {})})
        result = {"checks": [c.to_json() for c in self.checks],
                  "transfers": [asdict(t) for t in self.transfers],
                  "sweep": [p.to_json() for p in self.sweep_points],
                  "phase": self.current_phase, "error": error,
                  "failure": self.failure.to_json() if self.failure is not None else None}
        try:
            if error is not None:
                text = (f"{self.name} failed in phase {self.current_phase}: "
                        f"{error.splitlines()[0] if error else ''}")
                self.store.compare_set(PREFIX + "abort", "",
                                       self.sealer.seal(PREFIX + "abort", text))
            self.put_raw(f"result/{self.name}", json.dumps(result))
        except (RuntimeError, OSError) as exc:
            log.error("%s: cannot publish the result: %s", self.name, exc)

    def close(self) -> None:
        self._closing = True
        self._beater.join(timeout=2)

    def _beat_loop(self) -> None:
        key = PREFIX + f"hb/{self.name}"
        while not self._closing:
            try:
                self._hb_store.add(key, 1)
            except (RuntimeError, OSError):
                return
            time.sleep(HEARTBEAT_S)


def run_member(cfg: RunConfig, m: Membership, report: Report, display: Display) -> None:
    """Run this process's worker of a multi-host run; the reporter gathers everyone's
    results into ``report``."""
    cfg.local_device = cfg.device_for(m.role, m.rank, local_index=m.local_rank)
    display.worker(m.name, os.getpid(), cfg.device_for(m.role, m.rank))
    store, sealer = _join(cfg, m, report)
    try:
        ctl = StoreControl(m.name, cfg, store, lambda: open_store(m, cfg.timeout, master=False),
                           display, sealer)
    except RendezvousUnreachable as exc:
        report.add_check("rendezvous", FAIL, f"heartbeat connection: {exc}", worker=m.name,
                         data={"cause": exc.cause, "host": m.host, "port": m.port})
        raise
    try:
        _work(ctl, cfg, m, report)
    except KeyboardInterrupt as exc:  # SIGINT / SIGTERM (kvconnect.interrupts)
        signum = getattr(exc, "signum", signal.SIGINT)
        report.interrupt(signum, "run", {m.name: ctl.current_phase})
        ctl.finish(error=f"interrupted by {signal_name(signum)}")  # the others stop too
    finally:
        ctl.close()
        report.workers.append({"name": m.name, "role": m.role, "rank": m.rank,
                               "pid": os.getpid(), "device": cfg.device_for(m.role, m.rank),
                               "phase": ctl.current_phase})


def _join(cfg: RunConfig, m: Membership, report: Report) -> tuple[Any, Sealer]:
    """Host or reach the store, and prove the rendezvous token (:mod:`.store_auth`); the
    store and the sealer of its values. The ``rendezvous`` check says how it went (failed:
    :class:`RendezvousUnreachable` or :class:`RendezvousRefused`)."""
    try:
        store = open_store(m, cfg.timeout, master=m.hosts_store)
    except RendezvousUnreachable as exc:
        report.add_check("rendezvous", FAIL, str(exc), worker=m.name,
                         data={"cause": exc.cause, "host": m.host, "port": m.port,
                               "waited_seconds": round(exc.waited, 3),
                               "timeout": cfg.timeout})
        raise
    where = f"{m.host}:{m.port}"
    try:
        if m.is_reporter:
            others = [n for n in cfg.worker_names() if n != m.name]
            sealer = authenticate_reporter(store, PREFIX, m.token, others, where, cfg.timeout)
        else:
            sealer = authenticate_member(store, PREFIX, m.token, m.name, where, cfg.timeout)
    except RendezvousRefused as exc:
        report.add_check("rendezvous", FAIL, str(exc), worker=m.name,
                         data={"cause": exc.cause, "host": m.host, "port": m.port,
                               "token": m.token is not None})
        raise
    except (RuntimeError, OSError) as exc:  # the store went away during the check
        raise RendezvousUnreachable(f"rendezvous at {where}: lost the store during the token "
                                    f"check: {_first_line(exc)}", "error", 0.0) from None
    if sealer.active:
        report.add_check("rendezvous", PASS, f"every member proved the rendezvous token "
                                             f"(HMAC-SHA256 over fresh nonces) at {where}; store "
                                             "values are sealed", worker=m.name,
                         data={"cause": None, "host": m.host, "port": m.port, "token": True})
    return store, sealer


def _work(ctl: StoreControl, cfg: RunConfig, m: Membership, report: Report) -> None:
    """Agree on the config, run this worker's steps, then gather everyone's results (the
    reporter) or wait for the verdict."""
    from kvconnect.connectors.registry import get_transport

    from ..environment import describe
    from ..worker.process import run_and_report

    # only a prefill serving a transport that needs one makes a socket directory (a killed
    # process cannot remove its own, so nobody else makes one)
    serves_sockets = m.role == PREFILL and any(
        get_transport(t).needs_directory for t in cfg.transports)
    with run_dir() if serves_sockets else contextlib.nullcontext("") as ipc_dir:
        if not _agree_on_config(ctl, cfg, m, report):
            ctl.finish(error="configuration differs between processes")
            return
        ctl.publish("info", {"pid": os.getpid(), **describe()})
        run_and_report(ctl, m.role, m.rank, ipc_dir)
        report.checks.extend(ctl.checks)
        if ctl.failure is not None:
            report.checks.append(ctl.failure)
        report.transfers.extend(ctl.transfers)
        report.sweep.extend(ctl.sweep_points)
        if m.is_reporter:
            _gather(ctl, cfg, m, report)
        else:
            _await_verdict(ctl, cfg, m, report)


def _agree_on_config(ctl: StoreControl, cfg: RunConfig, m: Membership, report: Report) -> bool:
    """The reporter publishes its config; every other member compares its own with it and
    says ``config_ok``. Nobody starts before every member agreed: the reporter waits for
    each ``config_ok``, so its footprint baseline (taken as its steps begin) already holds
    the store connections every member opened on joining (the store may live in the
    reporter's process: a member joining late once showed up there as leaked sockets)."""
    mine = {k: v for k, v in cfg.to_json().items() if k not in _LOCAL_FIELDS}
    if m.is_reporter:
        ctl.publish("config", mine)
        for name in cfg.worker_names():
            if name == m.name:
                continue
            try:
                ctl.wait(name, "config_ok")
            except PeerFailure as exc:
                report.usage_error = f"{name} did not agree on the configuration: {exc}"
                return False
        return True
    theirs = ctl.wait(worker_name(PREFILL, 0), "config")
    diffs = [f"{k}: here {mine.get(k)!r}, prefill0 {theirs.get(k)!r}"
             for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if diffs:
        report.usage_error = (f"{m.name}'s arguments differ from prefill0's: "
                              + "; ".join(diffs))
        return False
    ctl.publish("config_ok", True)
    return True


def _gather(ctl: StoreControl, cfg: RunConfig, m: Membership, report: Report) -> None:
    others = [n for n in cfg.worker_names() if n != m.name]
    for name in others:
        ctl.phase(f"gather:{name}")
        try:
            info = ctl.wait(name, "info", timeout=cfg.timeout)
            report.workers.append({"name": name, **{k: info.get(k) for k in
                                                    ("pid", "hostname", "boot_id", "device")}})
            result = ctl.get_raw(f"result/{name}", name, cfg.timeout * 4, what="result")
        except PeerFailure as exc:
            report.add_check(f"worker/{name}", FAIL, str(exc), data=exc.data)
            continue
        report.checks.extend(Check.from_json(c) for c in result.get("checks", []))
        report.transfers.extend(Transfer.from_json(t) for t in result.get("transfers", []))
        report.sweep.extend(SweepPoint.from_json(p) for p in result.get("sweep", []))
        if isinstance(result.get("failure"), dict):
            report.checks.append(Check.from_json(result["failure"]))
        elif result.get("error"):
            report.add_check(f"worker/{name}", FAIL, f"{name} failed in phase "
                                                     f"{result.get('phase')}: {result['error']}",
                             worker=name)
    verdict = {"passed": report.passed and not report.failed_checks, "summary": report.summary()}
    ctl.put_raw("final", json.dumps(verdict))
    # keep the store (hosted here) up until everyone has read the verdict
    for name in others:
        try:
            ctl.get_raw(f"bye/{name}", name, min(10.0, cfg.timeout), what="goodbye")
        except PeerFailure:
            pass


def _await_verdict(ctl: StoreControl, cfg: RunConfig, m: Membership, report: Report) -> None:
    reporter = worker_name(PREFILL, 0)
    ctl.phase("await_verdict")
    try:
        verdict = ctl.get_raw("final", reporter, cfg.timeout * 4, what="final verdict")
    except PeerFailure as exc:
        report.add_check("run/verdict", FAIL, str(exc))
        return
    finally:
        try:
            ctl.put_raw(f"bye/{m.name}", "1")
        except (RuntimeError, OSError):
            pass
    report.add_check("run/verdict", PASS if verdict.get("passed") else FAIL,
                     f"{reporter} reports for the whole run: {verdict.get('summary')}",
                     worker=m.name)
