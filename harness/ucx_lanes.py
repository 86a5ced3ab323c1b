"""Which UCX lane carried a NIXL READ, from UCX's own protocol-selection report.

NIXL 1.5 does not say which UCX transport it used, and a slow fallback (VMM memory read
through ``tcp/lo`` "software emulation" at ~0.4 GB/s instead of ``cuda_ipc``) returns
correct data without a warning. With ``UCX_PROTO_INFO=y`` UCX prints a table each time it
selects a protocol; for a READ the title says ``remote memory read by ucp_get*``::

    | remote memory read by ucp_get*(multi) into host memory from host |
    | Range  | Description | Config                                    |
    | 0..inf | zero-copy   | cma/memory                                |

Local runs start workers with ``UCX_PROTO_INFO=y`` and their stdout in a log file; after a
transfer the worker flushes C stdio and reads the new part of that file
(:class:`LaneTracker`). Best effort: where stdout is not a regular file, nothing is known.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat

PROTO_INFO_ENV = "UCX_PROTO_INFO"
_TITLE = re.compile(r"remote memory read by ucp_get\S*(?:\s+into (\S+) memory from ([^\s|]+))?")
#: bytes of new log text parsed at most per transfer
_MAX_READ = 4 * 1024 * 1024


def parse_read_lanes(text: str) -> list[str]:
    """``["cma/memory zero-copy (host<-host)", ...]``: the lanes of every READ protocol table
    in ``text`` (UCX_PROTO_INFO output, log prefixes allowed), first seen first."""
    lanes: list[str] = []
    state, where = 0, ""
    for raw in text.splitlines():
        cut = min((i for i in (raw.find("|"), raw.find("+")) if i >= 0), default=-1)
        if cut < 0:
            continue
        line = raw[cut:].strip()
        title = _TITLE.search(line)
        if title:
            state = 1
            where = f" ({title.group(1)}<-{title.group(2)})" if title.group(1) else ""
            continue
        if state == 1 and line.startswith("|") and "Range" in line and "Config" in line:
            state = 2
            continue
        if state == 2 and line.startswith("+"):
            state = 3  # the separator under the header: rows follow
            continue
        if state == 3:
            if line.startswith("+"):
                state = 0
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 3 and cells[2]:
                lane = f"{cells[2]} {cells[1]}{where}".strip()
                if lane not in lanes:
                    lanes.append(lane)
    return lanes


class LaneTracker:
    """Reads this process's own stdout log as it grows and remembers each peer's READ lanes."""

    def __init__(self) -> None:
        self.path = _stdout_file()
        self.offset = os.path.getsize(self.path) if self.path else 0
        self.by_peer: dict[str, list[str]] = {}

    def lanes_after_read(self, peer: str) -> list[str]:
        """Lanes of the READ just done from ``peer`` (new tables since the last call, else
        what this peer used before); empty when unknown."""
        if self.path:
            _flush_c_stdio()
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(_MAX_READ)
                    self.offset = f.tell()
            except OSError:
                data = b""
            new = parse_read_lanes(data.decode("utf-8", errors="replace"))
            if new:
                self.by_peer[peer] = new
        return self.by_peer.get(peer, [])


def _stdout_file() -> str:
    """Path of fd 1 when it is a regular file (a worker log), else ""."""
    try:
        if not stat.S_ISREG(os.fstat(1).st_mode):
            return ""
        path = os.readlink("/proc/self/fd/1")
    except OSError:
        return ""
    return path if os.path.isfile(path) else ""


def _flush_c_stdio() -> None:
    """fflush(NULL): push out what UCX printed through C stdio buffers."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
