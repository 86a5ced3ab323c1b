"""Connectors an author might write, for the conformance kit's own tests (need vLLM).

None derives from vLLM's NIXL, SimpleCPUOffload or Offloading connectors, so the kit must
check them as connectors of unknown kind:

- :class:`MinimalConnector`: the smallest valid ``KVConnectorBase_V1``; keeps vLLM's views
  as handed (conforms).
- :class:`StorageRowsConnector`: derives its block rows from ``untyped_storage().nbytes() //
  num_blocks`` (the bug the kit exists to catch: its rows reach uncommitted memory).
- :class:`NoisyConnector`: conforms, but writes a non-JSON line to every pipe it inherited
  and to its stdout / stderr while registering.
- :class:`HangingConnector`: ``register_kv_caches`` never returns (for per-case deadlines).
- :class:`CorruptingExampleConnector`: vLLM's ExampleConnector storing negated KV (engine
  mode: a reload must give other tokens).
- :class:`EarlyExitConnector`: ends its process with status 0 while registering.
- :class:`DaemonizingConnector`: conforms, but leaves a daemon behind (``fork``, ``setsid``,
  ``fork``: a process of a session of its own, orphaned) that would sleep ten minutes; its
  pid goes to the file ``$KVC_TEST_DAEMON_PIDFILE``.
- :class:`NotAConnector`: a class that is not a ``KVConnectorBase_V1``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class MinimalConnector(KVConnectorBase_V1):
    """Does nothing but keep the views vLLM hands it."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.kv_caches: dict[str, torch.Tensor] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class StorageRowsConnector(MinimalConnector):
    """Views each layer's whole storage as ``num_blocks`` rows (geometry from the storage
    size): over a reservation its rows are capacity / num_blocks times too long."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        n = self._kv_cache_config.num_blocks
        self.rows = {}
        for name, cache in kv_caches.items():
            storage = cache.untyped_storage()
            raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(storage)
            self.rows[name] = raw.view(n, storage.nbytes() // n)


def _inherited_pipes() -> list[int]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("pipe:"):
                out.append(int(name))
        except OSError:
            continue
    return out


class NoisyConnector(MinimalConnector):
    """Writes text that is not JSON to every pipe it can find, and to stdout / stderr."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for fd in _inherited_pipes() + [1, 2]:
            try:
                os.write(fd, b"NoisyConnector: hello from register_kv_caches {not json\n")
                os.write(fd, b"no newline at the end, then")
            except OSError:
                continue
        super().register_kv_caches(kv_caches)


class HangingConnector(MinimalConnector):
    """``register_kv_caches`` sleeps for ten minutes."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        time.sleep(600)


def corrupting_example_connector() -> type:
    """:class:`CorruptingExampleConnector`'s base is vLLM's ExampleConnector (imported here
    so that this module imports where ExampleConnector's extras are missing)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    return ExampleConnector


class CorruptingExampleConnector(corrupting_example_connector()):  # type: ignore[misc]
    """vLLM's ExampleConnector (store to files, reload from them) that stores every KV with
    its sign flipped: a reload feeds the engine wrong KV (the engine mode must fail it)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        import safetensors.torch

        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
        for request in self._get_connector_metadata().requests:
            if request.is_store:
                path = self._generate_filename_debug(layer_name, request.token_ids,
                                                     request.mm_hashes)
                kv = safetensors.torch.load_file(path)["kv_cache"]
                safetensors.torch.save_file({"kv_cache": -kv}, path)


class EarlyExitConnector(MinimalConnector):
    """Leaves the process with exit status 0 in ``register_kv_caches``."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        os._exit(0)


class DaemonizingConnector(MinimalConnector):
    """Registers as MinimalConnector does, after starting a daemon the kit must find."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        pid = os.fork()
        if pid == 0:  # the intermediate: a session of its own, then the daemon, then gone
            try:
                os.setsid()
                if os.fork() == 0:
                    with open(os.environ["KVC_TEST_DAEMON_PIDFILE"], "w") as f:
                        f.write(str(os.getpid()))
                    time.sleep(600)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        path = os.environ["KVC_TEST_DAEMON_PIDFILE"]
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        super().register_kv_caches(kv_caches)


class NotAConnector:
    """A class, but not a KV connector."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass
