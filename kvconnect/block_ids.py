"""Block ids (logical blocks): the one type the public API accepts (:data:`BlockIds`) and its
one conversion (:func:`as_block_ids`) where ids enter (a transport's ``fetch``, a copy plan's
``copy``, the offload connector's ``save``/``load``); below that edge functions take the 1-D
int64 ``np.ndarray`` it returns. Torch-free: a tensor is recognised once torch is imported.
"""

from __future__ import annotations

import operator
import struct
import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from .errors import KvconnectError

if TYPE_CHECKING:
    import torch

__all__ = ["BlockIds", "BlockIdsError", "as_block_ids", "merged_block_ids"]

#: block ids as callers may pass them: ints in any iterable (a list, a tuple, a range), a 1-D
#: integer numpy array or a 1-D integer torch tensor (any device)
BlockIds: TypeAlias = "Iterable[int] | np.ndarray | torch.Tensor"

#: id lists up to this long are checked in Python (numpy's per-call cost is more)
_SMALL_ID_LIST = 32


class BlockIdsError(KvconnectError, TypeError, ValueError):
    """Block ids that are not a 1-D collection of non-negative ints. Both a ``TypeError``
    (wrong kind, dimensions or element) and a ``ValueError`` (a negative id), so callers
    catching either keep working."""


def as_block_ids(values: BlockIds, what: str = "block ids", *,
                 allow_negative: bool = False) -> np.ndarray:
    """``values`` as a 1-D int64 array (``values`` itself when it is one: converting again
    below the edge costs nothing). :class:`BlockIdsError` naming ``what`` for non-integers
    (bools, floats, ...), an array or tensor that is not 1-D integer, and negative ids unless
    ``allow_negative`` (the caller's range check names the valid range). Upper bounds are the
    caller's to check (they depend on the region)."""
    out = _convert(values, what)
    if not allow_negative and out.size:
        low = min(out.tolist()) if out.size <= _SMALL_ID_LIST else int(out.min())
        if low < 0:
            raise BlockIdsError(f"{what} must be non-negative, got {low}")
    return out


def merged_block_ids(requests: Sequence[tuple[BlockIds, BlockIds]],
                     names: tuple[str, str] = ("src_ids", "dst_ids"), *,
                     allow_negative: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Several ``(ids, ids)`` requests as two 1-D int64 arrays, concatenated in request order
    (:func:`as_block_ids` of each side, named by ``names``); ``ValueError`` when a request's
    sides differ in length."""
    firsts, seconds = [], []
    for i, (x, y) in enumerate(requests):
        a = as_block_ids(x, names[0], allow_negative=allow_negative)
        b = as_block_ids(y, names[1], allow_negative=allow_negative)
        if a.size != b.size:
            one, two = (n.replace("_", " ") for n in names)
            raise ValueError(f"request {i}: {a.size} {one} but {b.size} {two}")
        firsts.append(a)
        seconds.append(b)
    if len(firsts) == 1:
        return firsts[0], seconds[0]
    empty = np.zeros(0, dtype=np.int64)
    return (np.concatenate(firsts) if firsts else empty,
            np.concatenate(seconds) if seconds else empty)


def _convert(values: BlockIds, what: str) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise BlockIdsError(f"{what} must be a 1-D integer array, got {values.dtype} of "
                                f"shape {values.shape}")
        return values.astype(np.int64, copy=False)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values, torch.Tensor):
        if (values.dim() != 1 or values.is_floating_point() or values.is_complex()
                or values.dtype == torch.bool):
            raise BlockIdsError(f"{what} must be a 1-D integer tensor, got {values.dtype} of "
                                f"shape {tuple(values.shape)}")
        return values.detach().cpu().numpy().astype(np.int64, copy=False)
    if isinstance(values, (list, tuple)):
        if not values:
            return np.zeros(0, dtype=np.int64)
        try:  # ints: the fastest conversion (no per-element Python code; ~2x array.array)
            fast = np.empty(len(values), dtype=np.int64)  # writable (torch.from_numpy)
            struct.pack_into(f"{len(values)}q", fast.data, 0, *values)
        except (struct.error, TypeError, OverflowError):
            pass  # a float, a huge value, ...: the checks below name it
        else:
            _refuse_bools(values, fast, what)
            return fast
    out = []
    for v in values:
        if isinstance(v, bool):
            raise BlockIdsError(f"{what} must hold ints, got a bool ({v})")
        try:
            out.append(operator.index(v))
        except TypeError:
            raise BlockIdsError(f"{what} must hold ints, got {type(v).__name__} {v!r}") from None
    return np.asarray(out, dtype=np.int64)


def _refuse_bools(values: list[int] | tuple[int, ...], packed: np.ndarray, what: str) -> None:
    """:class:`BlockIdsError` if ``values`` (just packed into ``packed``) holds a bool: struct
    takes True as 1, so only the 0s and 1s can be bools; look at those alone."""
    if len(values) <= _SMALL_ID_LIST:  # a decode fetch: a C-level scan, no numpy call
        if 0 not in values and 1 not in values:
            return
        suspects = range(len(values))
    else:
        suspects = np.flatnonzero(packed <= 1).tolist()
    for i in suspects:
        if isinstance(values[i], bool):
            raise BlockIdsError(f"{what} must hold ints, got a bool ({values[i]})")
