"""Config builders (attention, MLA, Jamba-style hybrid) and named presets.

Builders give the seed's shorthand tensors for the seed's layouts and vLLM 0.33's
placement form for vLLM's layouts (:func:`placement_config` places layers exactly as
vLLM 0.33's ``get_kv_cache_config_from_groups`` does). Units: bytes unless a name says
blocks or tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

import torch

from .config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from .formats import VLLM_LAYOUTS, page_format
from .plan import plan_layout
from .specs import (
    AttentionSpec,
    FullAttentionSpec,
    LayoutError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    dtype_from_name,
    itemsize,
    layout_int,
)

__all__ = ["PRESETS", "attention_config", "hybrid_config", "mla_config", "placement_config",
           "preset"]


def placement_config(groups: Sequence[KVCacheGroupSpec], layout: str, num_blocks: int,
                     kernel_block_size: int | None = None) -> KVCacheConfig:
    """A placement-form config for ``groups`` in vLLM layout ``layout``, placed as vLLM
    0.33's planner does: groups alias from byte 0; in a group, layers of one spec follow
    each other (layer-outer: ``layer_stride`` apart; block-outer: one page apart in the
    row). Block strides are pages (layer-outer; ``LHBNC``: a head's page) or the largest
    group's row (block-outer)."""
    fmt = page_format(layout)
    num_blocks = layout_int("num_blocks", num_blocks)
    # bytes per block: the largest group's pages (groups overlay each other)
    row = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    tensors = []
    for g in groups:
        spec = g.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise LayoutError(f"layout {layout}: {type(spec).__name__} layers are not modelled "
                              f"for vLLM 0.33 layouts yet (attention and MLA are)")
        page = spec.page_size_bytes
        if fmt.layer_outer:
            planes = fmt.planes(spec, False)
            block_stride = page // planes
            layer_stride = planes * num_blocks * block_stride
        else:
            block_stride = row
            # BHLNC: layers sit one head's page apart inside each head's run of the row
            layer_stride = spec.block_size * spec.content_bytes if layout == "BHLNC" else page
        tensors.append(KVCacheTensor(row * num_blocks, g.layer_names, layer_stride,
                                     block_stride, 0))
    return KVCacheConfig(num_blocks, tuple(tensors), tuple(groups), layout=layout,
                         kernel_block_size=kernel_block_size)


def _attn_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _per_layer_config(groups: Sequence[KVCacheGroupSpec], names: Iterable[str], page: int,
                      num_blocks: int, layout: str, kernel_block_size: int | None
                      ) -> KVCacheConfig:
    """vLLM's placement of ``groups``, else a tensor per layer of ``names`` (one if packed)."""
    if layout in VLLM_LAYOUTS:
        return placement_config(groups, layout, num_blocks, kernel_block_size)
    names = tuple(names)
    tensors = ((KVCacheTensor(page * len(names) * num_blocks, names),) if layout == "packed"
               else tuple(KVCacheTensor(page * num_blocks, (n,)) for n in names))
    return KVCacheConfig(num_blocks, tensors, tuple(groups), layout=layout,
                         kernel_block_size=kernel_block_size)


def attention_config(*, num_layers: int, num_kv_heads: int, head_size: int,
                     dtype: torch.dtype | str = torch.bfloat16, block_size: int = 16,
                     num_blocks: int = 64, layout: str = "kv_split_nhd",
                     kernel_block_size: int | None = None, sliding_window: int | None = None,
                     sliding_window_every: int = 0) -> KVCacheConfig:
    """A decoder of ``num_layers`` attention layers, one KV tensor per layer (or one packed
    tensor). With ``sliding_window`` and ``sliding_window_every = p``, every layer whose index
    is not a multiple of ``p`` uses a sliding window (Gemma-style interleaving)."""
    dtype = dtype_from_name(dtype)
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                             head_size=head_size, dtype=dtype)
    names = [_attn_name(i) for i in range(layout_int("num_layers", num_layers))]
    if sliding_window and sliding_window_every > 1:
        sw = SlidingWindowSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                               head_size=head_size, dtype=dtype, sliding_window=sliding_window)
        full_names = [n for i, n in enumerate(names) if i % sliding_window_every == 0]
        sw_names = [n for i, n in enumerate(names) if i % sliding_window_every != 0]
        groups = [KVCacheGroupSpec(tuple(full_names), full)]
        if sw_names:
            groups.append(KVCacheGroupSpec(tuple(sw_names), sw))
    else:
        groups = [KVCacheGroupSpec(tuple(names), full)]
    return _per_layer_config(groups, names, full.page_size_bytes, num_blocks, layout,
                             kernel_block_size)


def mla_config(*, num_layers: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
               dtype: torch.dtype | str = torch.bfloat16, block_size: int = 64,
               num_blocks: int = 64, layout: str = "blocks_first",
               kernel_block_size: int | None = None) -> KVCacheConfig:
    """A DeepSeek-style MLA decoder: one latent tensor per layer (one segment)."""
    spec = MLAAttentionSpec.latent(block_size=block_size, kv_lora_rank=kv_lora_rank,
                                   qk_rope_head_dim=qk_rope_head_dim,
                                   dtype=dtype_from_name(dtype))
    names = [_attn_name(i) for i in range(layout_int("num_layers", num_layers))]
    groups = (KVCacheGroupSpec(tuple(names), spec),)
    return _per_layer_config(groups, names, spec.page_size_bytes, num_blocks, layout,
                             kernel_block_size)


