"""NIXL connector worker on committed extents: real NIXL (DRAM over UCX) between two processes.

The prefill side runs in a child process (tests/_nixl_peer.py, driven through
tests/_json_peer.py) holding host-backend
ExtensibleKVCaches whose reservations are far above the committed blocks; this process is the
decode side and READs blocks from it. Metadata crosses the process boundary as JSON lines.
NIXL agent start-up costs ~1 s each, so one child process serves every layout.
"""

from __future__ import annotations

import base64
import contextlib
import json
import pickle
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import _nixl_peer as peerlib
import numpy as np
import pytest
from _json_peer import JsonLinePeer

from kvconnect.connectors.errors import IncompatiblePeerError, KVConnectorError, KVTransferError
from kvconnect.connectors.nixl.agent import nixl_importable
from kvconnect.connectors.nixl.descriptors import (
    check_descriptors_in_chunks,
    memory_type_for_device,
    region_descriptors,
    registration_extents,
    transfer_regions,
)
from kvconnect.connectors.nixl.handshake import HandshakeMetadata, MetadataError
from kvconnect.connectors.nixl.worker import NixlRegionWorker

needs_nixl = pytest.mark.skipif(not nixl_importable(), reason="NIXL Python bindings not installed")
# The two-process tests share one child process; keep them on one xdist worker. Workers come
# only from fixtures (`pair`, `nixl_worker`), which close them.
pytestmark = [pytest.mark.xdist_group("nixl_two_process"), pytest.mark.nixl]

MIB = 1024 * 1024
#: layouts under test: preset + overrides (small layer counts keep the test fast)
LAYOUTS: dict[str, dict[str, Any]] = {
    "kv_split": {"preset": "llama3-8b-like", "overrides": {"num_layers": 2}},
    "blocks_first": {"preset": "qwen-small-like",
                     "overrides": {"num_layers": 2, "layout": "blocks_first"}},
    "mla": {"preset": "deepseek-mla-like", "overrides": {"num_layers": 2}},
    "hybrid": {"preset": "jamba-hybrid-like", "overrides": {"num_layers": 8, "attn_period": 4}},
    "packed": {"preset": "packed", "overrides": {"num_layers": 4}},
}
PREFILL_BLOCKS = 12
DECODE_BLOCKS = 10
#: the decode K/V-split cache keeps its warm-up chunk (single_handle=False): 80 blocks of
#: 32 KiB are two physical chunks per segment (2 MiB + 2 MiB), so reads straddle a boundary
DECODE_MULTICHUNK_BLOCKS = 80
CAPACITY_FACTOR = 64
SEED = 1
REMOTE_IDS = [11, 0, 5, 7]  # non-contiguous, unordered
LOCAL_IDS = [2, 9, 0, 4]
MULTICHUNK_LOCAL_IDS = [63, 64, 0, 79]  # 63 | 64 sit on both sides of the chunk boundary


def _spec(name: str, num_blocks: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, **LAYOUTS[name], "num_blocks": num_blocks,
            "capacity_blocks": CAPACITY_FACTOR * num_blocks, "seed": SEED, **extra}


def _decode_spec(name: str, device: str = "cpu") -> dict[str, Any]:
    if name == "kv_split":
        return _spec(name, DECODE_MULTICHUNK_BLOCKS, single_handle=False, device=device)
    return _spec(name, DECODE_BLOCKS, device=device)


def _local_ids(name: str) -> list[int]:
    return MULTICHUNK_LOCAL_IDS if name == "kv_split" else LOCAL_IDS


def _check_blocks(cache: Any, local_ids: list[int], remote_ids: list[int], seed: int) -> None:
    """Local blocks hold the remote blocks' patterns; one untouched block stays zero."""
    untouched = next(b for b in range(cache.num_blocks) if b not in local_ids)
    for region in transfer_regions(cache.committed_regions()):
        key = peerlib.region_key(region)
        for lb, rb in zip(local_ids, remote_ids, strict=True):
            got = peerlib.read_block(cache, region, lb)
            want = peerlib.block_pattern(key, rb, region.block_len, seed)
            assert np.array_equal(got, want), (
                f"{key}: local block {lb} does not hold remote block {rb} (seed {seed}); "
                f"{int(np.count_nonzero(got != want))} of {region.block_len} bytes differ")
        assert not peerlib.read_block(cache, region, untouched).any(), (
            f"{key}: untouched local block {untouched} was written")


