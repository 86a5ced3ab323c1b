"""Every case in its own process, with a deadline; faults reported, never fatal.

vLLM's NIXL worker pins its process to one core, and a connector that touches uncommitted
memory of the host backend dies by SIGSEGV: so each case runs in a child. The parent
imports vLLM once and forks a child per case (a fresh interpreter would pay vLLM's import,
~10 s, per case). The child streams progress (``{"stage": ...}``, ``{"check": ...}``) over a
pipe, each line framed by a random per-case token, and writes its final result to a file in
its work folder; the parent waits with a deadline, kills the child's process group when it
passes, and turns a death by signal into a ``fault`` result naming the signal and the stage
it died in. The connector runs in that child and inherits the pipe: whatever it writes there
(a line without the case's token, bytes that are not JSON) is counted as stray output and
quoted in the result, never parsed, and a case whose handling fails in the parent becomes
an ``error`` result: later cases still run. Units: seconds.

On CUDA the parent must not initialise CUDA before it forks (a child of a process that did
cannot use it): :func:`warm_up` selects vLLM's CUDA platform and torch's NVML-based device
count, and :func:`run_cases` refuses to fork once torch has initialised CUDA. With
``start_method="spawn"`` each case runs in a fresh interpreter instead (``python -m
kvconnect.vllm.conformance.runner``: vLLM's import paid per case).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "RESULT_FILE", "START_METHODS", "case_status", "check_timeout",
           "run_cases", "warm_up"]

#: how a case's process starts: a fork of the warmed-up parent, or a fresh interpreter
START_METHODS = ("fork", "spawn")

#: seconds one case may take (setup, register, transfers, sleep / wake)
DEFAULT_TIMEOUT = 180.0
_MAX_LINE = 1 << 20
#: the file a case's process leaves its result in (in its work folder)
RESULT_FILE = "result.json"
#: first word of every progress line a case sends (then its token, then JSON)
_FRAME = "kvconnect-case"


def warm_up(device: object = "cpu") -> None:
    """Import what every case needs, once, before forking (CUDA stays uninitialised)."""
    from kvconnect.vllm.runtime import prepare_runtime

    prepare_runtime(device)
    import vllm.distributed.kv_transfer.kv_connector.factory  # noqa: F401
    import vllm.engine.arg_utils  # noqa: F401

    import kvconnect.vllm.cache  # noqa: F401
    import kvconnect.vllm.conformance.case  # noqa: F401

    from .compat import kv_cache_planning_module

    kv_cache_planning_module()


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


def check_timeout(timeout: float) -> float:
    """``timeout`` (seconds per case) when it is a finite number above 0; else ValueError."""
    from .options import parse_timeout

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout {timeout!r}: seconds per case, a number above 0")
    return parse_timeout(timeout)


def _child(spec: dict[str, Any], wfd: int, log_path: str, token: str, *,
           own_group: bool = True) -> None:
    """In the case's process: run the case, send progress lines framed by ``token``, write
    the result file, leave without cleanup."""
    code = 0
    prefix = f"{_FRAME} {token} ".encode()

    def send(obj: dict[str, Any]) -> None:
        os.write(wfd, prefix + json.dumps(obj).encode() + b"\n")

    try:
        if own_group:
            os.setpgid(0, 0)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(log, 1)
        os.dup2(log, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        from .case import run_case

        result = run_case(spec, lambda name: send({"stage": name}),
                          lambda name, value: send({"check": name, "value": value}))
        path = os.path.join(os.path.dirname(log_path), RESULT_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
        send({"done": True})
    except BaseException:
        code = 1
        try:
            send({"error": traceback.format_exc()[-2000:]})
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


def _start(spec: dict[str, Any], wfd: int, rfd: int, log_path: str, token: str,
           start_method: str) -> int:
    """Start the case's process (its own process group); returns its pid."""
    if start_method == "spawn":
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconnect.vllm.conformance.runner", "--case",
             json.dumps(spec), str(wfd), log_path, token],
            pass_fds=(wfd,), start_new_session=True, stdin=subprocess.DEVNULL)
        return proc.pid
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        _child(spec, wfd, log_path, token)
    return pid


class _Progress:
    """What the parent learnt from a case's pipe: stage, checks, error, stray output."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.prefix = f"{_FRAME} {token} ".encode()
        self.stage, self.error, self.done = "start", None, False
        self.checks: dict[str, Any] = {}
        self.stray_bytes, self.stray_sample = 0, b""

    def _stray(self, data: bytes) -> None:
        self.stray_bytes += len(data)
        if len(self.stray_sample) < 200:
            self.stray_sample += data[:200 - len(self.stray_sample)]

    def line(self, line: bytes) -> None:
        """One line from the pipe: the case's message if framed by its token, else stray."""
        at = line.find(self.prefix)
        msg = None
        if at >= 0:
            try:
                msg = json.loads(line[at + len(self.prefix):])
            except ValueError:
                msg = None
        if not isinstance(msg, dict):
            self._stray(line + b"\n")
            return
        self._stray(line[:at])
        self.stage = msg.get("stage", self.stage)
        if "check" in msg:
            self.checks[str(msg["check"])] = msg.get("value")
        self.error = msg.get("error", self.error)
        self.done = self.done or bool(msg.get("done"))

    def overflow(self, buf: bytes) -> bytes:
        """A buffer over the line limit without a newline: stray, but keep a message that
        may start in it."""
        at = buf.rfind(self.prefix)
        keep = buf[at:] if at > 0 and len(buf) - at <= _MAX_LINE // 2 else b""
        self._stray(buf[:len(buf) - len(keep)])
        return keep

    def evidence(self) -> dict[str, Any]:
        return {"bytes": self.stray_bytes,
                "sample": self.stray_sample.decode(errors="replace")}


