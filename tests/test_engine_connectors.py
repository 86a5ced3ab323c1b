"""KV connectors over the plugin's cache inside real engines (``make test-engine``).

1P1D: engines in separate processes, producer and consumer. One decode engine (plugin on,
kvconnect's patched NixlConnector) decodes the prompt from five prefill engines, after a
prefix-cache reset each: through the same-host ipc fast path (``same``, ``other``: plugin
on), through NIXL over UCX from an extensible cache (``nixl-*``: plugin on, fast path off
there, as across hosts) and from a plain one (``plain-same``: plugin off). ``*same`` have
the decode's weights: their tokens must equal the decode engine's own answer computed
locally (a single engine's); ``*other`` have other weights: their tokens must differ (the
KV really crossed, so the comparison can fail). The decode's fast-path facts say which path
each prefill took and why, and each prefill sees the decode's notification through
upstream's ``get_finished``. A second pair runs stock NixlConnector over
the same plugin cache and must fail as docs/conformance.md describes (its transfer ends in
``NIXL_ERR_REMOTE_DISCONNECT``; vLLM's default ``kv_load_failure_policy=fail`` ends the
request with ``finish_reason == "error"``).

Offload: kvconnect's SimpleCPUOffload in one in-process engine with the CPU stand-ins of
:mod:`kvconnect.vllm.host_stand_ins`: store, reload after a prefix-cache reset (equal tokens,
cached tokens counted), and a control whose CPU copy was zeroed before the reload.
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _engine_runs import DEVICE, EngineBatch, engine_env, engine_unavailable, free_port

REASON = engine_unavailable()
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900),
              pytest.mark.skipif(REASON is not None, reason=str(REASON))]

#: a seeded random prompt (a fresh Random per token would repeat one token 300 times)
PROMPT = random.Random(11).choices(range(3, 1000), k=300)
MAX_TOKENS = 8
PATCHED = ("KvconnectNixlConnector", "kvconnect.connectors.vllm")
STOCK = ("NixlConnector", None)
#: 8x the 1 GiB KV cache: a capacity stock NIXL's segmented registration path accepts
STOCK_CAPACITY = 8 << 30


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kvconnect.vllm.tiny_model import write_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    return {"seed0": write_tiny_llama(root / "seed0", seed=0),
            "seed1": write_tiny_llama(root / "seed1", seed=1)}


def _nixl(connector: tuple[str, str | None], engine_id: str,
          ipc_dir: str | None = None, ipc: bool = True) -> dict[str, Any]:
    # the prefill engines' model folders differ (other weights): vLLM's NIXL handshake
    # compares model paths unless told not to
    extra: dict[str, Any] = {"enforce_handshake_compat": False}
    if ipc_dir is not None:  # the fast path's sockets: short path, removed with the test
        extra["kvconnect_ipc_dir"] = ipc_dir
    if not ipc:
        extra["kvconnect_ipc"] = False
    return {"connector": connector[0], "connector_module": connector[1],
            "engine_id": engine_id, "extra_config": extra}


def _nixl_env(capacity: int | None, plugin: bool = True) -> dict[str, str]:
    extra = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
             "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    if capacity is not None:
        extra["KVCONNECT_KV_CAPACITY_BYTES"] = str(capacity)
    return engine_env(plugin=plugin, extra=extra)


def _pd(batch: EngineBatch, work: Path, connector: tuple[str, str | None],
        prefills: dict[str, tuple[Path, bool, bool]], decode_model: Path, tag: str,
        capacity: int | None = None, ipc_dir: str | None = None) -> None:
    """Prefill engines ``name -> (model, plugin on, fast path on)`` and one decode engine
    (plugin and fast path on) reading from each of them."""
    params = {}
    done = work / f"{tag}.done"
    # stock NIXL over the plugin's cache may refuse to start on CUDA (UCX registers VRAM):
    # then the start error is the result, as a failed transfer is on CPU
    may_fail = connector == STOCK and DEVICE == "cuda"
    for name, (model, plugin, ipc) in prefills.items():
        params[name] = str(work / f"{tag}-{name}.params.json")
        batch.start(f"{tag}-{name}", "pd_prefill", {
            **_nixl(connector, f"{tag}-{name}", ipc_dir, ipc), "model": str(model),
            "prompt": PROMPT, "params_out": params[name], "done_file": str(done),
            "timeout": 400, "check_notified": connector == PATCHED,
            "may_fail_to_start": may_fail}, _nixl_env(capacity, plugin))
    batch.start(f"{tag}-decode", "pd_decode", {
        **_nixl(connector, f"{tag}-decode", ipc_dir), "model": str(decode_model),
        "prompt": PROMPT, "max_tokens": MAX_TOKENS, "prefills": params,
        "done_file": str(done), "timeout": 400, "may_fail_to_start": may_fail},
        _nixl_env(capacity))


@pytest.fixture(scope="module")
def pd_patched(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> dict[str, Any]:
    """One decode engine (plugin on) reading from five prefill engines: ``same`` / ``other``
    (plugin on: the ipc fast path, same and other weights), ``nixl-same`` / ``nixl-other``
    (plugin on, fast path off there: NIXL READs from an extensible cache, as across hosts)
    and ``plain-same`` (plugin off: NIXL, the prefill says why)."""
    work = tmp_path_factory.mktemp("pd-patched")
    ipc_dir = tempfile.mkdtemp(prefix="kvc-")
    try:
        with EngineBatch(work, timeout=600) as batch:
            _pd(batch, work, PATCHED, {
                "same": (models["seed0"], True, True), "other": (models["seed1"], True, True),
                "nixl-same": (models["seed0"], True, False),
                "nixl-other": (models["seed1"], True, False),
                "plain-same": (models["seed0"], False, True),
            }, models["seed0"], "patched", ipc_dir=ipc_dir)
            return batch.results()
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _peer(pd: dict[str, Any], prefill: str) -> dict[str, Any]:
    """The decode's fast-path record of the prefill engine ``prefill``."""
    (peer,) = [p for p in pd["patched-decode"]["fast_path"]["peers"]
               if p["engine_id"] == f"patched-{prefill}"]
    return peer


