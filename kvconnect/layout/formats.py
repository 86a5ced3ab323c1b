"""Page formats: how a layer's page is laid out inside its placement, and how it is viewed.

One registry (:data:`FORMATS`, looked up with :func:`page_format`) holds every layout name a
config may give:

- vLLM 0.33's six :class:`VllmPageFormat` layouts. The logical per-layer view is 4-D
  ``[B, H, N, C]`` (C = K and V of one head and token, in bytes, viewed in the spec's
  dtype); the name is the physical order of ``[L, B, H, N, C]``. ``LBHNC``, ``LBNHC``,
  ``LHBNC`` are layer-outer (``LHBNC`` puts heads outside blocks: one plane, i.e. one
  segment, per head); ``BLHNC``, ``BLNHC``, ``BHLNC`` are block-outer (one row per block).
- the seed's five :class:`SeedPageFormat` layouts, 5-D views with K and V in a leading or
  second dimension: ``kv_split_nhd`` / ``kv_split_hnd`` (K and V are two planes),
  ``blocks_first`` / ``blocks_first_hnd`` (K and V side by side in a page), and
  ``packed`` (block-outer rows). A model with Mamba layers lays its attention out
  block-major whatever the layout says.

A format turns a :class:`LayerSlot` (where the planner put the layer) into a
:class:`~kvconnect.layout.geometry.LayerPlan`. Units: bytes unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .geometry import LayerPlan, RegionGeometry, ViewGeometry
from .specs import (
    AttentionSpec,
    KVCacheSpec,
    LayoutError,
    MambaSpec,
    MLAAttentionSpec,
    dtype_name,
    itemsize,
)

__all__ = ["FORMATS", "LAYOUTS", "SEED_LAYOUTS", "VLLM_LAYOUTS", "LayerSlot", "PageFormat",
           "SeedPageFormat", "VllmPageFormat", "page_format"]


@dataclass(frozen=True)
class LayerSlot:
    """Where the planner put one layer.

    ``first_segment``: its buffer segment (layer-outer) or 0 (block-outer); ``offset``:
    bytes into that segment's block (block-outer: into the row, or the seed's kernel row);
    ``block_stride``: bytes between consecutive logical blocks in the segment (a page, a
    plane of a page, or a row); ``layer_stride`` and ``num_layers``: its placement's
    (``BHLNC`` strides heads by ``num_layers * layer_stride``).
    """

    first_segment: int
    offset: int
    block_stride: int
    layer_stride: int
    num_layers: int


class PageFormat:
    """One layout name: where layers sit relative to blocks and how a page is viewed."""

    name: str = ""
    description: str = ""
    #: layers (and planes) outermost, each a block-prefix segment; else block rows
    layer_outer: bool = True
    #: the seed's packed layout: one "packed" region over whole rows
    packed: bool = False

    def planes(self, spec: KVCacheSpec, hybrid: bool) -> int:
        """Segments one layer of ``spec`` spans (K/V split: 2, LHBNC: heads, else 1)."""
        raise NotImplementedError

    def layer_plan(self, name: str, spec: KVCacheSpec, k: int, slot: LayerSlot,
                   tensor_index: int, hybrid: bool) -> LayerPlan:
        """Views and regions of layer ``name`` (``k`` kernel blocks per logical block)."""
        raise NotImplementedError


# -- vLLM 0.33 ------------------------------------------------------------------------------
_L, _B, _H, _N, _C = range(5)


class VllmPageFormat(PageFormat):
    """A vLLM 0.33 ``KVCacheLayout``: ``order`` is the physical order of ``[L, B, H, N, C]``."""

    def __init__(self, name: str, order: tuple[int, ...], description: str) -> None:
        self.name, self.order, self.description = name, order, description
        self.layer_outer = order[0] == _L

    def _heads_outside_blocks(self) -> bool:
        return self.order.index(_H) < self.order.index(_B)

    def planes(self, spec: KVCacheSpec, hybrid: bool) -> int:
        if not isinstance(spec, AttentionSpec):
            raise LayoutError(f"layout {self.name}: {type(spec).__name__} layers are not "
                              f"modelled for vLLM 0.33 layouts yet (attention and MLA are)")
        return spec.num_kv_heads if self._heads_outside_blocks() else 1

    def layer_plan(self, name: str, spec: KVCacheSpec, k: int, slot: LayerSlot,
                   tensor_index: int, hybrid: bool) -> LayerPlan:
        planes = self.planes(spec, hybrid)
        assert isinstance(spec, AttentionSpec)
        e, heads, c = itemsize(spec.dtype), spec.num_kv_heads, spec.content_bytes
        dense = spec.real_page_size_bytes
        if planes > 1 and spec.page_size_padded not in (None, dense):
            raise LayoutError(f"layer {name!r}: {self.name} cannot pad pages (heads lie outside "
                              f"blocks); use a block-compact layout such as LBHNC or BLHNC")
        bs = slot.block_stride
        if k > 1:
            if bs != dense:
                raise LayoutError(
                    f"layer {name!r}: layout {self.name} does not store blocks as dense, "
                    f"unpadded pages (block stride {bs} != page {dense}), so a block "
                    f"cannot be split into {k} kernel blocks; use kernel_block_size=None or a "
                    f"layer-compact layout such as LBNHC (vLLM raises the same)")
        kbs = spec.block_size // k
        sizes = {_H: heads, _N: kbs, _C: c}
        strides: dict[int, int | None] = {}
        cur, seen_b = 1, False
        for dim in reversed(self.order):
            if dim == _L:
                cur = slot.layer_stride * slot.num_layers
            elif dim == _B:
                strides[_B], seen_b = bs // k, True
            elif seen_b:  # outside the block dimension of a layer-outer layout: a plane
                strides[dim] = None
            else:
                strides[dim] = cur
                cur *= sizes[dim]
        if c % e:
            raise LayoutError(f"layer {name!r}: content of {c} bytes is not a whole number of "
                              f"{dtype_name(spec.dtype)} elements")
        view = ViewGeometry(spec.dtype, (k, heads, kbs, c // e),
                            (strides[_B], strides[_H], strides[_N], e), slot.offset,
                            block_dim=0, segment_dim=1 if strides[_H] is None else None,
                            first_segment=slot.first_segment)
        runs = view.runs_in_segment()
        if min(o for o, _ in runs) < 0 or max(o + n for o, n in runs) > slot.block_stride:
            raise LayoutError(f"layer {name!r}: its page does not fit its {slot.block_stride}-"
                              f"byte block stride in layout {self.name}")
        base = "latent" if isinstance(spec, MLAAttentionSpec) else "kv"
        regions = [RegionGeometry(base, slot.first_segment + p, off, n, bs)
                   for p in range(planes) for off, n in runs]
        if len(regions) > 1:
            regions = [RegionGeometry(f"{base}.{i}", r.segment, r.offset, r.block_len,
                                      r.block_stride) for i, r in enumerate(regions)]
        return LayerPlan(name, spec, tensor_index, (view,), tuple(regions))


# -- the seed's layouts ----------------------------------------------------------------------
def _token_head_strides(hnd: bool, kbs: int, heads: int, head: int, e: int) -> tuple[int, ...]:
    """Byte strides of (token, head, element) inside one kernel page of K (or V)."""
    if hnd:
        return (head * e, kbs * head * e, e)
    return (heads * head * e, head * e, e)


def _attention_view(spec: AttentionSpec, *, k: int, mode: str, hnd: bool, row_stride: int,
                    offset: int, layer: str) -> ViewGeometry:
    """The seed view of one attention layer.

    ``mode``: "split" (K/V segments), "kv_major" (logical (2, blocks, ...) over block-major
    pages), "blocks_first" ((blocks, 2, ...)), "latent" (MLA). ``row_stride`` is the bytes
    between consecutive kernel blocks (unused for "split").
    """
    e = itemsize(spec.dtype)
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
        e = itemsize(dtype)
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


def _moved(view: ViewGeometry, first_segment: int) -> ViewGeometry:
    from dataclasses import replace

    return replace(view, first_segment=first_segment)


class SeedPageFormat(PageFormat):
    """One of the seed's layouts (``kind``: "kv_split", "blocks_first" or "packed")."""

    def __init__(self, name: str, kind: str, hnd: bool, description: str) -> None:
        self.name, self.kind, self.hnd, self.description = name, kind, hnd, description
        self.packed = kind == "packed"
        self.layer_outer = not self.packed

    def planes(self, spec: KVCacheSpec, hybrid: bool) -> int:
        split = (self.kind == "kv_split" and not hybrid and isinstance(spec, AttentionSpec)
                 and not isinstance(spec, MLAAttentionSpec))
        return 2 if split else 1

    def layer_plan(self, name: str, spec: KVCacheSpec, k: int, slot: LayerSlot,
                   tensor_index: int, hybrid: bool) -> LayerPlan:
        seg = slot.first_segment
        if self.packed:
            return self._packed_layer(name, spec, k, slot, tensor_index)
        page = slot.block_stride * self.planes(spec, hybrid)
        if isinstance(spec, MambaSpec):
            views = tuple(_moved(v, seg) for v in _mamba_views(spec, page, name))
            return LayerPlan(name, spec, tensor_index, views,
                             (_region_from_views("state", views, page, seg),), is_list=True)
        assert isinstance(spec, AttentionSpec)
        if page % k:
            raise LayoutError(f"layer {name!r}: a {page}-byte page does not split into {k} "
                              f"kernel blocks")
        if self.planes(spec, hybrid) == 2:
            if spec.page_size_padded not in (None, spec.real_page_size_bytes):
                raise LayoutError(f"layer {name!r}: a padded page needs a block-major layout "
                                  f"(blocks_first), not {self.name!r}")
            view = _moved(_attention_view(spec, k=k, mode="split", hnd=self.hnd, row_stride=0,
                                          offset=0, layer=name), seg)
            half = slot.block_stride
            return LayerPlan(name, spec, tensor_index, (view,),
                             (RegionGeometry("k", seg, 0, half, half),
                              RegionGeometry("v", seg + 1, 0, half, half)))
        # one segment: an MLA latent page, or K and V side by side in a block-major page
        mla = isinstance(spec, MLAAttentionSpec)
        mode = "latent" if mla else "kv_major" if self.kind == "kv_split" else "blocks_first"
        view = _moved(_attention_view(spec, k=k, mode=mode, hnd=self.hnd, row_stride=page // k,
                                      offset=0, layer=name), seg)
        return LayerPlan(name, spec, tensor_index, (view,),
                         (_region_from_views("latent" if mla else "kv", (view,), page, seg),))

    @staticmethod
    def _packed_layer(name: str, spec: KVCacheSpec, k: int, slot: LayerSlot,
                      tensor_index: int) -> LayerPlan:
        if not isinstance(spec, AttentionSpec):
            raise LayoutError("the packed layout holds attention pages only; a model with "
                              "Mamba layers cannot use it (use its default block-major layout)")
        if spec.page_size_padded not in (None, spec.real_page_size_bytes):
            raise LayoutError(f"layer {name!r}: padded pages are not supported in packed rows")
        mode = "latent" if isinstance(spec, MLAAttentionSpec) else "kv_major"
        view = _attention_view(spec, k=k, mode=mode, hnd=False,
                               row_stride=slot.block_stride // k, offset=slot.offset, layer=name)
        return LayerPlan(name, spec, tensor_index, (view,), ())


# -- the registry ---------------------------------------------------------------------------
_VLLM = (
    VllmPageFormat("LBHNC", (0, 1, 2, 3, 4), "vLLM 0.33: layer-outer, [B, H, N, C] pages"),
    VllmPageFormat("LBNHC", (0, 1, 3, 2, 4), "vLLM 0.33: layer-outer, [B, N, H, C] pages"),
    VllmPageFormat("LHBNC", (0, 2, 1, 3, 4), "vLLM 0.33: layer-outer, heads outside blocks "
                                             "(one segment per layer and head)"),
    VllmPageFormat("BLHNC", (1, 0, 2, 3, 4), "vLLM 0.33: block-outer rows of [L, H, N, C]"),
    VllmPageFormat("BLNHC", (1, 0, 3, 2, 4), "vLLM 0.33: block-outer rows of [L, N, H, C]"),
    VllmPageFormat("BHLNC", (1, 2, 0, 3, 4), "vLLM 0.33: block-outer rows of [H, L, N, C]"),
)
_SEED = (
    SeedPageFormat("kv_split_nhd", "kv_split", False,
                   "seed: (2, blocks, tokens, heads, head); K and V are two planes"),
    SeedPageFormat("kv_split_hnd", "kv_split", True,
                   "seed: physically (2, blocks, heads, tokens, head), viewed NHD"),
    SeedPageFormat("blocks_first", "blocks_first", False,
                   "seed: (blocks, 2, tokens, heads, head); one segment"),
    SeedPageFormat("blocks_first_hnd", "blocks_first", True,
                   "seed: physically (blocks, 2, heads, tokens, head), viewed NHD"),
    SeedPageFormat("packed", "packed", False,
                   "seed: block-outer rows holding every layer's (2, tokens, heads, head) page"),
)

#: layout name -> its page format
FORMATS: dict[str, PageFormat] = {f.name: f for f in (*_SEED, *_VLLM)}
#: the seed's layout names, in registry order
SEED_LAYOUTS = tuple(f.name for f in _SEED)
#: vLLM 0.33's KVCacheLayout names
VLLM_LAYOUTS = tuple(f.name for f in _VLLM)
#: every layout name a config may give
LAYOUTS = SEED_LAYOUTS + VLLM_LAYOUTS


def page_format(name: object) -> PageFormat:
    """The format of layout ``name`` (a string, or vLLM's ``KVCacheLayout`` member)."""
    key = getattr(name, "name", name)
    fmt = FORMATS.get(str(key))
    if fmt is None:
        raise LayoutError(f"unknown layout {name!r}; expected one of {LAYOUTS}")
    return fmt
