"""Committed-extent helpers: the only KV geometry a connector should ever see.

With an extensible KV cache a layer's tensor spans the *reserved capacity* while only a
prefix of ``num_blocks`` blocks (per segment) is physically committed. These helpers take
``(kv_caches, num_blocks, kv_cache_config)`` and give back geometry bounded to the
committed extent:

- :func:`narrow_kv_caches_to_num_blocks`: per-layer views narrowed along the block
  dimension (kernel blocks: ``num_blocks * k``) whose *storage* is bounded too;
- :func:`bound_packed_storage`: the packed layout's one storage, ``num_blocks * block_stride``
  bytes;
- :func:`committed_regions`: the registration regions (:class:`CommittedRegion`) per layer.

They work the same on ordinary (``torch.empty``) allocations, where they are byte-identical
to ``narrow``. Units: bytes unless a name says blocks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .layout import KVCacheConfig, LayerPlan, LayoutError, LayoutPlan, plan_layout

__all__ = [
    "CommittedRegion", "KVCaches", "bound_packed_storage", "committed_regions",
    "narrow_kv_caches_to_num_blocks",
]

#: a layer's entry: one tensor, or a list of tensors (Mamba states)
KVCaches = Mapping[str, "torch.Tensor | Sequence[torch.Tensor]"]


@dataclass(frozen=True)
class CommittedRegion:
    """One registration region of one layer, inside committed memory.

    Units: bytes unless named ``*_blocks``. Block ``b`` of this region starts at
    ``base_ptr + b * block_stride`` and is ``block_len`` bytes long.
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
    #: index into the cache's ExtensibleTensor list, and the segment inside it
    tensor_index: int = 0
    segment: int = 0
    #: the layers whose pages this region holds (one, or every layer for "packed")
    layers: tuple[str, ...] = ()
    #: bytes from the start of segment ``segment`` of KV tensor ``tensor_index`` to base_ptr
    segment_offset: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this region owns: ``num_blocks * block_len``."""
        return self.num_blocks * self.block_len

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.block_len

    def block_address(self, block_id: int) -> int:
        """Address of block ``block_id`` (must be below ``num_blocks``)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(
                f"block {block_id} outside the {self.num_blocks} committed blocks of "
                f"{self.layer_name}/{self.part}"
            )
        return self.base_ptr + block_id * self.block_stride


# -- bounded storages ---------------------------------------------------------------------
class _CudaArray:
    """``__cuda_array_interface__`` holder; torch keeps it (and ``_keep``) alive."""

    def __init__(self, ptr: int, nbytes: int, keep: object) -> None:
        self._keep = keep
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None,
                                         "stream": None}


def _bounded_storage(ptr: int, nbytes: int, like: torch.Tensor) -> torch.UntypedStorage:
    """An untyped storage of exactly ``nbytes`` at ``ptr`` on ``like``'s device, keeping
    ``like``'s storage alive. Nothing is read: the range may include unmapped bytes."""
    if nbytes <= 0:
        raise ValueError(f"a bounded storage needs a positive byte count, got {nbytes}")
    keep = like.untyped_storage()
    if like.device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf._kvconnect_keep = keep  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()
    if like.device.type == "cuda":
        return torch.as_tensor(_CudaArray(ptr, nbytes, keep),
                               device=like.device).untyped_storage()
    raise LayoutError(f"cannot bound a storage on device type {like.device.type!r}")


# -- matching kv_caches against the plan ---------------------------------------------------
@dataclass(frozen=True)
class _LayerMatch:
    tensors: tuple[torch.Tensor, ...]
    #: address of the layer's KV tensor's first byte (segment 0, block 0)
    base: int
    #: bytes between segment starts (0 when single-segment)
    segment_stride: int
    #: logical blocks the given views hold
    blocks: int


