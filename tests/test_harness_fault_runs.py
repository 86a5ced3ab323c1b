"""``kvconnect-validate --inject FAULT@PHASE`` end to end on the host backend: real worker
processes, real sockets, real NIXL. A representative subset: every fault once and every
phase once (the full fault x phase matrix runs through ``scripts/fault_matrix.py``, whose
table is docs/reliability.md), plus the issue's bar command verbatim.

Each run must exit 1 (0 for restart-prefill) with a report naming the worker's side, rank
and phase within the deadline, the run's own ``cleanup`` check passed, and afterwards no
process of the run alive and nothing left in its TMPDIR.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvconnect.harness.coordinator.cleanup import processes_mentioning

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
#: small and fast: the faults are the point, not the bytes
SMALL = ["--device", "host", "--plain", "--num-layers", "1", "--num-blocks", "8"]
#: heartbeat limit 3 s, stall limit 7 s: seconds per run, robust on a busy 2-core machine
TIMEOUT = 6.0
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")

pytestmark = pytest.mark.slow


@dataclass
class Run:
    code: int
    report: dict[str, Any]
    output: str
    wall: float
    json_path: Path
    tmpdir: Path

    def checks(self, name: str) -> list[dict[str, Any]]:
        return [c for c in self.report["checks"] if c["name"] == name]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR short enough for Unix socket paths, so the run directory lands there."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def validate(tmp_path: Path, tmpdir: Path, *args: str) -> Run:
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["TMPDIR"] = str(tmpdir)
    t0 = time.monotonic()
    proc = subprocess.run([str(VALIDATE), *args, "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    wall = time.monotonic() - t0
    assert out.exists(), f"no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return Run(proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr, wall,
               out, tmpdir)


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[1] == str(pid):
            out.append(int(entry.name))
    return out


def assert_nothing_left(run: Run) -> None:
    """The run's own cleanup check passed; no worker is alive; its TMPDIR is empty."""
    [cleanup] = run.checks("cleanup")
    assert cleanup["status"] == "pass", cleanup["detail"]
    assert run.report["cleanup"]["processes"]["left"] == []
    assert run.report["workers"], run.output[-2000:]
    assert processes_mentioning(str(run.json_path)) == []
    assert list(run.tmpdir.iterdir()) == []


