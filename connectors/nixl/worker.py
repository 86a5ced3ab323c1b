"""NIXL connector worker on committed extents.

The worker takes KV geometry only from committed regions (:class:`kvconnect.views.CommittedRegion`,
``cache.committed_regions()``), never from storage sizes, and only after the cache's final commit.

Registration: one NIXL registration per physical chunk (``ExtensibleTensor.physical_chunks()``),
covering exactly the committed blocks inside that chunk. Every transfer descriptor (one per
block per region) is checked to lie inside one chunk: UCX exports only the first physical
handle of a region spanning several (ucx #11283), so a descriptor crossing a chunk boundary
would silently hit the wrong memory.

Typical use (decode pulls blocks from prefill)::

    with NixlRegionWorker("prefill") as p, NixlRegionWorker("decode") as d:
        p.register_kv_cache(prefill_cache)      # after extend_kv_cache(...)
        d.register_kv_cache(decode_cache)
        peer = d.add_peer(p.metadata_json())    # JSON bytes, crosses processes
        result = d.read_blocks(peer, remote_block_ids=[3, 7], local_block_ids=[0, 1])
        print(result.gbps, result.backend)

After sleep / wake (``cache.release_physical(); cache.recommit()``) call :meth:`reregister` and
send the new metadata to every peer, which loads it with :meth:`update_peer` (nixl #1126).

A side that is read from must make NIXL progress (``progress_thread``, :class:`NixlRegionWorker`).

Units: bytes for lengths and addresses, blocks for block ids and counts, seconds for time.
The worker is not thread-safe: use it from one thread.
"""

from __future__ import annotations

import json
import logging
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

from kvconnect.block_ids import BlockIds, as_block_ids
from kvconnect.cache_source import KVCacheSource
from kvconnect.lifetime import ClosesOnExit
from kvconnect.peer_layout import PeerLayout, layout_facts
from kvconnect.polling import poll_until
from kvconnect.views import PagedRegion

from ..errors import IncompatiblePeerError, KVConnectorError
from ..transport import FetchResult
from .agent import NotificationInbox, create_agent, drain_agent, release_logged
from .descriptors import PhysicalChunk, memory_type_for_device
from .handshake import HandshakeMetadata, RegionAddress
from .peers import LoadedPeer, drop_peer, load_peer, peer_descriptors, read_indices
from .reads import Reads
from .registration import (
    GivenRegions,
    RegistrationPlan,
    plan_registration,
    register_plan,
    source_layout,
    source_regions,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_TIMEOUT_S", "NixlRegionWorker"]

#: default deadline of one transfer, in seconds
DEFAULT_TIMEOUT_S = 30.0


class NixlRegionWorker(ClosesOnExit):
    """One NIXL agent registering one KV cache's committed extents and reading peers' blocks.

    ``engine_id`` names this side in metadata and errors; ``agent_name`` defaults to a unique
    name derived from it. ``backends`` are NIXL backend names (``("UCX",)``).

    ``progress_thread``: NIXL's own progress thread serves peers' reads of our memory without
    any call from us, but NIXL 1.5's Python API runs it with zero delay, so it keeps one CPU
    core busy per agent. With ``progress_thread=False`` the reading side progresses while it
    waits in :meth:`read_blocks`, and a side that is *read from* must call :meth:`progress`
    (or :meth:`wait_for_notification`) every few milliseconds, or its peers' reads stall
    until their deadline.
    """

    def __init__(self, engine_id: str, *, agent_name: str | None = None,
                 backends: Sequence[str] = ("UCX",),
                 default_timeout: float = DEFAULT_TIMEOUT_S,
                 progress_thread: bool = True) -> None:
        self.engine_id = str(engine_id)
        self.agent_name = agent_name or f"{self.engine_id}-{uuid.uuid4().hex[:12]}"
        self.backends = tuple(backends)
        if not self.backends:
            raise ValueError("at least one NIXL backend is needed, e.g. backends=('UCX',)")
        self.default_timeout = float(default_timeout)
        self.progress_thread = bool(progress_thread)
        #: the NIXL agent, created on first registration (start-up costs ~0.5-2 s)
        self._agent: Any = None
        #: drains and drops the agent when this worker is closed or collected (see drain_agent)
        self._retire_agent: weakref.finalize | None = None
        self._closed = False
        self._source: KVCacheSource | GivenRegions | None = None
        #: the last registration's regions, extents and transfer regions (kept while the
        #: memory sleeps, so peers can still be loaded; dropped at close)
        self._plan: RegistrationPlan | None = None
        self._reg_dlists: list[Any] = []
        self._local_prep: Any = None
        self._layout: PeerLayout | None = None
        self._metadata: HandshakeMetadata | None = None
        self._generation = 0
        #: names this worker instance in its metadata (a restart is a new incarnation)
        self.incarnation = uuid.uuid4().hex
        self._peers: dict[str, LoadedPeer] = {}
        self._inbox = NotificationInbox()
        self._reads = Reads(self.engine_id, self.backends, self._inbox)

    # -- properties ----------------------------------------------------------
    @property
    def is_registered(self) -> bool:
        """True while KV memory is registered with NIXL."""
        return bool(self._reg_dlists)

    @property
    def num_registrations(self) -> int:
        """Number of live NIXL registrations (one per physical chunk holding committed blocks)."""
        return len(self._reg_dlists)

    @property
    def registered_extents(self) -> list[tuple[int, int, int]]:
        """``(addr, length, device_id)`` of each live registration, in bytes."""
        plan = self._plan
        return list(plan.extents) if plan is not None and self.is_registered else []

    @property
    def regions(self) -> list[PagedRegion]:
        """The committed regions currently registered (local region order)."""
        return list(self._plan.regions) if self._plan is not None else []

    @property
    def memory_type(self) -> str:
        """``"DRAM"`` or ``"VRAM"`` once registered, ``""`` before."""
        return self._plan.memory_type if self._plan is not None else ""

    @property
    def generation(self) -> int:
        """Registration generation; grows by one on every (re-)registration."""
        return self._generation

    @property
    def peers(self) -> list[str]:
        """Engine ids of the loaded peers."""
        return list(self._peers)

    @property
    def layout(self) -> PeerLayout:
        """The layout this worker publishes (and compares peers' with), once registered."""
        if self._layout is None:
            raise KVConnectorError(f"{self.engine_id}: nothing registered yet")
        return self._layout

    # -- registration --------------------------------------------------------
    def register_kv_cache(self, cache: KVCacheSource) -> HandshakeMetadata:
        """Register the committed regions of an :class:`~kvconnect.kv_cache.ExtensibleKVCache`
        (any :class:`~kvconnect.cache_source.KVCacheSource`).

        Only legal after the final commit (``cache.is_final``); raises
        :class:`KVConnectorError` before. The published :class:`~kvconnect.peer_layout.PeerLayout`
        is ``PeerLayout.from_cache(cache)`` (config facts from ``cache.config``).
        Returns the new handshake metadata.
        """
        self._check_open()
        if not getattr(cache, "is_final", False):
            raise KVConnectorError(
                f"{self.engine_id}: cannot register the KV cache before its final commit "
                "(cache.is_final is False): registration is deferred until "
                "cache.extend_kv_cache(num_blocks) has committed the final size")
        self._check_unregistered()
        self._source = cache
        return self._register()

    def register_regions(self, regions: Sequence[PagedRegion], chunks: Sequence[PhysicalChunk],
                         *, config: object = None, **layout_info: int | str | None
                         ) -> HandshakeMetadata:
        """Register committed regions of memory that is not an ExtensibleKVCache (e.g. an
        ordinary cudaMalloc allocation, as the benchmarks' control): ``regions`` from
        :func:`kvconnect.views.committed_regions`, ``chunks`` the physical allocations holding
        them (``Chunk`` objects or ``(va, size)`` tuples, bytes).

        The caller vouches that the memory stays allocated and final while registered.
        Layout facts come from ``config`` and/or keywords ``block_size``, ``dtype``,
        ``layout``, ``kernel_block_size`` (:func:`kvconnect.peer_layout.layout_facts`).
        """
        self._check_open()
        self._check_unregistered()
        self._source = GivenRegions(list(regions), list(chunks),
                                    layout_facts(config, **layout_info))
        return self._register()

    def reregister(self) -> HandshakeMetadata:
        """Deregister and register again from the same source (after ``cache.recommit()``).

        Returns the new metadata; every peer must load it with :meth:`update_peer` (nixl #1126).
        """
        self._check_open()
        if self._source is None:
            raise KVConnectorError(f"{self.engine_id}: reregister() before any registration")
        self.deregister()
        return self._register()

    def deregister(self) -> None:
        """Release the local prepared descriptor list and all registrations (idempotent).

        Call it before ``cache.release_physical()`` when the cache goes to sleep.
        """
        if self._local_prep is not None:
            prep, self._local_prep = self._local_prep, None
            release_logged(self.engine_id, "releasing the local descriptor list",
                           self._agent.release_dlist_handle, prep)
        errors: list[BaseException] = []
        while self._reg_dlists:
            dlist = self._reg_dlists.pop()
            try:
                self._agent.deregister_memory(dlist)
            except Exception as exc:  # noqa: BLE001 - keep releasing the others
                errors.append(exc)
        self._metadata = None
        if errors:
            raise KVConnectorError(f"{self.engine_id}: deregistration failed: {errors[0]}")

    def _register(self) -> HandshakeMetadata:
        source = self._source
        if source is None:
            raise KVConnectorError(f"{self.engine_id}: no KV cache or regions to register")
        regions, chunks = source_regions(source, self.engine_id)
        plan = plan_registration(regions, chunks, self.engine_id)
        layout = source_layout(source, regions, self.engine_id)
        self._ensure_agent()
        self._reg_dlists, self._local_prep = register_plan(self._agent, plan, self.engine_id)
        self._plan = plan
        if self._layout is not None and layout.differences(self._layout) and self._peers:
            logger.warning("%s: the layout changed on re-registration; dropping peers %s "
                           "(add them again)", self.engine_id, sorted(self._peers))
            for name in list(self._peers):
                self.remove_peer(name)
        self._layout = layout
        self._generation += 1
        # Agent metadata only covers memory registered before the call: fetch it now.
        self._metadata = HandshakeMetadata(
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            agent_metadata=bytes(self._agent.get_agent_metadata()),
            memory_type=plan.memory_type,
            layout=layout,
            regions=tuple(RegionAddress(int(r.base_ptr), memory_type_for_device(r.device)[1])
                          for r in regions),
            registrations=tuple(plan.extents),
            generation=self._generation,
            incarnation=self.incarnation,
        )
        return self._metadata

    def start(self) -> None:
        """Create the NIXL agent now (idempotent). Registration does it when needed; call this
        to pay the start-up (~0.5-2 s) early or to time it."""
        self._check_open()
        self._ensure_agent()

    @property
    def is_started(self) -> bool:
        """True once the NIXL agent exists (and until :meth:`close`)."""
        return self._agent is not None

    def _ensure_agent(self) -> None:
        if self._agent is None:
            agent = create_agent(self.agent_name, self.backends, self.progress_thread,
                                 self.engine_id)
            self._agent = agent
            # The finalizer owns the teardown order: drain UCX, then drop the last reference.
            self._retire_agent = weakref.finalize(self, drain_agent, agent, self.engine_id)
            del agent

    def _check_unregistered(self) -> None:
        if self.is_registered:
            raise KVConnectorError(f"{self.engine_id}: already registered; use reregister() "
                                   "after the cache's memory was recommitted")

    # -- metadata / peers ----------------------------------------------------
    def metadata(self) -> HandshakeMetadata:
        """This side's current handshake metadata (after registration)."""
        self._check_open()
        if self._metadata is None:
            raise KVConnectorError(f"{self.engine_id}: no metadata before registration")
        return self._metadata

    def metadata_json(self) -> bytes:
        """:meth:`metadata` as UTF-8 JSON bytes, ready to send to a peer."""
        return self.metadata().to_json()

    def check_peer(self, metadata: bytes | str | HandshakeMetadata) -> HandshakeMetadata:
        """Parse a peer's metadata and check its layout against ours.

        Raises :class:`IncompatiblePeerError` listing every difference; loads nothing.
        """
        self._check_open()
        md = metadata if isinstance(metadata, HandshakeMetadata) else \
            HandshakeMetadata.from_json(metadata)
        diffs = self.layout.differences(md.layout)
        if diffs:
            raise IncompatiblePeerError(diffs, peer=md.engine_id)
        return md

    def add_peer(self, metadata: bytes | str | HandshakeMetadata) -> str:
        """Load a peer's metadata (JSON from :meth:`metadata_json`); returns its engine id.

        The layout is checked first (:class:`IncompatiblePeerError` before any NIXL call);
        then the remote agent is added and its descriptor list prepared once.
        """
        md = self.check_peer(metadata)
        if md.engine_id in self._peers:
            raise KVConnectorError(f"{self.engine_id}: peer {md.engine_id!r} already loaded; "
                                   "use update_peer() to load new metadata")
        if md.agent_name == self.agent_name:
            raise KVConnectorError(f"{self.engine_id}: peer uses our own agent name")
        self._load_peer(md)
        return md.engine_id

    def update_peer(self, metadata: bytes | str | HandshakeMetadata) -> str:
        """Replace a peer's metadata (after it re-registered, or restarted under the same
        engine id): remove its agent, load the new metadata, prepare descriptors again. Adds
        the peer when it is not loaded yet. If loading the new metadata fails, the peer is
        left removed. A document older than the loaded one (same incarnation, lower
        generation: replayed or delayed) raises KVConnectorError and changes nothing."""
        md = self.check_peer(metadata)
        old = self._peers.get(md.engine_id)
        if old is None:
            return self.add_peer(md)
        was = old.metadata
        if md.incarnation and md.incarnation == was.incarnation and \
                md.generation < was.generation:
            raise KVConnectorError(
                f"{self.engine_id}: refused stale metadata of peer {md.engine_id!r}: "
                f"generation {md.generation} is older than the loaded {was.generation} of "
                "the same incarnation (a replayed or delayed document); the loaded one stays")
        self._load_peer(md, replace=old)
        return md.engine_id

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: release its prepared descriptors and remove its agent (idempotent)."""
        entry = self._peers.pop(peer, None)
        if entry is not None:
            drop_peer(self._agent, self.engine_id, entry)

    def _load_peer(self, md: HandshakeMetadata, replace: LoadedPeer | None = None) -> None:
        local = self._plan.xfer_regions if self._plan is not None else []
        remote_descs, offsets, counts = peer_descriptors(md, local)
        if replace is not None:
            self._peers.pop(replace.metadata.engine_id, None)
            drop_peer(self._agent, self.engine_id, replace)
        self._peers[md.engine_id] = load_peer(self._agent, self.engine_id, md, remote_descs,
                                              offsets, counts)

    # -- transfers -----------------------------------------------------------
    def read_blocks(self, peer: str, remote_block_ids: BlockIds, local_block_ids: BlockIds, *,
                    timeout: float | None = None, notif: bytes | None = None) -> FetchResult:
        """READ blocks ``remote_block_ids`` of ``peer`` into local ``local_block_ids`` (pairwise),
        for every region; block until done or ``timeout`` seconds pass.

        ``peer`` is an engine id returned by :meth:`add_peer`. The peer is notified on
        completion with ``notif`` (default: a small JSON message naming us and the block count).
        Any failure (an ``"ERR"`` state, a NIXL exception, the deadline) raises
        :class:`KVTransferError` naming the peer, the local blocks and the cause.

        Returns a :class:`~kvconnect.connectors.transport.FetchResult`: ``bytes`` moved, wall
        ``seconds`` from posting the prepared request to seeing it complete (the first read
        from a peer includes UCX connection set-up), ``blocks``, ``descriptors`` (blocks x
        transfer regions) and ``backend`` as NIXL reports it (``query_xfer_backend``).
        """
        self._check_open()
        entry = self._peers.get(peer)
        if entry is None:
            raise KVConnectorError(f"{self.engine_id}: unknown peer {peer!r}; loaded: "
                                   f"{sorted(self._peers)}")
        plan = self._plan
        if self._local_prep is None or plan is None:
            raise KVConnectorError(f"{self.engine_id}: not registered")
        # negative ids: read_indices reports them with the valid range
        remote = as_block_ids(remote_block_ids, "remote_block_ids", allow_negative=True)
        local = as_block_ids(local_block_ids, "local_block_ids", allow_negative=True)
        if remote.size != local.size:
            raise ValueError(f"{remote.size} remote block ids but {local.size} local ones")
        if remote.size == 0:
            raise ValueError("read_blocks needs at least one block")
        local_idx, remote_idx = read_indices(plan, entry, local, remote)
        nbytes = int(sum(int(r.block_len) for r in plan.xfer_regions)) * int(local.size)
        if notif is None:
            notif = json.dumps({"kvconnect": "read", "engine_id": self.engine_id[:200],
                                "num_blocks": int(local.size)}).encode()
        timeout = self.default_timeout if timeout is None else float(timeout)
        seconds, backend = self._reads.read(self._agent, peer, local.tolist(),
                                            (self._local_prep, local_idx),
                                            (entry.prep, remote_idx), notif, timeout)
        return FetchResult(bytes=nbytes, seconds=seconds, backend=backend,
                           blocks=int(local.size), descriptors=int(local_idx.size))

    # -- notifications -------------------------------------------------------
    def get_notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by remote agent name."""
        self._check_open()
        self._poll_notifs()
        return self._inbox.take_all()

    def progress(self) -> int:
        """Drive NIXL/UCX progress once (serves peers' reads when ``progress_thread=False``)
        and buffer new notifications; returns how many arrived. Cheap; call it in a loop."""
        self._check_open()
        return self._poll_notifs()

    def _poll_notifs(self) -> int:
        if self._agent is None:
            return 0
        return self._inbox.keep(self._agent.get_new_notifs() or {})

    def wait_for_notification(self, timeout: float | None = None,
                              from_agent: str | None = None) -> tuple[str, bytes]:
        """Wait (with a deadline, seconds) for one notification, optionally from one agent.

        Returns ``(agent_name, message)``; raises :class:`TimeoutError` when none arrives.
        """
        self._check_open()
        timeout = self.default_timeout if timeout is None else float(timeout)
        who = f" from {from_agent!r}" if from_agent else ""

        def next_one() -> tuple[str, bytes] | None:
            self._poll_notifs()
            return self._inbox.take_one(from_agent)

        return poll_until(next_one, max(0.0, timeout), first_pause=1e-4, max_pause=1e-3,
                          on_timeout=lambda _s: TimeoutError(
                              f"{self.engine_id}: no NIXL notification{who} within "
                              f"{timeout:.3g} s"))

    # -- shutdown ------------------------------------------------------------
    def close(self) -> None:
        """Release transfer and descriptor handles, remove remote agents, deregister, drain
        UCX progress, destroy the agent (idempotent). Safe after any failure: a peer killed
        mid-READ, a peer that closed its agent, a READ past its deadline, a lost notification.
        """
        if self._closed:
            return
        self._closed = True
        if self._agent is None:
            return
        # Queued operations of failed or timed-out requests complete (or fail) first.
        drain_agent(self._agent, self.engine_id)
        self._reads.release_stuck(self._agent)
        for name in list(self._peers):
            self.remove_peer(name)
        try:
            self.deregister()
        finally:
            self._source = None
            self._plan = None
            # drain the agent's UCX queues and drop our reference (the agent is destroyed
            # unless someone else still holds it)
            self._agent = None
            retire, self._retire_agent = self._retire_agent, None
            if retire is not None:
                retire()

    def _check_open(self) -> None:
        if self._closed:
            raise KVConnectorError(f"{self.engine_id}: the NIXL connector worker is closed")

    def __repr__(self) -> str:
        state = "closed" if self._closed else (
            f"{self.num_registrations} registrations, {len(self._peers)} peers")
        return f"<NixlRegionWorker {self.engine_id!r} agent={self.agent_name!r} {state}>"
