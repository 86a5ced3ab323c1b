"""Handshake metadata for KV connectors: a layout fingerprint plus NIXL agent metadata, as JSON.

Both sides of a transfer publish :class:`HandshakeMetadata`; the reading side loads the remote
one with :meth:`HandshakeMetadata.from_json` (size-bounded, type-checked: it comes from another
process, so it is never unpickled) and compares fingerprints with
:meth:`LayoutFingerprint.differences` before any transfer.

Units: bytes for ``block_len`` / ``block_stride`` / addresses / lengths, tokens for
``block_size``, blocks for ``num_blocks``.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvconnect.bounded_json import BoundedJSONError
from kvconnect.bounded_json import loads as bounded_loads
from kvconnect.checks import checked_int

from ..errors import KVConnectorError

__all__ = [
    "HANDSHAKE_SCHEMA",
    "MAX_METADATA_BYTES",
    "HandshakeMetadata",
    "LayoutFingerprint",
    "MetadataError",
    "RegionAddress",
    "RegionFingerprint",
    "kvconnect_version",
    "layout_fingerprint",
]

#: schema tag written into every metadata document; a different tag is rejected.
HANDSHAKE_SCHEMA = "kvconnect.nixl.handshake/1"
#: largest metadata document accepted from a peer, in bytes.
MAX_METADATA_BYTES = 64 * 1024 * 1024
_MAX_STR = 4096
_MAX_ITEMS = 1 << 20
_U64 = (1 << 64) - 1


class MetadataError(KVConnectorError, ValueError):
    """Peer metadata is malformed, too large or of an unknown schema."""


def kvconnect_version() -> str:
    """The installed kvconnect version string (``"unknown"`` when it cannot be determined)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("kvconnect")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover - stdlib always has it on 3.10+
        pass
    try:
        import kvconnect

        return str(getattr(kvconnect, "__version__", "unknown"))
    except ImportError:  # pragma: no cover
        return "unknown"


# -- validation helpers --------------------------------------------------------------------------

def _req(doc: dict, key: str, where: str) -> Any:
    if key not in doc:
        raise MetadataError(f"{where}: missing field {key!r}")
    return doc[key]


def _int(value: Any, what: str, lo: int = 0, hi: int = _U64) -> int:
    try:
        return checked_int(what, value, minimum=lo, maximum=hi)
    except ValueError as exc:
        raise MetadataError(str(exc)) from None


def _opt_int(value: Any, what: str) -> int | None:
    return None if value is None else _int(value, what)


def _str(value: Any, what: str, max_len: int = _MAX_STR) -> str:
    if not isinstance(value, str):
        raise MetadataError(f"{what} must be a string, got {type(value).__name__}")
    if len(value) > max_len:
        raise MetadataError(f"{what} is {len(value)} characters long (limit {max_len})")
    return value


def _opt_str(value: Any, what: str) -> str | None:
    return None if value is None else _str(value, what)


