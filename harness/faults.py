"""Injected faults: ``kvconnect-validate --inject FAULT@PHASE`` (repeatable).

A fault is a :class:`FaultKind` from a small registry (``kill-prefill``, ``stop-decode``,
``drop-notification``, ...) aimed at one worker and one *fault phase*. It fires once, in the
worker itself, when that worker enters a phase whose kind (the first ``:``-separated part
of its phase name, e.g. ``transfer`` in ``transfer:ipc:prefill0:round1``) is the fault
phase: :meth:`FaultPlan.at_phase`, called by :meth:`.control.Control.phase` (the one hook).
Before acting the worker tells the run that the fault fired (so the coordinator can time
how long the run takes to report it, :mod:`.faultwatch`).

Syntax: ``KIND[RANK]@PHASE``: ``kill-decode@transfer`` targets decode rank 0,
``kill-decode1@transfer`` decode rank 1. Imported by the coordinator (parsing, checks) and
by worker processes (firing), so it imports nothing else from the harness but the config's
role names.

Units: seconds.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvconnect.errors import KvconnectError

from .config import DECODE, PREFILL

log = logging.getLogger(__name__)

#: the phases a fault can be aimed at, and where each really happens (worker phase kinds)
PHASES: dict[str, str] = {
    "handshake": "prefill: publishes its offers (IPC socket, NIXL metadata); decode: loads a "
                 "prefill's offers (IPC mapping, NIXL remote agent)",
    "register": "both: NIXL registration of the committed KV cache",
    "transfer": "prefill: offers published, decodes reading its blocks; decode: one "
                "transport's fetch",
    "notification": "prefill: collects the NIXL READ completion notifications; decode: tells "
                    "the prefills it finished the round",
    "sleep": "both: NIXL deregistration and release of the cache's physical memory",
    "wake": "both: recommit, refill, NIXL re-registration",
}

#: the order in which every worker first enters each fault phase: a fault that ends a worker
#: at one of them comes before whatever is aimed at a later one
PHASE_ORDER = ("register", "handshake", "transfer", "notification", "sleep", "wake")

#: what a fault is expected to do to the run
EXPECT_FAILURE = "fail"  # the run fails (exit 1), naming the worker, its rank and phase
EXPECT_RECOVERY = "recover"  # the run recovers and passes (exit 0)


def phase_kind(phase: str) -> str:
    """``transfer`` for ``transfer:ipc:prefill0:round1``: what a fault phase matches."""
    return phase.split(":", 1)[0]


@dataclass
class FaultEffects:
    """What a fired fault changes inside a worker beyond its process state; read by the
    worker's steps. ``drop_notifications``: discard every NIXL completion notification
    received from now on (as if lost on the way)."""

    drop_notifications: bool = False


class FaultTarget(Protocol):
    """What a fault acts on and reports through: a worker's :class:`~.control.Control`."""

    effects: FaultEffects

    @property
    def stall_seconds(self) -> float: ...

    def fault_fired(self, spec: FaultSpec, phase: str) -> None: ...


def _kill(target: FaultTarget) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stop(target: FaultTarget) -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def _stall(target: FaultTarget) -> None:
    """Alive (heartbeats go on) but making no progress for longer than any deadline."""
    time.sleep(target.stall_seconds)


def _drop_notifications(target: FaultTarget) -> None:
    target.effects.drop_notifications = True


@dataclass(frozen=True)
class FaultKind:
    """One kind of fault. ``role``: the side it targets; ``action``: what it does in that
    worker when it fires; ``expect``: :data:`EXPECT_FAILURE` or :data:`EXPECT_RECOVERY`;
    ``not_applicable``: fault phases where it cannot happen, with why; ``detected_in``: the
    phase kind where the run notices it, when that is not the fault phase itself;
    ``needs_notices``: needs a transport whose fetches notify the serving worker
    (``TransportSpec.notifies_exporter``, e.g. nixl); ``local_only``: needs a coordinator
    (local runs)."""

    name: str
    role: str
    action: Callable[[FaultTarget], None]
    description: str
    expect: str = EXPECT_FAILURE
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    detected_in: str | None = None
    needs_notices: bool = False
    local_only: bool = False
    #: the coordinator starts a replacement under the same name after this fault
    restarts: bool = False
    #: the worker's incarnation ends when it fires (killed, stopped, stalled past every
    #: deadline): nothing else aimed at that worker fires after it
    ends_worker: bool = False


