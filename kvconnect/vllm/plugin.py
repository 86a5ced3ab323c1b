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
first, then vLLM's final block count at the same addresses. Modules are patched when they
are imported (an import hook; those already imported at once), so the front end, which
never allocates a KV cache, imports nothing more for the plugin.

It also gives vLLM's workers three methods, for ``LLM.collective_rpc`` (names, not pickled
callables, cross the process boundary)::

    llm.collective_rpc("kvconnect_kv_cache_facts")    # [facts dict of each worker]
    llm.collective_rpc("kvconnect_release_kv_cache")  # sleep the KV cache (addresses kept)
    llm.collective_rpc("kvconnect_recommit_kv_cache") # wake it: zeroed, same addresses

and elastic capacity: ``Worker.kvconnect_resize_kv_cache`` (the engine core calls it) and
``EngineCore.kvconnect_resize_kv_cache`` / ``kvconnect_resize_status`` /
``kvconnect_elastic_facts`` (engine-core utilities; :func:`kvconnect.vllm.resize_kv_cache`
calls them), with a tick after each engine step (:mod:`kvconnect.vllm.elastic_core`).

and, where vLLM has sleep mode with connector ``unregister_kv_caches`` /
``restore_kv_caches`` (0.33), wraps the worker's ``sleep`` / ``wake_up`` so the KV memory is
released after the connectors deregistered and recommitted before they re-register.
Facts: docs/vllm-plugin.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from .plugin_settings import (
    CAPACITY_ENV,
    ENTRY_POINT,
    SUPPORTED_VLLM_SERIES,
    SWITCH_ENV,
    PluginConfigError,
    UnsupportedVllmError,
    check_vllm_version,
    settings,
)

logger = logging.getLogger(__name__)

__all__ = ["CAPACITY_ENV", "ENTRY_POINT", "SUPPORTED_VLLM_SERIES", "SWITCH_ENV",
           "PluginConfigError", "UnsupportedVllmError", "check_vllm_version", "install",
           "installed", "patched_sites", "register", "uninstall"]

#: modules that hold ``allocate_kv_cache`` by name (a build may lack some)
_ALLOCATION_SITES = ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner",
                     "vllm.v1.worker.gpu.attn_utils")
