"""An extensible KV cache shaped exactly like vLLM 0.33's own allocation (needs vLLM).

vLLM 0.33 allocates one int8 buffer and views it per layer with ``create_kv_cache_views``.
:class:`VllmKVCache` is an :class:`~kvconnect.kv_cache.ExtensibleKVCache` of that buffer
(one :class:`~kvconnect.tensor.ExtensibleTensor`: one segment per layer, and per head for
``LHBNC``, when layer-outer; one segment when block-outer) for ``capacity_blocks`` blocks,
whose views are built by vLLM's own ``create_kv_cache_views`` over the reservation: exactly
the views vLLM would build for an allocation of ``capacity_blocks`` blocks. Only the
committed prefix is backed; connectors get :meth:`connector_config` (the placement at
capacity, ``num_blocks`` = committed).

Units: blocks are vLLM's logical blocks; bytes unless a name says blocks.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout.foreign import VllmKVCacheConfigLike, config_from_vllm, to_vllm_config
from kvconnect.tensor import ExtensibleTensor
from kvconnect.views import committed_extents
from kvconnect.vmm import AllocationOptions, DeviceSpec

__all__ = ["VllmKVCache"]


class VllmKVCache(ExtensibleKVCache):
    """vLLM 0.33's KV cache over a VMM reservation of ``capacity_blocks`` blocks.

    ``kv_cache_config`` is vLLM's (as its planner made it, for any block count);
    ``layout`` defaults to its ``kv_cache_layout``; ``kernel_block_size`` (tokens) is the
    attention kernel's block size when it splits vLLM's blocks; ``options`` is what the
    physical memory is requested with. Everything else (lifecycle, ``config``,
    ``committed_regions``, ...) is :class:`~kvconnect.kv_cache.ExtensibleKVCache`'s;
    :meth:`kv_caches` are vLLM's views.
    """

    def __init__(self, kv_cache_config: VllmKVCacheConfigLike, device: DeviceSpec = "cpu", *,
                 layout: object = None, capacity_blocks: int | None = None,
                 kernel_block_size: int | None = None,
                 options: AllocationOptions | None = None) -> None:
        self._template = kv_cache_config
        self._kernel_block_size = kernel_block_size
        super().__init__(config_from_vllm(kv_cache_config, layout, kernel_block_size), device,
                         capacity_blocks, options=options)

    def capacity_config(self) -> VllmKVCacheConfigLike:
        """vLLM's ``KVCacheConfig`` of the whole reservation (``capacity_blocks`` blocks)."""
        return to_vllm_config(self.config.with_num_blocks(self.capacity_blocks), self._template)

    def connector_config(self) -> VllmKVCacheConfigLike:
        """vLLM's ``KVCacheConfig`` a connector of this cache is handed: the placement of the
        reservation with ``num_blocks`` = the committed blocks (what vLLM's extensible cache
        hands its connectors)."""
        return to_vllm_config(self.config.with_num_blocks(self.capacity_blocks),
                              self._template, num_blocks=self.num_blocks)

    def kv_caches(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """vLLM's per-layer views over the WHOLE reservation (what its model runner would
        hold). Only the first :attr:`num_blocks` blocks are backed."""
        return cast(dict[str, torch.Tensor], super().kv_caches())

    def committed_extents(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the committed block prefixes (logical blocks, not the
        granule-rounded physical commit), adjacent ones merged, in address order."""
        (t,) = self.tensors
        extents = committed_extents(self.plan, 0, t.segment_capacity, self.num_blocks)
        return [(t.base_ptr + start, end - start) for start, end in extents]

    def _build_views(self, tensors: list[ExtensibleTensor]) -> dict[str, Any]:
        """vLLM's ``create_kv_cache_views`` over the reservation (``allocate`` builds them
        once; a failure releases what was reserved)."""
        from vllm.v1.kv_cache_interface import create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        (raw_tensor,) = tensors
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
                raw, spec, self.capacity_blocks, KVCacheLayout[self.config.layout], t,
                kernel_block_size=self._kernel_block_size), strict=True))
        return views
