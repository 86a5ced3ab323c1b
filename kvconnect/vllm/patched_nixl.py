"""vLLM's ``NixlConnector`` (0.32 / 0.33), patched so its worker registers committed memory
only and, between two engines of one host whose caches are both the plugin's, moves blocks
through kvconnect's ``ipc`` transport instead of a NIXL READ (needs vLLM and NIXL). Load
it with::

    --kv-transfer-config '{"kv_connector": "KvconnectNixlConnector",
                           "kv_connector_module_path": "kvconnect.vllm", "kv_role": ...}'

The fast path (:mod:`kvconnect.vllm.nixl_fast_path`) is negotiated per prefill worker right
after upstream's NIXL handshake and falls back to NIXL, logged once per peer with the
reason, whenever either side cannot take it. ``kv_connector_extra_config``:
``"kvconnect_ipc": false`` turns it off; ``"kvconnect_ipc_dir"`` is the directory of its
sockets (both engines must name the same one). docs/vllm-plugin.md says more.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from .head_planes import nixl_head_planes
from .nixl_fast_path import FastPathSettings, NixlIpcFastPath
from .patched_offload import CommittedOnly

__all__ = ["KvconnectNixlConnector"]


class KvconnectNixlConnector(CommittedOnly, NixlConnector):
    """vLLM's ``NixlConnector`` (pull) registering committed memory only (LHBNC: each head
    plane's region where the view puts it, and only its committed run registered), with the
    same-host ipc fast path. :meth:`kvconnect_fast_path_facts` says which path each peer
    takes and why."""

    #: the worker's fast path (None in the scheduler role, before registration)
    kvconnect_fast_path: NixlIpcFastPath | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        bounded = self._bounded(kv_caches)
        with nixl_head_planes(self.connector_worker, bounded):
            super().register_kv_caches(bounded.kv_caches)
        if self.kvconnect_fast_path is None:
            self.kvconnect_fast_path = self._fast_path(kv_caches)

    def _fast_path(self, kv_caches: dict[str, torch.Tensor]) -> NixlIpcFastPath:
        ktc = self._vllm_config.kv_transfer_config
        settings = FastPathSettings.from_extra_config(ktc.kv_connector_extra_config)
        record = None
        if settings.enabled:
            from .engine_cache import record_for_views

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
            super().shutdown()

    if hasattr(NixlConnector, "unregister_kv_caches"):  # vLLM 0.33: sleep / wake
        def unregister_kv_caches(self) -> None:
            if self.kvconnect_fast_path is not None:
                self.kvconnect_fast_path.pause_export()  # held until restore
            super().unregister_kv_caches()

        def restore_kv_caches(self) -> None:
            super().restore_kv_caches()
            if self.kvconnect_fast_path is not None:
                self.kvconnect_fast_path.resume_export()
