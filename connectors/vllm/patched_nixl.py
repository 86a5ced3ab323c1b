"""vLLM's ``NixlConnector`` (0.32 / 0.33), patched so its worker registers committed memory
only and, between two engines of one host whose caches are both the plugin's, moves blocks
through kvconnect's ``ipc`` transport instead of a NIXL READ (needs vLLM and NIXL). Load
it with::

    --kv-transfer-config '{"kv_connector": "KvconnectNixlConnector",
                           "kv_connector_module_path": "kvconnect.connectors.vllm", "kv_role": ...}'

The fast path (:mod:`kvconnect.connectors.vllm.nixl_fast_path`) is negotiated per prefill worker
right after upstream's NIXL handshake and falls back to NIXL, logged once per peer with the
reason, whenever either side cannot take it. ``kv_connector_extra_config``:
``"kvconnect_ipc": false`` turns it off; ``"kvconnect_ipc_dir"`` is the directory of its sockets
(both engines must name the same one). docs/vllm-plugin.md says more.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from kvconnect.vllm.head_planes import nixl_head_planes

from .nixl_fast_path import FastPathSettings, NixlIpcFastPath
from .nixl_resize import (
    KV_VERSION_PARAM,
    NixlResizeError,
    NixlResizeState,
    flatten_registered,
    per_handle_registration,
)
from .patched_offload import CommittedOnly

__all__ = ["KvconnectNixlConnector"]


class KvconnectNixlConnector(CommittedOnly, NixlConnector):
    """vLLM's ``NixlConnector`` (pull) registering committed memory only (LHBNC: each head
    plane's region where the view puts it, and only its committed run registered), with the
    same-host ipc fast path. :meth:`kvconnect_fast_path_facts` says which path each peer
    takes and why."""

    #: the worker's fast path (None in the scheduler role, before registration)
    kvconnect_fast_path: NixlIpcFastPath | None = None
    #: the worker's registrations and peers across resizes (None: not the plugin's cache)
    kvconnect_resize: NixlResizeState | None = None
    #: scheduler role: this engine's KV version (grows on every resize; peers compare it)
    kvconnect_kv_version: int = 0

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvconnect.vllm.engine_cache import record_for_views

        bounded = self._bounded(kv_caches)
        record = record_for_views(kv_caches)
        worker = self.connector_worker
        if record is None:  # vLLM's own allocation: upstream's registration as is
            with nixl_head_planes(worker, bounded):
                super().register_kv_caches(bounded.kv_caches)
        else:  # one NIXL region per physical allocation, so a resize can follow
            state = NixlResizeState(self)
            with per_handle_registration(worker.nixl_wrapper, record.physical_chunks(),
                                         state.registered), \
                    nixl_head_planes(worker, bounded):
                super().register_kv_caches(bounded.kv_caches)
            flatten_registered(worker)
            state.attach()
            self.kvconnect_resize = state
        if self.kvconnect_fast_path is None:
            self.kvconnect_fast_path = self._fast_path(kv_caches)

    # -- elastic resize (docs/vllm-plugin.md, "Elastic capacity") -------------------------
    def kvconnect_resize_kv_caches(self, num_blocks: int, chunks: list[tuple[int, int]]
                                   ) -> dict[str, Any]:
        """Worker role: follow the plugin's cache to ``num_blocks`` blocks whose physical
        allocations are then ``chunks`` (``(address, nbytes)``): register the new ones,
        rebuild the descriptors, deregister those about to be released, refresh the
        handshake payload; the fast path's export pauses meanwhile and its generation
        grows (decoders re-map). All-or-nothing (:class:`NixlResizeError`)."""
        state = self.kvconnect_resize
        if state is None:
            raise NixlResizeError("this connector registered vLLM's own KV allocation (not "
                                  "the plugin's cache): it cannot follow a resize")
        fast = self.kvconnect_fast_path
        state.check(num_blocks, chunks)
        if fast is not None:
            fast.pause_export()
        try:
            return state.resize(num_blocks, chunks)
        finally:
            if fast is not None:
                fast.resume_export()

    def kvconnect_set_kv_version(self, version: int) -> None:
        """Scheduler role: the engine's KV version, added to every ``kv_transfer_params``."""
        self.kvconnect_kv_version = int(version)

    def kvconnect_update_handshake_metadata(self, metadata: dict[tuple[int, int], Any]) -> int:
        """Scheduler role: serve ``metadata`` (the workers' refreshed handshake payloads,
        keyed ``(pp_rank, tp_rank)``) on vLLM's side channel from now on; returns how many
        entries changed. Raises when upstream's listener is not where vLLM 0.32 / 0.33
        keep it."""
        import msgspec

        sched = self.connector_scheduler
        listener = getattr(sched, "_nixl_handshake_listener_t", None)
        args = getattr(listener, "_args", None)
        served = args[0] if args else None
        if not isinstance(served, dict):
            raise RuntimeError("vLLM's NIXL handshake listener keeps its payloads elsewhere "
                               "in this version: peers cannot learn the new KV size")
        encoder = msgspec.msgpack.Encoder()
        for key, payload in metadata.items():
            served[tuple(key)] = encoder.encode(payload)
        return len(metadata)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
        delay, params = super().request_finished(request, block_ids)
        if params is not None:
            params[KV_VERSION_PARAM] = self.kvconnect_kv_version
        return delay, params

    if hasattr(NixlConnector, "request_finished_all_groups"):
        def request_finished_all_groups(self, request: Any, block_ids: Any
                                        ) -> tuple[bool, Any]:
            delay, params = super().request_finished_all_groups(request, block_ids)
            if params is not None:
                params[KV_VERSION_PARAM] = self.kvconnect_kv_version
            return delay, params

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> Any:
        params = request.kv_transfer_params or {}
        version = params.get(KV_VERSION_PARAM)
        if isinstance(version, int) and not isinstance(version, bool):
            self._kvc_peer_versions()[request.request_id] = version
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        versions = self._kvc_peer_versions()
        for req_id, req in getattr(meta, "reqs_to_recv", {}).items():
            version = versions.pop(req_id, None)
            if version is not None:
                req.kvconnect_peer_version = version
        return meta

    def _kvc_peer_versions(self) -> dict[str, int]:
        versions: dict[str, int] | None = self.__dict__.get("_kvconnect_peer_versions")
        if versions is None:
            versions = self.__dict__["_kvconnect_peer_versions"] = {}
        return versions

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.kvconnect_resize is not None:
            self.kvconnect_resize.refresh_peers(self._connector_metadata)
        super().start_load_kv(forward_context, **kwargs)

    def kvconnect_nixl_facts(self) -> dict[str, Any]:
        """Worker role: registrations (one NIXL region per physical allocation), resizes
        followed, peers refreshed; ``{}`` before registration or for vLLM's own cache."""
        return self.kvconnect_resize.facts() if self.kvconnect_resize is not None else {}

    def _fast_path(self, kv_caches: dict[str, torch.Tensor]) -> NixlIpcFastPath:
        ktc = self._vllm_config.kv_transfer_config
        settings = FastPathSettings.from_extra_config(ktc.kv_connector_extra_config)
        record = None
        if settings.enabled:
            from kvconnect.vllm.engine_cache import record_for_views

            record = record_for_views(kv_caches)
        fast = NixlIpcFastPath(settings, str(ktc.engine_id),
                               record.cache if record is not None else None,
                               can_send=ktc.kv_role in ("kv_producer", "kv_both"),
                               can_receive=ktc.kv_role in ("kv_consumer", "kv_both"))
        try:
            fast.attach(self.connector_worker)
        except BaseException:
            fast.close()
            raise
        return fast

    def kvconnect_fast_path_facts(self) -> dict[str, Any]:
        """The fast path's facts (:meth:`NixlIpcFastPath.facts`); ``{"enabled": False}``
        where there is none (scheduler role, before registration)."""
        fast = self.kvconnect_fast_path
        return fast.facts() if fast is not None else {"enabled": False, "peers": []}

    def shutdown(self) -> None:
        fast, self.kvconnect_fast_path = self.kvconnect_fast_path, None
        try:
            if fast is not None:
                fast.close()
        finally:
            try:
                super().shutdown()  # releases the transfers' handles first
            finally:
                if self.kvconnect_resize is not None:
                    self.kvconnect_resize.release_retired(force=True)

    if hasattr(NixlConnector, "unregister_kv_caches"):  # vLLM 0.33: sleep / wake
        def unregister_kv_caches(self) -> None:
            if self.kvconnect_fast_path is not None:
                self.kvconnect_fast_path.pause_export()  # held until restore
            super().unregister_kv_caches()

        def restore_kv_caches(self) -> None:
            super().restore_kv_caches()
            if self.kvconnect_fast_path is not None:
                self.kvconnect_fast_path.resume_export()
