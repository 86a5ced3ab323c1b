"""Worker processes load nothing of the coordinator (the import graph of every package,
harness included, is checked for cycles and upward imports in tests/test_package_layers.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kvconnect.harness

HARNESS = Path(kvconnect.harness.__file__).parent
#: modules and sub-packages only the kvconnect-validate process (coordinator or multi-host
#: member) needs: the command, the root modules only its two ways of running use, and those ways
COMMAND_SIDE = ("cli", "arguments", "resources", "std_streams", "display", "rundir",
                "coordinator", "multihost", "conformance")


#: runs the worker entry point as ``python -m kvconnect.harness.worker`` does, against a socket
#: that does not exist (so it leaves at once, through its ``__main__`` block), and prints the
#: modules loaded at the moment it exits
_WORKER_EXIT = """
import json, os, runpy, sys
real_exit = os._exit
def report_and_exit(code):
    print(json.dumps({"code": code, "modules": sorted(sys.modules)}), flush=True)
    real_exit(code)
os._exit = report_and_exit
sys.argv = ["worker", "--connect", sys.argv[1], "--role", "prefill", "--rank", "0"]
runpy.run_module("kvconnect.harness.worker", run_name="__main__")
"""


def test_a_worker_process_imports_no_coordinator_module(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", _WORKER_EXIT, str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=120)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["code"] == 70, proc.stderr  # could not join the run, as it should
    loaded = set(out["modules"])
    assert {"kvconnect.harness.control", "kvconnect.harness.worker.process"} <= loaded
    leaked = sorted(m for m in loaded for side in COMMAND_SIDE
                    if m == f"kvconnect.harness.{side}" or m.startswith(f"kvconnect.harness.{side}."))
    assert leaked == []


def test_the_command_side_names_what_exists() -> None:
    """Every name of :data:`COMMAND_SIDE` is a module or sub-package of the harness (a rename
    would otherwise pass the check above unseen)."""
    assert all((HARNESS / f"{side}.py").is_file() or (HARNESS / side / "__init__.py").is_file()
               for side in COMMAND_SIDE)
