"""A transport from outside the package runs in the real harness: tests/_stream_transport.py
(one file, one registration line) through ``kvconnect-validate --transport-module``.

The run uses subprocess workers (``python -m kvconnect.harness.worker``, not forks of the
coordinator), so each worker must import the module itself from the run config: nothing is
inherited. Remove the registration line from _stream_transport.py and the run exits 2
("unknown transport(s) stream").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
TESTS = Path(__file__).resolve().parent
SMALL = ["--device", "host", "--num-layers", "1", "--num-blocks", "8", "--plain"]

pytestmark = pytest.mark.slow


def _validate(tmp_path: Path, *args: str) -> tuple[int, dict[str, Any] | None, str]:
    """Run the console script with tests/ importable; ``(exit code, JSON report, output)``."""
    report = tmp_path / "report.json"
    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as tmpdir:
        env = {**os.environ, "TMPDIR": tmpdir, "PYTHONPATH": str(TESTS),
               "KVCONNECT_VALIDATE_LAUNCH": "subprocess"}
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
            env.pop(k, None)
        proc = subprocess.run([str(VALIDATE), *SMALL, "--json", str(report), *args],
                              capture_output=True, text=True, env=env, timeout=600)
        left = os.listdir(tmpdir)
    assert left == [], f"the run left {left} behind"
    doc = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, doc, proc.stdout + proc.stderr


def test_third_party_transport_runs_end_to_end_byte_exact(tmp_path: Path) -> None:
    code, doc, out = _validate(tmp_path, "--transport-module", "_stream_transport",
                               "--transports", "stream")
    assert code == 0 and doc is not None, out[-4000:]
    assert doc["config"]["transports"] == ["stream"]
    assert doc["config"]["transport_modules"] == ["_stream_transport"]
    moved = sorted((t["transport"], t["round"], t["verified"], t["backend"])
                   for t in doc["transfers"])
    assert moved == [("stream", 1, True, "unix-stream"), ("stream", 2, True, "unix-stream")]
    per_block = doc["transfers"][0]["bytes"] // doc["transfers"][0]["blocks"]
    assert per_block > 0 and all(t["gbps"] > 0 for t in doc["transfers"])
    names = {(c["worker"], c["name"], c["status"]) for c in doc["checks"]}
    for r in (1, 2):
        assert ("decode0", f"transfer/prefill0->decode0/stream/round{r}", "pass") in names
    for worker in ("prefill0", "decode0"):  # its sockets and threads were released
        assert (worker, "resources/released", "pass") in names


def test_without_the_module_the_transport_is_unknown(tmp_path: Path) -> None:
    code, _, out = _validate(tmp_path, "--transports", "stream")
    assert code == 2
    assert "unknown transport(s) stream" in out and "--transport-module" in out


@pytest.mark.parametrize("module", ["no_such_transport_module", "_stream_transport.nope"])
def test_a_module_that_does_not_import_is_a_usage_error(module: str,
                                                        run_validate_cli: Any) -> None:
    code, text = run_validate_cli(["--transport-module", module, "--device", "host", "-q"])
    assert code == 2
    assert f"transport module {module!r} does not import" in text
