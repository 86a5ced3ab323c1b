"""The conformance kit's usage and environment errors, and its progress channel (no vLLM
needed: every check here happens before vLLM is imported, or is pure parsing).

Each test failed before its fix (issue 16): ``--timeout nan`` gave a traceback, ``-1``
timed every case out, ``0`` silently became 180; ``--json /proc/x`` was found only after
every case ran; ``--device cuda:0`` without a GPU ended in a torch AttributeError (exit 1);
the pytest plugin took ``--kvconnect-num-blocks -5`` and unknown layouts as error cases and
had no per-case timeout; a non-JSON line on the case pipe crashed the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.harness.conformance.options import gpu_absent_reason
from kvconnect.harness.conformance.runner import _Progress, check_timeout

CLI = [sys.executable, "-m", "kvconnect.harness.conformance.cli"]


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, cwd=cwd)


@pytest.mark.parametrize("value", ["nan", "-1", "0", "inf", "ten", "1e300", "\u0665"])
def test_cli_refuses_a_timeout_that_is_not_a_finite_positive_number(value: str,
                                                                    tmp_path: Path) -> None:
    lines = tmp_path / "cases.jsonl"
    out = _cli("NixlConnector", "--timeout", value, "--jsonl", str(lines))
    assert out.returncode == 2, out.stderr
    assert "--timeout" in out.stderr and "Traceback" not in out.stderr
    assert not lines.exists()  # no case ran


@pytest.mark.parametrize("path", ["/proc/x", "/nonexistent-dir/out.json"])
@pytest.mark.parametrize("flag", ["--json", "--jsonl", "--markdown"])
def test_cli_refuses_an_unwritable_report_path_before_any_case(flag: str, path: str,
                                                               tmp_path: Path) -> None:
    lines = tmp_path / "cases.jsonl"
    extra = [] if flag == "--jsonl" else ["--jsonl", str(lines)]
    out = _cli("NixlConnector", "--layouts", "LBHNC", flag, path, *extra)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr and "Traceback" not in out.stderr
    assert not lines.exists()


def test_cli_refuses_a_directory_as_report_path(tmp_path: Path) -> None:
    out = _cli("NixlConnector", "--json", str(tmp_path))
    assert out.returncode == 2 and "directory" in out.stderr


@pytest.mark.skipif(gpu_absent_reason("cuda:0") is None, reason="this machine has a GPU")
def test_cli_without_a_gpu_says_no_gpu_with_exit_3() -> None:
    out = _cli("NixlConnector", "--device", "cuda:0")
    assert out.returncode == 3, out.stderr
    assert "no GPU" in out.stderr and "Traceback" not in out.stderr


def test_cli_refuses_a_gpu_index_that_does_not_exist() -> None:
    out = _cli("NixlConnector", "--device", "cuda:abc")
    assert out.returncode == 2 and "cuda:N" in out.stderr
    out = _cli("NixlConnector", "--device", "cuda:4096")
    assert out.returncode == 3 and "no GPU" in out.stderr


def test_api_refuses_bad_timeouts_before_running_anything() -> None:
    from kvconnect.harness.conformance import run_conformance

    for bad in (0, -1, float("nan"), float("inf"), True, "10", 1e300, 86401):
        with pytest.raises(ValueError, match="timeout"):
            run_conformance(["NixlConnector"], ["LBHNC"], timeout=bad)
    assert check_timeout(2.5) == 2.5


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "empty").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--co", str(tmp_path / "empty"), "--kvconnect-connector",
                           "some.module:Connector", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


@pytest.mark.parametrize("args", [
    ("--kvconnect-num-blocks", "-5"), ("--kvconnect-num-blocks", "x"),
    ("--kvconnect-capacity-blocks", "0"), ("--kvconnect-layouts", "LBHNC,NOPE"),
    ("--kvconnect-timeout", "nan"), ("--kvconnect-timeout", "-1"),
    ("--kvconnect-timeout", "1e300"), ("--kvconnect-num-blocks", "\u0666\u0664"),
    ("--kvconnect-num-blocks", "+64"), ("--kvconnect-capacity-blocks", str(2 ** 70)),
    ("--kvconnect-num-blocks", "64", "--kvconnect-capacity-blocks", "32"),
    ("--kvconnect-device", "tpu:0"),
], ids=lambda a: " ".join(a))
def test_plugin_bad_options_are_usage_errors(tmp_path: Path, args: tuple[str, ...]) -> None:
    out = _pytest(tmp_path, *args)
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "kvconnect conformance" in out.stderr and "conformance[" not in out.stdout


def test_plugin_collects_one_case_per_layout_with_good_options(tmp_path: Path) -> None:
    out = _pytest(tmp_path, "--kvconnect-layouts", "LBHNC,BLHNC", "--kvconnect-timeout",
                  "30", "--kvconnect-num-blocks", "64")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("conformance[some.module:Connector-") == 2


def _line(token: str, obj: dict) -> bytes:
    return f"kvconnect-case {token} ".encode() + json.dumps(obj).encode()


def test_progress_takes_only_lines_framed_by_the_case_token() -> None:
    p = _Progress("abc123")
    p.line(b"not json at all {")
    p.line(_line("abc123", {"stage": "register"}))
    p.line(b"junk before the frame" + _line("abc123", {"check": "register",
                                                       "value": {"status": "pass"}}))
    p.line(_line("other", {"stage": "forged"}))  # another token: stray
    p.line(_line("abc123", {"stage": "x"})[:-3])  # truncated JSON: stray
    p.line(_line("abc123", {"done": True}))
    assert p.stage == "register" and p.done
    assert p.checks == {"register": {"status": "pass"}}
    assert p.stray_bytes > 0 and p.evidence()["sample"].startswith("not json at all")


def test_progress_survives_an_endless_line() -> None:
    p = _Progress("t")
    keep = p.overflow(b"x" * (1 << 20) + _line("t", {"stage": "s"})[:24])
    assert keep.startswith(b"kvconnect-case t") and p.stray_bytes == 1 << 20
    assert p.overflow(b"y" * 100) == b"" and p.stray_bytes == (1 << 20) + 100


def test_engine_mode_usage_errors() -> None:
    import torch

    if not torch.cuda.is_available():  # engines on a GPU: an environment problem here
        out = _cli("NixlConnector", "--engine", "--device", "cuda:0")
        assert out.returncode == 3 and "no GPU" in out.stderr, out.stderr
    out = _cli("NixlConnector", "--engine", "--pd")
    assert out.returncode == 2 and "--pd" in out.stderr
    out = _cli("NixlConnector", "--engine", "--caches", "extensible,huge")
    assert out.returncode == 2 and "--caches" in out.stderr


def test_engine_rows_judge_tokens_controls_and_movement() -> None:
    from kvconnect.harness.conformance.engine import (
        _mark_unsupported,
        _status,
        _tokens_check,
        _transfer_check,
    )

    ref = [[1, 2, 3], [4, 5, 6]]
    assert _tokens_check({"tokens": [1, 2, 3], "num_cached_tokens": 64}, ref[0],
                         needs_cache=True)["status"] == "pass"
    assert _tokens_check({"tokens": [1, 2, 9], "num_cached_tokens": 64}, ref[0],
                         needs_cache=True)["status"] == "fail"
    assert _tokens_check({"tokens": [1, 2, 3], "num_cached_tokens": 0}, ref[0],
                         needs_cache=True)["status"] == "skip"  # nothing reloaded
    good = {"remote": {"tokens": [1, 2, 3]}, "control": {"tokens": [7, 7, 7]},
            "control_zeroed_bytes": 4096}
    assert _transfer_check(good, ref)["status"] == "pass"
    recomputed = dict(good, control={"tokens": [4, 5, 6]})  # zeroed KV changed nothing
    assert _transfer_check(recomputed, ref)["status"] == "skip"
    assert _transfer_check(dict(good, remote={"tokens": [0]}), ref)["status"] == "fail"
    row = {"checks": {"starts": {"status": "pass"}, "reload": _tokens_check(
        {"tokens": [1, 2, 3], "num_cached_tokens": 0}, ref[0], needs_cache=True)},
        "log_errors": ["LMCache ERROR: Failed to initialize"]}
    assert _status(row) == "inconclusive" and "Failed to initialize" in row["evidence"]
    rows = [{"cache": c, "status": "fail", "evidence": f"{c}: RuntimeError: no CPU",
             "checks": {"starts": {"status": "fail"}}} for c in ("extensible", "plain")]
    _mark_unsupported(rows)
    assert [r["status"] for r in rows] == ["unsupported", "unsupported"]
    rows[1]["checks"]["starts"]["status"] = "pass"
    rows[1]["status"] = rows[0]["status"] = "fail"
    _mark_unsupported(rows)  # plain starts: the extensible failure is the connector's
    assert rows[0]["status"] == "fail"


def test_engine_log_errors_put_the_exception_first() -> None:
    from kvconnect.harness.conformance.engine import _ANSI, _error_lines

    log = ["\x1b[31;20m[t] LMCache ERROR:\x1b[0m Failed to initialize: Traceback", "  File x",
           "ValueError: chunk size 32 is not a multiple of 256", "INFO fine",
           "ValueError: chunk size 32 is not a multiple of 256"]
    got = _error_lines([_ANSI.sub("", x) for x in log])
    assert got == ["ValueError: chunk size 32 is not a multiple of 256",
                   "[t] LMCache ERROR: Failed to initialize: Traceback"]
