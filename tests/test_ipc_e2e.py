"""The real ``kvconnect-validate`` moving more chunks over IPC than one SCM_RIGHTS message can
carry: 127 layers x 2 segments = 254 chunk fds (Linux: at most 253 per sendmsg). Before the
fds went in batches this run failed with "peer closed the connection"; 126 layers passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")

pytestmark = pytest.mark.slow


def test_127_layers_over_ipc(tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    report = tmp_path / "report.json"
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(k, None)
    proc = subprocess.run(
        [str(VALIDATE), "--device", "host", "--num-layers", "127", "--num-blocks", "8",
         "--transports", "ipc", "--plain", "--json", str(report)],
        capture_output=True, text=True, env=env, timeout=600)
    assert report.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    doc = json.loads(report.read_text())
    failed = [(c["worker"], c["name"], c["detail"]) for c in doc["checks"]
              if c["status"] == "fail"]
    assert proc.returncode == 0 and doc["passed"] is True and not failed, failed
    transfers = [(t["transport"], t["round"], t["verified"]) for t in doc["transfers"]]
    assert sorted(transfers) == [("ipc", 1, True), ("ipc", 2, True)]
    allocate = [c for c in doc["checks"]
                if c["worker"] == "prefill0" and c["name"] == "kv_cache/allocate"]
    assert len(allocate) == 1 and allocate[0]["status"] == "pass"