@pytest.fixture(scope="module")
def pd_stock(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Any]:
    """Stock NixlConnector over the plugin's cache, both ways it fails on vLLM 0.32: a pair
    whose capacity is a multiple of vLLM's blocks (8 GiB for 1 GiB: its registration takes
    the reservation for 8 segments and the transfer fails) and, at the default capacity (not
    a multiple), an engine whose registration asserts before it starts."""
    work = tmp_path_factory.mktemp("pd-stock")
    with EngineBatch(work, timeout=240) as batch:
        _pd(batch, work, STOCK, {"same": (models["seed0"], True, True)}, models["seed0"], "stock",
            capacity=STOCK_CAPACITY)
        batch.start("stock-default-capacity", "pd_prefill", {
            **_nixl(STOCK, "stock-default"), "model": str(models["seed0"]), "prompt": PROMPT,
            "params_out": str(work / "unused.json"), "done_file": str(work / "unused.done"),
            "timeout": 400, "may_fail_to_start": True}, _nixl_env(None))
        outcomes = batch.outcomes()
        out: dict[str, Any] = {name: o["result"] for name, o in outcomes.items()}
        out["returncodes"] = {name: o["returncode"] for name, o in outcomes.items()}
        out["decode_log"] = batch.engines["stock-decode"].log_text()
        out["prefill_log"] = batch.engines["stock-same"].log_text()
    return out


@pytest.mark.parametrize("same", ["same", "nixl-same", "plain-same"])
def test_patched_nixl_1p1d_decode_equals_a_single_engine(pd_patched: dict[str, Any],
                                                         same: str) -> None:
    """Every path (ipc, NIXL from an extensible cache, NIXL from a plain one) gives the
    tokens a single engine gives, and the prefill learnt its blocks were read."""
    d = pd_patched["patched-decode"]
    remote = d["remote"][same]
    assert remote["finish_reason"] == "length" and len(remote["tokens"]) == MAX_TOKENS
    assert d["local"]["num_cached_tokens"] == 0
    assert remote["tokens"] == d["local"]["tokens"]
    prefill = pd_patched[f"patched-{same}"]
    assert prefill["finished_sending"] == [
        prefill["output"]["kv_transfer_params"]["remote_request_id"]]


