"""Helper for tests/test_nixl_teardown.py: one NIXL failure-then-teardown sequence per process.

``python _nixl_teardown_child.py decode SCENARIO`` runs a decode-side NixlRegionWorker
against prefill peers it starts as child processes (``... prefill``), drives the failure the
scenario names, closes (or drops) the worker, collects garbage and prints one ``KVC {json}``
line with what happened. The test asserts the process exits 0: before the teardown fix, the
agent's destructor could abort the process (UCX ``arbiter.c:36`` assertion, exit 134).

Scenarios:
- ``peer_killed_mid_read``: SIGKILL the peer from a timer while READing (a sweep of delays, one
  peer each, so that some READ is posted while UCX is discovering the disconnect);
- ``peer_closed_agent``: the peer closes its worker (agent destroyed), then READ;
- ``read_timeout``: the peer stops making progress, the READ runs past its deadline, then the
  peer is killed;
- ``notification_lost``: the peer is killed before it notifies; waiting for the
  notification times out;
- ``collected_without_close``: as ``peer_killed_mid_read`` but the worker is never closed:
  garbage collection retires it;
- ``raw_read_posted_after_kill``: the sequence that reproduced the abort most often here, on
  bare NIXL agents: a READ request made, the peer SIGKILLed, the READ posted ~1 ms later
  (NIXL_ERR_REMOTE_DISCONNECT), the handle released, the agent destroyed. Without
  ``drain_agent`` before the destructor it aborted in 9 of 54 single-attempt runs here; this
  scenario makes several attempts. ``KVC_TEARDOWN_SKIP_DRAIN=1`` skips the drain (to see it).
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _nixl_peer as peerlib
from _json_peer import JsonLinePeer, reply, serve

#: many small blocks: a READ posts thousands of descriptors, which widens the window in which
#: UCX learns of the disconnect while NIXL is still posting
SPEC = {"preset": "qwen-small-like",
        "overrides": {"num_layers": 2, "num_kv_heads": 1, "head_size": 64},
        "num_blocks": 4096, "capacity_blocks": 8192, "single_handle": True}
READ_BLOCKS = 4096
#: seconds after read_blocks() starts at which a timer thread SIGKILLs the peer: a sweep across
#: the moment NIXL posts the READ (the abort needed the disconnect to surface while posting)
KILL_DELAYS = (0.0, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004)
DEADLINE_S = 30.0


# -- the prefill side -----------------------------------------------------------------------------

def prefill(engine_id: str, progress_thread: bool) -> int:
    """Register a cache, publish its metadata (the hello), then obey ``close`` / ``stall``."""
    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    cache = peerlib.make_cache(SPEC)
    worker = NixlRegionWorker(engine_id, progress_thread=progress_thread)

    def handle(cmd: dict[str, Any]) -> None:
        if cmd["op"] == "close":
            worker.close()
            reply({"closed": True})
        elif cmd["op"] == "stall":  # no progress thread and no progress calls: peers stall
            reply({"stalling": True})
            time.sleep(DEADLINE_S)
        else:
            reply({"ok": False, "error": f"unknown op {cmd['op']!r}"})

    try:
        worker.register_kv_cache(cache)
        reply({"metadata": worker.metadata_json().decode()})
        return serve(handle)
    finally:
        worker.close()
        cache.close()


def _peer(engine_id: str, progress_thread: bool = True) -> JsonLinePeer:
    """A prefill child (or the bare-agent one, ``engine_id="raw"``); its hello is what it
    publishes. Its stderr is not captured: only this process's outcome is under test."""
    args = ["raw"] if engine_id == "raw" else [
        "prefill", engine_id, "1" if progress_thread else "0"]
    return JsonLinePeer.script(Path(__file__).name, *args, startup_timeout=DEADLINE_S,
                               capture_stderr=False)


def _stop(peer: JsonLinePeer) -> None:
    peer.kill()
    peer.close()


def raw_prefill() -> int:
    """A bare NIXL agent over a numpy buffer: prints its metadata and address, then waits."""
    import numpy as np

    from kvconnect.connectors.nixl.agent import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    buf = np.full(RAW_DESCS * RAW_DESC_BYTES, 7, dtype=np.uint8)
    agent = nixl_agent(f"raw-prefill-{os.getpid()}",
                       nixl_agent_config(backends=["UCX"], enable_prog_thread=True))
    agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    reply({"agent_metadata": agent.get_agent_metadata().hex(), "addr": buf.ctypes.data})
    sys.stdin.read()  # until the parent closes stdin (or kills us)
    os._exit(0)  # never run this agent's destructor: only the decode side is under test


#: the raw scenario: descriptors per READ and their size (bytes)
RAW_DESCS = 20000
RAW_DESC_BYTES = 4096
#: seconds between the SIGKILL and posting the READ, one attempt (and one peer) each
RAW_DELAYS = (0.001, 0.001, 0.0015, 0.001, 0.002, 0.001)


