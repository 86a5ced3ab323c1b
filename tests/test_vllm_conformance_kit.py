"""The conformance kit on an author's own connectors (issue 16, defect 8; needs vLLM).

Before: a connector not derived from vLLM's NIXL or offload classes ended in the kit's own
``AttributeError: ... no attribute 'connector_worker'``; one writing a non-JSON line to an
inherited fd crashed the run (JSONDecodeError): later cases never ran, no ``--json``.
The connectors are in ``tests/_conformance_connectors.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from kvconnect.vllm.runtime import prepare_cpu_runtime

prepare_cpu_runtime()
pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvconnect.harness.conformance import run_conformance  # noqa: E402

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
MOD = "_conformance_connectors"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}


@pytest.fixture(scope="module")
def authored() -> dict[str, dict]:
    sys.path.insert(0, str(HERE))
    try:
        rs = run_conformance([f"{MOD}:MinimalConnector", f"{MOD}:StorageRowsConnector"],
                             ["LBHNC", "BLHNC"], timeout=120)
    finally:
        sys.path.remove(str(HERE))
    return {(r["connector"].split(":")[1], r["layout"]): r for r in rs}


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_a_minimal_connector_gets_a_verdict_and_what_was_not_checked(authored, layout) -> None:
    r = authored[("MinimalConnector", layout)]
    assert r["probe"] == "generic" and r["status"] == "pass", r
    assert r["checks"]["register"]["status"] == "pass"
    assert r["checks"]["committed_only"]["held_views"] == 2  # vLLM's views, as handed
    assert r["checks"]["committed_only"]["views_reaching_uncommitted"] == 0
    assert sorted(r["unchecked"]) == ["block_geometry", "moves_blocks"]
    assert all(len(reason) > 20 for reason in r["unchecked"].values())
    assert r["checks"]["moves_blocks"]["status"] == "skip"
    assert r["checks"]["sleep_wake"]["status"] == "pass"


def test_a_connector_deriving_rows_from_the_storage_size_fails(authored) -> None:
    r = authored[("StorageRowsConnector", "LBHNC")]
    co = r["checks"]["committed_only"]
    assert r["status"] == "fail" and co["status"] == "fail", r
    assert co["views_reaching_uncommitted"] == 2
    assert all(e["uncommitted_bytes"] > 0 for e in co["held_examples"])
    assert co["held_examples"][0]["attribute"].startswith("connector.rows[")


def test_a_connector_printing_to_inherited_fds_cannot_break_the_run(tmp_path: Path) -> None:
    report = tmp_path / "out.json"
    out = subprocess.run(
        [sys.executable, "-m", "kvconnect.harness.conformance.cli", f"{MOD}:NoisyConnector",
         f"{MOD}:MinimalConnector", "--layouts", "LBHNC", "--json", str(report),
         "--timeout", "120"],
        capture_output=True, text=True, timeout=400, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(report.read_text())["results"]
    assert [r["connector"].split(":")[1] for r in results] == ["NoisyConnector",
                                                               "MinimalConnector"]
    noisy, minimal = results
    assert noisy["status"] == minimal["status"] == "pass"
    assert noisy["stray_output"]["bytes"] > 0 and "stray_output" not in minimal
    assert "hello from register_kv_caches" in noisy["stray_output"]["sample"]


def test_plugin_timeout_bounds_a_hanging_case(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    junit = tmp_path / "junit.xml"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "empty"),
         "--kvconnect-connector", f"{MOD}:HangingConnector", "--kvconnect-layouts", "LBHNC",
         "--kvconnect-timeout", "40", f"--junitxml={junit}"],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert out.returncode == pytest.ExitCode.TESTS_FAILED, out.stdout + out.stderr
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    result = json.loads(props["kvconnect_conformance"])
    assert result["status"] == "timeout" and result["stage"] == "register", result
    assert 40 <= result["seconds"] < 100


def _session_members(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of stat: the session id
                out.append(int(name))
    return out


def test_sigterm_kills_the_case_in_flight_and_keeps_the_results(tmp_path: Path) -> None:
    import signal
    import time

    report, lines = tmp_path / "out.json", tmp_path / "cases.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconnect.harness.conformance.cli", f"{MOD}:MinimalConnector",
         f"{MOD}:HangingConnector", "--layouts", "LBHNC", "--json", str(report),
         "--jsonl", str(lines), "--timeout", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=tmp_path,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (lines.exists() and lines.read_text().strip()):  # the first case is done
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.5)
        time.sleep(3)  # the hanging case is in register_kv_caches now
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    kept = json.loads(report.read_text())
    assert kept["interrupted"] == "SIGTERM"
    assert [r["connector"].split(":")[1] for r in kept["results"]] == ["MinimalConnector"]
    assert _session_members(proc.pid) == []  # the hanging case's process went too


@pytest.fixture(scope="module")
def misbehaving(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run over the connectors that end early, are not connectors, or daemonize (issue
    23, item 10), with the daemon's pid."""
    pidfile = tmp_path_factory.mktemp("daemon") / "pid"
    os.environ["KVC_TEST_DAEMON_PIDFILE"] = str(pidfile)
    sys.path.insert(0, str(HERE))
    try:
        rs = run_conformance([f"{MOD}:EarlyExitConnector", f"{MOD}:NotAConnector",
                              f"{MOD}:DaemonizingConnector"], ["LBHNC"], timeout=120)
    finally:
        sys.path.remove(str(HERE))
        del os.environ["KVC_TEST_DAEMON_PIDFILE"]
    out: dict[str, Any] = {r["connector"].split(":")[1]: r for r in rs}
    out["daemon_pid"] = int(pidfile.read_text()) if pidfile.exists() else None
    return out


