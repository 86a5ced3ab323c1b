"""kvconnect: KV-cache connector toolkit for extensible (VMM-backed) KV caches.

The committed extent is the only geometry a connector should ever see.

Public names load lazily (``import kvconnect`` does not import torch until one is used),
so that command-line tools such as ``kvconnect-validate --help`` start fast. They are listed
once, in ``_MODULE_EXPORTS``; ``__all__`` and attribute lookup derive from it. The connectors
(``kvconnect.connectors``), the harness (``kvconnect.harness``) and the vLLM integration
(``kvconnect.vllm``) are sub-packages with their own exports. Every error any of them raises
derives from :class:`KvconnectError` (``kvconnect.errors``).
"""

from __future__ import annotations

from .lazy_exports import lazy_exports as _lazy_exports

__version__ = "0.1.0"

#: submodule -> the public names it defines (the one list of kvconnect's exports)
_MODULE_EXPORTS: dict[str, tuple[str, ...]] = {
    "errors": ("KvconnectError",),
    "block_ids": ("BlockIds", "BlockIdsError", "as_block_ids", "merged_block_ids",),
    "bounded_json": ("JSON", "JSONObject",),
    "cache_source": ("KVCacheSource",),
    "framing": ("IpcError", "PeerError", "PeerRefusedError",),
    "ipc": ("PeerMapping",),
    "child": ("Child", "LineReader", "LineWriter", "exit_signal_name", "exit_text",),
    "kv_cache": ("ExtensibleKVCache", "KVCacheStateError",),
    "layout": (
        "LAYOUTS", "PRESETS", "VLLM_LAYOUTS", "placement_config", "AttentionSpec",
        "FullAttentionSpec", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "KVCacheTensor",
        "LayoutError", "LayoutPlan", "MambaSpec", "MLAAttentionSpec", "SlidingWindowSpec",
        "plan_layout", "preset",
    ),
    "layout.foreign": ("config_from_vllm",),
    "sizing": (
        "InsufficientMemoryError", "KVSizing", "blocks_for_kv_cache_memory_bytes",
        "blocks_for_utilization", "committed_bytes_for_blocks", "measure_non_kv_memory_bytes",
    ),
    "tensor": ("Chunk", "ExportedChunk", "ExtensibleTensor", "VmmUnavailableError",),
    "lifetime": ("LiveViewsError",),
    "undo": ("UndoStack",),
    "units": ("gbps",),
    "ports": ("ephemeral_port_range", "free_tcp_port",),
    "polling": ("poll_until",),
    "peer_layout": (
        "PEER_LAYOUT_SCHEMA", "LayoutFacts", "LayoutRegion", "PeerLayout", "PeerLayoutError",
        "layout_facts",
    ),
    "views": (
        "CommittedRegion", "PagedRegion", "block_span", "bound_packed_storage",
        "committed_regions", "narrow_kv_caches_to_num_blocks", "page_holders", "page_owners",
    ),
    "vmm": (
        "AllocationOptions", "DeviceCapabilities", "GrantedFlags", "VmmDriver", "VmmError",
        "VmmProbe", "get_vmm_driver", "probe_vmm",
    ),
}
#: public name -> submodule that defines it
_EXPORTS: dict[str, str] = {name: f".{module}" for module, names in _MODULE_EXPORTS.items()
                            for name in names}

__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
