"""The ipc transport's export reply as a receiver must read it: every field a peer sends.

:class:`~.transport.IpcExportServer` replies with the chunk records of
:func:`kvconnect.ipc.export_message` (validated by :func:`kvconnect.ipc.import_message`), the
committed block count ``num_blocks`` and one record per committed region
(``members``, ``tensor_index``, ``offset``, ``block_len``, ``block_stride``, ``num_blocks``;
bytes, except the block counts). A hostile or broken exporter may send anything there:
:func:`checked_regions` turns it into :class:`PeerRegion` values or raises
:class:`~kvconnect.framing.IpcError` naming the field, and :func:`peer_block_region` builds
the copy's source region over the peer's mapping, raising the same error when the region
does not lie inside what the peer mapped. Nothing else of the reply is trusted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.checks import MAX_BYTES, checked_int
from kvconnect.framing import IpcError
from kvconnect.views import block_span

from ..copy.block_copy import BlockRegion

__all__ = ["MAX_PEER_REGIONS", "PeerRegion", "checked_regions", "peer_block_region"]

#: most regions one reply may list (a model has a few per layer group)
MAX_PEER_REGIONS = 1 << 14
#: most layer names one region may list, and the longest name
MAX_MEMBERS = 1 << 14
MAX_NAME_CHARS = 512


@dataclass(frozen=True)
class PeerRegion:
    """One committed region of the peer, validated: ``offset`` (bytes from the start of the
    peer's tensor ``tensor_index``), ``block_len`` and ``block_stride`` (bytes),
    ``num_blocks`` (kernel blocks: a whole multiple of the peer's logical block count)."""

    members: tuple[str, ...]
    tensor_index: int
    offset: int
    block_len: int
    block_stride: int
    num_blocks: int


def _int(peer: str, what: str, value: object, *, minimum: int = 0,
         maximum: int = MAX_BYTES) -> int:
    try:
        return checked_int(what, value, minimum=minimum, maximum=maximum)
    except ValueError as exc:
        raise IpcError(f"export reply from {peer}: bad {exc}") from None


def _members(peer: str, index: int, value: object) -> tuple[str, ...]:
    where = f"export reply from {peer}: region {index} members"
    if not isinstance(value, list) or not value or len(value) > MAX_MEMBERS:
        raise IpcError(f"{where} must be a non-empty list of at most {MAX_MEMBERS} layer "
                       f"names, got {type(value).__name__}")
    if not all(isinstance(m, str) and 0 < len(m) <= MAX_NAME_CHARS for m in value):
        raise IpcError(f"{where} must be layer names of 1..{MAX_NAME_CHARS} characters")
    return tuple(value)


def checked_regions(peer: str, reply: Mapping[str, Any], num_tensors: int,
                    ) -> tuple[int, dict[tuple[str, ...], PeerRegion]]:
    """``(the peer's logical block count, its regions by members)`` from an export reply, or
    :class:`IpcError` for anything missing, of the wrong type, out of range or listed twice.
    ``num_tensors``: how many tensors the reply's chunk records mapped."""
    remote_n = _int(peer, "num_blocks", reply.get("num_blocks"), minimum=1)
    records = reply.get("regions")
    if not isinstance(records, list) or len(records) > MAX_PEER_REGIONS:
        raise IpcError(f"export reply from {peer}: 'regions' must be a list of at most "
                       f"{MAX_PEER_REGIONS} records, got {type(records).__name__}")
    regions: dict[tuple[str, ...], PeerRegion] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise IpcError(f"export reply from {peer}: region {i} is a "
                           f"{type(rec).__name__}, not an object")
        members = _members(peer, i, rec.get("members"))
        if members in regions:
            raise IpcError(f"export reply from {peer}: region {i} lists members "
                           f"{list(members)[:4]} again")
        num_blocks = _int(peer, f"region {i} num_blocks", rec.get("num_blocks"), minimum=1)
        if num_blocks % remote_n:
            raise IpcError(f"export reply from {peer}: region {i} has {num_blocks} blocks, not "
                           f"a whole multiple of the {remote_n} committed blocks")
        regions[members] = PeerRegion(
            members=members,
            tensor_index=_int(peer, f"region {i} tensor_index", rec.get("tensor_index"),
                              maximum=max(0, num_tensors - 1)),
            offset=_int(peer, f"region {i} offset", rec.get("offset")),
            block_len=_int(peer, f"region {i} block_len", rec.get("block_len"), minimum=1),
            block_stride=_int(peer, f"region {i} block_stride", rec.get("block_stride"),
                              minimum=1),
            num_blocks=num_blocks)
    if num_tensors == 0 and regions:
        raise IpcError(f"export reply from {peer}: regions but no mapped tensor")
    return remote_n, regions


def peer_block_region(peer: str, region: PeerRegion, mappings: Sequence[Any],
                      remote_blocks: int) -> BlockRegion:
    """The copy's source region over the peer's mapping of tensor ``region.tensor_index``:
    :class:`IpcError` when its blocks do not lie inside one chunk the peer mapped, or do not
    form a valid region (overlapping blocks)."""
    label = f"{peer}:{'+'.join(region.members)}"
    span = block_span(region.num_blocks, region.block_stride, region.block_len)
    try:
        view = mappings[region.tensor_index].view(region.offset, span)
        return BlockRegion(view, region.block_len, region.block_stride, remote_blocks,
                           region.num_blocks // remote_blocks, name=label)
    except ValueError as exc:
        raise IpcError(f"export reply from {peer}: region {list(region.members)[:4]} "
                       f"({region.num_blocks} blocks of {region.block_len} bytes every "
                       f"{region.block_stride} from offset {region.offset}) is not inside "
                       f"what it mapped: {exc}") from None