_WORKER_BASE = "vllm.v1.worker.worker_base"
_GPU_WORKER = "vllm.v1.worker.gpu_worker"
_ENGINE_CORE = "vllm.v1.engine.core"
#: what was replaced: (module or class, attribute, original), so uninstall() can undo it
_patched: list[tuple[Any, str, Any]] = []
#: the import hook while installed
_hook: list[_PatchAfterImport] = []


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then ``patch`` on the fresh module; everything else (sources,
    resources) is the real loader's."""

    def __init__(self, loader: Any, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    """Patches vLLM's worker modules when (and in whichever process) they are imported, so
    the front end, which never allocates a KV cache, imports none of them for the plugin."""

    def __init__(self, targets: dict[str, Callable[[ModuleType], None]]) -> None:
        self.targets = targets

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = self.targets.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def installed() -> bool:
    """True once :func:`install` ran in this process (and until :func:`uninstall`)."""
    return bool(_hook)


def register() -> None:
    """vLLM's plugin hook (every engine process). Off unless ``KVCONNECT_EXTENSIBLE_KV=1``:
    then nothing is imported or patched. On: checks the vLLM version and the settings, then
    :func:`install`. Raises (and patches nothing) on an unsupported version or a bad
    setting (every one is read here: :func:`~kvconnect.vllm.plugin_settings.settings`, so a
    bad value fails in the front end, before any engine); vLLM lets a plugin's error stop
    the engine."""
    if not settings().enabled:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    install()


def install() -> None:
    """Patch vLLM in this process (idempotent): ``allocate_kv_cache`` where it is bound by
    name, the workers' RPC methods and, where vLLM's connectors can deregister (0.33),
    ``sleep`` / ``wake_up``. Modules already imported are patched now, the others when they
    are imported (an import hook)."""
    if _hook:
        return
    targets: dict[str, Callable[[ModuleType], None]] = {
        **{name: _patch_allocation for name in _ALLOCATION_SITES},
        _WORKER_BASE: _patch_worker_base, _GPU_WORKER: _patch_gpu_worker,
        _ENGINE_CORE: _patch_engine_core}
    hook = _PatchAfterImport(targets)
    try:
        for name, patch in targets.items():
            if name in sys.modules:
                patch(sys.modules[name])
        sys.meta_path.insert(0, hook)
        _hook.append(hook)
    except BaseException:
        uninstall()
        raise
    logger.debug("kvconnect plugin installed; patched so far: %s", patched_sites())


def patched_sites() -> list[str]:
    """``module.attribute`` of everything the plugin replaced so far in this process."""
    return [f"{o.__module__}.{o.__qualname__}.{a}" if isinstance(o, type) else f"{o.__name__}.{a}"
            for o, a, _ in _patched]


def _patch_allocation(module: ModuleType) -> None:
    from . import engine_cache

    current = getattr(module, "allocate_kv_cache", None)
    if current is None:
        return
    original = _unwrapped(current)
    _set(module, "allocate_kv_cache", functools.wraps(original)(functools.partial(
        engine_cache.allocate_extensible_kv_cache, original=original)), original)


def _patch_worker_base(module: ModuleType) -> None:
    from . import engine_cache

    for method, impl in (("kvconnect_kv_cache_facts", engine_cache.worker_facts),
                         ("kvconnect_release_kv_cache", engine_cache.release_kv_cache),
                         ("kvconnect_recommit_kv_cache", engine_cache.recommit_kv_cache)):
        _set(module.WorkerBase, method, impl)


def _unwrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_kvconnect", False) else fn


def _set(owner: Any, attr: str, value: Any, original: Any = None) -> None:
    if original is None:
        original = (owner.__dict__.get(attr) if isinstance(owner, type)
                    else getattr(owner, attr, None))
    try:
        value._kvconnect = True
    except AttributeError:
        pass
    _patched.append((owner, attr, original))
    setattr(owner, attr, value)


def _patch_gpu_worker(module: ModuleType) -> None:
    """vLLM's ``Worker`` (CPU and GPU workers derive from it): the resize RPC, and the
    sleep / wake wrap."""
    from . import elastic_worker

    _set(module.Worker, "kvconnect_resize_kv_cache", elastic_worker.resize_worker_kv_cache)
    _wrap_sleep(module)


def _patch_engine_core(module: ModuleType) -> None:
    """vLLM's ``EngineCore``: the elastic resize utilities, a tick after every step (a
    pending shrink completes there; the policy runs there), and, in the busy-loop process,
    a tick on the wake-ups the idle policy sends."""
    from . import elastic_core

    core_cls = module.EngineCore

    def kvconnect_resize_kv_cache(self: Any, num_blocks: int, timeout: float) -> dict[str, Any]:
        return elastic_core.core_elastic(self).resize(num_blocks, timeout)

    def kvconnect_resize_status(self: Any, op: int) -> dict[str, Any]:
        return elastic_core.core_elastic(self).status(op)

    def kvconnect_elastic_facts(self: Any) -> dict[str, Any]:
        return elastic_core.core_elastic(self).facts()

    for name, fn in (("kvconnect_resize_kv_cache", kvconnect_resize_kv_cache),
                     ("kvconnect_resize_status", kvconnect_resize_status),
                     ("kvconnect_elastic_facts", kvconnect_elastic_facts)):
        _set(core_cls, name, fn)
    post_step = core_cls.post_step

    def kvconnect_post_step(self: Any, model_executed: bool) -> None:
        post_step(self, model_executed)
        elastic_core.core_elastic(self).tick()

    _set(core_cls, "post_step", functools.wraps(post_step)(kvconnect_post_step))
    proc_cls = getattr(module, "EngineCoreProc", None)
    handle = getattr(proc_cls, "_handle_client_request", None)
    if proc_cls is None or handle is None:
        return
    wakeup = module.EngineCoreRequestType.WAKEUP

    def kvconnect_handle(self: Any, request_type: Any, request: Any) -> Any:
        if request_type == wakeup:
            elastic_core.core_elastic(self).tick()
        return handle(self, request_type, request)

    _set(proc_cls, "_handle_client_request", functools.wraps(handle)(kvconnect_handle))


def _wrap_sleep(module: ModuleType) -> None:
    """0.33: release after the connectors deregistered, recommit before they re-register.
    vLLM 0.32's connectors cannot deregister, so its sleep is left alone (the workers'
    ``kvconnect_release_kv_cache`` refuses there while a connector is configured)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from . import engine_cache

    Worker = module.Worker  # noqa: N806 - vLLM's class

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
    cache it was given); the settings are read again on next use."""
    settings.cache_clear()
    while _hook:
        hook = _hook.pop()
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
    while _patched:
        owner, attr, original = _patched.pop()
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
