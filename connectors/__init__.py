"""KV connectors that take geometry only from the committed extent. The folder `connectors/`
installs as ``kvconnect.connectors`` (a setuptools ``package-dir`` mapping); sub-packages ``copy``,
``ipc``, ``nixl`` and ``offload`` hold one family each.

- :class:`NixlRegionWorker`: NIXL/UCX registration of committed regions (one per physical
  chunk, deferred until the final commit), JSON handshake with a
  :class:`~kvconnect.peer_layout.PeerLayout`, READs with deadlines, re-registration after
  sleep/wake. NIXL itself is imported lazily.
- :class:`CPUOffloadConnector`: a (pinned, on CUDA) CPU pool sized from committed per-block
  bytes, batched save/load with LRU slots.
- :class:`BlockCopyPlan`: the block-copy engine (one launch per transfer over every layer,
  region and block; on CUDA one CUDA graph replay) under the CPU offload and the ipc
  transport; several requests merge into one launch (``copy_many``,
  :meth:`IpcTransport.fetch_many`, :meth:`IpcTransport.start` -> :class:`PendingFetch`).
- :class:`Transport`, :class:`Exporter` and :class:`MemoryRegistration`, described by one
  :class:`TransportSpec` each and found by name in the registry (:func:`get_transport`;
  :func:`register_builtin_transports` adds ``ipc``: :class:`IpcTransport`,
  :class:`IpcExportServer`, and ``nixl``: :class:`NixlTransport`, :class:`NixlRegistration`).
  Every transfer returns a :class:`FetchResult` (GB/s by :func:`kvconnect.gbps`).
"""

from __future__ import annotations

from .copy.block_copy import COPY_METHODS, LAUNCH_MODES, BlockCopyPlan, BlockRegion, block_runs
from .errors import IncompatiblePeerError, KVConnectorError, KVTransferError
from .ipc.transport import IpcExportServer, IpcTransport, PendingFetch
from .nixl.handshake import HandshakeMetadata, MetadataError
from .nixl.transport import NixlRegistration, NixlTransport, slow_gpu_lane_advice
from .nixl.worker import (
    NixlRegionWorker,
    NixlUnavailableError,
    check_descriptors_in_chunks,
    memory_type_for_device,
    nixl_importable,
    region_descriptors,
    registration_extents,
    transfer_regions,
)
from .offload.connector import (
    CPUOffloadConnector,
    OffloadHandle,
    OffloadKeyError,
    RowSlice,
    offload_row_layout,
)
from .offload.slots import LruSlots
from .registry import (
    TransportModuleError,
    UnknownTransportError,
    get_transport,
    load_transport_modules,
    register_builtin_transports,
    register_transport,
    transport_names,
)
from .transport import (
    Exporter,
    FetchResult,
    MemoryRegistration,
    Transport,
    TransportContext,
    TransportSpec,
)

__all__ = [
    "COPY_METHODS",
    "LAUNCH_MODES",
    "BlockCopyPlan",
    "BlockRegion",
    "CPUOffloadConnector",
    "Exporter",
    "FetchResult",
    "IpcExportServer",
    "IpcTransport",
    "LruSlots",
    "MemoryRegistration",
    "NixlRegistration",
    "NixlTransport",
    "PendingFetch",
    "Transport",
    "TransportContext",
    "TransportModuleError",
    "TransportSpec",
    "UnknownTransportError",
    "block_runs",
    "get_transport",
    "load_transport_modules",
    "register_builtin_transports",
    "register_transport",
    "transport_names",
    "HandshakeMetadata",
    "IncompatiblePeerError",
    "KVConnectorError",
    "KVTransferError",
    "MetadataError",
    "NixlRegionWorker",
    "NixlUnavailableError",
    "OffloadHandle",
    "OffloadKeyError",
    "RowSlice",
    "check_descriptors_in_chunks",
    "memory_type_for_device",
    "nixl_importable",
    "offload_row_layout",
    "region_descriptors",
    "registration_extents",
    "slow_gpu_lane_advice",
    "transfer_regions",
]
