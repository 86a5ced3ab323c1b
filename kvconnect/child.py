"""Child processes: start one, read its JSON lines within a deadline, end it, say how it ended.

The one way kvconnect's tools run a child (the harness's workers, the conformance kit's cases,
1P1D sides and engines; torch-free, standard library only):

- :meth:`Child.fork` runs a function in a fork of this process (imports already paid);
  :meth:`Child.spawn` runs a command line. Both point stdin at ``/dev/null`` and stdout and
  stderr at a log file, and with ``own_group`` put the child in a process group of its own
  (a fork sets it on both sides, so no signal can miss it).
- :meth:`Child.end` is the one exit path: wait up to ``wait_s`` for the child to exit, then
  (optionally SIGTERM, then) SIGKILL it, and its whole process group with ``own_group``,
  and reap it. The group is signalled while its leader is not reaped yet (a zombie still
  holds the group's id), so no other process's group can be hit, and anything the child
  left running in its group goes with it. ``with Child.fork(...) as child:`` ends it on
  every path.
- :class:`LineReader` reads newline-terminated lines from a pipe, each within a deadline,
  with a bound on a line's length; :class:`LineWriter` is the child's end (JSON per line).
- :func:`exit_text` and :func:`exit_signal_name` put an exit status (``returncode``: negative
  for a death by signal) in words, for reports.

Units: seconds (monotonic clock), bytes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["MAX_LINE_BYTES", "Child", "LineReader", "LineWriter", "exit_signal_name",
           "exit_text", "log_tail", "signal_name"]

log = logging.getLogger(__name__)

#: bound on one line a child sends (bytes); a longer one goes to ``LineReader.on_overflow``
MAX_LINE_BYTES = 1 << 20
#: seconds :meth:`Child.end` waits for a SIGKILLed child before giving up reaping it
REAP_TIMEOUT_S = 30.0
#: signals a forked child gets back to their default action (not the parent's handlers)
_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal 99`` for a number Python has no name for."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_signal_name(code: int | None) -> str | None:
    """``SIGKILL`` for an exit status (``returncode``) of ``-9``; None for a normal exit or
    no exit yet."""
    if code is None or code >= 0:
        return None
    return signal_name(-code)


def exit_text(code: int | None) -> str:
    """An exit status in words: ``exit code 1``, ``killed by SIGKILL``, ``still running``."""
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {exit_signal_name(code)}"
    return f"exit code {code}"


def log_tail(path: str, lines: int | None = None, max_bytes: int = 16384) -> str:
    """The end of a child's log: its last ``max_bytes`` bytes, of those the last ``lines``
    lines (None: all); "" when it cannot be read. Undecodable bytes are replaced."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return text if lines is None else "\n".join(text.rstrip().splitlines()[-lines:])