def _list(value: Any, what: str, max_items: int = _MAX_ITEMS) -> list:
    if not isinstance(value, list):
        raise MetadataError(f"{what} must be a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise MetadataError(f"{what} has {len(value)} items (limit {max_items})")
    return value


def _dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise MetadataError(f"{what} must be an object, got {type(value).__name__}")
    return value


# -- fingerprint ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RegionFingerprint:
    """The geometry of one registration region that both peers must agree on (bytes)."""

    layer_name: str
    part: str
    block_len: int
    block_stride: int

    @property
    def key(self) -> str:
        """``"layer/part"``, the name used to pair regions across peers and in messages."""
        return f"{self.layer_name}/{self.part}"


@dataclass(frozen=True)
class LayoutFingerprint:
    """What must match between two peers before blocks can be copied between them.

    ``block_size`` is in tokens; ``dtype`` is the KV dtype name (e.g. ``"bfloat16"``, several
    joined by ``","`` for Mamba states); ``layout`` the physical layout name (``"kv_split_hnd"``
    and ``"kv_split_nhd"`` have equal block lengths but different byte orders);
    ``kernel_block_size`` the kernel block split in tokens. A field that is ``None`` on either
    side is not compared. ``kvconnect_version`` is informational (reports show it); the wire
    schema, not the package version, decides whether two peers can talk.
    """

    regions: tuple[RegionFingerprint, ...]
    block_size: int | None = None
    dtype: str | None = None
    layout: str | None = None
    kernel_block_size: int | None = None
    kvconnect_version: str = field(default_factory=kvconnect_version)
    #: every layer whose KV lives in the regions (a packed region holds all layers); empty
    #: means "the regions' layer names"
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        names = tuple(self.layer_names) or tuple(dict.fromkeys(r.layer_name for r in self.regions))
        object.__setattr__(self, "layer_names", names)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @property
    def layers(self) -> tuple[str, ...]:
        """Every layer name (``layer_names``; by default the regions' own, deduplicated)."""
        return self.layer_names

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            "dtype": self.dtype,
            "layout": self.layout,
            "kernel_block_size": self.kernel_block_size,
            "kvconnect_version": self.kvconnect_version,
            "num_regions": self.num_regions,
            "layers": list(self.layers),
            "regions": [
                {"layer": r.layer_name, "part": r.part, "block_len": r.block_len,
                 "block_stride": r.block_stride}
                for r in self.regions
            ],
        }

    @classmethod
    def from_json_dict(cls, doc: Any) -> LayoutFingerprint:
        doc = _dict(doc, "fingerprint")
        regions = []
        for i, item in enumerate(_list(_req(doc, "regions", "fingerprint"), "fingerprint.regions")):
            where = f"fingerprint.regions[{i}]"
            item = _dict(item, where)
            block_len = _int(_req(item, "block_len", where), f"{where}.block_len", 1)
            stride = _int(_req(item, "block_stride", where), f"{where}.block_stride", 1)
            regions.append(RegionFingerprint(
                layer_name=_str(_req(item, "layer", where), f"{where}.layer"),
                part=_str(_req(item, "part", where), f"{where}.part"),
                block_len=block_len, block_stride=stride))
        layers = tuple(_str(x, f"fingerprint.layers[{i}]")
                       for i, x in enumerate(_list(doc.get("layers", []), "fingerprint.layers")))
        keys = [r.key for r in regions]
        if len(set(keys)) != len(keys):
            raise MetadataError("fingerprint.regions lists a layer/part twice")
        num = _int(_req(doc, "num_regions", "fingerprint"), "fingerprint.num_regions")
        if num != len(regions):
            raise MetadataError(f"fingerprint.num_regions = {num} but {len(regions)} regions listed")
        return cls(
            regions=tuple(regions),
            block_size=_opt_int(doc.get("block_size"), "fingerprint.block_size"),
            dtype=_opt_str(doc.get("dtype"), "fingerprint.dtype"),
            layout=_opt_str(doc.get("layout"), "fingerprint.layout"),
            kernel_block_size=_opt_int(doc.get("kernel_block_size"),
                                       "fingerprint.kernel_block_size"),
            kvconnect_version=_str(_req(doc, "kvconnect_version", "fingerprint"),
                                   "fingerprint.kvconnect_version"),
            layer_names=layers,
        )

    def differences(self, remote: LayoutFingerprint) -> list[str]:
        """Readable differences between this (local) fingerprint and ``remote``; empty if compatible.

        Regions are paired by ``layer/part`` (order may differ). Example entry:
        ``"block_len of layer model.layers.0/k: local 4096 != remote 8192"``.
        """
        diffs: list[str] = []
        # The package version is reported, never compared: peers of different kvconnect
        # releases talk as long as the wire schema (HANDSHAKE_SCHEMA, checked on parse) and
        # the layout agree, as vLLM's NIXL connector compares a protocol version.
        if (self.block_size is not None and remote.block_size is not None
                and self.block_size != remote.block_size):
            diffs.append(f"block_size (tokens): local {self.block_size} != remote {remote.block_size}")
        for name in ("dtype", "layout", "kernel_block_size"):
            mine, theirs_v = getattr(self, name), getattr(remote, name)
            if mine is not None and theirs_v is not None and mine != theirs_v:
                diffs.append(f"{name}: local {mine} != remote {theirs_v}")
        if len(self.layers) != len(remote.layers):
            diffs.append(f"number of layers: local {len(self.layers)} != remote {len(remote.layers)}")
        elif self.layers != remote.layers:
            diffs.append(f"layer names: local {_short(list(self.layers))} != remote "
                         f"{_short(list(remote.layers))}")
        if self.num_regions != remote.num_regions:
            diffs.append(f"number of regions: local {self.num_regions} != remote {remote.num_regions}")
        theirs = {r.key: r for r in remote.regions}
        ours = {r.key: r for r in self.regions}
        missing = [k for k in ours if k not in theirs]
        extra = [k for k in theirs if k not in ours]
        if missing:
            diffs.append(f"regions missing on remote: {_short(missing)}")
        if extra:
            diffs.append(f"regions only on remote: {_short(extra)}")
        for key, mine in ours.items():
            other = theirs.get(key)
            if other is None:
                continue
            if mine.block_len != other.block_len:
                diffs.append(f"block_len of layer {key}: local {mine.block_len} != "
                             f"remote {other.block_len}")
            if mine.block_stride != other.block_stride:
                diffs.append(f"block_stride of layer {key}: local {mine.block_stride} != "
                             f"remote {other.block_stride}")
        return diffs


