"""ExtensibleKVCache: commit protocol, capacity, failures, sleep/wake, plain-geometry parity."""

from __future__ import annotations

import pytest
import torch

from kvconnect.kv_cache import ExtensibleKVCache, KVCacheStateError, capacity_step_blocks
from kvconnect.layout import LAYOUTS, LayoutError, allocate_kv_caches, plan_layout, preset
from kvconnect.views import committed_regions
from kvconnect.vmm.base import DEFAULT_OPTIONS, AllocationOptions, VmmError
from kvconnect.vmm.host import HostVmmDriver

MIB = 1024 * 1024


class OomInjectingHostDriver(HostVmmDriver):
    """The real host driver whose ``create`` fails ONCE after ``fail_after`` more allocations
    (models cuMemCreate returning CUDA_ERROR_OUT_OF_MEMORY); counts live reservations and
    handles. ``fail_always`` keeps failing after the first failure."""

    def __init__(self) -> None:
        super().__init__(0)
        self.fail_after: int | None = None
        self.fail_always = False
        self.live_reservations = 0
        self.live_handles = 0

    def create(self, size, device=None, options=DEFAULT_OPTIONS):
        if self.fail_after is not None:
            if self.fail_after == 0:
                if not self.fail_always:
                    self.fail_after = None
                raise VmmError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", "injected")
            self.fail_after -= 1
        h = super().create(size, device, options)
        self.live_handles += 1
        return h

    def release(self, handle):
        if not handle.released:
            self.live_handles -= 1
        super().release(handle)

    def reserve(self, size, alignment=0):
        va = super().reserve(size, alignment)
        self.live_reservations += 1
        return va

    def free_reserved(self, va, size):
        super().free_reserved(va, size)
        self.live_reservations -= 1


def _small(name: str = "llama3-8b-like", **kw):
    kw.setdefault("num_layers", 2)
    return preset(name, num_blocks=kw.pop("num_blocks", 16), **kw)


def test_commit_protocol(vmm_device: str) -> None:
    cfg = _small()
    assert ExtensibleKVCache(cfg, vmm_device).capacity_blocks == 4 * 16
    with ExtensibleKVCache(cfg, vmm_device, capacity_blocks=1000,
                           options=AllocationOptions(shareable=True)) as cache:
        assert cache.num_blocks == 0 and not cache.tensors
        assert cache.capacity_blocks == 1024  # rounded to 64 blocks: 64 x 32 KiB = 2 MiB
        cache.allocate()
        assert cache.num_blocks == 1
        assert cache.bytes_per_block == 2 * 64 * 1024
        assert [len(t.committed_bytes) for t in cache.tensors] == [2, 2]
        ptrs = {n: t.data_ptr() for n, t in cache.kv_caches().items()}
        cache.ensure_kv_cache_blocks(70)  # > one 2 MiB granule per segment: a second chunk
        cache.ensure_kv_cache_blocks(5)  # grow-only: a no-op
        assert cache.num_blocks == 70
        assert cache.num_physical_chunks == 2 * 2 * 2
        cache.extend_kv_cache(100)
        assert cache.is_final and cache.num_blocks == 100
        assert cache.num_physical_chunks == 4  # one physical allocation per segment
        assert {n: t.data_ptr() for n, t in cache.kv_caches().items()} == ptrs
        assert cache.committed_bytes == 4 * 4 * MIB  # 100 x 32 KiB -> 2 granules per segment
        regions = cache.committed_regions()
        assert len(regions) == 4 and all(r.num_blocks == 100 for r in regions)
        cache.extend_kv_cache(100)  # idempotent at the final size
        with pytest.raises(KVCacheStateError, match="final"):
            cache.ensure_kv_cache_blocks(101)
        with pytest.raises(KVCacheStateError, match="already final"):
            cache.extend_kv_cache(120)
    assert all(t.is_closed for t in cache.tensors) and cache.is_closed
    cache.close()  # idempotent


def test_extend_without_single_handle_keeps_chunks() -> None:
    with ExtensibleKVCache(_small(num_layers=1), capacity_blocks=256) as cache:
        cache.allocate()
        cache.ensure_kv_cache_blocks(70)
        cache.extend_kv_cache(130, single_handle=False)
        assert cache.num_physical_chunks == 2 * 3


