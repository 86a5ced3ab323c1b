"""Restarting a worker a ``restart-*`` fault killed: the coordinator's half of recovery.

:class:`Restarts` is a part of :class:`~.event_loop.Coordinator` (a mixin, to keep each
file readable in one sitting): when a restartable worker dies, its standby (started with the
others, so no torch import is needed then) takes over under the same name as the next
incarnation; decodes asking after the dead worker (``peer`` requests) learn that it was
replaced and fetch again. What it uses of the coordinator: :class:`~.part.CoordinatorPart`.
"""

from __future__ import annotations

import logging
import time

from kvconnect.child import exit_signal_name
from kvconnect.framing import send_message
from kvconnect.verdicts import PASS

from .part import CoordinatorPart
from .worker_records import LocalWorker

log = logging.getLogger("kvconnect.harness.coordinator.event_loop")


class Restarts(CoordinatorPart):
    """Worker replacement after ``restart-*`` faults (see the module docstring)."""

    def _restart(self, dead: LocalWorker, how: str) -> bool:
        """Replace ``dead`` by its standby under the same name: drop the keys it published,
        hand the standby the config as the next incarnation. False when no standby can."""
        standby = next((x for x in self.workers if x.name == dead.name
                        and x.state == "standby"), None)
        if standby is None or standby.sock is None or standby.proc.poll() is not None:
            return False
        self.restartable.discard(dead.name)
        dead.state = "dead"
        dead.replaced = True
        for key in [k for k in self.store if k.startswith(dead.name + "/")]:
            del self.store[key]
        for wt in [wt for wt in self.waiters if wt.worker is dead]:
            self.waiters.remove(wt)
        self.peer_queries = [q for q in self.peer_queries if q.worker is not dead]
        try:
            send_message(standby.sock, {"op": "config", "config": self.cfg.to_json(),
                                        "incarnation": standby.incarnation})
        except OSError as exc:
            log.warning("the standby of %s cannot take over: %s", dead.name, exc)
            dead.replaced = False
            return False
        self._running(standby)
        self.display.worker(standby.name, standby.proc.pid, standby.device)
        code = dead.proc.returncode
        record = {"worker": dead.name, "role": dead.role, "rank": dead.rank,
                  "phase": dead.phase, "cause": "died", "exit_code": code,
                  "signal": exit_signal_name(code), "old_pid": dead.proc.pid,
                  "new_pid": standby.proc.pid, "incarnation": standby.incarnation,
                  "at_seconds": round(time.monotonic() - self.watch.started, 3)}
        self.report.recovery.append(record)
        self.watch.restarted(dead.name, record, time.monotonic())
        self._add_check(f"restart/{dead.name}", PASS,
                        f"{dead.who} died in phase {dead.phase} ({how}); its standby (pid "
                        f"{standby.proc.pid}) took over as incarnation {standby.incarnation}",
                        data=record)
        self.display.message(f"{dead.name} died in phase {dead.phase} ({how}): restarted as "
                             f"incarnation {standby.incarnation}, pid {standby.proc.pid}")
        return True

    def _current(self, name: str) -> LocalWorker | None:
        """The worker running under ``name`` now (the latest incarnation that started)."""
        found = [w for w in self.workers if w.name == name and w.state != "standby"]
        return max(found, key=lambda w: w.incarnation) if found else None

    def _answer_peer_queries(self) -> None:
        """Answer ``peer`` requests: the replacing incarnation as soon as there is one; None
        once the grace passed with the peer alive (or a peer no restart can replace);
        ``fail`` after an abort."""
        now = time.monotonic()
        keep = []
        for q in self.peer_queries:
            current = self._current(q.peer)
            if self.aborted is not None:
                self._reply(q.worker, {"op": "fail", "id": q.rid, "message": self.aborted})
            elif current is not None and current.incarnation > q.incarnation:
                self._reply(q.worker, {"op": "value", "id": q.rid,
                                       "value": current.incarnation})
            elif current is None or now >= q.answer_by or (
                    current.finished and q.peer not in self.restartable):
                self._reply(q.worker, {"op": "value", "id": q.rid, "value": None})
            else:
                keep.append(q)
                continue
            q.worker.last_progress = now
        self.peer_queries = keep
