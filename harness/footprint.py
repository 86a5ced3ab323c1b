"""What a process holds that a run must give back: open fds, sockets and KV memory mappings.

A worker takes a :class:`Footprint` before it builds anything and again after it released
everything (cache, NIXL agent, transports, exporters): what is new in the second is a leak
the process would carry on with (a decode that keeps mapping a dead prefill's memory, an
export socket left open). The coordinator uses the same probes on itself. Linux /proc only;
elsewhere the footprint is empty and nothing can be compared.

KV memory mappings are those of the host backend's memfd chunks (``/memfd:kvconnect-chunk``)
and of peers' chunks mapped through IPC; CUDA VMM memory is not visible in /proc (the
coordinator asks the driver which processes still hold device memory, :mod:`.cleanup`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: a mapping of KV memory: the host backend names its chunks so (kvconnect.vmm.host)
KV_MAPPING_MARK = "/memfd:kvconnect-chunk"
#: fds listed in a leak report at most
MAX_LISTED = 8


@dataclass(frozen=True)
class Footprint:
    """``fds``: fd number -> what it points at (``socket:[123]``, ``/memfd:...``);
    ``kv_mappings``: lines of /proc/self/maps that map KV memory; ``mappings``: all lines."""

    fds: dict[int, str]
    kv_mappings: int
    mappings: int

    @classmethod
    def take(cls) -> Footprint:
        fds: dict[int, str] = {}
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            names = []
        for name in names:
            try:
                fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # the fd listdir itself used, or one closed meanwhile
        kv = total = 0
        try:
            with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
                for line in f:
                    total += 1
                    if KV_MAPPING_MARK in line:
                        kv += 1
        except OSError:
            pass
        return cls(fds, kv, total)

    def leaks_since(self, before: Footprint) -> dict[str, Any]:
        """What this footprint holds that ``before`` did not, as JSON values: ``fds`` (the
        targets of new fds: sockets, memfds, files), ``sockets``, ``kv_mappings`` (count of
        new KV mappings); empty when nothing leaked."""
        new = {fd: target for fd, target in self.fds.items()
               if before.fds.get(fd) != target}
        out: dict[str, Any] = {}
        if new:
            out["fds"] = sorted(new.values())[:MAX_LISTED]
            out["num_fds"] = len(new)
            sockets = [t for t in new.values() if t.startswith("socket:")]
            if sockets:
                out["sockets"] = len(sockets)
        if self.kv_mappings > before.kv_mappings:
            out["kv_mappings"] = self.kv_mappings - before.kv_mappings
        return out

    def to_json(self) -> dict[str, Any]:
        return {"fds": len(self.fds), "kv_mappings": self.kv_mappings,
                "mappings": self.mappings}
