"""The ``nixl`` transport: the :class:`~kvconnect.connectors.transport.Transport` interface
over a registered :class:`~kvconnect.connectors.nixl.worker.NixlRegionWorker`.

:data:`NIXL_TRANSPORT` is its spec. Per worker, :class:`NixlRegistration` owns the
NixlRegionWorker (agent, registration after the final commit, re-registration after
sleep / wake, progress, READ completion notices); both halves use it. A peer's offer is
``{"metadata": <the peer's metadata_json()>}``; :meth:`NixlTransport.open_peer` loads or
refreshes it (``update_peer``) when it changed. ``attribution(engine_id)`` may name the UCX
lanes a READ used: the spec passes a :class:`~.ucx_lanes.LaneTracker` when UCX prints its
protocol choices (``UCX_PROTO_INFO=y``, which the spec asks for in worker processes);
without it the backend is what NIXL reports. When those lanes show GPU memory moved by UCX's
TCP software emulation, the fetch's note says why and what changes it
(:func:`slow_gpu_lane_advice`, measured in docs/backends.md, "UCX and cuda_ipc on one node").

Units: bytes, seconds, logical blocks for block ids.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvconnect.block_ids import BlockIds
from kvconnect.bounded_json import JSON, JSONObject

from ..errors import KVConnectorError
from ..transport import FetchResult, TransportContext, TransportSpec
from .agent import nixl_install_problem
from .ucx_lanes import PROTO_INFO_ENV, LaneTracker

if TYPE_CHECKING:
    from .worker import NixlRegionWorker

__all__ = ["NIXL_TRANSPORT", "NixlMetadataExporter", "NixlRegistration", "NixlTransport",
           "slow_gpu_lane_advice"]


def slow_gpu_lane_advice(lanes: Sequence[str]) -> str:
    """Why UCX moved GPU memory through TCP software emulation and what changes it, or ""
    when ``lanes`` (``"<config> <description> (<into><-<from>)"``, ucx_lanes.py)
    show no such READ."""
    slow = [lane for lane in lanes if "software emulation" in lane and "cuda" in lane]
    if not slow:
        return ""
    return ("UCX read GPU memory through TCP software emulation. With the UCX of nixl-cu13 "
            "1.5.1 no setting gives VMM memory (kvconnect's caches) a cuda_ipc lane: it "
            "exports VMM memory only as FABRIC handles, which need IMEX; use the ipc "
            "transport. cudaMalloc memory gets cuda_ipc READs on a GPU without active "
            "NVLink only with UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (docs/backends.md)")


class NixlTransport:
    """Reads peers' blocks through ``worker`` (a registered NixlRegionWorker)."""

    name = "nixl"

    def __init__(self, worker: NixlRegionWorker | None, *, timeout: float = 60.0,
                 attribution: Callable[[str], list[str]] | None = None) -> None:
        if worker is None:
            raise KVConnectorError("the nixl transport needs a NixlRegionWorker registered "
                                   "with this worker's KV cache")
        self.worker = worker
        self.timeout = float(timeout)
        self.attribution = attribution
        self._engines: dict[str, tuple[str, str]] = {}  # peer -> (metadata, engine id)
        self._unreported_setup: dict[str, float] = {}

    def open_peer(self, peer: str, offer: Mapping[str, JSON]) -> float:
        """Load ``peer``'s NIXL metadata (again when it changed, e.g. after its wake)."""
        metadata = offer.get("metadata")
        if not isinstance(metadata, str) or not metadata:
            raise KVConnectorError(f"nixl: peer {peer!r} published no metadata")
        cached = self._engines.get(peer)
        if cached is not None and cached[0] == metadata:
            return 0.0
        t0 = time.perf_counter()
        engine = self.worker.update_peer(metadata.encode())
        setup = time.perf_counter() - t0
        self._engines[peer] = (metadata, engine)
        self._unreported_setup[peer] = setup
        return setup

    def fetch(self, peer: str, remote_ids: BlockIds, local_ids: BlockIds, *,
              timeout: float | None = None) -> FetchResult:
        """READ ``peer``'s blocks ``remote_ids`` into ``local_ids`` (raises
        :class:`~kvconnect.connectors.errors.KVTransferError` on failure or deadline)."""
        cached = self._engines.get(peer)
        if cached is None:
            raise KVConnectorError(f"nixl: no open peer {peer!r}; call open_peer() first")
        engine = cached[1]
        res = self.worker.read_blocks(engine, remote_ids, local_ids,
                                      timeout=self.timeout if timeout is None else timeout)
        via = res.backend
        used = self.attribution(engine) if self.attribution is not None else []
        if used:
            via = f"{via} " + ", ".join(used)
        note = f"{res.descriptors} descriptors"
        if advice := slow_gpu_lane_advice(used):
            note = f"{note}; {advice}"
        return dataclasses.replace(res, backend=via, note=note,
                                   setup_seconds=self._unreported_setup.pop(peer, 0.0))

    def invalidate(self, peer: str | None = None) -> None:
        """Forget loaded metadata so the next :meth:`open_peer` loads it again."""
        for name in list(self._engines) if peer is None else [peer]:
            self._engines.pop(name, None)
            self._unreported_setup.pop(name, None)

    def close(self) -> None:
        """Forget peers; the worker itself belongs to its creator."""
        self.invalidate()


