"""Planning: a config -> buffers of segments, and per layer its views and regions.

:func:`plan_layout` runs in two steps. :func:`validate_config` checks what every config
must satisfy (a known layout, positive sizes, each layer in one group and one tensor) and
returns the facts planning needs. Planning then turns the tensors into *layer slots*
(buffer, segment, offset, block stride) and asks the layout's page format
(:mod:`.formats`) for each layer's views and regions.

Both config forms go through the same slots: vLLM 0.33's placement form (one buffer; a
layer-outer layout gives every layer and plane its own segment, a block-outer layout one
segment of rows) and the seed's shorthand (one buffer per tensor, see :mod:`.config`).
Units: bytes unless a name says blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .formats import LayerSlot, PageFormat, page_format
from .geometry import LayerPlan, LayoutPlan, TensorPlan
from .specs import AttentionSpec, KVCacheSpec, LayoutError, MambaSpec, layout_int

if TYPE_CHECKING:  # the config calls the planner (bytes_per_block); types only here
    from .config import KVCacheConfig, KVCacheTensor

__all__ = ["ConfigFacts", "plan_layout", "validate_config"]


@dataclass(frozen=True)
class ConfigFacts:
    """What :func:`validate_config` established: the format, each layer's spec, whether
    Mamba layers make the model hybrid, and each layer's tensor."""

    fmt: PageFormat
    specs: dict[str, KVCacheSpec]
    hybrid: bool
    owner: dict[str, int]


# -- validation ------------------------------------------------------------------------------
def validate_config(config: KVCacheConfig) -> ConfigFacts:
    """Check the rules every config obeys, whatever its layout; :class:`LayoutError` names
    the group, tensor or layer at fault."""
    fmt = page_format(config.layout)
    layout_int("num_blocks", config.num_blocks)
    if config.kernel_block_size is not None:
        layout_int("kernel_block_size", config.kernel_block_size)
    if not config.kv_cache_groups:
        raise LayoutError("the config has no KV cache groups")
    specs: dict[str, KVCacheSpec] = {}
    for g in config.kv_cache_groups:
        if not isinstance(g.kv_cache_spec, KVCacheSpec):
            raise LayoutError(f"group spec {g.kv_cache_spec!r} is not a KVCacheSpec")
        layout_int("block_size", g.kv_cache_spec.block_size)
        for n in g.layer_names:
            if n in specs:
                raise LayoutError(f"layer {n!r} appears in more than one KV cache group")
            specs[n] = g.kv_cache_spec
    if not config.kv_cache_tensors:
        raise LayoutError("the config has no KV cache tensors")
    forms = {t.is_placement for t in config.kv_cache_tensors}
    if len(forms) != 1:
        raise LayoutError("the config mixes placement-form tensors (layer_stride / block_stride "
                          "given) with shorthand (size, layers) tensors; use one form")
    owner: dict[str, int] = {}
    for i, t in enumerate(config.kv_cache_tensors):
        layout_int(f"kv_cache_tensors[{i}].size", t.size)
        if t.host_resident:
            raise LayoutError(f"kv_cache_tensors[{i}] is host-resident (HiSparse host pool); "
                              f"kvconnect models device KV caches only")
        if not t.layers:
            raise LayoutError(f"kv_cache_tensors[{i}] is shared by no layer")
        for n in t.layers:
            if n not in specs:
                raise LayoutError(f"kv_cache_tensors[{i}] names layer {n!r}, which is in no "
                                  f"KV cache group")
            if n in owner:
                raise LayoutError(f"layer {n!r} is backed by kv_cache_tensors[{owner[n]}] and "
                                  f"[{i}]; a layer has exactly one KV tensor")
            owner[n] = i
        if t.is_placement:
            _validate_placement(i, t, config.kv_cache_tensors[0].size)
        elif t.size % config.num_blocks:
            raise LayoutError(f"kv_cache_tensors[{i}].size {t.size} is not a whole number of "
                              f"the config's {config.num_blocks} blocks")
    missing = [n for n in specs if n not in owner]
    if missing:
        raise LayoutError(f"layers {missing} have no KV cache tensor")
    return ConfigFacts(fmt, specs, any(isinstance(s, MambaSpec) for s in specs.values()), owner)


def _validate_placement(i: int, t: KVCacheTensor, buffer_size: int) -> None:
    layout_int(f"kv_cache_tensors[{i}].layer_stride", t.layer_stride)
    layout_int(f"kv_cache_tensors[{i}].block_stride", t.block_stride)
    if isinstance(t.offset, bool) or not isinstance(t.offset, int) or t.offset < 0:
        raise LayoutError(f"kv_cache_tensors[{i}].offset must be an int >= 0, got {t.offset!r}")
    if t.size != buffer_size:
        raise LayoutError(f"kv_cache_tensors[{i}].size {t.size} != {buffer_size}: placement-form "
                          f"tensors share ONE backing buffer, so every size is the buffer's")


