"""KV cache configs (mirroring vLLM's ``KVCacheConfig``) and their physical layouts.

A :class:`KVCacheConfig` says *what* is stored: ``num_blocks`` logical blocks, KV cache
tensors of ``size`` bytes each ``shared_by`` some layers, and groups of layers with one spec
(full attention, sliding window, MLA, Mamba). Two fields vLLM keeps in the attention backend
live here too, because every consumer needs them: ``layout`` (the physical layout of
attention pages) and ``kernel_block_size`` (the attention kernel's block size when it is
smaller than the logical block: one logical block = ``k`` kernel blocks).

:func:`plan_layout` turns a config into a :class:`LayoutPlan`: for every KV tensor its
segment count and bytes per block, for every layer the torch views (dtype, shape, strides,
byte offset) and the registration regions inside one logical block. The rest of kvconnect
(``kv_cache``, ``views``) builds tensors and regions from that plan only.

Physical layouts (``KVCacheConfig.layout``):

- ``"kv_split_nhd"``: per layer ``(2, blocks, block_size, heads, head)``; K and V are two
  segments, each a block prefix. ``"kv_split_hnd"``: physically ``(2, blocks, heads,
  block_size, head)``, viewed in the logical NHD shape.
- ``"blocks_first"`` / ``"blocks_first_hnd"``: ``(blocks, 2, block_size, heads, head)``, one
  segment, K and V of a block side by side.
- ``"packed"``: one shared tensor, one ``block_stride``-byte row per logical block holding
  every layer's page (cross-layer layout). The row must be exactly one block's pages.
- A model with Mamba layers forces its attention layers block-major (``(2, blocks, ...)``
  viewed over ``(blocks, 2, ...)`` pages), whatever ``layout`` says; they share pages with
  Mamba layers (``shared_by``), like vLLM's hybrid allocator.

Units: bytes unless a name says ``blocks`` or ``tokens``. A *kernel block* is
``kernel_block_size`` tokens; a view's block dimension counts kernel blocks
(``num_blocks * k``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from .checks import checked_int

__all__ = [
    "LAYOUTS", "AttentionSpec", "FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec",
    "KVCacheSpec", "KVCacheTensor", "LayerPlan", "LayoutError", "LayoutPlan", "MLAAttentionSpec",
    "MambaSpec", "PRESETS", "RegionGeometry", "SlidingWindowSpec", "TensorPlan", "ViewGeometry",
    "allocate_kv_caches", "attention_config", "build_kv_caches", "dtype_from_name",
    "dtype_name", "hybrid_config", "mla_config", "plan_layout", "preset",
]

#: every physical layout :func:`plan_layout` understands
LAYOUTS = ("kv_split_nhd", "kv_split_hnd", "blocks_first", "blocks_first_hnd", "packed")
_KV_SPLIT = ("kv_split_nhd", "kv_split_hnd")
_HND = ("kv_split_hnd", "blocks_first_hnd")


class LayoutError(ValueError):
    """A config that cannot be laid out (or does not match the tensors); says why."""


# -- dtypes -------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (for JSON)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Inverse of :func:`dtype_name`; accepts a dtype as is."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# -- specs --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV format of one layer. ``block_size`` is tokens per logical block."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one logical block of this layer occupies (padding included)."""
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": type(self).__name__}
        for f in self.__dataclass_fields__:
            v = getattr(self, f)
            if isinstance(v, torch.dtype):
                v = dtype_name(v)
            elif f == "dtypes":
                v = [dtype_name(d) for d in v]
            elif f == "shapes":
                v = [list(s) for s in v]
            out[f] = v
        return out

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> KVCacheSpec:
        """The spec :meth:`to_dict` described; any malformed field raises LayoutError."""
        kinds = {c.__name__: c for c in (FullAttentionSpec, SlidingWindowSpec,
                                         MLAAttentionSpec, MambaSpec)}
        if not isinstance(d, Mapping):
            raise LayoutError(f"a KV cache spec must be a dict, got {type(d).__name__}")
        d = dict(d)
        kind = d.pop("kind", None)
        if not isinstance(kind, str) or kind not in kinds:
            raise LayoutError(f"unknown KV cache spec kind {kind!r:.60}; expected one of "
                              f"{list(kinds)}")
        unknown = sorted(map(str, set(d) - {f.name for f in fields(kinds[kind])}))
        if unknown:
            raise LayoutError(f"{kind} has no fields {unknown[:4]}")
        args: dict[str, Any] = {}
        for name, value in d.items():
            where = f"{kind}.{name}"
            if name == "dtype":
                args[name] = _dict_dtype(where, value)
            elif name == "dtypes":
                args[name] = tuple(_dict_dtype(f"{where}[{i}]", x)
                                   for i, x in enumerate(_dict_list(where, value)))
            elif name == "shapes":
                args[name] = tuple(tuple(_dict_int(f"{where}[{i}]", v)
                                         for v in _dict_list(f"{where}[{i}]", shape))
                                   for i, shape in enumerate(_dict_list(where, value)))
            elif name == "page_size_padded" and value is None:
                args[name] = None
            else:
                args[name] = _dict_int(where, value)
        try:
            return kinds[kind](**args)
        except TypeError as exc:  # a required field is missing
            raise LayoutError(f"{kind}: {exc}") from None