class Pair:
    def __init__(self) -> None:
        self.peer: JsonLinePeer | None = None
        self.caches: dict[str, Any] = {}
        self.workers: dict[str, NixlRegionWorker] = {}
        self.metadata: dict[str, str] = {}


@contextlib.contextmanager
def open_pair(prefill_device: str = "cpu", decode_device: str = "cpu") -> Iterator[Pair]:
    """Prefill child + decode workers for every layout, registered; peers not yet loaded."""
    p = Pair()
    try:
        p.peer = JsonLinePeer.script("_nixl_peer.py")  # ready: it imported torch and NIXL
        p.peer.send(op="setup", layouts=[_spec(n, PREFILL_BLOCKS, device=prefill_device)
                                         for n in LAYOUTS])
        for name in LAYOUTS:  # meanwhile build the decode side
            p.caches[name] = peerlib.make_cache(_decode_spec(name, decode_device))
            # No progress thread: the reader progresses while it waits (saves a busy core).
            p.workers[name] = NixlRegionWorker(f"decode-{name}", progress_thread=False)
            p.workers[name].register_kv_cache(p.caches[name])
        p.metadata = p.peer.recv(timeout=120)["metadata"]
        yield p
    finally:
        for w in p.workers.values():
            w.close()
        for c in p.caches.values():
            c.close()
        if p.peer is not None:
            p.peer.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with open_pair() as p:
        yield p


# -- two processes ------------------------------------------------------------------------------

def _read_every_layout(pair: Pair) -> None:
    for name in LAYOUTS:
        worker, cache = pair.workers[name], pair.caches[name]
        peer = worker.add_peer(pair.metadata[name])
        assert peer == f"prefill-{name}"
        local_ids = _local_ids(name)
        result = worker.read_blocks(peer, REMOTE_IDS, local_ids, timeout=30)
        _check_blocks(cache, local_ids, REMOTE_IDS, SEED)
        moved = transfer_regions(cache.committed_regions())
        assert result.bytes == len(local_ids) * sum(r.block_len for r in moved), name
        assert result.descriptors == len(local_ids) * len(moved), name
        assert result.backend == "UCX" and result.seconds > 0 and result.gbps > 0, result
        assert worker.memory_type == ("DRAM" if cache.device.type == "cpu" else "VRAM")
        # The prefill side is notified of each completed read, naming the reader.
        (agent, msg), = pair.peer.call(op="notifs", name=name, count=1, wait_s=10)["notifs"]
        assert agent == worker.agent_name
        assert json.loads(msg) == {"kvconnect": "read", "engine_id": f"decode-{name}",
                                   "num_blocks": len(local_ids)}


@needs_nixl
def test_reads_are_byte_exact_for_every_layout(pair: Pair) -> None:
    _read_every_layout(pair)
    # Bad block ids fail before anything is posted.
    worker = pair.workers["mla"]
    with pytest.raises(IndexError, match=r"remote block ids .* \[0, 12\)"):
        worker.read_blocks("prefill-mla", [PREFILL_BLOCKS], [0])
    with pytest.raises(IndexError, match=r"local block ids must lie in \[0, 10\)"):
        worker.read_blocks("prefill-mla", [0], [-1])
    with pytest.raises(ValueError, match="2 remote block ids but 1 local"):
        worker.read_blocks("prefill-mla", [0, 1], [0])
    # Hybrid: the Mamba states alias the attention pages of the same KV tensor; only the
    # pages move, once.
    hybrid = pair.caches["hybrid"].committed_regions()
    assert len(transfer_regions(hybrid)) == len(pair.caches["hybrid"].tensors) < len(hybrid)