@pytest.mark.parametrize("other", ["other", "nixl-other"])
def test_patched_nixl_1p1d_control_other_prefill_weights_change_tokens(
        pd_patched: dict[str, Any], other: str) -> None:
    d = pd_patched["patched-decode"]
    remote = d["remote"][other]
    assert remote["finish_reason"] == "length"
    assert remote["tokens"] != d["local"]["tokens"]


@pytest.mark.parametrize("prefill", ["same", "other"])
def test_patched_nixl_same_host_plugin_engines_take_the_ipc_fast_path(
        pd_patched: dict[str, Any], prefill: str) -> None:
    peer = _peer(pd_patched, prefill)
    assert peer["route"] == "ipc" and peer["code"] is None
    (remote_blocks,) = pd_patched[f"patched-{prefill}"]["output"]["kv_transfer_params"][
        "remote_block_ids"]
    assert peer["ipc_reads"] == 1 and peer["nixl_reads"] == 0
    assert peer["ipc_blocks"] == len(remote_blocks) > 1  # the whole prompt, one copy
    assert peer["ipc_bytes"] == peer["ipc_blocks"] * pd_patched["patched-decode"]["facts"][0][
        "bytes_per_block"]
    export = pd_patched[f"patched-{prefill}"]["fast_path"]["export"]
    assert export["refusal"] is None and export["answered"] == 1 and export["served"] == 1


@pytest.mark.parametrize(("prefill", "code"), [
    ("nixl-same", "no_endpoint"), ("nixl-other", "no_endpoint"),
    ("plain-same", "remote_plain_cache")])
def test_patched_nixl_falls_back_to_nixl_saying_why(pd_patched: dict[str, Any], prefill: str,
                                                    code: str) -> None:
    """A prefill with the fast path off serves no offer; one without the plugin says its
    cache is vLLM's own. Either way the decode reads through NIXL."""
    peer = _peer(pd_patched, prefill)
    assert peer["route"] == "nixl" and peer["code"] == code
    assert peer["ipc_reads"] == 0 and peer["nixl_reads"] == 1
    fast = pd_patched[f"patched-{prefill}"]["fast_path"]
    if code == "no_endpoint":
        assert fast["enabled"] is False and fast["export"] is None
        (f,) = pd_patched[f"patched-{prefill}"]["facts"]  # an extensible cache all the same
        assert f["capacity_blocks"] > f["num_blocks"] and f["handle_type"] == "posix_fd"
    else:
        assert fast["export"]["refusal"] == "plain_cache" and fast["export"]["served"] == 0
        assert pd_patched[f"patched-{prefill}"]["facts"] is None  # no plugin there


def test_patched_nixl_engines_use_single_shareable_handles(pd_patched: dict[str, Any]) -> None:
    for name in ("patched-same", "patched-other", "patched-nixl-same", "patched-decode"):
        (f,) = pd_patched[name]["facts"]
        assert f["kv_connector"] == "KvconnectNixlConnector"
        assert f["single_handle"] and f["handles_per_segment"] == [1] * f["segments"]
        assert f["requested"]["shareable"] and f["handle_type"] == "posix_fd"
        assert f["capacity_blocks"] > f["num_blocks"]
        # GPUDirect RDMA: asked for on a GPU (the host backend has no such flag), and the
        # H200 grants it with VMM (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED=1)
        assert f["requested"]["rdma_capable"] == (DEVICE == "cuda")
        assert f["granted"] == f["requested"]


