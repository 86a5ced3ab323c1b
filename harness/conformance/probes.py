"""What a connector registered, and how to make it move blocks: one probe per connector kind.

A probe is chosen by :func:`probe_for` from :data:`PROBES` (the first whose upstream base
class the connector derives from; any other ``KVConnectorBase_V1`` subclass gets
:class:`GenericProbe`: its NIXL registrations and held views are checked, the rest is
reported as not checked, in words). Probes run inside a case's own process, which is discarded
afterwards, so they may patch classes for the life of that process.

Two stand-ins replace what cannot exist on a CPU-only machine, and say so in their names:
:class:`HostStreamStandIn` for ``torch.cuda.Stream`` and :class:`HostCopyBackendStandIn` for
SimpleCPUOffload's ``cuMemcpyBatchAsync`` backend (it copies the same rows, synchronously), both
from :mod:`kvconnect.vllm.host_stand_ins`, which CPU engines use too. On CUDA (a probe's
``device``) SimpleCPUOffload keeps upstream's streams and its ``DmaCopyBackend``.
OffloadingConnector's CUDA worker is not created on either (it needs vLLM's compiled
``swap_blocks_batch``): :class:`OffloadingProbe` captures the canonical
tensors upstream hands it and copies their rows the way that worker would (on the device's
memory, through torch).

Units: bytes; block ids are the connector's blocks (logical blocks here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.views import block_span
from kvconnect.vllm.host_stand_ins import HostCopyBackendStandIn, HostStreamStandIn

__all__ = ["PROBES", "ConnectorProbe", "GenericProbe", "NixlProbe", "NixlRegistrations",
           "OffloadingProbe", "Region", "SimpleCPUOffloadProbe", "dma_copy", "probe_for"]


@dataclass(frozen=True)
class Region:
    """A registered region: block ``b`` is ``block_len`` bytes at ``base + b * stride``."""

    base: int
    block_len: int
    block_stride: int
    num_blocks: int

    def block(self, b: int) -> tuple[int, int]:
        return self.base + b * self.block_stride, self.block_len

    @property
    def end(self) -> int:
        return self.base + block_span(self.num_blocks, self.block_stride, self.block_len)


class ConnectorProbe:
    """Introspection of one connector kind. ``exercise`` moves ``block_ids`` through the
    connector's geometry and returns ``(moved_bytes, mismatched_bytes)`` against
    ``expected`` (block id -> the bytes every KV run of that block held)."""

    kind = "base"
    #: "transfer" (peer reads blocks), "offload_round_trip" or "moves_blocks"
    exercise_name = "transfer"
    #: check name -> why this probe cannot run it (reported in words)
    limits: dict[str, str] = {}
    #: where the case's KV cache lives (set by :func:`probe_for`)
    device: torch.device = torch.device("cpu")

    def install(self) -> None:
        """Patch what must be patched before the connector is created."""

    def regions(self, connector: Any) -> list[Region]:
        return []

    def registered(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of memory registered now (NIXL registrations, or the
        spans an offload worker copies from)."""
        return []

    def exercise(self, connector: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                 runs: list[tuple[int, int]]) -> tuple[int, int]:
        raise NotImplementedError(f"{type(self).__name__} cannot move blocks")


# -- NIXL -------------------------------------------------------------------------------------
class NixlRegistrations:
    """Records every NIXL registration made in this process (any agent), as long as NIXL
    imports: ``(address, nbytes)`` of what is registered now."""

    def __init__(self) -> None:
        self._descs: dict[int, list[tuple[int, int]]] = {}
        self._live: dict[int, list[tuple[int, int]]] = {}
        self.installed = False

    def install(self) -> None:
        try:
            from nixl._api import nixl_agent
        except ImportError:
            return
        rec = self
        orig_get, orig_reg, orig_dereg = (nixl_agent.get_reg_descs, nixl_agent.register_memory,
                                          nixl_agent.deregister_memory)

        def get_reg_descs(self: Any, descs: Any, mem_type: Any = None) -> Any:
            out = orig_get(self, descs, mem_type)
            if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
                rec._descs[id(out)] = [(int(d[0]), int(d[1])) for d in descs]
            return out

        def register_memory(self: Any, reg_list: Any, mem_type: Any = None,
                            backends: list[str] = []) -> Any:  # noqa: B006 - upstream's
            out = orig_reg(self, reg_list, mem_type, backends)
            rec._live[id(out)] = rec._descs.get(id(out), [])
            return out

        def deregister_memory(self: Any, dereg_list: Any, backends: list[str] = []) -> Any:  # noqa: B006
            rec._live.pop(id(dereg_list), None)
            return orig_dereg(self, dereg_list, backends)

        nixl_agent.get_reg_descs = get_reg_descs
        nixl_agent.register_memory = register_memory
        nixl_agent.deregister_memory = deregister_memory
        self.installed = True

    def registered(self) -> list[tuple[int, int]]:
        return sorted(r for rs in self._live.values() for r in rs)


