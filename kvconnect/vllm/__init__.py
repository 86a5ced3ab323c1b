"""kvconnect for vLLM 0.33: its objects in, committed-memory geometry out, patched connectors.

Importing ``kvconnect.vllm`` does not import vLLM (nor does ``import kvconnect``); the names
below load on first use, and those marked (vLLM) need vLLM 0.33 installed
(``pip install 'kvconnect[vllm]'``, or ``make test-vllm`` on CPU).

- :func:`config_from_vllm`: vLLM's ``KVCacheConfig`` -> kvconnect's (by its fields). The
  helpers in :mod:`kvconnect.views` call it themselves, so
  ``narrow_kv_caches_to_num_blocks(kv_caches, n, vllm_kv_cache_config)`` just works.
- :class:`VllmKVCache` (vLLM): an extensible cache whose views are exactly what vLLM's
  ``create_kv_cache_views`` builds over the reservation.
- :func:`bound_for_connector` (vLLM): views and config bounded to the committed blocks.
- :func:`resize_kv_cache` (vLLM, plugin on): grow or shrink a running engine's KV cache at
  the same addresses (:func:`kv_cache_resize_status`, :func:`elastic_facts`,
  :class:`KVCacheResizeError`; the optional policy's knobs: :class:`ElasticPolicy`).

vLLM's connectors patched to see only committed memory (``KvconnectNixlConnector``, ...) are
connector code: :mod:`kvconnect.connectors.vllm`. The conformance kit for connector authors
is a command: :mod:`kvconnect.harness.conformance`.
"""

from __future__ import annotations

from typing import Any

from kvconnect.lazy_exports import lazy_exports

#: public name -> module that defines it (relative names are inside kvconnect.vllm)
_EXPORTS: dict[str, str] = {
    "config_from_vllm": "kvconnect.layout.foreign",
    "spec_from_vllm": "kvconnect.layout.foreign",
    "to_vllm_config": "kvconnect.layout.foreign",
    "VllmKVCache": "kvconnect.vllm.cache",
    "bound_for_connector": "kvconnect.vllm.bounding",
    "BoundedKVCaches": "kvconnect.vllm.bounding",
    "prepare_cpu_runtime": "kvconnect.vllm.runtime",
    "vllm_available": "kvconnect.vllm.runtime",
    "PluginConfigError": "kvconnect.vllm.plugin_settings",
    "UnsupportedVllmError": "kvconnect.vllm.plugin_settings",
    "kv_cache_facts": "kvconnect.vllm.engine_cache",
    "resize_kv_cache": "kvconnect.vllm.elastic",
    "kv_cache_resize_status": "kvconnect.vllm.elastic",
    "elastic_facts": "kvconnect.vllm.elastic",
    "KVCacheResizeError": "kvconnect.vllm.elastic",
    "ElasticPolicy": "kvconnect.vllm.plugin_settings",
    "write_tiny_llama": "kvconnect.vllm.tiny_model",
    "install_simple_cpu_offload_host_stand_ins": "kvconnect.vllm.host_stand_ins",
}

__all__ = sorted(_EXPORTS)
#: what :func:`~kvconnect.lazy_exports.lazy_exports` says a name that needs vLLM needs
VLLM_NEEDED = ("vllm", "vLLM 0.33: pip install 'kvconnect[vllm]' (on CPU: make test-vllm "
                       "builds .venv-vllm)")
#: names that moved out of this package -> where they live now
_MOVED = {name: "kvconnect.connectors.vllm" for name in (
    "KvconnectNixlConnector", "KvconnectSimpleCPUOffloadConnector",
    "KvconnectOffloadingConnector")}


_load, __dir__ = lazy_exports(__name__, _EXPORTS, needs=VLLM_NEEDED)


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}: set vLLM's "
                             f"kv_connector_module_path to {_MOVED[name]!r}")
    return _load(name)
