"""How many KV blocks to commit: pure functions, plus one CUDA measurement helper.

Two modes, as in the extensible KV cache seeds:

- **utilization** (two passes): after warm-up (CUDA graphs, worst-case activations, NCCL
  buffers) measure the non-KV memory in use, then commit
  ``(total * utilization - non_kv) // bytes_per_block`` blocks (less the granule rounding
  of every segment's commit, when segment sizes are given);
- **kv_cache_memory_bytes** (one pass): commit that many bytes of blocks as-is, whatever
  warm-up measured.

Units: bytes, except ``*_blocks`` and ``utilization`` (a fraction in (0, 1]).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .checks import checked_int, round_up
from .errors import KvconnectError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "InsufficientMemoryError", "KVSizing", "blocks_for_kv_cache_memory_bytes",
    "blocks_for_utilization", "committed_bytes_for_blocks", "measure_non_kv_memory_bytes",
]


class InsufficientMemoryError(KvconnectError, ValueError):
    """Not even one KV block fits; ``missing_bytes`` says how much more memory is needed."""

    def __init__(self, message: str, missing_bytes: int) -> None:
        super().__init__(message)
        self.missing_bytes = missing_bytes


@dataclass(frozen=True)
class KVSizing:
    """The outcome of a sizing pass."""

    #: blocks to commit (pass to ``extend_kv_cache``)
    num_blocks: int
    #: bytes the KV cache may use
    budget_bytes: int
    #: bytes the commit maps (granule-rounded per segment when segment sizes were given)
    committed_bytes: int
    #: "utilization" or "kv_cache_memory_bytes"
    mode: str
    #: True when ``num_blocks`` was cut down to the reservation's capacity
    capped: bool = False


def _fmt(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes} bytes ({nbytes / 2**30:.2f} GiB)"
    if nbytes >= 2**20:
        return f"{nbytes} bytes ({nbytes / 2**20:.1f} MiB)"
    return f"{nbytes} bytes"


def committed_bytes_for_blocks(num_blocks: int, segment_bytes_per_block: Sequence[int],
                               granule: int = 1) -> int:
    """Bytes mapped when every segment commits ``num_blocks`` blocks, each segment rounded up
    to ``granule`` (``ExtensibleKVCache.segment_bytes_per_block`` and ``.granule``)."""
    checked_int("num_blocks", num_blocks, minimum=0)
    checked_int("granule", granule)
    return sum(round_up(num_blocks * checked_int("segment bytes per block", s), granule)
               for s in segment_bytes_per_block)


def _fit(budget: int, bytes_per_block: int, segments: Sequence[int] | None, granule: int,
         capacity_blocks: int | None, what: str, mode: str) -> KVSizing:
    if segments is None:  # no segments given: blocks of bytes_per_block, nothing rounded
        segments, granule = (bytes_per_block,), 1
    elif sum(segments) != bytes_per_block:
        raise ValueError(f"segment_bytes_per_block sums to {sum(segments)}, not "
                         f"bytes_per_block {bytes_per_block}")
    need_one = committed_bytes_for_blocks(1, segments, granule)
    if budget < need_one:
        missing = need_one - max(budget, 0)
        raise InsufficientMemoryError(
            f"{what} leaves {budget} bytes for the KV cache, not enough for one block "
            f"({need_one} bytes committed): {_fmt(missing)} missing", missing)
    # Each segment's commit rounds up to the granule (under one granule of overshoot per
    # segment): binary-search the largest n whose mapped bytes fit; 1 fits (checked).
    hi = budget // bytes_per_block
    lo = min(max(1, (budget - len(segments) * granule) // bytes_per_block), hi)
    while committed_bytes_for_blocks(lo, segments, granule) > budget:
        lo = max(1, lo // 2)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if committed_bytes_for_blocks(mid, segments, granule) <= budget:
            lo = mid
        else:
            hi = mid - 1
    n = lo
    capped = False
    if capacity_blocks is not None and n > checked_int("capacity_blocks", capacity_blocks):
        warnings.warn(f"the memory budget fits {n} KV blocks but the reservation holds "
                      f"{capacity_blocks}; committing {capacity_blocks} (reserve more to use "
                      f"the rest)", stacklevel=3)
        n, capped = capacity_blocks, True
    return KVSizing(n, budget, committed_bytes_for_blocks(n, segments, granule), mode, capped)


def blocks_for_utilization(total_memory_bytes: int, utilization: float,
                           non_kv_memory_bytes: int, bytes_per_block: int, *,
                           segment_bytes_per_block: Sequence[int] | None = None,
                           granule: int = 1, capacity_blocks: int | None = None) -> KVSizing:
    """Second-pass sizing: blocks that fit in ``total * utilization - non_kv`` bytes.

    ``non_kv_memory_bytes`` is what the process uses besides the KV cache after warm-up
    (:func:`measure_non_kv_memory_bytes`). Given ``segment_bytes_per_block`` and
    ``granule``, the granule rounding of each segment's commit counts against the budget.
    More blocks than ``capacity_blocks`` are capped (with a warning).
    Raises ValueError for a utilization outside (0, 1] and
    :class:`InsufficientMemoryError` (saying how many bytes are missing) when no block fits.
    """
    total = checked_int("total_memory_bytes", total_memory_bytes)
    if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not (
            0.0 < float(utilization) <= 1.0):
        raise ValueError(f"utilization must be a fraction in (0, 1], got {utilization!r}")
    non_kv = checked_int("non_kv_memory_bytes", non_kv_memory_bytes, minimum=0)
    bpb = checked_int("bytes_per_block", bytes_per_block)
    usable = int(total * float(utilization))
    budget = usable - non_kv
    what = (f"utilization {utilization} of {total} bytes ({usable} usable) minus "
            f"{non_kv} non-KV bytes")
    return _fit(budget, bpb, segment_bytes_per_block, granule, capacity_blocks, what,
                "utilization")


def blocks_for_kv_cache_memory_bytes(kv_cache_memory_bytes: int, bytes_per_block: int, *,
                                     segment_bytes_per_block: Sequence[int] | None = None,
                                     granule: int = 1,
                                     capacity_blocks: int | None = None) -> KVSizing:
    """One-pass sizing: the blocks that ``kv_cache_memory_bytes`` holds, committed as-is
    (no warm-up measurement adjusts it). Granule rounding counts when segments are given."""
    budget = checked_int("kv_cache_memory_bytes", kv_cache_memory_bytes, minimum=0)
    bpb = checked_int("bytes_per_block", bytes_per_block)
    return _fit(budget, bpb, segment_bytes_per_block, granule, capacity_blocks,
                f"kv_cache_memory_bytes={budget}", "kv_cache_memory_bytes")


def measure_non_kv_memory_bytes(device: str | int | torch.device = "cuda:0",
                                kv_committed_bytes: int = 0) -> int:
    """CUDA: device memory in use now (``total - free`` from ``torch.cuda.mem_get_info``,
    every process on the device) minus the KV cache's committed bytes. Call after warm-up
    (graphs captured, worst-case activations run) and pass
    ``ExtensibleKVCache.committed_bytes``."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("measure_non_kv_memory_bytes needs a CUDA device (none is visible)")
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type != "cuda":
        raise ValueError(f"measure_non_kv_memory_bytes measures CUDA memory, got {dev}")
    kv = checked_int("kv_committed_bytes", kv_committed_bytes, minimum=0)
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    used = total - free
    if kv > used:
        raise ValueError(f"kv_committed_bytes {kv} exceeds the {used} bytes in use on {dev}: "
                         f"pass the KV cache's committed bytes on this device")
    non_kv = used - kv
    logger.info("non-KV memory on %s: %d bytes (%d in use, %d KV)", dev, non_kv, used, kv)
    return non_kv
