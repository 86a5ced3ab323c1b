"""Test helper: a child process driven by JSON lines, both sides of the protocol.

The parent sends one JSON command per line on the child's stdin; the child answers with
lines ``KVC {json}`` on stdout (the prefix keeps stray library output from being taken for a
reply), every reply carrying ``"ok"`` (false with an ``"error"`` when a command failed). The
child's first reply is its hello (``ready``, its pid, or what it publishes at start).

- Parent: :class:`JsonLinePeer` starts the child, reads every reply under a deadline, shows
  the child's stderr in errors; :meth:`~JsonLinePeer.close` asks it to exit, then kills it,
  and closes every pipe; :meth:`~JsonLinePeer.kill` SIGKILLs and reaps it.
- Child: :func:`reply` writes one reply; :func:`serve` reads commands and calls a handler
  for each, and ``idle()`` between them (to drive NIXL progress, for example).

Children run with this directory on ``PYTHONPATH``, so they can ``import _json_peer`` (and
the other helpers here) whether they are a file or ``python -c`` code.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

PREFIX = "KVC "
HERE = Path(__file__).resolve().parent


# -- the child's side ------------------------------------------------------------------------
def reply(obj: dict[str, Any]) -> None:
    """Write one reply line (``ok`` defaults to True)."""
    sys.stdout.write(PREFIX + json.dumps({"ok": True, **obj}) + "\n")
    sys.stdout.flush()


def serve(handle: Callable[[dict[str, Any]], bool | None],
          idle: Callable[[], None] | None = None, poll_s: float = 0.001) -> int:
    """Answer commands from stdin until ``{"op": "exit"}`` (replied to) or end of input.

    ``handle(cmd)`` replies itself (:func:`reply`); an exception it raises becomes an
    ``ok: false`` reply naming it. ``idle()`` runs every ``poll_s`` seconds while no command
    is waiting. Returns the exit status (0).
    """
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            while b"\n" not in buf:
                if sel.select(poll_s if idle is not None else None):
                    chunk = os.read(sys.stdin.fileno(), 1 << 16)
                    if not chunk:
                        return 0
                    buf += chunk
                elif idle is not None:
                    idle()
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            if cmd.get("op") == "exit":
                reply({})
                return 0
            try:
                handle(cmd)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        sel.close()


# -- the parent's side -----------------------------------------------------------------------
class JsonLinePeer:
    """A child process ``[sys.executable, "-u", *argv]`` speaking JSON lines.

    Waits up to ``startup_timeout`` seconds for the child's first reply (:attr:`hello`).
    ``capture_stderr=False`` sends the child's stderr to /dev/null (a child that is itself a
    test's subject prints only what it reports).
    """

    def __init__(self, argv: Sequence[str], startup_timeout: float = 120.0,
                 capture_stderr: bool = True) -> None:
        self.stderr = tempfile.TemporaryFile() if capture_stderr else None
        path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-u", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.stderr if self.stderr is not None else subprocess.DEVNULL,
            env=dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path))
        self.pid = self.proc.pid
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        self._closed = False
        try:
            self.hello = self.recv(startup_timeout)
        except BaseException:
            self.close()
            raise

    @classmethod
    def script(cls, name: str, *args: str, **kwargs: Any) -> JsonLinePeer:
        """Run ``tests/<name>`` with ``args``."""
        return cls([str(HERE / name), *args], **kwargs)

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        """The next reply; RuntimeError if it says ``ok: false`` or the child exited,
        TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(PREFIX.encode()):
                    msg = json.loads(line[len(PREFIX):])
                    if not msg.get("ok"):
                        raise RuntimeError(f"peer failed: {msg.get('error')}\n{self.log()}")
                    return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the peer within {timeout} s\n{self.log()}")
            if self._sel.select(left):
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError(f"peer exited with {self.proc.poll()}\n{self.log()}")
                self._buf += chunk

    def call(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        """:meth:`send` then :meth:`recv`."""
        self.send(**cmd)
        return self.recv(timeout)

    def log(self) -> str:
        if self.stderr is None:
            return "(peer stderr not captured)"
        self.stderr.seek(0)
        return "peer stderr (tail):\n" + self.stderr.read().decode(errors="replace")[-4000:]

    def kill(self) -> int:
        """SIGKILL the child and reap it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        """Ask the child to exit (killing it if it does not), close every pipe (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                self.call(op="exit", timeout=20)
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - fall back to killing it
                self.kill()
        self._sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe after a kill
                pass
        if self.stderr is not None:
            self.stderr.close()

    def __enter__(self) -> JsonLinePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
