"""kvconnect: KV-cache connector toolkit for extensible (VMM-backed) KV caches.

The committed extent is the only geometry a connector should ever see.

Public names load lazily (``import kvconnect`` does not import torch until one is used),
so that command-line tools such as ``kvconnect-validate --help`` start fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> submodule that defines it
_EXPORTS: dict[str, str] = {
    "IpcError": "framing",
    "PeerError": "framing",
    "PeerRefusedError": "framing",
    "PeerMapping": "ipc",
    "PeerSession": "session",
    "accept_session": "session",
    "connect_session": "session",
    "ExtensibleKVCache": "kv_cache",
    "KVCacheStateError": "kv_cache",
    "LAYOUTS": "layout",
    "PRESETS": "layout",
    "AttentionSpec": "layout",
    "FullAttentionSpec": "layout",
    "KVCacheConfig": "layout",
    "KVCacheGroupSpec": "layout",
    "KVCacheSpec": "layout",
    "KVCacheTensor": "layout",
    "LayoutError": "layout",
    "LayoutPlan": "layout",
    "MambaSpec": "layout",
    "MLAAttentionSpec": "layout",
    "SlidingWindowSpec": "layout",
    "plan_layout": "layout",
    "preset": "layout",
    "InsufficientMemoryError": "sizing",
    "KVSizing": "sizing",
    "blocks_for_kv_cache_memory_bytes": "sizing",
    "blocks_for_utilization": "sizing",
    "committed_bytes_for_blocks": "sizing",
    "measure_non_kv_memory_bytes": "sizing",
    "Chunk": "tensor",
    "ExportedChunk": "tensor",
    "ExtensibleTensor": "tensor",
    "LiveViewsError": "lifetime",
    "VmmUnavailableError": "tensor",
    "UndoStack": "undo",
    "poll_until": "polling",
    "CommittedRegion": "views",
    "bound_packed_storage": "views",
    "committed_regions": "views",
    "narrow_kv_caches_to_num_blocks": "views",
    "AllocationOptions": "vmm",
    "DeviceCapabilities": "vmm",
    "GrantedFlags": "vmm",
    "VmmDriver": "vmm",
    "VmmError": "vmm",
    "VmmProbe": "vmm",
    "get_vmm_driver": "vmm",
    "probe_vmm": "vmm",
}

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .framing import IpcError, PeerError, PeerRefusedError  # noqa: F401
    from .ipc import PeerMapping  # noqa: F401
    from .kv_cache import ExtensibleKVCache, KVCacheStateError  # noqa: F401
    from .layout import (  # noqa: F401
        LAYOUTS,
        PRESETS,
        AttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        KVCacheTensor,
        LayoutError,
        LayoutPlan,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        plan_layout,
        preset,
    )
    from .lifetime import LiveViewsError  # noqa: F401
    from .polling import poll_until  # noqa: F401
    from .session import PeerSession, accept_session, connect_session  # noqa: F401
    from .sizing import (  # noqa: F401
        InsufficientMemoryError,
        KVSizing,
        blocks_for_kv_cache_memory_bytes,
        blocks_for_utilization,
        committed_bytes_for_blocks,
        measure_non_kv_memory_bytes,
    )
    from .tensor import Chunk, ExportedChunk, ExtensibleTensor, VmmUnavailableError  # noqa: F401
    from .undo import UndoStack  # noqa: F401
    from .views import (  # noqa: F401
        CommittedRegion,
        bound_packed_storage,
        committed_regions,
        narrow_kv_caches_to_num_blocks,
    )
    from .vmm import (  # noqa: F401
        AllocationOptions,
        DeviceCapabilities,
        GrantedFlags,
        VmmDriver,
        VmmError,
        VmmProbe,
        get_vmm_driver,
        probe_vmm,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "LAYOUTS",
    "PRESETS",
    "AttentionSpec",
    "Chunk",
    "CommittedRegion",
    "ExtensibleKVCache",
    "FullAttentionSpec",
    "InsufficientMemoryError",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheStateError",
    "KVCacheTensor",
    "KVSizing",
    "LayoutError",
    "LayoutPlan",
    "MLAAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "blocks_for_kv_cache_memory_bytes",
    "blocks_for_utilization",
    "bound_packed_storage",
    "committed_bytes_for_blocks",
    "committed_regions",
    "measure_non_kv_memory_bytes",
    "narrow_kv_caches_to_num_blocks",
    "plan_layout",
    "preset",
    "AllocationOptions",
    "DeviceCapabilities",
    "ExportedChunk",
    "ExtensibleTensor",
    "GrantedFlags",
    "IpcError",
    "LiveViewsError",
    "PeerError",
    "PeerMapping",
    "PeerRefusedError",
    "PeerSession",
    "UndoStack",
    "accept_session",
    "connect_session",
    "VmmDriver",
    "VmmError",
    "VmmProbe",
    "VmmUnavailableError",
    "__version__",
    "get_vmm_driver",
    "poll_until",
    "probe_vmm",
]
