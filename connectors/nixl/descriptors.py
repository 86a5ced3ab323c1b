"""NIXL transfer descriptors and registration extents, from committed regions only.

Pure geometry (numpy, no NIXL): which ``(address, length, device_id)`` rows a transfer moves,
which extents to register (one per physical chunk, exactly the committed blocks inside it),
and the check that no descriptor crosses a physical chunk boundary (ucx #11283) or touches
uncommitted memory. Units: bytes for addresses and lengths, blocks for block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias, TypeVar

import numpy as np

from kvconnect.tensor import Chunk
from kvconnect.views import PagedRegion, page_holders
from kvconnect.vmm import parse_device

from ..errors import KVConnectorError

__all__ = [
    "PhysicalChunk",
    "check_descriptors_in_chunks",
    "memory_type_for_device",
    "region_descriptors",
    "registration_extents",
    "transfer_regions",
]

#: a physical allocation holding committed blocks: a :class:`~kvconnect.tensor.Chunk`, or
#: ``(va, size[, ...])`` in bytes (memory that is not an ExtensibleKVCache)
PhysicalChunk: TypeAlias = "Chunk | tuple[int, ...]"
RegionT = TypeVar("RegionT", bound=PagedRegion)

UCX_MULTI_HANDLE_ISSUE = ("UCX exports only the first physical handle of a region spanning "
                          "several (ucx #11283): recommit each segment as one handle "
                          "(extend_kv_cache(..., single_handle=True)) before registering")


def memory_type_for_device(device: object) -> tuple[str, int]:
    """NIXL memory type and device id for a torch device string.

    ``"cpu"`` / ``"host"`` -> ``("DRAM", 0)``; ``"cuda:N"`` -> ``("VRAM", N)``.
    """
    try:
        kind, index = parse_device(device)
    except ValueError as exc:
        raise ValueError(f"no NIXL memory type for device {device!r}: {exc}") from None
    return ("DRAM", 0) if kind == "host" else ("VRAM", index)


def region_descriptors(regions: Sequence[PagedRegion]) -> np.ndarray:
    """Transfer descriptors for every committed block of ``regions``: an ``N x 3`` uint64
    array of ``(address, length, device_id)`` rows, region-major, each region contributing
    its ``num_blocks`` blocks in order (regions may differ in block count).

    ``device_id`` is the id implied by each region's ``device`` (0 for DRAM, the GPU index
    for CUDA). Lengths are ``block_len`` bytes; addresses advance by ``block_stride``.
    """
    parts = []
    for region in regions:
        blocks = np.arange(int(region.num_blocks), dtype=np.uint64)
        rows = np.empty((blocks.size, 3), dtype=np.uint64)
        rows[:, 0] = np.uint64(region.base_ptr) + blocks * np.uint64(region.block_stride)
        rows[:, 1] = np.uint64(region.block_len)
        rows[:, 2] = np.uint64(memory_type_for_device(region.device)[1])
        parts.append(rows)
    if not parts:
        return np.empty((0, 3), dtype=np.uint64)
    return np.concatenate(parts, axis=0)


def transfer_regions(regions: Sequence[RegionT]) -> list[RegionT]:
    """The regions whose blocks a transfer moves: the regions that hold their own pages
    (:func:`kvconnect.views.page_holders`; a region whose blocks lie inside another's, as a
    Mamba layer's inside the attention page of the same KV tensor in a hybrid model, is moved
    with it), in order of first appearance. Raises ``ValueError`` as
    :func:`kvconnect.views.page_owners`."""
    return [r for r, _ in page_holders(regions)]


def _chunk_bounds(chunks: Sequence[PhysicalChunk]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted chunk starts and ends from ``Chunk`` objects or ``(va, size[, ...])`` tuples."""
    pairs = []
    for c in chunks:
        if isinstance(c, Chunk):
            pairs.append((int(c.va), int(c.size)))
        else:
            pairs.append((int(c[0]), int(c[1])))
    pairs.sort()
    starts = np.array([p[0] for p in pairs], dtype=np.uint64)
    ends = np.array([p[0] + p[1] for p in pairs], dtype=np.uint64)
    if len(pairs) > 1 and np.any(starts[1:] < ends[:-1]):
        raise ValueError("physical chunks overlap")
    return starts, ends


def check_descriptors_in_chunks(descs: np.ndarray, chunks: Sequence[PhysicalChunk], *,
                                what: str = "descriptor") -> np.ndarray:
    """Check that every ``(addr, len, dev)`` row lies wholly inside one chunk.

    ``chunks`` are ``Chunk`` objects (``va``, ``size``) or ``(va, size, ...)`` tuples, in bytes.
    Returns the index (into the address-sorted chunk list) of each row's chunk. Raises
    :class:`KVConnectorError` naming the first offending row when one crosses a chunk boundary
    (ucx #11283) or lies outside every chunk (uncommitted memory).
    """
    descs = np.asarray(descs, dtype=np.uint64).reshape(-1, 3)
    starts, ends = _chunk_bounds(chunks)
    if descs.shape[0] == 0:
        return np.empty(0, dtype=np.int64)
    if starts.size == 0:
        raise KVConnectorError(f"no physical chunks: {descs.shape[0]} {what}s lie in "
                               "uncommitted memory")
    addr = descs[:, 0]
    end = addr + descs[:, 1]
    idx = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
    inside = idx >= 0
    safe = np.where(inside, idx, 0)
    inside &= addr < ends[safe]
    whole = inside & (end <= ends[safe])
    if not np.all(whole):
        row = int(np.argmin(whole))
        a, n = int(addr[row]), int(descs[row, 1])
        if not inside[row]:
            raise KVConnectorError(
                f"{what} {row} ([{a:#x}, {a + n:#x}), {n} bytes) lies outside every committed "
                "physical chunk: it would touch uncommitted memory")
        c = int(safe[row])
        raise KVConnectorError(
            f"{what} {row} ([{a:#x}, {a + n:#x}), {n} bytes) crosses the end of physical chunk "
            f"[{int(starts[c]):#x}, {int(ends[c]):#x}); {UCX_MULTI_HANDLE_ISSUE}")
    return idx


def registration_extents(regions: Sequence[PagedRegion], chunks: Sequence[PhysicalChunk]
                         ) -> list[tuple[int, int, int]]:
    """The extents to register: one ``(addr, length, device_id)`` per physical chunk holding
    committed blocks, spanning exactly from the first committed block byte in that chunk to the
    last (never the chunk's or the storage's full size).

    Raises :class:`KVConnectorError` if any block of any region crosses a chunk boundary or
    lies outside the chunks.
    """
    descs = region_descriptors(regions)
    idx = check_descriptors_in_chunks(descs, chunks, what="block descriptor")
    out = []
    for c in np.unique(idx):
        sel = descs[idx == c]
        lo = int(sel[:, 0].min())
        hi = int((sel[:, 0] + sel[:, 1]).max())
        devs = np.unique(sel[:, 2])
        if devs.size != 1:
            raise KVConnectorError(f"regions on different devices share the chunk at {lo:#x}")
        out.append((lo, hi - lo, int(devs[0])))
    return out
