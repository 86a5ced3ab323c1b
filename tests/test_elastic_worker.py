"""The worker side of an elastic resize without vLLM: the checks (each refusal changes
nothing), the order of commit and connector, and the rollback when a connector cannot
follow (kvconnect.vllm.elastic_worker over a host-backend cache)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import preset
from kvconnect.vllm import elastic_worker
from kvconnect.vllm.engine_cache import EngineKVCache
from kvconnect.vmm import AllocationOptions

MIB = 1 << 20


class FollowingConnector:
    """Records what it was asked; ``fail`` makes it refuse."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[int, list[tuple[int, int]]]] = []

    def kvconnect_resize_kv_caches(self, num_blocks: int, chunks: list[tuple[int, int]]
                                   ) -> dict[str, Any]:
        self.calls.append((num_blocks, list(chunks)))
        if self.fail:
            raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return {"registration_seconds": 0.001}


class StockConnector:
    """A connector without kvconnect's resize hook (vLLM's own)."""


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A worker whose model runner holds a plugin record of a host cache (64 of 1024
    blocks, 2 layers K/V split: 4 segments of 32 KiB a block)."""
    cfg = preset("llama3-8b-like", num_blocks=64, num_layers=2)
    cache = ExtensibleKVCache(cfg, "cpu", capacity_blocks=1024,
                              options=AllocationOptions(shareable=True))
    cache.allocate()
    cache.extend_kv_cache(64)
    record = EngineKVCache(cache, "test", None, "KVCONNECT_KV_CAPACITY_BYTES=test",
                           cache.options, [1, 64])
    runner = SimpleNamespace(kv_cache_config=SimpleNamespace(num_blocks=64))
    w = SimpleNamespace(model_runner=runner, record=record, connector=None)
    monkeypatch.setattr(elastic_worker, "record_for_worker", lambda _: record)
    monkeypatch.setattr(elastic_worker, "transfer_group", lambda: w.connector)
    monkeypatch.setattr(elastic_worker, "engine_log", SimpleNamespace(info=lambda *a: None))
    yield w
    cache.close(force=True)


def _state(w: Any) -> tuple[int, int, int]:
    c = w.record.cache
    return c.num_blocks, c.committed_bytes, c.num_physical_chunks


def test_grow_commits_then_the_connector_registers_the_new_allocations(worker: Any) -> None:
    worker.connector = FollowingConnector()
    before = {(c.va, c.size) for t in worker.record.cache.tensors for c in t.physical_chunks()}
    answer = elastic_worker.resize_worker_kv_cache(worker, 256)
    assert answer["ok"] and answer["facts"]["num_blocks"] == 256
    ((n, chunks),) = worker.connector.calls
    assert n == 256 and len(set(chunks) - before) == 4  # one new allocation per segment
    assert worker.model_runner.kv_cache_config.num_blocks == 256
    (entry,) = answer["facts"]["resizes"]
    assert (entry["from"], entry["to"]) == (64, 256)
    assert entry["committed_bytes_delta"] == 4 * 6 * MIB
    assert entry["registration_seconds"] == 0.001


def test_shrink_lets_the_connector_drop_what_goes_before_it_is_released(worker: Any) -> None:
    worker.connector = FollowingConnector()
    elastic_worker.resize_worker_kv_cache(worker, 256)
    grown = {(c.va, c.size) for t in worker.record.cache.tensors for c in t.physical_chunks()}
    answer = elastic_worker.resize_worker_kv_cache(worker, 64)
    assert answer["ok"]
    _, (n, kept) = worker.connector.calls
    # the connector saw the allocations that stay while the others were still mapped
    assert n == 64 and len(kept) == 4 and set(kept) < grown
    assert _state(worker) == (64, 4 * 2 * MIB, 4)


def test_a_connector_that_cannot_follow_a_grow_leaves_everything_as_it_was(
        worker: Any) -> None:
    worker.connector = FollowingConnector(fail=True)
    before = _state(worker)
    answer = elastic_worker.resize_worker_kv_cache(worker, 256)
    assert not answer["ok"] and answer["code"] == "connector"
    assert "NIXL_ERR_NOT_FOUND" in answer["message"] and "released again" in answer["message"]
    assert _state(worker) == before and worker.record.resizes == []
    assert worker.model_runner.kv_cache_config.num_blocks == 64


def test_a_connector_that_cannot_follow_a_shrink_releases_nothing(worker: Any) -> None:
    worker.connector = FollowingConnector()
    elastic_worker.resize_worker_kv_cache(worker, 256)
    worker.connector.fail = True
    before = _state(worker)
    answer = elastic_worker.resize_worker_kv_cache(worker, 64)
    assert not answer["ok"] and answer["code"] == "connector"
    assert "nothing was released" in answer["message"]
    assert _state(worker) == before


@pytest.mark.parametrize("case", ["stock_connector", "beyond_capacity", "beyond_device",
                                  "released", "bad_count"])
def test_refusals_change_nothing(worker: Any, monkeypatch: pytest.MonkeyPatch,
                                 case: str) -> None:
    target, code = 256, case
    if case == "stock_connector":
        worker.connector, code = StockConnector(), "connector"
    elif case == "beyond_capacity":
        target = 1025
    elif case == "beyond_device":
        monkeypatch.setattr(elastic_worker, "device_free_bytes", lambda _: 8 * MIB)
    elif case == "released":
        worker.record.cache.release_physical()
    else:
        target, code = 0, "failed"
    before = (worker.record.cache.num_blocks, worker.record.cache.committed_bytes)
    for check_only in (True, False):
        answer = elastic_worker.resize_worker_kv_cache(worker, target, check_only)
        assert not answer["ok"] and answer["code"] == code, answer
    assert (worker.record.cache.num_blocks, worker.record.cache.committed_bytes) == before
    if case == "stock_connector":
        assert "StockConnector cannot follow" in answer["message"]
    if case == "beyond_device":
        assert "8388608 are available" in answer["message"]


def test_growth_bytes_counts_whole_granules_per_segment(worker: Any) -> None:
    record = worker.record
    assert elastic_worker.growth_bytes(record, 64) == 0
    assert elastic_worker.growth_bytes(record, 65) == 4 * 2 * MIB
    assert elastic_worker.growth_bytes(record, 256) == 4 * 6 * MIB