def test_a_case_that_exits_0_early_says_so(misbehaving: dict[str, Any]) -> None:
    """Before: the evidence was a tail of vLLM's warnings from the case's log."""
    r = misbehaving["EarlyExitConnector"]
    assert r["status"] == "error"
    assert r["evidence"].startswith("the case's process ended (exit code 0) before it "
                                    "reported a result"), r["evidence"]
    assert "WARNING" not in r["evidence"]  # the log (``log_tail`` when there is one) apart


def test_a_class_that_is_not_a_connector_is_named(misbehaving: dict[str, Any]) -> None:
    """Before: a raw pydantic traceback, cut mid-word."""
    r = misbehaving["NotAConnector"]
    assert r["status"] == "error"
    assert r["evidence"] == (f"ConnectorSpecError: {MOD}:NotAConnector is the class "
                             "NotAConnector, not a vLLM KV connector (a subclass of "
                             "KVConnectorBase_V1): name a connector class")


def test_a_daemon_a_connector_leaves_is_found_reported_and_ended(
        misbehaving: dict[str, Any]) -> None:
    """Before: the case passed and the daemon (its own session, orphaned) outlived the
    kit. Now the kit adopts the case's orphans, names them in the ``leftovers`` check
    (which fails the case) and ends them."""
    r = misbehaving["DaemonizingConnector"]
    pid = misbehaving["daemon_pid"]
    assert pid is not None
    left = r["checks"]["leftovers"]
    assert r["status"] == "fail" and left["status"] == "fail", r
    assert [(p["pid"], p["found_by"]) for p in left["left"]] == [(pid, "adopted orphan")]
    assert not os.path.exists(f"/proc/{pid}"), "the daemon outlived the kit"
    assert r["checks"]["register"]["status"] == "pass"  # otherwise it conforms


def test_a_case_that_leaves_nothing_passes_the_leftovers_check(authored) -> None:
    r = authored[("MinimalConnector", "LBHNC")]
    assert r["checks"]["leftovers"] == {"status": "pass", "processes": 0}