class NixlMetadataExporter:
    """The serving half: publishes the worker's current metadata (registration happens
    elsewhere; NIXL serves READs itself)."""

    def __init__(self, worker: NixlRegionWorker) -> None:
        self.worker = worker

    def describe(self) -> JSONObject:
        return {"metadata": self.worker.metadata_json().decode()}

    def pause(self) -> None:
        return None

    def resume(self) -> None:
        return None

    def close(self) -> None:
        return None


class NixlRegistration:
    """One worker's NIXL agent and its registration of ``ctx.cache`` (the
    :class:`~kvconnect.connectors.transport.MemoryRegistration` of ``nixl``). The agent runs
    without NIXL's progress thread (NIXL 1.5 spins it without pause, a core per agent): a
    READ progresses inside ``read_blocks``, a serving worker calls :meth:`progress`."""

    def __init__(self, ctx: TransportContext) -> None:
        from .worker import NixlRegionWorker

        self.cache = ctx.cache
        self.worker = NixlRegionWorker(ctx.name, default_timeout=ctx.timeout,
                                       progress_thread=False)
        self.identity = self.worker.agent_name

    def register(self) -> str:
        """Register the committed KV cache (refused before its final commit)."""
        w = self.worker
        w.register_kv_cache(self.cache)
        return (f"agent {w.agent_name}: {w.num_registrations} registrations (one per "
                f"physical chunk) of {len(w.regions)} committed regions, memory type "
                f"{w.memory_type}, after the final commit")

    def deregister(self) -> None:
        self.worker.deregister()

    def reregister(self) -> str:
        self.worker.reregister()
        return (f"registered again: generation {self.worker.generation}, "
                f"{self.worker.num_registrations} registrations")

    def progress(self) -> None:
        self.worker.progress()

    def take_notices(self) -> dict[str, int]:
        """READ completion notifications received since the last call, per agent name."""
        return {agent: len(msgs) for agent, msgs in self.worker.get_notifications().items()}

    def close(self) -> None:
        self.worker.close()


def _worker_of(registration: Any, half: str) -> Any:
    if not isinstance(registration, NixlRegistration):
        raise KVConnectorError(f"the nixl {half} needs this worker's NixlRegistration "
                               "(NIXL_TRANSPORT.registration(ctx), registered with its KV "
                               f"cache), got {type(registration).__name__}")
    return registration.worker


def _receiver(ctx: TransportContext, registration: Any) -> NixlTransport:
    lanes = LaneTracker() if os.environ.get(PROTO_INFO_ENV) else None
    return NixlTransport(_worker_of(registration, "receiver"), timeout=ctx.timeout,
                         attribution=lanes.lanes_after_read if lanes else None,
                         **ctx.options_for("nixl"))


def _exporter(ctx: TransportContext, registration: Any) -> NixlMetadataExporter:
    return NixlMetadataExporter(_worker_of(registration, "exporter"))


#: the ``nixl`` transport (registered by kvconnect.connectors.registry)
NIXL_TRANSPORT = TransportSpec(
    "nixl", _receiver, _exporter, registration=NixlRegistration,
    completion_notice="a NIXL notification sent with each READ",
    requires=nixl_install_problem,
    environment={PROTO_INFO_ENV: "y"},  # UCX names its lanes: READs are attributed
    description="NIXL READs of registered committed regions (UCX underneath)")
