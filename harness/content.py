"""Position-dependent block contents and per-block digests.

Every byte a prefill writes depends on (seed, prefill rank, layer, part, block id, offset):
a counter-based hash computed with torch integer ops on the cache's device (no per-byte
Python). A block that lands in the wrong slot, the wrong layer, the wrong K/V half or the
wrong offset therefore differs, unlike constant fills (nixlbench's 0xbb/0xaa).

Digests are BLAKE2b-128 over each (block, region) byte range: any flipped byte changes them.
When a digest differs, :func:`first_difference` regenerates the expected bytes and names the
first differing offset.

Regions come from :meth:`ExtensibleKVCache.committed_regions`. Layers that alias the same
pages by design (hybrid attention + Mamba) give regions contained in another region; those
are *covered* and not filled or checked on their own (the covering region holds their bytes).

Units: bytes for lengths and offsets, blocks for block ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvconnect.views import block_span, page_owners

_M32 = 0xFFFFFFFF
#: bound on the int64 scratch of one fill batch (bytes of generated content)
_BATCH_BYTES = 32 * 1024 * 1024
PART_NAMES = {"k": "K", "v": "V", "kv": "K+V", "latent": "latent", "state": "state",
              "packed": "packed"}


@dataclass(frozen=True)
class RegionSpec:
    """A committed region as both sides of a transfer describe it (JSON-able).

    ``offset`` is bytes from the start of KV tensor ``tensor_index``'s reservation to block 0;
    ``covered_by`` is the index of the region that contains this one (aliased pages), or -1.
    """

    index: int
    layer_name: str
    part: str
    block_len: int
    block_stride: int
    num_blocks: int
    tensor_index: int
    segment: int
    offset: int
    covered_by: int = -1

    @property
    def label(self) -> str:
        return f"layer {self.layer_name} part {PART_NAMES.get(self.part, self.part)}"

    @property
    def signature(self) -> tuple[str, str, int, int]:
        return (self.layer_name, self.part, self.block_len, self.block_stride)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RegionSpec:
        return cls(**{k: (str(v) if k in ("layer_name", "part") else int(v))
                      for k, v in obj.items()})


def region_specs(cache: Any) -> list[RegionSpec]:
    """The cache's committed regions as :class:`RegionSpec`, each region whose pages another
    holds marked ``covered_by`` that holder (kvconnect's one page-sharing rule,
    :func:`kvconnect.views.page_owners`; partial overlaps raise ``ValueError``)."""
    tensors = cache.tensors
    regions = list(cache.committed_regions())
    holder = page_owners(regions)
    specs: list[RegionSpec] = []
    for i, r in enumerate(regions):
        base = tensors[r.tensor_index].base_ptr
        specs.append(RegionSpec(i, r.layer_name, r.part, int(r.block_len), int(r.block_stride),
                                int(r.num_blocks), int(r.tensor_index), int(r.segment),
                                int(r.base_ptr - base), -1 if holder[i] == i else holder[i]))
    return specs


def owners(specs: Sequence[RegionSpec]) -> list[RegionSpec]:
    """The regions that hold their bytes themselves (not covered by another)."""
    return [s for s in specs if s.covered_by < 0]


def rows_view(flat: torch.Tensor, spec: RegionSpec, num_blocks: int | None = None) -> torch.Tensor:
    """``(num_blocks, block_len)`` uint8 view over a bounded flat view of the region's span."""
    n = spec.num_blocks if num_blocks is None else num_blocks
    span = block_span(n, spec.block_stride, spec.block_len)
    if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < span:
        raise ValueError(f"{spec.label}: need a flat uint8 view of {span} bytes, got "
                         f"{flat.dtype} {tuple(flat.shape)}")
    return flat.as_strided((n, spec.block_len), (spec.block_stride, 1), flat.storage_offset())


def cache_rows(cache: Any, spec: RegionSpec) -> torch.Tensor:
    """The region's rows in ``cache`` (bounded to committed memory by ``committed_view``)."""
    t = cache.tensors[spec.tensor_index]
    span = block_span(spec.num_blocks, spec.block_stride, spec.block_len)
    return rows_view(t.committed_view(spec.offset, span), spec)


def content_key(seed: int, source: str, spec: RegionSpec) -> int:
    """32-bit key of one region's contents written by ``source`` (e.g. ``prefill0``)."""
    h = hashlib.blake2b(f"{seed}/{source}/{spec.layer_name}/{spec.part}/{spec.index}".encode(),
                        digest_size=8).digest()
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


def all_zero(rows: torch.Tensor) -> bool:
    """True when every byte of ``rows`` is zero."""
    return not bool(rows.any())
