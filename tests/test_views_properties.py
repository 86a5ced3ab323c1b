"""Property tests: random layouts, capacity far above the committed count.

The oracle below builds each layout from ordinary torch tensors with explicit shapes and
permutes (not from kvconnect's plan). For every drawn config the extensible cache must give
regions inside committed memory (the host backend faults on anything else, which would
crash the worker), disjoint unless the config aliases pages (hybrid ``shared_by``), adding
up to the committed bytes, and identical in geometry and contents to the oracle.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import (
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    attention_config,
    hybrid_config,
    mla_config,
)
from kvconnect.views import committed_regions, narrow_kv_caches_to_num_blocks

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]


@st.composite
def configs(draw) -> KVCacheConfig:
    kind = draw(st.sampled_from(["attention", "sliding", "mla", "hybrid", "packed",
                                 "packed_mla"]))
    dtype = draw(st.sampled_from(DTYPES))
    num_layers = draw(st.integers(1, 4))
    block_size = draw(st.sampled_from([8, 16, 32, 48]))
    kbs = draw(st.sampled_from([None] + [d for d in (4, 8, 16) if block_size % d == 0]))
    if kind in ("attention", "sliding", "packed"):
        layout = "packed" if kind == "packed" else draw(st.sampled_from(
            ["kv_split_nhd", "kv_split_hnd", "blocks_first", "blocks_first_hnd"]))
        return attention_config(
            num_layers=num_layers, num_kv_heads=draw(st.integers(1, 3)),
            head_size=draw(st.sampled_from([8, 16, 24, 64])), dtype=dtype,
            block_size=block_size, num_blocks=4, layout=layout, kernel_block_size=kbs,
            sliding_window=64 if kind == "sliding" else None, sliding_window_every=2)
    if kind in ("mla", "packed_mla"):
        return mla_config(num_layers=num_layers, kv_lora_rank=draw(st.sampled_from([16, 32])),
                          qk_rope_head_dim=draw(st.sampled_from([8, 16])), dtype=dtype,
                          block_size=block_size, num_blocks=4, kernel_block_size=kbs,
                          layout="packed" if kind == "packed_mla" else "blocks_first")
    conv_c = draw(st.sampled_from([4, 8, 12]))
    return hybrid_config(
        num_layers=draw(st.integers(2, 5)), attn_period=draw(st.integers(2, 4)),
        num_kv_heads=draw(st.integers(1, 2)), head_size=draw(st.sampled_from([8, 16])),
        dtype=draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32])),
        mamba_shapes=((conv_c, 3), (conv_c, draw(st.sampled_from([4, 16])))),
        mamba_dtypes=(draw(st.sampled_from([torch.bfloat16, torch.float32])), torch.float32),
        kernel_block_size=draw(st.sampled_from([None, 8, 16])), num_blocks=4,
        layout=draw(st.sampled_from(["kv_split_nhd", "kv_split_hnd", "blocks_first",
                                     "blocks_first_hnd"])))


# -- the oracle: ordinary tensors, explicit shapes ------------------------------------------
def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _k(cfg: KVCacheConfig, spec) -> int:
    if isinstance(spec, MambaSpec) or cfg.kernel_block_size is None:
        return 1
    return spec.block_size // cfg.kernel_block_size


def oracle(cfg: KVCacheConfig, n: int):
    """(raw uint8 tensors, kv_caches) of an ordinary allocation with ``n`` blocks."""
    specs = cfg.layer_specs()
    hybrid = any(isinstance(s, MambaSpec) for s in specs.values())
    split = cfg.layout in ("kv_split_nhd", "kv_split_hnd")
    hnd = cfg.layout.endswith("hnd")
    kv: dict = {}
    raws = []
    if cfg.layout == "packed":
        (t,) = cfg.kv_cache_tensors
        k = _k(cfg, specs[t.layers[0]])
        row = t.size // cfg.num_blocks // k
        raw = torch.zeros(n * k, row, dtype=torch.uint8)
        off = 0
        for name in t.layers:
            s = specs[name]
            pk = s.page_size_bytes // k
            sl = raw[:, off:off + pk].view(s.dtype)
            kbs = s.block_size // k
            if isinstance(s, MLAAttentionSpec):
                kv[name] = sl.view(n * k, kbs, s.head_size)
            else:
                kv[name] = sl.view(n * k, 2, kbs, s.num_kv_heads, s.head_size).transpose(0, 1)
            off += pk
        return [raw.view(-1)], kv
    for t in cfg.kv_cache_tensors:
        page = t.size // cfg.num_blocks
        raw = torch.zeros(n * page, dtype=torch.uint8)
        raws.append(raw)
        for name in t.layers:
            s = specs[name]
            if isinstance(s, MambaSpec):
                rows = raw.view(n, page)
                off, states = 0, []
                for shape, dt in zip(s.shapes, s.dtypes, strict=True):
                    b = math.prod(shape) * _esize(dt)
                    states.append(rows[:, off:off + b].view(dt).view(n, *shape))
                    off += b
                kv[name] = states
                continue
            k = _k(cfg, s)
            kbs, heads, head = s.block_size // k, s.num_kv_heads, s.head_size
            if isinstance(s, MLAAttentionSpec):
                rows = raw.view(n * k, page // k)[:, :kbs * head * _esize(s.dtype)]
                kv[name] = rows.view(s.dtype).view(n * k, kbs, head)
            elif split and not hybrid:
                flat = raw.view(s.dtype)
                kv[name] = (flat.view(2, n * k, heads, kbs, head).transpose(2, 3) if hnd
                            else flat.view(2, n * k, kbs, heads, head))
            else:
                rows = raw.view(n * k, page // k)[:, :2 * kbs * heads * head * _esize(s.dtype)]
                rows = rows.view(s.dtype)
                x = (rows.view(n * k, 2, heads, kbs, head).transpose(2, 3) if hnd
                     else rows.view(n * k, 2, kbs, heads, head))
                kv[name] = x.transpose(0, 1) if split else x
    return raws, kv


def _extent(t: torch.Tensor) -> tuple[int, int]:
    e = t.element_size()
    return t.data_ptr(), t.data_ptr() + e + sum((s - 1) * st * e
                                                for s, st in zip(t.shape, t.stride(), strict=True))


def _block_dim(cfg: KVCacheConfig, spec) -> int:
    if isinstance(spec, (MambaSpec, MLAAttentionSpec)):
        return 0
    return 1 if cfg.layout in ("kv_split_nhd", "kv_split_hnd", "packed") else 0


def oracle_regions(cfg: KVCacheConfig, kv: dict) -> dict[str, list[tuple]]:
    """Per layer (non-packed): (part, first block's start address, block_len, block_stride)."""
    specs = cfg.layer_specs()
    hybrid = any(isinstance(s, MambaSpec) for s in specs.values())
    page = {name: t.size // cfg.num_blocks for t in cfg.kv_cache_tensors for name in t.layers}
    out: dict[str, list[tuple]] = {}
    for name, v in kv.items():
        s = specs[name]
        if isinstance(v, list):  # Mamba: the states of a block, summed
            ext = [_extent(x.narrow(0, 0, 1)) for x in v]
            start, end = min(a for a, _ in ext), max(b for _, b in ext)
            out[name] = [("state", start, end - start, page[name])]
            continue
        k, bd = _k(cfg, s), _block_dim(cfg, s)
        split = bd == 1 and not hybrid and not isinstance(s, MLAAttentionSpec)
        stride = page[name] // 2 if split else page[name]
        if isinstance(s, MLAAttentionSpec):
            a, b = _extent(v.narrow(0, 0, k))
            out[name] = [("latent", a, b - a, stride)]
        elif split:  # K and V separately
            regs = []
            for part, half in (("k", v[0]), ("v", v[1])):
                a, b = _extent(half.narrow(0, 0, k))
                regs.append((part, a, b - a, stride))
            out[name] = regs
        else:
            a, b = _extent(v.narrow(bd, 0, k))
            out[name] = [("kv", a, b - a, stride)]
    return out


def _fill_random(kv: dict, gen: torch.Generator) -> dict:
    vals = {}
    for name, v in kv.items():
        tensors = v if isinstance(v, list) else [v]
        vals[name] = [torch.randint(0, 100, tuple(x.shape), generator=gen).to(x.dtype)
                      for x in tensors]
    return vals


def _write(kv: dict, vals: dict) -> None:
    for name, v in kv.items():  # layer order: aliasing layers overwrite in the same order
        for x, val in zip(v if isinstance(v, list) else [v], vals[name], strict=True):
            x.copy_(val)


def _fill_segments(cache: ExtensibleKVCache, n: int, gen: torch.Generator
                   ) -> list[list[torch.Tensor]]:
    """Random bytes over every segment's first ``n`` blocks (through the segment views);
    returns them (CPU, per tensor, per segment)."""
    out = []
    for tp, t in zip(cache.plan.tensors, cache.tensors, strict=True):
        used = n * tp.segment_bytes_per_block
        out.append([torch.randint(0, 256, (used,), generator=gen, dtype=torch.uint8)
                    for _ in range(t.num_segments)])
        for s, data in enumerate(out[-1]):
            t.segment_view(s)[:used].copy_(data.to(cache.device))
    return out


# -- the properties -------------------------------------------------------------------------
@SETTINGS
@given(cfg=configs(), n=st.integers(1, 12), warm=st.integers(1, 12),
       over=st.integers(4, 64), seed=st.integers(0, 2**16))
def test_extensible_cache_regions_and_views(vmm_device: str, cfg: KVCacheConfig, n: int,
                                            warm: int, over: int, seed: int) -> None:
    specs = cfg.layer_specs()
    hybrid = any(isinstance(s, MambaSpec) for s in specs.values())
    on_host = vmm_device == "cpu"
    with ExtensibleKVCache(cfg, vmm_device, capacity_blocks=n * over) as cache:
        assert cache.capacity_blocks >= n * over
        cache.allocate()
        cache.ensure_kv_cache_blocks(min(warm, n))
        cache.extend_kv_cache(n)
        regions = cache.committed_regions()
        plan = cache.plan

        # 1. every region lies inside its segment's committed block prefix, and its bytes
        #    (through region_view; on the host also through its raw address) are the bytes
        #    written at its segment offset (an out-of-bounds GPU read would fault)
        written = _fill_segments(cache, n, torch.Generator().manual_seed(seed))
        for r in regions:
            t = cache.tensors[r.tensor_index]
            seg_used = n * plan.tensors[r.tensor_index].segment_bytes_per_block
            assert r.base_ptr == t.segment_base(r.segment) + r.segment_offset
            assert 0 <= r.segment_offset and r.segment_offset + r.span <= seg_used
            assert r.segment_offset + r.span <= t.committed_bytes[r.segment]
            want = written[r.tensor_index][r.segment][r.segment_offset:][:r.span]
            assert torch.equal(cache.region_view(r).cpu(), want), (r.layer_name, r.part)
            if on_host:
                assert ctypes.string_at(r.base_ptr, r.span) == want.numpy().tobytes()

        # 2. regions do not overlap, except layers aliasing one tensor by config (hybrid)
        intervals = sorted((r.base_ptr + b * r.block_stride,
                            r.base_ptr + b * r.block_stride + r.block_len, r.tensor_index,
                            r.layer_name) for r in regions for b in range(n))
        for (_, a1, ti, la), (b0, _, tj, lb) in zip(intervals, intervals[1:], strict=False):
            if a1 > b0:
                assert hybrid and ti == tj and la != lb, (la, lb)

        # 3. lengths add up to the committed bytes of n blocks
        if hybrid:
            for name, s in specs.items():
                got = sum(r.nbytes for r in regions if r.layer_name == name)
                used = (sum(s.state_bytes) if isinstance(s, MambaSpec)
                        else s.real_page_size_bytes)
                assert got == n * used
        else:
            assert sum(r.nbytes for r in regions) == n * cache.bytes_per_block

        # 4. geometry equals an ordinary allocation of the same layout
        raws, okv = oracle(cfg, n)
        expect = oracle_regions(cfg, okv)
        raw_of = {name: i for i, t in enumerate(cfg.kv_cache_tensors) for name in t.layers}
        if cfg.layout == "packed":
            (r,) = regions
            assert (r.part, r.block_len, r.block_stride) == ("packed",) + (
                cfg.bytes_per_block,) * 2
            assert r.layers == tuple(cfg.kv_cache_tensors[0].layers)
        else:
            for name, exp in expect.items():
                got = [r for r in regions if r.layer_name == name]
                base = raws[raw_of[name]].data_ptr()
                seg_len = n * plan.tensors[raw_of[name]].segment_bytes_per_block
                got_t = [(r.part, r.segment_offset, r.block_len, r.block_stride) for r in got]
                exp_t = [(p, (a - base) - (seg_len if p == "v" else 0), ln, sd)
                         for p, a, ln, sd in exp]
                assert got_t == exp_t, name

        # 5. writes through the narrowed views land where the ordinary layout puts them
        narrowed = cache.narrowed_kv_caches()
        vals = _fill_random(okv, torch.Generator().manual_seed(seed))
        _write(okv, vals)
        _write(narrowed, {k: [x.to(cache.device) for x in v] for k, v in vals.items()})
        for tp, raw in zip(plan.tensors, raws, strict=True):
            t = cache.tensors[tp.index]
            seg_len = n * tp.segment_bytes_per_block
            for s in range(tp.num_segments):
                got = t.committed_view(s * t.segment_capacity, seg_len).cpu()
                assert torch.equal(got, raw[s * seg_len:(s + 1) * seg_len])

        # 6. the narrowed storages are bounded to the committed extent
        for name, v in narrowed.items():
            tp = plan.tensors[plan.layers[name].tensor_index]
            seg_cap = cache.tensors[tp.index].segment_capacity
            want = (tp.num_segments - 1) * seg_cap + n * tp.segment_bytes_per_block
            for x in v if isinstance(v, list) else [v]:
                # ints only: a failing assert must not repr a storage spanning the K/V gap
                nbytes, ptr = x.untyped_storage().nbytes(), x.untyped_storage().data_ptr()
                assert (nbytes, ptr) == (want, cache.tensors[tp.index].base_ptr), name


@SETTINGS
@given(cfg=configs(), big=st.integers(2, 10), data=st.data())
def test_plain_narrowing_is_byte_identical_to_narrow(cfg: KVCacheConfig, big: int,
                                                     data) -> None:
    n = data.draw(st.integers(1, big))
    raws, okv = oracle(cfg, big)
    _write(okv, _fill_random(okv, torch.Generator().manual_seed(big)))
    out = narrow_kv_caches_to_num_blocks(okv, n, cfg)
    specs = cfg.layer_specs()
    for name, v in okv.items():
        k = _k(cfg, specs[name])
        for x, y in zip(v if isinstance(v, list) else [v],
                        out[name] if isinstance(v, list) else [out[name]], strict=True):
            bdim = _block_dim(cfg, specs[name])
            ref = x.narrow(bdim, 0, n * k)
            assert (y.data_ptr(), y.shape, y.stride()) == (ref.data_ptr(), ref.shape,
                                                           ref.stride())
            assert torch.equal(y, ref)
    # regions of the plain allocation equal the oracle's, absolute addresses included
    regions = committed_regions(okv, n, cfg)
    if cfg.layout == "packed":
        assert [(r.base_ptr, r.block_len) for r in regions] == [
            (raws[0].data_ptr(), cfg.bytes_per_block)]
        return
    expect = oracle_regions(cfg, okv)
    for name, exp in expect.items():
        got = [(r.part, r.base_ptr, r.block_len, r.block_stride)
               for r in regions if r.layer_name == name]
        assert got == exp, name


@pytest.mark.gpu
def test_properties_on_cuda_smoke() -> None:
    """One config per family on CUDA VMM memory: regions committed, writes match the oracle."""
    for cfg in (attention_config(num_layers=2, num_kv_heads=2, head_size=64, num_blocks=4,
                                 layout="kv_split_hnd", kernel_block_size=8),
                mla_config(num_layers=2, num_blocks=4, layout="packed"),
                hybrid_config(num_layers=4, attn_period=4, num_blocks=4)):
        with ExtensibleKVCache(cfg, "cuda:0", capacity_blocks=512) as cache:
            cache.allocate()
            cache.extend_kv_cache(9)
            raws, okv = oracle(cfg, 9)
            vals = _fill_random(okv, torch.Generator().manual_seed(0))
            _write(okv, vals)
            narrowed = cache.narrowed_kv_caches()
            _write(narrowed, {k: [x.cuda() for x in v] for k, v in vals.items()})
            for tp, raw in zip(cache.plan.tensors, raws, strict=True):
                t = cache.tensors[tp.index]
                seg_len = 9 * tp.segment_bytes_per_block
                for s in range(tp.num_segments):
                    got = t.committed_view(s * t.segment_capacity, seg_len).cpu()
                    assert torch.equal(got, raw[s * seg_len:(s + 1) * seg_len])
            for r in cache.committed_regions():
                assert cache.region_view(r).numel() == r.span
