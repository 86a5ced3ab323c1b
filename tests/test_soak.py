"""Soak: long runs of the operations a server repeats, with the resources they hold measured
at the start (after a warm-up) and at the end.

- 1,000 sleep/wake cycles with NIXL re-registration on the host backend (100 on CUDA,
  marked gpu): deregister, release_physical, recommit, reregister;
- 1,000 commit/release cycles of an ExtensibleTensor and 1,000 whole ExtensibleKVCache
  lifetimes (allocate, warm-up, final commit, close);
- 200 consecutive 1P1D NIXL READs (real NIXL, two processes) against one peer, every one
  checked byte for byte.

Measured from /proc/self: open fds, mappings (lines of maps), resident memory (VmRSS), and
NIXL's view: live registrations, the size of the agent metadata (it lists every registered
extent, so a registration NIXL kept would grow it) and whether NIXL accepts descriptors over
the registered extents. Fds, mappings and registrations must be exactly flat; resident
memory within :data:`RSS_SLACK_KIB` (see there why).

With ``KVC_RELIABILITY_RECORD=path`` each soak appends its figures as one JSON line (read by
``scripts/reliability_tables.py`` for docs/reliability.md).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import _nixl_peer as peerlib
import _nixl_service_peer as service
import _reliability as reliability
import numpy as np
import pytest
from _json_peer import JsonLinePeer

from kvconnect import ExtensibleKVCache, ExtensibleTensor
from kvconnect.connectors.nixl.agent import nixl_importable
from kvconnect.connectors.nixl.descriptors import transfer_regions
from kvconnect.layout import preset
from kvconnect.vmm import get_vmm_driver

needs_nixl = pytest.mark.skipif(not nixl_importable(), reason="NIXL Python bindings not installed")

G = 2 * 1024 * 1024
#: resident memory a soak may gain between its start and end snapshots (KiB). RSS moves in
#: pages and with allocator behaviour: CPython's obmalloc and glibc keep freed memory for
#: reuse, NIXL/UCX grow internal tables on first use (hence the warm-up before the start
#: snapshot). The soaks here grew 0-600 KiB over 1,000 cycles; 4 MiB over 1,000 cycles is
#: 4 KiB (one page) per cycle, so any leak of a page or more per cycle -- an mmap'd
#: chunk (2 MiB), a NIXL registration record with its descriptors, a metadata blob (~1 KiB)
#: kept per cycle in a list -- goes over it, while allocator noise stays under.
RSS_SLACK_KIB = 4096
SPEC = {"preset": "llama3-8b-like", "overrides": {"num_layers": 2}, "num_blocks": 16,
        "capacity_blocks": 1024}
WARMUP = 20


def _report(name: str, start: dict, end: dict, **extra: Any) -> None:
    """Record this soak's figures (tests/_reliability.py)."""
    reliability.record("soak", soak=name, start=start, end=end,
                       rss_slack_kib=RSS_SLACK_KIB, **extra)


def _assert_flat(start: dict, end: dict, exact: tuple[str, ...],
                 fds: tuple[list[str], list[str]] = ([], [])) -> None:
    """``exact`` keys equal at both ends, RSS within the bound; ``fds``: the fd targets at the
    start and the end, named in the message when the fd count moved."""
    gained = Counter(fds[1]) - Counter(fds[0])
    lost = Counter(fds[0]) - Counter(fds[1])
    for key in exact:
        if key == "fds" and fds != ([], []):
            _assert_fds_flat(start[key], end[key], gained, lost)
            continue
        assert end[key] == start[key], f"{key}: {start[key]} at the start, {end[key]} at the end"
    grown = end["rss_kib"] - start["rss_kib"]
    assert grown <= RSS_SLACK_KIB, f"resident memory grew by {grown} KiB (bound {RSS_SLACK_KIB})"


#: fd kinds that kvconnect and NIXL hold for KV memory (host-backend chunks, IPC and UCX
#: sockets, device nodes): none of them may be gained over a soak
HELD_FD_KINDS = ("memfd:", "socket:", "/dev/")


def _assert_fds_flat(start: int, end: int, gained: Counter, lost: Counter) -> None:
    """No fd of a kind kvconnect or NIXL holds is gained, and the count moves by at most one
    fd of another kind (a runtime thread of the process, e.g. an event fd another test's
    library started lazily in this xdist worker, is no leak of the soak; 1,000 cycles leaking
    would move it by hundreds). The message names every fd gained or lost."""
    held = sorted(t for t in gained.elements() if t.startswith(HELD_FD_KINDS))
    detail = f"fds {start} -> {end} (gained {sorted(gained.elements())}, lost " \
             f"{sorted(lost.elements())})"
    assert not held, f"the soak gained fds of the kinds it holds: {held}; {detail}"
    assert abs(end - start) <= 1, detail


