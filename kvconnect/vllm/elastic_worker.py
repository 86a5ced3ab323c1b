"""The worker side of an elastic KV cache resize (needs vLLM; runs in each worker process).

The engine core asks every worker to resize through ``collective_rpc(
"kvconnect_resize_kv_cache", args=(num_blocks,))`` (a method the plugin adds to vLLM's
``Worker``) *before* it adds blocks to the scheduler's pool (grow) and *after* the pool gave
up the tail (shrink). :func:`resize_worker_kv_cache`:

- checks first, changing nothing on refusal (a ``code``, as :class:`ElasticResizeError`):
  the cache is the plugin's and awake (``released``), ``num_blocks`` lies in
  ``[1, capacity_blocks]`` (``beyond_capacity``), the device can commit the growth
  (``beyond_device``: free device memory, ``MemAvailable`` on the host backend), and a
  configured KV connector can follow a resize (``connector``: kvconnect's patched
  connectors implement ``kvconnect_resize_kv_caches``; stock ones register the old size
  and would keep it);
- grow: commits the new blocks at the same addresses (one more physical allocation per
  segment), then lets the connector register them; a connector failure releases them again;
- shrink: the connector first drops what is about to go (registrations, descriptors), then
  the physical allocations wholly past the new tail are released (addresses stay reserved);
- sets vLLM's block count in the model runner's and the connector's configs and records
  the resize in the facts (``resizes``: time, from -> to, seconds, commit and registration
  seconds, committed bytes).

Units: blocks are vLLM's logical blocks; bytes; seconds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from kvconnect.checks import round_up
from kvconnect.errors import KvconnectError

from .engine_cache import EngineKVCache, engine_log, record_for_worker, transfer_group

__all__ = ["ElasticResizeError", "device_free_bytes", "growth_bytes", "resize_worker_kv_cache"]


class ElasticResizeError(KvconnectError, RuntimeError):
    """A resize was refused or failed; ``code`` says why (``beyond_capacity``,
    ``beyond_device``, ``released``, ``connector``, ``pending``, ``busy_timeout``,
    ``unsupported``, ``failed``). Nothing was changed unless the message says otherwise."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def device_free_bytes(device: torch.device) -> int:
    """Bytes the device can still commit: free GPU memory, or the host's ``MemAvailable``."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def growth_bytes(record: EngineKVCache, num_blocks: int) -> int:
    """Physical bytes a grow to ``num_blocks`` would commit (granule-rounded)."""
    cache = record.cache
    total = 0
    for t, tp in zip(cache.tensors, cache.plan.tensors, strict=True):
        want = round_up(num_blocks * tp.segment_bytes_per_block, cache.granule)
        total += sum(max(0, want - c) for c in t.committed_bytes)
    return total


def _chunks_after_shrink(record: EngineKVCache, num_blocks: int) -> list[tuple[int, int]]:
    """The physical allocations a shrink to ``num_blocks`` keeps (those starting before the
    granule-rounded new tail of their segment)."""
    cache = record.cache
    out: list[tuple[int, int]] = []
    for t, tp in zip(cache.tensors, cache.plan.tensors, strict=True):
        keep = round_up(num_blocks * tp.segment_bytes_per_block, cache.granule)
        out.extend((ch.va, ch.size) for ch in t.physical_chunks() if ch.offset < keep)
    return sorted(out)


def check_resize(worker: Any, num_blocks: int) -> tuple[EngineKVCache, Any]:
    """The worker's record and connector, or :class:`ElasticResizeError` (nothing done)."""
    try:
        record = record_for_worker(worker)
    except KvconnectError as exc:
        raise ElasticResizeError("unsupported", str(exc)) from None
    cache = record.cache
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ElasticResizeError("failed", f"num_blocks must be a positive int, got "
                                           f"{num_blocks!r}")
    if cache.is_released:
        raise ElasticResizeError(
            "released", f"the KV cache is released (asleep): recommit it "
                        f"(kvconnect_recommit_kv_cache / wake_up) before resizing to "
                        f"{num_blocks} blocks. Nothing was changed.")
    if num_blocks > cache.capacity_blocks:
        raise ElasticResizeError(
            "beyond_capacity",
            f"cannot resize the KV cache to {num_blocks} blocks: the reservation holds "
            f"{cache.capacity_blocks} blocks of {cache.bytes_per_block} bytes "
            f"({record.capacity_source}); raise KVCONNECT_KV_CAPACITY_BYTES when starting "
            f"the engine. Nothing was changed.")
    need = growth_bytes(record, num_blocks) if num_blocks > cache.num_blocks else 0
    if need:
        free = device_free_bytes(cache.device)
        if need > free:
            raise ElasticResizeError(
                "beyond_device",
                f"cannot grow the KV cache to {num_blocks} blocks: that commits {need} more "
                f"bytes on {cache.device} and only {free} are available. Nothing was "
                f"changed.")
    connector = transfer_group()
    if connector is not None and not callable(getattr(connector, "kvconnect_resize_kv_caches",
                                                      None)):
        raise ElasticResizeError(
            "connector",
            f"the KV connector {type(connector).__name__} cannot follow a KV cache resize: its "
            f"registrations and descriptors cover the {cache.num_blocks} blocks it was given "
            f"and would stay so (peers would read unregistered or released memory). Use "
            f"kvconnect's patched connectors (kv_connector_module_path: "
            f"kvconnect.connectors.vllm). Nothing was changed.")
    return record, connector


