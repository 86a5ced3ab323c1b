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
kvconnect.harness.conformance.runner``: vLLM's import paid per case).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvconnect.child import Child, LineReader, LineWriter, exit_signal_name, exit_text, log_tail
from kvconnect.errors import KvconnectError
from kvconnect.leftovers import become_subreaper, children, end_leftovers, is_subreaper
from kvconnect.verdicts import (
    ENDED_EARLY,
    ERROR,
    FAIL,
    FAULT,
    PASS,
    REFUSED,
    TIMEOUT,
    check_entry,
)

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

    import kvconnect.harness.conformance.case  # noqa: F401
    import kvconnect.vllm.cache  # noqa: F401

    from .compat import kv_cache_planning_module

    kv_cache_planning_module()


def case_status(result: dict[str, Any]) -> str:
    """``pass`` when every check passed (or was skipped); ``refused`` when kvconnect's
    bounding declined the layout before anything was registered; else ``fail``, ``fault``
    or ``timeout`` as the case ended."""
    if result.get("status") in ENDED_EARLY:
        return str(result["status"])
    checks = result.get("checks", {})
    if checks.get("register", {}).get("status") == REFUSED:
        return REFUSED
    if not checks or any(c.get("status") == FAIL for c in checks.values()):
        return FAIL
    return PASS


def check_timeout(timeout: float) -> float:
    """``timeout`` (seconds per case) when it is a number above 0 and at most a day; else
    ValueError."""
    from .options import parse_timeout

    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout {timeout!r}: seconds per case, a number above 0")
    return parse_timeout(timeout)