class Child:
    """One child process this process started and owns (from :meth:`fork` or :meth:`spawn`).

    Popen's interface where the callers need it: ``pid``, ``returncode`` (None until reaped;
    negative: the signal that killed it), :meth:`poll`, :meth:`wait` (``subprocess.
    TimeoutExpired`` past its timeout), :meth:`kill`; and :meth:`end`, which always leaves it
    (and, with ``own_group``, its process group) dead and reaped.
    """

    def __init__(self, pid: int, *, own_group: bool,
                 popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self.own_group = own_group
        self.returncode: int | None = None
        self._popen = popen

    # -- starting ------------------------------------------------------------------------------
    @classmethod
    def fork(cls, body: Callable[[], int], *, log_path: str | None, own_group: bool,
             close_fds: Iterable[int] = ()) -> Child:
        """Fork; the child closes ``close_fds``, points stdin at ``/dev/null`` and stdout /
        stderr at ``log_path`` (truncated, 0600; None: inherited), restores SIGINT / SIGTERM
        / SIGHUP to their defaults, runs ``body()`` and leaves through ``os._exit`` with its
        return value (1 and the traceback in the log when it raised): never back into the
        parent's stack."""
        logfd = (os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                 if log_path is not None else None)
        for stream in (sys.stdout, sys.stderr):  # no buffered output written twice
            if stream is not None:
                stream.flush()
        try:
            pid = os.fork()
        except BaseException:
            if logfd is not None:
                os.close(logfd)
            raise
        if pid == 0:  # pragma: no cover - runs in the child (the callers' tests cover it)
            _run_forked(body, logfd, own_group, list(close_fds))
        if logfd is not None:
            os.close(logfd)
        if own_group:
            try:
                os.setpgid(pid, pid)  # also the parent: the group exists before fork returns
            except OSError:
                pass  # the child did it first, or exec'd / exited already
        return cls(pid, own_group=own_group)

    @classmethod
    def spawn(cls, argv: Sequence[str], *, log_path: str | None, own_group: bool,
              env: Mapping[str, str] | None = None, cwd: str | None = None,
              pass_fds: Sequence[int] = ()) -> Child:
        """Run ``argv`` (stdin ``/dev/null``, stdout and stderr into ``log_path``, None:
        inherited; every other fd but ``pass_fds`` closed); with ``own_group`` in a new
        session, so in a process group of its own."""
        with open(log_path, "wb") if log_path is not None else contextlib.nullcontext() as logf:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT if logf is not None else None,
                                    env=None if env is None else dict(env), cwd=cwd,
                                    close_fds=True, pass_fds=tuple(pass_fds),
                                    start_new_session=own_group)
        return cls(proc.pid, own_group=own_group, popen=proc)

    # -- Popen's interface ---------------------------------------------------------------------
    def poll(self) -> int | None:
        """The exit status once the child exited (reaping it), else None."""
        if self.returncode is not None:
            return self.returncode
        if self._popen is not None:
            self.returncode = self._popen.poll()
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped elsewhere: its status is lost
            self.returncode = -signal.SIGKILL
            return self.returncode
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Reap the child within ``timeout`` seconds (None: no limit); its exit status.
        Raises ``subprocess.TimeoutExpired`` when it is still running then."""
        if self._popen is not None and self.returncode is None:
            self.returncode = self._popen.wait(timeout)
        if not self.wait_exit(float("inf") if timeout is None else timeout):
            raise subprocess.TimeoutExpired(f"child pid {self.pid}", timeout or 0)
        code = self.poll()  # exited: this reaps it
        assert code is not None
        return code

    def kill(self) -> None:
        """SIGKILL the child (its process group with ``own_group``) unless it was reaped."""
        self._signal(signal.SIGKILL)

    # -- ending --------------------------------------------------------------------------------
    def exited(self) -> bool:
        """True once the child has exited (reaped or not); never reaps it."""
        if self.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid,
                             os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            self.poll()
            return True

    def end(self, wait_s: float = 0.0, *, term_grace_s: float = 0.0) -> int:
        """Give the child ``wait_s`` seconds to exit by itself; then, with ``term_grace_s``,
        SIGTERM it and give it that long; then SIGKILL it (its whole group with
        ``own_group``: what it left running too) and reap it. Its exit status (a child that
        cannot be reaped within :data:`REAP_TIMEOUT_S` is logged, its status then -9)."""
        self.wait_exit(wait_s)
        if self.returncode is None:  # not reaped: the pid and the group id are still ours
            if term_grace_s > 0 and not self.exited():
                self._signal(signal.SIGTERM)
                self.wait_exit(term_grace_s)
            self._signal(signal.SIGKILL)
        try:
            return self.wait(REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            log.error("child pid %d did not die after SIGKILL", self.pid)
            return -signal.SIGKILL

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def wait_exit(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the child to exit, without reaping it; whether it did."""
        deadline = time.monotonic() + seconds
        pause = 0.005
        while not self.exited():
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.05)
        return True

    def _signal(self, signum: int) -> None:
        if self.returncode is not None:
            return  # reaped: the pid (and group id) may belong to another process now
        try:
            if self.own_group:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _run_forked(body: Callable[[], int], logfd: int | None, own_group: bool,
                close_fds: list[int]) -> None:  # pragma: no cover - runs in the child
    code = 1
    try:
        if own_group:
            os.setpgid(0, 0)
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        if logfd is not None:
            os.dup2(logfd, 1)
            os.dup2(logfd, 2)
            os.close(logfd)
        for signum in _RESET_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        code = body()
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


class LineReader:
    """Newline-terminated lines from the read end of a pipe, each waited for until a
    deadline. A line longer than ``max_line`` bytes goes to ``on_overflow(buffer)``, which
    returns what to keep (default: nothing; ``dropped_bytes`` counts it)."""

    def __init__(self, fd: int, *, max_line: int = MAX_LINE_BYTES,
                 on_overflow: Callable[[bytes], bytes] | None = None) -> None:
        self.fd = fd
        self.max_line = max_line
        self.on_overflow = on_overflow or self._drop
        self.eof = False
        self.dropped_bytes = 0
        self._buf = b""

    def next_line(self, deadline: float) -> bytes | None:
        """The next line (without its newline); None at end of file (see :meth:`rest`) or
        when ``deadline`` (monotonic seconds) passed first."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if self.eof or left <= 0:
                return None
            if not poller.poll(min(left, 1.0) * 1000):
                continue
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.eof = True
                continue
            self._buf += chunk
            if len(self._buf) > self.max_line and b"\n" not in self._buf:
                self._buf = self.on_overflow(self._buf)
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def json(self, deadline: float) -> Any:
        """The next line as JSON (None as :meth:`next_line`); ValueError if it is not."""
        line = self.next_line(deadline)
        return None if line is None else json.loads(line)

    def rest(self) -> bytes:
        """Bytes read after the last newline (a line cut off at end of file); taken once."""
        rest, self._buf = self._buf, b""
        return rest

    def _drop(self, buf: bytes) -> bytes:
        self.dropped_bytes += len(buf)
        return b""


class LineWriter:
    """The child's end: one JSON document per line, each after ``prefix``."""

    def __init__(self, fd: int, prefix: bytes = b"") -> None:
        self.fd = fd
        self.prefix = prefix

    def send(self, obj: Mapping[str, Any]) -> None:
        data = self.prefix + json.dumps(obj).encode() + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def run(self, work: Callable[[], object], limit: int = 2000) -> int:
        """``work()``, then 0; when it raises, 1 after sending ``{"error": traceback}``
        (its last ``limit`` characters) if the pipe still takes it."""
        try:
            work()
        except BaseException:
            try:
                self.send({"error": traceback.format_exc()[-limit:]})
            except OSError:
                pass
            return 1
        return 0
