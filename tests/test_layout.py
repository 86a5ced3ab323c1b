"""KV cache configs, presets and the layout plan (pure geometry, no VMM)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvconnect.layout import (
    LAYOUTS,
    PRESETS,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    LayoutError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    allocate_kv_caches,
    attention_config,
    build_kv_caches,
    hybrid_config,
    plan_layout,
    preset,
)

KIB = 1024


def test_page_sizes_match_vllm_formulas() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert full.page_size_bytes == 2 * 16 * 8 * 128 * 2 == 64 * KIB
    sw = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16,
                           sliding_window=128)
    assert sw.page_size_bytes == 2 * 16 * 2 * 64 * 2
    mla = MLAAttentionSpec.latent(block_size=64, kv_lora_rank=512, qk_rope_head_dim=64,
                                  dtype=torch.bfloat16)
    assert mla.page_size_bytes == 64 * 576 * 2 and mla.num_kv_heads == 1
    mamba = MambaSpec(block_size=16, shapes=((8, 3), (8, 16)),
                      dtypes=(torch.bfloat16, torch.float32))
    assert mamba.state_bytes == (8 * 3 * 2, 8 * 16 * 4)
    assert mamba.page_size_bytes == 48 + 512
    padded = MambaSpec(block_size=16, shapes=((8, 3),), dtypes=(torch.bfloat16,),
                       page_size_padded=4096)
    assert padded.page_size_bytes == 4096
    with pytest.raises(LayoutError, match="below"):
        _ = MambaSpec(block_size=16, shapes=((8, 3),), dtypes=(torch.bfloat16,),
                      page_size_padded=8).page_size_bytes
    with pytest.raises(LayoutError, match="one dtype per state"):
        MambaSpec(block_size=16, shapes=((8, 3), (2,)), dtypes=(torch.bfloat16,))


def test_llama_preset_numbers() -> None:
    cfg = preset("llama3-8b-like", num_blocks=100)
    assert len(cfg.layer_names) == 32 and len(cfg.kv_cache_tensors) == 32
    assert cfg.bytes_per_block == 32 * 64 * KIB
    assert all(t.size == 100 * 64 * KIB for t in cfg.kv_cache_tensors)
    plan = plan_layout(cfg)
    assert {tp.num_segments for tp in plan.tensors} == {2}
    assert plan.tensors[0].segment_bytes_per_block == 32 * KIB
    small = preset("llama3-8b-like", num_blocks=64, num_layers=4, layout="kv_split_hnd")
    assert len(small.layer_names) == 4 and small.layout == "kv_split_hnd"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_plans_and_round_trips_json(name: str) -> None:
    cfg = preset(name, num_blocks=8, num_layers=4)
    plan = plan_layout(cfg)
    assert plan.bytes_per_block == cfg.bytes_per_block > 0
    again = KVCacheConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


def test_segment_counts_per_layout() -> None:
    seg = {lay: {tp.num_segments for tp in plan_layout(
        preset("qwen-small-like", num_blocks=4, num_layers=2, layout=lay)).tensors}
        for lay in LAYOUTS}
    # the seed's: per-layer buffers; vLLM's: ONE buffer, a segment per layer (and per head
    # for LHBNC: qwen-small has 2 KV heads) when layer-outer, one segment when block-outer
    assert seg == {"kv_split_nhd": {2}, "kv_split_hnd": {2}, "blocks_first": {1},
                   "blocks_first_hnd": {1}, "packed": {1}, "LBHNC": {2}, "LBNHC": {2},
                   "LHBNC": {4}, "BLHNC": {1}, "BLNHC": {1}, "BHLNC": {1}}
    assert {tp.num_segments for tp in plan_layout(preset("deepseek-mla-like", num_blocks=4,
            num_layers=2, layout="kv_split_nhd")).tensors} == {1}
    hybrid = plan_layout(preset("jamba-hybrid-like", num_blocks=4, num_layers=8))
    assert hybrid.hybrid and {tp.num_segments for tp in hybrid.tensors} == {1}


def test_jamba_preset_shares_pages_like_vllm_hybrid_allocator() -> None:
    cfg = preset("jamba-hybrid-like", num_blocks=10)
    specs = cfg.layer_specs()
    attn = [n for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
    mamba = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
    assert len(attn) == 4 and len(mamba) == 28
    a = specs[attn[0]]
    m = specs[mamba[0]]
    # attention block grows to 48 tokens (a multiple of 16) so its page holds the states
    assert a.block_size == 48 and a.page_size_bytes == 48 * 2 * 8 * 128 * 2
    assert sum(m.state_bytes) <= a.page_size_bytes == m.page_size_bytes
    assert len(cfg.kv_cache_tensors) == 4
    for t in cfg.kv_cache_tensors:
        assert t.size == 10 * a.page_size_bytes
        assert sum(isinstance(specs[n], FullAttentionSpec) for n in t.layers) == 1
        assert len(t.layers) == 8
    lp = plan_layout(cfg).layers[attn[0]]
    assert lp.blocks_per_block == 3  # 48-token blocks in 16-token kernel blocks


def test_kernel_split_shapes() -> None:
    cfg = preset("llama3-8b-like", num_blocks=5, num_layers=1, block_size=32,
                 kernel_block_size=8)
    _, kv = allocate_kv_caches(cfg)
    t = next(iter(kv.values()))
    assert t.shape == (2, 5 * 4, 8, 8, 128)
    with pytest.raises(LayoutError, match="not a multiple of kernel_block_size"):
        preset("llama3-8b-like", num_blocks=5, num_layers=1, block_size=16,
               kernel_block_size=12)


def test_hnd_is_a_permuted_view_of_physical_heads_first() -> None:
    cfg = preset("qwen-small-like", num_blocks=3, num_layers=1, layout="kv_split_hnd")
    raw, kv = allocate_kv_caches(cfg)
    t = next(iter(kv.values()))
    assert t.shape == (2, 3, 16, 2, 64)
    phys = raw[0].view(torch.bfloat16).view(2, 3, 2, 16, 64)
    vals = torch.arange(t.numel(), dtype=torch.float32).to(torch.bfloat16).view(t.shape)
    t.copy_(vals)
    assert torch.equal(phys.transpose(2, 3), vals)


def test_packed_rows_must_be_one_block() -> None:
    good = preset("packed", num_blocks=4, num_layers=3)
    t = good.kv_cache_tensors[0]
    assert plan_layout(good).block_stride == t.size // 4 == 3 * 64 * KIB
    two_blocks_per_row = KVCacheConfig(4, (KVCacheTensor(t.size * 2, t.layers),),
                                       good.kv_cache_groups, layout="packed")
    with pytest.raises(LayoutError, match="exactly one logical block"):
        plan_layout(two_blocks_per_row)
    split = KVCacheConfig(4, tuple(KVCacheTensor(t.size // 3, (n,)) for n in t.layers),
                          good.kv_cache_groups, layout="packed")
    with pytest.raises(LayoutError, match="ONE tensor"):
        plan_layout(split)
    with pytest.raises(LayoutError, match="Mamba"):
        plan_layout(hybrid_config(num_layers=4, layout="packed", num_blocks=4))


@pytest.mark.parametrize("mutate, match", [
    (lambda c: KVCacheConfig(c.num_blocks, (KVCacheTensor(c.kv_cache_tensors[0].size + 16 * 4,
                             c.kv_cache_tensors[0].layers),) + c.kv_cache_tensors[1:],
                             c.kv_cache_groups), "does not match its tensors"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors[1:], c.kv_cache_groups),
     "have no KV cache tensor"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors + (KVCacheTensor(
        c.kv_cache_tensors[0].size, ("ghost",)),), c.kv_cache_groups), "in no KV cache group"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors + c.kv_cache_tensors[:1],
                             c.kv_cache_groups), "exactly one KV tensor"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors, c.kv_cache_groups,
                             layout="nhd_weird"), "unknown layout"),
    (lambda c: KVCacheConfig(3, c.kv_cache_tensors, c.kv_cache_groups),
     "not a whole number"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors, c.kv_cache_groups + (
        c.kv_cache_groups[0],)), "more than one KV cache group"),
])
def test_inconsistent_configs_are_rejected_with_the_reason(mutate, match) -> None:
    cfg = preset("llama3-8b-like", num_blocks=4, num_layers=2)
    with pytest.raises(LayoutError, match=match):
        plan_layout(mutate(cfg))


def test_kv_split_and_block_major_layers_cannot_share_a_tensor() -> None:
    a = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16)
    m = MLAAttentionSpec(block_size=32, head_size=32, dtype=torch.float16)
    assert a.page_size_bytes == m.page_size_bytes
    cfg = KVCacheConfig(2, (KVCacheTensor(2 * a.page_size_bytes, ("a", "m")),),
                        (KVCacheGroupSpec(("a",), a), KVCacheGroupSpec(("m",), m)))
    with pytest.raises(LayoutError, match="different segment counts"):
        plan_layout(cfg)


def test_padded_attention_page_needs_block_major() -> None:
    a = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16,
                          page_size_padded=4096)
    groups = (KVCacheGroupSpec(("a",), a),)
    tensors = (KVCacheTensor(2 * 4096, ("a",)),)
    with pytest.raises(LayoutError, match="block-major"):
        plan_layout(KVCacheConfig(2, tensors, groups, layout="kv_split_nhd"))
    plan = plan_layout(KVCacheConfig(2, tensors, groups, layout="blocks_first"))
    (rg,) = plan.layers["a"].regions
    assert (rg.block_len, rg.block_stride) == (a.real_page_size_bytes, 4096)


def test_mamba_states_are_page_strided_and_contiguous_in_the_page() -> None:
    cfg = hybrid_config(num_layers=2, attn_period=2, num_kv_heads=1, head_size=16,
                        dtype=torch.float16, mamba_shapes=((4, 3), (4, 8)),
                        mamba_dtypes=(torch.float32, torch.float16), kernel_block_size=None,
                        num_blocks=6)
    raw, kv = allocate_kv_caches(cfg)
    mamba = kv["model.layers.0.mamba"]
    attn = kv["model.layers.1.self_attn.attn"]
    assert isinstance(mamba, list) and len(mamba) == 2
    page = cfg.kv_cache_tensors[0].size // 6
    conv, ssm = mamba
    assert conv.shape == (6, 4, 3) and ssm.shape == (6, 4, 8)
    assert conv.stride(0) * 4 == page and ssm.stride(0) * 2 == page
    assert ssm.data_ptr() - conv.data_ptr() == 4 * 3 * 4
    # hybrid attention is block-major: K and V of block b are adjacent inside page b
    assert attn.shape[:2] == (2, 6)
    assert attn.stride(1) * 2 == page
    assert attn[1, 0].data_ptr() - attn[0, 0].data_ptr() == attn[0, 0].numel() * 2
    assert raw[0].data_ptr() == conv.data_ptr() == attn.data_ptr()


def test_sliding_window_groups() -> None:
    cfg = attention_config(num_layers=4, num_kv_heads=2, head_size=32, num_blocks=4,
                           sliding_window=64, sliding_window_every=2)
    kinds = [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups]
    assert kinds == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert len(plan_layout(cfg).layers) == 4


def test_build_kv_caches_rejects_too_small_raw_tensors() -> None:
    cfg = preset("qwen-small-like", num_blocks=4, num_layers=2)
    raw, _ = allocate_kv_caches(cfg)
    with pytest.raises(LayoutError, match="too few"):
        build_kv_caches(cfg, raw, 5)
    with pytest.raises(LayoutError, match="raw tensors"):
        build_kv_caches(cfg, raw[:1], 4)


def test_preset_errors() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-9")
    with pytest.raises(TypeError, match="bad override"):
        preset("llama3-8b-like", num_heads=3)
    cfg = preset("qwen-small-like", num_blocks=4, num_layers=2)
    assert cfg.with_num_blocks(10).kv_cache_tensors[0].size == 10 * cfg.bytes_per_block // 2


# -- vLLM 0.33's placement form -------------------------------------------------------------
def test_placement_rescales_layer_outer_strides_and_keeps_block_outer_rows() -> None:
    lbhnc = preset("LBHNC", num_blocks=8, num_layers=2)
    page = 64 * KIB
    (t,) = lbhnc.kv_cache_tensors
    assert (t.size, t.layer_stride, t.block_stride, t.offset) == (2 * 8 * page, 8 * page,
                                                                  page, 0)
    big = lbhnc.with_num_blocks(100)
    assert big.kv_cache_tensors[0].layer_stride == 100 * page
    assert plan_layout(big).alloc_blocks == 100
    blhnc = preset("BLHNC", num_blocks=8, num_layers=2).with_num_blocks(100)
    (b,) = blhnc.kv_cache_tensors
    assert (b.size, b.layer_stride, b.block_stride) == (100 * 2 * page, page, 2 * page)
    # a committed prefix of a larger placement: same bytes, fewer blocks in use
    view = dataclasses.replace(big, num_blocks=8)
    assert plan_layout(view).alloc_blocks == 100
    with pytest.raises(LayoutError, match="holds 100 blocks, fewer than"):
        plan_layout(dataclasses.replace(big, num_blocks=101))


def test_seed_layouts_are_placements_with_their_own_page_format() -> None:
    """blocks_first places layers exactly as LBHNC does (one segment per layer, the page as
    block stride); only the byte order inside the page differs."""
    seed = plan_layout(preset("qwen-small-like", num_blocks=4, num_layers=2,
                              layout="blocks_first"))
    vllm = plan_layout(preset("qwen-small-like", num_blocks=4, num_layers=2, layout="LBHNC"))
    seed_runs = [(r.block_len, r.block_stride) for lp in seed.layers.values()
                 for r in lp.regions]
    vllm_runs = [(r.block_len, r.block_stride) for lp in vllm.layers.values()
                 for r in lp.regions]
    assert seed_runs == vllm_runs
    assert seed.bytes_per_block == vllm.bytes_per_block
    assert [lp.views[0].unit_shape for lp in seed.layers.values()] != [
        lp.views[0].unit_shape for lp in vllm.layers.values()]


@pytest.mark.parametrize("mutate, match", [
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors[:1] + (KVCacheTensor(
        c.kv_cache_tensors[0].size, ("x",)),), c.kv_cache_groups), "mixes placement-form"),
    (lambda c: KVCacheConfig(c.num_blocks, (KVCacheTensor(
        c.kv_cache_tensors[0].size + 2, ("model.layers.0.self_attn.attn",), 4 * 64 * KIB,
        64 * KIB), KVCacheTensor(c.kv_cache_tensors[0].size, (
            "model.layers.1.self_attn.attn",), 4 * 64 * KIB, 64 * KIB, 4 * 64 * KIB)),
        c.kv_cache_groups, layout="LBHNC"), "ONE backing buffer"),
    (lambda c: KVCacheConfig(c.num_blocks, (KVCacheTensor(
        c.kv_cache_tensors[0].size, c.kv_cache_tensors[0].layers, 4 * 64 * KIB, 64 * KIB,
        64 * KIB),), c.kv_cache_groups, layout="LBHNC"), "not at a segment start"),
    (lambda c: KVCacheConfig(5, c.kv_cache_tensors, c.kv_cache_groups, layout="LBHNC"),
     "holds 4 blocks, fewer"),
    (lambda c: KVCacheConfig(c.num_blocks, c.kv_cache_tensors, c.kv_cache_groups,
                             layout="LBHNC", kernel_block_size=12), "not a multiple"),
])
def test_placement_configs_are_rejected_with_the_reason(mutate, match) -> None:
    cfg = preset("LBHNC", num_blocks=4, num_layers=2)
    with pytest.raises(LayoutError, match=match):
        plan_layout(mutate(cfg))


def test_strides_come_in_pairs() -> None:
    with pytest.raises(LayoutError, match="both layer_stride and block_stride"):
        KVCacheTensor(1024, ("a",), 512)
