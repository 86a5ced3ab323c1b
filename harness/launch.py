"""Starting, stopping and describing local worker processes (the coordinator's side).

A worker is started either by forking the coordinator (host backend: torch is imported once)
or as a fresh ``python -m kvconnect.harness.worker`` (CUDA: a process that may have
initialised CUDA must not fork). Both give an object with Popen's ``pid``, ``poll``,
``wait``, ``kill`` and ``returncode``. The rest are small probes of a process the coordinator
quotes in its reports: exit status in words, ``/proc`` state, the tail of a log, open fds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from .config import RunConfig
from .rundir import janitor_fds

LAUNCH_ENV = "KVCONNECT_VALIDATE_LAUNCH"


def launch_method(cfg: RunConfig) -> str:
    """``fork`` for the host backend (workers start without re-importing torch: seconds
    saved per worker on small machines), ``subprocess`` for CUDA (a process that may have
    initialised CUDA must not fork). ``KVCONNECT_VALIDATE_LAUNCH`` overrides."""
    forced = os.environ.get(LAUNCH_ENV, "")
    if forced in ("fork", "subprocess"):
        if forced == "fork" and cfg.device != "host":
            raise ValueError(f"{LAUNCH_ENV}=fork is only safe on the host backend")
        return forced
    return "fork" if cfg.device == "host" else "subprocess"


def preload_worker_modules() -> None:
    """Import what every worker needs once, before forking (never initialises a device)."""
    import kvconnect.connectors  # noqa: F401  (every built-in transport, offload, copy)
    import kvconnect.kv_cache  # noqa: F401

    from . import decode, prefill, scenario, transports, worker  # noqa: F401


def transport_environment() -> dict[str, str]:
    """The variables every registered transport wants in worker processes (its spec's
    ``environment``; a value already set wins)."""
    from kvconnect.connectors.registry import get_transport, transport_names

    out: dict[str, str] = {}
    for name in transport_names():
        out.update(get_transport(name).environment)
    return out


def start_worker(method: str, args: list[str], log_path: str,
                 listener: socket.socket | None) -> Any:
    """Start one worker with ``args`` (``--connect``, ``--role``, ``--rank``), stdout and
    stderr into ``log_path``; returns a Popen-like object."""
    if method == "fork":
        return ForkedWorker.start(args, log_path, listener)
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in transport_environment().items():  # e.g. UCX names its lanes
        env.setdefault(key, value)
    cmd = [sys.executable, "-m", "kvconnect.harness.worker", *args]
    with open(log_path, "wb") as logf:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=subprocess.STDOUT, env=env, close_fds=True)


class ForkedWorker:
    """A worker forked from the coordinator (host backend). The subset of Popen's interface
    the coordinator uses: ``pid``, ``poll``, ``wait``, ``kill``, ``returncode``.

    Fork happens before the coordinator starts any thread, so the child inherits no lock held
    by another thread; the child closes the listening socket, points stdout/stderr at its log
    and leaves through ``os._exit`` (never back into the coordinator's stack).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, args: list[str], log_path: str, listener: socket.socket | None,
              ) -> ForkedWorker:
        if threading.active_count() > 1:
            raise RuntimeError("cannot fork workers once the coordinator runs threads")
        logfd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except BaseException:
            os.close(logfd)
            raise
        if pid == 0:  # pragma: no cover - runs in the child (covered by the e2e tests)
            code = 1
            try:
                if listener is not None:
                    os.close(listener.detach())
                for fd in janitor_fds():
                    os.close(fd)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.close(null)
                os.dup2(logfd, 1)
                os.dup2(logfd, 2)
                os.close(logfd)
                for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(signum, signal.SIG_DFL)  # not the coordinator's handler
                os.environ["PYTHONUNBUFFERED"] = "1"
                for key, value in transport_environment().items():
                    os.environ.setdefault(key, value)
                from .worker import main as worker_main

                code = worker_main(args)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(logfd)
        return cls(pid)

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL if self.returncode is None else self.returncode
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.005
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def kill_process(proc: Any) -> None:
    """SIGKILL ``proc`` if it still runs (a Popen or :class:`ForkedWorker`)."""
    if proc.poll() is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def exit_signal_name(code: int | None) -> str | None:
    """``SIGKILL`` for an exit status of ``-9``; None for a normal exit or no exit yet."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_text(code: int | None) -> str:
    """An exit status in words: ``exit code 1``, ``killed by SIGKILL``, ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {exit_signal_name(code)}"
    return f"exit code {code}"


def open_fds() -> set[int]:
    """This process's open fds (empty where /proc is missing)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return set()
    fds = {int(n) for n in names}
    return {fd for fd in fds if fd_target(fd) != ""}  # drop the one listdir itself used


def fd_target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def proc_state(pid: int) -> str:
    """The ``State:`` line of /proc/PID/status (e.g. ``T (stopped)``), or ``gone``."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("State:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "gone"


def log_tail(path: str, lines: int) -> str:
    """The last ``lines`` lines of ``path`` (at most its last 16 KiB), or ""."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 16384))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.rstrip().splitlines()[-lines:])
