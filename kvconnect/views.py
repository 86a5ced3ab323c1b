"""Committed-extent helpers: the only KV geometry a connector should ever see.

With an extensible KV cache a layer's tensor spans the *reserved capacity* while only a
prefix of ``num_blocks`` blocks (per segment) is physically committed. These helpers take
``(kv_caches, num_blocks, kv_cache_config)`` and give back geometry bounded to the
committed extent. ``kv_cache_config`` is kvconnect's ``KVCacheConfig`` (or its
``LayoutPlan``) or vLLM 0.33's own ``KVCacheConfig`` (converted by its fields, see
:mod:`kvconnect.layout.foreign`; no vLLM import here):

- :func:`narrow_kv_caches_to_num_blocks`: per-layer views narrowed along the block
  dimension (kernel blocks: ``num_blocks * k``) whose *storage* is bounded too;
- :func:`bound_packed_storage`: a block-outer layout's one storage (the seed's packed,
  vLLM's ``BL*``/``BH*``), ``num_blocks * block_stride`` bytes;
- :func:`committed_regions`: the registration regions (:class:`CommittedRegion`) per layer;
- :func:`page_owners` / :func:`page_holders`: the one rule for regions that share pages
  (hybrid attention + Mamba layers on one KV tensor, vLLM's overlaid cache groups): which
  region holds each region's bytes, so that shared bytes are stored and moved once.

They work the same on ordinary (``torch.empty``) allocations, where they are byte-identical
to ``narrow``. Units: bytes unless a name says blocks.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias, TypeVar

import torch

from ._pointer_view import bytes_tensor
from .checks import checked_int
from .layout import KVCacheConfig, LayerPlan, LayoutError, LayoutPlan, plan_layout
from .layout.build import typed_view
from .layout.foreign import VllmKVCacheConfigLike, config_from_vllm, is_vllm_like_config

__all__ = [
    "CommittedRegion", "KVCacheConfigLike", "KVCaches", "PagedRegion", "block_span",
    "bound_packed_storage",
    "committed_extents", "committed_regions", "narrow_kv_caches_to_num_blocks", "page_holders",
    "page_owners",
]

#: a layer's entry: one tensor, or a list of tensors (Mamba states)
KVCaches = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]
#: what says where a cache's blocks are: kvconnect's config or plan, or vLLM 0.33's config
KVCacheConfigLike: TypeAlias = "KVCacheConfig | LayoutPlan | VllmKVCacheConfigLike"


def block_span(num_blocks: int, block_stride: int, block_len: int) -> int:
    """Bytes from the first block's start to the last block's end, for ``num_blocks`` blocks
    of ``block_len`` bytes ``block_stride`` bytes apart (0 for no blocks)."""
    if num_blocks <= 0:
        return 0
    return (num_blocks - 1) * block_stride + block_len


@dataclass(frozen=True)
class PagedRegion:
    """Blocks of one region: block ``b`` starts at ``base_ptr + b * block_stride`` and is
    ``block_len`` bytes long. What descriptors and the page-sharing rule read: a
    :class:`CommittedRegion` is one; a reader rebuilds a peer's regions as such from its
    handshake (which names no tensor or segment). Units: bytes unless named ``*_blocks``;
    ``device`` is a torch device string (``"cpu"``, ``"cuda:N"``).
    """

    layer_name: str
    #: "k" / "v" (K/V split), "kv" (blocks-first), "latent" (MLA), "state" (Mamba, states summed),
    #: "packed" (one block_stride row holding every layer's page)
    part: str
    base_ptr: int
    block_len: int
    block_stride: int
    num_blocks: int
    device: str

    @property
    def nbytes(self) -> int:
        """Bytes this region owns: ``num_blocks * block_len``."""
        return self.num_blocks * self.block_len

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        return block_span(self.num_blocks, self.block_stride, self.block_len)

    def block_address(self, block_id: int) -> int:
        """Address of block ``block_id`` (must be below ``num_blocks``)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(
                f"block {block_id} outside the {self.num_blocks} committed blocks of "
                f"{self.layer_name}/{self.part}"
            )
        return self.base_ptr + block_id * self.block_stride