@needs_nixl
def test_registrations_cover_exactly_the_committed_extent(pair: Pair) -> None:
    for name, cache in pair.caches.items():
        worker = pair.workers[name]
        chunks = [c for t in cache.tensors for c in t.physical_chunks()]
        assert worker.num_registrations == len(chunks), name  # one per physical chunk
        for addr, length, dev in worker.registered_extents:
            assert dev == 0
            inside = [c for c in chunks if c.va <= addr and addr + length <= c.va + c.size]
            assert len(inside) == 1, f"{name}: extent {addr:#x}+{length} crosses chunks"
        total = sum(length for _, length, _ in worker.registered_extents)
        reserved = sum(t.capacity_bytes for t in cache.tensors)
        assert total <= cache.num_blocks * cache.bytes_per_block < reserved // 32, name
    # K/V split: exactly the K and V prefixes, split at the 2 MiB chunk boundary.
    cache = pair.caches["kv_split"]
    want = []
    for r in cache.committed_regions():
        first = 2 * MIB // r.block_len
        want += [(r.base_ptr, 2 * MIB, 0),
                 (r.base_ptr + 2 * MIB, (r.num_blocks - first) * r.block_len, 0)]
    assert sorted(pair.workers["kv_split"].registered_extents) == sorted(want)
    # The prefill side recommitted each segment as one handle: one registration per segment.
    md = HandshakeMetadata.from_json(pair.metadata["kv_split"])
    assert len(md.registrations) == 2 * 2  # 2 layers x (K, V)
    assert md.memory_type == "DRAM" and pair.workers["kv_split"].memory_type == "DRAM"
    # The packed layout registers one region of block-stride rows holding every layer.
    packed = HandshakeMetadata.from_json(pair.metadata["packed"])
    (region,) = packed.layout.regions
    assert region.block_len == region.block_stride
    assert len(packed.layout.layer_names) == 4
    assert packed.registrations == ((packed.regions[0].base_ptr,
                                     PREFILL_BLOCKS * region.block_stride, 0),)


@needs_nixl
def test_incompatible_layout_fails_before_any_transfer(pair: Pair, nixl_worker: Any) -> None:
    worker = pair.workers["mla"]
    with pytest.raises(IncompatiblePeerError) as err:
        worker.check_peer(pair.metadata["kv_split"])
    text = str(err.value)
    assert "block_size (tokens): local 64 != remote 16" in text
    assert "regions missing on remote: model.layers.0.self_attn.attn/latent" in text
    assert "layout: local blocks_first != remote kv_split_nhd" in text
    # Same layers, one block length different (half: a longer one than the stride is a
    # malformed document, MetadataError): the message names region, field and both sizes.
    doc = json.loads(pair.metadata["kv_split"])
    doc["engine_id"] = "prefill-doubled"
    doc["layout"]["regions"][0]["block_len"] //= 2
    fresh = nixl_worker("decode-fresh")  # no agent until it registers
    with pytest.raises(IncompatiblePeerError) as err:
        pair.workers["kv_split"].add_peer(json.dumps(doc))
    (diff,) = err.value.differences
    assert diff.startswith("block_len (bytes per kernel block) of region "
                           "model.layers.0.self_attn.attn/k: local 32768 != remote 16384: ")
    assert err.value.peer == "prefill-doubled"
    assert "prefill-doubled" not in pair.workers["kv_split"].peers
    with pytest.raises(KVConnectorError, match="unknown peer"):
        pair.workers["kv_split"].read_blocks("prefill-doubled", [0], [0])
    with pytest.raises(KVConnectorError, match="nothing registered"):
        fresh.add_peer(pair.metadata["kv_split"])


