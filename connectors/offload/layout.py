"""Where each committed region's page of a logical block sits in a CPU row.

The row is derived from the cache's :class:`~kvconnect.peer_layout.PeerLayout`: the regions
that hold their own pages (:meth:`~kvconnect.peer_layout.PeerLayout.holders`, the one
page-sharing rule) lie side by side in one CPU row (the CPU offload pool's row), each
covering the bytes of every region it holds, so shared pages are stored once.

Units: bytes, logical blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnect.peer_layout import LayoutRegion, PeerLayout

__all__ = ["RowSlice", "offload_row_layout"]


@dataclass(frozen=True)
class RowSlice:
    """Where one holder region's page of a logical block sits inside a CPU row (bytes).

    ``region`` (``layout.regions[index]``) is ``sub_blocks`` kernel blocks of ``block_len``
    bytes, ``block_stride`` apart, per logical block; they occupy ``[column, column + width)``
    of the CPU row. ``members`` names every ``layer/part`` whose bytes the slice covers
    (several when layers share a KV tensor, as attention and Mamba layers do in hybrid
    models).
    """

    index: int
    region: LayoutRegion
    column: int
    members: tuple[str, ...]

    @property
    def width(self) -> int:
        """Bytes of this region per logical block: ``sub_blocks * block_len``."""
        return self.region.bytes_per_block


def offload_row_layout(layout: PeerLayout) -> list[RowSlice]:
    """The CPU row of ``layout``: one slice per region that holds its own pages, in order,
    side by side from column 0. The row size (``bytes_per_block``) is the sum of the slices'
    widths; ``slice.index`` is the region's index in ``layout`` (and in the committed
    regions it was built from)."""
    slices: list[RowSlice] = []
    column = 0
    for i, r, members in layout.holders():
        slices.append(RowSlice(i, r, column, members))
        column += r.bytes_per_block
    return slices
