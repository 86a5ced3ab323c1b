"""The library ipc transport between real processes (host VMM backend), and the registry.

A child process owns a KV cache, fills it and serves it with an IpcExportServer; this
process maps it with IpcTransport and fetches blocks into its own cache. Expected bytes come
from a third cache filled here with the same deterministic pattern, never through the
mapping under test.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterator

import pytest
import torch
from _json_peer import JsonLinePeer
from _nixl_peer import fill_cache

from kvconnect.connectors.errors import IncompatiblePeerError, KVConnectorError
from kvconnect.connectors.ipc.transport import IpcTransport
from kvconnect.connectors.registry import (
    UnknownTransportError,
    get_transport,
    register_builtin_transports,
    register_transport,
    transport_names,
)
from kvconnect.connectors.transport import FetchResult, Transport, TransportContext, TransportSpec
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import preset
from kvconnect.vmm import AllocationOptions

NUM_BLOCKS = 24

_CHILD = textwrap.dedent("""
    import os, shutil, sys, tempfile
    from _json_peer import reply, serve
    from _nixl_peer import fill_cache as fill
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.vmm import AllocationOptions
    from kvconnect.connectors.ipc.transport import IpcExportServer

    layers, seed, n, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    cache = ExtensibleKVCache(preset("llama3-8b-like", num_blocks=n, num_layers=layers),
                              device, capacity_blocks=n * 4,
                              options=AllocationOptions(shareable=True))
    cache.allocate()
    cache.extend_kv_cache(n)
    fill(cache, seed)
    directory = tempfile.mkdtemp()
    server = IpcExportServer(cache, directory, "child", lambda: {os.getppid()}, 30.0)

    def handle(cmd):
        global seed
        assert cmd["op"] == "sleep_wake", cmd
        server.pause()
        cache.release_physical()
        cache.recommit()
        seed += 1
        fill(cache, seed)
        server.resume()
        reply({"offer": server.describe()})

    try:
        reply({"offer": server.describe()})
        serve(handle)
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)
        cache.close()
