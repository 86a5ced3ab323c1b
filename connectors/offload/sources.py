"""Where a CPU offload connector reads its geometry and bounded views from.

Two sources with one interface (``num_blocks``, ``capacity_blocks``, ``regions()``,
``layout(regions)``, ``flat_view(region, span)``, ``state_token()``, ``check_usable()``):

- :class:`CacheSource`: an :class:`~kvconnect.kv_cache.ExtensibleKVCache` (any
  :class:`~kvconnect.cache_source.KVCacheSource`); views are ``committed_view``s of its
  ExtensibleTensors, re-derived when its commit state changes;
- :class:`TensorsSource`: ordinary (or already narrowed) per-layer tensors with a
  ``KVCacheConfig``; geometry from :func:`kvconnect.views.committed_regions`, views from the
  narrowed, storage-bounded layers. No automatic rebind.

:func:`block_source` picks by type, never by duck typing.
"""

from __future__ import annotations

import torch

from kvconnect.cache_source import KVCacheSource
from kvconnect.peer_layout import PeerLayout
from kvconnect.views import CommittedRegion, KVCacheConfigLike, KVCaches

from ..errors import KVConnectorError

__all__ = ["CacheSource", "TensorsSource", "block_source"]


class CacheSource:
    """Geometry and bounded views from an ExtensibleKVCache, or any KVCacheSource
    (re-derived on state changes)."""

    def __init__(self, cache: KVCacheSource) -> None:
        if not isinstance(cache, KVCacheSource):
            raise TypeError(
                f"cache must be an ExtensibleKVCache (a KVCacheSource), got "
                f"{type(cache).__name__}; for ordinary tensors use "
                "CPUOffloadConnector.from_kv_caches()"
            )
        self.cache = cache
        self.capacity_blocks: int | None = cache.capacity_blocks

    @property
    def num_blocks(self) -> int:
        return int(self.cache.num_blocks)

    def regions(self) -> list[CommittedRegion]:
        return list(self.cache.committed_regions())

    def layout(self, regions: list[CommittedRegion]) -> PeerLayout:
        """``PeerLayout.from_cache`` of ``regions`` (from :meth:`regions`, same order)."""
        return PeerLayout.from_cache(self.cache, regions)

    def flat_view(self, r: CommittedRegion, span: int) -> torch.Tensor:
        tensors = self.cache.tensors
        if not 0 <= r.tensor_index < len(tensors):
            raise KVConnectorError(
                f"region {r.layer_name}/{r.part} names tensor {r.tensor_index}, but the cache "
                f"has {len(tensors)} tensors"
            )
        t = tensors[r.tensor_index]
        # committed_view raises unless the whole span is committed memory of one segment
        return t.committed_view(r.base_ptr - t.base_ptr, span)

    def state_token(self) -> object:
        return (self.num_blocks,
                tuple((t.committed_bytes, t.num_physical_chunks) for t in self.cache.tensors))

    def check_usable(self) -> None:
        tensors = self.cache.tensors
        if not tensors:
            raise KVConnectorError("the KV cache is not allocated: call cache.allocate() first")
        if any(t.is_closed for t in tensors):
            raise KVConnectorError("the KV cache was closed; close() this CPU offload connector")
        if self.cache.is_released or any(t.is_released for t in tensors):
            raise KVConnectorError(
                "the KV cache is asleep (physical memory released): call cache.recommit() "
                "before save/load; blocks already in the CPU pool are kept"
            )


class TensorsSource:
    """Geometry from ``committed_regions(kv_caches, num_blocks, config)`` over ordinary (or
    already narrowed) tensors; views come from the narrowed, storage-bounded layers."""

    capacity_blocks: int | None = None

    def __init__(self, kv_caches: KVCaches, num_blocks: int,
                 kv_cache_config: KVCacheConfigLike) -> None:
        from kvconnect.views import committed_regions, narrow_kv_caches_to_num_blocks

        self._num_blocks = int(num_blocks)
        self._config = kv_cache_config
        self._regions = committed_regions(kv_caches, self._num_blocks, kv_cache_config)
        narrowed = narrow_kv_caches_to_num_blocks(kv_caches, self._num_blocks, kv_cache_config)
        self._storages: dict[str, torch.UntypedStorage] = {}
        self._device: dict[str, torch.device] = {}
        for name, value in narrowed.items():
            first = value[0] if isinstance(value, (list, tuple)) else value
            self._storages[name] = first.untyped_storage()
            self._device[name] = first.device

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def regions(self) -> list[CommittedRegion]:
        return list(self._regions)

    def layout(self, regions: list[CommittedRegion]) -> PeerLayout:
        """The layout of ``regions`` (from :meth:`regions`, same order) with the config's
        facts (no tensors: no offsets)."""
        return PeerLayout.from_regions(regions, self._num_blocks, config=self._config)

    def flat_view(self, r: CommittedRegion, span: int) -> torch.Tensor:
        name = r.layers[0] if r.layers else r.layer_name
        storage = self._storages[name]
        start = r.base_ptr - storage.data_ptr()
        # The narrowed storage is bounded to the committed extent, so this is a bounds check
        # against committed memory, not a source of geometry.
        if start < 0 or start + span > storage.nbytes():
            raise KVConnectorError(
                f"region {r.layer_name}/{r.part} ({span} bytes at {r.base_ptr:#x}) is not "
                f"inside the committed storage of layer {name!r}"
            )
        out = torch.empty(0, dtype=torch.uint8, device=self._device[name])
        return out.set_(storage, start, (span,), (1,))

    def state_token(self) -> object:
        return self._num_blocks

    def check_usable(self) -> None:
        return None


def block_source(cache: KVCacheSource | CacheSource | TensorsSource
                 ) -> CacheSource | TensorsSource:
    """``cache`` itself when it is a source already, else a :class:`CacheSource` over it."""
    if isinstance(cache, (CacheSource, TensorsSource)):
        return cache
    return CacheSource(cache)