def test_capacity_rounding_keeps_segments_granule_multiples() -> None:
    cfg = _small("deepseek-mla-like")  # 72 KiB pages: 2 MiB / gcd(2 MiB, 72 KiB) = 256 blocks
    plan = plan_layout(cfg)
    assert capacity_step_blocks(plan, 2 * MIB) == 256
    cache = ExtensibleKVCache(cfg, capacity_blocks=300)
    assert cache.capacity_blocks == 512
    default = ExtensibleKVCache(cfg)
    assert default.capacity_blocks == 256  # 4 x 16 rounded up
    jamba = ExtensibleKVCache(_small("jamba-hybrid-like", num_layers=4))
    assert (jamba.capacity_blocks * jamba.plan.tensors[0].segment_bytes_per_block) % (2 * MIB) == 0


def test_beyond_capacity_fails_cleanly() -> None:
    with ExtensibleKVCache(_small(), capacity_blocks=64) as cache:
        cache.allocate()
        cache.ensure_kv_cache_blocks(10)
        before = (cache.num_blocks, cache.num_physical_chunks, cache.committed_bytes)
        with pytest.raises(ValueError, match="capacity_blocks=64"):
            cache.extend_kv_cache(65)
        assert (cache.num_blocks, cache.num_physical_chunks, cache.committed_bytes) == before
        assert not cache.is_final
        cache.extend_kv_cache(64)
        assert cache.num_blocks == 64


def test_failed_commit_midway_rolls_back_every_tensor() -> None:
    drv = OomInjectingHostDriver()
    with ExtensibleKVCache(_small(num_layers=3), drv, capacity_blocks=128) as cache:
        cache.allocate()
        before = ([t.committed_bytes for t in cache.tensors], cache.num_physical_chunks,
                  drv.live_handles)
        drv.fail_after = 4  # tensors 0 and 1 grow (2 segments each), tensor 2 fails
        with pytest.raises(VmmError, match="OUT_OF_MEMORY"):
            cache.ensure_kv_cache_blocks(100)
        assert cache.num_blocks == 1
        assert ([t.committed_bytes for t in cache.tensors], cache.num_physical_chunks,
                drv.live_handles) == before
        drv.fail_after = None
        cache.extend_kv_cache(100)
        assert cache.num_blocks == 100
    assert drv.live_handles == 0 and drv.live_reservations == 0


def test_failed_single_handle_recommit_restores_the_warmup_state() -> None:
    drv = OomInjectingHostDriver()
    with ExtensibleKVCache(_small(num_layers=1), drv, capacity_blocks=256) as cache:
        cache.allocate()
        cache.ensure_kv_cache_blocks(70)  # 2 chunks per segment
        assert cache.num_physical_chunks == 4
        drv.fail_after = 1  # segment 0 recommits as one chunk, segment 1 fails
        with pytest.raises(VmmError):
            cache.extend_kv_cache(100)
        assert cache.num_blocks == 70 and not cache.is_final
        assert cache.committed_bytes == 2 * 4 * MIB
        for r in cache.committed_regions():  # every block is mapped again
            assert cache.region_view(r).numel() == r.span
        drv.fail_after = None
        cache.extend_kv_cache(100)
        assert cache.is_final and cache.num_physical_chunks == 2
    assert drv.live_handles == 0


def test_failed_extend_that_cannot_be_restored_leaves_the_cache_released() -> None:
    drv = OomInjectingHostDriver()
    with ExtensibleKVCache(_small(num_layers=1), drv, capacity_blocks=256) as cache:
        cache.allocate()
        cache.ensure_kv_cache_blocks(70)
        drv.fail_after, drv.fail_always = 1, True
        with pytest.raises(VmmError):
            cache.extend_kv_cache(100)
        assert cache.is_released and not cache.is_final and drv.live_handles == 0
        with pytest.raises(KVCacheStateError, match="recommit"):
            cache.committed_regions()
        drv.fail_after, drv.fail_always = None, False
        cache.recommit()
        cache.extend_kv_cache(100)
        assert cache.is_final and cache.num_blocks == 100 and cache.num_physical_chunks == 2


