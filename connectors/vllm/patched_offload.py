"""vLLM 0.33's offload connectors, patched so their workers see only committed memory (needs
vLLM); the NIXL one is in :mod:`kvconnect.connectors.vllm.patched_nixl` (upstream's NIXL module
pulls in attention backends that need vLLM's compiled extensions on CUDA, so it loads only when
asked).

Each class subclasses upstream's and changes one thing: before upstream's ``register_kv_caches``
runs, the views and the connector's ``KVCacheConfig`` are bounded to the committed blocks
(:func:`kvconnect.vllm.bounding.bound_for_connector`), and, for ``LHBNC``, each head plane is
placed where the view puts it, not where upstream derives it from the block count
(:mod:`kvconnect.vllm.head_planes`; for OffloadingConnector this also fixes upstream's LHBNC bug
on plain allocations: it moved only the first head). ``KvconnectSimpleCPUOffloadConnector`` also
follows an elastic resize (``kvconnect_resize_kv_caches``); ``KvconnectOffloadingConnector``
does not yet (a resize is refused while it is configured). Everything else, including sleep /
wake (``unregister_kv_caches`` / ``restore_kv_caches``, which re-register
exactly what was registered: the committed extents), is upstream's. On a plain allocation
the bounded views and config equal the originals, so registrations are byte-identical.

Load one with::

    --kv-transfer-config '{"kv_connector": "KvconnectNixlConnector",
                           "kv_connector_module_path": "kvconnect.connectors.vllm", "kv_role": ...}'
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)

from kvconnect.vllm.bounding import BoundedKVCaches, bound_for_connector
from kvconnect.vllm.head_planes import offloading_head_planes, simple_offload_head_planes

__all__ = ["CommittedOnly", "KvconnectOffloadingConnector",
           "KvconnectSimpleCPUOffloadConnector"]


class CommittedOnly:
    """The bounding step shared by the patched connectors."""

    _vllm_config: Any
    _kv_cache_config: Any
    #: what the last ``register_kv_caches`` handed upstream (None before it ran)
    kvconnect_bounded: BoundedKVCaches | None = None

    def _bounded(self, kv_caches: dict[str, torch.Tensor]) -> BoundedKVCaches:
        cfg = self._kv_cache_config
        layout = getattr(cfg, "kv_cache_layout", None) or (
            self._vllm_config.cache_config.kv_cache_layout)
        bounded = bound_for_connector(kv_caches, cfg, layout=layout, head_planes=True)
        self.kvconnect_bounded = bounded
        return bounded


class KvconnectSimpleCPUOffloadConnector(CommittedOnly, SimpleCPUOffloadConnector):
    """vLLM's ``SimpleCPUOffloadConnector`` whose worker places regions in committed memory
    (its worker reads ``layer_stride`` / ``offset`` from the config: bounded too)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker_handler is None:  # scheduler role, or offload disabled upstream
            super().register_kv_caches(kv_caches)
            return
        bounded = self._bounded(kv_caches)
        self.worker_handler.kv_cache_config = bounded.kv_cache_config
        with simple_offload_head_planes(self.worker_handler, bounded):
            super().register_kv_caches(bounded.kv_caches)

    def kvconnect_resize_kv_caches(self, num_blocks: int, chunks: list[tuple[int, int]]
                                   ) -> dict[str, Any]:
        """Worker role: follow the plugin's cache to ``num_blocks`` blocks. Each region
        upstream copies through (``[num_blocks, block_bytes]`` rows, by name) becomes the
        same rows at the same address for the new count, in the dict its copy backend
        holds; the pinned CPU pool and its contents stay (CUDA's batched copy reads only
        each region's base and row stride). ``chunks`` is not needed: nothing is
        registered with a transport."""
        from kvconnect.vllm.engine_cache import record_for_views

        t0 = time.perf_counter()
        handler = self.worker_handler
        regions = getattr(handler, "gpu_kv_caches", None) if handler is not None else None
        if not regions:
            return {"registration_seconds": 0.0, "regions": 0}
        record = record_for_views(regions)
        if record is None:
            raise RuntimeError("SimpleCPUOffload's regions are not in the plugin's KV cache")
        (tensor,) = record.cache.tensors
        resized = {}
        for name, rows in regions.items():
            row = rows.stride(0) * rows.element_size()
            view = tensor.committed_view(rows.data_ptr() - tensor.base_ptr, num_blocks * row)
            resized[name] = view.view(rows.dtype).view(num_blocks, *rows.shape[1:])
        regions.update(resized)  # the backend holds this dict
        for cfg in (getattr(handler, "kv_cache_config", None), self._kv_cache_config):
            if cfg is not None:
                cfg.num_blocks = num_blocks
        seconds = time.perf_counter() - t0
        return {"registration_seconds": seconds, "regions": len(resized)}


class KvconnectOffloadingConnector(CommittedOnly, OffloadingConnector):
    """vLLM's ``OffloadingConnector`` over bounded views (its geometry is already bounded by
    ``num_blocks``; its packed path assumes row 0 at the storage start, which bounding
    guarantees), with LHBNC's head planes as canonical tensors (upstream mistakes LHBNC for
    a packed layout)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        bounded = self._bounded(kv_caches)
        self.connector_worker.kv_cache_config = bounded.kv_cache_config
        with offloading_head_planes(self.connector_worker, bounded.kv_caches,
                                    bounded.kv_cache_config):
            super().register_kv_caches(bounded.kv_caches)
