"""The coordinator's account of ``--inject`` faults: when each fired, which check reported it
and how long that took, or how the run recovered from it.

A worker tells the coordinator the moment a fault fires (before it acts, on the same
monotonic clock: one host); every failing check that reaches the report afterwards is shown
to :meth:`FaultWatch.observe`, and the first that names the fault's worker (``data.worker``
or the check's own worker) with its role, rank and phase is the fault's report. At the end
:meth:`FaultWatch.finish` adds one ``fault/<spec>`` check per fault (did it fire, was it
reported naming the right side, rank and phase within the deadline, or did the run recover)
and the ``faults`` section of the report.

Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvconnect.verdicts import FAIL, PASS, Check

from ..faults import EXPECT_RECOVERY, FaultSpec, phase_kind
from ..report import Report

#: a fault must be reported within ``--timeout`` plus this (the stall watchdog's grace and
#: the coordinator's 0.1 s tick)
REPORT_GRACE_S = 2.0


@dataclass
class _Record:
    spec: FaultSpec
    fired_at: float | None = None
    in_phase: str | None = None
    report: dict[str, Any] | None = None
    reported_at: float | None = None
    restart: dict[str, Any] | None = None


class FaultWatch:
    """Faults of one local run. ``started``: the run's start (monotonic seconds)."""

    def __init__(self, specs: list[FaultSpec], timeout: float, started: float) -> None:
        self.records = [_Record(s) for s in specs]
        #: seconds from firing within which a fault must be reported
        self.deadline = timeout + REPORT_GRACE_S
        self.started = started

    def fired(self, worker: str, record: dict[str, Any]) -> _Record | None:
        """A worker says fault ``record["fault"]`` fires now (its ``at``: monotonic)."""
        for rec in self.records:
            if rec.spec.worker == worker and rec.spec.text == record.get("fault") \
                    and rec.fired_at is None:
                rec.fired_at = float(record.get("at", 0.0))
                rec.in_phase = str(record.get("in_phase", ""))
                return rec
        return None

    def observe(self, check: Check, now: float) -> None:
        """A check reached the report at ``now`` (monotonic)."""
        if check.status != FAIL:
            return
        data = check.data
        if not all(k in data for k in ("role", "rank", "phase")):
            return
        who = data.get("worker") or check.worker
        for rec in self.records:
            if rec.fired_at is None or rec.report is not None or rec.spec.worker != who:
                continue
            rec.report = {"check": check.name, "by": check.worker, "role": data["role"],
                          "rank": data["rank"], "phase": data["phase"],
                          "cause": data.get("cause")}
            rec.reported_at = now

    def restarted(self, worker: str, restart: dict[str, Any], now: float) -> None:
        """The coordinator replaced ``worker`` (a ``restart-*`` fault) at ``now``."""
        for rec in self.records:
            if rec.spec.worker == worker and rec.spec.fault.restarts and rec.restart is None:
                rec.restart = restart
                rec.reported_at = now

    def finish(self, report: Report) -> None:
        """Add a ``fault/<spec>`` check per fault and the report's ``faults`` section."""
        others_failed = [c for c in report.failed_checks if not c.name.startswith("fault/")]
        for rec in self.records:
            entry, problem = self._outcome(rec, others_failed)
            report.faults.append(entry)
            spec = rec.spec
            data = {"fault": spec.text, "role": spec.role, "rank": spec.rank,
                    "phase": spec.phase, "outcome": entry["outcome"],
                    "time_to_report_seconds": entry["time_to_report_seconds"]}
            report.add_check(f"fault/{spec.text}", FAIL if problem else PASS,
                             problem or entry["summary"], data=data)

    def _outcome(self, rec: _Record, others_failed: list[Check]
                 ) -> tuple[dict[str, Any], str]:
        spec, fault = rec.spec, rec.spec.fault
        entry: dict[str, Any] = {
            "fault": spec.text, "kind": spec.kind, "role": spec.role, "rank": spec.rank,
            "worker": spec.worker, "phase": spec.phase, "expect": fault.expect,
            "fired": rec.fired_at is not None, "fired_in_phase": rec.in_phase,
            "fired_at_seconds": (None if rec.fired_at is None
                                 else round(rec.fired_at - self.started, 3)),
            "reported_by": rec.report, "time_to_report_seconds": None,
            "deadline_seconds": self.deadline, "restart": rec.restart,
        }
        if rec.fired_at is None:
            entry.update(outcome="not_fired", summary="never fired")
            return entry, (f"--inject {spec.text} never fired: {spec.worker} did not enter a "
                           f"{spec.phase} phase (it failed, or the run ended, before)")
        if fault.expect == EXPECT_RECOVERY:
            if rec.reported_at is not None:  # the standby took over
                entry["time_to_report_seconds"] = round(rec.reported_at - rec.fired_at, 3)
            if rec.restart is None:
                entry.update(outcome="not_restarted", summary="not restarted")
                return entry, (f"--inject {spec.text} fired in {rec.in_phase} but "
                               f"{spec.worker} was not restarted")
            if others_failed:
                entry.update(outcome="recovery_failed", summary="recovery failed")
                return entry, (f"--inject {spec.text}: {spec.worker} was restarted, but the "
                               f"run did not recover: {len(others_failed)} checks failed "
                               f"(first: {others_failed[0].name})")
            entry.update(outcome="recovered", summary=(
                f"{spec.worker} killed in {rec.in_phase}, restarted as incarnation "
                f"{rec.restart.get('incarnation')}; the run recovered and passed"))
            return entry, ""
        if rec.report is None or rec.reported_at is None:
            entry.update(outcome="not_reported", summary="not reported")
            return entry, (f"--inject {spec.text} fired in {rec.in_phase} but no failing "
                           f"check named {spec.worker} with its role, rank and phase")
        took = rec.reported_at - rec.fired_at
        entry["time_to_report_seconds"] = round(took, 3)
        got = rec.report
        want_phase = fault.detected_in or spec.phase
        wrong = []
        if (got["role"], got["rank"]) != (spec.role, spec.rank):
            wrong.append(f"it names {got['role']} rank {got['rank']}")
        if phase_kind(str(got["phase"])) != want_phase:
            wrong.append(f"it names phase {got['phase']}, not a {want_phase} phase")
        if took > self.deadline:
            wrong.append(f"it came {took:.2f} s after the fault, past the deadline "
                         f"{self.deadline:g} s")
        summary = (f"fired in {rec.in_phase}; {got['check']} reported {spec.role} rank "
                   f"{spec.rank} in phase {got['phase']} ({got.get('cause') or 'failed'}) "
                   f"{took:.2f} s later")
        if wrong:
            entry.update(outcome="misreported", summary=summary)
            return entry, f"--inject {spec.text}: {summary}, but " + "; ".join(wrong)
        entry.update(outcome="reported", summary=summary)
        return entry, ""
