"""An extensible KV cache shaped exactly like vLLM 0.33's own allocation (needs vLLM).

vLLM 0.33 allocates one int8 buffer and views it per layer with ``create_kv_cache_views``.
:class:`VllmKVCache` reserves that buffer as an :class:`~kvconnect.tensor.ExtensibleTensor`
(one segment per layer, and per head for ``LHBNC``, when layer-outer; one segment when
block-outer) for ``capacity_blocks`` blocks, and builds the views with vLLM's own
``create_kv_cache_views`` over the reservation: exactly the views vLLM would build for an
allocation of ``capacity_blocks`` blocks. Only the committed prefix is backed; connectors
get :meth:`connector_config` (the placement at capacity, ``num_blocks`` = committed).

Units: blocks are vLLM's logical blocks; bytes unless a name says blocks.
"""

from __future__ import annotations

import torch

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import KVCacheConfig
from kvconnect.layout.foreign import VllmKVCacheConfigLike, config_from_vllm
from kvconnect.tensor import ExtensibleTensor
from kvconnect.views import CommittedRegion, committed_extents
from kvconnect.vmm import AllocationOptions, DeviceSpec

from .convert import to_vllm_config

__all__ = ["VllmKVCache"]


class VllmKVCache:
    """vLLM 0.33's KV cache over a VMM reservation of ``capacity_blocks`` blocks.

    ``kv_cache_config`` is vLLM's (as its planner made it, for any block count);
    ``layout`` defaults to its ``kv_cache_layout``; ``kernel_block_size`` (tokens) is the
    attention kernel's block size when it splits vLLM's blocks; ``options`` is what the
    physical memory is requested with. Lifecycle as
    :class:`~kvconnect.kv_cache.ExtensibleKVCache` (``allocate``, ``ensure_kv_cache_blocks``,
    ``extend_kv_cache``, ``resize``, ``release_physical`` / ``recommit``, ``close``), which it wraps;
    like it, a :class:`~kvconnect.cache_source.KVCacheSource` (connectors read it the same).
    """

    def __init__(self, kv_cache_config: VllmKVCacheConfigLike, device: DeviceSpec = "cpu", *,
                 layout: object = None, capacity_blocks: int | None = None,
                 kernel_block_size: int | None = None,
                 options: AllocationOptions | None = None) -> None:
        self._template = kv_cache_config
        self._config = config_from_vllm(kv_cache_config, layout, kernel_block_size)
        self._kernel_block_size = kernel_block_size
        self.cache = ExtensibleKVCache(self._config, device, capacity_blocks, options=options)
        self._views: dict[str, torch.Tensor] | None = None

    # -- what it is ------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return self._config.layout

    @property
    def config(self) -> KVCacheConfig:
        """kvconnect's config of the cache (its planned block count)."""
        return self._config

    @property
    def capacity_blocks(self) -> int:
        return self.cache.capacity_blocks

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    # -- what connectors read (KVCacheSource) -------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.cache.device

    @property
    def is_final(self) -> bool:
        return self.cache.is_final

    @property
    def is_released(self) -> bool:
        return self.cache.is_released

    @property
    def tensors(self) -> list[ExtensibleTensor]:
        """The one ExtensibleTensor of vLLM's buffer."""
        return self.cache.tensors

    def committed_regions(self) -> list[CommittedRegion]:
        return self.cache.committed_regions()

    def capacity_config(self) -> VllmKVCacheConfigLike:
        """vLLM's ``KVCacheConfig`` of the whole reservation (``capacity_blocks`` blocks)."""
        return to_vllm_config(self._config.with_num_blocks(self.capacity_blocks), self._template)

    def connector_config(self) -> VllmKVCacheConfigLike:
        """vLLM's ``KVCacheConfig`` a connector of this cache is handed: the placement of the
        reservation with ``num_blocks`` = the committed blocks (what vLLM's extensible cache
        hands its connectors)."""
        return to_vllm_config(self._config.with_num_blocks(self.capacity_blocks),
                              self._template, num_blocks=self.num_blocks)

    # -- lifecycle ---------------------------------------------------------------------------
    def allocate(self) -> None:
        """Reserve, commit one block, and build vLLM's views over the reservation."""
        from vllm.v1.kv_cache_interface import create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        self.cache.allocate()
        try:
            (raw_tensor,) = self.cache.tensors
            raw = raw_tensor.full_view().view(torch.int8)
            cfg = self.capacity_config()
            specs = {n: g.kv_cache_spec for g in cfg.kv_cache_groups for n in g.layer_names}
            views: dict[str, torch.Tensor] = {}
            for t in cfg.kv_cache_tensors:
                spec = specs[t.layers[0]]
                per_layer = getattr(spec, "kv_cache_specs", None)
                if per_layer is not None:
                    spec = per_layer[t.layers[0]]
                views.update(zip(t.layers, create_kv_cache_views(
                    raw, spec, self.capacity_blocks, KVCacheLayout[self.layout], t,
                    kernel_block_size=self._kernel_block_size), strict=True))
        except BaseException:
            self.cache.close(force=True)  # never mask the error with LiveViewsError
            raise
        self._views = views

    def kv_caches(self) -> dict[str, torch.Tensor]:
        """vLLM's per-layer views over the WHOLE reservation (what its model runner would
        hold). Only the first :attr:`num_blocks` blocks are backed."""
        if self._views is None:
            raise RuntimeError("kv_caches() before allocate()")
        return dict(self._views)

    def ensure_kv_cache_blocks(self, num_blocks: int) -> None:
        self.cache.ensure_kv_cache_blocks(num_blocks)

    def extend_kv_cache(self, num_blocks: int, single_handle: bool = True) -> None:
        self.cache.extend_kv_cache(num_blocks, single_handle=single_handle)

    def resize(self, num_blocks: int) -> int:
        """:meth:`ExtensibleKVCache.resize <kvconnect.kv_cache.ExtensibleKVCache.resize>`:
        grow or shrink at the same addresses; returns the change of committed bytes."""
        return self.cache.resize(num_blocks)

    def release_physical(self) -> None:
        self.cache.release_physical()

    def recommit(self) -> None:
        self.cache.recommit()

    def committed_extents(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the committed block prefixes (logical blocks, not the
        granule-rounded physical commit), adjacent ones merged, in address order."""
        (t,) = self.cache.tensors
        extents = committed_extents(self.cache.plan, 0, t.segment_capacity, self.num_blocks)
        return [(t.base_ptr + start, end - start) for start, end in extents]

    def close(self, *, force: bool = False) -> None:
        """Release the reservation (idempotent). Refuses with ``LiveViewsError`` while views
        from :meth:`kv_caches` are still referenced, unless ``force`` (see
        ``ExtensibleKVCache.close``)."""
        self._views = None
        self.cache.close(force=force)

    def __enter__(self) -> VllmKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