def resize_worker_kv_cache(worker: Any, num_blocks: int, check_only: bool = False
                           ) -> dict[str, Any]:
    """Resize this worker's KV cache to ``num_blocks`` blocks (see the module docstring), or
    only check that it could (``check_only``). Returns JSON: ``{"ok": True, "facts": ...}``
    or a refusal ``{"ok": False, "code", "message"}`` (an RPC result keeps its reason across
    processes, where an exception would not keep its class)."""
    try:
        if check_only:
            check_resize(worker, num_blocks)
            return {"ok": True, "facts": None}
        return {"ok": True, "facts": _resize(worker, num_blocks)}
    except ElasticResizeError as exc:
        return {"ok": False, "code": exc.code, "message": str(exc)}


def _resize(worker: Any, num_blocks: int) -> dict[str, Any]:
    record, connector = check_resize(worker, num_blocks)
    cache = record.cache
    old = cache.num_blocks
    t0 = time.perf_counter()
    commit_s = registration_s = 0.0
    delta = 0
    connector_record: dict[str, Any] | None = None
    if num_blocks > old:
        try:
            delta = cache.resize(num_blocks)
        except Exception as exc:
            raise ElasticResizeError("beyond_device", f"committing {num_blocks} blocks failed "
                                     f"({exc}); nothing was changed") from exc
        commit_s = time.perf_counter() - t0
        if connector is not None:
            try:
                connector_record = connector.kvconnect_resize_kv_caches(
                    num_blocks, record.physical_chunks())
            except BaseException as exc:
                cache.resize(old)
                raise ElasticResizeError("connector", f"{type(connector).__name__} could not "
                                         f"follow the grow to {num_blocks} blocks ({exc}); the "
                                         f"new memory was released again") from exc
    elif num_blocks < old:
        if connector is not None:
            try:
                connector_record = connector.kvconnect_resize_kv_caches(
                    num_blocks, _chunks_after_shrink(record, num_blocks))
            except Exception as exc:
                raise ElasticResizeError("connector", f"{type(connector).__name__} could not "
                                         f"follow the shrink to {num_blocks} blocks ({exc}); "
                                         f"nothing was released") from exc
        t1 = time.perf_counter()
        delta = cache.resize(num_blocks)
        commit_s = time.perf_counter() - t1
    if connector_record:
        registration_s = float(connector_record.get("registration_seconds", 0.0))
    runner_cfg = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if runner_cfg is not None:
        runner_cfg.num_blocks = num_blocks
    seconds = time.perf_counter() - t0
    entry = {"time": time.time(), "from": old, "to": num_blocks,
             "seconds": seconds, "commit_seconds": commit_s,
             "registration_seconds": registration_s, "committed_bytes_delta": delta,
             "committed_bytes": cache.committed_bytes,
             "physical_handles": cache.num_physical_chunks,
             "connector": connector_record}
    record.resizes.append(entry)
    engine_log.info("kvconnect KV cache resized: %d -> %d blocks in %.3f ms (committed %+d "
                    "bytes, now %d in %d physical handles)", old, num_blocks,
                    seconds * 1e3, delta, cache.committed_bytes,
                    cache.num_physical_chunks)
    return record.facts()
