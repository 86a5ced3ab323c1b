"""The same-host fast path of
:class:`~kvconnect.connectors.vllm.patched_nixl.KvconnectNixlConnector`: KV blocks through
kvconnect's ``ipc`` transport (POSIX-fd mappings, one fused copy) instead of a NIXL READ, where
both engines' caches are the plugin's.

Everything else stays upstream's. The NIXL handshake runs as always; right after it registered a
prefill worker's agent (``add_remote_agent``), the decode asks that worker for its ipc offer
(:mod:`kvconnect.connectors.vllm.ipc_offer`) and records a :class:`FastPathDecision` per
``(engine, remote rank)``. A READ upstream would post (``_read_blocks``) for an ``"ipc"`` peer
becomes one :meth:`IpcTransport.start <kvconnect.connectors.ipc.transport.IpcTransport.start>`
whose :class:`IpcXferHandles` handle goes where upstream keeps its NIXL handles
(``_recving_transfers``), with the producer's notification queued where upstream queues
deferred ones (``_pending_recv_notifs``). Upstream's own polling then reports it: the copy
done -> the notification goes to the prefill worker through NIXL (which frees its blocks)
and the request is in ``finished_recving``; a failed copy -> ``"ERR"`` -> upstream's failure
path (``get_block_ids_with_load_errors``, ``kv_load_failure_policy``). The agent's
``check_xfer_state`` / ``get_xfer_telemetry`` / ``release_xfer_handle`` answer for these
handles (negative ints; NIXL's are addresses) and pass every other handle through.

A read goes through NIXL when the peer's decision says so, when a read is not the plain
case (several KV cache groups, region-mapped reads, kernel blocks that do not form whole
logical blocks), or when starting the copy fails (the peer then stays on NIXL:
``copy_failed``). The first ipc read maps the peer (main thread) and checks what upstream's
topology says (same TP, block size, no DCP / PP / Mamba / host buffer / post-processing);
:class:`~kvconnect.connectors.errors.IncompatiblePeerError` or a mismatch -> ``layout``.
Units: bytes, seconds; block ids are vLLM's (kernel ids in, logical ids to the transport).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvconnect.bounded_json import Doc
from kvconnect.checks import checked_seconds
from kvconnect.framing import IpcError
from kvconnect.vllm.plugin_settings import PluginConfigError

from ..errors import IncompatiblePeerError, KVConnectorError
from ..ipc.transport import IpcExportServer, IpcTransport
from .ipc_handles import IpcXferHandles
from .ipc_offer import (
    FastPathDecision,
    IpcOfferServer,
    default_offer_dir,
    ensure_offer_dir,
    export_socket_name,
    request_offer,
)

logger = logging.getLogger(__name__)
#: vLLM's logging configuration shows INFO lines of loggers under "vllm"
engine_log = logging.getLogger("vllm.kvconnect.fast_path")
#: seconds before the first new offer request after a prefill did not answer in time, and
#: the most between two (doubling in between)
RETRY_FIRST_S, RETRY_MAX_S = 2.0, 120.0
#: seconds :meth:`NixlIpcFastPath.close` waits for an offer request still in flight
_RETRY_JOIN_S = 2.0

__all__ = ["RETRY_FIRST_S", "RETRY_MAX_S", "FastPathSettings", "NixlIpcFastPath",
           "layout_mismatch", "retry_delay"]


@dataclass(frozen=True)
class FastPathSettings:
    """From ``kv_connector_extra_config`` (a JSON object): ``kvconnect_ipc`` (true or false,
    default true), ``kvconnect_ipc_dir`` (an absolute path, default
    :func:`~kvconnect.connectors.vllm.ipc_offer.default_offer_dir`), ``kvconnect_ipc_timeout``
    (seconds above 0, at most :data:`~kvconnect.checks.MAX_SECONDS`, default 10). A key that is
    present must hold such a value: anything else raises
    :class:`~kvconnect.vllm.plugin_settings.PluginConfigError` naming the key and the accepted
    form."""

    enabled: bool
    directory: str
    timeout: float

    @classmethod
    def from_extra_config(cls, extra: object) -> FastPathSettings:
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise PluginConfigError(f"kv_connector_extra_config must be a JSON object, got "
                                    f"{type(extra).__name__} {extra!r:.60}")
        where = "kv_connector_extra_config"
        enabled = Doc(extra, where, PluginConfigError).boolean("kvconnect_ipc", default=True)
        try:
            timeout = checked_seconds(f"{where} kvconnect_ipc_timeout",
                                      extra.get("kvconnect_ipc_timeout", 10.0))
        except ValueError as exc:
            raise PluginConfigError(str(exc)) from None
        directory = extra.get("kvconnect_ipc_dir", None)
        if "kvconnect_ipc_dir" not in extra:
            directory = default_offer_dir()
        elif not _is_absolute_path(directory):
            raise PluginConfigError(f"{where} kvconnect_ipc_dir must be an absolute path (a "
                                    f"string; both engines name the same directory), got "
                                    f"{type(directory).__name__} {directory!r:.60}")
        return cls(enabled, str(directory), timeout)


def _is_absolute_path(value: object) -> bool:
    if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
        return False
    try:
        os.fsencode(value)
    except UnicodeError:  # e.g. a lone surrogate from a JSON escape
        return False
    return True


def layout_mismatch(worker: Any, engine_id: str) -> str | None:
    """Why upstream's view of this peer rules ipc out (a sentence), or None: ipc copies
    block ``i`` of every layer as it is, so both sides must agree on TP, block size and
    kernel blocks per block, and nothing may need upstream's post-processing."""
    try:
        topo = worker.transfer_topo
        info = topo.get_engine_info(engine_id)
        ours_ratio = worker._physical_blocks_per_logical_kv_block
        checks = [
            (info.remote_tp_size == topo.tp_size,
             f"tensor parallel size {info.remote_tp_size} there, {topo.tp_size} here"),
            (info.remote_block_size == topo.block_size,
             f"block size {info.remote_block_size} there, {topo.block_size} here"),
            (info.remote_physical_blocks_per_logical == ours_ratio,
             f"{info.remote_physical_blocks_per_logical} kernel blocks per block there, "
             f"{ours_ratio} here"),
            (getattr(info, "remote_dcp_size", 1) == 1 and getattr(worker, "dcp_size", 1) == 1,
             "decode context parallelism"),
            (getattr(worker, "pp_size", 1) == 1, "pipeline parallelism"),
            (not getattr(worker, "_has_mamba", False), "Mamba state groups"),
            (not getattr(worker, "use_host_buffer", False), "a host staging buffer"),
            (not getattr(worker, "_mixed_mem_types", False), "mixed DRAM / VRAM regions"),
            (not getattr(worker, "enable_permute_local_kv", False)
             and not getattr(worker, "enable_heterogeneous_attn_post_process", False),
             "post-processing after receive"),
        ]
    except (AttributeError, KeyError) as exc:
        return f"upstream's topology for {engine_id!r} is not readable: {exc!r}"
    return next((why for ok, why in checks if not ok), None)


