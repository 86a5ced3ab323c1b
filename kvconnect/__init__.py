"""kvconnect: KV-cache connector toolkit for extensible (VMM-backed) KV caches.

The committed extent is the only geometry a connector should ever see.
"""

from __future__ import annotations

from .ipc import IpcError, PeerMapping
from .kv_cache import ExtensibleKVCache, KVCacheStateError
from .layout import (
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
from .sizing import (
    InsufficientMemoryError,
    KVSizing,
    blocks_for_kv_cache_memory_bytes,
    blocks_for_utilization,
    committed_bytes_for_blocks,
    measure_non_kv_memory_bytes,
)
from .tensor import Chunk, ExportedChunk, ExtensibleTensor, VmmUnavailableError
from .views import (
    CommittedRegion,
    bound_packed_storage,
    committed_regions,
    narrow_kv_caches_to_num_blocks,
)
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
