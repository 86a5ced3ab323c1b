"""Handshake metadata for the NIXL worker: a :class:`~kvconnect.peer_layout.PeerLayout`, where
its regions lie, and NIXL agent metadata, as JSON.

Both sides of a transfer publish :class:`HandshakeMetadata`; the reading side loads the remote
one with :meth:`HandshakeMetadata.from_json` (size-bounded, type-checked: it comes from another
process, so it is never unpickled) and compares layouts with
:meth:`kvconnect.peer_layout.PeerLayout.differences` (kvconnect's one compatibility rule)
before any transfer.

Units: bytes for addresses and lengths (the layout names its own units).
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass

from kvconnect.bounded_json import Doc, json_int, json_list, load_document
from kvconnect.peer_layout import PeerLayout, PeerLayoutError

from ..errors import KVConnectorError

__all__ = [
    "HANDSHAKE_SCHEMA",
    "MAX_METADATA_BYTES",
    "HandshakeMetadata",
    "MetadataError",
    "RegionAddress",
    "WIRE_VERSION",
]

#: version of the metadata document (bump when a field changes)
WIRE_VERSION = 2
#: schema tag written into every metadata document; a different tag is rejected.
HANDSHAKE_SCHEMA = f"kvconnect.nixl.handshake/{WIRE_VERSION}"
#: largest metadata document accepted from a peer, in bytes.
MAX_METADATA_BYTES = 64 * 1024 * 1024
_MAX_ITEMS = 1 << 20
_U64 = (1 << 64) - 1


class MetadataError(KVConnectorError, PeerLayoutError):
    """Peer metadata is malformed, too large or of an unknown schema (its layout too)."""


# -- validation helpers --------------------------------------------------------------------------

def _agent_metadata(d: Doc, max_bytes: int) -> bytes:
    """The NIXL agent metadata: ``agent_metadata_b64``, non-empty valid base64."""
    b64 = d.string("agent_metadata_b64", max_chars=max_bytes)
    try:
        agent_md = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise MetadataError(f"agent_metadata_b64 is not valid base64: {exc}") from None
    if not agent_md:
        raise MetadataError("agent_metadata_b64 is empty")
    return agent_md


#: the integer fields ``(name, minimum, maximum)`` of one ``regions`` / ``registrations`` row
_REGION = (("base_ptr", 0, _U64), ("device_id", 0, 1 << 16))
_EXTENT = (("addr", 0, _U64), ("length", 1, _U64), ("device_id", 0, 1 << 16))


def _int_rows(d: Doc, key: str, fields: tuple[tuple[str, int, int], ...]
              ) -> list[tuple[int, ...]]:
    """``d[key]``: a list of rows, each a list of one integer per field, within its bounds."""
    rows = []
    for i, item in enumerate(d.array(key, _MAX_ITEMS)):
        what = f"{d.at(key)}[{i}]"
        item = json_list(what, item, MetadataError, len(fields))
        if len(item) != len(fields):
            raise MetadataError(f"{what} must be [{', '.join(f[0] for f in fields)}]")
        rows.append(tuple(json_int(f"{what}.{name}", value, MetadataError, lo, hi)
                          for value, (name, lo, hi) in zip(item, fields, strict=True)))
    return rows


# -- full metadata document ----------------------------------------------------------------------

@dataclass(frozen=True)
class RegionAddress:
    """Where one layout region lives in the publishing process: the address of its block 0
    (bytes) and the NIXL device id (0 for DRAM, the GPU index for VRAM). Its block count is
    the layout's (``PeerLayout.kernel_blocks``)."""

    base_ptr: int
    device_id: int = 0


@dataclass(frozen=True)
class HandshakeMetadata:
    """Everything a peer needs to read our blocks: agent metadata, layout and addresses.

    ``regions[i]`` is the address of ``layout.regions[i]``. ``registrations`` are the
    registered extents ``(addr, length, device_id)``, one per physical chunk; every remote
    descriptor must lie inside one of them. ``generation`` grows on every re-registration;
    ``incarnation`` (random, up to 64 characters) names the publishing worker instance, so a
    reader tells a restarted peer (new incarnation, generation from 1 again) from an older
    document of the same peer (same incarnation, lower generation: stale or replayed).
    """

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    memory_type: str
    layout: PeerLayout
    regions: tuple[RegionAddress, ...]
    registrations: tuple[tuple[int, int, int], ...]
    generation: int = 0
    incarnation: str = ""

    def to_json(self) -> bytes:
        """UTF-8 JSON document (agent metadata base64-encoded)."""
        doc = {
            "schema": HANDSHAKE_SCHEMA,
            "engine_id": self.engine_id,
            "agent_name": self.agent_name,
            "agent_metadata_b64": base64.b64encode(self.agent_metadata).decode("ascii"),
            "memory_type": self.memory_type,
            "generation": self.generation,
            "incarnation": self.incarnation,
            "layout": self.layout.to_json(),
            "regions": [[r.base_ptr, r.device_id] for r in self.regions],
            "registrations": [list(x) for x in self.registrations],
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | bytearray | str,
                  max_bytes: int = MAX_METADATA_BYTES) -> HandshakeMetadata:
        """Parse and validate a peer's metadata; raises :class:`MetadataError` on anything off
        (including ``data`` that is not bytes or text at all)."""
        d = load_document(data, max_bytes, "metadata", MetadataError)
        d.check_version("schema", HANDSHAKE_SCHEMA, "metadata schema")
        agent_md = _agent_metadata(d, max_bytes)
        memory_type = d.string("memory_type")
        if memory_type not in ("DRAM", "VRAM"):
            raise MetadataError(f"memory_type must be 'DRAM' or 'VRAM', got {memory_type!r}")
        layout = PeerLayout.from_json(d.raw("layout"), error=MetadataError)
        regions = [RegionAddress(ptr, dev) for ptr, dev in _int_rows(d, "regions", _REGION)]
        if len(regions) != len(layout.regions):
            raise MetadataError(f"{len(regions)} region addresses for "
                                f"{len(layout.regions)} layout regions")
        regs = [(addr, n, dev) for addr, n, dev in _int_rows(d, "registrations", _EXTENT)]
        return cls(
            engine_id=d.string("engine_id"),
            agent_name=d.string("agent_name"),
            agent_metadata=agent_md,
            memory_type=memory_type,
            layout=layout,
            regions=tuple(regions),
            registrations=tuple(regs),
            generation=d.integer("generation", 0, _U64, default=0),
            incarnation=d.string("incarnation", max_chars=64, default=""),
        )
