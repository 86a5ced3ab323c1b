"""``--inject FAULT@PHASE`` in-process: parsing and refusal (exit 2), the one hook that fires
a fault at a worker's phase boundary, the coordinator's account of time-to-report, what a
process holds (fds, sockets, KV mappings), the after-run leak checks, and the fault-matrix
script's table writer. Fast: no worker processes (tests/test_harness_fault_runs.py runs them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from kvconnect.harness.coordinator.cleanup import (
    Baseline,
    _new_temp_entries,
    children,
    take_baseline,
)
from kvconnect.harness.coordinator.faultwatch import REPORT_GRACE_S, FaultWatch
from kvconnect.harness.faults import (
    FAULT_KINDS,
    PHASES,
    FaultEffects,
    FaultPlan,
    FaultSpec,
    FaultSpecError,
    parse_fault,
    phase_kind,
    restarted_workers,
)
from kvconnect.harness.footprint import Footprint
from kvconnect.harness.report import FAIL, PASS, Check, Report

REPO = Path(__file__).resolve().parents[1]


# -- parsing and refusal ------------------------------------------------------------------------
def test_specs_parse_to_kind_rank_and_phase() -> None:
    assert parse_fault("kill-decode@transfer") == FaultSpec("kill-decode", 0, "transfer")
    assert parse_fault("kill-decode1@transfer") == FaultSpec("kill-decode", 1, "transfer")
    assert parse_fault(" Restart-Prefill@TRANSFER ") == FaultSpec("restart-prefill", 0,
                                                                  "transfer")
    spec = parse_fault("drop-notification@notification")
    assert (spec.role, spec.worker, spec.text) == ("prefill", "prefill0",
                                                   "drop-notification@notification")
    assert FaultSpec.from_json(spec.to_json()) == spec
    assert parse_fault("stop-prefill2@wake").text == "stop-prefill2@wake"
    with pytest.raises(FaultSpecError, match="does not apply to wake"):
        parse_fault("drop-notification@wake")


def test_the_registry_holds_every_fault_the_issue_names() -> None:
    assert {"kill-prefill", "kill-decode", "stop-prefill", "stop-decode", "slow-prefill",
            "drop-notification", "restart-prefill"} <= set(FAULT_KINDS)
    assert {"handshake", "register", "transfer", "notification", "sleep", "wake"} <= set(PHASES)
    assert restarted_workers([{"kind": "restart-prefill", "rank": 1, "phase": "wake"},
                              {"kind": "kill-decode", "rank": 0, "phase": "wake"}]) \
        == {"prefill1"}


@pytest.mark.parametrize("argv, message", [
    (["--inject", "kill-decode"], "expected FAULT@PHASE"),
    (["--inject", "explode-decode@transfer"], "unknown fault 'explode-decode'"),
    (["--inject", "kill-decode@lunch"], "unknown phase 'lunch'"),
    (["--inject", "drop-notification@sleep"], "does not apply to sleep"),
    (["--inject", "kill-decode1@transfer"], "there is no decode1"),
    (["--inject", "kill-decode@wake", "--inject", "kill-decode@wake"], "given twice"),
    (["--inject", "drop-notification@transfer", "--transports", "ipc"],
     "needs a transport whose fetches notify the prefill (nixl"),
    (["--inject", "restart-prefill@transfer", "--rendezvous", "h:1234", "--role", "decode",
      "--rank", "0"], "needs a local run"),
    # issue 16: combinations that were accepted, then ended in not_fired
    (["--inject", "kill-prefill@handshake", "--inject", "kill-prefill@transfer"],
     "kill-prefill@transfer can never fire: kill-prefill@handshake ends prefill0 first"),
    (["--inject", "restart-prefill@wake", "--inject", "restart-prefill@transfer"],
     "restart-prefill@wake can never fire: restart-prefill@transfer ends prefill0 first"),
    (["--inject", "kill-decode@transfer", "--inject", "drop-notification@notification"],
     "drop-notification@notification can never fire: kill-decode@transfer fails the run"),
    (["--prefill", "2", "--inject", "stop-prefill1@transfer", "--inject",
      "kill-prefill@transfer"], "fails the run first"),
])
def test_bad_inject_specs_exit_2_with_a_message(argv: list[str], message: str,
                                                run_validate_cli: Any) -> None:
    code, text = run_validate_cli(argv)
    assert code == 2, text
    assert message in text


def test_combinations_that_can_all_fire_are_accepted() -> None:
    from kvconnect.harness.faults import check_faults

    for texts in (["restart-prefill@transfer", "kill-decode@wake"],
                  ["drop-notification@transfer", "kill-prefill@sleep"],
                  ["restart-prefill@transfer", "restart-prefill1@transfer"],
                  ["drop-notification@transfer", "kill-decode@notification"]):
        check_faults([parse_fault(t) for t in texts], 2, 1, multi_host=False)


def test_the_help_lists_the_faults_and_phases(run_validate_cli: Any) -> None:
    code, text = run_validate_cli(["--help"])
    assert code == 0
    flat = " ".join(text.split())
    for name in FAULT_KINDS:
        assert name in flat
    assert "--inject FAULT@PHASE" in flat


# -- the hook -----------------------------------------------------------------------------------
class _Target:
    """What a fault acts on, without a process to kill: records what fired."""

    def __init__(self) -> None:
        self.effects = FaultEffects()
        self.fired: list[tuple[str, str]] = []

    @property
    def stall_seconds(self) -> float:
        return 0.0

    def fault_fired(self, spec: FaultSpec, phase: str) -> None:
        self.fired.append((spec.text, phase))


def test_a_fault_fires_once_at_the_first_phase_of_its_kind_in_its_worker_only() -> None:
    specs = [parse_fault("drop-notification@transfer")]
    target = _Target()
    plan = FaultPlan(specs, "prefill0")
    for phase in ("register", "handshake:round1", "transferx", "transfer:round1",
                  "notification:round1", "transfer:round2"):
        plan.at_phase(phase, target)
    assert target.fired == [("drop-notification@transfer", "transfer:round1")]
    assert target.effects.drop_notifications
    other = _Target()
    FaultPlan(specs, "prefill1").at_phase("transfer:round1", other)
    FaultPlan(specs, "prefill0", incarnation=2).at_phase("transfer:round1", other)
    assert other.fired == [] and not other.effects.drop_notifications
    assert phase_kind("transfer:ipc:prefill0:round1") == "transfer"


# -- time to report -----------------------------------------------------------------------------
def _check(name: str, by: str, **data: Any) -> Check:
    return Check(name, FAIL, "x", by, data=data)


def test_the_watch_pairs_a_fired_fault_with_the_first_check_naming_its_worker() -> None:
    specs = [parse_fault("kill-decode@transfer"), parse_fault("stop-prefill@register"),
             parse_fault("slow-prefill@sleep"), parse_fault("drop-notification@notification")]
    watch = FaultWatch(specs, timeout=10.0, started=100.0)
    watch.fired("decode0", {"fault": "kill-decode@transfer", "at": 101.0,
                            "in_phase": "transfer:ipc:prefill0:round1"})
    watch.fired("prefill0", {"fault": "stop-prefill@register", "at": 102.0,
                             "in_phase": "register"})
    # a check naming another worker, or without role/rank/phase, is not the report
    watch.observe(_check("transfer/x", "decode0", peer="prefill0"), 101.1)
    watch.observe(_check("worker/prefill0", "coordinator", worker="prefill0", role="prefill",
                         rank=0, phase="wake", cause="died"), 101.2)  # wrong phase
    watch.observe(_check("worker/decode0", "coordinator", worker="decode0", role="decode",
                         rank=0, phase="transfer:ipc:prefill0:round1", cause="died"), 101.25)
    watch.fired("prefill0", {"fault": "drop-notification@notification", "at": 103.0,
                             "in_phase": "notification:round1"})  # after those checks
    report = Report()
    watch.finish(report)
    by = {f["fault"]: f for f in report.faults}
    assert by["kill-decode@transfer"]["outcome"] == "reported"
    assert by["kill-decode@transfer"]["time_to_report_seconds"] == pytest.approx(0.25)
    assert by["kill-decode@transfer"]["reported_by"]["phase"] == "transfer:ipc:prefill0:round1"
    assert by["stop-prefill@register"]["outcome"] == "misreported"  # named phase wake
    assert by["slow-prefill@sleep"]["outcome"] == "not_fired"
    assert by["drop-notification@notification"]["outcome"] == "not_reported"
    status = {c.name: c.status for c in report.checks}
    assert status == {"fault/kill-decode@transfer": PASS, "fault/stop-prefill@register": FAIL,
                      "fault/slow-prefill@sleep": FAIL,
                      "fault/drop-notification@notification": FAIL}


def test_a_report_after_the_deadline_fails_and_a_detected_in_phase_counts() -> None:
    specs = [parse_fault("stop-decode@wake"), parse_fault("drop-notification@transfer")]
    watch = FaultWatch(specs, timeout=4.0, started=0.0)
    watch.fired("decode0", {"fault": "stop-decode@wake", "at": 1.0, "in_phase": "wake"})
    watch.fired("prefill0", {"fault": "drop-notification@transfer", "at": 1.0,
                             "in_phase": "transfer:round1"})
    watch.observe(_check("worker/decode0", "coordinator", worker="decode0", role="decode",
                         rank=0, phase="wake"), 1.0 + 4.0 + REPORT_GRACE_S + 0.5)
    watch.observe(_check("nixl/notifications/round1", "prefill0", role="prefill", rank=0,
                         phase="notification:round1"), 3.0)
    report = Report()
    watch.finish(report)
    by = {f["fault"]: f for f in report.faults}
    assert by["stop-decode@wake"]["outcome"] == "misreported"
    assert by["drop-notification@transfer"]["outcome"] == "reported"  # seen where it shows


def test_a_restart_fault_recovers_only_when_the_run_passed() -> None:
    spec = parse_fault("restart-prefill@transfer")
    for other_failure, outcome in ((False, "recovered"), (True, "recovery_failed")):
        watch = FaultWatch([spec], timeout=10.0, started=0.0)
        watch.fired("prefill0", {"fault": spec.text, "at": 1.0, "in_phase": "transfer:round1"})
        watch.restarted("prefill0", {"incarnation": 2, "phase": "transfer:round1"}, 1.5)
        report = Report()
        if other_failure:
            report.add_check("transfer/x", FAIL, "x")
        watch.finish(report)
        assert report.faults[0]["outcome"] == outcome
        assert report.faults[0]["time_to_report_seconds"] == pytest.approx(0.5)


# -- what a process holds -----------------------------------------------------------------------
def test_a_footprint_names_the_socket_and_mapping_opened_since() -> None:
    from kvconnect.vmm import get_vmm_driver

    before = Footprint.take()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    drv = get_vmm_driver("cpu")
    assert drv is not None
    g = drv.granularity()
    va = drv.reserve(g)
    handle = drv.create(g)
    drv.map(va, g, handle)
    try:
        leaks = Footprint.take().leaks_since(before)
        assert leaks["sockets"] == 1 and leaks["kv_mappings"] == 1
        assert any(t.startswith("socket:") for t in leaks["fds"])
    finally:
        drv.unmap(va, g)
        drv.release(handle)
        drv.free_reserved(va, g)
        sock.close()
    assert Footprint.take().leaks_since(before) == {}


def test_the_leak_check_sees_a_left_child_and_a_left_run_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil
    import subprocess
    import tempfile

    short = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # short: run_dir_base keeps it
    monkeypatch.setenv("TMPDIR", str(short))
    monkeypatch.setattr(tempfile, "tempdir", None)
    child = None
    try:
        before = take_baseline()
        assert before.temp_base == str(short)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        assert child.pid in children()
        left = short / "kvv-leftover"
        left.mkdir()
        (left / "owner.json").write_text(json.dumps(
            {"pid": os.getpid(), "start_ticks": 1, "boot_id": "x"}))  # ours, stale
        (short / "someone-else").mkdir()
        (short / "kvconnect-conformance-logs-x").mkdir()  # a kit run beside this one
        generic = short / "kvconnect-x"
        generic.mkdir()
        assert _new_temp_entries(before) == [str(generic), str(left)]
        generic.rmdir()
        assert _new_temp_entries(Baseline(Footprint({}, 0, 0), {},
                                          {"kvv-leftover", "someone-else"}, str(short))) == []
    finally:
        if child is not None:
            child.kill()
            child.wait()
        shutil.rmtree(short, ignore_errors=True)
    assert child.pid not in children()


# -- the fault-matrix script --------------------------------------------------------------------
def _fault_matrix() -> Any:
    spec = importlib.util.spec_from_file_location("fault_matrix",
                                                  REPO / "scripts" / "fault_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_matrix_covers_every_combination_and_lists_n_a_with_why() -> None:
    fm = _fault_matrix()
    combos = fm.matrix()
    assert len(combos) == len(FAULT_KINDS) * len(PHASES)
    na = {(f, p): why for f, p, why in combos if why}
    assert ("drop-notification", "sleep") in na and "notification" in na[
        ("drop-notification", "sleep")]
    assert ("kill-decode", "transfer") not in na


def test_the_table_goes_between_the_markers_and_nothing_else_changes(tmp_path: Path) -> None:
    fm = _fault_matrix()
    rows = [
        {"fault": "kill-decode", "phase": "transfer", "spec": "kill-decode@transfer",
         "exit_code": 1, "ok": True, "problems": [], "wall_seconds": 2.5,
         "time_to_report_seconds": 0.02,
         "reported_by": {"role": "decode", "rank": 0, "phase": "transfer:ipc:prefill0:round1",
                         "cause": "died", "check": "worker/decode0"}},
        {"fault": "drop-notification", "phase": "sleep", "na": True, "why": "none in flight"},
    ]
    meta = {"date": "2030-01-01", "machine": "m", "versions": "v", "command": "c"}
    section = fm.render(rows, meta)
    assert "| kill-decode | transfer | 1 | decode 0 in `transfer:ipc:prefill0:round1` (died) " \
           "| 0.02 s | 2.5 s | ok |" in section
    assert "| drop-notification | sleep | n/a | none in flight |" in section
    assert "**1 of 1 combinations behaved**" in section
    doc = tmp_path / "reliability.md"
    fm.write_doc(section, doc)  # created with a title and the section
    text = doc.read_text()
    assert text.startswith("# Reliability\n") and text.count(fm.BEGIN) == 1
    doc.write_text("# Reliability\n\nintro\n\n" + text[text.index(fm.BEGIN):] + "\nlater\n")
    fm.write_doc(fm.render(rows[1:], meta), doc)
    again = doc.read_text()
    assert again.startswith("# Reliability\n\nintro\n\n") and again.endswith("\nlater\n")
    assert "kill-decode" not in again and again.count(fm.END) == 1


class _RecordingControl:
    """Stands in for the worker's control channel: records the checks a step reports."""

    incarnation = 1

    def __init__(self) -> None:
        self.checks: list[tuple[str, str, dict[str, Any]]] = []

    def failed(self, name: str, detail: str, data: dict[str, Any]) -> None:
        self.checks.append((FAIL, name, data))

    def passed(self, name: str, detail: str, data: dict[str, Any]) -> None:
        self.checks.append((PASS, name, data))