def test_failed_allocate_frees_every_reservation() -> None:
    drv = OomInjectingHostDriver()
    drv.fail_after = 2
    cache = ExtensibleKVCache(_small(num_layers=3), drv)
    with pytest.raises(VmmError):
        cache.allocate()
    assert drv.live_reservations == 0 and drv.live_handles == 0
    assert not cache.tensors
    with pytest.raises(KVCacheStateError, match="allocate"):
        cache.kv_caches()


@pytest.mark.parametrize("fail_after", [0, 1, 2, 3])
def test_failed_wake_stays_released_and_can_be_retried(fail_after: int) -> None:
    drv = OomInjectingHostDriver()
    with ExtensibleKVCache(_small(num_layers=2), drv, capacity_blocks=128) as cache:
        cache.allocate()
        cache.extend_kv_cache(100)
        regions = cache.committed_regions()
        cache.release_physical()
        drv.fail_after = fail_after
        with pytest.raises(VmmError):
            cache.recommit()
        assert cache.is_released and drv.live_handles == 0
        assert cache.num_physical_chunks == 0
        drv.fail_after = None
        cache.recommit()
        assert cache.num_blocks == 100 and cache.num_physical_chunks == 4
        assert cache.committed_regions() == regions
        for r in regions:
            assert int(cache.region_view(r).count_nonzero()) == 0


def test_state_errors() -> None:
    cache = ExtensibleKVCache(_small())
    with pytest.raises(KVCacheStateError, match="allocate"):
        cache.ensure_kv_cache_blocks(2)
    cache.allocate()
    with pytest.raises(KVCacheStateError, match="twice"):
        cache.allocate()
    with pytest.raises(ValueError, match="positive"):
        cache.ensure_kv_cache_blocks(0)
    cache.ensure_kv_cache_blocks(4)
    with pytest.raises(ValueError, match="never shrinks"):
        cache.extend_kv_cache(3)
    cache.close()
    with pytest.raises(KVCacheStateError, match="closed"):
        cache.kv_caches()
    with pytest.raises(KVCacheStateError, match="after close"):
        cache.allocate()
    with pytest.raises(ValueError, match="capacity_blocks"):
        ExtensibleKVCache(_small(), capacity_blocks=0)


def test_config_that_cannot_be_backed_is_rejected_before_reserving() -> None:
    cfg = _small()
    t = cfg.kv_cache_tensors[0]
    bad = type(cfg)(cfg.num_blocks, (type(t)(t.size + cfg.num_blocks * 2, t.layers),)
                    + cfg.kv_cache_tensors[1:], cfg.kv_cache_groups)
    with pytest.raises(LayoutError, match="does not match"):
        ExtensibleKVCache(bad)


def test_sleep_and_wake(vmm_device: str) -> None:
    with ExtensibleKVCache(_small("qwen-small-like"), vmm_device) as cache:
        cache.allocate()
        cache.extend_kv_cache(40)
        narrowed = cache.narrowed_kv_caches()
        for t in narrowed.values():
            t.fill_(3)
        regions = cache.committed_regions()
        cache.release_physical()
        cache.release_physical()  # idempotent
        assert cache.committed_bytes == 0 and cache.num_physical_chunks == 0
        with pytest.raises(KVCacheStateError, match="recommit"):
            cache.committed_regions()
        with pytest.raises(KVCacheStateError, match="recommit"):
            cache.ensure_kv_cache_blocks(41)
        cache.recommit()
        assert cache.num_blocks == 40
        assert cache.num_physical_chunks == sum(t.num_segments for t in cache.tensors)
        again = cache.committed_regions()
        assert again == regions  # same addresses; connectors must still re-register
        for r in again:
            assert int(cache.region_view(r).count_nonzero()) == 0  # zeroed pages
        with pytest.raises(KVCacheStateError, match="without release"):
            cache.recommit()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_committed_equals_capacity_matches_plain_allocation(layout: str) -> None:
    # vLLM splits blocks into kernel blocks only where a block is one dense page
    kbs = None if layout in ("LHBNC", "BLHNC", "BLNHC", "BHLNC") else 8
    cfg = preset("qwen-small-like", num_blocks=8, num_layers=2, layout=layout,
                 kernel_block_size=kbs)
    with ExtensibleKVCache(cfg, capacity_blocks=8) as cache:
        cap = cache.capacity_blocks
        cache.allocate()
        cache.extend_kv_cache(cap)
        raw, plain = allocate_kv_caches(cfg, num_blocks=cap)
        ext = cache.kv_caches()
        narrowed = cache.narrowed_kv_caches()
        for n, t in plain.items():
            for view in (ext[n], narrowed[n]):
                assert view.shape == t.shape and view.stride() == t.stride()
                assert view.data_ptr() - _base(cache, n) == (
                    t.data_ptr() - raw[cache.plan.layers[n].tensor_index].data_ptr())
        plain_regions = committed_regions(plain, cap, cfg)
        ext_regions = cache.committed_regions()
        assert len(plain_regions) == len(ext_regions)
        for p, e in zip(plain_regions, ext_regions, strict=True):
            pbase = raw[p.tensor_index].data_ptr()
            ebase = cache.tensors[e.tensor_index].base_ptr
            assert (p.layer_name, p.part, p.base_ptr - pbase, p.block_len, p.block_stride,
                    p.num_blocks, p.segment) == (e.layer_name, e.part, e.base_ptr - ebase,
                                                 e.block_len, e.block_stride, e.num_blocks,
                                                 e.segment)


