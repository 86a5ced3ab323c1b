"""Committed-extent helpers on hand-built tensors and on the extensible cache."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import LayoutError, allocate_kv_caches, preset
from kvconnect.views import (
    CommittedRegion,
    bound_packed_storage,
    committed_regions,
    narrow_kv_caches_to_num_blocks,
)

NAME = "model.layers.0.self_attn.attn"


def _one_layer(layout: str, **kw):
    return preset("qwen-small-like", num_blocks=8, num_layers=1, layout=layout, **kw)


def test_narrow_plain_kv_split_is_byte_identical_to_narrow() -> None:
    cfg = _one_layer("kv_split_nhd")
    kv = {NAME: torch.randn(2, 8, 16, 2, 64).to(torch.bfloat16)}
    out = narrow_kv_caches_to_num_blocks(kv, 3, cfg)[NAME]
    ref = kv[NAME].narrow(1, 0, 3)
    assert out.data_ptr() == ref.data_ptr()
    assert out.shape == ref.shape and out.stride() == ref.stride()
    assert torch.equal(out, ref)
    # the storage ends at V's last committed byte (K prefix, the gap, V prefix)
    half = 16 * 2 * 64 * 2
    assert out.untyped_storage().nbytes() == 8 * half + 3 * half
    assert out.untyped_storage().data_ptr() == kv[NAME].data_ptr()
    # the bug narrow() alone leaves in place
    assert ref.untyped_storage().nbytes() == 2 * 8 * half


@pytest.mark.parametrize("layout", ["blocks_first", "blocks_first_hnd"])
def test_narrow_plain_blocks_first_bounds_storage_to_committed(layout: str) -> None:
    cfg = _one_layer(layout)
    _, kv = allocate_kv_caches(cfg)
    kv[NAME].copy_(torch.randn(kv[NAME].shape))
    out = narrow_kv_caches_to_num_blocks(kv, 5, cfg)[NAME]
    ref = kv[NAME].narrow(0, 0, 5)
    assert (out.data_ptr(), out.shape, out.stride()) == (ref.data_ptr(), ref.shape, ref.stride())
    assert torch.equal(out, ref)
    assert out.untyped_storage().nbytes() == 5 * cfg.bytes_per_block


def test_narrow_counts_kernel_blocks() -> None:
    cfg = preset("llama3-8b-like", num_blocks=6, num_layers=2, block_size=32,
                 kernel_block_size=16)
    _, kv = allocate_kv_caches(cfg)
    out = narrow_kv_caches_to_num_blocks(kv, 4, cfg)
    for t in out.values():
        assert t.shape[1] == 8  # 4 logical blocks = 8 kernel blocks
    regions = committed_regions(kv, 4, cfg)
    k = next(r for r in regions if r.part == "k")
    assert k.block_len == k.block_stride == 32 * 8 * 128 * 2


def test_regions_for_kv_split_land_on_the_two_prefixes() -> None:
    cfg = _one_layer("kv_split_hnd")
    raw, kv = allocate_kv_caches(cfg)
    regions = committed_regions(kv, 3, cfg)
    assert [r.part for r in regions] == ["k", "v"]
    k, v = regions
    half = 16 * 2 * 64 * 2
    assert k.base_ptr == raw[0].data_ptr() and v.base_ptr == raw[0].data_ptr() + 8 * half
    assert (k.block_len, k.block_stride, k.num_blocks, k.segment) == (half, half, 3, 0)
    assert (v.segment, v.segment_offset) == (1, 0)
    assert k.nbytes == 3 * half and k.span == 3 * half
    assert v.block_address(2) == v.base_ptr + 2 * half
    with pytest.raises(IndexError):
        v.block_address(3)


def test_packed_storage_is_one_bounded_storage() -> None:
    cfg = preset("packed", num_blocks=8, num_layers=3)
    raw, kv = allocate_kv_caches(cfg)
    stride = cfg.bytes_per_block
    st = bound_packed_storage(kv, 5, cfg)
    assert st.nbytes() == 5 * stride and st.data_ptr() == raw[0].data_ptr()
    out = narrow_kv_caches_to_num_blocks(kv, 5, cfg)
    ptrs = {t.untyped_storage().data_ptr() for t in out.values()}
    sizes = {t.untyped_storage().nbytes() for t in out.values()}
    assert ptrs == {raw[0].data_ptr()} and sizes == {5 * stride}
    # NIXL's packed math, done on the bounded storage, now gives the right stride
    any_view = next(iter(out.values()))
    assert any_view.untyped_storage().nbytes() // 5 == stride
    (region,) = committed_regions(kv, 5, cfg)
    assert (region.part, region.block_len, region.block_stride) == ("packed", stride, stride)
    assert region.layers == tuple(cfg.layer_names)
    with pytest.raises(LayoutError, match="needs a block-outer layout"):
        bound_packed_storage(*allocate_kv_caches(_one_layer("blocks_first"))[1:], 2,
                             _one_layer("blocks_first"))


def test_packed_layer_pages_sit_side_by_side_in_each_row() -> None:
    cfg = preset("packed", num_blocks=4, num_layers=2, num_kv_heads=1, head_size=8,
                 dtype=torch.float32)
    raw, kv = allocate_kv_caches(cfg)
    page = 2 * 16 * 1 * 8 * 4
    l0, l1 = (kv[n] for n in cfg.layer_names)
    assert l1.data_ptr() - l0.data_ptr() == page
    assert l0.stride(1) * 4 == 2 * page  # one row per block holds both layers
    l1[1, 2].fill_(7.0)  # V of block 2 of layer 1
    row = raw[0].view(4, 2 * page)[2]
    assert torch.equal(row[page + page // 2:].view(torch.float32),
                       torch.full((16 * 8,), 7.0))
    assert int(row[:page + page // 2].count_nonzero()) == 0


def test_mamba_state_regions_sum_states() -> None:
    cfg = preset("jamba-hybrid-like", num_blocks=4, num_layers=2, attn_period=2,
                 mamba_shapes=((16, 3), (16, 8)))
    _, kv = allocate_kv_caches(cfg)
    regions = {r.layer_name: r for r in committed_regions(kv, 2, cfg)}
    m = regions["model.layers.0.mamba"]
    assert m.part == "state"
    assert m.block_len == 16 * 3 * 2 + 16 * 8 * 4
    assert m.block_stride == cfg.bytes_per_block
    a = regions["model.layers.1.self_attn.attn"]
    assert a.part == "kv" and a.base_ptr == m.base_ptr  # shared_by: the pages alias


@pytest.mark.parametrize("bad, match", [
    (lambda kv: {**kv, NAME: kv[NAME].float()}, "dtype"),
    (lambda kv: {**kv, NAME: kv[NAME][:, :, :8]}, "shape"),
    (lambda kv: {}, "missing layers"),
    (lambda kv: {**kv, "extra": kv[NAME]}, "not in the config"),
    (lambda kv: {**kv, NAME: kv[NAME].transpose(2, 3).contiguous().transpose(2, 3)},
     "strides"),
    (lambda kv: {**kv, NAME: kv[NAME].narrow(1, 0, 2)}, "fewer than num_blocks"),
])
def test_tensors_that_do_not_match_the_config_are_rejected(bad, match) -> None:
    cfg = _one_layer("kv_split_nhd")
    _, kv = allocate_kv_caches(cfg)
    with pytest.raises(LayoutError, match=match):
        narrow_kv_caches_to_num_blocks(bad(kv), 3, cfg)
    with pytest.raises(LayoutError, match=match):
        committed_regions(bad(kv), 3, cfg)


def test_config_is_required_and_num_blocks_positive() -> None:
    cfg = _one_layer("kv_split_nhd")
    _, kv = allocate_kv_caches(cfg)
    with pytest.raises(TypeError):
        narrow_kv_caches_to_num_blocks(kv, 3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="KVCacheConfig"):
        narrow_kv_caches_to_num_blocks(kv, 3, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        narrow_kv_caches_to_num_blocks(kv, 0, cfg)


def test_layers_sharing_a_tensor_must_start_at_the_same_address() -> None:
    cfg = preset("jamba-hybrid-like", num_blocks=4, num_layers=2, attn_period=2,
                 mamba_shapes=((16, 3), (16, 8)))
    _, kv = allocate_kv_caches(cfg)
    _, other = allocate_kv_caches(cfg)
    kv["model.layers.0.mamba"] = other["model.layers.0.mamba"]
    with pytest.raises(LayoutError, match="different addresses"):
        committed_regions(kv, 2, cfg)


def test_extensible_views_are_bounded_to_committed_memory() -> None:
    cfg = preset("llama3-8b-like", num_blocks=16, num_layers=2)
    with ExtensibleKVCache(cfg, capacity_blocks=4096) as cache:
        cache.allocate()
        cache.extend_kv_cache(10)
        full = cache.kv_caches()
        seg_cap = cache.tensors[0].segment_capacity
        # (ints first: an assertion message must never repr memory past the committed prefix)
        full_bytes = full[NAME].untyped_storage().nbytes()
        assert full_bytes == 2 * seg_cap  # the whole reservation
        out = cache.narrowed_kv_caches()[NAME]
        half = 32 * 1024
        assert out.shape[1] == 10
        out_bytes = out.untyped_storage().nbytes()
        assert out_bytes == seg_cap + 10 * half  # K prefix .. V prefix, gap included
        k_ptr, v_ptr = out[0].data_ptr(), out[1].data_ptr()
        assert k_ptr == cache.tensors[0].base_ptr
        assert v_ptr == cache.tensors[0].segment_base(1)
        for t in cache.narrowed_kv_caches().values():
            t.fill_(1)  # every element is in committed memory (the host backend would fault)
        for r in cache.committed_regions():
            vals = cache.region_view(r).view(torch.bfloat16)
            assert vals.numel() * 2 == r.nbytes and bool((vals == 1).all())


def test_regions_read_through_raw_pointers_never_fault() -> None:
    cfg = preset("deepseek-mla-like", num_blocks=16, num_layers=2)
    with ExtensibleKVCache(cfg, capacity_blocks=1024) as cache:
        cache.allocate()
        cache.extend_kv_cache(7)
        for r in cache.committed_regions():
            data = ctypes.string_at(r.base_ptr, r.span)  # faults if outside committed memory
            assert len(data) == r.span == 7 * r.block_len
        page = cache.plan.tensors[0].bytes_per_block
        bogus = CommittedRegion(NAME, "latent", cache.tensors[0].base_ptr, page, page, 8, "cpu")
        with pytest.raises(ValueError, match="outside its committed"):
            cache.region_view(bogus)