def hybrid_config(*, num_layers: int, attn_period: int = 8, num_kv_heads: int = 8,
                  head_size: int = 128, dtype: torch.dtype | str = torch.bfloat16,
                  mamba_shapes: Sequence[Sequence[int]] = ((2048, 3), (2048, 16)),
                  mamba_dtypes: Sequence[torch.dtype | str] = (torch.bfloat16, torch.float32),
                  block_size: int | None = None, kernel_block_size: int | None = 16,
                  num_blocks: int = 64, layout: str = "kv_split_nhd") -> KVCacheConfig:
    """A Jamba-style hybrid: one attention layer per ``attn_period`` layers (at index
    ``period // 2`` of each period), Mamba elsewhere. Like vLLM's hybrid allocator, the
    attention block size grows (in multiples of 16 tokens, or of ``kernel_block_size``) until
    an attention page holds the Mamba states, the Mamba page is padded to it, and each KV
    tensor is shared by one layer of every group. Attention is laid out block-major."""
    dtype = dtype_from_name(dtype)
    num_layers = layout_int("num_layers", num_layers)
    if num_layers < 2:
        raise LayoutError("a hybrid model needs at least 2 layers (attention + Mamba)")
    period = min(layout_int("attn_period", attn_period), num_layers)
    is_attn = [i % period == period // 2 for i in range(num_layers)]
    attn = [_attn_name(i) for i in range(num_layers) if is_attn[i]]
    mamba = [f"model.layers.{i}.mamba" for i in range(num_layers) if not is_attn[i]]
    if not mamba:
        raise LayoutError(f"attn_period {attn_period} leaves no Mamba layer")
    m_dtypes = tuple(dtype_from_name(d) for d in mamba_dtypes)
    m_spec0 = MambaSpec(block_size=1, shapes=tuple(tuple(s) for s in mamba_shapes),
                        dtypes=m_dtypes)
    per_token = 2 * num_kv_heads * head_size * itemsize(dtype)
    if block_size is None:
        align = kernel_block_size or 16
        block_size = align * max(1, -(-m_spec0.page_size_bytes // (per_token * align)))
    a_spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads,
                               head_size=head_size, dtype=dtype)
    page = a_spec.page_size_bytes
    if page < m_spec0.page_size_bytes:
        raise LayoutError(f"attention page {page} bytes (block_size {block_size}) is smaller "
                          f"than the Mamba state page {m_spec0.page_size_bytes} bytes")
    m_spec = replace(m_spec0, block_size=block_size, page_size_padded=page)
    g = len(attn)
    groups = [KVCacheGroupSpec(tuple(attn), a_spec)]
    mamba_groups = [mamba[j:j + g] for j in range(0, len(mamba), g)]
    groups += [KVCacheGroupSpec(tuple(mg), m_spec) for mg in mamba_groups]
    tensors = tuple(KVCacheTensor(page * num_blocks,
                                  (attn[j],) + tuple(mg[j] for mg in mamba_groups if j < len(mg)))
                    for j in range(g))
    return KVCacheConfig(num_blocks, tensors, tuple(groups), layout=layout,
                         kernel_block_size=kernel_block_size)


def _with_defaults(build: Callable[..., KVCacheConfig], **defaults: Any
                   ) -> Callable[..., KVCacheConfig]:
    """``build`` taking ``num_blocks`` and overrides of ``defaults``."""
    def builder(num_blocks: int, **kw: object) -> KVCacheConfig:
        return build(num_blocks=num_blocks, **{**defaults, **kw})
    return builder


_LLAMA: dict[str, Any] = dict(num_layers=32, num_kv_heads=8, head_size=128,
                              dtype=torch.bfloat16, block_size=16)
_llama = _with_defaults(attention_config, **_LLAMA)
_qwen = _with_defaults(attention_config, num_layers=24, num_kv_heads=2, head_size=64,
                       dtype=torch.bfloat16, block_size=16)
_deepseek = _with_defaults(mla_config, num_layers=27, kv_lora_rank=512, qk_rope_head_dim=64,
                           dtype=torch.bfloat16, block_size=64)
_jamba = _with_defaults(hybrid_config, num_layers=32, attn_period=8)


#: preset name -> (builder, one-line description)
PRESETS = {
    "llama3-8b-like": (_llama, "32 layers, 8 KV heads x 128, bf16, 16-token blocks, K/V split"),
    "qwen-small-like": (_qwen, "24 layers, 2 KV heads x 64, bf16, 16-token blocks, K/V split"),
    "deepseek-mla-like": (_deepseek, "27 MLA layers, latent 512+64, bf16, 64-token blocks"),
    "jamba-hybrid-like": (_jamba, "32 layers, attention 1 in 8 (8 KV heads x 128) + Mamba "
                                  "(conv 2048x3 bf16, ssm 2048x16 fp32), block-major, "
                                  "48-token blocks in 16-token kernel blocks"),
    "packed": (_with_defaults(attention_config, **_LLAMA, layout="packed"),
               "Llama-3-8B-like pages packed into one 2 MiB row per block"),
    # vLLM 0.33's layouts (one backing buffer, placed as vLLM's planner does)
    **{name: (_with_defaults(attention_config, **_LLAMA, layout=name),
              f"Llama-3-8B-like pages in vLLM 0.33's {name} layout") for name in VLLM_LAYOUTS},
}


def preset(name: str, num_blocks: int = 64, **overrides: object) -> KVCacheConfig:
    """A named config (see :data:`PRESETS`) for ``num_blocks`` blocks. ``overrides`` go to
    the builder: e.g. ``num_layers=4``, ``layout="kv_split_hnd"``, ``kernel_block_size=8``,
    ``dtype="float16"``, ``block_size=32``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    builder = PRESETS[name][0]
    try:
        cfg = builder(num_blocks, **overrides)
    except TypeError as exc:
        raise TypeError(f"preset {name!r}: bad override ({exc})") from None
    plan_layout(cfg)  # validate now, with the reason
    return cfg