@needs_nixl
def test_wake_reregister_then_peer_close_and_local_close(pair: Pair) -> None:
    name = "kv_split"
    worker, cache = pair.workers[name], pair.caches[name]
    peer = f"prefill-{name}"
    if peer not in worker.peers:  # when this test runs alone
        worker.add_peer(pair.metadata[name])
    # Prefill sleeps and wakes (zeroed pages, same addresses), refills, re-registers.
    reply = pair.peer.call(op="sleep_wake", name=name, seed=2)
    new_md = HandshakeMetadata.from_json(reply["metadata"])
    old_md = HandshakeMetadata.from_json(pair.metadata[name])
    assert new_md.generation == old_md.generation + 1
    assert new_md.regions == old_md.regions  # same VA
    worker.update_peer(reply["metadata"])
    # The new connection needs the peer to make progress: while it stalls, the read runs
    # into its deadline and fails as a KVTransferError (the request is released, not leaked).
    pair.peer.call(op="stall", seconds=3)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match=r"timed out after 1 s") as err:
        worker.read_blocks(peer, REMOTE_IDS, _local_ids(name), timeout=1)
    assert 1 <= time.monotonic() - t0 < 3 and err.value.block_ids == _local_ids(name)
    pair.peer.recv(timeout=30)  # the stall is over
    worker.read_blocks(peer, REMOTE_IDS, _local_ids(name), timeout=30)
    _check_blocks(cache, _local_ids(name), REMOTE_IDS, seed=2)

    # Decode sleeps and wakes too: deregister, release, recommit, re-register, read again.
    worker.deregister()
    cache.release_physical()
    cache.recommit()
    assert not any(peerlib.read_block(cache, r, b).any() for r in cache.committed_regions()
                   for b in _local_ids(name))
    generation = worker.generation
    worker.reregister()
    assert worker.generation == generation + 1
    worker.read_blocks(peer, REMOTE_IDS, _local_ids(name), timeout=30)
    _check_blocks(cache, _local_ids(name), REMOTE_IDS, seed=2)

    # Prefill closes every worker: NIXL no longer knows any of its memory.
    report = pair.peer.call(op="close")["report"]
    for lay, rep in report.items():
        assert rep["num_registrations"] == 0, lay
        assert rep["still_registered"] and not any(rep["still_registered"]), (lay, rep)
    # A read from the closed peer fails fast with one error naming peer, blocks and cause.
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        worker.read_blocks(peer, [1, 3], [5, 6], timeout=10)
    assert time.monotonic() - t0 < 10
    assert err.value.peer == peer and err.value.block_ids == [5, 6]
    assert err.value.cause and peer in str(err.value) and "[5, 6]" in str(err.value)

    # Local close: no registrations, no remote agents, idempotent.
    del err  # its traceback holds this frame; nothing NIXL-owned stays reachable from it
    still_registered, still_knows_peer = _close_and_probe(worker, new_md.agent_name)
    assert still_registered == [False] * len(still_registered) and still_registered
    assert not still_knows_peer
    assert worker.num_registrations == 0 and worker.peers == []
    with pytest.raises(KVConnectorError, match="closed"):
        worker.read_blocks(peer, [0], [0])


def _close_and_probe(worker: NixlRegionWorker, peer_agent: str) -> tuple[list[bool], bool]:
    """Close ``worker`` twice (idempotent) while holding its agent, then ask the agent whether
    it still knows the registered extents and the peer. The agent reference dies with this
    frame, so no test frame or traceback keeps a NIXL agent alive."""
    agent, extents = worker._agent, worker.registered_extents
    worker.close()
    worker.close()
    try:
        return (peerlib._nixl_knows(agent, extents, "DRAM"),
                bool(agent.check_remote_metadata(peer_agent)))
    finally:
        del agent


# -- one process, no transfer ------------------------------------------------------------------

def test_register_before_final_commit_raises(nixl_worker: Any) -> None:
    cache = peerlib.make_cache(_spec("kv_split", 8, final=False))
    worker = nixl_worker("early")
    with cache:
        with pytest.raises(KVConnectorError, match="before its final commit"):
            worker.register_kv_cache(cache)
        assert not worker.is_registered and not worker.is_started  # no agent was started


@needs_nixl
def test_a_missing_backend_plugin_is_refused(nixl_worker: Any) -> None:
    worker = nixl_worker("no-plugin", backends=("NO_SUCH_BACKEND",), progress_thread=False)
    with pytest.raises(KVConnectorError, match="NO_SUCH_BACKEND"):
        worker.start()
    assert not worker.is_started