def _short(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def layout_fingerprint(regions: Sequence[Any], *, block_size: int | None = None,
                       dtype: str | None = None, layout: str | None = None,
                       kernel_block_size: int | None = None) -> LayoutFingerprint:
    """Fingerprint of committed regions (objects with ``layer_name``, ``part``, ``block_len``,
    ``block_stride``, e.g. :class:`kvconnect.views.CommittedRegion`) plus config facts."""
    layers: dict[str, None] = {}
    for r in regions:
        for name in (getattr(r, "layers", ()) or (r.layer_name,)):
            layers.setdefault(str(name))
    return LayoutFingerprint(
        regions=tuple(RegionFingerprint(str(r.layer_name), str(r.part), int(r.block_len),
                                        int(r.block_stride)) for r in regions),
        layer_names=tuple(layers),
        block_size=None if block_size is None else int(block_size),
        dtype=None if dtype is None else str(dtype),
        layout=None if layout is None else str(layout),
        kernel_block_size=None if kernel_block_size is None else int(kernel_block_size),
    )


# -- full metadata document ----------------------------------------------------------------------

@dataclass(frozen=True)
class RegionAddress:
    """Where one region lives in the publishing process: base address (bytes), committed block
    count, and the NIXL device id (0 for DRAM, the GPU index for VRAM)."""

    base_ptr: int
    num_blocks: int
    device_id: int = 0


@dataclass(frozen=True)
class HandshakeMetadata:
    """Everything a peer needs to read our blocks: agent metadata, layout and addresses.

    ``regions[i]`` is the address of ``fingerprint.regions[i]``. ``registrations`` are the
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
    fingerprint: LayoutFingerprint
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
            "fingerprint": self.fingerprint.to_json_dict(),
            "regions": [[r.base_ptr, r.num_blocks, r.device_id] for r in self.regions],
            "registrations": [list(x) for x in self.registrations],
        }
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | bytearray | str,
                  max_bytes: int = MAX_METADATA_BYTES) -> HandshakeMetadata:
        """Parse and validate a peer's metadata; raises :class:`MetadataError` on anything off
        (including ``data`` that is not bytes or text at all)."""
        if not isinstance(data, (bytes, bytearray, str)):
            raise MetadataError(f"peer metadata must be JSON bytes or text, got "
                                f"{type(data).__name__}")
        size = len(data.encode("utf-8")) if isinstance(data, str) else len(data)
        if size > max_bytes:
            raise MetadataError(f"peer metadata is {size} bytes, above the {max_bytes}-byte limit")
        try:  # nesting depth and integer digits bounded: no RecursionError, no 4300-digit ints
            doc = bounded_loads(data)
        except BoundedJSONError as exc:
            raise MetadataError(f"peer metadata is not valid JSON: {exc}") from None
        doc = _dict(doc, "metadata")
        schema = _str(_req(doc, "schema", "metadata"), "schema")
        if schema != HANDSHAKE_SCHEMA:
            raise MetadataError(f"unknown metadata schema {schema!r} (expected {HANDSHAKE_SCHEMA!r})")
        b64 = _str(_req(doc, "agent_metadata_b64", "metadata"), "agent_metadata_b64",
                   max_len=max_bytes)
        try:
            agent_md = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MetadataError(f"agent_metadata_b64 is not valid base64: {exc}") from None
        if not agent_md:
            raise MetadataError("agent_metadata_b64 is empty")
        memory_type = _str(_req(doc, "memory_type", "metadata"), "memory_type")
        if memory_type not in ("DRAM", "VRAM"):
            raise MetadataError(f"memory_type must be 'DRAM' or 'VRAM', got {memory_type!r}")
        fingerprint = LayoutFingerprint.from_json_dict(_req(doc, "fingerprint", "metadata"))
        regions = []
        for i, item in enumerate(_list(_req(doc, "regions", "metadata"), "regions")):
            item = _list(item, f"regions[{i}]", 3)
            if len(item) != 3:
                raise MetadataError(f"regions[{i}] must be [base_ptr, num_blocks, device_id]")
            regions.append(RegionAddress(_int(item[0], f"regions[{i}].base_ptr"),
                                         _int(item[1], f"regions[{i}].num_blocks", 0, 1 << 40),
                                         _int(item[2], f"regions[{i}].device_id", 0, 1 << 16)))
        if len(regions) != fingerprint.num_regions:
            raise MetadataError(f"{len(regions)} region addresses for "
                                f"{fingerprint.num_regions} fingerprint regions")
        regs = []
        for i, item in enumerate(_list(_req(doc, "registrations", "metadata"), "registrations")):
            item = _list(item, f"registrations[{i}]", 3)
            if len(item) != 3:
                raise MetadataError(f"registrations[{i}] must be [addr, length, device_id]")
            regs.append((_int(item[0], f"registrations[{i}].addr"),
                         _int(item[1], f"registrations[{i}].length", 1),
                         _int(item[2], f"registrations[{i}].device_id", 0, 1 << 16)))
        return cls(
            engine_id=_str(_req(doc, "engine_id", "metadata"), "engine_id"),
            agent_name=_str(_req(doc, "agent_name", "metadata"), "agent_name"),
            agent_metadata=agent_md,
            memory_type=memory_type,
            fingerprint=fingerprint,
            regions=tuple(regions),
            registrations=tuple(regs),
            generation=_int(doc.get("generation", 0), "generation"),
            incarnation=_str(doc.get("incarnation", ""), "incarnation", max_len=64),
        )