def raw_read_posted_after_kill() -> list[str]:
    import numpy as np

    from kvconnect.connectors.nixl.agent import drain_agent, import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    dst = np.zeros(RAW_DESCS * RAW_DESC_BYTES, dtype=np.uint8)
    agent = nixl_agent(f"raw-decode-{os.getpid()}",
                       nixl_agent_config(backends=["UCX"], enable_prog_thread=False))
    reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [
        (dst.ctypes.data + i * RAW_DESC_BYTES, RAW_DESC_BYTES, 0) for i in range(RAW_DESCS)],
        "DRAM")
    ids = list(range(RAW_DESCS))
    outcomes = []
    for delay in RAW_DELAYS:
        peer = _peer("raw")
        try:
            info = peer.hello
            name = agent.add_remote_agent(bytes.fromhex(info["agent_metadata"]))
            remote = agent.prep_xfer_dlist(name, [
                (info["addr"] + i * RAW_DESC_BYTES, RAW_DESC_BYTES, 0) for i in range(RAW_DESCS)],
                "DRAM")
            first = agent.make_prepped_xfer("READ", local, ids[:4], remote, ids[:4], b"x")
            state = agent.transfer(first)
            deadline = time.monotonic() + DEADLINE_S
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(first)
            outcomes.append("ok" if state == "DONE" else state)
            handle = agent.make_prepped_xfer("READ", local, ids, remote, ids, b"x")
            peer.kill()
            time.sleep(delay)
            try:
                state = agent.transfer(handle)
                outcomes.append(f"posted:{state}")
            except Exception as exc:  # noqa: BLE001 - nixlRemoteDisconnectError expected
                outcomes.append(type(exc).__name__)
        finally:
            _stop(peer)
    if not os.environ.get("KVC_TEARDOWN_SKIP_DRAIN"):
        drain_agent(agent, "raw-decode")
    # Retired as a forgotten agent is: handles, registration and peers left to its destructor.
    del agent, reg, local
    gc.collect()
    return outcomes


# -- the decode side ------------------------------------------------------------------------------

def _read(worker: Any, peer: str, timeout: float = 10.0) -> str:
    """One READ of every block; the name of what it raised, or ``"ok"``."""
    ids = list(range(READ_BLOCKS))
    try:
        worker.read_blocks(peer, ids, ids, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - the scenario reports the type
        return type(exc).__name__
    return "ok"


def decode(scenario: str) -> int:
    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    if scenario == "raw_read_posted_after_kill":
        outcomes = raw_read_posted_after_kill()
        reply({"scenario": scenario, "outcomes": outcomes, "teardown": "done"})
        return 0
    cache = peerlib.make_cache(SPEC)
    worker = NixlRegionWorker("decode", progress_thread=False)
    worker.register_kv_cache(cache)
    outcomes: list[str] = []
    peers: list[JsonLinePeer] = []

    def connect(progress_thread: bool = True) -> tuple[JsonLinePeer, str]:
        peer = _peer(f"prefill{len(peers)}", progress_thread)
        peers.append(peer)
        name = worker.add_peer(peer.hello["metadata"])
        return peer, name

    try:
        if scenario in ("peer_killed_mid_read", "collected_without_close"):
            delays = KILL_DELAYS if scenario == "peer_killed_mid_read" else KILL_DELAYS[1:4]
            for delay in delays:
                peer, name = connect()
                outcomes.append(_read(worker, name))  # connection set-up, then a clean READ
                killer = threading.Timer(delay, peer.kill)
                killer.start()
                outcomes.append(_read(worker, name))
                killer.join()
                if outcomes[-1] == "ok":  # the kill landed after the READ: read the dead peer
                    outcomes.append(_read(worker, name))
                # The dead peers stay loaded: close() (or the collector) must cope with them.
        elif scenario == "peer_closed_agent":
            peer, name = connect()
            outcomes.append(_read(worker, name))
            peer.call(op="close")
            outcomes.append(_read(worker, name))
        elif scenario == "read_timeout":
            peer, name = connect(progress_thread=False)
            peer.call(op="stall")
            outcomes.append(_read(worker, name, timeout=0.5))
            peer.kill()
        elif scenario == "notification_lost":
            peer, name = connect()
            outcomes.append(_read(worker, name))
            peer.kill()
            try:
                worker.wait_for_notification(timeout=0.5, from_agent="prefill-never")
            except TimeoutError:
                outcomes.append("TimeoutError")
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
        if scenario == "collected_without_close":
            del worker  # only garbage collection retires the agent
        else:
            worker.close()
        gc.collect()
        reply({"scenario": scenario, "outcomes": outcomes, "teardown": "done"})
    finally:
        for peer in peers:
            _stop(peer)
        gc.collect()
        cache.close()
    return 0


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "prefill":
        sys.exit(prefill(sys.argv[2], sys.argv[3] == "1"))
    if role == "raw":
        sys.exit(raw_prefill())
    sys.exit(decode(sys.argv[2]))
