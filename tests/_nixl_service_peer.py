"""Helper for tests/test_soak.py and tests/test_nixl_recovery.py: a prefill process serving
one host-backend ExtensibleKVCache over NIXL, as a long-running server would.

Run as a script (``JsonLinePeer.script("_nixl_service_peer.py")``, tests/_json_peer.py) it
answers JSON-line commands; between commands it drives NIXL progress and consumes the
notifications readers send (a server that never reads them would buffer them forever).
Its hello carries its ``pid``. Commands:

- ``setup`` {spec, engine_id, seed, agent_name?} -> ``metadata`` (JSON text) and ``pid``
- ``resources`` -> this process's :func:`resource_snapshot` plus ``notifications`` served
- ``stall`` {seconds} -> reply, then no NIXL progress for that long, then reply again
- ``exit``

Imported, it provides :func:`resource_snapshot` (used by the decode side too).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any


def resource_snapshot() -> dict[str, int]:
    """Open fds, mappings and resident memory (KiB) of this process, from /proc/self.

    ``maps`` counts every mapping except anonymous read-write ones: those are the allocator's
    (malloc arenas, the heap, Python's arenas) and come and go with allocation patterns; their
    growth shows in ``rss_kib``, which the soaks bound. KV memory (memfd chunks), address
    reservations (``---p``) and file mappings all count."""
    with open("/proc/self/maps") as f:
        maps = sum(1 for line in f if not _anonymous_read_write(line))
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps, "rss_kib": rss}


def _anonymous_read_write(line: str) -> bool:
    fields = line.split()
    return fields[1].startswith("rw") and (len(fields) < 6 or fields[5] in ("[heap]", ""))


def fd_targets() -> list[str]:
    """What each open fd of this process points at (``/proc/self/fd`` links), sorted: says
    which fd a soak gained when its count moved."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return sorted(out)


def main() -> int:
    import _nixl_peer as peerlib
    from _json_peer import reply, serve

    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    state: dict[str, Any] = {"cache": None, "worker": None, "served": 0}

    def serve_reads() -> None:  # serve reads and consume notifications meanwhile
        worker = state["worker"]
        if worker is not None:
            worker.progress()
            state["served"] += sum(len(m) for m in worker.get_notifications().values())

    def handle(cmd: dict[str, Any]) -> None:
        op = cmd.get("op")
        if op == "setup":
            state["cache"] = peerlib.make_cache(cmd["spec"])
            peerlib.fill_cache(state["cache"], cmd["seed"])
            state["worker"] = NixlRegionWorker(cmd["engine_id"], progress_thread=False,
                                                  agent_name=cmd.get("agent_name"))
            state["worker"].register_kv_cache(state["cache"])
            reply({"metadata": state["worker"].metadata_json().decode(), "pid": os.getpid()})
        elif op == "resources":
            worker = state["worker"]
            reply({**resource_snapshot(), "notifications": state["served"],
                   "num_registrations": worker.num_registrations if worker else 0})
        elif op == "stall":
            reply({})
            time.sleep(cmd["seconds"])
            reply({"stalled": cmd["seconds"]})
        else:
            reply({"ok": False, "error": f"unknown op {op!r}"})

    try:
        reply({"ready": True, "pid": os.getpid()})
        return serve(handle, idle=serve_reads)
    finally:
        if state["worker"] is not None:
            state["worker"].close()
        if state["cache"] is not None:
            state["cache"].close()


if __name__ == "__main__":
    sys.exit(main())
