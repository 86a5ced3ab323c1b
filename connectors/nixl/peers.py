"""The peers a NIXL worker reads from: checking, loading and dropping their metadata.

A peer's descriptors are built once from its handshake (committed regions only, in the local
transfer-region order), checked to lie inside its registrations (one per physical chunk), and
prepared as one NIXL descriptor list; :func:`drop_peer` releases it and the remote agent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvconnect.views import PagedRegion, page_owners

from ..errors import IncompatiblePeerError, KVConnectorError
from .agent import NixlAgent, NixlHandle, release_logged
from .descriptors import check_descriptors_in_chunks, region_descriptors
from .handshake import HandshakeMetadata
from .registration import RegistrationPlan

__all__ = ["MAX_PEER_DESCRIPTORS", "LoadedPeer", "drop_peer", "load_peer", "peer_descriptors",
           "read_indices", "remote_paged_regions"]

#: most block descriptors (blocks x regions) accepted from one peer's metadata
MAX_PEER_DESCRIPTORS = 1 << 25


@dataclass
class LoadedPeer:
    """A peer a worker reads from: its handshake metadata (which names its NIXL remote
    agent) and the descriptor list prepared once over all its committed blocks."""

    metadata: HandshakeMetadata
    prep: NixlHandle | None
    #: for each local region (local order): first row of that region in the remote dlist
    offsets: np.ndarray
    #: for each local region (local order): remote committed block count
    num_blocks: np.ndarray


def _first_diff(ours: list[str], theirs: list[str]) -> str:
    only_ours = sorted(set(ours) - set(theirs))
    only_theirs = sorted(set(theirs) - set(ours))
    return f"(only local: {only_ours[:4]}, only remote: {only_theirs[:4]})"


def remote_paged_regions(md: HandshakeMetadata) -> list[PagedRegion]:
    """The peer's layout regions at the addresses its handshake gives, in its order.

    Raises :class:`IncompatiblePeerError` when the pages its regions share at those
    addresses are not the ones its layout says (``held_by``), or cannot be moved block by
    block at all (:func:`kvconnect.views.page_owners`)."""
    layout = md.layout
    regions = [layout.paged_region(i, a.base_ptr,
                                   "cpu" if md.memory_type == "DRAM" else f"cuda:{a.device_id}")
               for i, a in enumerate(md.regions)]
    try:
        owners = page_owners(regions)
    except ValueError as exc:
        raise IncompatiblePeerError([f"the peer's regions cannot be read: {exc}"],
                                    peer=md.engine_id) from None
    declared = [i if r.holds_own else r.held_by for i, r in enumerate(layout.regions)]
    if owners != declared:
        bad = next(i for i, (a, b) in enumerate(zip(owners, declared, strict=True)) if a != b)
        raise IncompatiblePeerError(
            [f"the peer's layout says region {layout.regions[bad].key} is held by "
             f"{layout.regions[declared[bad]].key}, its addresses put it in "
             f"{layout.regions[owners[bad]].key}"], peer=md.engine_id)
    return regions


def peer_descriptors(md: HandshakeMetadata, local_xfer_regions: Sequence[PagedRegion]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The peer's block descriptors paired with ours: ``(descs, offsets, counts)``.

    ``descs`` (``N x 3`` uint64 ``(addr, len, device_id)``) holds every committed block of each
    remote region, region after region in the order of ``local_xfer_regions``; ``offsets[i]``
    is the first row of local region ``i``'s partner and ``counts[i]`` its block count.
    Raises :class:`IncompatiblePeerError` when the regions that alias pages differ (from
    ours, or from what the peer's addresses say: :func:`remote_paged_regions`), and
    :class:`KVConnectorError` for too many descriptors or a block outside the peer's
    registrations.
    """
    # Pair remote regions with ours by layer/part, in local transfer-region order.
    layout = md.layout
    index = {r.key: i for i, r in enumerate(layout.regions)}
    remote_regions = remote_paged_regions(md)
    theirs = [r.key for _, r, _ in layout.holders()]
    ours = [f"{r.layer_name}/{r.part}" for r in local_xfer_regions]
    if sorted(theirs) != sorted(ours):
        raise IncompatiblePeerError(
            [f"page aliasing differs: regions moved locally {_first_diff(ours, theirs)} "
             "vs remotely"], peer=md.engine_id)
    order = [index[k] for k in ours]
    remote_counts = np.array([remote_regions[j].num_blocks for j in order], dtype=np.int64)
    if int(remote_counts.sum()) > MAX_PEER_DESCRIPTORS:
        raise KVConnectorError(
            f"peer {md.engine_id!r} advertises {int(remote_counts.sum())} block descriptors, "
            f"above the limit of {MAX_PEER_DESCRIPTORS}")
    remote_descs = region_descriptors([remote_regions[j] for j in order])
    # The peer's blocks must lie inside its registrations (one per physical chunk).
    check_descriptors_in_chunks(remote_descs, md.registrations,
                                what=f"remote descriptor of {md.engine_id!r}")
    offsets = np.concatenate([[0], np.cumsum(remote_counts)[:-1]]).astype(np.int64)
    return remote_descs, offsets, remote_counts