# -- sleep / wake with NIXL re-registration ----------------------------------------------------

def _nixl_state(worker: Any) -> dict[str, Any]:
    return {"registrations": worker.num_registrations,
            "agent_metadata_bytes": len(worker.metadata().agent_metadata),
            "generation": worker.generation}


@needs_nixl
@pytest.mark.nixl
def test_sleep_wake_with_reregistration_stays_flat(vmm_device: str, nixl_worker: Any) -> None:
    """Sleep/wake cycles with NIXL re-registration (1,000 host, 100 CUDA): fds, maps,
    registrations, agent metadata size and free device memory exactly flat, RSS within
    the bound; NIXL knows exactly the current extents."""
    cycles = 1000 if vmm_device == "cpu" else 100
    cache = peerlib.make_cache(dict(SPEC, device=vmm_device))
    try:
        worker = nixl_worker("soak-sleep", progress_thread=False)
        worker.register_kv_cache(cache)
        region = cache.committed_regions()[-1]
        last = region.num_blocks - 1

        def cycle(i: int) -> None:
            if i % 10 == 0:  # the memory is real: written before sleep, zero after wake
                peerlib.block_view(cache, region, last).fill_(0xA5)
            worker.deregister()
            cache.release_physical()
            cache.recommit()
            worker.reregister()
            if i % 10 == 0:
                assert not peerlib.read_block(cache, region, last).any(), f"cycle {i}"

        def device_free() -> int:
            if vmm_device == "cpu":
                return 0
            import torch

            torch.cuda.synchronize()
            return int(torch.cuda.mem_get_info(0)[0])

        for i in range(WARMUP):  # the same steps as measured (first use of torch ops too)
            cycle(i)
        start = {**service.resource_snapshot(), **_nixl_state(worker),
                 "device_free_bytes": device_free()}
        fds_start = service.fd_targets()
        t0 = time.perf_counter()
        for i in range(cycles):
            cycle(i)
        seconds = time.perf_counter() - t0
        end = {**service.resource_snapshot(), **_nixl_state(worker),
               "device_free_bytes": device_free()}
        fds_end = service.fd_targets()
        where = "host" if vmm_device == "cpu" else vmm_device
        _report(f"sleep/wake + NIXL re-registration ({where})", start, end,
                cycles=cycles, seconds=round(seconds, 3),
                per_second=round(cycles / seconds, 1))
        assert end["generation"] == start["generation"] + cycles
        _assert_flat(start, end, ("fds", "maps", "registrations", "agent_metadata_bytes",
                                  "device_free_bytes"), (fds_start, fds_end))
        # NIXL knows exactly the current extents: all of them while registered, none after
        # deregistration (nothing of the 1,000 earlier registrations lingers).
        agent, extents = worker._agent, worker.registered_extents
        assert len(extents) == cache.num_physical_chunks
        assert peerlib._nixl_knows(agent, extents, worker.memory_type) == [True] * len(extents)
        worker.deregister()
        assert peerlib._nixl_knows(agent, extents, worker.memory_type) == [False] * len(extents)
        del agent
    finally:
        if "worker" in locals():
            worker.close()
        cache.close()


# -- commit / release ---------------------------------------------------------------------------

def _memfd_chunks() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:kvconnect-chunk" in line for line in f)


def test_tensor_commit_release_cycles_stay_flat() -> None:
    """1,000 ExtensibleTensor commit/shrink cycles: fds, maps and mapped chunks exactly
    flat, RSS within the bound."""
    cycles = 1000
    driver = get_vmm_driver("cpu")
    with ExtensibleTensor(2 * 8 * G, driver, num_segments=2) as t:
        def cycle(i: int) -> None:
            t.commit(G * (1 + i % 4))
            view = t.segment_view(1)
            view[-1] = i % 251  # the last committed byte of segment 1 is real memory
            assert int(view[-1]) == i % 251
            del view
            t.shrink_to([0, 0])

        for i in range(WARMUP):
            cycle(i)
        start = {**service.resource_snapshot(), "chunks": _memfd_chunks()}
        t0 = time.perf_counter()
        for i in range(cycles):
            cycle(i)
        seconds = time.perf_counter() - t0
        end = {**service.resource_snapshot(), "chunks": _memfd_chunks()}
        assert t.committed_bytes == (0, 0) and t.num_physical_chunks == 0
    _report("ExtensibleTensor commit/shrink (host)", start, end, cycles=cycles,
            seconds=round(seconds, 3), per_second=round(cycles / seconds, 1))
    _assert_flat(start, end, ("fds", "maps", "chunks"))
    assert end["chunks"] == 0


