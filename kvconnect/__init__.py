"""kvconnect: KV-cache connector toolkit for extensible (VMM-backed) KV caches.

The committed extent is the only geometry a connector should ever see.
"""

from __future__ import annotations

from .ipc import IpcError, PeerMapping
from .tensor import Chunk, ExportedChunk, ExtensibleTensor, VmmUnavailableError
from .vmm import (
    DeviceCapabilities,
    GrantedFlags,
    VmmDriver,
    VmmError,
    VmmProbe,
    get_vmm_driver,
    probe_vmm,
)

__version__ = "0.1.0"

__all__ = [
    "Chunk",
    "DeviceCapabilities",
    "ExportedChunk",
    "ExtensibleTensor",
    "GrantedFlags",
    "IpcError",
    "PeerMapping",
    "VmmDriver",
    "VmmError",
    "VmmProbe",
    "VmmUnavailableError",
    "__version__",
    "get_vmm_driver",
    "probe_vmm",
]