def read_indices(plan: RegistrationPlan, entry: LoadedPeer, local: np.ndarray,
                 remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the local and the peer's prepared descriptor lists for a READ of remote
    blocks ``remote`` into local blocks ``local`` (pairwise), region-major. Raises
    ``IndexError`` for a block id outside either side's committed blocks."""
    local_counts = np.array([int(r.num_blocks) for r in plan.xfer_regions], dtype=np.int64)
    if local.min() < 0 or local.max() >= local_counts.min():
        raise IndexError(f"local block ids must lie in [0, {int(local_counts.min())}), got "
                         f"{int(local.min())}..{int(local.max())}")
    if remote.min() < 0 or remote.max() >= entry.num_blocks.min():
        raise IndexError(f"remote block ids of {entry.metadata.engine_id!r} must lie in "
                         f"[0, {int(entry.num_blocks.min())}), got "
                         f"{int(remote.min())}..{int(remote.max())}")
    return ((plan.local_offsets[:, None] + local[None, :]).reshape(-1),
            (entry.offsets[:, None] + remote[None, :]).reshape(-1))


def load_peer(agent: NixlAgent, engine_id: str, md: HandshakeMetadata, remote_descs: np.ndarray,
              offsets: np.ndarray, counts: np.ndarray) -> LoadedPeer:
    """Add the peer's NIXL agent and prepare its descriptor list; nothing stays loaded when
    this raises (:class:`KVConnectorError`)."""
    try:
        name = agent.add_remote_agent(md.agent_metadata)
    except Exception as exc:
        raise KVConnectorError(f"{engine_id}: loading the NIXL metadata of peer "
                               f"{md.engine_id!r} failed: {type(exc).__name__}: {exc}") from exc
    # The name comes from the peer's blob: any bytes (a non-UTF-8 name must not escape as
    # UnicodeDecodeError with the remote agent left loaded).
    text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    if text != md.agent_name:
        agent.remove_remote_agent(name)
        raise KVConnectorError(f"peer {md.engine_id!r}: agent metadata names {text!r}, "
                               f"the handshake says {md.agent_name!r}")
    try:
        prep = agent.prep_xfer_dlist(md.agent_name, remote_descs, md.memory_type)
    except Exception as exc:
        agent.remove_remote_agent(md.agent_name)
        raise KVConnectorError(f"{engine_id}: preparing descriptors of peer "
                               f"{md.engine_id!r} failed: {type(exc).__name__}: {exc}") from exc
    return LoadedPeer(md, prep, offsets, counts)


def drop_peer(agent: NixlAgent, engine_id: str, entry: LoadedPeer) -> None:
    """Release the peer's descriptor list and remove its remote agent (failures are logged)."""
    if entry.prep is not None:
        release_logged(engine_id, f"releasing the descriptor list of {entry.metadata.engine_id}",
                       agent.release_dlist_handle, entry.prep)
        entry.prep = None
    name = entry.metadata.agent_name
    release_logged(engine_id, f"removing remote agent {name!s}", agent.remove_remote_agent, name)