def _case_body(spec: dict[str, Any], wfd: int, token: str) -> int:
    """In the case's process (stdio already on its log): run the case, send progress lines
    framed by ``token``, write the result file into the case's work folder."""
    out = LineWriter(wfd, f"{_FRAME} {token} ".encode())

    def work() -> None:
        from .case import run_case

        try:
            result = run_case(spec, lambda name: out.send({"stage": name}),
                              lambda name, value: out.send({"check": name, "value": value}))
        except KvconnectError as exc:  # ours (e.g. not a connector): its message says it all
            out.send({"error": f"{type(exc).__name__}: {exc}"})
            return
        path = os.path.join(spec["workdir"], RESULT_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
        out.send({"done": True})

    return out.run(work)


def _start(spec: dict[str, Any], wfd: int, rfd: int, log_path: str, token: str,
           start_method: str) -> Child:
    """Start the case's process in its own process group."""
    if start_method == "spawn":
        return Child.spawn([sys.executable, "-m", "kvconnect.harness.conformance.runner",
                            "--case", json.dumps(spec), str(wfd), token],
                           log_path=log_path, own_group=True, pass_fds=(wfd,))
    return Child.fork(lambda: _case_body(spec, wfd, token), log_path=log_path,
                      own_group=True, close_fds=(rfd,))


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
    reader = LineReader(rfd, max_line=_MAX_LINE, on_overflow=progress.overflow)
    while not progress.done and progress.error is None:
        line = reader.next_line(deadline)
        if line is None:
            break
        progress.line(line)
    rest = reader.rest()
    if rest:
        progress.line(rest)


def _read_result(workdir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(workdir, RESULT_FILE)) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def _run_one(spec: dict[str, Any], timeout: float, log_dir: str, start_method: str = "fork"
             ) -> dict[str, Any]:
    ours_before = set(children())  # what is not among these afterwards came from the case
    rfd, wfd = os.pipe()
    workdir = tempfile.mkdtemp(dir=log_dir)
    spec = {**spec, "workdir": workdir}
    log_path = os.path.join(workdir, "case.log")
    progress = _Progress(secrets.token_hex(8))
    t0 = time.monotonic()
    try:
        child = _start(spec, wfd, rfd, log_path, progress.token, start_method)
    except BaseException:
        os.close(rfd)
        raise
    finally:
        os.close(wfd)
    deadline = t0 + timeout
    try:
        _read_progress(rfd, progress, deadline)
    except BaseException:  # interrupted (SIGINT / SIGTERM): the case's process goes too
        child.end()
        raise
    finally:
        os.close(rfd)
    timed_out = (not progress.done and progress.error is None
                 and time.monotonic() >= deadline)
    code = child.end(0.0 if timed_out else 10.0)
    left = end_leftovers(child.pid, led_session=start_method == "spawn",
                         ours_before=ours_before)
    result = _read_result(workdir) if progress.done else None
    out = dict(result or {"connector": spec["connector"], "layout": spec["layout"],
                          "num_blocks": spec.get("num_blocks"),
                          "capacity_blocks": spec.get("capacity_blocks"),
                          "checks": progress.checks})
    out["seconds"] = round(time.monotonic() - t0, 2)
    if progress.stray_bytes:
        out["stray_output"] = progress.evidence()
    out.setdefault("checks", {})["leftovers"] = _leftovers_check(left)
    _how_it_ended(out, progress, timed_out=timed_out, code=code, has_result=result is not None,
                  timeout=timeout, log_path=log_path)
    out.setdefault("status", case_status(out))
    return out


def _leftovers_check(left: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``leftovers`` check: no process of the case's (its group, its session, an orphan
    of its tree) outlived it; those that did are named here (the kit ended them)."""
    if not left:
        return check_entry(PASS, processes=0)
    names = ", ".join(f"{p['name']} (pid {p['pid']}, {p['found_by']})" for p in left[:5])
    return check_entry(FAIL, processes=len(left), left=left[:20],
                       error=f"left {len(left)} process(es) running after the case ended, "
                             f"ended by the kit: {names}")


def _last_lines(text: str, limit: int = 1500) -> str:
    """The end of ``text``, at most ``limit`` characters, starting at a line (never in the
    middle of a word): the end of a traceback says what was raised."""
    if len(text) <= limit:
        return text
    tail = text[-limit:]
    cut = tail.find("\n")
    return tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail


def _how_it_ended(out: dict[str, Any], progress: _Progress, *, timed_out: bool, code: int,
                  has_result: bool, timeout: float, log_path: str) -> None:
    """``timeout``, ``fault`` (a death by signal, named, with the stage it died in) or
    ``error`` (no result) into ``out``; nothing for a case that left its result."""
    stage = progress.stage
    sig = exit_signal_name(code)
    if timed_out:
        out.update(status=TIMEOUT, stage=stage, evidence=f"no result within {timeout:g} s")
    elif sig is not None and not has_result:
        out.update(status=FAULT, signal=sig, stage=stage, evidence=f"{sig} during {stage}")
    elif not has_result:
        tail = log_tail(log_path, max_bytes=2000)
        if tail:
            out["log_tail"] = _last_lines(tail)
        evidence = (_last_lines(str(progress.error)) if progress.error else
                    f"the case's process ended ({exit_text(code)}) before it reported a result, "
                    f"in stage {stage!r}")
        out.update(status=ERROR, stage=stage, evidence=evidence)


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
    :data:`~kvconnect.harness.conformance.case.CASE_DEFAULTS`) in its own process: a fork of
    this one (vLLM imported once) or, with ``start_method="spawn"``, a fresh interpreter."""
    if start_method not in START_METHODS:
        raise ValueError(f"start_method {start_method!r}: choose from {START_METHODS}")
    timeout = check_timeout(timeout)
    specs = [dict(s) for s in specs]
    device = case_device(specs)
    if start_method == "fork":
        warm_up(device)
    results: list[dict[str, Any]] = []
    # the orphans of a case's process tree (a daemonizing connector) are adopted here, found
    # and ended after the case (the ``leftovers`` check)
    was_subreaper = is_subreaper()
    become_subreaper(True)
    try:
        _run_all(specs, timeout, start_method, device, results, on_result)
    finally:
        if not was_subreaper:
            become_subreaper(False)
    return results


def _run_all(specs: list[dict[str, Any]], timeout: float, start_method: str, device: str,
             results: list[dict[str, Any]],
             on_result: Callable[[dict[str, Any]], None] | None) -> None:
    with tempfile.TemporaryDirectory(prefix="kvconnect-conformance-logs-") as log_dir:
        for spec in specs:
            if start_method == "fork":
                _check_fork_safe(device)
            try:
                res = _run_one(spec, timeout, log_dir, start_method)
            except Exception as exc:  # noqa: BLE001 - one case's trouble never ends the run
                res = {"connector": spec.get("connector"), "layout": spec.get("layout"),
                       "checks": {}, "status": ERROR,
                       "evidence": f"the kit failed on this case: {type(exc).__name__}: "
                                   f"{exc}"[:1500]}
            results.append(res)
            if on_result is not None:
                on_result(res)


def _case_main(argv: list[str]) -> None:
    """``python -m kvconnect.harness.conformance.runner --case SPEC_JSON FD TOKEN``: one case
    in this fresh interpreter (the spawn start method; the parent points stdio at its log)."""
    if len(argv) != 4 or argv[0] != "--case":
        sys.exit("usage: python -m kvconnect.harness.conformance.runner --case SPEC_JSON FD "
                 "TOKEN")
    code = _case_body(json.loads(argv[1]), int(argv[2]), argv[3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's atexit teardown can hang: the result is written


if __name__ == "__main__":
    _case_main(sys.argv[1:])
