"""The smallest accommodation that lets vLLM's SimpleCPUOffload run inside a CPU engine.

SimpleCPUOffload's worker needs CUDA streams and events (``torch.cuda.Stream`` and its
``priority_range``, ``torch.cuda.current_stream``, ``torch.Event``) and copies blocks with
``cuMemcpyBatchAsync`` (``DmaCopyBackend``). None of them exists on a CPU-only machine (vLLM's
CPU platform stubs ``torch.cuda.Stream`` only while its model runner is built, without
``priority_range``). :func:`install_simple_cpu_offload_host_stand_ins` replaces exactly those,
as SimpleCPUOffload's worker module sees them, for the rest of the process, and nothing when
CUDA is available: a stream stand-in, an event
stand-in that is complete once recorded, and a copy backend that copies the same rows
(``base + block_id * stride(0)``) synchronously and records a completed event, so the
worker's event bookkeeping (``_poll_stream_events``) runs unchanged. Everything else is
vLLM's (scheduler, metadata, worker). Call it before the engine is built, in the process
that runs the worker (an in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["HostCopyBackendStandIn", "HostEngineCopyBackendStandIn", "HostEventStandIn",
           "HostStreamStandIn", "install_simple_cpu_offload_host_stand_ins"]


class HostStreamStandIn:
    """Stands in for ``torch.cuda.Stream`` on a CPU-only machine (no streams exist here)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return 0, 0

    def wait_event(self, event: Any) -> None:
        pass


class HostCopyBackendStandIn:
    """Stands in for SimpleCPUOffload's ``DmaCopyBackend`` (``cuMemcpyBatchAsync``, CUDA
    only): the same per-region rows (``base + block_id * stride(0)``, ``shape[1:]`` bytes),
    copied synchronously on the CPU."""

    def init(self, gpu_caches: dict[str, torch.Tensor], cpu_caches: dict[str, torch.Tensor],
             *args: Any) -> None:
        self.gpu_caches, self.cpu_caches = gpu_caches, cpu_caches

    def copy(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool) -> int:
        moved = 0
        for name, dev in self.gpu_caches.items():
            host = self.cpu_caches[name]
            src, dst = (dev, host) if is_store else (host, dev)
            for s, d in zip(src_blocks, dst_blocks, strict=True):
                dst[d].copy_(src[s])
                moved += src[s].numel() * src.element_size()
        return moved

    def launch_copy(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool,
                    *args: Any, **kwargs: Any) -> None:
        self.copy(src_blocks, dst_blocks, is_store)

    def shutdown(self) -> None:
        pass


class HostEventStandIn:
    """Stands in for ``torch.Event`` on a CPU-only machine: host copies are synchronous, so
    an event is complete as soon as it is recorded."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass


class HostEngineCopyBackendStandIn(HostCopyBackendStandIn):
    """Stands in for ``DmaCopyBackend`` inside an engine: the rows are copied at once and a
    completed :class:`HostEventStandIn` is appended, as the DMA thread does when done."""

    #: blocks copied so far (store, load): evidence the offload path ran
    copied_blocks: dict[str, int]

    def init(self, gpu_caches: dict[str, torch.Tensor], cpu_caches: dict[str, torch.Tensor],
             *args: Any) -> None:
        super().init(gpu_caches, cpu_caches)
        self.copied_blocks = {"store": 0, "load": 0}

    def launch_copy(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool,
                    event_idx: int, events_list: list[tuple[int, Any]],
                    wait_event: Any = None) -> None:
        self.copy(src_blocks, dst_blocks, is_store)
        self.copied_blocks["store" if is_store else "load"] += len(src_blocks)
        events_list.append((event_idx, HostEventStandIn()))


class _Forwarding:
    """Attributes of ``target`` except those given: what the offload worker module sees
    as ``torch`` (and ``torch.cuda``); every other module keeps the real ones."""

    def __init__(self, target: Any, **overrides: Any) -> None:
        self._target = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def install_simple_cpu_offload_host_stand_ins() -> bool:
    """Install the stand-ins in this process (idempotent); False (nothing done) when CUDA is
    available, where vLLM's own streams and DMA backend run. Only SimpleCPUOffload's worker
    module sees them: its ``torch`` name is a forwarding object whose ``cuda.Stream``,
    ``cuda.current_stream`` and ``Event`` are the stand-ins (vLLM's CPU runner swaps
    ``torch.cuda.Stream`` itself while it initialises the KV cache, so patching torch would
    not reach the worker)."""
    if torch.cuda.is_available():
        return False
    import vllm.v1.simple_kv_offload.worker as worker

    if isinstance(worker.torch, _Forwarding):
        return True
    cuda = _Forwarding(torch.cuda, Stream=HostStreamStandIn,
                       current_stream=lambda *a, **k: HostStreamStandIn())
    worker.torch = _Forwarding(torch, cuda=cuda, Event=HostEventStandIn)  # type: ignore[assignment]
    worker.DmaCopyBackend = HostEngineCopyBackendStandIn  # type: ignore[misc,assignment]
    return True
