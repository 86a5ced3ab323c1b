"""Every case in its own process, with a deadline; faults reported, never fatal.

vLLM's NIXL worker pins its process to one core, and a connector that touches uncommitted
memory of the host backend dies by SIGSEGV: so each case runs in a child. The parent
imports vLLM once and forks a child per case (a fresh interpreter would pay vLLM's import,
~10 s, per case). The child streams JSON lines (``{"stage": ...}``, then
``{"result": ...}``) over a pipe; the parent waits with a deadline, kills the child's
process group when it passes, and turns a death by signal into a ``fault`` result naming
the signal and the stage it died in. Units: seconds.

On CUDA the parent must not initialise CUDA before it forks (a child of a process that did
cannot use it): :func:`warm_up` selects vLLM's CUDA platform and torch's NVML-based device
count, and :func:`run_cases` refuses to fork once torch has initialised CUDA. With
``start_method="spawn"`` each case runs in a fresh interpreter instead (``python -m
kvconnect.vllm.conformance.runner``: vLLM's import paid per case).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "START_METHODS", "case_status", "run_cases", "warm_up"]

#: how a case's process starts: a fork of the warmed-up parent, or a fresh interpreter
START_METHODS = ("fork", "spawn")

#: seconds one case may take (setup, register, transfers, sleep / wake)
DEFAULT_TIMEOUT = 180.0
_MAX_LINE = 1 << 20


def warm_up(device: object = "cpu") -> None:
    """Import what every case needs, once, before forking (CUDA stays uninitialised)."""
    from kvconnect.vllm.runtime import prepare_runtime

    prepare_runtime(device)
    import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.core.kv_cache_planning  # noqa: F401

    import kvconnect.vllm.cache  # noqa: F401
    import kvconnect.vllm.conformance.case  # noqa: F401


def case_status(result: dict[str, Any]) -> str:
    """``pass`` when every check passed (or was skipped); ``refused`` when kvconnect's
    bounding declined the layout before anything was registered; else ``fail``, ``fault``
    or ``timeout`` as the case ended."""
    if result.get("status") in ("fault", "timeout", "error"):
        return str(result["status"])
    checks = result.get("checks", {})
    if checks.get("register", {}).get("status") == "refused":
        return "refused"
    if not checks or any(c.get("status") == "fail" for c in checks.values()):
        return "fail"
    return "pass"


def _child(spec: dict[str, Any], wfd: int, log_path: str, *, own_group: bool = True) -> None:
    """In the case's process: run the case, write JSON lines, leave without cleanup."""
    code = 0
    try:
        if own_group:
            os.setpgid(0, 0)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        from .case import run_case

        def send(obj: dict[str, Any]) -> None:
            os.write(wfd, (json.dumps(obj) + "\n").encode())

        result = run_case(spec, lambda name: send({"stage": name}),
                          lambda name, value: send({"check": name, "value": value}))
        send({"result": result})
    except BaseException:
        code = 1
        try:
            os.write(wfd, (json.dumps({"error": traceback.format_exc()[-2000:]}) + "\n").encode())
        except OSError:
            pass
    finally:
        os._exit(code)


def _tail(path: str, n: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _start(spec: dict[str, Any], wfd: int, rfd: int, log_path: str, start_method: str
           ) -> int:
    """Start the case's process (its own process group); returns its pid."""
    if start_method == "spawn":
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconnect.vllm.conformance.runner", "--case",
             json.dumps(spec), str(wfd), log_path],
            pass_fds=(wfd,), start_new_session=True, stdin=subprocess.DEVNULL)
        return proc.pid
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(spec, wfd, log_path)
    return pid