def test_stock_nixl_over_the_plugin_cache_fails_as_documented(pd_stock: dict[str, Any]) -> None:
    """Stock NixlConnector takes its geometry from the storage size (8x the KV cache here):
    its READ reaches past the committed blocks. On CPU the transfer fails
    (``NIXL_ERR_REMOTE_DISCONNECT``); on CUDA the prefill engine dies of SIGSEGV in UCX's
    ``cuMemcpyAsync`` from unmapped VRAM (seen on the H200), or, failing that, the decode
    must not have the prompt's KV either."""
    d, p = pd_stock["stock-decode"], pd_stock["stock-same"]
    assert pd_stock["returncodes"]["stock-decode"] == 0, pd_stock["decode_log"][-3000:]
    if DEVICE == "cuda" and p is None:  # the prefill died: how, exactly
        assert pd_stock["returncodes"]["stock-same"] < 0, pd_stock["prefill_log"][-3000:]
        assert "cuMemcpyAsync" in pd_stock["prefill_log"]
    if DEVICE == "cuda" and ("start_error" in d or (p is not None and "start_error" in p)):
        return  # refused at registration: nothing was read
    assert p is not None or DEVICE == "cuda", "the prefill engine died on CPU"
    remote = d["remote"]["same"]
    (f,) = d["facts"]
    assert f["kv_connector"] in ("NixlConnector", "NixlPullConnector")  # stock
    assert f["capacity_blocks"] == 8 * f["num_blocks"]
    if DEVICE == "cpu":
        assert remote["finish_reason"] == "error"
        assert "NIXL_ERR_REMOTE_DISCONNECT" in pd_stock["decode_log"]
    else:
        assert remote["finish_reason"] == "error" or remote["tokens"] != d["local"]["tokens"]
    assert remote["tokens"] != d["local"]["tokens"]


def test_stock_nixl_refuses_a_reservation_it_cannot_partition(pd_stock: dict[str, Any]) -> None:
    r = pd_stock["stock-default-capacity"]
    assert "output" not in r
    messages = [e["message"] for e in r["start_error"]["chain"] if e["type"] == "AssertionError"]
    assert messages and "cannot be partitioned into NIXL regions" in messages[0]


# -- offload ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def offload(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("offload")
    with EngineBatch(work, timeout=400) as batch:
        batch.start("offload", "offload", {
            "model": str(models["seed0"]), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
            "connector": "KvconnectSimpleCPUOffloadConnector",
            "connector_module": "kvconnect.connectors.vllm", "engine_id": "offload",
            "extra_config": {"cpu_bytes_to_use": 256 << 20}}, engine_env(plugin=True))
        return batch.results()["offload"]


def test_simple_cpu_offload_stores_and_reloads_over_the_plugin_cache(
        offload: dict[str, Any]) -> None:
    """Store, then reload after a prefix-cache reset: vLLM's own copy path on CUDA
    (``cuMemcpyBatchAsync``), the CPU stand-ins (which count the blocks) on CPU."""
    r = offload
    assert r["connector"] == "KvconnectSimpleCPUOffloadConnector"
    assert r["stand_ins"] == (DEVICE == "cpu")
    (f,) = r["facts"]
    assert f["kv_connector"] == r["connector"] and f["capacity_blocks"] > f["num_blocks"]
    if r["stand_ins"]:
        assert r["copied_after_first"]["store"] > 0
        assert r["copied_after_reload"]["load"] > r["copied_after_first"]["load"]
    assert r["reloaded"]["num_cached_tokens"] > 0
    assert r["reloaded"]["tokens"] == r["first"]["tokens"]
    # its regions lie in the reservation, over storages bounded to the committed memory
    for ptr, nbytes in r["offload_regions"].values():
        assert nbytes <= f["committed_bytes"]
        assert any(b <= ptr < b + f["reserved_bytes"] for b in f["reservation_bases"])


def test_simple_cpu_offload_control_zeroed_copy_changes_tokens(offload: dict[str, Any]) -> None:
    r = offload
    assert r["from_zeroed_copy"]["num_cached_tokens"] > 0
    assert r["from_zeroed_copy"]["tokens"] != r["first"]["tokens"]