FAULT_KINDS: dict[str, FaultKind] = {}


def register_fault(kind: FaultKind) -> None:
    """Add ``kind`` to the registry (ValueError when the name is taken)."""
    if kind.name in FAULT_KINDS:
        raise ValueError(f"fault {kind.name!r} is already registered")
    if kind.role not in (PREFILL, DECODE):
        raise ValueError(f"fault {kind.name!r}: role must be {PREFILL} or {DECODE}")
    unknown = set(kind.not_applicable) - set(PHASES)
    if unknown:
        raise ValueError(f"fault {kind.name!r}: unknown phases {sorted(unknown)}")
    FAULT_KINDS[kind.name] = kind


for _role in (PREFILL, DECODE):
    register_fault(FaultKind(f"kill-{_role}", _role, _kill,
                             f"SIGKILL the {_role} worker (a crash, the OOM killer)",
                             ends_worker=True))
    register_fault(FaultKind(f"stop-{_role}", _role, _stop,
                             f"SIGSTOP the {_role} worker (a hang: no heartbeat, no progress)",
                             ends_worker=True))
register_fault(FaultKind(
    "slow-prefill", PREFILL, _stall,
    "the prefill stalls (alive, heartbeating) for 3 x --timeout: longer than any deadline",
    ends_worker=True))
_NO_NOTIFICATION = ("no NIXL READ completion notification is in flight while the prefill is "
                    "in its {phase} phase (they arrive while decodes read, and are collected "
                    "in the notification phase)")
register_fault(FaultKind(
    "drop-notification", PREFILL, _drop_notifications,
    "the prefill loses (discards) every NIXL READ completion notification it receives from "
    "that phase on",
    not_applicable={p: _NO_NOTIFICATION.format(phase=p)
                    for p in ("handshake", "register", "sleep", "wake")},
    detected_in="notification", needs_notices=True))
register_fault(FaultKind(
    "restart-prefill", PREFILL, _kill,
    "SIGKILL the prefill, then the coordinator starts a new one under the same name: "
    "decodes must re-handshake and fetch again, without restarting",
    expect=EXPECT_RECOVERY, local_only=True, restarts=True, ends_worker=True))


class FaultSpecError(KvconnectError, ValueError):
    """A ``--inject`` value that cannot work (exit code 2)."""


@dataclass(frozen=True)
class FaultSpec:
    """One ``--inject`` value: fault ``kind`` aimed at ``role`` ``rank`` in ``phase``."""

    kind: str
    rank: int
    phase: str

    @property
    def fault(self) -> FaultKind:
        return FAULT_KINDS[self.kind]

    @property
    def role(self) -> str:
        return self.fault.role

    @property
    def worker(self) -> str:
        return f"{self.role}{self.rank}"

    @property
    def text(self) -> str:
        """The canonical spelling: ``kill-decode@transfer``, ``kill-decode1@transfer``."""
        return f"{self.kind}{self.rank or ''}@{self.phase}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "rank": self.rank, "phase": self.phase}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> FaultSpec:
        spec = cls(str(obj["kind"]), int(obj["rank"]), str(obj["phase"]))
        if spec.kind not in FAULT_KINDS or spec.phase not in PHASES or spec.rank < 0:
            raise ValueError(f"malformed fault {dict(obj)!r}")
        return spec


_SPEC = re.compile(r"^(?P<kind>[a-z]+(?:-[a-z]+)*?)(?P<rank>[0-9]{0,6})@(?P<phase>[a-z]+)$")


def parse_fault(text: str) -> FaultSpec:
    """``"kill-decode@transfer"`` -> FaultSpec; :class:`FaultSpecError` naming the known
    faults and phases otherwise."""
    m = _SPEC.match(text.strip().lower())
    known = (f"faults: {', '.join(FAULT_KINDS)} (append a rank, e.g. kill-decode1); "
             f"phases: {', '.join(PHASES)}")
    if m is None:
        raise FaultSpecError(f"--inject {text!r}: expected FAULT@PHASE, e.g. "
                             f"kill-decode@transfer; {known}")
    kind, rank, phase = m["kind"], m["rank"], m["phase"]
    if kind not in FAULT_KINDS:
        raise FaultSpecError(f"--inject {text!r}: unknown fault {kind!r}; {known}")
    if phase not in PHASES:
        raise FaultSpecError(f"--inject {text!r}: unknown phase {phase!r}; {known}")
    spec = FaultSpec(kind, int(rank) if rank else 0, phase)
    why = spec.fault.not_applicable.get(phase)
    if why:
        raise FaultSpecError(f"--inject {text}: {kind} does not apply to {phase}: {why}")
    return spec


