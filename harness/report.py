"""The result of a validation run: checks (:class:`kvconnect.verdicts.Check`), transfers,
environment; JSON and JUnit output.

A :class:`Report` is filled by the coordinator as workers send their results, then written
as JSON (``--json``), JUnit XML (``--junit``) and a final table (see :mod:`.display`).

Units: ``bytes`` are bytes, ``seconds`` are wall seconds, ``gbps`` is 1e9 bytes per second
(:func:`kvconnect.units.gbps`: 0.0 at zero seconds).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Any

from kvconnect.child import signal_name
from kvconnect.units import gbps
from kvconnect.verdicts import CHECK_STATUSES, FAIL, PASS, SKIP, Check

from .report_files import write_report

#: identifies the JSON layout; bump when a field changes meaning
SCHEMA = "kvconnect-validate/1"

#: exit codes of ``kvconnect-validate``; a run stopped by a signal exits ``128 + signal``
#: (130 after SIGINT, 143 after SIGTERM), as a shell reports a process the signal killed
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_ENVIRONMENT = 3
EXIT_SIGNAL_BASE = 128


@dataclass
class Transfer:
    """One measured transfer of ``blocks`` KV blocks (``bytes`` in total) over one transport.

    ``transport`` is a registered transport's name; ``backend`` says what carried it
    underneath (e.g. ``UCX`` for NIXL, ``copy:cpu`` for the IPC copy). ``gbps`` follows
    :func:`kvconnect.units.gbps` (0.0 at zero seconds). ``round`` 1 is before sleep/wake,
    2 after. ``verified`` is True only when every block's digest matched.
    """

    pair: str
    transport: str
    bytes: int
    seconds: float
    gbps: float
    verified: bool
    backend: str = ""
    round: int = 1
    blocks: int = 0
    #: same-run reference: GB/s of one contiguous torch copy of the same bytes between
    #: ordinary allocations on the same two devices (None where it was not measured)
    reference_gbps: float | None = None

    @classmethod
    def measured(cls, pair: str, transport: str, nbytes: int, seconds: float, verified: bool,
                 **extra: Any) -> Transfer:
        """Build a transfer, computing ``gbps`` from ``nbytes`` and ``seconds``."""
        return cls(pair=pair, transport=transport, bytes=int(nbytes), seconds=float(seconds),
                   gbps=gbps(nbytes, seconds), verified=bool(verified), **extra)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Transfer:
        return cls(pair=str(obj["pair"]), transport=str(obj["transport"]),
                   bytes=int(obj["bytes"]), seconds=float(obj["seconds"]),
                   gbps=float(obj["gbps"]), verified=bool(obj["verified"]),
                   backend=str(obj.get("backend", "")), round=int(obj.get("round", 1)),
                   blocks=int(obj.get("blocks", 0)),
                   reference_gbps=(None if obj.get("reference_gbps") is None
                                   else float(obj["reference_gbps"])))

    @property
    def label(self) -> str:
        return f"{self.pair} {self.transport} round {self.round}"


@dataclass
class SweepPoint:
    """One size of a ``--sizes`` sweep (nccl-tests / nixlbench style) over one pair and
    transport: ``warmup`` untimed fetches, then ``iters`` timed ones of ``blocks`` blocks
    (``bytes`` each). Seconds are per fetch; ``verified`` is True when the destination held
    exactly the source's blocks after the last one. GB/s are 1e9 bytes per second: ``avg``
    from the mean time, ``peak`` from the fastest fetch, ``low`` from the slowest."""

    pair: str
    transport: str
    bytes: int
    blocks: int
    warmup: int
    iters: int
    avg_seconds: float
    min_seconds: float
    max_seconds: float
    verified: bool
    backend: str = ""
    #: same-run reference: GB/s of one contiguous torch copy of the same bytes between
    #: ordinary allocations on the same two devices (None where it was not measured)
    reference_gbps: float | None = None

    @property
    def avg_gbps(self) -> float:
        return gbps(self.bytes, self.avg_seconds)

    @property
    def peak_gbps(self) -> float:
        return gbps(self.bytes, self.min_seconds)

    @property
    def low_gbps(self) -> float:
        return gbps(self.bytes, self.max_seconds)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "avg_gbps": self.avg_gbps, "peak_gbps": self.peak_gbps,
                "low_gbps": self.low_gbps}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SweepPoint:
        return cls(pair=str(obj["pair"]), transport=str(obj["transport"]),
                   bytes=int(obj["bytes"]), blocks=int(obj["blocks"]),
                   warmup=int(obj["warmup"]), iters=int(obj["iters"]),
                   avg_seconds=float(obj["avg_seconds"]),
                   min_seconds=float(obj["min_seconds"]),
                   max_seconds=float(obj["max_seconds"]), verified=bool(obj["verified"]),
                   backend=str(obj.get("backend", "")),
                   reference_gbps=(None if obj.get("reference_gbps") is None
                                   else float(obj["reference_gbps"])))


def sweep_averages(points: list[SweepPoint]) -> dict[str, float]:
    """Per transport, the mean of the per-size average GB/s over every size and pair (the
    closing line of nccl-tests, ``# Avg bus bandwidth``)."""
    by: dict[str, list[float]] = {}
    for p in points:
        by.setdefault(p.transport, []).append(p.avg_gbps)
    return {t: sum(v) / len(v) for t, v in by.items()}


@dataclass
class Report:
    """Everything a run found. ``passed`` is True when no check failed and nothing is missing."""

    config: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: set when the run could not be carried out at all (exit 3), with what is missing
    environment_error: str = ""
    #: set when the arguments cannot work (exit 2): processes of a multi-host run disagree
    #: on the configuration, or the run needs more than this machine could ever give
    usage_error: str = ""
    #: set when a signal stopped the run (exit ``128 + signal``): ``signal`` (``SIGTERM``),
    #: ``stage`` (``preflight``, ``startup``, ``run``, ``teardown``) and ``phases``, the phase
    #: each worker was in (``{"decode0": "transfer:ipc:prefill0:round1"}``)
    interrupted: dict[str, Any] | None = None
    #: what the run needs and what the machine has (see :mod:`.resources`), checked before
    #: any worker starts
    resources: dict[str, Any] = field(default_factory=dict)
    #: ``--inject`` faults: when each fired, what reported it and how fast, or how the run
    #: recovered (see :mod:`.faultwatch`)
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: workers replaced after a ``restart-*`` fault: who died where, who took over
    recovery: list[dict[str, Any]] = field(default_factory=list)
    #: what the coordinator checked was given back after the run (see :mod:`.cleanup`)
    cleanup: dict[str, Any] = field(default_factory=dict)
    #: ``--sizes``: one point per pair, transport and size
    sweep: list[SweepPoint] = field(default_factory=list)
    #: leftover run directories of killed runs removed before this one started
    stale_run_dirs: list[str] = field(default_factory=list)

    # -- building ----------------------------------------------------------------
    def add_check(self, name: str, status: str, detail: str = "", worker: str = "coordinator",
                  seconds: float = 0.0, data: dict[str, Any] | None = None) -> Check:
        check = Check(name, status, detail, worker, seconds, dict(data or {}))
        self.checks.append(check)
        return check

    def interrupt(self, signum: int, stage: str, phases: dict[str, str]) -> None:
        """Record that signal ``signum`` stopped the run in ``stage`` (first signal wins)."""
        if self.interrupted is not None:
            return
        name = signal_name(signum)
        self.interrupted = {"signal": name, "signum": signum, "stage": stage,
                            "phases": dict(phases)}
        where = ", ".join(f"{w} in {p}" for w, p in phases.items()) or "no worker running"
        self.add_check("run", FAIL, f"interrupted by {name} during {stage} ({where}) before "
                                    "the run finished", data=self.interrupted)

    def apply_bandwidth_floor(self, min_gbps: float | None) -> None:
        """Add one check per transfer under ``min_gbps`` (and one passing check otherwise)."""
        if not min_gbps:
            return
        slow = [t for t in self.transfers if t.gbps < min_gbps]
        for t in slow:
            self.add_check(f"bandwidth/{t.pair}/{t.transport}/round{t.round}", FAIL,
                           f"{t.label}: {t.gbps:.3f} GB/s is under the --min-gbps floor of "
                           f"{min_gbps:g} GB/s ({t.bytes} bytes in {t.seconds:.4f} s via "
                           f"{t.backend or t.transport})",
                           data={"pair": t.pair, "transport": t.transport, "round": t.round,
                                 "gbps": t.gbps, "min_gbps": min_gbps})
        if not slow:
            if self.transfers:
                low = min(self.transfers, key=lambda t: t.gbps)
                self.add_check("bandwidth/floor", PASS,
                               f"all {len(self.transfers)} transfers at or above {min_gbps:g} "
                               f"GB/s (slowest: {low.label} at {low.gbps:.3f} GB/s)")
            else:
                self.add_check("bandwidth/floor", SKIP, "no transfers were measured")

    # -- verdict -------------------------------------------------------------------
    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.status == FAIL]

    @property
    def passed(self) -> bool:
        return (not self.environment_error and not self.usage_error and not self.failed_checks
                and bool(self.checks))

    @property
    def exit_code(self) -> int:
        if self.interrupted is not None:
            return EXIT_SIGNAL_BASE + int(self.interrupted["signum"])
        if self.usage_error:
            return EXIT_USAGE
        if self.environment_error:
            return EXIT_ENVIRONMENT
        return EXIT_OK if self.passed else EXIT_FAILED

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(CHECK_STATUSES, 0)
        for c in self.checks:
            out[c.status] += 1
        return out

    def summary(self) -> str:
        """One line: verdict and counts."""
        c = self.counts()
        verified = sum(1 for t in self.transfers if t.verified)
        tally = (f"{c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped; {verified}/"
                 f"{len(self.transfers)} transfers verified in {self.wall_seconds:.1f} s")
        if self.interrupted is not None:
            return (f"INTERRUPTED by {self.interrupted['signal']} during "
                    f"{self.interrupted['stage']}: {tally}")
        if self.usage_error:
            return f"BAD CONFIGURATION: {self.usage_error}"
        if self.environment_error:
            return f"CANNOT RUN: {self.environment_error}"
        return f"{'PASSED' if self.passed else 'FAILED'}: {tally}"

    # -- output --------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "summary": self.summary(),
            "environment_error": self.environment_error,
            "usage_error": self.usage_error,
            "interrupted": self.interrupted,
            "resources": self.resources,
            "faults": self.faults,
            "recovery": self.recovery,
            "cleanup": self.cleanup,
            "wall_seconds": round(self.wall_seconds, 3),
            "config": self.config,
            "environment": self.environment,
            "workers": self.workers,
            "checks": [c.to_json() for c in self.checks],
            "transfers": [asdict(t) for t in self.transfers],
            "sweep": [p.to_json() for p in self.sweep],
            "sweep_average_gbps": sweep_averages(self.sweep),
            "stale_run_dirs": self.stale_run_dirs,
        }

    def write_json(self, path: str) -> None:
        """Write the JSON report (see :mod:`.report_files` for what ``path`` may be)."""
        write_report(path, json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n")

    def to_junit(self) -> ET.Element:
        """JUnit XML: one ``testsuite``, one ``testcase`` per check (``skipped``/``failure``)."""
        c = self.counts()
        suites = ET.Element("testsuites", name="kvconnect-validate")
        suite = ET.SubElement(
            suites, "testsuite", name="kvconnect-validate", tests=str(len(self.checks)),
            failures=str(c[FAIL]), errors="0", skipped=str(c[SKIP]),
            time=f"{self.wall_seconds:.3f}", hostname=str(self.environment.get("hostname", "")),
        )
        props = ET.SubElement(suite, "properties")
        for key in ("kvconnect", "torch", "nixl", "ucx", "cuda_driver", "device"):
            if self.environment.get(key) is not None:
                ET.SubElement(props, "property", name=key, value=str(self.environment[key]))
        for check in self.checks:
            case = ET.SubElement(suite, "testcase", name=check.name,
                                 classname=f"kvconnect-validate.{check.worker or 'run'}",
                                 time=f"{check.seconds:.3f}")
            if check.status == FAIL:
                first_line = (check.detail.strip().splitlines() or [""])[0]
                el = ET.SubElement(case, "failure", message=first_line[:200],
                                   type="ValidationFailure")
                el.text = check.detail
            elif check.status == SKIP:
                ET.SubElement(case, "skipped", message=check.detail)
            elif check.detail:
                ET.SubElement(case, "system-out").text = check.detail
        if self.environment_error:
            case = ET.SubElement(suite, "testcase", name="environment",
                                 classname="kvconnect-validate.run", time="0")
            ET.SubElement(case, "error", message=self.environment_error, type="Environment")
            suite.set("errors", "1")
            suite.set("tests", str(len(self.checks) + 1))
        return suites

    def write_junit(self, path: str) -> None:
        root = self.to_junit()
        ET.indent(root)
        text = ET.tostring(root, encoding="unicode", xml_declaration=False)
        write_report(path, '<?xml version="1.0" encoding="utf-8"?>\n' + text + "\n")