""")


def _child(layers: int, seed: int, device: str = "cpu") -> JsonLinePeer:
    """A process serving a filled cache of ``layers`` layers: its hello holds the offer."""
    return JsonLinePeer(["-c", _CHILD, str(layers), str(seed), str(NUM_BLOCKS), device])


def _cache(layers: int = 2, device: str = "cpu") -> ExtensibleKVCache:
    cache = ExtensibleKVCache(preset("llama3-8b-like", num_blocks=NUM_BLOCKS, num_layers=layers),
                              device, capacity_blocks=NUM_BLOCKS * 4,
                              options=AllocationOptions(shareable=True))
    cache.allocate()
    cache.extend_kv_cache(NUM_BLOCKS)
    return cache


def _block(cache: ExtensibleKVCache, b: int) -> list[torch.Tensor]:
    out = []
    for r in cache.committed_regions():
        t = cache.tensors[r.tensor_index]
        out.append(t.committed_view(r.base_ptr - t.base_ptr + b * r.block_stride,
                                    r.block_len).clone())
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture
def child() -> Iterator[JsonLinePeer]:
    with _child(layers=2, seed=1) as c:
        yield c


def test_fetch_caches_the_mapping_and_remaps_after_the_peers_sleep(child: JsonLinePeer) -> None:
    with _cache() as dst, _cache() as want, IpcTransport(dst, timeout=30) as ipc:
        assert isinstance(ipc, Transport)
        fill_cache(dst, seed=99)
        fill_cache(want, seed=1)  # what the child holds, computed here independently
        before = {b: _block(dst, b) for b in range(NUM_BLOCKS)}
        first = ipc.open_peer("child", child.hello["offer"])
        assert first > 0
        assert ipc.open_peer("child", child.hello["offer"]) == 0.0  # cached: no new mapping
        remote, local = [20, 3, 4, 5, 11], [0, 7, 8, 9, 23]
        res = ipc.fetch("child", remote, local)
        assert res.bytes == len(remote) * dst.bytes_per_block and res.blocks == len(remote)
        assert res.backend == "host:cpu" and res.setup_seconds == first
        for r, lo in zip(remote, local, strict=True):
            assert _same(_block(dst, lo), _block(want, r)), (r, lo)
        for b in set(range(NUM_BLOCKS)) - set(local):
            assert _same(_block(dst, b), before[b]), b
        assert ipc.fetch("child", [1], [1]).setup_seconds == 0.0  # paid once
        # the peer sleeps and wakes with new contents: a new generation, so a new mapping
        offer = child.call(op="sleep_wake")["offer"]
        assert offer["generation"] > child.hello["offer"]["generation"]
        fill_cache(want, seed=2)
        assert ipc.open_peer("child", offer) > 0
        ipc.fetch("child", [6, 7], [2, 3])
        assert _same(_block(dst, 2), _block(want, 6)) and _same(_block(dst, 3), _block(want, 7))
        with pytest.raises(ValueError, match="destination block id appears twice"):
            ipc.fetch("child", [1, 2], [4, 4])
        with pytest.raises(ValueError, match=r"lie in \[0, 24\)"):
            ipc.fetch("child", [24], [0])
        ipc.invalidate("child")
        with pytest.raises(KVConnectorError, match="no open peer"):
            ipc.fetch("child", [1], [1])
    with pytest.raises(KVConnectorError, match="after close"):
        ipc.open_peer("child", offer)
    ipc.close()  # idempotent


def test_a_fetch_refuses_this_cache_changed_and_takes_it_back_unchanged(
        child: JsonLinePeer) -> None:
    """Each fetch checks this cache's state cheaply (tensor versions) and, when a version
    moved, compares what the plan depends on (block count, committed bytes, chunks)."""
    with _cache() as dst, _cache() as want, IpcTransport(dst, timeout=30) as ipc:
        fill_cache(want, seed=1)
        ipc.open_peer("child", child.hello["offer"])
        dst.release_physical()  # this worker sleeps: nothing committed any more
        for _ in range(2):
            with pytest.raises(KVConnectorError, match="changed since"):
                ipc.fetch("child", [1], [1])
        dst.recommit()  # the same sizes at the same addresses: the plan fits again
        ipc.fetch("child", [20], [2])
        assert _same(_block(dst, 2), _block(want, 20))
        assert ipc.open_peer("child", child.hello["offer"]) == 0.0


def test_requests_merge_into_one_copy_and_start_returns_a_pending_fetch(
        child: JsonLinePeer, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvconnect.connectors.copy.block_copy import BlockCopyPlan

    copies: list[int] = []
    real = BlockCopyPlan.copy
    monkeypatch.setattr(BlockCopyPlan, "copy", lambda self, s, d, **kw: (
        copies.append(len(s)), real(self, s, d, **kw))[1])
    with _cache() as dst, _cache() as want, IpcTransport(dst, timeout=30) as ipc:
        fill_cache(dst, seed=98)
        fill_cache(want, seed=1)
        ipc.open_peer("child", child.hello["offer"])
        res = ipc.fetch_many("child", [([20, 3], [0, 7]), ([4], [8]), ([], [])])
        assert copies == [3] and res.blocks == 3 and res.bytes == 3 * dst.bytes_per_block
        for r, lo in ((20, 0), (3, 7), (4, 8)):
            assert _same(_block(dst, lo), _block(want, r)), (r, lo)
        pending = ipc.start("child", [([5, 6], [9, 10])])
        assert pending.done()  # the host method copies synchronously
        got = pending.wait()
        assert got.blocks == 2 and got.seconds >= 0 and got.backend == "host:cpu"
        assert _same(_block(dst, 9), _block(want, 5)) and _same(_block(dst, 10), _block(want, 6))
        with pytest.raises(ValueError, match="appears twice"):
            ipc.fetch_many("child", [([1], [2]), ([3], [2])])
        with pytest.raises(ValueError, match="request 0: 2 remote ids but 1 local"):
            ipc.start("child", [([1, 2], [3])])
        with pytest.raises(ValueError, match="launch must be one of"):
            IpcTransport(dst, launch="later")


def test_incompatible_layout_is_refused_before_any_copy(child: JsonLinePeer) -> None:
    with _cache(layers=3) as dst, IpcTransport(dst, timeout=30) as ipc:
        with pytest.raises(IncompatiblePeerError, match="regions missing on remote"):
            ipc.open_peer("child", child.hello["offer"])
        with pytest.raises(KVConnectorError, match="no open peer"):
            ipc.fetch("child", [0], [0])


def test_bad_offers_and_directions() -> None:
    from kvconnect.framing import IpcError

    with _cache() as dst:
        with pytest.raises(ValueError, match="direction"):
            IpcTransport(dst, direction="sideways")
        with IpcTransport(dst, timeout=5) as ipc:
            with pytest.raises(IpcError, match="malformed ipc offer"):
                ipc.open_peer("x", {"pid": os.getpid()})
            with pytest.raises(OSError):
                ipc.open_peer("x", {"path": "/nonexistent/kvc.sock", "pid": 1})


def test_registry_builds_both_halves_by_name() -> None:
    register_builtin_transports()
    register_builtin_transports()  # idempotent
    assert transport_names()[:2] == ("ipc", "nixl")
    ipc, nixl = get_transport("ipc"), get_transport("nixl")
    assert ipc.same_host_only and not nixl.same_host_only
    assert ipc.needs_directory and ipc.sends_chunk_fds and ipc.registration is None
    assert nixl.notifies_exporter and not ipc.notifies_exporter
    assert ipc.exporter is not None and nixl.exporter is not None
    with pytest.raises(UnknownTransportError, match="registered: ipc, nixl"):
        get_transport("carrier-pigeon")
    with pytest.raises(KeyError):  # the standard base is kept
        get_transport("carrier-pigeon")
    with pytest.raises(ValueError, match="already registered"):
        register_transport(TransportSpec("ipc", ipc.receiver))
    register_transport(ipc)  # the same spec again: nothing changes
    with pytest.raises(ValueError, match="identifier"):
        register_transport(TransportSpec("no such", ipc.receiver))

    with _cache() as cache:
        t = ipc.receiver(TransportContext(cache=cache, timeout=3.0), None)
        try:
            assert isinstance(t, IpcTransport) and t.name == "ipc" and t.timeout == 3.0
        finally:
            t.close()
        with pytest.raises(KVConnectorError, match="NixlRegistration"):
            nixl.receiver(TransportContext(cache=cache), None)


def test_one_gbps_rule() -> None:
    """GB/s are 1e9 bytes per second; zero seconds give 0.0 (never inf) everywhere."""
    from kvconnect import gbps
    from kvconnect.harness.report import SweepPoint, Transfer

    assert gbps(2_000_000_000, 0.5) == 4.0
    assert gbps(1, 0.0) == 0.0 and gbps(0, 0.0) == 0.0
    assert FetchResult(3_000_000, 0.001, "x").gbps == pytest.approx(3.0)
    assert FetchResult(3_000_000, 0.0, "x").gbps == 0.0
    assert Transfer.measured("p->d", "ipc", 10, 0.0, True).gbps == 0.0
    point = SweepPoint("p->d", "ipc", 4000, 1, 0, 1, 0.0, 0.0, 1e-6, True)
    assert (point.avg_gbps, point.peak_gbps, point.low_gbps) == (0.0, 0.0, 4.0)


@pytest.mark.gpu
def test_gpu_a_started_fetch_is_timed_on_the_device_from_its_start() -> None:
    """``seconds`` of a started fetch runs on the device's timeline from the call: work queued
    on the stream before it (a 50 ms device sleep) does not count, and on an idle stream the
    host's preparing and issuing, which the device waited for, does; the bytes arrive."""
    with _child(layers=2, seed=5, device="cuda:0") as peer, _cache(device="cuda:0") as dst, \
            _cache(device="cuda:0") as want, IpcTransport(dst, timeout=30) as ipc:
        fill_cache(want, seed=5)
        ipc.open_peer("child", peer.hello["offer"])
        ipc.fetch("child", [1], [1])  # warm
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # about 50 ms of device time queued before the call
        queued = ipc.start("child", [([20, 3], [0, 7])]).wait(30.0)
        assert queued.seconds < 0.02, queued
        assert queued.host_seconds > 0 and queued.launch_seconds > 0
        torch.cuda.synchronize()
        idle = ipc.start("child", [([4, 5], [8, 9])]).wait(30.0)
        assert idle.seconds >= 0.5 * (idle.host_seconds + idle.launch_seconds), idle
        for r, lo in ((20, 0), (3, 7), (4, 8), (5, 9)):
            assert _same(_block(dst, lo), _block(want, r)), (r, lo)
