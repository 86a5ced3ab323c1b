"""KV cache configs (vLLM 0.33's model) and their physical layouts.

A :class:`KVCacheConfig` says *what* is stored (``num_blocks`` logical blocks, groups of
layers with one spec each) and *where*: each :class:`KVCacheTensor` places a set of layers
in a backing buffer as vLLM 0.33 does (``offset + l * layer_stride + b * block_stride``),
and ``layout`` names the page format (vLLM's ``LBHNC`` ... ``BHLNC``, or the seed's
``kv_split_nhd`` ... ``packed``). :func:`plan_layout` turns a config into a
:class:`LayoutPlan`: buffers of equal block-prefix segments and, per layer, its torch
views and registration regions. ``kv_cache`` and ``views`` build tensors and regions from
the plan only; ``kvconnect.vllm`` converts vLLM's own objects into this model.

Modules, one job each: :mod:`.specs` (per-layer formats), :mod:`.config` (configs, JSON),
:mod:`.formats` (page formats registry), :mod:`.geometry` (plan vocabulary), :mod:`.plan`
(validation, then planning), :mod:`.build` (torch views, plain allocation),
:mod:`.presets` (builders, named presets).
"""

from __future__ import annotations

from .build import allocate_kv_caches, build_kv_caches
from .config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from .formats import FORMATS, LAYOUTS, SEED_LAYOUTS, VLLM_LAYOUTS, PageFormat, page_format
from .geometry import LayerPlan, LayoutPlan, RegionGeometry, TensorPlan, ViewGeometry
from .plan import plan_layout, validate_config
from .presets import (
    PRESETS,
    attention_config,
    hybrid_config,
    mla_config,
    placement_config,
    preset,
)
from .specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    LayoutError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    dtype_from_name,
    dtype_name,
)

__all__ = [
    "FORMATS", "LAYOUTS", "PRESETS", "SEED_LAYOUTS", "VLLM_LAYOUTS", "AttentionSpec",
    "FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "KVCacheTensor",
    "LayerPlan", "LayoutError", "LayoutPlan", "MLAAttentionSpec", "MambaSpec", "PageFormat",
    "RegionGeometry", "SlidingWindowSpec", "TensorPlan", "ViewGeometry", "allocate_kv_caches",
    "attention_config", "build_kv_caches", "dtype_from_name", "dtype_name", "hybrid_config",
    "mla_config", "page_format", "placement_config", "plan_layout", "preset", "validate_config",
]
