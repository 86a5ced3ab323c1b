"""Shared by the fast path's tests (tests/test_nixl_fast_path*.py): a host-backend cache as
an engine's plugin cache, and stand-ins for what the fast path reads of vLLM's NIXL worker
(vLLM is not installed in this environment; the engine tests run the real one)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from _nixl_peer import fill_cache

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import preset
from kvconnect.vmm import AllocationOptions

#: a NIXL agent name (a UUID, as vLLM's)
AGENT = "0f9c2a8e-5d1b-4c3e-9a7f-1b2c3d4e5f60"
NUM_BLOCKS = 8


def cache(seed: int | None = None) -> ExtensibleKVCache:
    """A shareable 2-layer cache of NUM_BLOCKS committed blocks (of 4x that reserved),
    filled from ``seed`` when given."""
    kv = ExtensibleKVCache(preset("llama3-8b-like", num_blocks=NUM_BLOCKS, num_layers=2),
                           "cpu", capacity_blocks=NUM_BLOCKS * 4,
                           options=AllocationOptions(shareable=True))
    kv.allocate()
    kv.extend_kv_cache(NUM_BLOCKS)
    if seed is not None:
        fill_cache(kv, seed)
    return kv


def upstream_worker_stand_in(**changes: Any) -> SimpleNamespace:
    """The attributes of vLLM's NIXL worker that :func:`layout_mismatch` reads."""
    info = SimpleNamespace(remote_tp_size=1, remote_block_size=128,
                           remote_physical_blocks_per_logical=1, remote_dcp_size=1)
    topo = SimpleNamespace(tp_size=1, block_size=128, get_engine_info=lambda e: info)
    worker = SimpleNamespace(transfer_topo=topo, _physical_blocks_per_logical_kv_block=1,
                             dcp_size=1, pp_size=1, _has_mamba=False, use_host_buffer=False,
                             _mixed_mem_types=False, enable_permute_local_kv=False,
                             enable_heterogeneous_attn_post_process=False)
    for k, v in changes.items():
        target = info if k.startswith("remote_") else worker
        setattr(target, k, v)
    return worker


class PullWorkerStandIn(SimpleNamespace):
    """What :class:`NixlIpcFastPath` touches of vLLM's pull worker: its bookkeeping dicts,
    upstream's topology (:func:`upstream_worker_stand_in`) and a prefix trim that keeps
    everything (no local prefix hit)."""

    def _apply_prefix_caching(self, *, decode_block_ids: Any, prefill_block_ids: Any,
                              **ratios: int) -> tuple[Any, Any]:
        return decode_block_ids, prefill_block_ids


def read_kw(local: list[int], remote: list[int]) -> dict[str, Any]:
    """The keyword arguments of upstream's ``_read_blocks`` for one plain read from
    prefill-0 rank 0."""
    spec = SimpleNamespace(remote_rank=0, local_block_ids=[local], remote_block_ids=[remote],
                           block_ids_by_region=False)
    return {"read_spec": spec, "dst_engine_id": "prefill-0", "request_id": "req-1",
            "remote_request_id": "p-req-1", "expected_consumers": 1}
