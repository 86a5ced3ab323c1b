"""The ``ipc`` transport: KV blocks between processes of one host through POSIX-fd handles.

Serving side: an :class:`IpcExportServer` answers on a Unix socket in a private 0700
directory. A connecting process is checked with SO_PEERCRED (our uid, and a pid the owner
allows) and receives the KV tensors' chunk fds (``ExtensibleTensor.export_handles()``) with a
JSON description: tensor geometry, chunk records, its
:class:`~kvconnect.peer_layout.PeerLayout` (the committed regions, the page holders and the
logical block count), the device's UUID and a *generation* that grows on every :meth:`~IpcExportServer.resume` (after
the cache slept and woke: new physical memory at the same addresses).

Receiving side: :class:`IpcTransport` maps a peer's chunks once
(:class:`kvconnect.ipc.PeerMapping`), compares the peer's layout with its own
(:meth:`~kvconnect.peer_layout.PeerLayout.differences`, kvconnect's one rule), pairs the
regions that hold their pages and builds one
:class:`~..copy.block_copy.BlockCopyPlan` per peer; each :meth:`~IpcTransport.fetch` then uploads
the block ids and runs **one** copy launch over every layer, region and block. The mapping
and the plan are cached across fetches and rebuilt when the peer's generation changes, when
this cache's committed state changes, or on :meth:`~IpcTransport.invalidate` (call it after
this worker's own sleep / wake). The set-up (connect, map, plan, and on CUDA the kernel's
compilation and one captured graph per id-count bucket) is reported apart from the copy, in
the first fetch after it. A fetch then stages the ids in pinned memory and replays one graph
(:mod:`..copy.block_copy`); :meth:`~IpcTransport.start` returns without waiting (a
:class:`PendingFetch`), and several requests to one peer merge into one launch
(:meth:`~IpcTransport.fetch_many`).

GPUs: on one GPU the copy runs there. Across GPUs, ``direction="push"`` launches on the
exporter's GPU (reading its own memory, writing into ours through a peer mapping: access to
our chunks is granted to that GPU), ``"pull"`` on ours (reading the peer's memory);
``"auto"`` pushes when the exporter's GPU is visible here, as a kernel storing to the peer
measured faster than one loading from it on cudaMalloc memory (docs/ and
benchmarks/results/ hold the figures).

Units: bytes, seconds, logical blocks for block ids.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvconnect.block_ids import BlockIds, merged_block_ids
from kvconnect.bounded_json import JSON, Doc, JSONObject
from kvconnect.cache_source import KVCacheSource
from kvconnect.framing import (
    IpcError,
    connect_unix,
    peer_credentials,
    recv_json,
    recv_message,
    send_error,
    send_message,
)
from kvconnect.ipc import PeerMapping, export_message, import_message
from kvconnect.lifetime import ClosesOnExit
from kvconnect.peer_layout import PeerLayout
from kvconnect.unix_server import UnixServer

from ..copy._cuda_streams import current_stream, synchronize
from ..copy._kernel_launch import wait_events
from ..copy.block_copy import LAUNCH_MODES, BlockCopyPlan, layout_block_region
from ..errors import IncompatiblePeerError, KVConnectorError, KVTransferError
from ..transport import FetchResult, TransportContext, TransportSpec
from ._cache_state import CacheState
from .reply import checked_layout, peer_block_region

log = logging.getLogger(__name__)

__all__ = ["DIRECTIONS", "IPC_TRANSPORT", "IpcExportServer", "IpcTransport", "PendingFetch",
           "device_uuid"]

#: where a cross-GPU copy runs: the exporter's GPU (push), ours (pull), or push when possible
DIRECTIONS = ("auto", "push", "pull")
#: the JSON layout of the export reply; bump when a field changes meaning
WIRE_VERSION = 3


def device_uuid(device: torch.device) -> str:
    """A GPU's UUID (the same in every process whatever CUDA_VISIBLE_DEVICES says), or
    ``"host"`` for the host backend."""
    if device.type != "cuda":
        return "host"
    return str(torch.cuda.get_device_properties(device).uuid)


def _local_ordinal(uuid: str) -> int | None:
    """The ordinal under which this process sees the GPU ``uuid``, or None."""
    if uuid == "host" or not torch.cuda.is_available():
        return None
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


class IpcExportServer:
    """Serves this worker's KV chunk fds to allowed processes (prefill side).

    ``allowed`` returns the pids that may connect (checked with SO_PEERCRED, as well as the
    uid, the moment a connection is accepted). Each request gets the chunks as they are
    *now*. Clients are served concurrently, each in its own thread (at most
    :data:`MAX_CLIENTS` at once; more wait in the listen backlog): a client that connects and
    then stalls holds only its own thread, for at most ``timeout`` seconds, and only an
    allowed process gets that far. :attr:`errors` keeps the last :data:`MAX_KEPT_ERRORS`
    failed requests (:attr:`num_errors` counts them all); the first :data:`MAX_LOGGED_ERRORS`
    are logged as warnings, the rest at debug level. ``pause()`` holds requests while the
    cache sleeps; ``resume()`` lets them through and bumps :attr:`generation` so receivers
    re-map. :meth:`close` stops accepting, ends the clients' connections, removes the socket.
    """

    #: clients served at once
    MAX_CLIENTS = 64
    #: failed requests whose text is kept, and those logged as warnings
    MAX_KEPT_ERRORS = 64
    MAX_LOGGED_ERRORS = 10

    def __init__(self, cache: KVCacheSource, directory: str, name: str,
                 allowed: Callable[[], set[int]], timeout: float) -> None:
        self.cache = cache
        self.path = os.path.join(directory, f"{name}.sock")
        self.allowed = allowed
        self.timeout = timeout
        self.served = 0
        self.generation = 1
        self.errors: collections.deque[str] = collections.deque(maxlen=self.MAX_KEPT_ERRORS)
        self.num_errors = 0
        self._lock = threading.Lock()  # held while the cache sleeps (pause / resume)
        self._state = threading.Lock()  # counters and errors
        self._server = UnixServer(self.path, self._client, max_clients=self.MAX_CLIENTS,
                                  name="kvc-ipc-export")

    def describe(self) -> JSONObject:
        """What a receiver needs to connect: the socket path, our pid, the generation."""
        return {"path": self.path, "pid": os.getpid(), "generation": self.generation}

    @property
    def active_clients(self) -> int:
        """Connections being served now."""
        return self._server.active_clients

    def pause(self) -> None:
        """Hold requests (while the cache sleeps): they wait until :meth:`resume`."""
        self._lock.acquire()

    def resume(self) -> None:
        """Let requests through again; receivers holding older mappings must re-map."""
        self.generation += 1
        self._lock.release()

    def _client(self, conn: socket.socket) -> None:
        """One connection (its own thread, :class:`~kvconnect.unix_server.UnixServer`)."""
        try:
            self._handle(conn)
        except (IpcError, OSError, RuntimeError, ValueError) as exc:
            self._failed(exc)
            try:
                send_error(conn, exc)  # the decode sees this error, not a closed socket
            except OSError:
                pass

    def _failed(self, exc: BaseException) -> None:
        with self._state:
            self.num_errors += 1
            self.errors.append(str(exc))
            count = self.num_errors
        if count <= self.MAX_LOGGED_ERRORS and self._server.serving:
            log.warning("ipc export: %s%s", exc, " (later failures are logged at debug level)"
                        if count == self.MAX_LOGGED_ERRORS else "")
        else:
            log.debug("ipc export: %s", exc)

    def _handle(self, conn: socket.socket) -> None:
        creds = peer_credentials(conn)
        if creds.uid != os.getuid() or creds.pid not in self.allowed():
            raise IpcError(f"refused a connection from pid {creds.pid} uid {creds.uid}: not a "
                           "decode worker of this run")
        request = recv_json(conn, timeout=self.timeout)
        if request.get("op") != "export":
            raise IpcError(f"unexpected request {request.get('op')!r}")
        with self._lock:
            if not self._server.serving:
                raise IpcError("the export server is closing")
            message, out_fds = export_message(self.cache.tensors)
            try:
                send_message(conn, self._reply(message), out_fds)
            finally:
                for fd in out_fds:
                    os.close(fd)
        recv_json(conn, timeout=self.timeout)  # the decode's "mapped" acknowledgement
        with self._state:
            self.served += 1

    def _reply(self, message: JSONObject) -> JSONObject:
        """The export reply: ``message`` (chunk records) with the layout
        (``PeerLayout.from_cache``), device and generation added."""
        message.update(version=WIRE_VERSION, layout=PeerLayout.from_cache(self.cache).to_json(),
                       device=device_uuid(self.cache.device), generation=self.generation)
        return message

    def close(self) -> None:
        """Stop accepting, end every client's connection and wait (briefly) for their
        threads, remove the socket. Idempotent."""
        if not self._server.serving:
            return
        self._server.close()
        if self.num_errors > self.MAX_LOGGED_ERRORS:
            log.warning("ipc export %s: %d failed requests in all (the last: %s)",
                        self.path, self.num_errors, self.errors[-1])


@dataclass
class _Peer:
    """One open peer: its mappings and plan, what they were built against (``key``: the
    offer; ``local``: this cache's state) and the per-fetch facts fixed at that time."""

    key: tuple[str, int, int]
    local: CacheState
    mappings: list[PeerMapping]
    plan: BlockCopyPlan
    launch: torch.device
    chunks: int
    unreported_setup: float
    inflight: list[PendingFetch] = field(default_factory=list)
    # fixed per plan, derived once here instead of per fetch:
    #: FetchResult.backend and .note of every fetch
    backend: str = field(init=False, default="")
    note: str = field(init=False, default="")
    #: CUDA device indices a fetch synchronizes first (launch and local, once each)
    sync_devices: tuple[int | None, ...] = field(init=False, default=())
    #: this cache's device, and whether the copy runs on another GPU (push)
    local_device: torch.device = field(init=False, default=torch.device("cpu"))
    cross: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.local_device = local = torch.device(self.local.cache.device)
        self.backend = f"{self.plan.method}:{self.launch}"
        self.note = (f"{self.chunks} chunks of {len(self.mappings)} tensors mapped, "
                     f"{self.plan.num_columns} columns per block")
        cuda = dict.fromkeys(d for d in (self.launch, local) if d.type == "cuda")
        self.sync_devices = tuple(d.index for d in cuda)
        self.cross = self.launch != local and local.type == "cuda"

    def close(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) for copies still reading the mappings, then
        unmap them."""
        pending = [p for p in self.inflight if not p.done()]
        self.inflight.clear()
        if pending:
            try:
                wait_events([ev for p in pending for ev in p.events], timeout,
                            f"{len(pending)} copies from {self.key[0]}")
            except TimeoutError as exc:
                log.warning("ipc: unmapping a peer while copies still run: %s", exc)
        while self.mappings:
            self.mappings.pop().close()


@dataclass
class PendingFetch:
    """A copy started by :meth:`IpcTransport.start`; :meth:`wait` returns its
    :class:`FetchResult`. ``seconds`` there is the transfer's own time on the device's
    timeline, timed as a plain copy is (CUDA events): from an event recorded when
    :meth:`IpcTransport.start` was called to one recorded after the copy. Host work (ids
    converted and checked, the launch) counts where the device waited for it, and not where it
    ran beside work already queued on the stream; that work itself does not count, nor does a
    caller that looks late (an engine polling once per step). On the host, where the copy is
    synchronous, the wall time of the call."""

    peer: str
    entry: _Peer
    local_ids: np.ndarray
    nbytes: int
    started: float
    events: list[torch.cuda.Event]
    timeout: float
    finished: float | None = None
    #: (start event, end event, host seconds preparing, host seconds issuing) on CUDA
    timing: tuple[torch.cuda.Event, torch.cuda.Event, float, float] | None = None

    def done(self) -> bool:
        """True once the copy has completed (never blocks)."""
        if self.finished is None and all(ev.query() for ev in self.events):
            self.finished = time.perf_counter()
        return self.finished is not None

    def wait(self, timeout: float | None = None) -> FetchResult:
        """Block until the copy is done (at most ``timeout`` seconds, default the
        transport's); raises :class:`KVTransferError` when it fails or runs out of time."""
        if self.finished is None:
            try:
                wait_events(self.events, self.timeout if timeout is None else float(timeout),
                            f"copy of {len(self.local_ids)} blocks from {self.peer}")
            except Exception as exc:
                raise KVTransferError(self.peer, self.local_ids.tolist(), exc) from exc
            self.finished = time.perf_counter()
        entry = self.entry
        setup, entry.unreported_setup = entry.unreported_setup, 0.0
        host, launch = self.timing[2:] if self.timing is not None else (0.0, 0.0)
        return FetchResult(self.nbytes, self.seconds(), entry.backend, setup,
                           len(self.local_ids), entry.note, host_seconds=host,
                           launch_seconds=launch)

    def seconds(self) -> float:
        """The transfer's time (see the class docstring); call once it is done."""
        assert self.finished is not None
        if self.timing is None:
            return self.finished - self.started
        start, end, _, _ = self.timing
        return start.elapsed_time(end) / 1e3


class IpcTransport(ClosesOnExit):
    """The receiving half of ``ipc`` for ``cache`` (an ExtensibleKVCache); see the module
    docstring. ``direction``: one of :data:`DIRECTIONS`; ``method``: the block-copy method
    (``"auto"``: the kernel on CUDA, the host method on the host); ``launch``: how the kernel
    is issued (``"graph"`` or ``"eager"``, :data:`.block_copy.LAUNCH_MODES`)."""

    name = "ipc"

    def __init__(self, cache: KVCacheSource, *, timeout: float = 60.0, direction: str = "auto",
                 method: str = "auto", launch: str = "graph") -> None:
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {launch!r}")
        self.cache = cache
        self.timeout = float(timeout)
        self.direction = direction
        self.method = method
        self.launch = launch
        self._peers: dict[str, _Peer] = {}
        self._closed = False

    # -- peers ---------------------------------------------------------------------------
    def open_peer(self, peer: str, offer: Mapping[str, JSON]) -> float:
        """Map ``peer``'s chunks from its :meth:`IpcExportServer.describe` ``offer`` and
        build the copy plan, unless the cached ones are still valid. Returns the seconds
        spent (0.0 when cached). Raises :class:`IpcError` for a bad or unreachable peer,
        :class:`IncompatiblePeerError` when the layouts do not pair up."""
        if self._closed:
            raise KVConnectorError("IpcTransport used after close()")
        try:
            key = (str(offer["path"]), int(offer["pid"]), int(offer.get("generation", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise IpcError(f"peer {peer!r}: malformed ipc offer {dict(offer)!r}") from exc
        entry = self._peers.get(peer)
        if entry is not None and entry.key == key and entry.local.unchanged():
            return 0.0
        self.invalidate(peer)
        t0 = time.perf_counter()
        entry = self._connect(peer, key, CacheState(self.cache))
        entry.unreported_setup = time.perf_counter() - t0
        self._peers[peer] = entry
        return entry.unreported_setup

    def _connect(self, peer: str, key: tuple[str, int, int], local: CacheState) -> _Peer:
        path, pid, _ = key
        cache = self.cache
        driver = cache.tensors[0].driver
        mappings: list[PeerMapping] = []
        sock = connect_unix(path, self.timeout)
        try:
            creds = peer_credentials(sock)
            if creds.pid != pid or creds.uid != os.getuid():
                raise IpcError(f"{path} is served by pid {creds.pid} uid {creds.uid}, not by "
                               f"{peer} (pid {pid})")
            send_message(sock, {"op": "export", "pid": os.getpid()})
            reply, fds = recv_message(sock, timeout=self.timeout)
            try:
                Doc(reply, f"export reply from {peer}", IpcError).check_version(
                    "version", WIRE_VERSION, "wire version")
                remote_gpu = _local_ordinal(str(reply.get("device", "host")))
                launch, extra = self._launch_device(remote_gpu)
                # Every field of the peer's chunk records is validated there (IpcError).
                mappings.extend(import_message(driver, reply, fds, access_devices=extra))
            finally:
                for fd in fds:
                    os.close(fd)
            send_message(sock, {"op": "mapped"})
            plan = self._plan(peer, reply, mappings, launch)
            if launch != cache.device:
                self._grant_local_access(launch)
            plan.warm_up()  # JIT and table upload belong to set-up, not to the first fetch
            return _Peer(key, local, mappings, plan, launch, len(reply["chunks"]), 0.0)
        except BaseException:
            for m in mappings:
                m.close()
            raise
        finally:
            sock.close()

    def _launch_device(self, remote_gpu: int | None) -> tuple[torch.device, list[int]]:
        """(where copies run, peer GPUs the mappings must grant access to)."""
        local = torch.device(self.cache.device)
        if local.type != "cuda" or remote_gpu is None or remote_gpu == local.index:
            return local, []
        if self.direction == "pull":
            return local, [remote_gpu]
        return torch.device("cuda", remote_gpu), [remote_gpu]

    def _grant_local_access(self, launch: torch.device) -> None:
        """Let the push GPU write into our committed chunks."""
        for t in self.cache.tensors:
            for ch in t.physical_chunks():
                t.driver.set_access(ch.va, ch.size, [launch.index])

    def _plan(self, peer: str, reply: Mapping[str, JSON], mappings: list[PeerMapping],
              launch: torch.device) -> BlockCopyPlan:
        cache = self.cache
        # every field of the peer's layout is validated there (IpcError)
        remote = checked_layout(peer, reply, len(mappings))
        local = PeerLayout.from_cache(cache)
        diffs = local.differences(remote)
        if diffs:
            raise IncompatiblePeerError(diffs, peer)
        remote_index = {r.key: j for j, r in enumerate(remote.regions)}
        src, dst = [], []
        for _, r, members in local.holders():
            name = "+".join(members)
            src.append(peer_block_region(peer, remote, remote_index[r.key], mappings, name))
            t = cache.tensors[r.tensor_index]
            flat = t.committed_view(int(r.offset or 0), r.span(local.num_blocks))
            dst.append(layout_block_region(flat, r, local.num_blocks, name=name))
        return BlockCopyPlan(src, dst, device=launch, method=self.method, launch=self.launch)

    # -- transfers -----------------------------------------------------------------------
    def fetch(self, peer: str, remote_ids: BlockIds, local_ids: BlockIds, *,
              timeout: float | None = None) -> FetchResult:
        """Copy ``peer``'s logical blocks ``remote_ids[i]`` into our ``local_ids[i]`` with one
        launch and wait (at most ``timeout`` seconds) until they are in place. Raises
        ``BlockIdsError`` / ``ValueError`` for bad ids, :class:`KVConnectorError` when
        :meth:`open_peer` was not called (or the cache changed since),
        :class:`KVTransferError` when the copy fails or times out."""
        return self.fetch_many(peer, [(remote_ids, local_ids)], timeout=timeout)

    def fetch_many(self, peer: str, requests: Sequence[tuple[BlockIds, BlockIds]],
                   *, timeout: float | None = None) -> FetchResult:
        """Several ``(remote_ids, local_ids)`` requests to ``peer`` as **one** launch (local
        ids distinct across all of them), waited for like :meth:`fetch`. Work already queued
        on the devices finishes first and is not part of the result's ``seconds``."""
        entry = self._entry(peer)
        for index in entry.sync_devices:
            synchronize(index)
        return self._launch(peer, entry, requests).wait(timeout)

    def start(self, peer: str, requests: Sequence[tuple[BlockIds, BlockIds]]) -> PendingFetch:
        """Launch the copy of every ``(remote_ids, local_ids)`` request to ``peer`` as one
        launch and return at once (on CUDA; the host copies synchronously). The copy is
        ordered after work queued on this cache's current stream, and that stream's later
        work after it. Errors as :meth:`fetch`."""
        return self._launch(peer, self._entry(peer), requests)

    def _launch(self, peer: str, entry: _Peer,
                requests: Sequence[tuple[BlockIds, BlockIds]]) -> PendingFetch:
        started = time.perf_counter()
        cross, local = entry.cross, entry.local_device
        first = None
        if entry.launch.type == "cuda":  # the transfer's time starts here, on the device
            if cross:
                current_stream(entry.launch.index).wait_stream(current_stream(local.index))
            first = torch.cuda.Event(enable_timing=True)
            first.record(current_stream(entry.launch.index))
        # the one conversion of a fetch's ids; check_ids reports ids out of range (negative too)
        src, dst = merged_block_ids(requests, ("remote_ids", "local_ids"), allow_negative=True)
        if src.size:
            entry.plan.check_ids(src, dst)
        events: list[torch.cuda.Event] = []
        timing = None
        try:
            prepared = time.perf_counter()
            nbytes = entry.plan.copy(src, dst, validate=False)
            if first is not None:
                issued = time.perf_counter()
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(current_stream(entry.launch.index))
                events.append(ev)
                timing = (first, ev, prepared - started, issued - prepared)
                if cross:
                    current_stream(local.index).wait_event(ev)
        except Exception as exc:
            raise KVTransferError(peer, dst.tolist(), exc) from exc
        pending = PendingFetch(peer, entry, dst, nbytes, started, events, self.timeout,
                               timing=timing)
        entry.inflight = [p for p in entry.inflight if not p.done()]
        if events:
            entry.inflight.append(pending)
        return pending

    def _entry(self, peer: str) -> _Peer:
        entry = self._peers.get(peer)
        if entry is None:
            raise KVConnectorError(f"ipc: no open peer {peer!r}; call open_peer() first")
        if not entry.local.unchanged():
            raise KVConnectorError(f"ipc: this KV cache changed since {peer!r} was opened; "
                                   "call open_peer() again")
        return entry

    def invalidate(self, peer: str | None = None) -> None:
        """Drop the mappings and plans of ``peer`` (all peers when None); the next
        :meth:`open_peer` maps again."""
        names = list(self._peers) if peer is None else [peer]
        for name in names:
            entry = self._peers.pop(name, None)
            if entry is not None:
                entry.close(self.timeout)

    def plan_for(self, peer: str) -> BlockCopyPlan:
        """The copy plan of an open peer (for reports and benchmarks)."""
        entry = self._peers.get(peer)
        if entry is None:
            raise KVConnectorError(f"ipc: no open peer {peer!r}")
        return entry.plan

    def close(self) -> None:
        """Unmap every peer (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.invalidate()


def _receiver(ctx: TransportContext, registration: object = None) -> IpcTransport:
    return IpcTransport(ctx.cache, timeout=ctx.timeout, **ctx.options_for("ipc"))


def _exporter(ctx: TransportContext, registration: object = None) -> IpcExportServer:
    return IpcExportServer(ctx.cache, ctx.directory, ctx.name, ctx.allowed_pids, ctx.timeout)


#: the ``ipc`` transport (registered by kvconnect.connectors.registry)
IPC_TRANSPORT = TransportSpec(
    "ipc", _receiver, _exporter, same_host_only=True, needs_directory=True,
    sends_chunk_fds=True,
    description="POSIX-fd handles over a Unix socket; one block-copy launch per fetch")