@dataclass(frozen=True)
class CommittedRegion(PagedRegion):
    """One registration region of one layer, inside committed memory (a :class:`PagedRegion`
    placed in the cache: which KV tensor, which segment, which layers)."""

    #: index into the cache's ExtensibleTensor list, and the segment inside it
    tensor_index: int = 0
    segment: int = 0
    #: the layers whose pages this region holds (one, or every layer for "packed")
    layers: tuple[str, ...] = ()
    #: bytes from the start of segment ``segment`` of KV tensor ``tensor_index`` to base_ptr
    segment_offset: int = 0


# -- shared pages ----------------------------------------------------------------------------
RegionT = TypeVar("RegionT", bound=PagedRegion)


def _holds(owner: PagedRegion, r: PagedRegion) -> bool:
    """Block ``b`` of ``r`` lies inside block ``b`` of ``owner``, for every block of ``r``."""
    return (owner.device == r.device and owner.block_stride == r.block_stride
            and r.num_blocks <= owner.num_blocks and owner.base_ptr <= r.base_ptr
            and r.base_ptr + r.block_len <= owner.base_ptr + owner.block_len)


def _may_share_bytes(a: PagedRegion, b: PagedRegion) -> bool:
    """Whether blocks of ``a`` and ``b`` may share a byte: exact for equal strides; at
    different strides, whether their spans overlap (no layout we build interleaves regions of
    different strides, and the answer stays O(1) for a peer's regions)."""
    if a.num_blocks <= 0 or b.num_blocks <= 0 or a.device != b.device:
        return False
    a_end = a.base_ptr + block_span(a.num_blocks, a.block_stride, a.block_len)
    b_end = b.base_ptr + block_span(b.num_blocks, b.block_stride, b.block_len)
    if a_end <= b.base_ptr or b_end <= a.base_ptr:
        return False
    if a.block_stride != b.block_stride or a.block_stride <= 0:
        return True
    # block i of a meets block j of b iff d + k*s lies in (-a.block_len, b.block_len), where
    # k = i - j takes the values 1 - b.num_blocks .. a.num_blocks - 1
    s, d = a.block_stride, a.base_ptr - b.base_ptr
    k_lo = max((-a.block_len - d) // s + 1, 1 - b.num_blocks)
    k_hi = min(-((d - b.block_len) // s) - 1, a.num_blocks - 1)
    return k_lo <= k_hi


def page_owners(regions: Sequence[PagedRegion]) -> list[int]:
    """For each region, the index of the region that holds its bytes (its own index when it
    holds them itself). The one page-sharing rule of kvconnect.

    Region ``o`` holds region ``r`` when block ``b`` of ``r`` lies inside block ``b`` of
    ``o`` for every block of ``r``: same device and block stride, ``o.base_ptr <=
    r.base_ptr``, ``r.base_ptr + r.block_len <= o.base_ptr + o.block_len`` and ``r.num_blocks
    <= o.num_blocks`` (hybrid models: a Mamba layer's states inside the attention page of the
    same KV tensor; vLLM's overlaid cache groups: identical regions). A holder is chosen
    among the largest ``block_len`` first, the earliest in ``regions`` among equals, so the
    answer does not depend on the order of aliasing layers. Moving (or storing) the holders'
    blocks moves every region's bytes exactly once.

    Raises ``ValueError`` naming both regions when blocks of two regions share bytes and
    neither holds the other (a partial overlap, block ``b`` of one landing in another block
    of the other, or regions of different block strides whose spans overlap): such regions
    cannot be moved block by block. O(n log n) for regions in disjoint spans, O(n^2) pair
    checks of O(1) each at worst (block-outer layouts, all regions in the same rows).
    """
    order = sorted(range(len(regions)), key=lambda i: (-regions[i].block_len, i))
    owner = list(range(len(regions)))
    #: per device: the holders so far as (first byte, index), sorted, and their longest span
    holders: dict[str, list[tuple[int, int]]] = {}
    longest: dict[str, int] = {}
    for i in order:
        r = regions[i]
        dev, start = str(r.device), r.base_ptr
        span = block_span(r.num_blocks, r.block_stride, r.block_len)
        row = holders.setdefault(dev, [])
        # only holders starting in [start - longest span, start + span) can meet r
        lo = bisect.bisect_left(row, (start - longest.get(dev, 0), -1))
        hi = bisect.bisect_left(row, (start + span, -1))
        for _, h in row[lo:hi]:
            o = regions[h]
            if _holds(o, r):
                owner[i] = h
                break
            if _may_share_bytes(o, r):
                raise ValueError(
                    f"regions {o.layer_name}/{o.part} and {r.layer_name}/{r.part} share bytes "
                    "but neither holds the other block for block (a partial overlap, another "
                    "block id, or another block stride): the layout cannot be moved region by "
                    "region")
        else:
            bisect.insort(row, (start, i))
            longest[dev] = max(longest.get(dev, 0), span)
    return owner


def page_holders(regions: Sequence[RegionT]) -> list[tuple[RegionT, tuple[str, ...]]]:
    """The regions that hold their own bytes (:func:`page_owners`), each with the
    ``layer/part`` names of every region whose bytes it holds (its own included), names and
    holders in order of first appearance in ``regions``. Moving the holders' blocks moves
    each region's bytes once. Raises ``ValueError`` as :func:`page_owners`."""
    owner = page_owners(regions)
    members: dict[int, list[str]] = {}
    for i, r in enumerate(regions):
        members.setdefault(owner[i], []).append(f"{r.layer_name}/{r.part}")
    return [(regions[h], tuple(names)) for h, names in members.items()]


# -- bounded storages ---------------------------------------------------------------------
def _bounded_storage(ptr: int, nbytes: int, like: torch.Tensor) -> torch.UntypedStorage:
    """An untyped storage of exactly ``nbytes`` at ``ptr`` on ``like``'s device, keeping
    ``like``'s storage alive. Nothing is read: the range may include unmapped bytes."""
    if nbytes <= 0:
        raise ValueError(f"a bounded storage needs a positive byte count, got {nbytes}")
    if like.device.type not in ("cpu", "cuda"):
        raise LayoutError(f"cannot bound a storage on device type {like.device.type!r}")
    return bytes_tensor(ptr, nbytes, like.device, like.untyped_storage()).untyped_storage()


# -- matching kv_caches against the plan ---------------------------------------------------
@dataclass(frozen=True)
class _LayerMatch:
    tensors: tuple[torch.Tensor, ...]
    #: address of the start of the layer's first segment (block 0)
    anchor: int
    first_segment: int
    #: bytes between segment starts read off a plane dimension, or None (no plane dim)
    segment_stride: int | None
    #: logical blocks the given views hold
    blocks: int


@dataclass(frozen=True)
class _BufferMatch:
    """Where a planned buffer lies: its first byte and the distance between segments."""

    base: int
    segment_stride: int


def _as_plan(config: KVCacheConfigLike) -> LayoutPlan:
    if isinstance(config, LayoutPlan):
        return config
    if isinstance(config, KVCacheConfig):
        return plan_layout(config)
    if is_vllm_like_config(config):
        return plan_layout(config_from_vllm(config))
    raise TypeError(f"kv_cache_config must be kvconnect's or vLLM's KVCacheConfig (or a "
                    f"LayoutPlan), got {type(config).__module__}.{type(config).__name__}")


def _match_layer(lp: LayerPlan, value: object) -> _LayerMatch:
    name = lp.name
    if lp.is_list:
        if isinstance(value, torch.Tensor) or not isinstance(value, Sequence):
            raise LayoutError(f"layer {name!r}: expected a list of {len(lp.views)} state "
                              f"tensors, got {type(value).__name__}")
        tensors = tuple(value)
    else:
        if not isinstance(value, torch.Tensor):
            raise LayoutError(f"layer {name!r}: expected a tensor, got {type(value).__name__}")
        tensors = (value,)
    if len(tensors) != len(lp.views):
        raise LayoutError(f"layer {name!r}: {len(tensors)} tensors given, the config has "
                          f"{len(lp.views)}")
    anchor = seg_stride = blocks = None
    for i, (t, g) in enumerate(zip(tensors, lp.views, strict=True)):
        what = f"layer {name!r}" + (f" state {i}" if lp.is_list else "")
        if t.dtype != g.dtype:
            raise LayoutError(f"{what}: dtype {t.dtype} does not match the config's {g.dtype}")
        if t.dim() != len(g.unit_shape):
            raise LayoutError(f"{what}: {t.dim()}-D tensor, the config's layout is "
                              f"{len(g.unit_shape)}-D {g.unit_shape}")
        per = g.blocks_per_block
        other = [d for d in range(t.dim()) if d != g.block_dim]
        if [t.shape[d] for d in other] != [g.unit_shape[d] for d in other] or (
                t.shape[g.block_dim] % per):
            raise LayoutError(
                f"{what}: shape {tuple(t.shape)} does not match the config's layout "
                f"{g.shape_for(1)} per block (block dim {g.block_dim}, {per} kernel blocks per "
                f"block)")
        ss = None if g.segment_dim is None else t.stride(g.segment_dim) * g.itemsize
        want = g.strides_for(ss or 0)
        if tuple(t.stride()) != want:
            raise LayoutError(f"{what}: strides {tuple(t.stride())} do not match the config's "
                              f"layout {want} (layout {lp.spec!r})")
        a = t.data_ptr() - g.offset_bytes
        n = t.shape[g.block_dim] // per
        if anchor is None:
            anchor, seg_stride, blocks = a, ss, n
        elif (a, n) != (anchor, blocks):
            raise LayoutError(f"{what}: the state tensors do not lie in one page-strided "
                              f"buffer of the same block count")
    assert anchor is not None and blocks is not None
    return _LayerMatch(tensors, anchor, lp.views[0].first_segment, seg_stride, blocks)


def _match_buffer(plan: LayoutPlan, index: int, layers: dict[str, _LayerMatch]) -> _BufferMatch:
    """The buffer's base and segment stride, from its layers' addresses (and plane
    strides); every layer must agree and segments must not overlap."""
    tp = plan.tensors[index]
    known = {m.segment_stride for m in layers.values() if m.segment_stride is not None}
    (n0, m0) = min(layers.items(), key=lambda kv: kv[1].first_segment)
    if tp.num_segments == 1:
        ss = 0
    elif known:
        ss = known.pop()
        if known:
            raise LayoutError(f"layers of buffer {index} disagree on the distance between "
                              f"planes: {sorted(known | {ss})} bytes")
    else:
        other = next(((n, m) for n, m in layers.items()
                      if m.first_segment != m0.first_segment), None)
        if other is None:
            raise LayoutError(f"cannot tell the segment stride of buffer {index}: all its "
                              f"layers start at segment {m0.first_segment}")
        dist, steps = other[1].anchor - m0.anchor, other[1].first_segment - m0.first_segment
        if dist % steps:
            raise LayoutError(f"layers {n0!r} and {other[0]!r} are {dist} bytes apart, not a "
                              f"whole number of the {steps} segments between them")
        ss = dist // steps
    base = m0.anchor - m0.first_segment * ss
    for n, m in layers.items():
        if m.anchor != base + m.first_segment * ss:
            raise LayoutError(f"layers {n0!r} and {n!r} share buffer {index} in the config, "
                              f"but their tensors start at different addresses: {n!r} at "
                              f"{m.anchor:#x}, not at segment {m.first_segment} of the buffer "
                              f"({base:#x} + {m.first_segment} * {ss} bytes)")
        if tp.num_segments > 1 and ss < m.blocks * tp.segment_bytes_per_block:
            what = "K and V" if plan.layers[n].views[0].segment_dim is not None else "segments"
            raise LayoutError(f"layer {n!r}: {what} are {ss} bytes apart, less than the "
                              f"{m.blocks * tp.segment_bytes_per_block} bytes of {m.blocks} "
                              f"blocks: they overlap")
    return _BufferMatch(base, ss)


def _match_all(kv_caches: KVCaches, num_blocks: int, plan: LayoutPlan
               ) -> tuple[dict[str, _LayerMatch], dict[int, _BufferMatch]]:
    checked_int("num_blocks", num_blocks)
    missing = [n for n in plan.layers if n not in kv_caches]
    extra = [n for n in kv_caches if n not in plan.layers]
    if missing or extra:
        raise LayoutError(f"kv_caches do not match the config: missing layers {missing}, "
                          f"layers not in the config {extra}")
    out = {n: _match_layer(lp, kv_caches[n]) for n, lp in plan.layers.items()}
    for n, m in out.items():
        if num_blocks > m.blocks:
            raise LayoutError(f"layer {n!r} holds {m.blocks} blocks, fewer than num_blocks "
                              f"{num_blocks}")
    by_buffer: dict[int, dict[str, _LayerMatch]] = {}
    for n, m in out.items():
        by_buffer.setdefault(plan.layers[n].tensor_index, {})[n] = m
    buffers = {i: _match_buffer(plan, i, ms) for i, ms in by_buffer.items()}
    return out, buffers


def _rebuild(lp: LayerPlan, m: _LayerMatch, storage: torch.UntypedStorage, storage_start: int,
             bm: _BufferMatch, num_blocks: int) -> torch.Tensor | list[torch.Tensor]:
    views = [typed_view(storage, g.start_bytes(bm.segment_stride) - storage_start, g,
                        num_blocks, bm.segment_stride, t.device)
             for t, g in zip(m.tensors, lp.views, strict=True)]
    return views if lp.is_list else views[0]


def committed_extents(plan: LayoutPlan, index: int, segment_stride: int, num_blocks: int
                      ) -> list[tuple[int, int]]:
    """``(start, end)`` bytes from buffer ``index``'s base: its committed prefixes of
    ``num_blocks`` blocks, adjacent ones merged (one extent on a plain allocation)."""
    tp = plan.tensors[index]
    used = num_blocks * tp.segment_bytes_per_block
    out: list[tuple[int, int]] = []
    for s in range(tp.num_segments):
        a = s * segment_stride
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], a + used)
        else:
            out.append((a, a + used))
    return out


def _layer_extent(lp: LayerPlan, extents: list[tuple[int, int]], segment_stride: int
                  ) -> tuple[int, int]:
    """The bytes (from the buffer base) of the extents holding the layer's segments."""
    first, last = lp.segments
    lo, hi = first * segment_stride, last * segment_stride
    start = next(a for a, b in extents if a <= lo < b or a == lo)
    end = next(b for a, b in extents if a <= hi < b or a == hi)
    return start, end


# -- public helpers ------------------------------------------------------------------------
def bound_packed_storage(kv_caches: KVCaches, num_blocks: int,
                         kv_cache_config: KVCacheConfigLike) -> torch.UntypedStorage:
    """The one storage of a block-outer layout (the seed's packed, vLLM's ``BL*``/``BH*``)
    bounded to ``num_blocks * block_stride`` bytes from row 0 (``nbytes() // num_blocks ==
    block_stride``). Raises unless the layout is block-outer and every layer's view lies in
    the same rows. ``kv_cache_config``: kvconnect's or vLLM's ``KVCacheConfig``."""
    plan = _as_plan(kv_cache_config)
    if not plan.block_outer:
        raise LayoutError(f"bound_packed_storage needs a block-outer layout (packed, BLHNC, "
                          f"BLNHC, BHLNC), the config is {plan.config.layout!r}")
    matches, buffers = _match_all(kv_caches, num_blocks, plan)
    first = next(iter(matches.values()))
    return _bounded_storage(buffers[0].base, num_blocks * plan.block_stride, first.tensors[0])


def narrow_kv_caches_to_num_blocks(
    kv_caches: KVCaches, num_blocks: int, kv_cache_config: KVCacheConfigLike,
) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Narrow every layer to its first ``num_blocks`` logical blocks AND bound its storage.

    Each result has the input's dtype, strides and data pointer, with the block dimension
    cut to ``num_blocks * k`` kernel blocks. Its ``untyped_storage()`` covers exactly the
    committed bytes around it: the committed prefixes of its buffer's segments, adjacent
    ones merged. So on a plain allocation every layer of a buffer shares one storage of the
    buffer's committed bytes; with a larger reservation a layer-outer layer (vLLM's
    ``LB*``) gets its own ``num_blocks * page`` bytes, a block-outer layout (packed,
    ``BL*``) one ``num_blocks * block_stride`` storage for all layers, and a layer with
    planes (K/V split, ``LHBNC`` heads) the span from its first plane's first byte to its
    last plane's last committed byte (the bytes between belong to no element). Layers that
    alias a buffer (hybrid) share one storage. ``kv_cache_config`` (kvconnect's or vLLM's
    ``KVCacheConfig``) is required: it is what says where the block dimension is and how
    pages are packed.
    """
    plan = _as_plan(kv_cache_config)
    matches, buffers = _match_all(kv_caches, num_blocks, plan)
    storages: dict[tuple[int, int, int], torch.UntypedStorage] = {}
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for n, lp in plan.layers.items():
        m, bm = matches[n], buffers[lp.tensor_index]
        extents = committed_extents(plan, lp.tensor_index, bm.segment_stride, num_blocks)
        start, end = _layer_extent(lp, extents, bm.segment_stride)
        key = (lp.tensor_index, start, end)
        st = storages.get(key)
        if st is None:
            st = storages[key] = _bounded_storage(bm.base + start, end - start, m.tensors[0])
        out[n] = _rebuild(lp, m, st, start, bm, num_blocks)
    return out


def committed_regions(kv_caches: KVCaches, num_blocks: int,
                      kv_cache_config: KVCacheConfigLike) -> list[CommittedRegion]:
    """The regions a connector should register for the first ``num_blocks`` blocks.

    K and V separately for K/V-split layouts (parts "k"/"v", segments 0/1), one "kv" region
    for block-major attention, one "latent" region for MLA, one "state" region for a Mamba
    layer (``block_len`` = the sum of its states' bytes per block, ``block_stride`` = its page)
    and, for the seed's packed layout, ONE "packed" region over the whole storage
    (``block_len == block_stride``, ``layers`` = every layer in row order). vLLM layouts give
    one region per contiguous run of a layer's page ("kv"; "kv.0", "kv.1", ... per head for
    ``LHBNC`` and ``BHLNC``). Layers placed at the same bytes alias them by design (hybrid
    models, vLLM's overlaid cache groups). ``kv_cache_config``: kvconnect's or vLLM's.
    """
    plan = _as_plan(kv_cache_config)
    matches, buffers = _match_all(kv_caches, num_blocks, plan)
    if plan.packed:
        m = next(iter(matches.values()))
        rg = plan.packed_region()
        return [CommittedRegion("packed", "packed", buffers[0].base, rg.block_len,
                                rg.block_stride, num_blocks, str(m.tensors[0].device), 0, 0,
                                tuple(plan.layers), 0)]
    out = []
    for n, lp in plan.layers.items():
        m, bm = matches[n], buffers[lp.tensor_index]
        for rg in lp.regions:
            out.append(CommittedRegion(
                n, rg.part, bm.base + rg.segment * bm.segment_stride + rg.offset, rg.block_len,
                rg.block_stride, num_blocks, str(m.tensors[0].device), lp.tensor_index,
                rg.segment, (n,), rg.offset))
    return out
