"""KV connectors that take geometry only from the committed extent. The folder `connectors/`
installs as ``kvconnect.connectors`` (a setuptools ``package-dir`` mapping); sub-packages ``copy``,
``ipc``, ``nixl`` and ``offload`` hold one family each, and their internals are imported from
there (``kvconnect.connectors.nixl.worker``, ``kvconnect.connectors.copy.block_copy``, ...).

The public names:

- :class:`NixlRegionWorker`: NIXL/UCX registration of committed regions (one per physical
  chunk, deferred until the final commit), JSON handshake with a
  :class:`~kvconnect.peer_layout.PeerLayout`, READs with deadlines, re-registration after
  sleep/wake. NIXL itself is imported lazily.
- :class:`CPUOffloadConnector`: a (pinned, on CUDA) CPU pool sized from committed per-block
  bytes, batched save/load with LRU slots.
- :class:`BlockCopyPlan`: the block-copy engine (one launch per transfer over every layer,
  region and block; on CUDA one CUDA graph replay) under the CPU offload and the ipc transport.
- :class:`Transport`, :class:`Exporter` and :class:`MemoryRegistration`, described by one
  :class:`TransportSpec` each and found by name in the registry (:func:`get_transport`,
  :func:`transport_names`; built in: ``ipc`` and ``nixl``; another package adds one with
  :func:`register_transport`). Every transfer returns a :class:`FetchResult` (GB/s by
  :func:`kvconnect.gbps`).
"""

from __future__ import annotations

from .copy.block_copy import BlockCopyPlan
from .errors import IncompatiblePeerError, KVConnectorError, KVTransferError
from .nixl.worker import NixlRegionWorker
from .offload.connector import CPUOffloadConnector
from .registry import get_transport, load_transport_modules, register_transport, transport_names
from .transport import (
    Exporter,
    FetchResult,
    MemoryRegistration,
    Transport,
    TransportContext,
    TransportSpec,
)

__all__ = [
    "BlockCopyPlan",
    "CPUOffloadConnector",
    "Exporter",
    "FetchResult",
    "IncompatiblePeerError",
    "KVConnectorError",
    "KVTransferError",
    "MemoryRegistration",
    "NixlRegionWorker",
    "Transport",
    "TransportContext",
    "TransportSpec",
    "get_transport",
    "load_transport_modules",
    "register_transport",
    "transport_names",
]
