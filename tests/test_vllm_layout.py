"""kvconnect's layout model against vLLM 0.33's own code (vLLM-marked; skips without vLLM).

vLLM's planner and ``allocate_kv_cache`` are the reference: kvconnect must place layers and
build views exactly as they do, and its helpers must take vLLM's own objects.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvconnect.vllm.runtime import make_vllm_config, prepare_cpu_runtime, write_tiny_model

prepare_cpu_runtime()
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from kvconnect.layout import (  # noqa: E402
    VLLM_LAYOUTS,
    LayoutError,
    allocate_kv_caches,
    attention_config,
    plan_layout,
)
from kvconnect.layout.foreign import config_from_vllm  # noqa: E402
from kvconnect.views import (  # noqa: E402
    bound_packed_storage,
    committed_regions,
    narrow_kv_caches_to_num_blocks,
)

pytestmark = pytest.mark.vllm

LAYERS, HEADS, HEAD, BLOCK = 3, 2, 64, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                         dtype=torch.bfloat16)
BLOCK_OUTER = ("BLHNC", "BLNHC", "BHLNC")


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory):
    model = write_tiny_model(tmp_path_factory.mktemp("model"), num_layers=LAYERS,
                             num_kv_heads=HEADS, head_dim=HEAD)
    return make_vllm_config(model, layout="LBHNC", block_size=BLOCK)


def _vllm_plan(vllm_config, layout: str, num_blocks: int):
    vllm_config.cache_config.kv_cache_layout = layout
    cfg = get_kv_cache_config_from_groups(vllm_config, [KVCacheGroupSpec(NAMES, SPEC)],
                                          num_blocks * LAYERS * SPEC.page_size_bytes)
    cfg.kv_cache_layout = layout
    return cfg


def _geometry(kv: dict, base: int) -> dict:
    return {n: (tuple(t.shape), t.stride(), t.dtype, t.data_ptr() - base) for n, t in kv.items()}


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_placement_config_places_layers_as_vllm_planner_does(vllm_config, layout: str) -> None:
    theirs = _vllm_plan(vllm_config, layout, 40)
    ours = attention_config(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD,
                            block_size=BLOCK, num_blocks=theirs.num_blocks, layout=layout)
    assert [(t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset)
            for t in ours.kv_cache_tensors] == [
        (t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset)
        for t in theirs.kv_cache_tensors]
    assert config_from_vllm(theirs).kv_cache_tensors == ours.kv_cache_tensors


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_views_equal_vllm_allocate_kv_cache(vllm_config, layout: str) -> None:
    theirs = _vllm_plan(vllm_config, layout, 40)
    vkv = allocate_kv_cache(theirs, torch.device("cpu"), KVCacheLayout[layout])
    raw, okv = allocate_kv_caches(config_from_vllm(theirs))
    vbase = next(iter(vkv.values())).untyped_storage().data_ptr()
    assert _geometry(okv, raw[0].data_ptr()) == _geometry(vkv, vbase)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_block_views_equal_vllm(vllm_config, layout: str) -> None:
    theirs = _vllm_plan(vllm_config, layout, 24)
    vkv = allocate_kv_cache(theirs, torch.device("cpu"), KVCacheLayout[layout],
                            kernel_block_sizes=[16])
    raw, okv = allocate_kv_caches(config_from_vllm(theirs, kernel_block_size=16))
    vbase = next(iter(vkv.values())).untyped_storage().data_ptr()
    assert _geometry(okv, raw[0].data_ptr()) == _geometry(vkv, vbase)
    assert next(iter(okv.values())).shape[0] == 2 * theirs.num_blocks


def test_kernel_split_refused_where_vllm_refuses(vllm_config) -> None:
    theirs = _vllm_plan(vllm_config, "BLHNC", 24)
    with pytest.raises(ValueError, match="dense"):
        allocate_kv_cache(theirs, torch.device("cpu"), KVCacheLayout.BLHNC,
                          kernel_block_sizes=[16])
    with pytest.raises(LayoutError, match="dense"):
        plan_layout(config_from_vllm(theirs, kernel_block_size=16))


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_vllm_kv_cache_views_equal_a_plain_allocation_of_capacity(vllm_config,
                                                                 layout: str) -> None:
    from kvconnect.vllm.cache import VllmKVCache

    planned = _vllm_plan(vllm_config, layout, 16)
    with VllmKVCache(planned, "cpu", layout=layout, capacity_blocks=256) as cache:
        cache.allocate()
        cache.extend_kv_cache(16)
        cap = cache.capacity_blocks
        plain_cfg = _vllm_plan(vllm_config, layout, cap)
        assert plain_cfg.num_blocks == cap
        plain = allocate_kv_cache(plain_cfg, torch.device("cpu"), KVCacheLayout[layout])
        pbase = next(iter(plain.values())).untyped_storage().data_ptr()
        assert _geometry(cache.kv_caches(), cache.tensors[0].base_ptr) == _geometry(
            plain, pbase)
        t = cache.tensors[0]
        # one segment per layer (and head for LHBNC) when layer-outer, one when block-outer
        want = 1 if layout in BLOCK_OUTER else LAYERS * (HEADS if layout == "LHBNC" else 1)
        assert t.num_segments == want
        assert cache.connector_config().num_blocks == 16
        assert cache.connector_config().kv_cache_tensors == cache.capacity_config(
        ).kv_cache_tensors


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_helpers_take_vllm_objects(vllm_config, layout: str) -> None:
    """The seed's TypeError ('kv_cache_config must be a KVCacheConfig, got KVCacheConfig')
    is gone: vLLM's own config and views go straight in; on a plain allocation narrowing is
    byte-identical to ``narrow``."""
    theirs = _vllm_plan(vllm_config, layout, 12)
    vkv = allocate_kv_cache(theirs, torch.device("cpu"), KVCacheLayout[layout])
    for t in vkv.values():
        t.copy_(torch.randn(t.shape))
    out = narrow_kv_caches_to_num_blocks(vkv, 5, theirs)
    for n, t in vkv.items():
        ref = t.narrow(0, 0, 5)
        assert (out[n].data_ptr(), out[n].shape, out[n].stride()) == (
            ref.data_ptr(), ref.shape, ref.stride())
        assert torch.equal(out[n], ref)
    regions = committed_regions(vkv, 5, theirs)
    base = next(iter(vkv.values())).untyped_storage().data_ptr()
    assert all(r.base_ptr >= base and r.num_blocks == 5 for r in regions)
    covered = sum(r.block_len for r in regions)
    assert covered == LAYERS * SPEC.page_size_bytes  # every KV byte of a block, once
    if layout in BLOCK_OUTER:
        st = bound_packed_storage(vkv, 5, theirs)
        assert (st.data_ptr(), st.nbytes()) == (base, 5 * theirs.kv_cache_tensors[0].block_stride)
    else:
        with pytest.raises(LayoutError, match="block-outer"):
            bound_packed_storage(vkv, 5, theirs)


def test_vllm_config_without_layout_says_what_to_pass(vllm_config) -> None:
    theirs = dataclasses.replace(_vllm_plan(vllm_config, "LBHNC", 8), kv_cache_layout=None)
    with pytest.raises(LayoutError, match="pass layout="):
        config_from_vllm(theirs)
    assert config_from_vllm(theirs, layout=KVCacheLayout.LBHNC).layout == "LBHNC"


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_bounding_a_plain_allocation_changes_nothing(vllm_config, layout: str) -> None:
    from kvconnect.vllm.bounding import bound_for_connector

    theirs = _vllm_plan(vllm_config, layout, 12)
    vkv = allocate_kv_cache(theirs, torch.device("cpu"), KVCacheLayout[layout])
    bounded = bound_for_connector(vkv, theirs)
    assert bounded.kv_cache_config.kv_cache_tensors == theirs.kv_cache_tensors
    storage = next(iter(vkv.values())).untyped_storage()
    assert bounded.registered == ((storage.data_ptr(), storage.nbytes()),)
    for n, t in vkv.items():
        b = bounded.kv_caches[n]
        assert (b.data_ptr(), b.shape, b.stride()) == (t.data_ptr(), t.shape, t.stride())
