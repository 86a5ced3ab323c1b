"""KvconnectNixlConnector's resize logic without vLLM or NIXL: registration pieces (one per
physical allocation), the straddle check, and the decode side's peer refresh and read
guard over a stand-in of upstream's worker (kvconnect.connectors.vllm.nixl_resize)."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any

import pytest

from kvconnect.connectors.vllm.nixl_resize import (
    NixlResizeError,
    NixlResizeState,
    chunk_pieces,
    straddling_block,
)

MIB = 1 << 20


def test_each_touched_allocation_is_one_piece_whole() -> None:
    chunks = [(0, 2 * MIB), (2 * MIB, 4 * MIB), (100 * MIB, 2 * MIB)]
    # a storage over the first 5 MiB touches two allocations: both, whole, once each
    ranges = [(0, 5 * MIB, 0, ""), (MIB, MIB, 0, "")]
    assert chunk_pieces(ranges, chunks) == [(0, 2 * MIB, 0, ""), (2 * MIB, 4 * MIB, 0, "")]
    assert chunk_pieces([(50 * MIB, MIB, 0, "")], chunks) == []


def test_a_block_across_two_allocations_is_found() -> None:
    chunks = [(0, 2 * MIB), (2 * MIB, 2 * MIB)]
    # 64 KiB blocks: the boundary falls between blocks
    assert straddling_block([(0, 64 << 10, 64 << 10, 64)], chunks) is None
    # 72 KiB blocks (an MLA-like page): block 28 spans [2016, 2088) KiB, across 2 MiB
    assert straddling_block([(0, 72 << 10, 72 << 10, 56)], chunks) == (0, 28, 2 * MIB)
    # a gap between blocks (stride > length) may hold the boundary
    assert straddling_block([(0, 32 << 10, 64 << 10, 64)], chunks) is None


def _worker(**kw: Any) -> Any:
    w = SimpleNamespace(
        _physical_blocks_per_logical_kv_block=1, region_num_blocks=[16, 16],
        kv_caches_base_addr={"me": {0: [0, 8 * MIB]}}, engine_id="me", tp_rank=0,
        block_len_per_layer=[64 << 10] * 2, block_stride_per_layer=[64 << 10] * 2,
        _remote_agents={}, dst_num_blocks={}, _recving_transfers={}, _recving_metadata={},
        _failed_recv_reqs=queue.Queue(), cleaned=[], inflight=set())
    w._engines_with_inflight_transfers = lambda: set(w.inflight)

    def cleanup(engine: str, log_eviction: bool = True) -> None:
        w.cleaned.append(engine)
        w._remote_agents.pop(engine, None)
        w.dst_num_blocks.pop(engine, None)

    w._cleanup_remote_engine = cleanup
    w.read = []
    w._read_blocks_for_req = lambda req_id, meta: w.read.append(req_id)
    for k, v in kw.items():
        setattr(w, k, v)
    return w


def _req(engine: str, blocks: list[int], version: int | None) -> Any:
    meta = SimpleNamespace(remote=SimpleNamespace(engine_id=engine, block_ids=[blocks]))
    if version is not None:
        meta.kvconnect_peer_version = version
    return meta


def _state(w: Any) -> NixlResizeState:
    state = NixlResizeState(SimpleNamespace(connector_worker=w))
    state.attach()
    return state


def test_check_refuses_what_it_does_not_follow() -> None:
    state = _state(_worker(_has_mamba=True))
    with pytest.raises(NixlResizeError, match="Mamba"):
        state.check(32, [(0, 2 * MIB)])
    state = _state(_worker(block_len_per_layer=[72 << 10] * 2,
                           block_stride_per_layer=[72 << 10] * 2))
    with pytest.raises(NixlResizeError, match="straddle"):
        state.check(56, [(0, 2 * MIB), (2 * MIB, 2 * MIB), (8 * MIB, 4 * MIB)])


def test_a_newer_kv_version_drops_the_prefill_so_upstream_handshakes_again() -> None:
    w = _worker(_remote_agents={"p": {}}, dst_num_blocks={"p": 16})
    state = _state(w)
    md = SimpleNamespace(reqs_to_recv={"r1": _req("p", [1, 2], 0)})
    state.refresh_peers(md)
    assert w.cleaned == [] and state.peer_versions == {"p": 0}
    md = SimpleNamespace(reqs_to_recv={"r2": _req("p", [20, 21], 1)})
    state.refresh_peers(md)
    assert w.cleaned == ["p"] and state.peer_versions == {"p": 1}
    assert "r2" in md.reqs_to_recv  # upstream handshakes and reads it
    # the same version again: no second refresh
    w._remote_agents["p"], w.dst_num_blocks["p"] = {}, 64
    state.refresh_peers(SimpleNamespace(reqs_to_recv={"r3": _req("p", [30], 1)}))
    assert w.cleaned == ["p"] and state.refreshed == {"p": 1}


def test_a_refresh_waits_while_reads_from_that_prefill_are_in_flight() -> None:
    w = _worker(_remote_agents={"p": {}}, dst_num_blocks={"p": 16}, inflight={"p"})
    state = _state(w)
    state.peer_versions["p"] = 0
    md = SimpleNamespace(reqs_to_recv={"r": _req("p", [20], 1)})
    state.refresh_peers(md)
    assert md.reqs_to_recv == {} and list(state.deferred) == ["r"] and w.cleaned == []
    w.inflight.clear()
    md2 = SimpleNamespace(reqs_to_recv={})
    state.refresh_peers(md2)  # the next step: refreshed, the request joins its metadata
    assert list(md2.reqs_to_recv) == ["r"] and w.cleaned == ["p"]


def test_a_read_past_what_the_prefill_advertised_is_refused() -> None:
    """A prefill whose connector ignored its grow: after the refresh it still advertises 16
    blocks, so reading block 20 from it fails the request instead of reading elsewhere."""
    w = _worker(_remote_agents={"p": {}}, dst_num_blocks={"p": 16})
    state = _state(w)
    w._read_blocks_for_req("ok", _req("p", [3, 4], 1))
    w._read_blocks_for_req("bad", _req("p", [15, 20], 1))
    w._read_blocks_for_req("unknown-engine", _req("q", [99], 1))  # handshake first
    assert w.read == ["ok", "unknown-engine"]
    assert w._failed_recv_reqs.get_nowait() == "bad" and "bad" in w._recving_metadata
    assert state.refused_reads == {"p": 1}