def _dict_int(what: str, value: object) -> int:
    """A positive int field of a config dict, or LayoutError."""
    try:
        return checked_int(what, value)
    except ValueError as exc:
        raise LayoutError(str(exc)) from None


def _dict_str(what: str, value: object) -> str:
    if not isinstance(value, str):
        raise LayoutError(f"{what} must be a string, got {type(value).__name__}")
    return value


def _dict_list(what: str, value: object) -> list:
    if not isinstance(value, (list, tuple)):
        raise LayoutError(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def _dict_dtype(what: str, value: object) -> torch.dtype:
    try:
        return dtype_from_name(value if isinstance(value, torch.dtype) else
                               _dict_str(what, value))
    except ValueError as exc:
        raise LayoutError(f"{what}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged attention: per token ``num_kv_heads`` heads of ``head_size`` elements of
    ``dtype``. ``page_size_padded`` (bytes) pads the page, as hybrid models do."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None

    #: K and V (2) or one latent vector (1) per token and head
    kv_factor = 2

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one logical block without padding."""
        return (self.kv_factor * self.block_size * self.num_kv_heads * self.head_size
                * _itemsize(self.dtype))

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        if self.page_size_padded is None:
            return real
        if self.page_size_padded < real:
            raise LayoutError(f"page_size_padded {self.page_size_padded} is below the real page "
                              f"size {real} bytes")
        return self.page_size_padded


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention: every token keeps its K and V."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention (same page format; ``sliding_window`` tokens matter)."""

    sliding_window: int


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one latent vector per token (``head_size`` =
    ``kv_lora_rank + qk_rope_head_dim``), ``num_kv_heads`` = 1, no K/V split."""

    num_kv_heads: int = 1
    kv_factor = 1

    @classmethod
    def latent(cls, *, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
               dtype: torch.dtype) -> MLAAttentionSpec:
        return cls(block_size=block_size, head_size=kv_lora_rank + qk_rope_head_dim, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Mamba state: per logical block, one tensor per entry of ``shapes`` / ``dtypes``,
    stored one after the other from the page start. ``page_size_padded`` pads the page."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(v) for v in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise LayoutError(f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} "
                              f"shapes and {len(self.dtypes)} dtypes")

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor for one block."""
        return tuple(math.prod(s) * _itemsize(d)
                     for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        real = sum(self.state_bytes)
        if self.page_size_padded is None:
            return real
        if self.page_size_padded < real:
            raise LayoutError(f"page_size_padded {self.page_size_padded} is below the "
                              f"{real} bytes of the Mamba states")
        return self.page_size_padded


# -- config -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVCacheTensor:
    """One KV cache allocation of ``size`` bytes (for the config's ``num_blocks``), used by
    the layers in ``shared_by`` (several layers alias it in hybrid models; all layers of a
    packed layout own disjoint slices of each row)."""

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared_by", tuple(self.shared_by))


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec (and one block table)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True)
class KVCacheConfig:
    """A KV cache: ``num_blocks`` logical blocks, its tensors and its layer groups.

    ``layout`` is one of :data:`LAYOUTS`; ``kernel_block_size`` (tokens, dividing every
    attention block size) splits each logical block into ``block_size // kernel_block_size``
    kernel blocks; ``None`` means no split.
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    layout: str = "kv_split_nhd"
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))

    @property
    def layer_names(self) -> list[str]:
        """Every layer, in group order."""
        return [n for g in self.kv_cache_groups for n in g.layer_names]

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        return {n: g.kv_cache_spec for g in self.kv_cache_groups for n in g.layer_names}

    @property
    def bytes_per_block(self) -> int:
        """Bytes one logical block takes over all KV tensors (shared tensors count once)."""
        return sum(t.size // self.num_blocks for t in self.kv_cache_tensors)

    def with_num_blocks(self, num_blocks: int) -> KVCacheConfig:
        """The same cache sized for ``num_blocks`` blocks (tensor sizes scaled)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        tensors = tuple(KVCacheTensor(t.size // self.num_blocks * num_blocks, t.shared_by)
                        for t in self.kv_cache_tensors)
        return replace(self, num_blocks=num_blocks, kv_cache_tensors=tensors)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description (for handshakes: compare, never unpickle)."""
        return {
            "num_blocks": self.num_blocks,
            "layout": self.layout,
            "kernel_block_size": self.kernel_block_size,
            "kv_cache_tensors": [{"size": t.size, "shared_by": list(t.shared_by)}
                                 for t in self.kv_cache_tensors],
            "kv_cache_groups": [{"layer_names": list(g.layer_names),
                                 "kv_cache_spec": g.kv_cache_spec.to_dict()}
                                for g in self.kv_cache_groups],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KVCacheConfig:
        """The config :meth:`to_dict` described. Every field is checked (types, positive
        ints, known spec kinds and dtypes); anything malformed raises LayoutError. Whether
        the config can be laid out is :func:`plan_layout`'s to say."""
        if not isinstance(d, Mapping):
            raise LayoutError(f"a KV cache config must be a dict, got {type(d).__name__}")
        known = {"num_blocks", "kv_cache_tensors", "kv_cache_groups", "layout",
                 "kernel_block_size"}
        missing = sorted(known - {"layout", "kernel_block_size"} - d.keys())
        unknown = sorted(map(str, d.keys() - known))
        if missing or unknown:
            raise LayoutError(f"KV cache config: missing fields {missing}, unknown fields "
                              f"{unknown[:4]}")
        tensors, groups = [], []
        for i, t in enumerate(_dict_list("kv_cache_tensors", d["kv_cache_tensors"])):
            where = f"kv_cache_tensors[{i}]"
            if not isinstance(t, Mapping) or not {"size", "shared_by"} <= t.keys():
                raise LayoutError(f"{where} must be a dict with size and shared_by")
            names = _dict_list(f"{where}.shared_by", t["shared_by"])
            tensors.append(KVCacheTensor(_dict_int(f"{where}.size", t["size"]),
                                         tuple(_dict_str(f"{where}.shared_by", n)
                                               for n in names)))
        for i, g in enumerate(_dict_list("kv_cache_groups", d["kv_cache_groups"])):
            where = f"kv_cache_groups[{i}]"
            if not isinstance(g, Mapping) or not {"layer_names", "kv_cache_spec"} <= g.keys():
                raise LayoutError(f"{where} must be a dict with layer_names and kv_cache_spec")
            names = _dict_list(f"{where}.layer_names", g["layer_names"])
            groups.append(KVCacheGroupSpec(tuple(_dict_str(f"{where}.layer_names", n)
                                                 for n in names),
                                           KVCacheSpec.from_dict(g["kv_cache_spec"])))
        kbs = d.get("kernel_block_size")
        return cls(
            num_blocks=_dict_int("num_blocks", d["num_blocks"]),
            kv_cache_tensors=tuple(tensors),
            kv_cache_groups=tuple(groups),
            layout=_dict_str("layout", d.get("layout", "kv_split_nhd")),
            kernel_block_size=None if kbs is None else _dict_int("kernel_block_size", kbs),
        )


# -- the plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ViewGeometry:
    """One torch tensor of a layer, over its KV tensor's bytes.

    The tensor has ``dtype``, shape ``shape_for(n)`` for ``n`` logical blocks, and element
    strides from ``strides_bytes`` (``None`` marks the segment dimension, whose stride is
    the distance between segments and so depends on the reservation). It starts
    ``offset_bytes`` after the KV tensor's first byte.
    """

    dtype: torch.dtype
    #: shape with the block dimension counted for ONE logical block (= kernel blocks per block)
    unit_shape: tuple[int, ...]
    strides_bytes: tuple[int | None, ...]
    offset_bytes: int
    block_dim: int
    #: the K/V (segment) dimension, or None for single-segment layouts
    segment_dim: int | None = None

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @property
    def blocks_per_block(self) -> int:
        """Kernel blocks per logical block (the view's block-dim count per logical block)."""
        return self.unit_shape[self.block_dim]

    def shape_for(self, num_blocks: int) -> tuple[int, ...]:
        s = list(self.unit_shape)
        s[self.block_dim] *= num_blocks
        return tuple(s)

    def strides_for(self, segment_stride_bytes: int = 0) -> tuple[int, ...]:
        """Element strides, given the byte distance between segments."""
        e = self.itemsize
        out = []
        for sb in self.strides_bytes:
            b = segment_stride_bytes if sb is None else sb
            if b % e:
                raise LayoutError(f"stride of {b} bytes is not a multiple of the {e}-byte "
                                  f"{dtype_name(self.dtype)} element")
            out.append(b // e)
        return tuple(out)

    def extent_in_segment(self) -> tuple[int, int]:
        """``(first, end)`` bytes, relative to the segment start, that one logical block of
        this view touches (one segment; the segment dimension held at one index)."""
        end = self.offset_bytes + self.itemsize
        for d, (n, sb) in enumerate(zip(self.unit_shape, self.strides_bytes, strict=True)):
            if d == self.segment_dim:
                continue
            end += (n - 1) * int(sb)  # type: ignore[arg-type]
        return self.offset_bytes, end


@dataclass(frozen=True)
class RegionGeometry:
    """A registration region of a layer, for one logical block: ``block_len`` bytes from
    ``offset`` bytes after the start of ``segment``, repeating every ``block_stride`` bytes."""

    part: str
    segment: int
    offset: int
    block_len: int
    block_stride: int


@dataclass(frozen=True)
class TensorPlan:
    """How one KV tensor is backed: ``num_segments`` segments, each a block prefix of
    ``segment_bytes_per_block`` bytes per logical block."""

    index: int
    layers: tuple[str, ...]
    bytes_per_block: int
    num_segments: int

    @property
    def segment_bytes_per_block(self) -> int:
        return self.bytes_per_block // self.num_segments


@dataclass(frozen=True)
class LayerPlan:
    """One layer: its views (one tensor, or Mamba's list of states) and regions."""

    name: str
    spec: KVCacheSpec
    tensor_index: int
    views: tuple[ViewGeometry, ...]
    regions: tuple[RegionGeometry, ...]
    #: True when the layer's kv_caches entry is a list of tensors (Mamba states)
    is_list: bool = False

    @property
    def blocks_per_block(self) -> int:
        return self.views[0].blocks_per_block


@dataclass(frozen=True)
class LayoutPlan:
    """Everything kvconnect derives from a :class:`KVCacheConfig` (see :func:`plan_layout`)."""

    config: KVCacheConfig
    tensors: tuple[TensorPlan, ...]
    layers: dict[str, LayerPlan] = field(hash=False)
    packed: bool = False
    hybrid: bool = False

    @property
    def bytes_per_block(self) -> int:
        return sum(t.bytes_per_block for t in self.tensors)

    @property
    def block_stride(self) -> int:
        """Packed layouts: bytes of one row (= one logical block of every layer)."""
        if not self.packed:
            raise LayoutError(f"block_stride is defined for the packed layout, not "
                              f"{self.config.layout!r}")
        return self.tensors[0].bytes_per_block

    def packed_region(self) -> RegionGeometry:
        return RegionGeometry("packed", 0, 0, self.block_stride, self.block_stride)


def _check_positive(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{what} must be a positive int, got {value!r}")
    return value


def _kernel_split(spec: KVCacheSpec, kernel_block_size: int | None, layer: str) -> int:
    if kernel_block_size is None or isinstance(spec, MambaSpec):
        return 1
    if spec.block_size % kernel_block_size:
        raise LayoutError(f"layer {layer}: block_size {spec.block_size} is not a multiple of "
                          f"kernel_block_size {kernel_block_size}")
    return spec.block_size // kernel_block_size


def _token_head_strides(hnd: bool, kbs: int, heads: int, head: int, e: int) -> tuple[int, ...]:
    """Byte strides of (token, head, element) inside one kernel page of K (or V)."""
    if hnd:
        return (head * e, kbs * head * e, e)
    return (heads * head * e, head * e, e)


def _attention_views(spec: AttentionSpec, *, k: int, mode: str, hnd: bool, row_stride: int,
                     offset: int, layer: str) -> ViewGeometry:
    """The view of one attention layer.

    ``mode``: "split" (K/V segments), "kv_major" (logical (2, blocks, ...) over block-major
    pages), "blocks_first" ((blocks, 2, ...)), "latent" (MLA). ``row_stride`` is the bytes
    between consecutive kernel blocks (unused for "split").
    """
    e = _itemsize(spec.dtype)
    kbs = spec.block_size // k
    heads, head = spec.num_kv_heads, spec.head_size
    half = kbs * heads * head * e  # bytes of K (or V) in one kernel block
    if mode != "split" and row_stride % e:
        raise LayoutError(f"layer {layer}: kernel-block stride {row_stride} bytes is not a "
                          f"multiple of the {e}-byte element")
    if offset % e:
        raise LayoutError(f"layer {layer}: its page starts {offset} bytes into the row, not a "
                          f"multiple of its {e}-byte {dtype_name(spec.dtype)} element (order "
                          f"packed layers so pages stay aligned)")
    tok = _token_head_strides(hnd, kbs, heads, head, e)
    if mode == "latent":
        if heads != 1:
            raise LayoutError(f"layer {layer}: MLA stores one latent vector per token; "
                              f"num_kv_heads must be 1, got {heads}")
        return ViewGeometry(spec.dtype, (k, kbs, head), (row_stride, head * e, e), offset, 0)
    if mode == "split":
        return ViewGeometry(spec.dtype, (2, k, kbs, heads, head), (None, half) + tok, offset,
                            block_dim=1, segment_dim=0)
    if mode == "kv_major":
        return ViewGeometry(spec.dtype, (2, k, kbs, heads, head), (half, row_stride) + tok,
                            offset, block_dim=1)
    return ViewGeometry(spec.dtype, (k, 2, kbs, heads, head), (row_stride, half) + tok, offset,
                        block_dim=0)


def _mamba_views(spec: MambaSpec, page: int, layer: str) -> tuple[ViewGeometry, ...]:
    views = []
    offset = 0
    for shape, dtype, nbytes in zip(spec.shapes, spec.dtypes, spec.state_bytes, strict=True):
        e = _itemsize(dtype)
        if offset % e or page % e:
            raise LayoutError(f"layer {layer}: Mamba state of {dtype_name(dtype)} at byte "
                              f"{offset} of a {page}-byte page is misaligned; order states by "
                              f"decreasing element size or pad the page")
        inner = []
        acc = e
        for n in reversed(shape):
            inner.append(acc)
            acc *= n
        views.append(ViewGeometry(dtype, (1, *shape), (page, *reversed(inner)), offset, 0))
        offset += nbytes
    return tuple(views)


def _region_from_views(part: str, views: Sequence[ViewGeometry], stride: int,
                       segment: int = 0) -> RegionGeometry:
    first = min(v.extent_in_segment()[0] for v in views)
    end = max(v.extent_in_segment()[1] for v in views)
    return RegionGeometry(part, segment, first, end - first, stride)


def plan_layout(config: KVCacheConfig) -> LayoutPlan:
    """Validate ``config`` and derive its physical plan. Raises :class:`LayoutError`
    naming the layer/tensor and the reason when the config cannot be laid out."""
    layout = config.layout
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    _check_positive("num_blocks", config.num_blocks)
    kbs = config.kernel_block_size
    if kbs is not None:
        _check_positive("kernel_block_size", kbs)
    if not config.kv_cache_groups:
        raise LayoutError("the config has no KV cache groups")
    specs: dict[str, KVCacheSpec] = {}
    for g in config.kv_cache_groups:
        if not isinstance(g.kv_cache_spec, KVCacheSpec):
            raise LayoutError(f"group spec {g.kv_cache_spec!r} is not a KVCacheSpec")
        _check_positive("block_size", g.kv_cache_spec.block_size)
        for n in g.layer_names:
            if n in specs:
                raise LayoutError(f"layer {n!r} appears in more than one KV cache group")
            specs[n] = g.kv_cache_spec
    hybrid = any(isinstance(s, MambaSpec) for s in specs.values())
    packed = layout == "packed"

    owner: dict[str, int] = {}
    for i, t in enumerate(config.kv_cache_tensors):
        _check_positive(f"kv_cache_tensors[{i}].size", t.size)
        if not t.shared_by:
            raise LayoutError(f"kv_cache_tensors[{i}] is shared by no layer")
        for n in t.shared_by:
            if n not in specs:
                raise LayoutError(f"kv_cache_tensors[{i}] names layer {n!r}, which is in no "
                                  f"KV cache group")
            if n in owner:
                raise LayoutError(f"layer {n!r} is backed by kv_cache_tensors[{owner[n]}] and "
                                  f"[{i}]; a layer has exactly one KV tensor")
            owner[n] = i
        if t.size % config.num_blocks:
            raise LayoutError(f"kv_cache_tensors[{i}].size {t.size} is not a whole number of "
                              f"the config's {config.num_blocks} blocks")
    missing = [n for n in specs if n not in owner]
    if missing:
        raise LayoutError(f"layers {missing} have no KV cache tensor")

    if packed:
        return _plan_packed(config, specs, hybrid)

    tensors: list[TensorPlan] = []
    layers: dict[str, LayerPlan] = {}
    hnd = layout in _HND
    for i, t in enumerate(config.kv_cache_tensors):
        page = t.size // config.num_blocks
        seg_counts = set()
        for n in t.shared_by:
            spec = specs[n]
            if spec.page_size_bytes != page:
                raise LayoutError(
                    f"config does not match its tensors: kv_cache_tensors[{i}] holds {page} "
                    f"bytes per block but layer {n!r} has a {spec.page_size_bytes}-byte page")
            k = _kernel_split(spec, kbs, n)
            if isinstance(spec, MambaSpec):
                views = _mamba_views(spec, page, n)
                regions = (_region_from_views("state", views, page),)
                layers[n] = LayerPlan(n, spec, i, views, regions, is_list=True)
                seg_counts.add(1)
                continue
            assert isinstance(spec, AttentionSpec)
            if page % k:
                raise LayoutError(f"layer {n!r}: a {page}-byte page does not split into {k} "
                                  f"kernel blocks")
            if isinstance(spec, MLAAttentionSpec):
                view = _attention_views(spec, k=k, mode="latent", hnd=hnd, row_stride=page // k,
                                        offset=0, layer=n)
                layers[n] = LayerPlan(n, spec, i, (view,),
                                      (_region_from_views("latent", (view,), page),))
                seg_counts.add(1)
            elif layout in _KV_SPLIT and not hybrid:
                if spec.page_size_padded not in (None, spec.real_page_size_bytes):
                    raise LayoutError(f"layer {n!r}: a padded page needs a block-major layout "
                                      f"(blocks_first), not {layout!r}")
                view = _attention_views(spec, k=k, mode="split", hnd=hnd, row_stride=0,
                                        offset=0, layer=n)
                half = page // 2
                regions = (RegionGeometry("k", 0, 0, half, half),
                           RegionGeometry("v", 1, 0, half, half))
                layers[n] = LayerPlan(n, spec, i, (view,), regions)
                seg_counts.add(2)
            else:
                mode = "kv_major" if layout in _KV_SPLIT else "blocks_first"
                view = _attention_views(spec, k=k, mode=mode, hnd=hnd, row_stride=page // k,
                                        offset=0, layer=n)
                layers[n] = LayerPlan(n, spec, i, (view,),
                                      (_region_from_views("kv", (view,), page),))
                seg_counts.add(1)
        if len(seg_counts) != 1:
            raise LayoutError(f"kv_cache_tensors[{i}] is shared by layers needing different "
                              f"segment counts {sorted(seg_counts)}; K/V-split and block-major "
                              f"layers cannot share one tensor")
        tensors.append(TensorPlan(i, t.shared_by, page, seg_counts.pop()))
    ordered = {n: layers[n] for n in config.layer_names}
    return LayoutPlan(config, tuple(tensors), ordered, packed=False, hybrid=hybrid)


def _plan_packed(config: KVCacheConfig, specs: dict[str, KVCacheSpec],
                 hybrid: bool) -> LayoutPlan:
    if hybrid:
        raise LayoutError("the packed layout holds attention pages only; a model with Mamba "
                          "layers cannot use it (use its default block-major layout)")
    if len(config.kv_cache_tensors) != 1:
        raise LayoutError(f"the packed layout is ONE tensor shared by every layer; the config "
                          f"has {len(config.kv_cache_tensors)} KV cache tensors")
    t = config.kv_cache_tensors[0]
    block_stride = t.size // config.num_blocks
    pages = [specs[n].page_size_bytes for n in t.shared_by]
    if sum(pages) != block_stride:
        raise LayoutError(
            f"packed rows must hold exactly one logical block: bytes per block of the packed "
            f"tensor ({t.size} / {config.num_blocks} blocks = {block_stride}) != block_stride, "
            f"the sum of the {len(pages)} layers' pages ({sum(pages)} bytes)")
    splits = {_kernel_split(specs[n], config.kernel_block_size, n) for n in t.shared_by}
    if len(splits) != 1:
        raise LayoutError(f"packed layers must share one kernel split, got {sorted(splits)} "
                          f"(use one block size for every layer)")
    k = splits.pop()
    if block_stride % k or any(p % k for p in pages):
        raise LayoutError(f"packed row of {block_stride} bytes does not split into {k} kernel rows")
    kernel_row = block_stride // k
    layers: dict[str, LayerPlan] = {}
    offset = 0
    for n, page in zip(t.shared_by, pages, strict=True):
        spec = specs[n]
        assert isinstance(spec, AttentionSpec)
        if spec.page_size_padded not in (None, spec.real_page_size_bytes):
            raise LayoutError(f"layer {n!r}: padded pages are not supported in packed rows")
        mode = "latent" if isinstance(spec, MLAAttentionSpec) else "kv_major"
        view = _attention_views(spec, k=k, mode=mode, hnd=False, row_stride=kernel_row,
                                offset=offset, layer=n)
        layers[n] = LayerPlan(n, spec, 0, (view,), ())
        offset += page // k
    ordered = {n: layers[n] for n in config.layer_names}
    return LayoutPlan(config, (TensorPlan(0, t.shared_by, block_stride, 1),), ordered,
                      packed=True, hybrid=False)


# -- building tensors ----------------------------------------------------------------------
def _typed_view(raw: torch.Tensor, geom: ViewGeometry, num_blocks: int,
                segment_stride: int) -> torch.Tensor:
    storage = raw.untyped_storage()
    start = raw.data_ptr() - storage.data_ptr() + geom.offset_bytes
    e = geom.itemsize
    if start % e:
        raise LayoutError(f"view start {start} bytes into its storage is not aligned to {e}")
    out = torch.empty(0, dtype=geom.dtype, device=raw.device)
    return out.set_(storage, start // e, geom.shape_for(num_blocks),
                    geom.strides_for(segment_stride))


def build_kv_caches(plan: LayoutPlan | KVCacheConfig, raw_tensors: Sequence[torch.Tensor],
                    num_blocks: int) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Per-layer tensors in the model's shape over ``raw_tensors`` (1-D uint8 tensors, one
    per planned KV tensor, each holding ``num_blocks`` blocks per segment: segment ``s``
    starts at byte ``s * raw.numel() // num_segments``). Mamba layers get a list of states.
    """
    if isinstance(plan, KVCacheConfig):
        plan = plan_layout(plan)
    if len(raw_tensors) != len(plan.tensors):
        raise LayoutError(f"{len(raw_tensors)} raw tensors for {len(plan.tensors)} planned KV "
                          f"tensors")
    seg_strides = []
    for tp, raw in zip(plan.tensors, raw_tensors, strict=True):
        if raw.dtype != torch.uint8 or raw.dim() != 1:
            raise LayoutError("raw KV tensors must be 1-D uint8")
        nbytes = raw.numel()
        if nbytes % tp.num_segments or nbytes // tp.num_segments < (
                num_blocks * tp.segment_bytes_per_block):
            raise LayoutError(f"raw tensor {tp.index} holds {nbytes} bytes, too few for "
                              f"{num_blocks} blocks of {tp.bytes_per_block} bytes in "
                              f"{tp.num_segments} segment(s)")
        seg_strides.append(nbytes // tp.num_segments)
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name, lp in plan.layers.items():
        raw, ss = raw_tensors[lp.tensor_index], seg_strides[lp.tensor_index]
        views = [_typed_view(raw, g, num_blocks, ss) for g in lp.views]
        out[name] = views if lp.is_list else views[0]
    return out


def allocate_kv_caches(config: KVCacheConfig, device: str | torch.device = "cpu",
                       num_blocks: int | None = None
                       ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | list[torch.Tensor]]]:
    """An ordinary (non-extensible) zeroed allocation of ``config``: ``(raw, kv_caches)``.

    The fallback where VMM is unavailable, and the reference geometry the extensible cache
    must match when committed == capacity. ``num_blocks`` defaults to the config's.
    """
    plan = plan_layout(config)
    n = config.num_blocks if num_blocks is None else _check_positive("num_blocks", num_blocks)
    raw = [torch.zeros(n * tp.bytes_per_block, dtype=torch.uint8, device=device)
           for tp in plan.tensors]
    return raw, build_kv_caches(plan, raw, n)


# -- config builders and presets ----------------------------------------------------------
def _attn_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _per_layer_tensors(names: Iterable[str], page: int, num_blocks: int, layout: str
                       ) -> tuple[KVCacheTensor, ...]:
    names = tuple(names)
    if layout == "packed":
        return (KVCacheTensor(page * len(names) * num_blocks, names),)
    return tuple(KVCacheTensor(page * num_blocks, (n,)) for n in names)


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
    names = [_attn_name(i) for i in range(_check_positive("num_layers", num_layers))]
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
    return KVCacheConfig(num_blocks, _per_layer_tensors(names, full.page_size_bytes, num_blocks,
                                                        layout),
                         tuple(groups), layout=layout, kernel_block_size=kernel_block_size)


def mla_config(*, num_layers: int, kv_lora_rank: int = 512, qk_rope_head_dim: int = 64,
               dtype: torch.dtype | str = torch.bfloat16, block_size: int = 64,
               num_blocks: int = 64, layout: str = "blocks_first",
               kernel_block_size: int | None = None) -> KVCacheConfig:
    """A DeepSeek-style MLA decoder: one latent tensor per layer (one segment)."""
    spec = MLAAttentionSpec.latent(block_size=block_size, kv_lora_rank=kv_lora_rank,
                                   qk_rope_head_dim=qk_rope_head_dim,
                                   dtype=dtype_from_name(dtype))
    names = [_attn_name(i) for i in range(_check_positive("num_layers", num_layers))]
    return KVCacheConfig(num_blocks, _per_layer_tensors(names, spec.page_size_bytes, num_blocks,
                                                        layout),
                         (KVCacheGroupSpec(tuple(names), spec),), layout=layout,
                         kernel_block_size=kernel_block_size)


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
    num_layers = _check_positive("num_layers", num_layers)
    if num_layers < 2:
        raise LayoutError("a hybrid model needs at least 2 layers (attention + Mamba)")
    period = min(_check_positive("attn_period", attn_period), num_layers)
    is_attn = [i % period == period // 2 for i in range(num_layers)]
    attn = [_attn_name(i) for i in range(num_layers) if is_attn[i]]
    mamba = [f"model.layers.{i}.mamba" for i in range(num_layers) if not is_attn[i]]
    if not mamba:
        raise LayoutError(f"attn_period {attn_period} leaves no Mamba layer")
    m_dtypes = tuple(dtype_from_name(d) for d in mamba_dtypes)
    m_spec0 = MambaSpec(block_size=1, shapes=tuple(tuple(s) for s in mamba_shapes),
                        dtypes=m_dtypes)
    per_token = 2 * num_kv_heads * head_size * _itemsize(dtype)
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


def _llama(num_blocks: int, **kw: Any) -> KVCacheConfig:
    args = dict(num_layers=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                block_size=16)
    args.update(kw)
    return attention_config(num_blocks=num_blocks, **args)


def _qwen(num_blocks: int, **kw: Any) -> KVCacheConfig:
    args = dict(num_layers=24, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                block_size=16)
    args.update(kw)
    return attention_config(num_blocks=num_blocks, **args)


def _deepseek(num_blocks: int, **kw: Any) -> KVCacheConfig:
    args = dict(num_layers=27, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
                block_size=64)
    args.update(kw)
    return mla_config(num_blocks=num_blocks, **args)


def _jamba(num_blocks: int, **kw: Any) -> KVCacheConfig:
    args = dict(num_layers=32, attn_period=8)
    args.update(kw)
    return hybrid_config(num_blocks=num_blocks, **args)


def _packed(num_blocks: int, **kw: Any) -> KVCacheConfig:
    args = dict(num_layers=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
                block_size=16, layout="packed")
    args.update(kw)
    return attention_config(num_blocks=num_blocks, **args)


#: preset name -> (builder, one-line description)
PRESETS = {
    "llama3-8b-like": (_llama, "32 layers, 8 KV heads x 128, bf16, 16-token blocks, K/V split"),
    "qwen-small-like": (_qwen, "24 layers, 2 KV heads x 64, bf16, 16-token blocks, K/V split"),
    "deepseek-mla-like": (_deepseek, "27 MLA layers, latent 512+64, bf16, 64-token blocks"),
    "jamba-hybrid-like": (_jamba, "32 layers, attention 1 in 8 (8 KV heads x 128) + Mamba "
                                  "(conv 2048x3 bf16, ssm 2048x16 fp32), block-major, "
                                  "48-token blocks in 16-token kernel blocks"),
    "packed": (_packed, "Llama-3-8B-like pages packed into one 2 MiB row per block"),
}


def preset(name: str, num_blocks: int = 64, **overrides: Any) -> KVCacheConfig:
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
