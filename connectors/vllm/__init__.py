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

from typing import Any

from kvconnect.vllm import load_export

#: public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "KvconnectNixlConnector": "kvconnect.connectors.vllm.patched_nixl",
    "KvconnectSimpleCPUOffloadConnector": "kvconnect.connectors.vllm.patched_offload",
    "KvconnectOffloadingConnector": "kvconnect.connectors.vllm.patched_offload",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    value = load_export(_EXPORTS, __name__, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