@needs_nixl
def test_register_regions_of_a_plain_allocation(nixl_worker: Any) -> None:
    """Memory that is no ExtensibleKVCache (an ordinary allocation, the benchmarks' NIXL
    control) registers exactly its committed regions, one extent per allocation."""
    from kvconnect.layout import allocate_kv_caches, preset
    from kvconnect.views import committed_regions

    cfg = preset("llama3-8b-like", num_blocks=6, num_layers=2)
    raw, kv = allocate_kv_caches(cfg, "cpu", num_blocks=6)
    worker = nixl_worker("plain")
    regions = committed_regions(kv, 6, cfg)
    md = worker.register_regions(regions, [(r.data_ptr(), r.numel()) for r in raw], config=cfg)
    assert md.memory_type == "DRAM" and worker.num_registrations == len(raw)
    want = sorted((r.data_ptr(), r.numel(), 0) for r in raw)
    assert sorted(worker.registered_extents) == want
    assert md.layout.block_size == 16 and md.layout.layout == cfg.layout
    with pytest.raises(TypeError, match="unknown layout facts"):
        nixl_worker("plain2").register_regions(regions, [], colour="blue")


def test_descriptor_crossing_a_chunk_boundary_raises(nixl_worker: Any) -> None:
    # Hybrid pages are 192 KiB: with the warm-up chunk kept (single_handle=False), block 10
    # straddles the 2 MiB boundary between the first and second physical allocation.
    cache = peerlib.make_cache(_spec("hybrid", 16, single_handle=False))
    worker = nixl_worker("crossing")
    with cache:
        assert cache.num_physical_chunks > len(cache.tensors)
        with pytest.raises(KVConnectorError, match=r"crosses the end of physical chunk.*11283"):
            worker.register_kv_cache(cache)
        assert not worker.is_registered
    chunks = [(0x10000, 0x1000), (0x11000, 0x1000)]
    ok = np.array([[0x10000, 0x1000, 0], [0x11800, 0x800, 0]], dtype=np.uint64)
    assert check_descriptors_in_chunks(ok, chunks).tolist() == [0, 1]
    with pytest.raises(KVConnectorError, match="descriptor 1 .* crosses"):
        check_descriptors_in_chunks(np.array([[0x10000, 8, 0], [0x10ff0, 0x20, 0]]), chunks)
    with pytest.raises(KVConnectorError, match="outside every committed"):
        check_descriptors_in_chunks(np.array([[0x12000, 8, 0]]), chunks)


def test_region_descriptors_and_extents_follow_committed_regions() -> None:
    for name in LAYOUTS:
        cache = peerlib.make_cache(_spec(name, 6))
        with cache:
            regions = cache.committed_regions()
            descs = region_descriptors(regions)
            assert descs.dtype == np.uint64 and descs.shape == (len(regions) * 6, 3)
            for r_i, region in enumerate(regions):
                for b in range(6):
                    assert descs[r_i * 6 + b].tolist() == [
                        region.block_address(b), region.block_len, 0]
            chunks = [c for t in cache.tensors for c in t.physical_chunks()]
            extents = registration_extents(regions, chunks)
            assert len(extents) == len(cache.tensors) * cache.tensors[0].num_segments
            for region in regions:  # every block lies inside one registered extent
                for b in range(region.num_blocks):
                    a = region.block_address(b)
                    assert any(x <= a and a + region.block_len <= x + n for x, n, _ in extents)
            # never the storage / reservation size
            assert sum(n for _, n, _ in extents) <= 6 * cache.bytes_per_block


def test_memory_type_for_device() -> None:
    assert memory_type_for_device("cpu") == ("DRAM", 0)
    assert memory_type_for_device("cuda:3") == ("VRAM", 3)
    assert memory_type_for_device("cuda") == ("VRAM", 0)
    with pytest.raises(ValueError, match="no NIXL memory type"):
        memory_type_for_device("xpu:0")


