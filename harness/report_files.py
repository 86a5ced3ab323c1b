"""Where ``--json`` / ``--junit`` reports go: checked before the run, written after it.

What a report path may be (the decision of issue 16, docs/validate.md says the same):

- a regular file, a path that does not exist yet, or a symbolic link to either: **replaced
  atomically** (a temporary file beside the target, renamed over it), so a reader never
  sees half a report. A link is followed: the link stays, the file it points at is replaced;
- a character device or a FIFO (``/dev/null``, ``/dev/stdout``, a terminal, a named pipe),
  or the file this process's own stdout or stderr is (``--json /dev/stdout > out.txt``):
  **written through**, in place, never replaced (as root, ``--json /dev/null`` must not
  turn the system's ``/dev/null`` into a regular file). A FIFO must get a reader within
  :data:`WRITE_THROUGH_TIMEOUT_S` and take the whole report by then;
- anything else (a directory, a block device, a socket, a link loop, a name longer than the
  file system allows): refused before any worker starts (``kvconnect-validate`` exits 2).
"""

from __future__ import annotations

import errno
import os
import select
import stat
import sys
import tempfile
import time

from kvconnect.checks import check_can_create_file
from kvconnect.errors import KvconnectError

#: longest a write-through report (FIFO, terminal, pipe) may wait for its reader
WRITE_THROUGH_TIMEOUT_S = 30.0
#: bytes handed to one ``write`` of a write-through report (a pipe's atomic size)
_CHUNK = 4096


class ReportPathError(KvconnectError, ValueError):
    """A report path that cannot be written (the message says why and what to do)."""


def _stat(path: str) -> os.stat_result | None:
    """``os.stat`` (links followed), None when nothing is there yet."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _std_fd(st: os.stat_result) -> int | None:
    """1 or 2 when ``st`` is the file this process's stdout or stderr is, else None."""
    for fd in (1, 2):
        try:
            other = os.fstat(fd)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return fd
    return None


def writes_through(st: os.stat_result | None) -> bool:
    """True when a report to a file with this status is written in place, not replaced."""
    if st is None:
        return False
    return stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode) or _std_fd(st) is not None


def check_report_path(flag: str, path: str) -> None:
    """Raise :class:`ReportPathError` unless a report can be written to ``path`` (see the
    module docstring): what the writer will do is tried now, so a bad path fails before the
    run, not after it."""
    where = f"{flag} {path}"
    try:
        st = _stat(path)
    except OSError as exc:  # ELOOP, ENAMETOOLONG, EACCES, ENOTDIR
        raise ReportPathError(f"{where}: {exc.strerror or exc}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ReportPathError(f"{where}: is a directory, expected a file path")
    if writes_through(st):
        assert st is not None
        if not os.access(path, os.W_OK):
            raise ReportPathError(f"{where}: not writable by this user")
        return
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a block device" if stat.S_ISBLK(st.st_mode) else (
            "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise ReportPathError(f"{where}: is {kind}; give a regular file, a new path, or a "
                              "character device / FIFO to write through (/dev/stdout)")
    target = os.path.realpath(path)
    directory = os.path.dirname(target) or "."
    if not os.path.isdir(directory):
        raise ReportPathError(f"{where}: directory {directory} does not exist")
    _probe_directory(where, directory)
    if st is None:
        _probe_name(where, target)


def _probe_directory(where: str, directory: str) -> None:
    """A temporary file can be created (and renamed) in ``directory``."""
    try:
        check_can_create_file(directory)
    except OSError as exc:
        raise ReportPathError(f"{where}: cannot create a file in {directory}: "
                              f"{exc.strerror or exc}") from None


def _probe_name(where: str, target: str) -> None:
    """The report's own name can be created (a name too long for the file system, a
    character it refuses), then removes it again."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # created meanwhile by someone else: the name is fine
    except OSError as exc:
        name = os.path.basename(target)
        hint = (f" (the name is {len(name.encode())} bytes)"
                if exc.errno == errno.ENAMETOOLONG else "")
        raise ReportPathError(f"{where}: cannot create {target}: "
                              f"{exc.strerror or exc}{hint}") from None
    os.close(fd)
    os.unlink(target)


def same_report_file(a: str, b: str) -> bool:
    """True when two report paths would replace the same regular file."""
    sa, sb = _stat(a), _stat(b)
    if writes_through(sa) or writes_through(sb):
        return False
    if sa is not None and sb is not None:
        return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
    return os.path.realpath(a) == os.path.realpath(b)


def write_report(path: str, text: str, timeout: float = WRITE_THROUGH_TIMEOUT_S) -> None:
    """Write ``text`` to ``path`` as the module docstring says: replace a regular file
    atomically, write through a device, FIFO or this process's own stdout / stderr (at most
    ``timeout`` seconds). OSError when it cannot."""
    st = _stat(path)
    if writes_through(st):
        assert st is not None
        fd = _std_fd(st)
        if fd is not None:
            for stream in (sys.stdout, sys.stderr):
                try:
                    if stream is not None:
                        stream.flush()
                except (OSError, ValueError):
                    pass
            _write_all(fd, text.encode(), time.monotonic() + timeout, path)
        else:
            _write_through(path, text.encode(), timeout)
        return
    _atomic_replace(os.path.realpath(path), text)


def _write_through(path: str, data: bytes, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            break
        except OSError as exc:
            if exc.errno != errno.ENXIO or time.monotonic() > deadline:
                raise  # ENXIO: a FIFO nobody reads (yet)
            time.sleep(0.1)
    try:
        _write_all(fd, data, deadline, path)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes, deadline: float, path: str) -> None:
    """Write every byte of ``data`` to ``fd`` by ``deadline`` (waiting while it is full)."""
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, f"{len(view)} bytes of the report were not "
                                                f"taken by the reader of {path} in time")
        select.select([], [fd], [], left)
        try:
            n = os.write(fd, view[:_CHUNK])
        except BlockingIOError:
            continue
        view = view[n:]


def _atomic_replace(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".kvconnect-", dir=directory)
    try:
        mask = os.umask(0o022)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
