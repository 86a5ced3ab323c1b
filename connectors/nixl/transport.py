"""The ``nixl`` transport: the :class:`~kvconnect.connectors.transport.Transport` interface
over a registered :class:`~kvconnect.connectors.nixl.worker.NixlRegionWorker`.

The worker (agent, registrations, re-registration after sleep / wake) stays with whoever
created it; this adapter only loads peers and READs. A peer's offer is
``{"metadata": <the peer's metadata_json()>}``; :meth:`NixlTransport.open_peer` loads or
refreshes it (``update_peer``) when it changed. ``attribution(engine_id)`` may name the UCX
lanes a READ used (the harness passes its lane tracker); without it the backend is what
NIXL reports. When those lanes show GPU memory moved by UCX's TCP software emulation, the
fetch's note says why and what changes it (:func:`slow_gpu_lane_advice`, measured in
docs/backends.md, "UCX and cuda_ipc on one node").

Units: bytes, seconds, logical blocks for block ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvconnect.bounded_json import JSON, JSONObject

from ..errors import KVConnectorError
from ..transport import FetchResult, TransportContext, TransportSpec, register_transport

if TYPE_CHECKING:
    from .worker import NixlRegionWorker

__all__ = ["NixlMetadataExporter", "NixlTransport", "slow_gpu_lane_advice"]


def slow_gpu_lane_advice(lanes: Sequence[str]) -> str:
    """Why UCX moved GPU memory through TCP software emulation and what changes it, or ""
    when ``lanes`` (``"<config> <description> (<into><-<from>)"``, harness/ucx_lanes.py)
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

    def fetch(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int], *,
              timeout: float | None = None) -> FetchResult:
        """READ ``peer``'s blocks ``remote_ids`` into ``local_ids`` (raises
        :class:`~kvconnect.connectors.errors.KVTransferError` on failure or deadline)."""
        cached = self._engines.get(peer)
        if cached is None:
            raise KVConnectorError(f"nixl: no open peer {peer!r}; call open_peer() first")
        engine = cached[1]
        res = self.worker.read_blocks(engine, list(remote_ids), list(local_ids),
                                      timeout=self.timeout if timeout is None else timeout)
        via = res.backend if res.transport == res.backend else f"{res.backend}/{res.transport}"
        used = self.attribution(engine) if self.attribution is not None else []
        if used:
            via = f"{via} " + ", ".join(used)
        note = f"{res.descriptors} descriptors"
        if advice := slow_gpu_lane_advice(used):
            note = f"{note}; {advice}"
        return FetchResult(int(res.bytes), float(res.seconds), via,
                           self._unreported_setup.pop(peer, 0.0), int(res.num_blocks), note)

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


def _receiver(ctx: TransportContext) -> NixlTransport:
    return NixlTransport(ctx.nixl, timeout=ctx.timeout, attribution=ctx.attribution,
                         **ctx.options.get("nixl", {}))


def _exporter(ctx: TransportContext) -> NixlMetadataExporter:
    if ctx.nixl is None:
        raise KVConnectorError("the nixl exporter needs a registered NixlRegionWorker")
    return NixlMetadataExporter(ctx.nixl)


def _requires() -> str | None:
    from .worker import nixl_importable

    return None if nixl_importable() else "NIXL is not installed (pip install kvconnect[nixl])"


register_transport(TransportSpec(
    "nixl", _receiver, _exporter, same_host_only=False, requires=_requires,
    description="NIXL READs of registered committed regions (UCX underneath)"))