class NixlProbe(ConnectorProbe):
    """Records every NIXL registration (any agent in the process) and reads blocks from the
    connector's agent with a second, real agent, as a decode peer does."""

    kind = "nixl"
    exercise_name = "transfer"

    def __init__(self) -> None:
        self._nixl = NixlRegistrations()
        self._dst: Any = None

    def install(self) -> None:
        self._nixl.install()

    def registered(self) -> list[tuple[int, int]]:
        return self._nixl.registered()

    def regions(self, connector: Any) -> list[Region]:
        w = connector.connector_worker
        bases = w.kv_caches_base_addr[w.engine_id][w.tp_rank]
        return [Region(int(a), int(n), int(s), int(b)) for a, n, s, b in zip(
            bases, w.block_len_per_layer, w.block_stride_per_layer, w.region_num_blocks,
            strict=True)]

    def exercise(self, connector: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                 runs: list[tuple[int, int]], timeout: float = 30.0) -> tuple[int, int]:
        """A fresh agent READs every region's ``block_ids`` from the connector's agent into
        its own buffer; compares with the source bytes (read after, at the same addresses)."""
        if self.device.type != "cpu":
            raise NotImplementedError("the NIXL transfer check reads DRAM only (a VRAM peer "
                                      "needs NIXL on the GPU machine)")
        from nixl._api import nixl_agent, nixl_agent_config

        w = connector.connector_worker
        src = w.nixl_wrapper
        regions = self.regions(connector)
        descs = [r.block(b) for r in regions for b in block_ids]
        total = sum(n for _, n in descs)
        if self._dst is None:
            self._dst = nixl_agent("kvconnect-conformance-peer",
                                   nixl_agent_config(backends=["UCX"]))
        dst = self._dst
        buf = torch.zeros(total, dtype=torch.uint8)
        reg = dst.register_memory([(buf.data_ptr(), total, 0, "")], "DRAM")
        name = dst.add_remote_agent(src.get_agent_metadata())
        try:
            local, off = [], buf.data_ptr()
            for _, n in descs:
                local.append((off, n, 0))
                off += n
            handle = dst.initialize_xfer("READ", dst.get_xfer_descs(local, "DRAM"),
                                         dst.get_xfer_descs([(a, n, 0) for a, n in descs],
                                                            "DRAM"), name)
            try:
                state = dst.transfer(handle)
                deadline = time.monotonic() + timeout
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"NIXL READ of {total} bytes not done in {timeout} s")
                    time.sleep(0.001)
                    state = dst.check_xfer_state(handle)
                if state != "DONE":
                    raise RuntimeError(f"NIXL READ of {total} bytes ended in state {state}")
            finally:
                dst.release_xfer_handle(handle)
            want = read_runs(descs)
            got = buf.numpy().tobytes()
            return total, sum(a != b for a, b in zip(got, want, strict=True))
        finally:
            dst.remove_remote_agent(name)
            dst.deregister_memory(reg)


# -- offload connectors ---------------------------------------------------------------------
def _rows_region(t: torch.Tensor) -> Region:
    e = t.element_size()
    return Region(t.data_ptr(), t[0].numel() * e, t.stride(0) * e, t.shape[0])


def _round_trip(copy: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                runs: list[tuple[int, int]]) -> tuple[int, int]:
    """Store ``block_ids`` to host slots, scribble them on the device, load them back;
    compare every KV run of those blocks with what it held before."""
    want = read_runs(runs)
    slots = list(range(len(block_ids)))
    moved = copy(block_ids, slots, True)
    scribble()
    moved += copy(slots, block_ids, False)
    got = read_runs(runs)
    return moved, sum(a != b for a, b in zip(got, want, strict=True))


class SimpleCPUOffloadProbe(ConnectorProbe):
    """SimpleCPUOffload: its worker's device regions, and a store / scribble / load round
    trip through its own region views (with :class:`HostCopyBackendStandIn`)."""

    kind = "simple_cpu_offload"
    exercise_name = "offload_round_trip"

    #: seconds one DMA copy (store or load) may take on CUDA
    copy_timeout = 20.0

    def install(self) -> None:
        import vllm.v1.simple_kv_offload.worker as worker

        if self.device.type == "cpu":
            torch.cuda.Stream = HostStreamStandIn  # type: ignore[misc,assignment]
            worker.DmaCopyBackend = HostCopyBackendStandIn  # type: ignore[misc,assignment]

    def regions(self, connector: Any) -> list[Region]:
        h = connector.worker_handler
        return [_rows_region(t) for t in (h.gpu_kv_caches or {}).values()]

    def registered(self) -> list[tuple[int, int]]:
        return []

    def exercise(self, connector: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                 runs: list[tuple[int, int]]) -> tuple[int, int]:
        h = connector.worker_handler
        backend = h._backend
        if isinstance(backend, HostCopyBackendStandIn):
            return _round_trip(backend.copy, block_ids, scribble, read_runs, runs)
        row_bytes = sum(t[0].numel() * t.element_size() for t in h.gpu_kv_caches.values())

        def copy(src: list[int], dst: list[int], is_store: bool) -> int:
            dma_copy(backend, src, dst, is_store, self.copy_timeout)
            return row_bytes * len(src)

        return _round_trip(copy, block_ids, scribble, read_runs, runs)


