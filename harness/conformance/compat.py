"""What differs between the vLLM versions the kit supports (0.32 and 0.33), in one place.

- ``get_kv_cache_config_from_groups``: ``vllm.v1.core.kv_cache_planning`` in 0.33,
  ``vllm.v1.core.kv_cache_utils`` in 0.32 (:func:`kv_cache_config_from_groups`).
- Connector sleep hooks: 0.33's ``KVConnectorBase_V1`` has ``unregister_kv_caches`` /
  ``restore_kv_caches``; 0.32's has neither (:func:`sleep_hooks`).

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["SUPPORTED_VLLM", "kv_cache_config_from_groups", "kv_cache_planning_module",
           "sleep_hooks", "vllm_version"]

#: vLLM release series the kit runs on
SUPPORTED_VLLM = ("0.32", "0.33")

_PLANNING_MODULES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")


def vllm_version() -> str:
    """The installed vLLM's version (``vllm.__version__``)."""
    import vllm

    return str(vllm.__version__)


def kv_cache_planning_module() -> Any:
    """The module holding ``get_kv_cache_config_from_groups`` in this vLLM."""
    for name in _PLANNING_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "get_kv_cache_config_from_groups"):
            return mod
    raise ImportError(f"vLLM {vllm_version()} has get_kv_cache_config_from_groups in none of "
                      f"{', '.join(_PLANNING_MODULES)} (the kit supports vLLM "
                      f"{' and '.join(SUPPORTED_VLLM)})")


def kv_cache_config_from_groups(vllm_config: Any, groups: list[Any],
                                available_memory: int) -> Any:
    """vLLM's ``get_kv_cache_config_from_groups`` (``available_memory`` in bytes)."""
    return kv_cache_planning_module().get_kv_cache_config_from_groups(
        vllm_config, groups, available_memory)


def sleep_hooks(connector: Any) -> tuple[Any, Any] | None:
    """``(unregister_kv_caches, restore_kv_caches)`` bound to ``connector``, or None when
    this vLLM's connector API has no such hooks (0.32)."""
    unregister = getattr(connector, "unregister_kv_caches", None)
    restore = getattr(connector, "restore_kv_caches", None)
    if unregister is None or restore is None:
        return None
    return unregister, restore
