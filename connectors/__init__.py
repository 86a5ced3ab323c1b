"""KV connectors that take geometry only from the committed extent.

- :class:`NixlConnectorWorker`: NIXL/UCX registration of committed regions (one per physical
  chunk, deferred until the final commit), JSON handshake with a layout fingerprint, READs with
  deadlines, re-registration after sleep/wake. NIXL itself is imported lazily.
- :class:`CPUOffloadConnector`: a (pinned, on CUDA) CPU pool sized from committed per-block
  bytes, batched save/load with LRU slots.
"""

from __future__ import annotations

from .cpu_offload import (
    CPUOffloadConnector,
    OffloadHandle,
    OffloadKeyError,
    RowSlice,
    offload_row_layout,
)
from .errors import IncompatiblePeerError, KVConnectorError, KVTransferError
from .handshake import HandshakeMetadata, LayoutFingerprint, MetadataError
from .nixl import (
    NixlConnectorWorker,
    NixlUnavailableError,
    TransferResult,
    check_descriptors_in_chunks,
    layout_info_from_config,
    memory_type_for_device,
    nixl_available,
    region_descriptors,
    registration_extents,
    transfer_regions,
)

__all__ = [
    "CPUOffloadConnector",
    "HandshakeMetadata",
    "IncompatiblePeerError",
    "KVConnectorError",
    "KVTransferError",
    "LayoutFingerprint",
    "MetadataError",
    "NixlConnectorWorker",
    "NixlUnavailableError",
    "OffloadHandle",
    "OffloadKeyError",
    "RowSlice",
    "TransferResult",
    "check_descriptors_in_chunks",
    "layout_info_from_config",
    "memory_type_for_device",
    "nixl_available",
    "offload_row_layout",
    "region_descriptors",
    "registration_extents",
    "transfer_regions",
]
