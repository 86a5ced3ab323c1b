"""Pieces of batched block copies between KV regions and a CPU pool.

Vocabulary (units in bytes unless named otherwise):

- A *block-row view* of a region is a tensor of shape ``(num_blocks, sub_blocks,
  block_len // word)`` and strides ``(sub_blocks * block_stride, block_stride, 1) / word``
  laid over a **bounded** flat view of the region (a view whose storage covers only
  committed memory), so one ``index_select`` / ``index_copy_`` over dimension 0 moves any set
  of blocks of the region. ``sub_blocks`` > 1 when a logical block is split into kernel blocks.
- A *word* is the element size used to move bytes (:func:`word_size`): index ops cost per
  element, so 8-byte words beat bytes.
- A *run* is a stretch of a batch whose pool slots are consecutive: one contiguous copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvconnect.views import block_span

__all__ = [
    "WORD_DTYPES",
    "block_row_view",
    "contiguous_runs",
    "word_size",
]

#: element types used to move bytes, by size: wider words mean fewer elements per index op
#: (torch's CPU ``index_copy_`` is ~8x faster on int64 than on uint8)
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(*byte_values: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every value (sizes, offsets, addresses)."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in byte_values):
            return w
    return 1


def block_row_view(
    flat: torch.Tensor,
    *,
    num_blocks: int,
    block_len: int,
    block_stride: int,
    sub_blocks: int = 1,
    offset: int = 0,
    word: int = 1,
) -> torch.Tensor:
    """A ``(num_blocks, sub_blocks, block_len // word)`` view over ``flat`` from byte ``offset``.

    Arguments are bytes. ``word`` (1, 2, 4 or 8) is the element size of the view
    (:data:`WORD_DTYPES`); it must divide ``block_len``, ``block_stride``, ``offset``, the
    address and the size of ``flat``. ``flat`` must be a 1-D contiguous uint8 tensor covering
    every byte of the view; raises ``ValueError`` otherwise (the view never reaches past
    ``flat``'s end, so it never reaches past the memory that ``flat`` is bounded to).
    """
    if flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"block_row_view needs a 1-D contiguous uint8 tensor, got dtype={flat.dtype} "
            f"shape={tuple(flat.shape)}"
        )
    if num_blocks <= 0 or block_len <= 0 or sub_blocks <= 0:
        raise ValueError(
            f"num_blocks ({num_blocks}), block_len ({block_len}) and sub_blocks ({sub_blocks}) "
            "must be positive"
        )
    if block_stride < block_len:
        raise ValueError(
            f"block_stride ({block_stride} bytes) is smaller than block_len ({block_len} bytes): "
            "blocks would overlap"
        )
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    span = block_span(num_blocks * sub_blocks, block_stride, block_len)
    if offset + span > flat.numel():
        raise ValueError(
            f"{num_blocks} blocks x {sub_blocks} of {block_len} bytes at stride {block_stride} "
            f"from offset {offset} need {offset + span} bytes, but the bounded view holds only "
            f"{flat.numel()} bytes"
        )
    if word not in WORD_DTYPES:
        raise ValueError(f"word must be one of {sorted(WORD_DTYPES)} bytes, got {word}")
    if word_size(block_len, block_stride, offset, flat.data_ptr(), flat.numel()) < word:
        raise ValueError(
            f"a {word}-byte word does not divide block_len {block_len}, block_stride "
            f"{block_stride}, offset {offset}, the address {flat.data_ptr():#x} and the size "
            f"{flat.numel()} of the view"
        )
    words = flat.view(WORD_DTYPES[word]) if word > 1 else flat
    return words.as_strided(
        (num_blocks, sub_blocks, block_len // word),
        (sub_blocks * block_stride // word, block_stride // word, 1),
        words.storage_offset() + offset // word,
    )


def contiguous_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a batch into runs of consecutive slots.

    Returns ``(batch_position, first_slot, length)`` triples: batch entries
    ``[batch_position, batch_position + length)`` go to slots ``[first_slot, first_slot +
    length)``. An empty batch gives an empty list.
    """
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((start, int(slots[start]), i - start))
            start = i
    return runs
