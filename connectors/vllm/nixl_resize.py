"""``KvconnectNixlConnector`` across elastic resizes of the plugin's KV cache (needs vLLM).

**Registration, one region per physical handle.** UCX cannot register a region spanning
several physical allocations (ucx #11283), and a grown segment spans several. Around
upstream's ``register_kv_caches`` (:func:`per_handle_registration`), each registration
range upstream derives is replaced by the physical allocations it touches, each registered
on its own (one NIXL region per handle, all committed memory). A later resize then only
registers the allocations it added and deregisters those it is about to release: the
registrations (and the remote keys peers hold) of every other allocation stay as they are,
so a transfer in flight is never under a registration that changes.

**Resize** (:meth:`NixlResizeState.resize`, the worker side): refused, changing nothing,
when a KV block would straddle two allocations (a NIXL descriptor must lie in one region)
or the worker uses features this does not follow (Mamba states, a host staging buffer,
mixed memory types, heterogeneous TP splits). Otherwise: register the new allocations,
set upstream's block counts, prepare new local descriptor lists for the new count (the
old ones are retired: released once no transfer started before can use them), deregister
the allocations about to go, and rebuild the handshake payload (agent metadata and block
count) that the engine core serves peers. The engine core then serves the new payload on
vLLM's side channel and bumps the engine's **KV version**, which
``request_finished`` adds to every ``kv_transfer_params`` (``kvconnect_kv_version``).

**Peers** (:meth:`NixlResizeState.refresh_peers`, the decode side, before upstream's
``start_load_kv``): a request whose prefill's KV version is newer than the one this worker
loaded that prefill's metadata at (or whose remote block ids lie past the prefill's size
known here) makes the worker drop that engine (``_cleanup_remote_engine``: NIXL agent and
descriptors; the fast path forgets its mapping) so upstream handshakes again and loads the
new registrations; while reads from that engine are still in flight the request waits a
step. Units: blocks are vLLM's logical blocks unless a name says physical; bytes.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from kvconnect.errors import KvconnectError
from kvconnect.undo import UndoStack
from kvconnect.vllm.head_planes import _instance_patch

logger = logging.getLogger(__name__)

__all__ = ["KV_VERSION_PARAM", "NixlResizeError", "NixlResizeState", "chunk_pieces",
           "straddling_block"]

#: the key ``request_finished`` adds to ``kv_transfer_params``: the producer's KV version
KV_VERSION_PARAM = "kvconnect_kv_version"


class NixlResizeError(KvconnectError, RuntimeError):
    """The NIXL connector cannot follow this resize (nothing was changed)."""


class _PerPiece(list):  # type: ignore[type-arg]
    """What the patched ``get_reg_descs`` returns: ``(range, reg descs)`` per allocation."""


def chunk_pieces(ranges: list[tuple], chunks: list[tuple[int, int]]) -> list[tuple]:
    """The physical allocations ``(address, nbytes)`` in ``chunks`` that any registration
    range ``(address, nbytes, *rest)`` touches, as ranges with that range's ``rest``, each
    once, in address order."""
    out: dict[int, tuple] = {}
    for start, n, *rest in ranges:
        for va, size in chunks:
            if va < start + n and start < va + size:
                out.setdefault(va, (va, size, *rest))
    return [out[va] for va in sorted(out)]


def straddling_block(regions: list[tuple[int, int, int, int]], chunks: list[tuple[int, int]]
                     ) -> tuple[int, int, int] | None:
    """``(region, block, address)`` of a block that straddles an allocation boundary, or
    None. ``regions``: ``(base, block_len, block_stride, num_blocks)``; a block is
    ``[base + k * stride, + block_len)``."""
    starts = sorted(va for va, _ in chunks)
    for r, (base, length, stride, count) in enumerate(regions):
        end = base + count * stride
        for b in starts:
            if base < b < end:
                k, off = divmod(b - base, stride)
                if 0 < off < length:
                    return r, k, b
    return None


@contextlib.contextmanager
def per_handle_registration(wrapper: Any, chunks: list[tuple[int, int]],
                            registered: dict[tuple[int, int], Any]) -> Iterator[None]:
    """Around upstream's ``register_kv_caches``: register each physical allocation its
    ranges touch on its own (recorded in ``registered``: ``(address, nbytes)`` -> descs)."""
    def cut(original: Any) -> Any:
        def get_reg_descs(descs: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
                return _PerPiece((p, original([p], *args, **kwargs))
                                 for p in chunk_pieces(descs, chunks))
            return original(descs, *args, **kwargs)
        return get_reg_descs

    def each(original: Any) -> Any:
        def register_memory(descs: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(descs, _PerPiece):
                return original(descs, *args, **kwargs)
            with UndoStack() as undo:
                for piece, d in descs:
                    original(d, *args, **kwargs)
                    undo.push(wrapper.deregister_memory, d)
                    registered[(piece[0], piece[1])] = d
            return None
        return register_memory

    with _instance_patch(wrapper, "get_reg_descs", cut), \
            _instance_patch(wrapper, "register_memory", each):
        yield


def flatten_registered(worker: Any) -> None:
    """Upstream keeps each ``register_memory`` argument to deregister it later: make each
    per-allocation descs list its own entry."""
    flat: list[Any] = []
    for d in worker._registered_descs:
        flat.extend(descs for _, descs in d) if isinstance(d, _PerPiece) else flat.append(d)
    worker._registered_descs[:] = flat


class NixlResizeState:
    """One NIXL connector worker's registrations and peers across resizes (see the module
    docstring). ``registered``: ``(address, nbytes)`` of each physical allocation ->
    its NIXL reg descs; ``history``: one record per resize this worker followed."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.registered: dict[tuple[int, int], Any] = {}
        self.retired: list[int] = []
        self.history: list[dict[str, Any]] = []
        #: engine id -> KV version this worker loaded that engine's metadata at
        self.peer_versions: dict[str, int] = {}
        #: requests waiting for their engine's reads to drain before it is refreshed
        self.deferred: dict[str, Any] = {}
        #: engine id -> how often its metadata was dropped to load it again
        self.refreshed: dict[str, int] = {}
        #: engine id -> the KV version of its last refresh (one refresh per version)
        self.refreshed_at: dict[str, int | None] = {}
        #: engine id -> reads refused: blocks past the size it advertised
        self.refused_reads: dict[str, int] = {}

    @property
    def worker(self) -> Any:
        return self.connector.connector_worker

    # -- the resize -------------------------------------------------------------------
    def check(self, num_blocks: int, chunks: list[tuple[int, int]]) -> None:
        """Raise :class:`NixlResizeError` unless :meth:`resize` can follow ``num_blocks``."""
        w = self.worker
        for flag, what in (("_has_mamba", "Mamba state layers"),
                           ("use_host_buffer", "a host staging buffer"),
                           ("_mixed_mem_types", "mixed DRAM / VRAM regions"),
                           ("src_xfer_handles_by_tp_ratio", "heterogeneous tensor parallelism")):
            if getattr(w, flag, False):
                raise NixlResizeError(f"KvconnectNixlConnector does not follow a KV cache "
                                      f"resize with {what}; nothing was changed")
        ratio = int(w._physical_blocks_per_logical_kv_block)
        old = set(w.region_num_blocks)
        if len(old) != 1:
            raise NixlResizeError(f"NIXL regions of different block counts {sorted(old)}; a "
                                  f"resize is followed for uniform attention regions only")
        bases = w.kv_caches_base_addr[w.engine_id][w.tp_rank]
        regions = [(b, ln, st, num_blocks * ratio) for b, ln, st in
                   zip(bases, w.block_len_per_layer, w.block_stride_per_layer, strict=True)]
        bad = straddling_block(regions, chunks)
        if bad is not None:
            r, k, b = bad
            raise NixlResizeError(
                f"KV block {k} of NIXL region {r} would straddle the physical allocations "
                f"meeting at {b:#x} (a NIXL descriptor must lie in one registered region): "
                f"this resize cannot be followed; nothing was changed. Resize in steps whose "
                f"allocation boundaries fall on whole blocks")

    def resize(self, num_blocks: int, chunks: list[tuple[int, int]]) -> dict[str, Any]:
        """Follow the cache to ``num_blocks`` blocks whose physical allocations (after the
        resize) are ``chunks``; returns what was done (seconds, regions). All-or-nothing:
        on failure upstream's state and registrations are as before."""
        self.check(num_blocks, chunks)
        w = self.worker
        t0 = time.perf_counter()
        wanted = set(chunks)
        added = sorted(wanted - set(self.registered))
        removed = sorted(set(self.registered) - wanted)
        mem_type = w.region_mem_types[0] if w.region_mem_types else w.nixl_memory_type
        device = int(getattr(w, "device_id", 0) or 0)
        ratio = int(w._physical_blocks_per_logical_kv_block)
        geometry = ("num_blocks", "_logical_num_blocks", "region_num_blocks", "num_descs")
        before = {k: getattr(w, k) for k in geometry if hasattr(w, k)}
        before_dst = (w.dst_num_blocks.get(w.engine_id), w.dst_region_num_blocks.get(w.engine_id))
        with UndoStack() as undo:
            for va, size in added:
                descs = w.nixl_wrapper.get_reg_descs([(va, size, device, "")], mem_type)
                w.nixl_wrapper.register_memory(descs, backends=w.nixl_backends)
                undo.push(self._forget, (va, size), descs)
                self.registered[(va, size)] = descs
                w._registered_descs.append(descs)
            undo.push(self._restore_geometry, before, before_dst)
            w.num_blocks = num_blocks * ratio
            w._logical_num_blocks = num_blocks
            w.region_num_blocks = [num_blocks * ratio] * len(w.region_num_blocks)
            w.num_descs = sum(w.region_num_blocks)
            w.dst_num_blocks[w.engine_id] = w.num_blocks
            w.dst_region_num_blocks[w.engine_id] = list(w.region_num_blocks)
            new_handles: dict[int, tuple[int, Any]] = {}
            for block_size in sorted(w.src_xfer_handles_by_block_size):
                handle, data = w.register_local_xfer_handler(block_size)
                undo.push(w.nixl_wrapper.release_dlist_handle, handle)
                new_handles[block_size] = (handle, data)
        registration_s = time.perf_counter() - t0
        # committed from here on: swap the descriptor lists, drop what goes
        for block_size, (handle, data) in new_handles.items():
            self.retired.append(w.src_xfer_handles_by_block_size[block_size])
            w.src_xfer_handles_by_block_size[block_size] = handle
            if block_size == w.block_size:
                w.src_blocks_data = data
            else:
                w.src_blocks_data_by_block_size[block_size] = data
        self.release_retired()  # before deregistering what the old lists describe
        for key in removed:
            self._forget(key, self.registered[key])
        self._refresh_payload()
        self._cfg_blocks(num_blocks)
        record = {"num_blocks": num_blocks, "registered_regions": len(added),
                  "deregistered_regions": len(removed), "regions": len(self.registered),
                  "registration_seconds": registration_s,
                  "seconds": time.perf_counter() - t0}
        self.history.append(record)
        return record

    def _forget(self, key: tuple[int, int], descs: Any) -> None:
        w = self.worker
        w.nixl_wrapper.deregister_memory(descs)
        self.registered.pop(key, None)
        w._registered_descs[:] = [d for d in w._registered_descs if d is not descs]

    def _restore_geometry(self, before: dict[str, Any], dst: tuple[Any, Any]) -> None:
        w = self.worker
        for k, v in before.items():
            setattr(w, k, v)
        w.dst_num_blocks[w.engine_id], w.dst_region_num_blocks[w.engine_id] = dst

    def _cfg_blocks(self, num_blocks: int) -> None:
        for cfg in (getattr(self.worker, "kv_cache_config", None),
                    getattr(self.connector, "_kv_cache_config", None)):
            if cfg is not None and hasattr(cfg, "num_blocks"):
                cfg.num_blocks = num_blocks

    def _refresh_payload(self) -> None:
        """The handshake payload with the new registrations and block count."""
        import msgspec
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
            NixlAgentMetadata,
        )

        w = self.worker
        payload = w.xfer_handshake_metadata
        if payload is None:
            return
        meta = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        meta.agent_metadata = w.nixl_wrapper.get_agent_metadata()
        meta.num_blocks = w.num_blocks
        if getattr(meta, "region_num_blocks", None) is not None:
            meta.region_num_blocks = list(w.region_num_blocks)
        payload.agent_metadata_bytes = msgspec.msgpack.encode(meta)

    def release_retired(self, force: bool = False) -> None:
        """Release retired descriptor lists once no receive started before them is left
        (upstream releases a transfer's handle when it reports it done), or now (``force``:
        at shutdown, after upstream released its transfers)."""
        w = self.worker
        if not self.retired or (getattr(w, "_recving_transfers", None) and not force):
            return
        while self.retired:
            handle = self.retired.pop()
            try:
                w.nixl_wrapper.release_dlist_handle(handle)
            except Exception as exc:  # shutdown goes on
                logger.warning("kvconnect: releasing a retired NIXL descriptor list: %s", exc)

    def facts(self) -> dict[str, Any]:
        return {"regions": len(self.registered),
                "region_bytes": sorted(size for _, size in self.registered),
                "resizes": list(self.history), "retired_dlists": len(self.retired),
                "peer_versions": dict(self.peer_versions), "refreshed": dict(self.refreshed),
                "refused_reads": dict(self.refused_reads), "deferred": len(self.deferred)}

    # -- the decode side ----------------------------------------------------------------
    def attach(self) -> None:
        """Guard upstream's ``_read_blocks_for_req`` (decode side): a read naming blocks past
        what the prefill advertised fails the request instead of reading other memory."""
        w = self.worker
        original = getattr(w, "_read_blocks_for_req", None)
        if original is None:
            return

        def read_blocks_for_req(req_id: str, meta: Any) -> Any:
            if self._beyond_known_size(meta):
                return self._fail(req_id, meta)
            return original(req_id, meta)

        w._read_blocks_for_req = read_blocks_for_req

    def _beyond_known_size(self, meta: Any) -> bool:
        """Whether ``meta`` reads blocks past its (handshaken) prefill's advertised size."""
        w = self.worker
        remote = getattr(meta, "remote", None)
        if remote is None or remote.engine_id not in w._remote_agents:
            return False
        size = w.dst_num_blocks.get(remote.engine_id)
        if size is None:
            return False
        top = max((max(g) for g in remote.block_ids if len(g)), default=-1)
        return (top + 1) * int(w._physical_blocks_per_logical_kv_block) > size

    def _fail(self, req_id: str, meta: Any) -> None:
        w = self.worker
        engine = meta.remote.engine_id
        self.refused_reads[engine] = self.refused_reads.get(engine, 0) + 1
        logger.error("kvconnect: prefill engine %s named KV blocks past the %s blocks it "
                     "registered (request %s): the read is refused (did its connector follow "
                     "a resize?)", engine, w.dst_num_blocks.get(engine), req_id)
        w._recving_metadata[req_id] = meta
        w._failed_recv_reqs.put(req_id)

    def refresh_peers(self, metadata: Any) -> None:
        """Before upstream's ``start_load_kv(metadata)``: drop the metadata of every engine
        whose KV version moved (or that now names blocks past its known size), so upstream
        handshakes again; requests from an engine whose reads are still in flight wait in
        :attr:`deferred` and join a later step's metadata."""
        w = self.worker
        reqs = getattr(metadata, "reqs_to_recv", None)
        if reqs is None:
            return
        for req_id, meta in list(self.deferred.items()):
            reqs.setdefault(req_id, meta)
        self.deferred.clear()
        busy: set[str] | None = None
        for req_id, meta in list(reqs.items()):
            remote = getattr(meta, "remote", None)
            if remote is None:
                continue
            engine = remote.engine_id
            version = getattr(meta, "kvconnect_peer_version", None)
            known = self.peer_versions.get(engine)
            if version is not None and known is None:
                self.peer_versions[engine] = known = version
            moved = version is not None and version > known  # type: ignore[operator]
            if not (moved or self._beyond_known_size(meta)) \
                    or self.refreshed_at.get(engine, -1) == version and not moved:
                continue
            if engine in w._remote_agents:
                if busy is None:
                    busy = w._engines_with_inflight_transfers()
                if engine in busy:
                    self.deferred[req_id] = reqs.pop(req_id)
                    continue
                w._cleanup_remote_engine(engine, log_eviction=False)
                self.refreshed[engine] = self.refreshed.get(engine, 0) + 1
                self.refreshed_at[engine] = version
                logger.info("kvconnect: prefill engine %s changed its KV cache (version %s, "
                            "known %s): loading its metadata again", engine, version, known)
            if version is not None:
                self.peer_versions[engine] = max(version, known or 0)
