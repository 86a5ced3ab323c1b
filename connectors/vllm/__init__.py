"""vLLM 0.33's connectors patched for kvconnect's extensible KV cache: their workers see only
committed memory (the committed-extent helpers of :mod:`kvconnect.vllm`).

- :class:`KvconnectNixlConnector`: upstream's NixlConnector, registering committed memory
  (one region per physical allocation), following resizes, with the same-host ipc fast path
  (:mod:`.nixl_fast_path`);
- :class:`KvconnectSimpleCPUOffloadConnector`, :class:`KvconnectOffloadingConnector`:
  upstream's offload connectors over the committed blocks.

Load one with ``--kv-transfer-config '{"kv_connector": "KvconnectNixlConnector",
"kv_connector_module_path": "kvconnect.connectors.vllm", ...}'``. Importing this package does
not import vLLM; the classes load on first use and need vLLM 0.33.
"""

from __future__ import annotations

from kvconnect.lazy_exports import lazy_exports
from kvconnect.vllm import VLLM_NEEDED

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "KvconnectNixlConnector": "kvconnect.connectors.vllm.patched_nixl",
    "KvconnectSimpleCPUOffloadConnector": "kvconnect.connectors.vllm.patched_offload",
    "KvconnectOffloadingConnector": "kvconnect.connectors.vllm.patched_offload",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, needs=VLLM_NEEDED)
