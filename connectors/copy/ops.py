"""Words: the element size batched block copies move bytes in (units: bytes).

Index ops and kernels cost per element, so 8-byte words beat bytes: a copy picks the widest
word (:func:`word_size`) that divides every length, stride, offset and address it touches
and views its bytes as that type (:data:`WORD_DTYPES`).
"""

from __future__ import annotations

import torch

__all__ = ["WORD_DTYPES", "word_size"]

#: element types used to move bytes, by size: wider words mean fewer elements per index op
#: (torch's CPU ``index_copy_`` is ~8x faster on int64 than on uint8)
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def word_size(*byte_values: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) dividing every value (sizes, offsets, addresses)."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in byte_values):
            return w
    return 1
