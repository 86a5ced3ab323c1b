"""What the plugin puts in place of vLLM's ``allocate_kv_cache``, and the workers' RPCs.

:func:`allocate_extensible_kv_cache` builds vLLM's KV cache as a
:class:`~kvconnect.vllm.cache.VllmKVCache`: it checks everything first (a VMM backend for
the device, the capacity, the KV specs), then reserves the capacity once, commits one
block, and commits vLLM's final ``num_blocks`` at the same addresses (one physical handle
per segment when a KV connector is configured, with POSIX-FD exportable handles, and
RDMA-capable ones on GPUs). It logs one line (``facts=`` then JSON) and returns vLLM's
per-layer views over the whole reservation; vLLM's views own the memory, as they own
``torch.zeros``' (the reservation goes when the last view does).

The engine's record of it (:class:`EngineKVCache`) lives as long as the model runner's
``kv_cache_config``; the worker methods the plugin adds find it there:
:func:`worker_facts`, :func:`release_kv_cache`, :func:`recommit_kv_cache` (and
:mod:`kvconnect.vllm.elastic_worker`'s resize, which appends to :attr:`EngineKVCache.resizes`).
Units: bytes; blocks are vLLM's logical blocks.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconnect.bounded_json import JSONObject
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import plan_layout
from kvconnect.layout.foreign import config_from_vllm
from kvconnect.vmm import AllocationOptions, probe_vmm

from .cache import VllmKVCache
from .plugin_settings import CAPACITY_ENV, SWITCH_ENV, PluginConfigError, settings

logger = logging.getLogger(__name__)
#: vLLM's logging configuration shows INFO lines of loggers under "vllm" (its handler)
engine_log = logging.getLogger("vllm.kvconnect")

__all__ = ["FACTS_SCHEMA", "EngineKVCache", "allocate_extensible_kv_cache", "kv_cache_facts",
           "record_for_views", "record_for_worker", "recommit_kv_cache", "release_kv_cache",
           "transfer_group", "worker_facts"]

#: version of the facts dict's fields (docs/vllm-plugin.md lists them; 2 added ``resizes``)
FACTS_SCHEMA = 2
#: id(the model runner's kv_cache_config) -> (a weak reference to it, its cache): a record
#: goes when the runner's config does (vLLM's configs are unhashable dataclasses)
_BY_CONFIG: dict[int, tuple[weakref.ref[Any], EngineKVCache]] = {}


@dataclass
class EngineKVCache:
    """One engine worker's extensible KV cache and what was asked of it."""

    cache: ExtensibleKVCache
    layout: str
    kv_connector: str | None
    capacity_source: str
    requested: AllocationOptions
    commits: list[int]
    vllm_version: str = ""
    events: list[str] = field(default_factory=list)
    #: one record per resize (kvconnect.vllm.elastic_worker): time, from -> to, seconds
    resizes: list[dict[str, Any]] = field(default_factory=list)

    def physical_chunks(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of every physical allocation mapped now, address order."""
        return sorted((ch.va, ch.size) for t in self.cache.tensors
                      for ch in ([] if t.is_released else t.physical_chunks()))

    def facts(self) -> JSONObject:
        """JSON-able facts (fields in docs/vllm-plugin.md); read them again after a change."""
        c = self.cache
        tensors = c.tensors
        released = c.is_released
        per_segment: list[int] = []
        for t in tensors:
            counts = [0] * t.num_segments
            for ch in ([] if released else t.physical_chunks()):
                counts[ch.segment] += 1
            per_segment.extend(counts)
        granted = [t.granted for t in tensors]
        shareable = all(g.shareable for g in granted)
        return {
            "schema": FACTS_SCHEMA, "enabled": True, "pid": os.getpid(),
            "vllm_version": self.vllm_version, "backend": tensors[0].driver.name,
            "device": str(c.device), "layout": self.layout, "kv_connector": self.kv_connector,
            "capacity_source": self.capacity_source,
            "reserved_bytes": sum(t.capacity_bytes for t in tensors),
            "reservation_bases": [t.base_ptr for t in tensors],
            "capacity_blocks": c.capacity_blocks, "num_blocks": c.num_blocks,
            "bytes_per_block": c.bytes_per_block,
            "committed_bytes": c.committed_bytes,
            "segments": len(per_segment), "physical_handles": sum(per_segment),
            "handles_per_segment": per_segment, "commits_blocks": list(self.commits),
            "single_handle": bool(self.kv_connector),
            "handle_type": "posix_fd" if shareable else "none",
            "requested": {"shareable": self.requested.shareable,
                          "rdma_capable": self.requested.rdma_capable},
            "granted": {"shareable": shareable,
                        "rdma_capable": all(g.rdma_capable for g in granted)},
            "released": released, "events": list(self.events),
            "resizes": [dict(r) for r in self.resizes],
        }

    def summary(self) -> str:
        f = self.facts()
        return (f"kvconnect extensible KV cache: reserved {f['reserved_bytes']} bytes "
                f"({f['capacity_blocks']} blocks, {f['capacity_source']}), committed "
                f"{' then '.join(map(str, f['commits_blocks']))} blocks "
                f"({f['committed_bytes']} bytes), handle type {f['handle_type']}, "
                f"{f['segments']} segments / {f['physical_handles']} physical handles, "
                f"backend {f['backend']} ({f['device']}); facts={json.dumps(f)}")


def _kernel_block_size(kernel_block_sizes: list[int] | None) -> int | None:
    sizes = set(kernel_block_sizes or ())
    if len(sizes) > 1:
        raise PluginConfigError(
            f"kvconnect's extensible KV cache needs one attention kernel block size over all "
            f"KV cache groups; this model's groups use {sorted(sizes)}. Unset {SWITCH_ENV}.")
    return sizes.pop() if sizes else None


def _check_specs(kv_cache_config: Any) -> None:
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None)
        for s in (specs.values() if isinstance(specs, dict) else [spec]):
            if not getattr(s, "has_layer_views", True):
                raise PluginConfigError(
                    f"kvconnect's extensible KV cache builds per-layer attention views; "
                    f"{type(s).__name__} (layers {group.layer_names[:2]}...) has none. Unset "
                    f"{SWITCH_ENV} for this model.")


def _device_total_bytes(device: torch.device, backend: str) -> int:
    if backend == "host":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(torch.cuda.mem_get_info(device)[1])


def _capacity_blocks(per_block: int, device: torch.device, backend: str,
                     num_blocks: int) -> tuple[int, str]:
    """Blocks of ``per_block`` bytes to reserve (from KVCONNECT_KV_CAPACITY_BYTES, else the
    device's memory) and where the figure came from; raises when it holds fewer than vLLM's
    ``num_blocks``."""
    wanted = settings().capacity_bytes
    source = f"{CAPACITY_ENV}={wanted}" if wanted is not None else "device total memory"
    if wanted is None:
        wanted = max(_device_total_bytes(device, backend), num_blocks * per_block)
    blocks = wanted // per_block
    if blocks < num_blocks:
        raise PluginConfigError(
            f"{CAPACITY_ENV}={wanted} bytes holds {blocks} KV blocks of {per_block} bytes, but "
            f"vLLM sized its KV cache at {num_blocks} blocks ({num_blocks * per_block} bytes). "
            f"Raise {CAPACITY_ENV} to at least {num_blocks * per_block}, unset it (the default "
            f"reserves the device's total memory), or lower vLLM's KV cache size. Nothing was "
            f"reserved.")
    return blocks, source


def allocate_extensible_kv_cache(kv_cache_config: Any, device: torch.device, layout: Any,
                                 kernel_block_sizes: list[int] | None = None, *,
                                 original: Callable[..., dict[str, torch.Tensor]]
                                 ) -> dict[str, torch.Tensor]:
    """vLLM's ``allocate_kv_cache`` contract (per-layer views), backed by a VMM reservation.
    Everything is checked before anything is reserved; a failure after the reservation
    releases it before the error propagates."""
    if not kv_cache_config.kv_cache_tensors:
        return original(kv_cache_config, device, layout, kernel_block_sizes)
    import vllm

    device = torch.device(device)
    _check_specs(kv_cache_config)
    kernel = _kernel_block_size(kernel_block_sizes)
    probe_result = probe_vmm(device)
    if probe_result.driver is None:
        raise PluginConfigError(
            f"kvconnect's extensible KV cache needs a VMM backend for {device}: "
            f"{probe_result.reason}. Unset {SWITCH_ENV} to use vLLM's own allocation. "
            f"Nothing was reserved.")
    backend = probe_result.driver.name
    group = transfer_group()
    connector = None if group is None else type(group).__name__
    options = AllocationOptions(shareable=connector is not None,
                                rdma_capable=connector is not None and backend != "host")
    num_blocks = int(kv_cache_config.num_blocks)
    per_block = plan_layout(config_from_vllm(kv_cache_config, layout, kernel)).bytes_per_block
    capacity, source = _capacity_blocks(per_block, device, backend, num_blocks)
    vkc = VllmKVCache(kv_cache_config, device, layout=layout, capacity_blocks=capacity,
                      kernel_block_size=kernel, options=options)
    vkc.allocate()  # reserve + one block (released again on its own failure)
    try:
        vkc.extend_kv_cache(num_blocks, single_handle=connector is not None)
        views = vkc.kv_caches()
    except BaseException:
        vkc.close(force=True)
        raise
    record = EngineKVCache(vkc, vkc.config.layout, connector, source, options, [1, num_blocks],
                           vllm_version=vllm.__version__)
    _warn_ungranted(record)
    _remember(kv_cache_config, record)
    engine_log.info("%s", record.summary())
    return views


def _warn_ungranted(record: EngineKVCache) -> None:
    f = record.facts()
    for flag in ("shareable", "rdma_capable"):
        if f["requested"][flag] and not f["granted"][flag]:
            logger.warning("kvconnect KV cache on %s (%s backend): %s handles were requested "
                           "for the KV connector but not granted; it falls back without them",
                           f["device"], f["backend"], flag)


def _remember(kv_cache_config: Any, record: EngineKVCache) -> None:
    key = id(kv_cache_config)
    _BY_CONFIG[key] = (weakref.ref(kv_cache_config), record)
    weakref.finalize(kv_cache_config, _BY_CONFIG.pop, key, None)


def _lookup(kv_cache_config: Any) -> EngineKVCache | None:
    entry = _BY_CONFIG.get(id(kv_cache_config))
    if entry is None or entry[0]() is not kv_cache_config:
        return None
    return entry[1]


def kv_cache_facts() -> list[dict[str, Any]]:
    """Facts of every plugin-made KV cache alive in this process (a worker process has one;
    an in-process engine, one per live engine)."""
    return [r.facts() for _, r in list(_BY_CONFIG.values())]


def record_for_views(kv_caches: dict[str, torch.Tensor]) -> EngineKVCache | None:
    """The plugin's record of the cache whose reservation holds every view in ``kv_caches``
    (a connector's ``register_kv_caches`` argument, narrowed or not), or None when they are
    not the plugin's (vLLM's own allocation; connectors get a deep copy of the runner's
    config, so the views are what identifies the cache)."""
    ptrs = [v.data_ptr() for v in kv_caches.values()]
    for _, record in list(_BY_CONFIG.values()):
        spans = [(t.base_ptr, t.base_ptr + t.capacity_bytes) for t in record.cache.tensors]
        if ptrs and all(any(lo <= p < hi for lo, hi in spans) for p in ptrs):
            return record
    return None


def record_for_worker(worker: Any) -> EngineKVCache:
    """The plugin's record of ``worker``'s KV cache; PluginConfigError when it has none."""
    runner = getattr(worker, "model_runner", None)
    cfg = getattr(runner, "kv_cache_config", None)
    record = _lookup(cfg) if cfg is not None else None
    if record is None:
        raise PluginConfigError(
            f"this worker's KV cache was not made by kvconnect (is {SWITCH_ENV}=1 set in the "
            f"engine's environment, and did the engine finish initialising its KV cache?)")
    return record


def worker_facts(worker: Any) -> dict[str, Any]:
    """The worker's KV cache facts (``llm.collective_rpc("kvconnect_kv_cache_facts")``),
    with ``fast_path`` added where the worker's connector is kvconnect's NIXL connector (its
    ``kvconnect_fast_path_facts``, of
    :class:`~kvconnect.connectors.vllm.patched_nixl.KvconnectNixlConnector`: the one way to
    read them from a multi-process engine, as ``vllm serve`` runs)."""
    facts = record_for_worker(worker).facts()
    fast_path = getattr(transfer_group(), "kvconnect_fast_path_facts", None)
    if fast_path is not None:
        facts["fast_path"] = fast_path()
    return facts


def transfer_group() -> Any:
    """vLLM's KV connector of this worker process, or None when none is configured."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def release_kv_cache(worker: Any, deregister: bool = True) -> dict[str, Any]:
    """Sleep the worker's KV cache: the connector deregisters (``unregister_kv_caches``),
    then every physical allocation is released; addresses stay reserved. Touching the KV
    cache (running the engine) before :func:`recommit_kv_cache` faults. Refuses, releasing
    nothing, when a connector is configured that cannot deregister (vLLM 0.32's)."""
    record = record_for_worker(worker)
    connector = transfer_group()
    if deregister and connector is not None and not record.cache.is_released:
        if not hasattr(connector, "unregister_kv_caches"):
            raise PluginConfigError(
                f"{type(connector).__name__} cannot deregister its KV caches on vLLM "
                f"{record.vllm_version} (no unregister_kv_caches): releasing the memory under "
                f"its registrations is refused. Nothing was released.")
        connector.unregister_kv_caches()
    record.cache.release_physical()
    record.events.append("released")
    engine_log.info("kvconnect KV cache released: %d bytes reserved, 0 committed",
                    record.facts()["reserved_bytes"])
    return record.facts()


def recommit_kv_cache(worker: Any, reregister: bool = True) -> dict[str, Any]:
    """Wake the worker's KV cache: the same blocks, zero-filled, at the same addresses, one
    physical handle per segment; then the connector re-registers (``restore_kv_caches``)."""
    record = record_for_worker(worker)
    record.cache.recommit()
    record.events.append("recommitted")
    connector = transfer_group()
    if reregister and connector is not None and hasattr(connector, "restore_kv_caches"):
        connector.restore_kv_caches()
    engine_log.info("kvconnect KV cache recommitted: %d bytes",
                    record.facts()["committed_bytes"])
    return record.facts()