def _base(cache: ExtensibleKVCache, layer: str) -> int:
    return cache.tensors[cache.plan.layers[layer].tensor_index].base_ptr


def test_default_presets_allocate_small_on_host() -> None:
    for name in ("llama3-8b-like", "deepseek-mla-like", "jamba-hybrid-like", "packed"):
        with ExtensibleKVCache(preset(name, num_blocks=4, num_layers=4)) as cache:
            cache.allocate()
            cache.extend_kv_cache(4)
            assert cache.committed_bytes <= 16 * MIB
            got = torch.zeros(1)
            for r in cache.committed_regions():
                got += cache.region_view(r).sum()
            assert float(got) == 0.0


def test_close_refuses_while_handed_out_views_are_referenced() -> None:
    from kvconnect import LiveViewsError

    cache = ExtensibleKVCache(_small(), capacity_blocks=64)
    cache.allocate()
    cache.extend_kv_cache(8)
    kv = cache.kv_caches()
    region = cache.region_view(cache.committed_regions()[0])
    with pytest.raises(LiveViewsError) as err:
        cache.close()
    assert err.value.live_views >= 2 and not cache.is_closed
    assert cache.kv_caches().keys() == kv.keys()  # still usable after a refusal
    del kv
    with pytest.raises(LiveViewsError) as err:
        cache.close()
    assert err.value.live_views == 1
    del region
    cache.close()  # the cache's own views do not count
    assert cache.is_closed and all(t.is_closed for t in cache.tensors)


def test_forced_close_and_with_block_release_under_live_views() -> None:
    with ExtensibleKVCache(_small(), capacity_blocks=64) as cache:
        cache.allocate()
        kv = cache.kv_caches()
    assert cache.is_closed and cache.num_physical_chunks == 0
    assert all(t.live_views == 1 for t in cache.tensors)  # kv keeps the addresses reserved
    del kv
    assert all(t.live_views == 0 for t in cache.tensors)


def test_a_32_layer_cache_probes_once_and_shares_one_driver(monkeypatch) -> None:
    """One driver per device: 32 layers build one driver with one probe reservation (it was
    33 drivers and 65 reservations), and every tensor reserves once."""
    import kvconnect.vmm as vmm
    from kvconnect.vmm import host

    monkeypatch.setattr(vmm, "_DRIVERS", {})
    built: list[HostVmmDriver] = []
    reserves: list[int] = []

    class CountingHostVmmDriver(host.HostVmmDriver):
        def __init__(self, device_index: int = 0) -> None:
            super().__init__(device_index)
            built.append(self)

        def reserve(self, size, alignment=0):
            reserves.append(size)
            return super().reserve(size, alignment)

    monkeypatch.setattr(host, "HostVmmDriver", CountingHostVmmDriver)
    cfg = _small(num_layers=32)
    with ExtensibleKVCache(cfg, "cpu", capacity_blocks=64) as cache:
        cache.allocate()
        cache.extend_kv_cache(16)
        assert len(cache.tensors) == 32
        assert {id(t.driver) for t in cache.tensors} == {id(built[0])}
    again = ExtensibleKVCache(cfg, "cpu")  # a second cache on the device: no new probe
    assert len(built) == 1
    assert len(reserves) == 1 + 32  # the probe's, then one per tensor
    assert again.granule == cache.granule
