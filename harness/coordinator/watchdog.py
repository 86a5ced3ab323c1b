"""Who is to blame when a worker goes quiet: the coordinator's judgement of silence.

A worker proves it is alive with heartbeats (every 0.5 s, from their own thread) and that it
moves with messages (phases, checks, values published). The coordinator (:mod:`.event_loop`)
asks :func:`judge` about each running worker on every turn of its event loop:

- no heartbeat for the heartbeat limit and the process is not running: **unresponsive**
  (stopped, hung on a lock, deadlocked), with its process state;
- no heartbeat but the process is running (``R``) or in the kernel (``D``): **busy**, not
  hung: on a machine with more workers than cores a heartbeat thread can wait seconds for
  the CPU. Nothing is charged; the progress and wait deadlines still bound it;
- no progress outside a wait for ``--timeout`` + 1 s: **no_progress**.

:class:`StallClock` notices the coordinator's own stalls (SIGSTOP, a suspended VM, a
starved CPU): what workers sent meanwhile is still unread, so the coordinator moves every
watchdog and deadline on by the gap instead of blaming the first worker it looks at. A stall
longer than a worker waits for the coordinator's answer (its request's timeout +
``COORDINATOR_GRACE_S``) fails the run as the coordinator's (:meth:`StallClock.blame`): the
worker that gave up is not blamed.

Units: seconds (monotonic clock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .launch import proc_state
from .worker_records import LocalWorker

log = logging.getLogger(__name__)

#: the event loop turns every 0.1 s: a longer gap means the coordinator itself did not run
COORDINATOR_STALL_S = 1.0
#: process states of a worker that is busy, not hung: running (R) or in the kernel (D)
BUSY_STATES = ("R", "D")

UNRESPONSIVE = "unresponsive"
NO_PROGRESS = "no_progress"


@dataclass(frozen=True)
class Verdict:
    """Why a worker is failed: ``cause`` (:data:`UNRESPONSIVE` or :data:`NO_PROGRESS`),
    the seconds it was ``silent`` (no heartbeat) and ``idle`` (no progress), and its
    ``process_state`` (``/proc/PID/status``) when its heartbeats stopped."""

    cause: str
    silent: float
    idle: float
    process_state: str = ""


@dataclass
class Judge:
    """Judges running workers; remembers the busy ones it already said so about."""

    heartbeat_timeout: float
    progress_deadline: float
    _busy_noted: set[str] = field(default_factory=set)

    def __call__(self, w: LocalWorker, now: float) -> Verdict | None:
        """The verdict on running worker ``w`` at ``now``, or None while it is fine (or
        busy: see the module docstring)."""
        silent, idle = now - w.last_seen, now - w.last_progress
        if silent > self.heartbeat_timeout:
            state = proc_state(w.proc.pid)
            if not state.startswith(BUSY_STATES):
                return Verdict(UNRESPONSIVE, silent, idle, state)
            if w.name not in self._busy_noted:
                self._busy_noted.add(w.name)
                log.warning("%s sent no heartbeat for %.1f s but is running (%s): busy, "
                            "not hung; its progress deadline still applies", w.who, silent,
                            state)
        if w.waiting == 0 and idle > self.progress_deadline:
            return Verdict(NO_PROGRESS, silent, idle)
        return None


@dataclass
class StallClock:
    """Notices gaps between turns of the coordinator's loop longer than
    :data:`COORDINATOR_STALL_S`."""

    last: float
    stalls: list[float] = field(default_factory=list)

    def turn(self, now: float) -> float:
        """Seconds the coordinator did not run before this turn (0.0 when it ran)."""
        gap, self.last = now - self.last, now
        if gap <= COORDINATOR_STALL_S:
            return 0.0
        self.stalls.append(gap)
        log.warning("the coordinator did not run for %.1f s (stopped or starved of CPU); its "
                    "deadlines were moved on by that much", gap)
        return gap

    def blame(self, who: str, phase: str, message: str, wait_limit: float
              ) -> tuple[str, dict[str, Any]]:
        """The ``coordinator/stalls`` failure when worker ``who`` gave up in ``phase`` on an
        answer the coordinator owed it for ``wait_limit`` seconds (``message``: the worker's
        words): detail and data, naming the coordinator's stall (or, when none was measured,
        its silence) and the worker it stopped."""
        stalls = self.summary()
        if stalls:
            why = (f"the coordinator did not run for {stalls['max_seconds']:.1f} s (stopped or "
                   f"starved of CPU), longer than a worker waits for its answer "
                   f"({wait_limit:g} s)")
        else:
            why = f"the coordinator did not answer within {wait_limit:g} s"
        return (f"{why}: {who} gave up in phase {phase} ({message}); the failure is the "
                f"coordinator's, not the worker's",
                {**(stalls or {"count": 0}), "cause": "coordinator_stall",
                 "stopped_worker_phase": phase, "wait_limit_seconds": wait_limit})

    def summary(self) -> dict[str, Any] | None:
        """The ``coordinator/stalls`` check's data, None when there was none."""
        if not self.stalls:
            return None
        return {"count": len(self.stalls), "max_seconds": round(max(self.stalls), 3),
                "total_seconds": round(sum(self.stalls), 3)}