def _kernel_split(spec: KVCacheSpec, kernel_block_size: int | None, layer: str) -> int:
    if kernel_block_size is None or isinstance(spec, MambaSpec):
        return 1
    if spec.block_size % kernel_block_size:
        raise LayoutError(f"layer {layer}: block_size {spec.block_size} is not a multiple of "
                          f"kernel_block_size {kernel_block_size}")
    return spec.block_size // kernel_block_size


# -- slots -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Slotted:
    """Planning's middle step: every layer's slot, the buffers and the blocks placed."""

    slots: dict[str, tuple[int, LayerSlot]]
    buffers: tuple[TensorPlan, ...]
    alloc_blocks: int


def _shorthand_slots(config: KVCacheConfig, facts: ConfigFacts) -> _Slotted:
    """The seed's shorthand: tensor ``i`` is buffer ``i`` of ``size / num_blocks`` bytes
    per block; its layers alias it, split into planes as the format says."""
    nb, fmt = config.num_blocks, facts.fmt
    if fmt.packed:
        return _packed_slots(config, facts)
    slots: dict[str, tuple[int, LayerSlot]] = {}
    buffers = []
    for i, t in enumerate(config.kv_cache_tensors):
        page = t.size // nb
        planes = set()
        for n in t.layers:
            spec = facts.specs[n]
            if spec.page_size_bytes != page:
                raise LayoutError(
                    f"config does not match its tensors: kv_cache_tensors[{i}] holds {page} "
                    f"bytes per block but layer {n!r} has a {spec.page_size_bytes}-byte page")
            p = fmt.planes(spec, facts.hybrid)
            planes.add(p)
            slots[n] = (i, LayerSlot(0, 0, page // p, page * nb, 1))
        if len(planes) != 1:
            raise LayoutError(f"kv_cache_tensors[{i}] is shared by layers needing different "
                              f"segment counts {sorted(planes)}; K/V-split and block-major "
                              f"layers cannot share one tensor")
        buffers.append(TensorPlan(i, t.layers, page, planes.pop()))
    return _Slotted(slots, tuple(buffers), nb)


def _packed_slots(config: KVCacheConfig, facts: ConfigFacts) -> _Slotted:
    """The seed's packed shorthand: ONE tensor, one row per block, pages in layer order
    (each split into ``k`` kernel rows)."""
    if facts.hybrid:
        raise LayoutError("the packed layout holds attention pages only; a model with Mamba "
                          "layers cannot use it (use its default block-major layout)")
    if len(config.kv_cache_tensors) != 1:
        raise LayoutError(f"the packed layout is ONE tensor shared by every layer; the config "
                          f"has {len(config.kv_cache_tensors)} KV cache tensors")
    t = config.kv_cache_tensors[0]
    row = t.size // config.num_blocks
    pages = [facts.specs[n].page_size_bytes for n in t.layers]
    if sum(pages) != row:
        raise LayoutError(
            f"packed rows must hold exactly one logical block: bytes per block of the packed "
            f"tensor ({t.size} / {config.num_blocks} blocks = {row}) != block_stride, "
            f"the sum of the {len(pages)} layers' pages ({sum(pages)} bytes)")
    splits = {_kernel_split(facts.specs[n], config.kernel_block_size, n) for n in t.layers}
    if len(splits) != 1:
        raise LayoutError(f"packed layers must share one kernel split, got {sorted(splits)} "
                          f"(use one block size for every layer)")
    k = splits.pop()
    if row % k or any(p % k for p in pages):
        raise LayoutError(f"packed row of {row} bytes does not split into {k} kernel rows")
    slots, offset = {}, 0
    for n, page in zip(t.layers, pages, strict=True):
        slots[n] = (0, LayerSlot(0, offset, row, page, len(t.layers)))
        offset += page // k
    return _Slotted(slots, (TensorPlan(0, t.layers, row, 1),), config.num_blocks)


def _placement_strides(t: KVCacheTensor, index: int) -> tuple[int, int]:
    """``(layer_stride, block_stride)`` of a placement tensor, bytes (KVCacheTensor sets both
    or neither)."""
    if t.layer_stride is None or t.block_stride is None:
        raise LayoutError(f"kv_cache_tensors[{index}] has no layer_stride/block_stride; a "
                          f"placement config gives both for every tensor")
    return t.layer_stride, t.block_stride


def _placement_slots(config: KVCacheConfig, facts: ConfigFacts) -> _Slotted:
    """vLLM 0.33's placement form: one buffer. Layer-outer: every (layer, plane) is a
    segment of ``segment_stride = layer_stride / planes`` bytes; block-outer: one segment
    of ``block_stride``-byte rows."""
    fmt, tensors = facts.fmt, config.kv_cache_tensors
    size = tensors[0].size
    layer_strides = [_placement_strides(t, i)[0] for i, t in enumerate(tensors)]
    strides = {_placement_strides(t, i)[1] for i, t in enumerate(tensors)}
    if len(strides) != 1:
        raise LayoutError(f"placement tensors have block strides {sorted(strides)}; one "
                          f"buffer of equal block-prefix segments needs one block stride (vLLM "
                          f"places mixed page sizes only in block-outer layouts such as BLHNC)")
    bs = strides.pop()
    slots: dict[str, tuple[int, LayerSlot]] = {}
    if not fmt.layer_outer:
        if size % bs:
            raise LayoutError(f"buffer of {size} bytes is not a whole number of {bs}-byte rows")
        for t, ls in zip(tensors, layer_strides, strict=True):
            for j, n in enumerate(t.layers):
                slots[n] = (0, LayerSlot(0, t.offset + j * ls, bs, ls, len(t.layers)))
        return _Slotted(slots, (TensorPlan(0, tuple(facts.owner), bs, 1),), size // bs)
    seg_strides = set()
    for i, (t, ls) in enumerate(zip(tensors, layer_strides, strict=True)):
        planes = {fmt.planes(facts.specs[n], facts.hybrid) for n in t.layers}
        if len(planes) != 1:
            raise LayoutError(f"kv_cache_tensors[{i}] places layers with different plane "
                              f"counts {sorted(planes)}; one tensor holds same-shaped layers")
        p = planes.pop()
        if ls % p:
            raise LayoutError(f"kv_cache_tensors[{i}].layer_stride {ls} does not "
                              f"split into {p} planes")
        seg_strides.add(ls // p)
    if len(seg_strides) != 1:
        raise LayoutError(f"layer-outer tensors have segment strides {sorted(seg_strides)}; "
                          f"an extensible buffer needs equal segments (use one page size, or a "
                          f"block-outer layout)")
    ss = seg_strides.pop()
    if ss % bs or size % ss:
        raise LayoutError(f"layer-outer placement: segment stride {ss} is not a whole number of "
                          f"{bs}-byte blocks, or the {size}-byte buffer not of segments")
    num_segments = size // ss
    for i, (t, ls) in enumerate(zip(tensors, layer_strides, strict=True)):
        if t.offset % ss:
            raise LayoutError(f"kv_cache_tensors[{i}].offset {t.offset} is not at a segment "
                              f"start (a multiple of {ss} bytes)")
        p = fmt.planes(facts.specs[t.layers[0]], facts.hybrid)
        for j, n in enumerate(t.layers):
            first = t.offset // ss + j * p
            if first + p > num_segments:
                raise LayoutError(f"layer {n!r} lies past the end of the {size}-byte buffer")
            slots[n] = (0, LayerSlot(first, 0, bs, ls, len(t.layers)))
    return _Slotted(slots, (TensorPlan(0, tuple(facts.owner), num_segments * bs, num_segments),),
                    ss // bs)


# -- the plan --------------------------------------------------------------------------------
def plan_layout(config: KVCacheConfig) -> LayoutPlan:
    """Validate ``config`` and derive its physical plan. Raises :class:`LayoutError`
    naming the layer/tensor and the reason when the config cannot be laid out."""
    facts = validate_config(config)
    slotted = (_placement_slots if config.is_placement else _shorthand_slots)(config, facts)
    if slotted.alloc_blocks < config.num_blocks:
        raise LayoutError(f"the placement holds {slotted.alloc_blocks} blocks, fewer than the "
                          f"config's num_blocks {config.num_blocks}")
    layers: dict[str, LayerPlan] = {}
    for n in config.layer_names:
        buffer, slot = slotted.slots[n]
        spec = facts.specs[n]
        k = _kernel_split(spec, config.kernel_block_size, n)
        if isinstance(spec, AttentionSpec) and slot.block_stride * facts.fmt.planes(
                spec, facts.hybrid) < spec.real_page_size_bytes:
            raise LayoutError(f"layer {n!r}: a {spec.real_page_size_bytes}-byte page does not "
                              f"fit its {slot.block_stride}-byte block stride")
        layers[n] = facts.fmt.layer_plan(n, spec, k, slot, buffer, facts.hybrid)
    return LayoutPlan(config, slotted.buffers, layers, packed=facts.fmt.packed,
                      hybrid=facts.hybrid, block_outer=not facts.fmt.layer_outer,
                      alloc_blocks=slotted.alloc_blocks)