def dma_copy(backend: Any, src_blocks: list[int], dst_blocks: list[int], is_store: bool,
             timeout: float) -> None:
    """One copy through upstream's ``DmaCopyBackend`` (its background thread and streams,
    ``cuMemcpyBatchAsync``), waited for: its event recorded, then synchronised. Raises
    RuntimeError when the copy thread died (the copy failed: its error is in the log) and
    TimeoutError past ``timeout`` seconds."""
    events: list[tuple[int, Any]] = []
    backend.launch_copy(src_blocks, dst_blocks, is_store, 0, events)
    deadline = time.monotonic() + timeout
    while not events:
        thread = getattr(backend, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("DmaCopyBackend's copy thread died (cuMemcpyBatchAsync failed: "
                               "see the case log)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"DmaCopyBackend copy not done in {timeout} s")
        time.sleep(0.001)
    events[0][1].synchronize()


class OffloadingProbe(ConnectorProbe):
    """OffloadingConnector: the canonical tensors its worker is built from (captured; the
    CUDA worker itself refuses CPU), and a round trip copying their rows."""

    kind = "offloading"
    exercise_name = "offload_round_trip"

    def __init__(self) -> None:
        self.canonical: Any = None

    def install(self) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
            OffloadingConnectorWorker,
        )

        probe = self

        def capture(self: Any, kv_caches: Any) -> None:
            probe.canonical = kv_caches

        OffloadingConnectorWorker._init_worker = capture  # type: ignore[method-assign]

    def _tensors(self) -> list[torch.Tensor]:
        return [] if self.canonical is None else [t.tensor for t in self.canonical.tensors]

    def regions(self, connector: Any) -> list[Region]:
        return [_rows_region(t) for t in self._tensors()]

    def exercise(self, connector: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                 runs: list[tuple[int, int]]) -> tuple[int, int]:
        tensors = self._tensors()
        host = [torch.zeros((len(block_ids),) + tuple(t.shape[1:]), dtype=t.dtype,
                            device="cpu") for t in tensors]

        def copy(src: list[int], dst: list[int], is_store: bool) -> int:
            moved = 0
            for dev, h in zip(tensors, host, strict=True):
                a, b = (dev, h) if is_store else (h, dev)
                for s, d in zip(src, dst, strict=True):
                    b[d].copy_(a[s])
                    moved += a[s].numel() * a.element_size()
            return moved

        return _round_trip(copy, block_ids, scribble, read_runs, runs)


# -- any other connector ---------------------------------------------------------------------
class GenericProbe(ConnectorProbe):
    """A ``KVConnectorBase_V1`` subclass of no kind the kit knows: checked by what it
    registers with NIXL (if it does) and the views it holds (:mod:`.holdings`); its blocks'
    addresses and its transfers are its own, so those checks are skipped, with the reason
    (the engine mode moves blocks through any connector)."""

    kind = "generic"
    exercise_name = "moves_blocks"
    #: what this probe cannot check, in words (the case reports them)
    limits = {
        "block_geometry": "the kit does not know how a connector of this kind addresses "
                          "blocks (no NIXL / SimpleCPUOffload / Offloading base class)",
        "moves_blocks": "its transfers are driven by its own metadata: connector-API mode "
                        "cannot make it move blocks (run the engine mode: "
                        "kvconnect-conformance --engine)",
    }

    def __init__(self) -> None:
        self._nixl = NixlRegistrations()

    def install(self) -> None:
        self._nixl.install()

    def registered(self) -> list[tuple[int, int]]:
        return self._nixl.registered()

    def exercise(self, connector: Any, block_ids: list[int], scribble: Any, read_runs: Any,
                 runs: list[tuple[int, int]]) -> tuple[int, int]:
        raise NotImplementedError(self.limits["moves_blocks"])


def _nixl_base() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    return NixlBaseConnector


def _simple_base() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        SimpleCPUOffloadConnector,
    )

    return SimpleCPUOffloadConnector


def _offloading_base() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    return OffloadingConnector


#: (upstream base class loader, probe class): the first base a connector derives from wins
PROBES: list[tuple[Any, type[ConnectorProbe]]] = [
    (_nixl_base, NixlProbe),
    (_simple_base, SimpleCPUOffloadProbe),
    (_offloading_base, OffloadingProbe),
]


def _derives(connector_cls: type, load_base: Any) -> bool:
    """Whether ``connector_cls`` derives from the upstream class ``load_base()`` loads; False
    when that upstream module cannot be imported here (e.g. vLLM's NIXL connector on CUDA
    without vLLM's compiled attention extensions): a class cannot derive from it then."""
    try:
        base = load_base()
    except ImportError:
        return False
    return issubclass(connector_cls, base)


def probe_for(connector_cls: type, device: str | torch.device = "cpu") -> ConnectorProbe:
    """The probe of ``connector_cls``'s kind (:class:`GenericProbe` if none fits), for a
    case whose KV cache lives on ``device``."""
    probe: ConnectorProbe = next(
        (p() for base, p in PROBES if _derives(connector_cls, base)), GenericProbe())
    probe.device = torch.device(device)
    return probe