def test_kv_cache_lifetimes_stay_flat() -> None:
    """1,000 ExtensibleKVCache lifetimes (allocate, warm-up, final commit, close): fds,
    maps and mapped chunks exactly flat, RSS within the bound."""
    cycles = 1000
    cfg = preset("llama3-8b-like", num_blocks=16, num_layers=2)

    def lifetime() -> None:
        cache = ExtensibleKVCache(cfg, "cpu", capacity_blocks=256)
        try:
            cache.allocate()
            cache.ensure_kv_cache_blocks(4)
            cache.extend_kv_cache(16)
            region = cache.committed_regions()[0]
            peerlib.block_view(cache, region, 15).fill_(1)
            assert cache.num_physical_chunks == len(cache.tensors) * 2  # K and V segments
        finally:
            cache.close()

    for _ in range(WARMUP):
        lifetime()
    start = {**service.resource_snapshot(), "chunks": _memfd_chunks()}
    t0 = time.perf_counter()
    for _ in range(cycles):
        lifetime()
    seconds = time.perf_counter() - t0
    end = {**service.resource_snapshot(), "chunks": _memfd_chunks()}
    _report("ExtensibleKVCache allocate/extend/close (host)", start, end, cycles=cycles,
            seconds=round(seconds, 3), per_second=round(cycles / seconds, 1))
    _assert_flat(start, end, ("fds", "maps", "chunks"))


# -- 200 transfers against one peer ------------------------------------------------------------

TRANSFERS = 200
REMOTE_SETS = ([11, 0, 5, 7], [3, 14, 9, 1])
LOCAL_IDS = [2, 9, 0, 4]


@needs_nixl
@pytest.mark.nixl
def test_consecutive_transfers_against_one_peer_stay_flat(nixl_worker: Any) -> None:
    """200 consecutive 1P1D NIXL READs against one peer process, each checked byte for
    byte: fds, maps, registrations and peers flat on both sides, RSS within the bound,
    one notification per READ."""
    peer = JsonLinePeer.script("_nixl_service_peer.py")
    cache = peerlib.make_cache(SPEC)
    try:
        md = peer.call(op="setup", spec=SPEC, engine_id="soak-prefill", seed=1)["metadata"]
        worker = nixl_worker("soak-decode", progress_thread=False)
        worker.register_kv_cache(cache)
        name = worker.add_peer(md)
        regions = transfer_regions(cache.committed_regions())
        wants = [{(r.layer_name, r.part, lb): peerlib.block_pattern(
                    peerlib.region_key(r), rb, r.block_len, 1)
                  for r in regions for lb, rb in zip(LOCAL_IDS, rs, strict=True)}
                 for rs in REMOTE_SETS]

        def transfer(i: int) -> float:
            res = worker.read_blocks(name, REMOTE_SETS[i % 2], LOCAL_IDS, timeout=30)
            for r in regions:  # every READ checked, byte for byte
                for lb in LOCAL_IDS:
                    got = peerlib.read_block(cache, r, lb)
                    assert np.array_equal(got, wants[i % 2][(r.layer_name, r.part, lb)]), \
                        f"transfer {i}: block {lb} of {peerlib.region_key(r)}"
            return res.seconds

        for i in range(WARMUP):
            transfer(i)
        expected = WARMUP

        def both_sides() -> dict[str, Any]:
            deadline = time.monotonic() + 30
            while True:  # until the peer consumed every notification so far
                remote = peer.call(op="resources")
                if remote["notifications"] >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            return {**service.resource_snapshot(), "registrations": worker.num_registrations,
                    "peers": len(worker.peers),
                    "peer": {k: remote[k] for k in ("fds", "maps", "rss_kib",
                                                    "num_registrations", "notifications")}}

        start = both_sides()
        t0 = time.perf_counter()
        busy = sum(transfer(WARMUP + i) for i in range(TRANSFERS))
        seconds = time.perf_counter() - t0
        expected += TRANSFERS
        end = both_sides()
        _report("1P1D NIXL READs against one peer (host, 2 processes)", start, end,
                cycles=TRANSFERS, seconds=round(seconds, 3),
                per_second=round(TRANSFERS / seconds, 1),
                read_seconds_total=round(busy, 4))
        _assert_flat(start, end, ("fds", "maps", "registrations", "peers"))
        _assert_flat(start["peer"], end["peer"], ("fds", "maps", "num_registrations"))
        assert end["peer"]["notifications"] == WARMUP + TRANSFERS  # one per READ, none lost
    finally:
        if "worker" in locals():
            worker.close()
        cache.close()
        peer.close()