def test_the_bar_command_exits_1_within_20_s_naming_decode_and_transfer(
        tmp_path: Path, short_tmp: Path) -> None:
    """The issue's bar, verbatim (default layout and sizes)."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["TMPDIR"] = str(short_tmp)
    t0 = time.monotonic()
    proc = subprocess.Popen([str(VALIDATE), "--prefill", "1", "--decode", "1", "--device",
                             "host", "--inject", "kill-decode@transfer", "--timeout", "10",
                             "--json", "r.json"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wall = time.monotonic() - t0
    assert proc.returncode == 1, output[-3000:]
    assert wall < 20, f"took {wall:.1f} s"
    report = json.loads((tmp_path / "r.json").read_text())
    [fault] = report["faults"]
    assert fault["outcome"] == "reported" and fault["time_to_report_seconds"] <= 10
    got = fault["reported_by"]
    assert (got["role"], got["rank"]) == ("decode", 0) and got["phase"].startswith("transfer:")
    [failed] = [c for c in report["checks"] if c["name"] == "worker/decode0"]
    assert failed["status"] == "fail"
    assert (failed["data"]["role"], failed["data"]["phase"].split(":")[0]) == \
        ("decode", "transfer")
    # no worker left: none of the run's pids alive, no child of the (gone) coordinator
    pids = [w["pid"] for w in report["workers"]]
    assert len(pids) == 2
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or b"r.json" not in \
            Path(f"/proc/{pid}/cmdline").read_bytes()
    assert _children_of(proc.pid) == []
    assert list(short_tmp.iterdir()) == []
    print(f"\nbar command: exit 1 in {wall:.1f} s, reported "
          f"{fault['time_to_report_seconds']:.3f} s after the kill")


#: every fault once, every phase once: (spec, side, rank, phase kind it is reported in, cause)
SUBSET = [
    ("kill-prefill@handshake", "prefill", "handshake", "died"),
    ("stop-prefill@register", "prefill", "register", "unresponsive"),
    ("stop-decode@wake", "decode", "wake", "unresponsive"),
    ("slow-prefill@sleep", "prefill", "sleep", "no_progress"),
    ("drop-notification@notification", "prefill", "notification", None),
    ("kill-decode@notification", "decode", "notification", "died"),
]


@pytest.mark.parametrize("spec, side, phase, cause", SUBSET, ids=[s[0] for s in SUBSET])
def test_a_fault_is_reported_naming_side_rank_and_phase_and_nothing_is_left(
        tmp_path: Path, short_tmp: Path, spec: str, side: str, phase: str,
        cause: str | None) -> None:
    run = validate(tmp_path, short_tmp, *SMALL, "--timeout", f"{TIMEOUT:g}", "--inject", spec)
    assert run.code == 1 and run.report["exit_code"] == 1, run.output[-3000:]
    [fault] = run.report["faults"]
    assert fault["fired"] and fault["outcome"] == "reported", fault
    got = fault["reported_by"]
    assert (got["role"], got["rank"], got["phase"].split(":")[0]) == (side, 0, phase)
    if cause is not None:
        assert got["cause"] == cause
    assert fault["time_to_report_seconds"] <= TIMEOUT + 2.0
    assert run.checks(f"fault/{spec}")[0]["status"] == "pass"
    assert_nothing_left(run)


def test_restart_prefill_at_transfer_recovers_without_restarting_the_decode(
        tmp_path: Path, short_tmp: Path) -> None:
    run = validate(tmp_path, short_tmp, *SMALL, "--timeout", f"{TIMEOUT:g}",
                   "--inject", "restart-prefill@transfer")
    assert run.code == 0 and run.report["passed"], run.output[-4000:]
    [fault] = run.report["faults"]
    assert fault["outcome"] == "recovered"
    [restart] = run.report["recovery"]
    assert (restart["worker"], restart["incarnation"], restart["signal"]) == \
        ("prefill0", 2, "SIGKILL")
    assert restart["phase"].startswith("transfer")
    # the decode kept running (one process, never replaced) and recovered
    decodes = [w for w in run.report["workers"] if w["role"] == "decode"]
    assert len(decodes) == 1 and decodes[0]["state"] == "done" and not decodes[0]["replaced"]
    prefills = {w["incarnation"]: w for w in run.report["workers"] if w["role"] == "prefill"}
    assert prefills[1]["replaced"] and prefills[2]["state"] == "done"
    [rec] = [c for c in run.report["checks"] if c["name"].startswith("recovery/")]
    assert rec["status"] == "pass" and rec["name"] == "recovery/prefill0->decode0/round1"
    d = rec["data"]
    assert (d["old_incarnation"], d["new_incarnation"]) == (1, 2)
    assert d["failed"] and d["cache_intact"] is True and d["cache_guard"]["num_changed"] == 0
    assert len(d["blocks_not_received"]) > 0
    # blocks not received were never reported as received: per transport and round exactly
    # one transfer, verified, and round 1's came from the new incarnation
    transfers = sorted((t["transport"], t["round"]) for t in run.report["transfers"])
    assert transfers == [("ipc", 1), ("ipc", 2), ("nixl", 1), ("nixl", 2)]
    assert all(t["verified"] for t in run.report["transfers"])
    for transport in d["failed"]:
        [c] = run.checks(f"transfer/prefill0->decode0/{transport}/round1")
        assert c["status"] == "pass" and c["data"]["peer_incarnation"] == 2
    assert_nothing_left(run)
    released = run.report["cleanup"]["workers"]
    assert released["decode0"] == "released" and released["prefill0.2"] == "released"
