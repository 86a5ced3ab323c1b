"""The plan's vocabulary: buffers of equal segments, per-layer views and regions.

A planned KV cache is one or more *buffers*. A buffer of ``num_segments`` equal segments
grows as block prefixes: every logical block adds ``segment_bytes_per_block`` bytes to
each segment (segment ``s`` starts ``s * segment_stride`` bytes into the buffer, and
``segment_stride`` depends on the allocation, not on the config). Layer-outer layouts
give every layer (or every K/V or head plane of a layer) its own segment; block-outer
layouts have one segment whose rows hold every layer's page.

Geometry is relative to segments so it holds for any allocation: a plain one of
``num_blocks`` blocks or a reservation of many times that (the extensible cache).
Units: bytes unless a name says blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .specs import KVCacheSpec, LayoutError, dtype_name, itemsize

if TYPE_CHECKING:
    from .config import KVCacheConfig

__all__ = ["LayerPlan", "LayoutPlan", "RegionGeometry", "TensorPlan", "ViewGeometry"]


@dataclass(frozen=True)
class ViewGeometry:
    """One torch tensor of a layer, over its buffer's bytes.

    The tensor has ``dtype``, shape ``shape_for(n)`` for ``n`` logical blocks, and element
    strides from ``strides_bytes`` (``None`` marks the segment dimension, whose stride is
    the distance between segments and so depends on the allocation). It starts
    ``offset_bytes`` after the start of segment ``first_segment``.
    """

    dtype: torch.dtype
    #: shape with the block dimension counted for ONE logical block (= kernel blocks per block)
    unit_shape: tuple[int, ...]
    strides_bytes: tuple[int | None, ...]
    offset_bytes: int
    block_dim: int
    #: the plane (K/V or head) dimension striding over segments, or None
    segment_dim: int | None = None
    first_segment: int = 0

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

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

    def start_bytes(self, segment_stride_bytes: int) -> int:
        """Bytes from the buffer's first byte to this view's first element."""
        return self.first_segment * segment_stride_bytes + self.offset_bytes

    def extent_in_segment(self) -> tuple[int, int]:
        """``(first, end)`` bytes, relative to the segment start, that one logical block of
        this view touches (one segment; the segment dimension held at one index)."""
        end = self.offset_bytes + self.itemsize
        for n, sb in self._in_segment_dims():
            end += (n - 1) * sb
        return self.offset_bytes, end

    def _in_segment_dims(self) -> list[tuple[int, int]]:
        """``(count, byte stride)`` of every dimension but the segment one (whose stride is
        the only ``None``)."""
        out = []
        for d, (n, sb) in enumerate(zip(self.unit_shape, self.strides_bytes, strict=True)):
            if d == self.segment_dim:
                continue
            if sb is None:
                raise LayoutError(f"dimension {d} has no byte stride but is not the segment "
                                  f"dimension ({self.segment_dim})")
            out.append((n, sb))
        return out

    def runs_in_segment(self, max_runs: int = 4096) -> list[tuple[int, int]]:
        """The contiguous byte runs ``(offset, length)`` of one logical block in one
        segment, in address order (coalescing dimensions whose strides abut)."""
        dims = sorted((sb, n) for n, sb in self._in_segment_dims() if n > 1)
        run = self.itemsize
        i = 0
        while i < len(dims) and dims[i][0] == run:
            run *= dims[i][1]
            i += 1
        starts = [self.offset_bytes]
        for stride, n in dims[i:]:
            starts = [s + j * stride for s in starts for j in range(n)]
            if len(starts) > max_runs:
                raise LayoutError(f"a block of this view splits into more than {max_runs} runs")
        return [(s, run) for s in sorted(starts)]


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
    """How one backing buffer is made: ``num_segments`` segments, each a block prefix of
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

    @property
    def segments(self) -> tuple[int, int]:
        """``(first, last)`` segment of its buffer that this layer's views touch."""
        first = min(v.first_segment for v in self.views)
        last = max(v.first_segment + (0 if v.segment_dim is None
                                      else v.unit_shape[v.segment_dim] - 1) for v in self.views)
        return first, last


@dataclass(frozen=True)
class LayoutPlan:
    """Everything kvconnect derives from a :class:`KVCacheConfig` (see
    :func:`kvconnect.layout.plan_layout`). ``tensors`` are the backing buffers."""

    config: KVCacheConfig
    tensors: tuple[TensorPlan, ...]
    layers: dict[str, LayerPlan] = field(hash=False)
    #: the seed's packed layout: ONE "packed" region over whole rows
    packed: bool = False
    hybrid: bool = False
    #: block-outer: one segment whose rows hold every layer's page (packed, BL*, BH*)
    block_outer: bool = False
    #: blocks the config's placement was made for (>= config.num_blocks)
    alloc_blocks: int = 0

    @property
    def bytes_per_block(self) -> int:
        return sum(t.bytes_per_block for t in self.tensors)

    @property
    def block_stride(self) -> int:
        """Block-outer layouts: bytes of one row (= one logical block of every layer)."""
        if not self.block_outer:
            raise LayoutError(f"block_stride is defined for block-outer layouts (packed, BL*, "
                              f"BH*), not {self.config.layout!r}")
        return self.tensors[0].bytes_per_block

    def packed_region(self) -> RegionGeometry:
        return RegionGeometry("packed", 0, 0, self.block_stride, self.block_stride)
