"""Starting, stopping and describing local worker processes (the coordinator's side).

A worker is started either by forking the coordinator (host backend: torch is imported once)
or as a fresh ``python -m kvconnect.harness.worker`` (CUDA: a process that may have
initialised CUDA must not fork). Both give a :class:`kvconnect.child.Child` (Popen's ``pid``,
``poll``, ``wait``, ``kill``, ``returncode``; exit statuses in words are
:func:`kvconnect.child.exit_text`). :func:`proc_state` is the probe of a process's ``/proc``
state the coordinator quotes in its reports (the fds it checks: :mod:`..footprint`).
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from kvconnect.child import Child

from ..config import RunConfig
from ..rundir import janitor_fds

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
    import kvconnect.connectors  # noqa: F401  (offload, copy, registry: every built-in transport)
    import kvconnect.kv_cache  # noqa: F401

    from ..worker import decode, prefill, process, reference_copies, scenario  # noqa: F401


def transport_environment() -> dict[str, str]:
    """The variables every registered transport wants in worker processes (its spec's
    ``environment``; a value already set wins)."""
    from kvconnect.connectors.registry import get_transport, transport_names

    out: dict[str, str] = {}
    for name in transport_names():
        out.update(get_transport(name).environment)
    return out


def start_worker(method: str, args: list[str], log_path: str,
                 listener: socket.socket | None) -> Child:
    """Start one worker with ``args`` (``--connect``, ``--role``, ``--rank``), stdout and
    stderr into ``log_path``: forked (``method`` ``fork``) or a fresh interpreter. Workers
    stay in the coordinator's process group (a terminal's Ctrl-C reaches them too)."""
    if method == "fork":
        return fork_worker(args, log_path, listener)
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in transport_environment().items():  # e.g. UCX names its lanes
        env.setdefault(key, value)
    cmd = [sys.executable, "-m", "kvconnect.harness.worker", *args]
    return Child.spawn(cmd, log_path=log_path, own_group=False, env=env)


def fork_worker(args: list[str], log_path: str, listener: socket.socket | None) -> Child:
    """A worker forked from the coordinator (host backend).

    Fork happens before the coordinator starts any thread, so the child inherits no lock
    held by another thread; the child closes the listening socket and the run directory's
    janitor fds (:meth:`Child.fork` does the rest: stdio, signal handlers, ``os._exit``)."""
    if threading.active_count() > 1:
        raise RuntimeError("cannot fork workers once the coordinator runs threads")

    def body() -> int:  # pragma: no cover - runs in the child (covered by the e2e tests)
        if listener is not None:
            os.close(listener.detach())
        for fd in janitor_fds():
            os.close(fd)
        os.environ["PYTHONUNBUFFERED"] = "1"
        for key, value in transport_environment().items():  # e.g. UCX names its lanes
            os.environ.setdefault(key, value)
        from ..worker.process import main as worker_main

        return worker_main(args)

    return Child.fork(body, log_path=log_path, own_group=False)


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