def _as_plan(config: KVCacheConfig | LayoutPlan) -> LayoutPlan:
    if isinstance(config, LayoutPlan):
        return config
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"kv_cache_config must be a KVCacheConfig, got {type(config).__name__}")
    return plan_layout(config)


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
    base = seg_stride = blocks = None
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
        ss = 0 if g.segment_dim is None else t.stride(g.segment_dim) * g.itemsize
        want = g.strides_for(ss)
        if tuple(t.stride()) != want:
            raise LayoutError(f"{what}: strides {tuple(t.stride())} do not match the config's "
                              f"layout {want} (layout {lp.spec!r})")
        b = t.data_ptr() - g.offset_bytes
        n = t.shape[g.block_dim] // per
        if base is None:
            base, seg_stride, blocks = b, ss, n
        elif (b, n) != (base, blocks):
            raise LayoutError(f"{what}: the state tensors do not lie in one page-strided "
                              f"buffer of the same block count")
    assert base is not None and seg_stride is not None and blocks is not None
    if lp.views[0].segment_dim is not None:
        half = _segment_bytes_per_block(lp)
        if seg_stride < blocks * half:
            raise LayoutError(f"layer {name!r}: K and V are {seg_stride} bytes apart, less "
                              f"than the {blocks * half} bytes of {blocks} blocks: they overlap")
    return _LayerMatch(tensors, base, seg_stride, blocks)


def _segment_bytes_per_block(lp: LayerPlan) -> int:
    return lp.regions[0].block_stride


def _match_all(kv_caches: KVCaches, num_blocks: int, plan: LayoutPlan
               ) -> dict[str, _LayerMatch]:
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    missing = [n for n in plan.layers if n not in kv_caches]
    extra = [n for n in kv_caches if n not in plan.layers]
    if missing or extra:
        raise LayoutError(f"kv_caches do not match the config: missing layers {missing}, "
                          f"layers not in the config {extra}")
    out = {n: _match_layer(lp, kv_caches[n]) for n, lp in plan.layers.items()}
    tensor_base: dict[int, tuple[str, int, int]] = {}
    for n, m in out.items():
        lp = plan.layers[n]
        if num_blocks > m.blocks:
            raise LayoutError(f"layer {n!r} holds {m.blocks} blocks, fewer than num_blocks "
                              f"{num_blocks}")
        seen = tensor_base.setdefault(lp.tensor_index, (n, m.base, m.segment_stride))
        if seen[1:] != (m.base, m.segment_stride):
            raise LayoutError(f"layers {seen[0]!r} and {n!r} share KV tensor {lp.tensor_index} "
                              f"in the config, but their tensors start at different addresses "
                              f"({seen[1]:#x} vs {m.base:#x})")
    return out


def _rebuild(lp: LayerPlan, m: _LayerMatch, storage: torch.UntypedStorage, num_blocks: int
             ) -> torch.Tensor | list[torch.Tensor]:
    views = []
    for t, g in zip(m.tensors, lp.views, strict=True):
        out = torch.empty(0, dtype=g.dtype, device=t.device)
        out.set_(storage, g.offset_bytes // g.itemsize, g.shape_for(num_blocks),
                 g.strides_for(m.segment_stride))
        views.append(out)
    return views if lp.is_list else views[0]


def _tensor_extent(plan: LayoutPlan, tensor_index: int, m: _LayerMatch, num_blocks: int) -> int:
    """Bytes from the KV tensor's base that ``num_blocks`` committed blocks cover."""
    tp = plan.tensors[tensor_index]
    used = num_blocks * tp.segment_bytes_per_block
    return (tp.num_segments - 1) * m.segment_stride + used


