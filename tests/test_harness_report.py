"""The report model: verdict and exit code, bandwidth floor, JSON and JUnit output, tables."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvconnect.harness.display import Display
from kvconnect.harness.report import Check, Report, Transfer


def _report() -> Report:
    r = Report(config={"num_prefill": 1}, environment={"hostname": "h", "torch": "2.x",
                                                       "cuda_driver": None})
    r.add_check("kv_cache/allocate", "pass", "ok", worker="prefill0", seconds=0.5)
    r.add_check("rdma/registration", "skip", "no RDMA device", worker="decode0")
    r.transfers.append(Transfer.measured("prefill0->decode0", "ipc", 8_000_000, 0.004, True,
                                         backend="copy:cpu", blocks=8))
    r.transfers.append(Transfer.measured("prefill0->decode0", "nixl", 8_000_000, 0.02, True,
                                         backend="UCX", round=2, blocks=8))
    return r


def test_verdict_and_exit_codes() -> None:
    r = _report()
    assert r.passed and r.exit_code == 0
    assert r.transfers[0].gbps == pytest.approx(2.0)
    r.add_check("transfer/x", "fail", "block 3 differs", worker="decode0")
    assert not r.passed and r.exit_code == 1
    r.environment_error = "no GPU"
    assert r.exit_code == 3 and r.summary().startswith("CANNOT RUN")
    r.usage_error = "ranks disagree"
    assert r.exit_code == 2
    assert not Report().passed  # nothing checked is not a pass
    with pytest.raises(ValueError):
        Check("x", "ok")


def test_bandwidth_floor_names_the_slow_transfer() -> None:
    r = _report()
    r.apply_bandwidth_floor(1.0)  # ipc 2 GB/s passes, nixl 0.4 GB/s does not
    failed = r.failed_checks
    assert len(failed) == 1 and r.exit_code == 1
    assert "prefill0->decode0 nixl round 2" in failed[0].detail
    assert "0.400 GB/s is under the --min-gbps floor of 1 GB/s" in failed[0].detail
    ok = _report()
    ok.apply_bandwidth_floor(0.1)
    assert ok.passed and ok.checks[-1].name == "bandwidth/floor"
    none = _report()
    none.apply_bandwidth_floor(None)
    assert len(none.checks) == 2


def test_json_output_schema(tmp_path: Path) -> None:
    r = _report()
    r.add_check("transfer/x", "fail", "block 3 differs", worker="decode0")
    path = tmp_path / "report.json"
    r.write_json(str(path))
    d = json.loads(path.read_text())
    assert d["schema"] == "kvconnect-validate/1"
    assert d["passed"] is False and d["exit_code"] == 1
    for c in d["checks"]:
        assert set(c) >= {"name", "status", "detail"} and c["status"] in ("pass", "fail", "skip")
    for t in d["transfers"]:
        assert set(t) >= {"pair", "transport", "bytes", "seconds", "gbps", "verified"}
    assert {"hostname", "torch"} <= set(d["environment"])
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # umask, not mkstemp's 0600


def test_junit_has_one_testcase_per_check(tmp_path: Path) -> None:
    r = _report()
    r.add_check("transfer/x", "fail", "block 3 differs\nsecond line", worker="decode0")
    path = tmp_path / "junit.xml"
    r.write_junit(str(path))
    root = ET.parse(path).getroot()
    suite = root.find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert len(cases) == len(r.checks) == int(suite.get("tests", "0"))
    assert suite.get("failures") == "1" and suite.get("skipped") == "1"
    by_name = {c.get("name"): c for c in cases}
    failure = by_name["transfer/x"].find("failure")
    assert failure is not None and failure.get("message") == "block 3 differs"
    assert "second line" in (failure.text or "")
    assert by_name["rdma/registration"].find("skipped") is not None
    assert by_name["kv_cache/allocate"].get("classname") == "kvconnect-validate.prefill0"
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props.get("torch") == "2.x" and "cuda_driver" not in props


def test_plain_display_prints_table_and_verdict() -> None:
    out = io.StringIO()
    d = Display(live=False, stream=out, verbose=True)
    r = _report()
    d.phase("prefill0", "allocate")
    d.check(r.checks[0])
    d.transfer(r.transfers[0])
    d.final(r)
    text = out.getvalue()
    assert "prefill0: allocate" in text
    assert "PASS prefill0/kv_cache/allocate" in text
    assert "prefill0->decode0" in text and "copy:cpu" in text
    assert text.rstrip().splitlines()[-1].startswith("PASSED: 1 passed, 0 failed, 1 skipped")


def test_the_default_output_is_short_and_puts_failures_first() -> None:
    """Issue 16: a plain 1P1D printed ~130 lines with every check twice. By default: no
    phase, pass or transfer line while running; the summary starts with the failures."""
    out = io.StringIO()
    d = Display(live=False, stream=out)
    r = _report()
    for i in range(30):
        r.add_check(f"kv_cache/step{i}", "pass", "fine", worker="decode0")
    r.add_check("transfer/x", "fail", "block 3 differs", worker="decode0")
    d.phase("prefill0", "allocate")
    for c in r.checks:
        d.check(c)
    d.transfer(r.transfers[0])
    d.phase("decode0", "done")
    d.final(r)
    lines = out.getvalue().splitlines()
    assert not any("prefill0: allocate" in x or "PASS " in x for x in lines)
    assert sum("decode0/transfer/x" in x for x in lines) == 2  # live, then in the summary
    summary = lines[lines.index(next(x for x in lines if x.startswith("Failures"))):]
    assert summary[1].startswith("  FAIL  decode0/transfer/x  block 3 differs")
    assert any(x.startswith("  SKIP  rdma/registration (decode0)") for x in summary)
    assert summary[-2].startswith("Checks: 31 passed, 1 failed, 1 skipped")
    assert len(lines) < 15


def test_a_sweep_prints_nccl_tests_columns_and_the_average_line() -> None:
    from kvconnect.harness.display import sweep_lines
    from kvconnect.harness.report import SweepPoint, sweep_averages

    points = [SweepPoint("prefill0->decode0", "ipc", 1 << 20, 4, 5, 20, 1e-3, 5e-4, 2e-3,
                         True, "torch:cpu"),
              SweepPoint("prefill0->decode0", "ipc", 4 << 20, 16, 5, 20, 2e-3, 1e-3, 4e-3,
                         True, "torch:cpu")]
    assert points[0].avg_gbps == pytest.approx((1 << 20) / 1e-3 / 1e9)
    assert points[0].peak_gbps == pytest.approx(2 * points[0].avg_gbps)
    avg = sweep_averages(points)["ipc"]
    assert avg == pytest.approx((points[0].avg_gbps + points[1].avg_gbps) / 2)
    text = [t for _, t in sweep_lines(points)]
    assert text[1].split()[1:] == ["pair", "transport", "size(B)", "blocks", "iters", "avg(us)",
                                   "min(us)", "max(us)", "avg", "GB/s", "peak", "GB/s",
                                   "ref", "GB/s", "verified"]
    assert text[2].split()[2:4] == ["1048576", "4"] and text[2].split()[5] == "1000.0"
    assert text[-1].startswith(f"# Avg bandwidth ipc: {avg:.3f} GB/s")
    r = _report()
    r.sweep = points
    doc = r.to_json()
    assert doc["sweep_average_gbps"]["ipc"] == pytest.approx(avg)
    assert doc["sweep"][1]["avg_gbps"] == pytest.approx(points[1].avg_gbps)
    assert SweepPoint.from_json(doc["sweep"][0]) == points[0]


def test_rich_display_escapes_markup_in_details() -> None:
    out = io.StringIO()
    d = Display(live=True, stream=out)
    r = _report()
    r.add_check("transfer/y", "fail", "blocks [1, 2] [bold]not markup[/bold]", worker="decode0")
    with d:
        d.phase("decode0", "transfer:ipc")
        d.check(r.checks[-1])
    d.final(r)
    text = out.getvalue()
    assert "[1, 2]" in text and "[bold]not markup[/bold]" in text
    assert "FAILED" in text


@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)])
def test_an_interrupted_run_exits_128_plus_the_signal_and_says_where(
        signum: int, code: int, tmp_path: Path) -> None:
    r = _report()
    r.interrupt(signum, "run", {"prefill0": "transfer:round1", "decode0": "transfer:ipc"})
    r.interrupt(9, "teardown", {})  # the first signal wins
    assert r.exit_code == code and not r.passed
    path = tmp_path / "r.json"
    r.write_json(str(path))
    d = json.loads(path.read_text())
    assert d["exit_code"] == code
    assert d["interrupted"]["signal"] == ("SIGINT" if signum == 2 else "SIGTERM")
    assert d["interrupted"]["phases"]["prefill0"] == "transfer:round1"
    run_check = [c for c in d["checks"] if c["name"] == "run"]
    assert run_check[0]["status"] == "fail" and run_check[0]["data"]["stage"] == "run"


def test_check_data_round_trips_and_must_be_an_object() -> None:
    c = Check("x", "fail", "block 3", data={"block": 3})
    assert Check.from_json(json.loads(json.dumps(c.__dict__))) == c
    with pytest.raises(ValueError, match="JSON object"):
        Check.from_json({"name": "x", "status": "pass", "data": [1]})


def test_the_conformance_kit_writes_the_same_check_as_an_entry() -> None:
    from kvconnect.verdicts import check_entry

    assert Check("x", "skip", "ignored", data={"reason": "r"}).to_entry() == {
        "status": "skip", "reason": "r"}
    assert check_entry("refused", error="e") == {"status": "refused", "error": "e"}
    with pytest.raises(ValueError, match="check status"):
        check_entry("ran")


def test_a_conformance_engine_that_left_no_result_ends_by_how_it_stopped() -> None:
    """The kit's engine rows: out of time, killed by a signal, or raised; each a status of
    the case vocabulary both reports share."""
    from kvconnect.verdicts import CASE_STATUSES, engine_end

    got = {sig: engine_end(sig, "why", "engine start") for sig in ("timeout", "SIGKILL", None)}
    assert [(e["status"], e["signal"]) for e in got.values()] == [
        ("timeout", None), ("fault", "SIGKILL"), ("fail", None)]
    assert all(e["status"] in CASE_STATUSES and e["stage"] == "engine start"
               and e["evidence"] == "why" for e in got.values())
