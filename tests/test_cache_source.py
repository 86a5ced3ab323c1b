"""KVCacheSource: the members connectors read. ExtensibleKVCache satisfies it, a cache that
only wraps one is served by a connector like the cache itself, and an object lacking a
member is refused."""

from __future__ import annotations

import pytest
import torch

from kvconnect import KVCacheSource
from kvconnect.connectors.offload.connector import CPUOffloadConnector
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import KVCacheConfig, preset
from kvconnect.peer_layout import PeerLayout
from kvconnect.tensor import ExtensibleTensor
from kvconnect.views import CommittedRegion

NUM_BLOCKS = 8


class WrappedCache:
    """Forwards exactly the KVCacheSource members to an ExtensibleKVCache (nothing else)."""

    def __init__(self, cache: ExtensibleKVCache) -> None:
        self._cache = cache

    @property
    def config(self) -> KVCacheConfig:
        return self._cache.config

    @property
    def num_blocks(self) -> int:
        return self._cache.num_blocks

    @property
    def capacity_blocks(self) -> int:
        return self._cache.capacity_blocks

    @property
    def device(self) -> torch.device:
        return self._cache.device

    @property
    def is_final(self) -> bool:
        return self._cache.is_final

    @property
    def is_released(self) -> bool:
        return self._cache.is_released

    @property
    def tensors(self) -> list[ExtensibleTensor]:
        return self._cache.tensors

    def committed_regions(self) -> list[CommittedRegion]:
        return self._cache.committed_regions()


class NoRegions:
    """Every member but committed_regions()."""

    config = None
    num_blocks = capacity_blocks = 1
    device = torch.device("cpu")
    is_final = True
    is_released = False
    tensors: list[ExtensibleTensor] = []


@pytest.fixture
def cache():
    c = ExtensibleKVCache(preset("qwen-small-like", num_blocks=NUM_BLOCKS, num_layers=2), "cpu",
                          capacity_blocks=4 * NUM_BLOCKS)
    c.allocate()
    c.extend_kv_cache(NUM_BLOCKS)
    yield c
    c.close(force=True)


def test_extensible_cache_and_a_wrapper_are_sources(cache):
    assert isinstance(cache, KVCacheSource)
    assert isinstance(WrappedCache(cache), KVCacheSource)
    assert not isinstance(NoRegions(), KVCacheSource)
    assert not isinstance({"num_blocks": 1}, KVCacheSource)


def test_offload_through_a_wrapper_moves_the_caches_bytes(cache):
    """The offload connector reads only KVCacheSource members: over a wrapper it builds the
    same layout and saves / loads the cache's own blocks."""
    src = WrappedCache(cache)
    assert PeerLayout.from_cache(src) == PeerLayout.from_cache(cache)
    gen = torch.Generator().manual_seed(7)
    for t in cache.tensors:
        for s in range(t.num_segments):
            view = t.segment_view(s)[:t.committed_bytes[s]]
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))
    r = cache.committed_regions()[0]
    block = cache.region_view(r)[r.block_stride:r.block_stride + r.block_len]
    before = block.clone()
    with CPUOffloadConnector(src, 4) as conn:
        assert conn.layout == PeerLayout.from_cache(cache)
        conn.save([1], keys=["b1"]).wait()
        block.zero_()
        conn.load([1], keys=["b1"]).wait()
    assert torch.equal(block, before)


def test_offload_refuses_what_is_not_a_source():
    with pytest.raises(TypeError, match="KVCacheSource"):
        CPUOffloadConnector(NoRegions(), 4)  # type: ignore[arg-type]
