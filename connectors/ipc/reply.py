"""The ipc transport's export reply as a receiver must read it: every field a peer sends.

:class:`~.transport.IpcExportServer` replies with the chunk records of
:func:`kvconnect.ipc.export_message` (validated by :func:`kvconnect.ipc.import_message`) and
the exporter's :class:`~kvconnect.peer_layout.PeerLayout` (``"layout"``,
``PeerLayout.from_cache``: each region placed by ``tensor_index`` and ``offset``, bytes from
the start of that tensor's reservation). A hostile or broken exporter may send anything
there: :func:`checked_layout` parses it (every field type- and range-checked) or raises
:class:`~kvconnect.framing.IpcError` naming the field, and :func:`peer_block_region` builds
the copy's source region over the peer's mapping, raising the same error when the region
does not lie inside what the peer mapped. Nothing else of the reply is trusted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvconnect.bounded_json import JSON
from kvconnect.framing import IpcError
from kvconnect.ipc import PeerMapping
from kvconnect.peer_layout import PeerLayout

from ..copy.block_copy import BlockRegion, layout_block_region

__all__ = ["checked_layout", "peer_block_region"]


def checked_layout(peer: str, reply: Mapping[str, JSON], num_tensors: int) -> PeerLayout:
    """The peer's layout from an export reply, each region that holds its pages placed in one
    of the ``num_tensors`` tensors its chunk records mapped; :class:`IpcError` naming the
    field for anything missing, of the wrong type, out of range or listed twice."""
    where = f"export reply from {peer}: layout"
    layout = PeerLayout.from_json(reply.get("layout"), where=where, error=IpcError)
    for i, r, _ in layout.holders():
        if r.offset is None:
            raise IpcError(f"{where}.regions[{i}].offset is missing: an exporter places its "
                           "regions in the tensors it maps")
        if r.tensor_index >= num_tensors:
            raise IpcError(f"{where}.regions[{i}].tensor_index = {r.tensor_index}, but the "
                           f"reply maps {num_tensors} tensors")
    return layout


def peer_block_region(peer: str, layout: PeerLayout, index: int, mappings: Sequence[PeerMapping],
                      name: str) -> BlockRegion:
    """The copy's source region ``index`` of the peer's ``layout`` (from
    :func:`checked_layout`) over its mapping of the region's tensor: :class:`IpcError` when
    its blocks do not lie inside one chunk the peer mapped (or a run of adjacent ones: a
    grown segment), or do not form a valid region."""
    r = layout.regions[index]
    span = r.span(layout.num_blocks)
    try:
        view = mappings[r.tensor_index].view(int(r.offset or 0), span)  # placed: checked_layout
        return layout_block_region(view, r, layout.num_blocks, name=f"{peer}:{name}")
    except ValueError as exc:
        raise IpcError(f"export reply from {peer}: region {r.key} ({layout.num_blocks} blocks "
                       f"of {r.sub_blocks} x {r.block_len} bytes every {r.block_stride} from "
                       f"offset {r.offset}) is not inside what it mapped: {exc}") from None
