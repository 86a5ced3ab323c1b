"""Where each committed region's page of a logical block sits, in a CPU row or a transfer.

Layers that share pages (hybrid attention + Mamba layers on one KV tensor) are stored once:
:func:`kvconnect.views.page_holders` (the one page-sharing rule) says which region holds each
region's bytes, and :func:`offload_row_layout` lays the holders side by side in one CPU row
(the CPU offload pool's row).

Units: bytes, logical blocks for ``num_blocks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvconnect.views import CommittedRegion, page_holders

__all__ = ["RowSlice", "offload_row_layout"]


@dataclass(frozen=True)
class RowSlice:
    """Where one committed region's page of a logical block sits inside a CPU row (bytes).

    ``sub_blocks`` kernel blocks of ``block_len`` bytes, ``block_stride`` apart, form one
    logical block of the region; they occupy ``[column, column + width)`` of the CPU row.
    ``members`` names every ``layer/part`` whose bytes the slice covers (several when layers
    share a KV tensor, as attention and Mamba layers do in hybrid models).
    """

    layer_name: str
    part: str
    tensor_index: int
    segment: int
    block_len: int
    block_stride: int
    sub_blocks: int
    column: int
    members: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """Bytes of this region per logical block: ``sub_blocks * block_len``."""
        return self.sub_blocks * self.block_len

    @property
    def signature(self) -> tuple[object, ...]:
        """What must stay the same for saved rows to remain loadable."""
        return (self.members, self.block_len, self.sub_blocks)


def offload_row_layout(
    regions: Sequence[CommittedRegion], num_blocks: int
) -> tuple[list[RowSlice], list[CommittedRegion]]:
    """The CPU row layout for ``regions`` of a cache with ``num_blocks`` logical blocks.

    Returns the row slices and the region each one reads (same order): one per region that
    holds its own pages (:func:`kvconnect.views.page_holders`), whose ``members`` name every
    region whose bytes it holds. The row size (``bytes_per_block``) is the sum of the slices'
    widths. A region with ``k * num_blocks`` blocks (kernel block = logical block / k) gives
    ``sub_blocks = k``. Raises ``ValueError`` for an empty region list, blocks that overlap,
    or a block count that is not a multiple of ``num_blocks``.
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if not regions:
        raise ValueError("the cache reports no committed regions: nothing to offload")
    for r in regions:
        if r.block_len <= 0 or r.block_stride < r.block_len:
            raise ValueError(
                f"region {r.layer_name}/{r.part}: block_len {r.block_len} and block_stride "
                f"{r.block_stride} bytes do not describe disjoint blocks"
            )
        if r.num_blocks <= 0 or r.num_blocks % num_blocks:
            raise ValueError(
                f"region {r.layer_name}/{r.part} has {r.num_blocks} committed blocks, not a "
                f"multiple of the cache's {num_blocks} logical blocks"
            )
    slices: list[RowSlice] = []
    kept: list[CommittedRegion] = []
    column = 0
    for r, members in page_holders(regions):
        sub = r.num_blocks // num_blocks
        slices.append(RowSlice(r.layer_name, r.part, r.tensor_index, r.segment, r.block_len,
                               r.block_stride, sub, column, members))
        kept.append(r)
        column += sub * r.block_len
    return slices, kept
