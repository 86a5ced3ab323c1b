"""vLLM 0.33's ``NixlConnector``, patched so its worker registers committed memory only
(needs vLLM and NIXL). Load it with::

    --kv-transfer-config '{"kv_connector": "KvconnectNixlConnector",
                           "kv_connector_module_path": "kvconnect.vllm", "kv_role": ...}'
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from .head_planes import nixl_head_planes
from .patched_offload import CommittedOnly

__all__ = ["KvconnectNixlConnector"]


class KvconnectNixlConnector(CommittedOnly, NixlConnector):
    """vLLM's ``NixlConnector`` (pull) registering committed memory only (LHBNC: each head
    plane's region where the view puts it, and only its committed run registered)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        bounded = self._bounded(kv_caches)
        with nixl_head_planes(self.connector_worker, bounded):
            super().register_kv_caches(bounded.kv_caches)