def _read_progress(rfd: int, progress: _Progress, deadline: float) -> None:
    """Read the case's pipe until it closes, the case says it is done, or ``deadline``."""
    buf = b""
    while not progress.done and progress.error is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        ready, _, _ = select.select([rfd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(rfd, 65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            progress.line(line)
        if len(buf) > _MAX_LINE:
            buf = progress.overflow(buf)
    if buf:
        progress.line(buf)


def _read_result(workdir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(workdir, RESULT_FILE)) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def _run_one(spec: dict[str, Any], timeout: float, log_dir: str, start_method: str = "fork"
             ) -> dict[str, Any]:
    rfd, wfd = os.pipe()
    workdir = tempfile.mkdtemp(dir=log_dir)
    spec = {**spec, "workdir": workdir}
    log_path = os.path.join(workdir, "case.log")
    progress = _Progress(secrets.token_hex(8))
    t0 = time.monotonic()
    try:
        pid = _start(spec, wfd, rfd, log_path, progress.token, start_method)
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    deadline = t0 + timeout
    try:
        _read_progress(rfd, progress, deadline)
    except BaseException:  # interrupted (SIGINT / SIGTERM): the case's process goes too
        _kill_group(pid)
        _reap(pid, 5.0)
        raise
    finally:
        os.close(rfd)
    timed_out = (not progress.done and progress.error is None
                 and time.monotonic() >= deadline)
    if timed_out:
        _kill_group(pid)
    status = _reap(pid, 10.0)
    result = _read_result(workdir) if progress.done else None
    out = dict(result or {"connector": spec["connector"], "layout": spec["layout"],
                          "num_blocks": spec.get("num_blocks"),
                          "capacity_blocks": spec.get("capacity_blocks"),
                          "checks": progress.checks})
    out["seconds"] = round(time.monotonic() - t0, 2)
    stage = progress.stage
    if progress.stray_bytes:
        out["stray_output"] = progress.evidence()
    if timed_out:
        out.update(status="timeout", stage=stage, evidence=f"no result within {timeout:g} s")
    elif os.WIFSIGNALED(status) and result is None:
        sig = signal.Signals(os.WTERMSIG(status)).name
        out.update(status="fault", signal=sig, stage=stage,
                   evidence=f"{sig} during {stage}")
    elif result is None:
        out.update(status="error", stage=stage,
                   evidence=(progress.error or _tail(log_path)
                             or "the case ended without a result")[-1500:])
    out.setdefault("status", case_status(out))
    return out


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int, timeout: float) -> int:
    """Wait up to ``timeout`` s for the case's process to exit (then kill its group), kill
    whatever else is left in its process group, reap it; its wait status."""
    deadline = time.monotonic() + timeout
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    _kill_group(pid)  # a zombie leader still holds the group's id: no other group is hit
    return os.waitpid(pid, 0)[1]


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
    timeout = check_timeout(timeout)
    specs = [dict(s) for s in specs]
    device = case_device(specs)
    if start_method == "fork":
        warm_up(device)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-conformance-logs-") as log_dir:
        for spec in specs:
            if start_method == "fork":
                _check_fork_safe(device)
            try:
                res = _run_one(spec, timeout, log_dir, start_method)
            except Exception as exc:  # noqa: BLE001 - one case's trouble never ends the run
                res = {"connector": spec.get("connector"), "layout": spec.get("layout"),
                       "checks": {}, "status": "error",
                       "evidence": f"the kit failed on this case: {type(exc).__name__}: "
                                   f"{exc}"[:1500]}
            results.append(res)
            if on_result is not None:
                on_result(res)
    return results


def _case_main(argv: list[str]) -> None:
    """``python -m kvconnect.vllm.conformance.runner --case SPEC_JSON FD LOG TOKEN``: one
    case in this fresh interpreter (the spawn start method)."""
    if len(argv) != 5 or argv[0] != "--case":
        sys.exit("usage: python -m kvconnect.vllm.conformance.runner --case SPEC_JSON FD LOG "
                 "TOKEN")
    _child(json.loads(argv[1]), int(argv[2]), argv[3], argv[4], own_group=False)


if __name__ == "__main__":
    _case_main(sys.argv[1:])
