"""kvconnect's placement-form config -> vLLM 0.33's own ``KVCacheConfig`` (needs vLLM).

The reverse of :func:`kvconnect.layout.foreign.config_from_vllm`: vLLM's tensors are
rebuilt from kvconnect's, its groups (and every other field) are taken from ``template``,
vLLM's own object. Units: bytes; ``num_blocks`` is logical blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from kvconnect.layout import KVCacheConfig, LayoutError
from kvconnect.layout.foreign import VllmKVCacheConfigLike

__all__ = ["replace_vllm_config", "to_vllm_config"]


def replace_vllm_config(config: VllmKVCacheConfigLike, **changes: object
                        ) -> VllmKVCacheConfigLike:
    """``dataclasses.replace`` of vLLM's ``KVCacheConfig`` (a dataclass, which the protocol
    cannot say: hence the cast)."""
    return dataclasses.replace(cast(Any, config), **changes)


def to_vllm_config(config: KVCacheConfig, template: VllmKVCacheConfigLike, *,
                   num_blocks: int | None = None) -> VllmKVCacheConfigLike:
    """vLLM's ``KVCacheConfig``: ``template`` with ``config``'s tensors (placement form),
    ``config.layout`` as its ``kv_cache_layout`` and ``num_blocks`` (default: the config's;
    may be below the blocks the placement holds, as for an extensible cache)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    if not config.is_placement:
        raise LayoutError("to_vllm_config needs a placement-form config (vLLM's layouts); "
                          f"{config.layout!r} uses the seed's shorthand tensors")
    tensors = [KVCacheTensor(size=t.size, layers=list(t.layers), layer_stride=t.layer_stride,
                             block_stride=t.block_stride, offset=t.offset)
               for t in config.kv_cache_tensors]
    return replace_vllm_config(template, kv_cache_tensors=tensors,
                               num_blocks=config.num_blocks if num_blocks is None else num_blocks,
                               kv_cache_layout=config.layout)
