"""The harness's import structure: worker processes load nothing of the coordinator, and no
harness module imports one above it (no cycle, counting imports inside functions too)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import kvconnect.harness

HARNESS = Path(kvconnect.harness.__file__).parent
#: modules only the kvconnect-validate process (coordinator or multi-host member) needs
COORDINATOR_MODULES = ("cli", "resources", "orchestrator", "launch", "rundir", "rendezvous",
                       "display", "faultwatch", "cleanup", "workerset", "store_auth")


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
    assert "kvconnect.harness.control" in loaded
    leaked = sorted(f"kvconnect.harness.{m}" for m in COORDINATOR_MODULES
                    if f"kvconnect.harness.{m}" in loaded)
    assert leaked == []


def _harness_imports(path: Path) -> set[str]:
    """Harness modules ``path`` imports, at module level or inside functions."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level == 1:
                out.update(a.name for a in node.names)
            elif node.module and node.module.startswith("kvconnect.harness."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[2] for a in node.names
                       if a.name.startswith("kvconnect.harness."))
    return out


def test_the_harness_import_graph_has_no_cycle() -> None:
    modules = {p.stem for p in HARNESS.glob("*.py")} - {"__init__"}
    graph = {m: _harness_imports(HARNESS / f"{m}.py") & modules for m in modules}
    assert graph["worker"] and "cli" in graph  # the parser found imports at all
    done: set[str] = set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(m):], m]))
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, [*stack, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
