"""vLLM 0.33's ``KVCacheConfig`` <-> kvconnect's config: both directions, in one place.

:func:`config_from_vllm` reads any object shaped like vLLM 0.33's ``KVCacheConfig``
(``num_blocks``, ``kv_cache_tensors`` of ``KVCacheTensor(size, layers, layer_stride,
block_stride, offset, host_resident)``, ``kv_cache_groups`` of ``(layer_names,
kv_cache_spec)``, ``kv_cache_layout``) by its fields (no vLLM import) and returns the same
cache in kvconnect's model. Specs map through :data:`SPEC_CONVERTERS`, keyed by vLLM's spec
class name; a field that would change the page's geometry in a way kvconnect does not model
raises :class:`LayoutError` naming it. ``kvconnect.views`` calls this for any config that is
not kvconnect's own, so ``narrow_kv_caches_to_num_blocks`` and friends take vLLM's objects
directly. :func:`to_vllm_config`, the reverse, imports vLLM (its ``KVCacheTensor``) when
called. Units: bytes; ``num_blocks`` is logical blocks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Protocol, TypeGuard, cast

from .config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from .formats import VLLM_LAYOUTS
from .specs import (
    FullAttentionSpec,
    KVCacheSpec,
    LayoutError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["SPEC_CONVERTERS", "VllmKVCacheConfigLike", "VllmKVCacheGroupLike",
           "VllmKVCacheTensorLike", "config_from_vllm", "is_vllm_like_config",
           "replace_vllm_config", "spec_from_vllm", "to_vllm_config"]


class VllmKVCacheTensorLike(Protocol):
    """vLLM 0.33's ``KVCacheTensor`` as read here (bytes; ``host_resident`` optional)."""

    @property
    def size(self) -> int: ...
    @property
    def layers(self) -> Sequence[str]: ...
    @property
    def layer_stride(self) -> int: ...
    @property
    def block_stride(self) -> int: ...
    @property
    def offset(self) -> int: ...


class VllmKVCacheGroupLike(Protocol):
    """vLLM 0.33's ``KVCacheGroupSpec``: layer names and their spec (a vLLM spec class,
    converted by class name: :data:`SPEC_CONVERTERS`)."""

    @property
    def layer_names(self) -> Sequence[str]: ...
    @property
    def kv_cache_spec(self) -> object: ...


class VllmKVCacheConfigLike(Protocol):
    """vLLM 0.33's ``KVCacheConfig`` as kvconnect reads it (no vLLM import): ``num_blocks``
    (logical blocks), its tensors and groups; ``kv_cache_layout`` is read with ``getattr``
    (the engine core sets it)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def kv_cache_tensors(self) -> Sequence[VllmKVCacheTensorLike]: ...
    @property
    def kv_cache_groups(self) -> Sequence[VllmKVCacheGroupLike]: ...


def _attention_fields(spec: Any, what: str, head_size_v: int) -> dict[str, Any]:
    """The attention spec's fields, after refusing what kvconnect does not model: a V head
    size other than ``head_size_v`` (K's head size; 0 for MLA's latent), packed head slots
    or state contents, compressed or pooled states."""
    got = getattr(spec, "head_size_v", head_size_v)
    if got is not None and got != head_size_v:
        raise LayoutError(f"{what}: head_size_v={got} differs from {head_size_v}; kvconnect "
                          f"models equal K and V head sizes (or MLA's latent only)")
    for field, ok in (("num_head_slots", None), ("state_content_bytes", None)):
        if getattr(spec, field, None) is not ok:
            raise LayoutError(f"{what}: vLLM spec field {field}={getattr(spec, field)!r} packs "
                              f"pages in a way kvconnect does not model")
    tps = getattr(spec, "tokens_per_state", 1)
    if tps != 1 and tps != Fraction(1):
        raise LayoutError(f"{what}: tokens_per_state={tps!r} (compressed or pooled states) "
                          f"is not modelled")
    return {"block_size": int(spec.block_size), "num_kv_heads": int(spec.num_kv_heads),
            "head_size": int(spec.head_size), "dtype": spec.dtype,
            "page_size_padded": getattr(spec, "page_size_padded", None)}


def _full(spec: Any, what: str) -> KVCacheSpec:
    return FullAttentionSpec(**_attention_fields(spec, what, spec.head_size))


def _sliding(spec: Any, what: str) -> KVCacheSpec:
    return SlidingWindowSpec(**_attention_fields(spec, what, spec.head_size),
                             sliding_window=int(spec.sliding_window))


def _mla(spec: Any, what: str) -> KVCacheSpec:
    return MLAAttentionSpec(**_attention_fields(spec, what, 0))


def _mamba(spec: Any, what: str) -> KVCacheSpec:
    return MambaSpec(block_size=int(spec.block_size), shapes=tuple(spec.shapes),
                     dtypes=tuple(spec.dtypes), page_size_padded=spec.page_size_padded)


#: vLLM spec class name -> converter ``(spec, what) -> kvconnect spec``. Attention kinds
#: whose pages look like full attention's (chunked-local, encoder-only, cross, sink) map
#: to :class:`FullAttentionSpec`: the geometry is what matters here.
SPEC_CONVERTERS: dict[str, Callable[[Any, str], KVCacheSpec]] = {
    "FullAttentionSpec": _full,
    "ChunkedLocalAttentionSpec": _full,
    "EncoderOnlyAttentionSpec": _full,
    "CrossAttentionSpec": _full,
    "SinkFullAttentionSpec": _full,
    "SlidingWindowSpec": _sliding,
    "MLAAttentionSpec": _mla,
    "MambaSpec": _mamba,
}


def spec_from_vllm(spec: object, what: str = "spec") -> KVCacheSpec:
    """kvconnect's spec for a vLLM spec (by class name; see :data:`SPEC_CONVERTERS`)."""
    if isinstance(spec, KVCacheSpec):
        return spec
    convert = SPEC_CONVERTERS.get(type(spec).__name__)
    if convert is None:
        raise LayoutError(f"{what}: vLLM spec {type(spec).__name__} is not modelled; known: "
                          f"{sorted(SPEC_CONVERTERS)}")
    return convert(spec, what)