# -- public helpers ------------------------------------------------------------------------
def bound_packed_storage(kv_caches: KVCaches, num_blocks: int,
                         kv_cache_config: KVCacheConfig | LayoutPlan) -> torch.UntypedStorage:
    """The packed layout's single storage bounded to ``num_blocks * block_stride`` bytes
    from row 0 (``nbytes() // num_blocks == block_stride``). Raises unless the config is
    packed and every layer's view lies in the same packed rows."""
    plan = _as_plan(kv_cache_config)
    if not plan.packed:
        raise LayoutError(f"bound_packed_storage needs the packed layout, the config is "
                          f"{plan.config.layout!r}")
    matches = _match_all(kv_caches, num_blocks, plan)
    first = next(iter(matches.values()))
    return _bounded_storage(first.base, num_blocks * plan.block_stride, first.tensors[0])


def narrow_kv_caches_to_num_blocks(
    kv_caches: KVCaches, num_blocks: int, kv_cache_config: KVCacheConfig | LayoutPlan,
) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Narrow every layer to its first ``num_blocks`` logical blocks AND bound its storage.

    Each result has the input's dtype, strides and data pointer, with the block dimension
    cut to ``num_blocks * k`` kernel blocks. Its ``untyped_storage()`` starts at the layer's
    KV tensor and ends at the last committed byte: for single-segment layouts (blocks-first,
    MLA, Mamba, hybrid) exactly ``num_blocks * bytes_per_block`` bytes; for packed layouts the
    one shared storage of ``num_blocks * block_stride`` bytes (all layers share it); for
    K/V-split layouts the span from K's first byte to V's last committed byte (``view[0]`` and
    ``view[1]`` land on the two committed prefixes; the bytes between belong to no element).
    Layers sharing a KV tensor share one storage. ``kv_cache_config`` is required: it is what
    says where the block dimension is and how pages are packed.
    """
    plan = _as_plan(kv_cache_config)
    matches = _match_all(kv_caches, num_blocks, plan)
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    if plan.packed:
        storage = bound_packed_storage(kv_caches, num_blocks, plan)
        for n, lp in plan.layers.items():
            out[n] = _rebuild(lp, matches[n], storage, num_blocks)
        return out
    storages: dict[int, torch.UntypedStorage] = {}
    for n, lp in plan.layers.items():
        m = matches[n]
        st = storages.get(lp.tensor_index)
        if st is None:
            st = _bounded_storage(m.base, _tensor_extent(plan, lp.tensor_index, m, num_blocks),
                                  m.tensors[0])
            storages[lp.tensor_index] = st
        out[n] = _rebuild(lp, m, st, num_blocks)
    return out


def committed_regions(kv_caches: KVCaches, num_blocks: int,
                      kv_cache_config: KVCacheConfig | LayoutPlan) -> list[CommittedRegion]:
    """The regions a connector should register for the first ``num_blocks`` blocks.

    K and V separately for K/V-split layouts (parts "k"/"v", segments 0/1), one "kv" region
    for block-major attention, one "latent" region for MLA, one "state" region for a Mamba
    layer (``block_len`` = the sum of its states' bytes per block, ``block_stride`` = its page)
    and, for the packed layout, ONE "packed" region over the whole storage (``block_len ==
    block_stride``, ``layers`` = every layer in row order). Layers listed together in one
    KV tensor's ``shared_by`` alias the same pages by design (hybrid models).
    """
    plan = _as_plan(kv_cache_config)
    matches = _match_all(kv_caches, num_blocks, plan)
    if plan.packed:
        m = next(iter(matches.values()))
        rg = plan.packed_region()
        return [CommittedRegion("packed", "packed", m.base, rg.block_len, rg.block_stride,
                                num_blocks, str(m.tensors[0].device), 0, 0,
                                tuple(plan.layers), 0)]
    out = []
    for n, lp in plan.layers.items():
        m = matches[n]
        for rg in lp.regions:
            out.append(CommittedRegion(
                n, rg.part, m.base + rg.segment * m.segment_stride + rg.offset, rg.block_len,
                rg.block_stride, num_blocks, str(m.tensors[0].device), lp.tensor_index,
                rg.segment, (n,), rg.offset))
    return out
