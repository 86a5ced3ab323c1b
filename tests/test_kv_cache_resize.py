"""ExtensibleKVCache.resize: grow and shrink a final cache at the same addresses."""

from __future__ import annotations

import pytest
import torch
from test_kv_cache import OomInjectingHostDriver

from kvconnect.kv_cache import ExtensibleKVCache, KVCacheStateError
from kvconnect.layout import preset
from kvconnect.vmm.base import VmmError

MIB = 1024 * 1024


def _cache(driver: object = "cpu", **kw: int) -> ExtensibleKVCache:
    # 2 layers, K/V split: 4 segments of 32 KiB per block; 64 blocks make one 2 MiB granule
    cfg = preset("llama3-8b-like", num_blocks=16, num_layers=kw.pop("num_layers", 2))
    return ExtensibleKVCache(cfg, driver, capacity_blocks=kw.pop("capacity_blocks", 1024))


def _fill(cache: ExtensibleKVCache, blocks: int) -> list[torch.Tensor]:
    """Block ``b`` of every segment filled with ``b % 251 + 1``; returns what was written."""
    out = []
    for t in cache.tensors:
        per_block = cache.plan.tensors[0].segment_bytes_per_block
        for s in range(t.num_segments):
            v = t.committed_view(s * t.segment_capacity, blocks * per_block)
            v.view(blocks, per_block).copy_(
                (torch.arange(blocks, dtype=torch.int32) % 251 + 1).to(torch.uint8)[:, None])
            out.append(v.clone())
    return out


def test_grow_after_the_final_commit_keeps_addresses_and_contents() -> None:
    with _cache() as cache:
        cache.allocate()
        cache.extend_kv_cache(64)
        ptrs = {n: t.data_ptr() for n, t in cache.kv_caches().items()}
        written = _fill(cache, 64)
        assert cache.num_physical_chunks == 4
        added = cache.resize(256)
        assert cache.num_blocks == 256 and added == 4 * 6 * MIB  # 8 MiB per segment now
        assert cache.num_physical_chunks == 8  # one more allocation per segment
        assert {n: t.data_ptr() for n, t in cache.kv_caches().items()} == ptrs
        kept = [t.committed_view(s * t.segment_capacity, 64 * 32 * 1024)
                for t in cache.tensors for s in range(t.num_segments)]
        assert all(torch.equal(a, b) for a, b in zip(written, kept, strict=True))
        regions = cache.committed_regions()
        assert all(r.num_blocks == 256 for r in regions)
        # the new blocks are usable memory
        _fill(cache, 256)


def test_shrink_releases_whole_allocations_past_the_new_tail() -> None:
    with _cache() as cache:
        cache.allocate()
        cache.extend_kv_cache(64)
        cache.resize(256)
        cache.resize(512)
        assert cache.num_physical_chunks == 12
        released = cache.resize(256)
        assert released == -4 * 8 * MIB and cache.num_physical_chunks == 8
        assert cache.num_blocks == 256
        # 100 blocks lie inside the grown allocation [2, 8) MiB: it stays whole
        assert cache.resize(100) == 0 and cache.num_blocks == 100
        assert cache.num_physical_chunks == 8
        assert cache.resize(64) == -4 * 6 * MIB and cache.num_physical_chunks == 4
        # below the start-up allocation nothing more can go: it is one mapping
        assert cache.resize(10) == 0 and cache.committed_bytes == 4 * 2 * MIB
        assert cache.resize(300) > 0 and cache.num_blocks == 300


def test_resize_refusals_change_nothing() -> None:
    with _cache(capacity_blocks=256) as cache:
        cache.allocate()
        with pytest.raises(KVCacheStateError, match="before extend_kv_cache"):
            cache.resize(10)
        cache.extend_kv_cache(64)
        before = (cache.num_blocks, cache.committed_bytes, cache.num_physical_chunks)
        with pytest.raises(ValueError, match="capacity_blocks=256"):
            cache.resize(257)
        with pytest.raises(ValueError, match="num_blocks"):
            cache.resize(0)
        assert (cache.num_blocks, cache.committed_bytes, cache.num_physical_chunks) == before
        cache.release_physical()
        with pytest.raises(KVCacheStateError, match="released"):
            cache.resize(128)
        cache.recommit()
        assert (cache.num_blocks, cache.committed_bytes) == before[:2]


def test_a_grow_the_device_cannot_commit_rolls_back_every_tensor() -> None:
    drv = OomInjectingHostDriver()
    with _cache(drv, num_layers=3) as cache:
        cache.allocate()
        cache.extend_kv_cache(64)
        before = ([t.committed_bytes for t in cache.tensors], cache.num_physical_chunks,
                  drv.live_handles)
        drv.fail_after = 4  # tensors 0 and 1 grow (2 segments each), tensor 2 fails
        with pytest.raises(VmmError, match="OUT_OF_MEMORY"):
            cache.resize(256)
        assert cache.num_blocks == 64
        assert ([t.committed_bytes for t in cache.tensors], cache.num_physical_chunks,
                drv.live_handles) == before
        assert cache.resize(256) > 0


def test_sleep_after_a_shrink_wakes_at_the_shrunk_size() -> None:
    with _cache() as cache:
        cache.allocate()
        cache.extend_kv_cache(64)
        cache.resize(512)
        cache.resize(128)
        committed = cache.committed_bytes
        cache.release_physical()
        cache.recommit()
        assert cache.num_blocks == 128 and cache.committed_bytes == committed
        assert cache.num_physical_chunks == 4  # one allocation per segment again


def test_a_peer_maps_a_grown_segment_as_one_contiguous_run() -> None:
    """After a grow a segment holds two physical allocations; a peer mapping them (kvconnect's
    ipc path) views blocks across the boundary, and nothing past the committed run."""
    import os

    from kvconnect.ipc import PeerMapping
    from kvconnect.vmm import AllocationOptions
    from kvconnect.vmm.host import HostVmmDriver

    drv = HostVmmDriver()
    cfg = preset("llama3-8b-like", num_blocks=16, num_layers=1)
    with ExtensibleKVCache(cfg, drv, capacity_blocks=1024,
                           options=AllocationOptions(shareable=True)) as cache:
        cache.allocate()
        cache.extend_kv_cache(64)
        cache.resize(192)  # 2 MiB + 4 MiB per segment
        (t,) = cache.tensors
        t.committed_view(0, 6 * MIB).view(torch.uint8).copy_(
            (torch.arange(6 * MIB) % 251).to(torch.uint8))
        chunks = t.export_handles()
        fds = [c.fd for c in chunks]
        try:
            recs = [{"segment": c.segment, "offset": c.offset, "size": c.size} for c in chunks]
            assert len(recs) == 4  # two segments (K, V) of two allocations each
            with PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs,
                                           fds) as m:
                across = m.view(2 * MIB - 4096, 8192)  # the boundary of the two allocations
                want = (torch.arange(2 * MIB - 4096, 2 * MIB + 4096) % 251).to(torch.uint8)
                assert torch.equal(across, want)
                with pytest.raises(ValueError, match="not inside one imported chunk"):
                    m.view(6 * MIB - 4096, 8192)  # past the committed run
                del across
        finally:
            for fd in fds:
                os.close(fd)
