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
# "... into host memory from host" and, for GPU memory in UCX 1.23, "... into cuda/GPU0 from
# cuda/dev[1]" (no "memory")
_TITLE = re.compile(r"remote memory read by ucp_get\S*"
                    r"(?:\s+into (\S+)(?: memory)? from ([^\s|]+))?")
_ENDPOINT = re.compile(r"\b(self|intra-node|inter-node)\s+cfg#(\d+)")
#: bytes of new log text parsed at most per transfer
_MAX_READ = 4 * 1024 * 1024


def parse_read_selections(text: str) -> list[tuple[str, list[str]]]:
    """``[(key, lanes), ...]``: each READ protocol table in ``text`` (UCX_PROTO_INFO output,
    log prefixes allowed), in order. ``key`` names the selection (endpoint scope, config
    index and direction: ``"intra-node cfg#1 (host<-host)"``); ``lanes`` are its rows'
    ``"<config> <description><direction>"``, first seen first."""
    out: list[tuple[str, list[str]]] = []
    state, where, endpoint = 0, "", ""
    lanes: list[str] = []
    for raw in text.splitlines():
        cut = min((i for i in (raw.find("|"), raw.find("+")) if i >= 0), default=-1)
        if cut < 0:
            continue
        line = raw[cut:].strip()
        title = _TITLE.search(line)
        if title:
            state, lanes = 1, []
            where = f" ({title.group(1)}<-{title.group(2)})" if title.group(1) else ""
            continue
        config = _ENDPOINT.search(line)
        if config and state != 3:
            endpoint = f"{config.group(1)} cfg#{config.group(2)}"
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
                if lanes:
                    out.append((f"{endpoint}{where}".strip(), lanes))
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 3 and cells[2]:
                lane = f"{cells[2]} {cells[1]}{where}".strip()
                if lane not in lanes:
                    lanes.append(lane)
    return out


def parse_read_lanes(text: str) -> list[str]:
    """``["cma/memory zero-copy (host<-host)", ...]``: the lanes of every READ protocol table
    in ``text``, first seen first."""
    lanes: list[str] = []
    for _, selected in parse_read_selections(text):
        lanes += [lane for lane in selected if lane not in lanes]
    return lanes


class LaneTracker:
    """Reads this process's own stdout log as it grows and attributes each peer's READs.

    UCX prints a protocol table once per selection (endpoint configuration x memory types),
    not once per peer: the first READ from a peer whose endpoint shares a configuration with
    an earlier peer's (every prefill on this host, say) prints nothing new. Such a READ
    reused a selection already made, so it is attributed to it: exactly, when this process
    has made one READ selection; as ``"one of: a | b"`` when it has made several.
    """

    def __init__(self) -> None:
        self.path = _stdout_file()
        self.offset = os.path.getsize(self.path) if self.path else 0
        self.by_peer: dict[str, list[str]] = {}
        #: every READ selection seen in this process: key -> lanes
        self.selections: dict[str, list[str]] = {}

    def lanes_after_read(self, peer: str) -> list[str]:
        """Lanes of the READ just done from ``peer``: the tables printed since the last call,
        else what this peer used before, else the selection it reused; empty when unknown
        (no log to read, or UCX printed no READ table at all)."""
        new: list[tuple[str, list[str]]] = []
        if self.path:
            _flush_c_stdio()
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(_MAX_READ)
                    self.offset = f.tell()
            except OSError:
                data = b""
            new = parse_read_selections(data.decode("utf-8", errors="replace"))
        if new:
            lanes: list[str] = []
            for key, selected in new:
                self.selections[key] = selected
                lanes += [lane for lane in selected if lane not in lanes]
            self.by_peer[peer] = lanes
        elif peer not in self.by_peer and self.selections:
            self.by_peer[peer] = _reused(list(self.selections.values()))
        return self.by_peer.get(peer, [])


def _reused(candidates: list[list[str]]) -> list[str]:
    """The lanes a READ that printed no table used: the one selection made, or all of them
    as alternatives."""
    distinct: list[list[str]] = []
    for lanes in candidates:
        if lanes not in distinct:
            distinct.append(lanes)
    if len(distinct) == 1:
        return list(distinct[0])
    return ["one of: " + " | ".join(", ".join(lanes) for lanes in distinct)]


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
