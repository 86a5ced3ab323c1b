"""What a NIXL worker registers and how: committed regions -> a checked plan -> registrations.

:func:`source_regions` takes the regions and physical chunks from a final, awake KV cache
(or from regions given by hand, :class:`GivenRegions`); :func:`plan_registration` checks them
and plans the extents (one per physical chunk) and the descriptors of the regions transfers
move, before any NIXL call; :func:`register_plan` registers the extents and prepares the
local descriptor list, undoing what it did when a step fails. Units: bytes, blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvconnect.cache_source import KVCacheSource
from kvconnect.peer_layout import LayoutFacts, PeerLayout
from kvconnect.undo import UndoStack
from kvconnect.views import PagedRegion

from ..errors import KVConnectorError
from .agent import NixlAgent, NixlHandle
from .descriptors import (
    PhysicalChunk,
    memory_type_for_device,
    region_descriptors,
    registration_extents,
    transfer_regions,
)

__all__ = ["LOCAL_AGENT", "GivenRegions", "RegistrationPlan", "plan_registration",
           "register_plan", "source_layout", "source_regions"]

#: NIXL's name for the local side of a prepared descriptor list
LOCAL_AGENT = "NIXL_INIT_AGENT"


@dataclass(frozen=True)
class GivenRegions:
    """Regions, the physical chunks holding them and their layout facts, given by hand."""

    regions: list[PagedRegion]
    chunks: list[PhysicalChunk]
    facts: LayoutFacts


def source_regions(src: KVCacheSource | GivenRegions, who: str
                   ) -> tuple[list[PagedRegion], list[PhysicalChunk]]:
    """``(regions, chunks)`` of ``src``: a :class:`GivenRegions`, or a KV cache that must be
    final and awake (else :class:`KVConnectorError` prefixed with ``who``)."""
    if isinstance(src, GivenRegions):
        return list(src.regions), list(src.chunks)
    if not getattr(src, "is_final", False):
        raise KVConnectorError(f"{who}: the KV cache is no longer final")
    if getattr(src, "is_released", False) or any(
            getattr(t, "is_released", False) for t in getattr(src, "tensors", ())):
        raise KVConnectorError(f"{who}: the KV cache's physical memory is released (asleep); "
                               "call cache.recommit() before registering")
    regions: list[PagedRegion] = list(src.committed_regions())
    chunks: list[PhysicalChunk] = [c for t in src.tensors for c in t.physical_chunks()]
    return regions, chunks


def source_layout(src: KVCacheSource | GivenRegions, regions: Sequence[PagedRegion], who: str
                  ) -> PeerLayout:
    """The layout a worker publishes for ``regions`` of ``src``: a cache's
    ``PeerLayout.from_cache`` (the one every user of that cache builds), or for
    :class:`GivenRegions` the regions' layout with its facts. Raises
    :class:`KVConnectorError` prefixed with ``who`` when the regions do not form a layout."""
    try:
        if isinstance(src, GivenRegions):
            facts = src.facts
            return PeerLayout.from_regions(
                regions, block_size=facts.get("block_size"), dtype=facts.get("dtype"),
                layout=facts.get("layout"), kernel_block_size=facts.get("kernel_block_size"))
        return PeerLayout.from_cache(src)
    except ValueError as exc:
        raise KVConnectorError(f"{who}: {exc}") from None


@dataclass(frozen=True)
class RegistrationPlan:
    """What one registration of committed regions needs, checked before any NIXL call."""

    #: the regions as given (their order is the handshake's)
    regions: list[PagedRegion]
    #: ``(addr, length, device_id)`` per physical chunk holding committed blocks, bytes
    extents: list[tuple[int, int, int]]
    #: ``"DRAM"`` or ``"VRAM"``
    memory_type: str
    #: the regions transfers move (:func:`transfer_regions`), in local order
    xfer_regions: list[PagedRegion]
    #: every block of every transfer region, region-major (``N x 3`` uint64)
    local_descs: np.ndarray
    #: first row of each transfer region in ``local_descs``
    local_offsets: np.ndarray


def plan_registration(regions: Sequence[PagedRegion], chunks: Sequence[PhysicalChunk], who: str
                      ) -> RegistrationPlan:
    """Check committed ``regions`` held in physical ``chunks`` and plan their registration.

    Raises :class:`KVConnectorError` (prefixed with ``who``) for no regions, duplicate
    ``layer/part`` names, regions on several devices, a region without blocks, regions that
    share bytes without one holding the other's blocks, and any block that crosses a chunk
    boundary or lies outside the chunks.
    """
    regions = list(regions)
    if not regions:
        raise KVConnectorError(f"{who}: no committed regions to register")
    keys = [f"{r.layer_name}/{r.part}" for r in regions]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise KVConnectorError(f"{who}: duplicate regions {dup[:4]}")
    kinds = {memory_type_for_device(r.device) for r in regions}
    if len(kinds) != 1:
        raise KVConnectorError(f"{who}: regions span several devices: {sorted(kinds)}")
    mem_type = kinds.pop()[0]
    if any(int(r.num_blocks) <= 0 for r in regions):
        raise KVConnectorError(f"{who}: a region has no committed blocks")
    # Every block descriptor must lie inside one chunk (checked here, before registering).
    extents = registration_extents(regions, chunks)
    try:
        xfer_regions = transfer_regions(regions)
    except ValueError as exc:
        raise KVConnectorError(f"{who}: {exc}") from None
    counts = np.array([int(r.num_blocks) for r in xfer_regions], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return RegistrationPlan(regions, extents, mem_type, xfer_regions,
                            region_descriptors(xfer_regions), offsets)


def register_plan(agent: NixlAgent, plan: RegistrationPlan, who: str
                  ) -> tuple[list[NixlHandle], NixlHandle]:
    """Register ``plan``'s extents with ``agent`` and prepare its local descriptor list:
    ``(registration handles, prepared list)``. On failure every registration made is undone
    and :class:`KVConnectorError` (prefixed with ``who``) raised."""
    handles: list[NixlHandle] = []
    try:
        with UndoStack() as undo:
            for addr, length, dev in plan.extents:
                handles.append(agent.register_memory([(addr, length, dev, "")],
                                                     plan.memory_type))
                undo.push(agent.deregister_memory, handles[-1])
            prep = agent.prep_xfer_dlist(LOCAL_AGENT, plan.local_descs, plan.memory_type)
    except Exception as exc:
        raise KVConnectorError(f"{who}: NIXL registration failed: {type(exc).__name__}: "
                               f"{exc}") from exc
    return handles, prep