def retry_delay(attempts: int) -> float:
    """Seconds to wait before offer request number ``attempts + 1`` to a prefill that did
    not answer the last ``attempts`` in time: :data:`RETRY_FIRST_S`, doubling, at most
    :data:`RETRY_MAX_S`."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2.0 ** min(max(attempts - 1, 0), 32))


def logical_ids(kernel_ids: list[int], ratio: int) -> list[int] | None:
    """Logical block ids whose kernel blocks are exactly ``kernel_ids`` (``ratio`` kernel
    blocks per block, in order), or None when they do not form whole blocks."""
    if ratio == 1:
        return list(kernel_ids)
    if len(kernel_ids) % ratio:
        return None
    out = []
    for i in range(0, len(kernel_ids), ratio):
        first = kernel_ids[i]
        if first % ratio or kernel_ids[i:i + ratio] != list(range(first, first + ratio)):
            return None
        out.append(first // ratio)
    return out


class NixlIpcFastPath:
    """The fast path of one connector worker (see the module docstring). ``cache``: the
    plugin's ExtensibleKVCache under this worker's views, or None (vLLM's own allocation).
    :meth:`attach` hooks it into upstream's worker; :meth:`close` releases everything."""

    def __init__(self, settings: FastPathSettings, engine_id: str, cache: Any,
                 can_send: bool, can_receive: bool) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.cache = cache
        self.can_send = can_send
        self.can_receive = can_receive
        self.handles = IpcXferHandles()
        self.peers: dict[tuple[str, int], tuple[str, FastPathDecision]] = {}
        self.offer_server: IpcOfferServer | None = None
        self.export_server: IpcExportServer | None = None
        self.transport: IpcTransport | None = None
        self._opened: set[tuple[str, int]] = set()
        #: counts of peers forgotten (upstream evicted them, e.g. to load a resized
        #: cache's metadata): added to the counts of the same peer's next decision
        self._kept_counts: dict[tuple[str, int], dict[str, int]] = {}
        self._logged: set[tuple[str, int, str]] = set()
        #: guards :attr:`peers` (the handshake thread, the main thread and retries write it)
        self._peers_lock = threading.Lock()
        #: offer requests asked again in the background, one per peer at most
        self._retries: dict[tuple[str, int], threading.Thread] = {}
        self._closed = False
        #: why this (producer) worker serves no offers, when setting them up failed
        self.serve_error: str | None = None
        self.local_refusal = self._local_refusal()

    def _local_refusal(self) -> FastPathDecision | None:
        if not self.settings.enabled:
            return FastPathDecision.nixl("disabled")
        if self.cache is None:
            return FastPathDecision.nixl("local_cache", "KVCONNECT_EXTENSIBLE_KV is not 1 "
                                                        "in this engine")
        return None

    # -- set-up ----------------------------------------------------------------------------
    def attach(self, worker: Any) -> None:
        """Start serving (producer roles) and hook upstream's worker (consumer roles)."""
        if not self.settings.enabled:
            return
        if self.can_send:
            try:
                name = worker.nixl_wrapper.name
                self._serve(name.decode() if isinstance(name, bytes) else str(name))
            except (IpcError, OSError) as exc:
                self.serve_error = str(exc)
                logger.warning("kvconnect NIXL fast path: engine %r does not serve ipc "
                               "offers: %s (decoders read it through NIXL)", self.engine_id,
                               exc)
        if self.can_receive:
            if self.local_refusal is None:
                self.transport = IpcTransport(self.cache, timeout=self.settings.timeout)
            self.handles.patch_agent(worker.nixl_wrapper)
            for name, wrap in (("add_remote_agent", self._negotiating),
                               ("_read_blocks", self._reading),
                               ("_cleanup_remote_engine", self._forgetting)):
                setattr(worker, name, wrap(worker, getattr(worker, name)))

    def _serve(self, agent: str) -> None:
        directory = ensure_offer_dir(self.settings.directory)
        refusal = None
        if self.cache is None:
            refusal = ("plain_cache", f"engine {self.engine_id!r} runs vLLM's own KV "
                                      f"allocation (KVCONNECT_EXTENSIBLE_KV is not 1 there)")
        elif not all(t.granted.shareable for t in self.cache.tensors):
            refusal = ("not_exportable", f"engine {self.engine_id!r}'s KV chunks were not "
                                         f"granted POSIX-fd handles")
        if refusal is None:
            self.export_server = IpcExportServer(
                self.cache, directory, export_socket_name(agent),
                lambda: self.offer_server.allowed() if self.offer_server else set(),
                self.settings.timeout)
        try:
            self.offer_server = IpcOfferServer(directory, agent, self.engine_id,
                                               self.export_server, refusal,
                                               self.settings.timeout)
        except BaseException:
            if self.export_server is not None:
                self.export_server.close()
                self.export_server = None
            raise

    # -- decode side: decisions --------------------------------------------------------------
    def negotiate(self, engine_id: str, rank: int, agent: str) -> FastPathDecision:
        """The decision for ``(engine_id, rank)`` served by NIXL agent ``agent`` (asked once
        per agent; runs in upstream's handshake thread). A prefill that did not answer in
        time is asked again later (:meth:`_retry_if_due`, at a read, with backoff)."""
        key = (engine_id, int(rank))
        known = self.peers.get(key)
        if known is not None and known[0] == agent:
            return known[1]
        decision = self.local_refusal or request_offer(
            self.settings.directory, agent, engine_id, self.settings.timeout)
        if decision.transient:
            decision.retry_at = time.monotonic() + retry_delay(decision.offer_attempts)
        with self._peers_lock:
            kept = self._kept_counts.pop(key, None)
            if kept is not None:  # the same engine again (its KV cache changed): counts go on
                decision.counts = {k: kept.get(k, 0) + decision.counts.get(k, 0)
                                   for k in {*kept, *decision.counts}}
            self.peers[key] = (agent, decision)
        self._log(key, decision)
        return decision

    def _retry_if_due(self, key: tuple[str, int], agent: str,
                      decision: FastPathDecision) -> None:
        """Ask a prefill that did not answer in time again, in the background (a read must
        not wait on it), once its backoff has passed; reads use NIXL meanwhile."""
        if self._closed or decision.retry_at is None or time.monotonic() < decision.retry_at:
            return
        running = self._retries.get(key)
        if running is not None and running.is_alive():
            return
        decision.retry_at = None  # this attempt is under way
        thread = threading.Thread(target=self._retry, args=(key, agent, decision),
                                  name="kvc-ipc-offer-retry", daemon=True)
        self._retries[key] = thread
        thread.start()

    def _retry(self, key: tuple[str, int], agent: str, old: FastPathDecision) -> None:
        new = request_offer(self.settings.directory, agent, key[0], self.settings.timeout)
        new.offer_attempts = old.offer_attempts + 1
        new.counts = old.counts
        if new.transient:
            new.retry_at = time.monotonic() + retry_delay(new.offer_attempts)
        with self._peers_lock:
            entry = self.peers.get(key)
            if self._closed or entry is None or entry[1] is not old:
                return  # forgotten, replaced or closed meanwhile
            self.peers[key] = (agent, new)
        self._log(key, new)

    def _log(self, key: tuple[str, int], decision: FastPathDecision) -> None:
        tag = (*key, f"{decision.route}:{decision.code}")
        if tag in self._logged:
            return
        self._logged.add(tag)
        where = f"prefill engine {key[0]!r} rank {key[1]}"
        if decision.route == "ipc":
            engine_log.info("kvconnect NIXL fast path: %s: ipc (same host, kvconnect caches)",
                            where)
        else:
            engine_log.warning("kvconnect NIXL fast path: %s: NIXL (%s: %s)", where,
                               decision.code, decision.reason)

    def _fall_back(self, key: tuple[str, int], code: str, detail: str) -> None:
        with self._peers_lock:
            agent, old = self.peers[key]
            new = FastPathDecision.nixl(code, detail)
            new.counts, new.offer_attempts = old.counts, old.offer_attempts
            self.peers[key] = (agent, new)
        if self.transport is not None:
            self.transport.invalidate(_peer_name(key))
        self._log(key, new)

    # -- decode side: reads ----------------------------------------------------------------
    def _negotiating(self, worker: Any, original: Callable[..., str]) -> Callable[..., str]:
        def add_remote_agent(meta: Any, remote_tp_rank: int = 0, *args: Any, **kw: Any) -> str:
            agent = original(meta, remote_tp_rank, *args, **kw)
            name = agent.decode() if isinstance(agent, bytes) else str(agent)  # NIXL: bytes
            try:
                self.negotiate(meta.engine_id, remote_tp_rank, name)
            except Exception as exc:  # never fail upstream's handshake: NIXL still works
                key = (meta.engine_id, int(remote_tp_rank))
                decision = FastPathDecision.nixl("refused", repr(exc)[:300])
                with self._peers_lock:
                    self.peers[key] = (name, decision)
                self._log(key, decision)
            return agent
        return add_remote_agent

    def _reading(self, worker: Any, original: Callable[..., bool]) -> Callable[..., bool]:
        def read_blocks(*args: Any, **kw: Any) -> bool:
            try:
                if not args and self._read_by_ipc(worker, kw):
                    return True
            except Exception as exc:  # upstream's step must go on: this read uses NIXL
                key = (kw.get("dst_engine_id"), getattr(kw.get("read_spec"), "remote_rank", -1))
                if key in self.peers:
                    self._fall_back(key, "ipc_error", repr(exc)[:300])  # type: ignore[arg-type]
                logger.exception("kvconnect fast path: an ipc read failed before it started")
            return original(*args, **kw)
        return read_blocks

    def _forgetting(self, worker: Any, original: Callable[..., None]) -> Callable[..., None]:
        def cleanup_remote_engine(engine_id: str, *args: Any, **kw: Any) -> None:
            original(engine_id, *args, **kw)
            self.forget(engine_id)
        return cleanup_remote_engine

    def forget(self, engine_id: str) -> None:
        """Drop the decisions and mappings of ``engine_id`` (upstream evicted its agents;
        after a resize of its cache it handshakes again and is mapped anew). Its counts are
        kept for its next decision."""
        with self._peers_lock:
            keys = [k for k in self.peers if k[0] == engine_id]
            for key in keys:
                self._kept_counts[key] = self.peers.pop(key)[1].counts
        for key in keys:
            self._opened.discard(key)
            if self.transport is not None:
                self.transport.invalidate(_peer_name(key))

    def _read_by_ipc(self, worker: Any, kw: dict[str, Any]) -> bool:
        """Start upstream's READ ``kw`` as an ipc copy; False leaves it to NIXL."""
        spec, engine_id = kw.get("read_spec"), kw.get("dst_engine_id")
        if spec is None or not isinstance(engine_id, str):
            return False
        key: tuple[str, int] = (engine_id, int(getattr(spec, "remote_rank", -1)))
        entry = self.peers.get(key)
        if entry is None:
            return False
        decision = entry[1]
        if decision.transient:
            self._retry_if_due(key, entry[0], decision)
        if decision.route != "ipc" or not any(spec.local_block_ids):
            decision.counts["nixl_reads"] += decision.route != "ipc"
            return False  # NIXL, or a full prefix hit (upstream only notifies)
        ids = self._ids(worker, spec, engine_id) if self._open(worker, key) else None
        if ids is None:
            self.peers[key][1].counts["nixl_reads"] += 1
            return False
        remote, local = ids
        agent = worker._remote_agents[engine_id][(0, key[1])]
        notif = f"{kw['remote_request_id']}:{kw['expected_consumers']}".encode()
        try:
            assert self.transport is not None  # _open attached it
            pending = self.transport.start(_peer_name(key), [(remote, local)])
        except (KVConnectorError, IpcError, OSError, ValueError, RuntimeError) as exc:
            self._fall_back(key, "copy_failed", repr(exc)[:300])
            decision.counts["nixl_reads"] += 1
            return False
        counts = decision.counts

        def done(result: Any) -> None:
            counts["ipc_reads"] += 1
            counts["ipc_blocks"] += len(local)
            counts["ipc_bytes"] += int(result.bytes)
            # the reads' time as reported to upstream's stats (the device's timeline on
            # CUDA), and the host's time preparing and issuing them (beside it)
            counts["ipc_us"] += round(result.seconds * 1e6)
            counts["ipc_host_us"] += round(result.host_seconds * 1e6)
            counts["ipc_launch_us"] += round(result.launch_seconds * 1e6)

        def failed(exc: BaseException) -> None:
            self._fall_back(key, "copy_failed", repr(exc)[:300])

        handle = self.handles.add(pending, done, failed)
        request_id = kw["request_id"]
        worker._pending_recv_notifs.setdefault(request_id, []).append((agent, notif))
        worker._recving_transfers[request_id].append(handle)
        return True

    def _open(self, worker: Any, key: tuple[str, int]) -> bool:
        """Map the peer after upstream's topology allows it (checked at its first read; the
        mapping is cached, and rebuilt when this cache changed); False (and the peer on
        NIXL from now on) when it cannot be."""
        if key not in self._opened:
            mismatch = layout_mismatch(worker, key[0])
            if mismatch is not None:
                self._fall_back(key, "layout", mismatch)
                return False
        decision = self.peers[key][1]
        try:
            mapped = self.transport.open_peer(  # type: ignore[union-attr]
                _peer_name(key), decision.offer or {})
        except IncompatiblePeerError as exc:
            self._fall_back(key, "layout", str(exc)[:500])
            return False
        except (IpcError, KVConnectorError, OSError, ValueError, RuntimeError) as exc:
            self._fall_back(key, "ipc_error", str(exc)[:500])
            return False
        if mapped > 0:  # (re)mapped: first read, the peer's generation or this cache moved
            decision.counts["maps"] = decision.counts.get("maps", 0) + 1
        self._opened.add(key)
        return True

    def _ids(self, worker: Any, spec: Any, engine_id: str
             ) -> tuple[list[int], list[int]] | None:
        """(remote, local) logical ids of a plain read, trimmed as upstream trims; None for
        reads ipc does not do (several groups, region-mapped, partial blocks)."""
        if getattr(spec, "block_ids_by_region", False) or len(spec.local_block_ids) != 1:
            return None
        ratio = worker._physical_blocks_per_logical_kv_block
        local, remote = worker._apply_prefix_caching(
            decode_block_ids=spec.local_block_ids, prefill_block_ids=spec.remote_block_ids,
            decode_physical_per_logical=ratio, prefill_physical_per_logical=ratio)
        lo, re = logical_ids(list(local[0]), ratio), logical_ids(list(remote[0]), ratio)
        if lo is None or re is None or len(lo) != len(re):
            return None
        return re, lo

    # -- facts and teardown -------------------------------------------------------------------
    def pause_export(self) -> None:
        """Hold export requests (this cache is about to be released)."""
        if self.export_server is not None:
            self.export_server.pause()

    def resume_export(self) -> None:
        """Serve again after a recommit; decoders re-map (the generation grows)."""
        if self.export_server is not None:
            self.export_server.resume()

    def facts(self) -> dict[str, Any]:
        """JSON-able: settings, this side's refusal, the servers' counters, each peer's
        decision and counts (fields in docs/vllm-plugin.md)."""
        local = self.local_refusal
        export = None
        if self.offer_server is not None:
            export = {"offer_socket": self.offer_server.path,
                      "answered": self.offer_server.answered,
                      "refusal": self.offer_server.refusal[0] if self.offer_server.refusal
                      else None,
                      "served": self.export_server.served if self.export_server else 0}
        return {"enabled": self.settings.enabled, "directory": self.settings.directory,
                "local_code": local.code if local else None, "export": export,
                "serve_error": self.serve_error,
                "in_flight": len(self.handles),
                "peers": [{"engine_id": e, "remote_rank": r, "agent": a, **d.to_json(),
                           "plan": self._plan_facts((e, r))}
                          for (e, r), (a, d) in sorted(self.peers.items())]}

    def _plan_facts(self, key: tuple[str, int]) -> dict[str, Any] | None:
        """The copy plan's facts (regions, columns, launch mode, graphs) of a mapped peer."""
        if key not in self._opened or self.transport is None:
            return None
        try:
            return dict(self.transport.plan_for(_peer_name(key)).describe())
        except KVConnectorError:  # unmapped since (the cache changed): mapped at next read
            return None

    def close(self) -> None:
        """Unmap every peer, stop the servers, wait briefly for offer requests asked again
        in the background (each ends within its own timeout; a result after this is
        dropped). Idempotent."""
        self._closed = True
        deadline = time.monotonic() + _RETRY_JOIN_S
        for key, thread in list(self._retries.items()):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                logger.warning("kvconnect fast path: an offer request to %s is still waiting "
                               "(it ends within %g s; its answer is dropped)",
                               _peer_name(key), self.settings.timeout)
        self._retries.clear()
        for closer in (self.transport, self.offer_server, self.export_server):
            if closer is not None:
                try:
                    closer.close()
                except Exception as exc:  # keep closing the others
                    logger.warning("kvconnect fast path: closing %r: %s", closer, exc)
        self.transport = self.offer_server = self.export_server = None
        self.handles.clear()


def _peer_name(key: tuple[str, int]) -> str:
    return f"{key[0]}#{key[1]}"