def _run_one(spec: dict[str, Any], timeout: float, log_dir: str, start_method: str = "fork"
             ) -> dict[str, Any]:
    rfd, wfd = os.pipe()
    workdir = tempfile.mkdtemp(dir=log_dir)
    spec = {**spec, "workdir": workdir}
    log_path = os.path.join(workdir, "case.log")
    t0 = time.monotonic()
    try:
        pid = _start(spec, wfd, rfd, log_path, start_method)
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    buf, stage, result, error = b"", "start", None, None
    checks: dict[str, Any] = {}
    deadline = t0 + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([rfd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(rfd, 65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > _MAX_LINE:
                error = "case output exceeded 1 MiB"
                break
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                stage = msg.get("stage", stage)
                if "check" in msg:
                    checks[msg["check"]] = msg["value"]
                result = msg.get("result", result)
                error = msg.get("error", error)
    finally:
        os.close(rfd)
    timed_out = result is None and error is None and time.monotonic() >= deadline
    if timed_out:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = _waitpid(pid, 10.0)
    out = dict(result or {"connector": spec["connector"], "layout": spec["layout"],
                          "num_blocks": spec.get("num_blocks"),
                          "capacity_blocks": spec.get("capacity_blocks"), "checks": checks})
    out["seconds"] = round(time.monotonic() - t0, 2)
    if timed_out:
        out.update(status="timeout", stage=stage, evidence=f"no result within {timeout:g} s")
    elif status is not None and os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        out.update(status="fault", signal=sig, stage=stage,
                   evidence=f"{sig} during {stage}")
    elif result is None:
        out.update(status="error", stage=stage, evidence=(error or _tail(log_path))[-1500:])
    out.setdefault("status", case_status(out))
    return out


def _waitpid(pid: int, timeout: float) -> tuple[int, int | None]:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return done, status
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return os.waitpid(pid, 0)
        time.sleep(0.05)


def case_device(specs: list[dict[str, Any]]) -> str:
    """The one device every spec names (``cpu`` when none does). Raises ValueError when
    specs name several: vLLM's platform is chosen once per process."""
    devices = {str(s.get("device", "cpu")) for s in specs} or {"cpu"}
    if len(devices) > 1:
        raise ValueError(f"conformance cases of one run must share a device, got "
                         f"{sorted(devices)}: run one kvconnect-conformance per device")
    return devices.pop()


def _check_fork_safe(device: str) -> None:
    from kvconnect.vllm.runtime import is_cuda_device

    if not is_cuda_device(device):
        return
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised in the conformance kit's parent process, so "
                           "forked cases could not use it: run with start_method='spawn' "
                           "(kvconnect-conformance --start-method spawn)")


def run_cases(specs: Iterable[dict[str, Any]], *, timeout: float = DEFAULT_TIMEOUT,
              on_result: Callable[[dict[str, Any]], None] | None = None,
              start_method: str = "fork") -> list[dict[str, Any]]:
    """Run each case spec (``connector``, ``layout``, ``device``, optional geometry: see
    :data:`~kvconnect.vllm.conformance.case.CASE_DEFAULTS`) in its own process: a fork of
    this one (vLLM imported once) or, with ``start_method="spawn"``, a fresh interpreter."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method {start_method!r}: choose from {START_METHODS}")
    specs = [dict(s) for s in specs]
    device = case_device(specs)
    if start_method == "fork":
        warm_up(device)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-conformance-logs-") as log_dir:
        for spec in specs:
            if start_method == "fork":
                _check_fork_safe(device)
            res = _run_one(spec, timeout, log_dir, start_method)
            results.append(res)
            if on_result is not None:
                on_result(res)
    return results


def _case_main(argv: list[str]) -> None:
    """``python -m kvconnect.vllm.conformance.runner --case SPEC_JSON FD LOG``: one case in
    this fresh interpreter (the spawn start method)."""
    if len(argv) != 4 or argv[0] != "--case":
        sys.exit("usage: python -m kvconnect.vllm.conformance.runner --case SPEC_JSON FD LOG")
    _child(json.loads(argv[1]), int(argv[2]), argv[3], own_group=False)


if __name__ == "__main__":
    _case_main(sys.argv[1:])
