"""stdout and stderr as the coordinator uses them: a closed, full or broken stream never
stops a run or loses its report.

- ``kvconnect-validate ... | head -1``: once the reader is gone (EPIPE) output is dropped
  quietly, as Unix tools end on a broken pipe, and the run goes on to write ``--json`` /
  ``--junit``; the exit code is the run's own verdict.
- ``>/dev/full`` (or any other write error): output is dropped after one line on stderr
  naming the error; the reports are still written.
- ``>&-`` (stdout or stderr closed when the process starts): the descriptor is pointed at
  ``/dev/null`` first, so no socket or file the run opens later takes fd 1 or 2, and
  writes go nowhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


def ensure_std_fds() -> None:
    """Open ``/dev/null`` on any of fds 0, 1, 2 that is closed (so the run's own files and
    sockets never become this process's stdout or stderr)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


class SafeStream:
    """A text stream whose writes never raise: after a broken pipe output is dropped
    quietly, after another error (``ENOSPC``) it is dropped after one note on ``notice``.
    ``stream`` None (closed at start-up) drops everything."""

    def __init__(self, stream: TextIO | None, name: str,
                 notice: TextIO | SafeStream | None = None) -> None:
        self._stream = stream
        self.name = name
        self._notice = notice
        #: why output is being dropped (``None`` while it still flows)
        self.broken: str | None = None if stream is not None else "closed"

    def _fail(self, exc: BaseException) -> None:
        self.broken = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            return  # the reader went away: end quietly
        if self._notice is not None:
            try:
                self._notice.write(f"kvconnect-validate: {self.name}: {self.broken}; "
                                   "dropping further output (the reports are still "
                                   "written)\n")
                self._notice.flush()
            except (OSError, ValueError, AttributeError):
                pass

    def write(self, text: str) -> int:
        if self.broken is None:
            try:
                assert self._stream is not None
                self._stream.write(text)
            except (OSError, ValueError) as exc:
                self._fail(exc)
        return len(text)

    def flush(self) -> None:
        if self.broken is None:
            try:
                assert self._stream is not None
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._fail(exc)

    def isatty(self) -> bool:
        try:
            return self.broken is None and self._stream is not None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        if self._stream is None:
            raise OSError(errno.EBADF, f"{self.name} is closed")
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


@contextlib.contextmanager
def safe_std_streams() -> Iterator[tuple[SafeStream, SafeStream]]:
    """While entered, ``sys.stdout`` and ``sys.stderr`` are :class:`SafeStream` s (closed
    descriptors pointed at ``/dev/null`` first); the originals come back on exit."""
    ensure_std_fds()
    out_orig, err_orig = sys.stdout, sys.stderr
    err = SafeStream(err_orig, "stderr")
    out = SafeStream(out_orig, "stdout", notice=err)
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        sys.stdout, sys.stderr = out_orig, err_orig
