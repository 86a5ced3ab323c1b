"""Processes a child left running: found, ended and reported (Linux ``/proc``; torch-free).

:meth:`kvconnect.child.Child.end` kills a child's process group. What leaves that group
escapes it: a process that moved to another group, or a daemon (``fork``, ``setsid``,
``fork``) in a session of its own, orphaned and adopted by init, where nothing would ever
see it again. A tool that runs code it does not trust (the conformance kit runs a connector
author's code) therefore makes itself a *child subreaper* (:func:`become_subreaper`) while
its children run, so that orphans of their trees are adopted here instead of by init, and
after each child ends calls :func:`end_leftovers`: every process still in the child's
process group, in its session when it led one, or adopted here since the child started is
named, SIGKILLed and (when ours) reaped.

Not found: a process that left the child's group and session and was not orphaned (its
parent, outside the child's tree, still lives), which code run by the child cannot arrange
without help from outside.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

__all__ = ["ProcStat", "become_subreaper", "children", "end_leftovers", "is_subreaper",
           "proc_stats"]

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
#: seconds :func:`end_leftovers` waits for what it SIGKILLed to be gone
_KILL_WAIT_S = 5.0


def _prctl(option: int, arg: Any) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def become_subreaper(on: bool = True) -> bool:
    """Make this process adopt its descendants' orphans (Linux ``PR_SET_CHILD_SUBREAPER``),
    or stop (``on=False``). False where unsupported."""
    try:
        return _prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return False


def is_subreaper() -> bool:
    """Whether this process adopts its descendants' orphans now."""
    value = ctypes.c_int(0)
    try:
        ok = _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value)) == 0
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        return False
    return ok and value.value != 0


@dataclass(frozen=True)
class ProcStat:
    """One line of ``/proc/PID/stat``, the fields that say where a process belongs."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgid: int
    sid: int


def proc_stats() -> list[ProcStat]:
    """Every process of this host (PID namespace) that can be read now."""
    out: list[ProcStat] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read().decode("ascii", errors="replace")
        except OSError:
            continue
        close = raw.rfind(")")
        fields = raw[close + 2:].split()
        if len(fields) < 4:
            continue
        out.append(ProcStat(int(name), raw[raw.find("(") + 1:close], fields[0],
                            int(fields[1]), int(fields[2]), int(fields[3])))
    return out


def children(pid: int | None = None) -> dict[int, str]:
    """Children of ``pid`` (default: this process): pid -> command name and state."""
    parent = os.getpid() if pid is None else pid
    return {p.pid: f"{p.comm} ({p.state})" for p in proc_stats() if p.ppid == parent}


def _owned_by(pid: int, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False


def end_leftovers(leader: int, *, led_session: bool, ours_before: Collection[int]
                  ) -> list[dict[str, Any]]:
    """End what the child ``leader`` (already ended and reaped: :meth:`Child.end`) left
    running: the live processes of its process group, of its session when it led one
    (``led_session``), and the children of this process that are not in ``ours_before``
    (our children before the child started: the rest are orphans of its tree, adopted here
    as a subreaper). Each is SIGKILLed, and reaped when it is ours; adopted zombies are
    reaped too. Returns a record per live process found: ``pid``, ``name`` (its command),
    ``found_by`` (``process group``, ``session`` or ``adopted orphan``)."""
    me, uid = os.getpid(), os.getuid()
    found: dict[int, dict[str, Any]] = {}
    ours: list[int] = []
    table = proc_stats()
    # the leader was reaped: a process with its pid now is another one, whose own group or
    # session may carry the same id (a group's id is not reused while the group has members)
    reused = any(p.pid == leader for p in table)
    for p in table:
        if p.pid in (me, leader) or not _owned_by(p.pid, uid):
            continue
        adopted = p.ppid == me and p.pid not in ours_before
        how = ("process group" if p.pgid == leader and not reused else
               "session" if led_session and p.sid == leader and not reused else
               "adopted orphan" if adopted else None)
        if how is None:
            continue
        if adopted:
            ours.append(p.pid)
        if p.state != "Z":
            found[p.pid] = {"pid": p.pid, "name": p.comm, "found_by": how}
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + _KILL_WAIT_S
    for pid in ours:
        while True:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere
                break
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    return sorted(found.values(), key=lambda r: r["pid"])