def test_metadata_roundtrip_and_validation() -> None:
    md = peerlib.sample_metadata()
    assert HandshakeMetadata.from_json(md.to_json()) == md
    doc = json.loads(md.to_json())

    def bad(mutate, match: str, **kw: Any) -> None:
        d = json.loads(json.dumps(doc))
        mutate(d)
        with pytest.raises(MetadataError, match=match):
            HandshakeMetadata.from_json(json.dumps(d), **kw)

    with pytest.raises(MetadataError, match="above the 100-byte limit"):
        HandshakeMetadata.from_json(md.to_json(), max_bytes=100)
    with pytest.raises(MetadataError, match="not valid JSON"):
        HandshakeMetadata.from_json(pickle.dumps({"schema": "x"}))
    with pytest.raises(MetadataError, match="must be an object"):
        HandshakeMetadata.from_json("[1, 2]")
    bad(lambda d: d.update(schema="other/9"), "unknown metadata schema")
    bad(lambda d: d.update(agent_metadata_b64="%%%"), "not valid base64")
    bad(lambda d: d.pop("engine_id"), "missing field 'engine_id'")
    bad(lambda d: d.update(memory_type="FILE"), "memory_type must be")
    bad(lambda d: d["regions"][0].__setitem__(0, "0x1000"), r"regions\[0\].base_ptr must be an int")
    bad(lambda d: d["regions"][0].__setitem__(1, True), r"regions\[0\].device_id must be an int")
    bad(lambda d: d["regions"][0].__setitem__(0, -1), "must be >= 0")
    bad(lambda d: d["regions"][0].pop(), r"regions\[0\] must be \[base_ptr, device_id\]")
    bad(lambda d: d["regions"].pop(), "1 region addresses for 2 layout regions")
    bad(lambda d: d["layout"]["regions"][1].__setitem__("block_len", 0),
        r"layout.regions\[1\].block_len must be positive")
    bad(lambda d: d["layout"].update(num_blocks=True), "layout.num_blocks must be an int")
    bad(lambda d: d["layout"]["regions"][1].update(part="k"), "layer/part 'layer0/k' twice")
    bad(lambda d: d["layout"].update(layers="layer0"), "layout.layers must be a list")
    bad(lambda d: d["layout"].update(schema="kvconnect.peer_layout/0"), "unknown layout schema")
    bad(lambda d: d.pop("layout"), "missing field 'layout'")
    bad(lambda d: d["registrations"].append([1, 2]), r"registrations\[2\] must be")
    assert base64.b64decode(doc["agent_metadata_b64"]) == b"\x00\x01md"


def test_handshake_layout_differences_are_readable() -> None:
    """The handshake's layout is compared by PeerLayout.differences (its cases:
    tests/test_peer_layout.py); the error names the peer and quotes them."""
    a = peerlib.sample_metadata().layout
    b = replace(a, block_size=32, regions=(replace(a.regions[0], block_len=8192),
                                           a.regions[1]))
    assert a.differences(a) == []
    # Another package version alone is compatible: the wire schema decides, not the release.
    assert a.differences(replace(a, kvconnect_version="9.9.9")) == []
    assert [d.split(":")[0] for d in a.differences(b)] == [
        "block_size (tokens)", "block_len (bytes per kernel block) of region layer0/k"]
    err = IncompatiblePeerError(a.differences(b), peer="p")
    assert "peer 'p' has an incompatible KV layout: block_size (tokens)" in str(err)
    t = KVTransferError("p", [1, 2], RuntimeError("boom"))
    assert (t.peer, t.block_ids, t.cause) == ("p", [1, 2], "RuntimeError: boom")
    assert str(t) == "KV transfer with peer 'p' failed for blocks [1, 2]: RuntimeError: boom"


@pytest.mark.gpu
@needs_nixl
def test_gpu_reads_byte_exact_and_after_wake() -> None:
    """The same on CUDA (VRAM): prefill on cuda:0, decode on cuda:1 where it exists."""
    import torch

    decode_device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    with open_pair("cuda:0", decode_device) as p:
        md = HandshakeMetadata.from_json(p.metadata["kv_split"])
        assert md.memory_type == "VRAM" and {r.device_id for r in md.regions} == {0}
        _read_every_layout(p)
        name, worker, cache = "kv_split", p.workers["kv_split"], p.caches["kv_split"]
        reply = p.peer.call(op="sleep_wake", name=name, seed=2)
        worker.update_peer(reply["metadata"])
        worker.read_blocks(f"prefill-{name}", REMOTE_IDS, _local_ids(name), timeout=60)
        _check_blocks(cache, _local_ids(name), REMOTE_IDS, seed=2)