def is_vllm_like_config(obj: object) -> TypeGuard[VllmKVCacheConfigLike]:
    """True for objects with vLLM 0.33 ``KVCacheConfig``'s fields (and not kvconnect's)."""
    return not isinstance(obj, KVCacheConfig) and all(
        hasattr(obj, a) for a in ("num_blocks", "kv_cache_tensors", "kv_cache_groups"))


def _groups(cfg: VllmKVCacheConfigLike) -> list[KVCacheGroupSpec]:
    out: list[KVCacheGroupSpec] = []
    for gi, g in enumerate(cfg.kv_cache_groups):
        spec = g.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        if per_layer is None:
            out.append(KVCacheGroupSpec(tuple(g.layer_names),
                                        spec_from_vllm(spec, f"kv_cache_groups[{gi}]")))
            continue
        by_spec: dict[Any, list[str]] = {}
        for name in g.layer_names:
            by_spec.setdefault(per_layer[name], []).append(name)
        out += [KVCacheGroupSpec(tuple(names), spec_from_vllm(s, f"kv_cache_groups[{gi}]"))
                for s, names in by_spec.items()]
    return out


def config_from_vllm(cfg: KVCacheConfig | VllmKVCacheConfigLike, layout: object = None,
                     kernel_block_size: int | None = None) -> KVCacheConfig:
    """kvconnect's :class:`KVCacheConfig` for vLLM 0.33's ``cfg``.

    ``layout`` (a name or vLLM's ``KVCacheLayout``) defaults to ``cfg.kv_cache_layout``
    (the engine core sets it); ``kernel_block_size`` (tokens) is the attention kernel's
    block size when it splits vLLM's blocks (vLLM keeps it per group, kvconnect per
    config). Raises :class:`LayoutError` when the layout is unknown or a spec is not
    modelled.
    """
    if isinstance(cfg, KVCacheConfig):
        return cfg
    if not is_vllm_like_config(cfg):
        raise TypeError(f"kv_cache_config must be kvconnect's or vLLM's KVCacheConfig, got "
                        f"{type(cfg).__module__}.{type(cfg).__name__}")
    name = layout if layout is not None else getattr(cfg, "kv_cache_layout", None)
    name = getattr(name, "name", name)
    if name is None:
        raise LayoutError("the vLLM KVCacheConfig has no kv_cache_layout (the engine core sets "
                          "it); pass layout=, e.g. config_from_vllm(cfg, layout='LBHNC')")
    if name not in VLLM_LAYOUTS:
        raise LayoutError(f"unknown vLLM KV cache layout {name!r}; expected one of "
                          f"{VLLM_LAYOUTS}")
    tensors = tuple(KVCacheTensor(int(t.size), tuple(t.layers), int(t.layer_stride),
                                  int(t.block_stride), int(t.offset),
                                  bool(getattr(t, "host_resident", False)))
                    for t in cfg.kv_cache_tensors)
    return KVCacheConfig(int(cfg.num_blocks), tensors, tuple(_groups(cfg)), layout=str(name),
                         kernel_block_size=kernel_block_size)


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
    from vllm.v1.kv_cache_interface import KVCacheTensor as VllmKVCacheTensor

    if not config.is_placement:
        raise LayoutError("to_vllm_config needs a placement-form config (vLLM's layouts); "
                          f"{config.layout!r} uses the seed's shorthand tensors")
    tensors = [VllmKVCacheTensor(size=t.size, layers=list(t.layers),
                                 layer_stride=t.layer_stride, block_stride=t.block_stride,
                                 offset=t.offset)
               for t in config.kv_cache_tensors]
    return replace_vllm_config(template, kv_cache_tensors=tensors,
                               num_blocks=config.num_blocks if num_blocks is None else num_blocks,
                               kv_cache_layout=config.layout)
