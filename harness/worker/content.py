"""Position-dependent block contents and per-block digests.

Every byte a prefill writes depends on (seed, prefill rank, layer, part, block id, offset):
a counter-based hash computed with torch integer ops on the cache's device (no per-byte
Python). A block that lands in the wrong slot, the wrong layer, the wrong K/V half or the
wrong offset therefore differs, unlike constant fills (nixlbench's 0xbb/0xaa).

Digests are BLAKE2b-128 over each (block, region) byte range: any flipped byte changes them.
When a digest differs, :func:`first_difference` regenerates the expected bytes and names the
first differing offset.

Regions come from the cache's :class:`~kvconnect.peer_layout.PeerLayout` (the one a prefill
publishes and a decode compares with its own by ``PeerLayout.differences``).
Layers that alias the same pages by design (hybrid attention + Mamba) give regions held by
another region; those are not filled or checked on their own (the holder holds their bytes):
only :func:`owners` are.

Units: bytes for lengths and offsets, blocks for block ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from kvconnect.peer_layout import LayoutRegion, PeerLayout

_M32 = 0xFFFFFFFF
#: bound on the int64 scratch of one fill batch (bytes of generated content)
_BATCH_BYTES = 32 * 1024 * 1024
PART_NAMES = {"k": "K", "v": "V", "kv": "K+V", "latent": "latent", "state": "state",
              "packed": "packed"}


def region_label(region: LayoutRegion) -> str:
    """``"layer <name> part <K|V|K+V|...>"``, as reports name a region."""
    return f"layer {region.layer_name} part {PART_NAMES.get(region.part, region.part)}"


def owners(layout: PeerLayout) -> list[LayoutRegion]:
    """The regions that hold their bytes themselves (:meth:`PeerLayout.holders`), in order."""
    return [r for _, r, _ in layout.holders()]


def paired_owners(local: PeerLayout, remote: PeerLayout
                  ) -> list[tuple[LayoutRegion, LayoutRegion, int]]:
    """``(local region, remote region, the remote's position in owners(remote))`` for each
    local owner, paired by ``layer/part``; the layouts must have no
    :meth:`~PeerLayout.differences` (``KeyError`` for a region the remote lacks)."""
    position = {r.key: j for j, r in enumerate(owners(remote))}
    return [(r, remote.region(r.key), position[r.key]) for r in owners(local)]


def rows_view(flat: torch.Tensor, region: LayoutRegion, num_blocks: int) -> torch.Tensor:
    """``(num_blocks, bytes_per_block)`` uint8 view (one row per logical block) over a
    bounded flat view of the region's span. A region split into kernel blocks must have them
    adjacent (``block_stride == block_len``)."""
    if region.sub_blocks > 1 and region.block_stride != region.block_len:
        raise ValueError(f"{region_label(region)}: {region.sub_blocks} kernel blocks per "
                         "block that are not adjacent cannot be one row")
    span = region.span(num_blocks)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < span:
        raise ValueError(f"{region_label(region)}: need a flat uint8 view of {span} bytes, got "
                         f"{flat.dtype} {tuple(flat.shape)}")
    return flat.as_strided((num_blocks, region.bytes_per_block), (region.logical_stride, 1),
                           flat.storage_offset())


def cache_rows(cache: Any, region: LayoutRegion) -> torch.Tensor:
    """The region's rows (its ``cache.num_blocks`` committed logical blocks) in ``cache``,
    bounded to committed memory by ``committed_view``; ``region`` from
    ``PeerLayout.from_cache(cache)``."""
    n = int(cache.num_blocks)
    if region.offset is None:
        raise ValueError(f"{region_label(region)}: a region without offset is not in a cache")
    t = cache.tensors[region.tensor_index]
    return rows_view(t.committed_view(region.offset, region.span(n)), region, n)


def content_key(seed: int, source: str, region: LayoutRegion) -> int:
    """32-bit key of one region's contents written by ``source`` (e.g. ``prefill0``)."""
    h = hashlib.blake2b(f"{seed}/{source}/{region.key}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2**32;
    every product stays below 2**63, so nothing overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def _pattern(key: int, block_ids: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, tag)`` int32 tensors: word ``w`` of block ``b`` is ``base[w] ^ tag[b]``."""
    device = block_ids.device
    base = _mix32(torch.arange(words, dtype=torch.int64, device=device) ^ (key & _M32))
    base = _mix32(base ^ ((key * 0x9E3779B1) & _M32))
    tag = _mix32((block_ids.to(torch.int64) & _M32) ^ ((key >> 7) & _M32))
    return _to_int32(base), _to_int32(tag)


def generate(key: int, block_ids: torch.Tensor, block_len: int) -> torch.Tensor:
    """Contents of blocks ``block_ids`` (int64 tensor, any device) of a region with ``key``:
    a ``(len(block_ids), block_len)`` uint8 tensor on the ids' device.

    Word ``w`` of block ``b`` is ``base[w] ^ tag[b]``: ``base`` is a hash of the word index
    and the key (so every offset inside a block differs), ``tag`` a bijective hash of the
    block id and the key (so distinct blocks differ in every word). One XOR per word.
    """
    words = -(-block_len // 4)
    base, tag = _pattern(key, block_ids, words)
    x = base[None, :] ^ tag[:, None]
    return x.contiguous().view(torch.uint8).view(block_ids.numel(), words * 4)[:, :block_len]


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) to int32 with the same low 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def fill(rows: torch.Tensor, key: int, block_ids: Sequence[int] | None = None) -> None:
    """Write the contents for ``key`` into ``rows`` (all blocks, or ``block_ids``).

    All blocks: the XOR writes straight into the rows when they are 4-byte aligned (one
    pass, no temporary). Chosen blocks: generated, then one ``index_copy_`` per batch.
    """
    n, block_len = rows.shape
    step = max(1, _BATCH_BYTES // (8 * max(block_len, 1)))
    if block_ids is None:
        direct = (block_len % 4 == 0 and rows.stride(0) % 4 == 0 and rows.stride(1) == 1
                  and rows.data_ptr() % 4 == 0)
        for i in range(0, n, step):
            ids = torch.arange(i, min(n, i + step), dtype=torch.int64, device=rows.device)
            target = rows[i:i + ids.numel()]
            if direct:
                base, tag = _pattern(key, ids, block_len // 4)
                torch.bitwise_xor(base[None, :], tag[:, None], out=target.view(torch.int32))
            else:
                target.copy_(generate(key, ids, block_len))
        return
    chosen = list(block_ids)
    for i in range(0, len(chosen), step):
        ids = torch.tensor(chosen[i:i + step], dtype=torch.int64, device=rows.device)
        rows.index_copy_(0, ids, generate(key, ids, block_len))


def digest_blocks(rows: torch.Tensor, block_ids: Sequence[int]) -> list[str]:
    """BLAKE2b-128 hex digest of each block's bytes, in ``block_ids`` order."""
    if not block_ids:
        return []
    ids = torch.tensor(list(block_ids), dtype=torch.int64, device=rows.device)
    data = rows.index_select(0, ids).cpu().numpy()
    return [hashlib.blake2b(row, digest_size=16).hexdigest() for row in data]


def first_difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[int, int, int] | None:
    """``(offset, expected_byte, actual_byte)`` of the first differing byte, or None."""
    a = actual.reshape(-1).cpu()
    e = expected.reshape(-1).cpu()
    diff = torch.nonzero(a != e)
    if diff.numel() == 0:
        return None
    off = int(diff[0, 0])
    return off, int(e[off]), int(a[off])
