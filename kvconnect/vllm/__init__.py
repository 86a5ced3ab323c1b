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
connector code: :mod:`kvconnect.connectors.vllm`.
"""

from __future__ import annotations

import importlib
from typing import Any

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
#: names that moved out of this package -> where they live now
_MOVED = {name: "kvconnect.connectors.vllm" for name in (
    "KvconnectNixlConnector", "KvconnectSimpleCPUOffloadConnector",
    "KvconnectOffloadingConnector")}


def load_export(exports: dict[str, str], package: str, name: str) -> Any:
    """``exports[name]`` (a module path) imported and its ``name`` returned, for a package's
    lazy ``__getattr__``; AttributeError for a name not exported, ImportError saying how to
    install vLLM when that module needs it."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != "vllm" and not str(exc.name).startswith("vllm."):
            raise
        raise ImportError(f"{package}.{name} needs vLLM 0.33: pip install "
                          f"'kvconnect[vllm]' (on CPU: make test-vllm builds .venv-vllm)"
                          ) from exc


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}: set vLLM's "
                             f"kv_connector_module_path to {_MOVED[name]!r}")
    value = load_export(_EXPORTS, __name__, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