def check_faults(specs: Sequence[FaultSpec], num_prefill: int, num_decode: int,
                 multi_host: bool) -> None:
    """Refuse (:class:`FaultSpecError`) faults aimed at workers that do not exist, the same
    fault twice, faults that need a coordinator in a multi-host run, and combinations in
    which a fault can never fire (:func:`_check_reachable`)."""
    seen: set[FaultSpec] = set()
    for spec in specs:
        count = num_prefill if spec.role == PREFILL else num_decode
        if spec.rank >= count:
            raise FaultSpecError(f"--inject {spec.text}: there is no {spec.worker} "
                                 f"(--{spec.role} {count}: ranks 0..{count - 1})")
        if spec in seen:
            raise FaultSpecError(f"--inject {spec.text} is given twice")
        seen.add(spec)
        if multi_host and spec.fault.local_only:
            raise FaultSpecError(f"--inject {spec.text}: needs a local run (the coordinator "
                                 "starts the replacement); not available with --rendezvous")
    _check_reachable(specs)


def _check_reachable(specs: Sequence[FaultSpec]) -> None:
    """Refuse a fault that another one prevents from ever firing.

    - A fault that ends its worker (kill, stop, slow, restart) at phase P: nothing else aimed
      at that worker in P or a later phase fires (the worker is gone; a restarted worker
      carries no fault: it replaces a worker once).
    - One that also fails the run (kill, stop, slow) aborts every worker: nothing aimed at
      P or a later phase fires anywhere.
    """
    def order(s: FaultSpec) -> int:
        return PHASE_ORDER.index(s.phase)

    for first in sorted(specs, key=order):
        if not first.fault.ends_worker:
            continue
        aborts = first.fault.expect == EXPECT_FAILURE
        for other in specs:
            if other is first or order(other) < order(first):
                continue
            if other.worker == first.worker or aborts:
                why = (f"{first.text} ends {first.worker} first" if other.worker == first.worker
                       else f"{first.text} fails the run first (every worker is stopped)")
                hint = (" (a restarted worker carries no fault: restart-* replaces a worker "
                        "once)" if first.fault.restarts else "")
                raise FaultSpecError(
                    f"--inject {other.text} can never fire: {why}, in its {first.phase} "
                    f"phase, which comes before or with {other.phase} (phases in order: "
                    f"{', '.join(PHASE_ORDER)}){hint}; inject them in separate runs")


def missing_transports(specs: Sequence[FaultSpec], transports: Sequence[str]) -> list[str]:
    """One message per fault that needs a kind of transport this run does not use."""
    if not any(s.fault.needs_notices for s in specs):
        return []
    from kvconnect.connectors.registry import get_transport, transport_names

    if any(get_transport(t).notifies_exporter for t in transports):
        return []
    notifying = [t for t in transport_names() if get_transport(t).notifies_exporter]
    return [f"--inject {s.text} needs a transport whose fetches notify the prefill "
            f"({', '.join(notifying) or 'none registered'}; --transports "
            f"{','.join(transports)})" for s in specs if s.fault.needs_notices]


class FaultPlan:
    """The faults aimed at one worker; each fires once, at the first phase of its kind.
    A replacement (``incarnation`` > 1) fires none: the fault already happened."""

    def __init__(self, specs: Sequence[FaultSpec], worker: str, incarnation: int = 1) -> None:
        self.pending = [s for s in specs if s.worker == worker] if incarnation == 1 else []

    def at_phase(self, phase: str, target: FaultTarget) -> None:
        kind = phase_kind(phase)
        due = [s for s in self.pending if s.phase == kind]
        for spec in due:
            self.pending.remove(spec)
            log.warning("--inject %s fires in phase %s", spec.text, phase)
            target.fault_fired(spec, phase)
            spec.fault.action(target)


def specs_from_config(faults: Sequence[Mapping[str, Any]]) -> list[FaultSpec]:
    """The run config's ``faults`` (JSON) as specs."""
    return [FaultSpec.from_json(f) for f in faults]


def restarted_workers(faults: Sequence[Mapping[str, Any]]) -> set[str]:
    """Names of the workers the run config's ``faults`` have restarted (``restart-*``)."""
    return {s.worker for s in specs_from_config(faults) if s.fault.restarts}
