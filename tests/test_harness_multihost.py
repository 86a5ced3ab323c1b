"""Multi-host mode on loopback: two ``kvconnect-validate`` processes meet through a
``torch.distributed.TCPStore``, once with ``--rendezvous/--role/--rank`` and once with the
variables torchrun sets. The decode process pretends to boot another kernel (a test hook),
so the ``ipc`` transport must be skipped with the reason while ``nixl`` carries the blocks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp_path: Path, name: str, args: list[str], env: dict[str, str],
            stderr: int = subprocess.STDOUT) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID")}
    proc = subprocess.Popen([str(VALIDATE), "--device", "host", "--plain", "--json", str(out),
                             *args], env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=stderr, text=True)
    return proc, out


def _finish(proc: subprocess.Popen, out: Path) -> tuple[int, str, dict[str, Any]]:
    try:
        text, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, text, report


def test_two_hosts_on_loopback_skip_ipc_across_boot_ids(tmp_path: Path) -> None:
    port = _free_port()
    common = ["--prefill", "1", "--decode", "1", "--rendezvous", f"127.0.0.1:{port}",
              "--timeout", "120"]
    p = _launch(tmp_path, "prefill", [*common, "--role", "prefill", "--rank", "0"], {})
    d = _launch(tmp_path, "decode", [*common, "--role", "decode", "--rank", "0"],
                {"KVCONNECT_FAKE_BOOT_ID_FOR_TEST": "another-host"})
    pcode, ptext, prep = _finish(*p)
    dcode, dtext, drep = _finish(*d)
    assert (pcode, dcode) == (0, 0), ptext[-3000:] + dtext[-3000:]
    assert prep and drep
    # the reporter (prefill0) holds everyone's checks
    workers = {c["worker"] for c in prep["checks"]}
    assert {"prefill0", "decode0"} <= workers
    nixl = sorted((t["transport"], t["round"], t["verified"]) for t in prep["transfers"])
    assert nixl == [("nixl", 1, True), ("nixl", 2, True)]
    ipc = [c for c in prep["checks"] if c["name"].startswith("transfer/") and "/ipc/" in c["name"]]
    assert len(ipc) == 2 and all(c["status"] == "skip" for c in ipc)
    assert "runs on another host (boot id" in ipc[0]["detail"] and "another-host" in \
        ipc[0]["detail"]
    verdict = [c for c in drep["checks"] if c["name"] == "run/verdict"]
    assert verdict and verdict[0]["status"] == "pass"
    assert prep["passed"] and drep["passed"]


def test_a_dead_peer_is_reported_with_its_phase_torchrun_variables(tmp_path: Path) -> None:
    port = _free_port()
    short_tmp = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))  # fits socket paths
    env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "TMPDIR": str(short_tmp)}
    args = ["--prefill", "1", "--decode", "1", "--transports", "ipc", "--timeout", "10",
            "--inject", "kill-decode@transfer"]  # every process is given the same faults
    p = _launch(tmp_path, "prefill", args, {**env, "RANK": "0"})
    d = _launch(tmp_path, "decode", args, {**env, "RANK": "1"})
    pcode, ptext, prep = _finish(*p)
    dcode, _, drep = _finish(*d)
    assert dcode == -9 and not drep  # SIGKILLed by the test hook: no report
    assert pcode == 1 and prep, ptext[-3000:]
    # the reporter's own failure: it saw decode0 stop in its transfer
    [failed] = [c for c in prep["checks"] if c["name"] == "worker/prefill0"]
    assert failed["status"] == "fail" and failed["worker"] == "prefill0"
    assert failed["data"] == {"phase": "transfer:round1", "peer": "decode0",
                              "peer_phase": "transfer:ipc:prefill0:round1",
                              "cause": "unresponsive"}
    assert prep["wall_seconds"] < 120
    # the prefill removed its socket directory; the killed decode never needed one
    assert list(short_tmp.iterdir()) == []
    short_tmp.rmdir()


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections (the kernel's backlog) but never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


def test_an_unreachable_rendezvous_exits_3_within_the_timeout_in_one_line(
        tmp_path: Path, silent_listener: int) -> None:
    closed = _free_port()  # bound once, then released: nothing listens there
    args = ["--prefill", "1", "--decode", "1", "--role", "decode", "--rank", "0",
            "--timeout", "5"]
    runs = {name: _launch(tmp_path, name, [*args, "--rendezvous", f"127.0.0.1:{port}"], {},
                          stderr=subprocess.PIPE)
            for name, port in (("closed", closed), ("silent", silent_listener))}
    for name, (proc, out) in runs.items():
        try:
            _, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 3, (name, stderr)
        report = json.loads(out.read_text())
        assert report["exit_code"] == 3 and report["environment_error"]
        [check] = [c for c in report["checks"] if c["name"] == "rendezvous"]
        assert check["data"]["cause"] == {"closed": "refused", "silent": "no_answer"}[name]
        assert 4.5 <= check["data"]["waited_seconds"] <= 7, check["data"]  # --timeout 5
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (name, stderr)  # one clear line, no C++ stack frames
