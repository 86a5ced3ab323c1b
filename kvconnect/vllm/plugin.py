"""The extensible KV cache inside a running vLLM engine: a ``vllm.general_plugins`` plugin.

vLLM runs :func:`register` in every process of an engine (front end, engine core, each
worker) through the entry point ``kvconnect_extensible_kv`` (pyproject.toml). It does
nothing unless ``KVCONNECT_EXTENSIBLE_KV=1``; ``VLLM_PLUGINS`` (vLLM's allow-list of plugin
names) can leave it out as well. When on, it checks the vLLM version (0.32.x and 0.33.x;
any other is refused with :class:`UnsupportedVllmError` before anything is patched) and
replaces vLLM's one KV allocation, ``allocate_kv_cache`` (imported by name into the V1
runner, ``gpu_model_runner``, and the V2 runner, ``gpu/attn_utils``), with
:func:`kvconnect.vllm.engine_cache.allocate_extensible_kv_cache`: a VMM reservation of
``KVCONNECT_KV_CAPACITY_BYTES`` (default: the device's total memory), one block committed
first, then vLLM's final block count at the same addresses.

It also gives vLLM's workers three methods, for ``LLM.collective_rpc`` (names, not pickled
callables, cross the process boundary)::

    llm.collective_rpc("kvconnect_kv_cache_facts")    # [facts dict of each worker]
    llm.collective_rpc("kvconnect_release_kv_cache")  # sleep the KV cache (addresses kept)
    llm.collective_rpc("kvconnect_recommit_kv_cache") # wake it: zeroed, same addresses

and, where vLLM has sleep mode with connector ``unregister_kv_caches`` /
``restore_kv_caches`` (0.33), wraps the worker's ``sleep`` / ``wake_up`` so the KV memory is
released after the connectors deregistered and recommitted before they re-register.
Facts: docs/vllm-plugin.md.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

from .plugin_settings import (
    CAPACITY_ENV,
    ENTRY_POINT,
    SUPPORTED_VLLM_SERIES,
    SWITCH_ENV,
    PluginConfigError,
    UnsupportedVllmError,
    capacity_bytes_from_env,
    check_vllm_version,
    enabled,
)

logger = logging.getLogger(__name__)

__all__ = ["CAPACITY_ENV", "ENTRY_POINT", "SUPPORTED_VLLM_SERIES", "SWITCH_ENV",
           "PluginConfigError", "UnsupportedVllmError", "capacity_bytes_from_env",
           "check_vllm_version", "enabled", "install", "installed", "register"]

#: modules that hold ``allocate_kv_cache`` by name (missing ones are skipped)
_ALLOCATION_SITES = ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner",
                     "vllm.v1.worker.gpu.attn_utils")
#: what install() replaced: (module, attribute, original), so tests can see it and undo it
_patched: list[tuple[Any, str, Any]] = []


def installed() -> bool:
    """True once :func:`install` patched vLLM in this process."""
    return bool(_patched)


def register() -> None:
    """vLLM's plugin hook (every engine process). Off unless ``KVCONNECT_EXTENSIBLE_KV=1``:
    then nothing is imported or patched. On: checks the vLLM version and the settings, then
    :func:`install`. Raises (and patches nothing) on an unsupported version or a bad
    setting; vLLM lets a plugin's error stop the engine."""
    if not enabled():
        return
    import vllm

    check_vllm_version(vllm.__version__)
    capacity_bytes_from_env()  # a bad value fails here, in the front end, before any engine
    install()


def install() -> None:
    """Patch vLLM in this process (idempotent): the allocation sites, the workers' RPC
    methods and, where vLLM has connector sleep support, sleep / wake_up."""
    if _patched:
        return
    from . import engine_cache

    sites = []
    for name in _ALLOCATION_SITES:  # import all first: they bind the original by name
        try:
            sites.append(importlib.import_module(name))
        except ImportError:  # a runner this build lacks (e.g. V2 on an older vLLM)
            continue
    try:
        for module in sites:
            original = getattr(module, "allocate_kv_cache", None)
            if original is None:
                continue
            _set(module, "allocate_kv_cache",
                 functools.wraps(original)(functools.partial(
                     engine_cache.allocate_extensible_kv_cache, original=_unwrapped(original))))
        from vllm.v1.worker.worker_base import WorkerBase

        for method, impl in (("kvconnect_kv_cache_facts", engine_cache.worker_facts),
                             ("kvconnect_release_kv_cache", engine_cache.release_kv_cache),
                             ("kvconnect_recommit_kv_cache", engine_cache.recommit_kv_cache)):
            _set(WorkerBase, method, impl)
        _wrap_sleep(engine_cache)
    except BaseException:
        uninstall()
        raise
    logger.debug("kvconnect plugin installed: %s", [f"{m.__name__}.{a}" for m, a, _ in _patched])


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_kvconnect", False) else fn


def _set(owner: Any, attr: str, value: Any) -> None:
    original = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    try:
        value._kvconnect = True
    except AttributeError:
        pass
    _patched.append((owner, attr, original))
    setattr(owner, attr, value)


def _wrap_sleep(engine_cache: Any) -> None:
    """0.33: release after the connectors deregistered, recommit before they re-register.
    vLLM 0.32's connectors cannot deregister, so its sleep is left alone (the workers'
    ``kvconnect_release_kv_cache`` refuses there while a connector is configured)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.worker.gpu_worker import Worker

    if not hasattr(KVConnectorBase_V1, "unregister_kv_caches"):
        return
    sleep, wake_up = Worker.sleep, Worker.wake_up

    def kvconnect_sleep(self: Any, level: int = 1) -> None:
        sleep(self, level)  # deregisters the connectors, then suspends vLLM's own pools
        engine_cache.release_kv_cache(self, deregister=False)

    def kvconnect_wake_up(self: Any, tags: list[str] | None = None) -> None:
        if tags is None or "kv_cache" in tags:
            engine_cache.recommit_kv_cache(self, reregister=False)
        wake_up(self, tags)  # resumes vLLM's pools, then the connectors re-register

    _set(Worker, "sleep", functools.wraps(sleep)(kvconnect_sleep))
    _set(Worker, "wake_up", functools.wraps(wake_up)(kvconnect_wake_up))


def uninstall() -> None:
    """Undo :func:`install` in this process (for tests; an engine built meanwhile keeps the
    cache it was given)."""
    while _patched:
        owner, attr, original = _patched.pop()
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