@pytest.mark.parametrize("device, verdict", [("cpu", FAIL), ("cuda:0", PASS)])
def test_released_check_counts_every_fd_on_host_and_kv_mappings_only_on_cuda(
        tmp_path: Path, device: str, verdict: str) -> None:
    """An fd opened during the run and still open is a leak on the host backend; on CUDA it
    is reported as runtime state (the driver's own fds outlive every kvconnect resource)."""
    from kvconnect.harness.worker.steps import WorkerSteps

    steps = WorkerSteps.__new__(WorkerSteps)
    steps.ctl, steps.device, steps.name = _RecordingControl(), device, "decode0"
    before = Footprint.take()
    with open(tmp_path / "held", "w"):
        steps.check_released(before)
    ((status, name, data),) = steps.ctl.checks
    assert (status, name) == (verdict, "resources/released")
    held = data["leaked"] if device == "cpu" else data["runtime_fds"]
    assert held["num_fds"] == 1 and str(tmp_path / "held") in held["fds"]


def test_a_silent_worker_that_is_running_is_busy_not_unresponsive() -> None:
    """Issue 16 defect 9: a worker whose heartbeat thread starves (more workers than cores)
    is running (state R): busy, not dead. A sleeping or stopped one is unresponsive."""
    import signal
    import subprocess
    import time

    from kvconnect.harness.coordinator.watchdog import NO_PROGRESS, UNRESPONSIVE, Judge
    from kvconnect.harness.coordinator.worker_records import LocalWorker

    judge = Judge(heartbeat_timeout=2.0, progress_deadline=5.0)
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    nap = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        time.sleep(0.5)
        now = time.monotonic()
        workers = {}
        for name, proc in (("spin", spin), ("nap", nap)):
            w = LocalWorker("prefill", 0, "cpu", proc, "/dev/null")
            w.last_seen, w.last_progress = now - 3.0, now - 1.0  # silent 3 s, moved 1 s ago
            workers[name] = w
        deadline = time.monotonic() + 10
        while not proc_running(spin.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert judge(workers["spin"], now) is None  # running: busy
        verdict = judge(workers["nap"], now)
        assert verdict is not None and verdict.cause == UNRESPONSIVE
        assert verdict.process_state.startswith("S")
        workers["spin"].last_progress = now - 6.0  # busy, but no progress past the deadline
        verdict = judge(workers["spin"], now)
        assert verdict is not None and verdict.cause == NO_PROGRESS
        spin.send_signal(signal.SIGSTOP)
        time.sleep(0.2)
        workers["spin"].last_progress = now
        verdict = judge(workers["spin"], now)
        assert verdict is not None and verdict.cause == UNRESPONSIVE
        assert verdict.process_state.startswith("T")
    finally:
        for proc in (spin, nap):
            proc.kill()
            proc.wait()


def proc_running(pid: int) -> bool:
    from kvconnect.harness.coordinator.launch import proc_state

    return proc_state(pid).startswith("R")
