"""The private directory of one run: its Unix sockets and worker logs.

``$TMPDIR/kvv-XXXXXXXX`` (``/tmp`` when $TMPDIR is too long for Unix socket paths), mode
0700, holding ``owner.json``: the pid, process start time and boot id of the process that
made it. Three things remove it:

- its maker, on every exit path it lives through (:func:`run_dir`);
- when the maker is killed (SIGKILL, OOM killer), a janitor: a ``/bin/sh`` in its own
  session that blocks reading a pipe only the maker holds, and removes the directory when the
  pipe closes. Workers keep dying with the coordinator (PR_SET_PDEATHSIG SIGKILL), so none
  can be left behind, stopped or hung, to clean up;
- when the janitor was killed too (a CI job killing everything), the next run on this
  machine (:func:`sweep_stale`): only directories of this uid whose owner process is gone,
  never another user's and never a live run's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from kvconnect.framing import kernel_boot_id

log = logging.getLogger(__name__)

#: a Unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL)
_MAX_BASE = 80 - 16
PREFIX = "kvv-"
OWNER_FILE = "owner.json"
#: bytes of an owner record read at most
_MAX_OWNER_BYTES = 4096
_JANITOR = 'read _ignored; rm -rf -- "$0"'
#: write ends of the janitor pipes this process holds (a forked child must close them)
_janitor_fds: set[int] = set()


@dataclass(frozen=True)
class Owner:
    """The process that made a run directory. ``start_ticks`` (``/proc/PID/stat`` field 22)
    tells a reused pid from the original."""

    pid: int
    start_ticks: int
    boot_id: str

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, process_start_ticks(pid) or 0, kernel_boot_id())

    def alive(self) -> bool:
        """True while the owner runs (a zombie, a reused pid or another boot: False)."""
        return self.boot_id == kernel_boot_id() and process_start_ticks(self.pid) == self.start_ticks

    @classmethod
    def read(cls, directory: str) -> Owner | None:
        """The owner record in ``directory``, or None when missing or malformed."""
        try:
            fd = os.open(os.path.join(directory, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            raw = os.read(fd, _MAX_OWNER_BYTES + 1)
        finally:
            os.close(fd)
        try:
            obj = json.loads(raw)
            owner = cls(int(obj["pid"]), int(obj["start_ticks"]), str(obj["boot_id"]))
        except (ValueError, TypeError, KeyError):
            return None
        return owner if len(raw) <= _MAX_OWNER_BYTES else None


def run_dir_base() -> str:
    """Where run directories go: ``$TMPDIR`` or, when that is too long, ``/tmp``."""
    base = tempfile.gettempdir()
    if len(base) > _MAX_BASE:
        log.warning("TMPDIR %s is too long for Unix socket paths; using /tmp", base)
        base = "/tmp"
    return base


@contextlib.contextmanager
def run_dir() -> Iterator[str]:
    """A fresh private (0700) directory for this run's sockets and logs, with its owner
    record and janitor; removed on exit. Sweeps stale run directories first."""
    base = run_dir_base()
    for path in sweep_stale(base):
        log.warning("removed %s, left behind by a run that was killed", path)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    janitor = None
    try:
        os.chmod(path, 0o700)
        fd = os.open(os.path.join(path, OWNER_FILE),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            json.dump(asdict(Owner.this_process()), f)
        janitor = _Janitor.start(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if janitor is not None:
            janitor.stop()


def sweep_stale(base: str) -> list[str]:
    """Remove run directories under ``base`` left by dead runs; returns their paths.

    Only real directories named ``kvv-*``, owned by this uid, with a well-formed owner
    record whose process is gone. Anything else (another user's, a live run's, one without
    a record, a symlink) is never touched."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return []
    uid = os.getuid()
    for entry in entries:
        try:
            if not entry.name.startswith(PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        owner = Owner.read(entry.path)
        if owner is None or owner.alive():
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class _Janitor:
    """``sh -c 'read; rm -rf DIR'`` in its own session, reading a pipe whose only writer is
    this process: when this process ends, however it ends, the read returns and the
    directory goes. Forked workers close the pipe (:func:`janitor_fds`)."""

    def __init__(self, proc: subprocess.Popen, fd: int) -> None:
        self.proc = proc
        self.fd = fd

    @classmethod
    def start(cls, path: str) -> _Janitor | None:
        read_end, write_end = os.pipe()
        try:
            proc = subprocess.Popen(["/bin/sh", "-c", _JANITOR, path], stdin=read_end,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    close_fds=True, start_new_session=True)
        except OSError as exc:
            os.close(write_end)
            log.warning("no janitor for %s (%s): if this process is killed, the next run "
                        "removes the directory", path, exc)
            return None
        finally:
            os.close(read_end)
        _janitor_fds.add(write_end)
        return cls(proc, write_end)

    def stop(self) -> None:
        """Close the pipe (the janitor removes nothing left) and reap the janitor."""
        _janitor_fds.discard(self.fd)
        os.close(self.fd)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - sh exits on EOF at once
            self.proc.kill()
            self.proc.wait()


def janitor_fds() -> list[int]:
    """Write ends of this process's janitor pipes: a forked child closes them, or the
    janitor would wait for the child too."""
    return sorted(_janitor_fds)


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when it is gone or a
    zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # fields from 3 (state) on
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])
