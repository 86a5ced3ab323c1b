"""CPU offload connector on committed extents: cold vs reload, slots, eviction, the guard.

Every test uses a real ExtensibleKVCache on the host VMM backend (mmap reservation, memfd
commits: touching uncommitted memory SIGSEGVs) with capacity far above the committed blocks;
tests taking ``vmm_device`` also run on CUDA where a VMM-capable GPU exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvconnect.connectors.copy.block_copy import block_runs
from kvconnect.connectors.copy.ops import word_size
from kvconnect.connectors.errors import KVConnectorError
from kvconnect.connectors.offload.connector import (
    CPUOffloadConnector,
    OffloadKeyError,
    offload_row_layout,
)
from kvconnect.connectors.offload.slots import LruSlots
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import allocate_kv_caches, preset
from kvconnect.peer_layout import PeerLayout
from kvconnect.views import CommittedRegion

NUM_BLOCKS = 16
CAPACITY = 1024  # blocks reserved: 64x the committed count

#: (id, preset, overrides): every physical layout the cache supports
LAYOUTS = [
    ("kv_split_nhd", "llama3-8b-like", {"num_layers": 3}),
    ("kv_split_hnd", "llama3-8b-like", {"num_layers": 3, "layout": "kv_split_hnd"}),
    ("blocks_first", "qwen-small-like", {"num_layers": 3, "layout": "blocks_first"}),
    ("blocks_first_hnd", "qwen-small-like", {"num_layers": 3, "layout": "blocks_first_hnd"}),
    ("kernel_split", "qwen-small-like", {"num_layers": 3, "block_size": 32,
                                         "kernel_block_size": 16}),
    ("mla", "deepseek-mla-like", {"num_layers": 3}),
    ("mamba_hybrid", "jamba-hybrid-like", {"num_layers": 8, "attn_period": 4}),
    ("packed", "packed", {"num_layers": 3}),
]
LAYOUT_IDS = [x[0] for x in LAYOUTS]


# -- helpers -------------------------------------------------------------------------------
def make_cache(name: str, overrides: dict, device: str = "cpu", num_blocks: int = NUM_BLOCKS,
               capacity: int | None = CAPACITY) -> ExtensibleKVCache:
    cfg = preset(name, num_blocks=num_blocks, **overrides)
    cache = ExtensibleKVCache(cfg, device, capacity_blocks=capacity)
    cache.allocate()
    cache.ensure_kv_cache_blocks(2)
    cache.extend_kv_cache(num_blocks)
    return cache


def fill(cache: ExtensibleKVCache, seed: int) -> None:
    """Position-dependent pseudo-random bytes over every committed byte: a multiplicative
    hash of (seed, tensor, segment, 8-byte word index), so every block, layer and K/V half
    differs and a block landing at the wrong place is caught."""
    per_segment = iter(cache.segment_bytes_per_block)
    for ti, t in enumerate(cache.tensors):
        for s in range(t.num_segments):
            used = cache.num_blocks * next(per_segment)  # the logical committed prefix
            words = t.segment_view(s)[:used].view(torch.int64)
            h = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
            h += (seed << 48) + (ti << 36) + (s << 32)
            h *= -7046029254386353131  # 0x9E3779B97F4A7C15 as int64 (wraps)
            h ^= h >> 29
            words.copy_(h)


def layer_blocks(cache: ExtensibleKVCache, block: int) -> dict[tuple[str, int], torch.Tensor]:
    """Block ``block`` of every layer, read through the MODEL-shaped tensors (kv_caches(),
    narrowed along each view's block dimension): independent of the regions under test."""
    out = {}
    kv = cache.narrowed_kv_caches()  # bounded: ops that copy whole inputs stay in bounds
    for name, lp in cache.plan.layers.items():
        tensors = kv[name] if lp.is_list else [kv[name]]
        for i, (t, g) in enumerate(zip(tensors, lp.views, strict=True)):
            k = g.blocks_per_block
            page = t.narrow(g.block_dim, block * k, k).cpu()
            # a contiguous copy, compared as bytes (random bytes hold NaN bit patterns)
            out[(name, i)] = page.clone(memory_format=torch.contiguous_format).view(torch.uint8)
    return out


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs"


def all_bytes(cache: ExtensibleKVCache) -> list[torch.Tensor]:
    """A copy of every segment's committed prefix."""
    return [t.segment_view(s).cpu().clone() for t in cache.tensors
            for s in range(t.num_segments)]


# -- copy_ops on plain tensors ---------------------------------------------------------------
def test_word_size_is_the_widest_dividing_word() -> None:
    assert word_size(64, 24, 0x1000) == 8
    assert word_size(64, 12) == 4
    assert word_size(64, 6) == 2
    assert word_size(64, 3) == 1


def _region(name: str, part: str, base: int, blen: int, stride: int, n: int,
            tensor: int = 0, segment: int = 0) -> CommittedRegion:
    return CommittedRegion(name, part, base, blen, stride, n, "cpu", tensor, segment)


def test_row_layout_stores_shared_pages_once_and_rejects_bad_regions() -> None:
    regions = [
        _region("attn", "kv", 0x10000, 4096, 4096, 8),
        _region("mamba", "state", 0x10000, 3000, 4096, 8),  # aliases attn's pages
        _region("attn2", "kv", 0x90000, 1024, 1024, 16, tensor=1),  # kernel split: 2 per block
    ]
    slices = offload_row_layout(PeerLayout.from_regions(regions, 8))
    assert [s.members for s in slices] == [("attn/kv", "mamba/state"), ("attn2/kv",)]
    assert [(s.column, s.width, s.region.sub_blocks) for s in slices] == [(0, 4096, 1), (4096, 2048, 2)]
    assert [s.index for s in slices] == [0, 2] and regions[slices[0].index].block_len == 4096
    with pytest.raises(ValueError, match="not a multiple"):
        PeerLayout.from_regions([_region("x", "kv", 0, 64, 64, 9)], 8)
    with pytest.raises(ValueError, match="share bytes"):
        PeerLayout.from_regions([_region("x", "kv", 0, 64, 64, 8),
                                 _region("y", "kv", 32, 64, 128, 8)], 8)
    with pytest.raises(ValueError, match="no committed regions"):
        PeerLayout.from_regions([], 8)
    with pytest.raises(ValueError, match="do not describe disjoint blocks"):
        PeerLayout.from_regions([_region("x", "kv", 0, 64, 32, 8)], 8)


def test_lru_slots_reserve_commit_abandon() -> None:
    slots = LruSlots(4)
    r = slots.reserve(["a", "b", "c"])
    assert r.slots == (0, 1, 2) and r.evicted == () and r.new == ("a", "b", "c")
    assert len(slots) == 0  # nothing recorded before commit
    slots.commit(r)
    r = slots.reserve(["d", "e"])  # one free slot: "a" (least recently used) goes
    assert r.evicted == ("a",) and sorted(r.slots) == [0, 3]
    slots.abandon(r)  # the copy failed: d and e are not in the pool, a stays evicted
    assert slots.keys() == ["b", "c"] and slots.num_free == 2
    slots.touch(["b"])
    r = slots.reserve(["b", "x", "y"])  # b keeps its slot
    assert r.slots[0] == 1 and r.evicted == ()
    slots.commit(r)
    assert slots.keys() == ["c", "b", "x", "y"]
    with pytest.raises(ValueError, match="cannot save 5 blocks"):
        slots.reserve(list("vwxyz"))
    with pytest.raises(ValueError, match="positive"):
        LruSlots(0)
    with pytest.raises(ValueError, match="must be an int"):
        LruSlots(True)


# -- cold vs reload, every layout ------------------------------------------------------------
@pytest.mark.parametrize(("name", "overrides"), [x[1:] for x in LAYOUTS], ids=LAYOUT_IDS)
def test_cold_vs_reload_all_layouts(name: str, overrides: dict, vmm_device: str) -> None:
    with make_cache(name, overrides, vmm_device) as cache:
        assert cache.capacity_blocks >= 64 * cache.num_blocks
        fill(cache, seed=1)
        cold = {b: layer_blocks(cache, b) for b in range(NUM_BLOCKS)}
        saved = [0, 5, 6, 7, 15, 9]
        with CPUOffloadConnector(cache, 8) as conn:
            assert conn.is_pinned == (vmm_device != "cpu")
            # one CPU row = one logical block over every layer, shared pages once
            assert conn.bytes_per_block == cache.bytes_per_block
            assert conn.pool_bytes == 8 * cache.bytes_per_block
            h = conn.save(saved)
            conn.wait(h)
            assert h.done() and h.nbytes == len(saved) * conn.bytes_per_block
            fill(cache, seed=2)  # clobber every committed byte
            clobbered = {b: layer_blocks(cache, b) for b in range(NUM_BLOCKS)}
            for b in saved:  # the clobber really changed the blocks
                assert not torch.equal(clobbered[b][next(iter(clobbered[b]))],
                                       cold[b][next(iter(cold[b]))])
            conn.load(saved).wait()
            for b in range(NUM_BLOCKS):
                want = cold[b] if b in saved else clobbered[b]
                assert_same(layer_blocks(cache, b), want, f"block {b}")
            # load into other blocks: block 3 <- key 15, block 12 <- key 0
            conn.load([3, 12], keys=[15, 0]).wait()
            assert_same(layer_blocks(cache, 3), cold[15], "block 3 <- 15")
            assert_same(layer_blocks(cache, 12), cold[0], "block 12 <- 0")
            assert_same(layer_blocks(cache, 4), clobbered[4], "block 4 untouched")


@pytest.mark.parametrize(("name", "overrides"), [x[1:] for x in LAYOUTS], ids=LAYOUT_IDS)
def test_committed_equals_capacity_is_byte_identical_to_plain_allocation(
        name: str, overrides: dict) -> None:
    if name != "jamba-hybrid-like":
        overrides = {**overrides, "num_layers": 1}  # capacity rounds to whole 2 MiB granules
    with make_cache(name, overrides, num_blocks=8, capacity=8) as probe:
        cap = probe.capacity_blocks  # rounded up to whole granules per segment
    cfg = preset(name, num_blocks=cap, **overrides)
    with ExtensibleKVCache(cfg, "cpu", capacity_blocks=cap) as cache:
        cache.allocate()
        cache.extend_kv_cache(cap)
        assert cache.num_blocks == cache.capacity_blocks
        raw, kv_plain = allocate_kv_caches(cfg, "cpu", num_blocks=cap)
        fill(cache, seed=3)
        ext_segments = all_bytes(cache)
        plain_segments = [chunk for r, t in zip(raw, cache.tensors, strict=True)
                          for chunk in r.view(t.num_segments, -1)]
        for dst, src in zip(plain_segments, ext_segments, strict=True):
            assert dst.numel() == src.numel()
            dst.copy_(src)
        ext = CPUOffloadConnector(cache, 6)
        plain = CPUOffloadConnector.from_kv_caches(kv_plain, cap, cfg, 6)
        try:
            assert [(s.members, s.column, s.width, s.region.block_stride)
                    for s in ext.row_layout] == [
                (s.members, s.column, s.width, s.region.block_stride) for s in plain.row_layout]
            ids = [cap - 1, 0, 2, 3]
            ext.save(ids).wait()
            plain.save(ids).wait()
            for b in ids:
                assert torch.equal(ext.read_cpu_block(b), plain.read_cpu_block(b)), b
            # clobber both the same way, load into permuted blocks: identical memory after
            fill(cache, seed=4)
            for dst, src in zip(plain_segments, all_bytes(cache), strict=True):
                dst.copy_(src)
            ext.load([1, cap - 2, 0, 5], keys=ids).wait()
            plain.load([1, cap - 2, 0, 5], keys=ids).wait()
            for a, b in zip(all_bytes(cache), plain_segments, strict=True):
                assert torch.equal(a, b)
        finally:
            ext.close()
            plain.close()


# -- slot accounting and eviction ------------------------------------------------------------
def test_lru_eviction_and_slot_accounting() -> None:
    with make_cache("qwen-small-like", {"num_layers": 2}) as cache:
        fill(cache, seed=5)
        cold = {b: layer_blocks(cache, b) for b in range(NUM_BLOCKS)}
        conn = CPUOffloadConnector(cache, 4)
        h = conn.save([0, 1, 2, 3])
        assert h.evicted == () and sorted(h.slots) == [0, 1, 2, 3]
        assert conn.num_used_slots == conn.num_cpu_blocks == 4
        h = conn.save([4])  # pool full: key 0 (least recently used) goes
        assert h.evicted == (0,)
        assert not conn.contains(0) and 4 in conn
        assert conn.slot_of(4) == 0  # the evicted slot was reused
        conn.load([9], keys=[1])  # touch key 1: now most recently used
        h = conn.save([5, 6])
        assert h.evicted == (2, 3)
        assert conn.keys() == [4, 1, 5, 6]
        # a batch that re-saves a present key keeps its slot and never evicts its own keys
        slot1 = conn.slot_of(1)
        h = conn.save([1, 7], keys=[1, "hash-7"])
        assert h.evicted == (4,) and conn.slot_of(1) == slot1
        assert h.slots[0] == slot1
        with pytest.raises(OffloadKeyError) as err:
            conn.load([0, 2], keys=[0, 4])
        assert err.value.missing == [0, 4]
        # every surviving key still holds its own block
        fill(cache, seed=6)
        conn.load([10, 11, 12, 13], keys=[1, 5, 6, "hash-7"]).wait()
        for dst, src in zip([10, 11, 12, 13], [1, 5, 6, 7], strict=True):
            assert_same(layer_blocks(cache, dst), cold[src], f"{dst} <- {src}")
        assert conn.discard([5, "nope"]) == [5]
        assert conn.num_used_slots == conn.num_cpu_blocks - 1 and not conn.contains(5)
        with pytest.raises(ValueError, match="cannot save 5 blocks into a CPU pool of 4"):
            conn.save([0, 1, 2, 3, 4])
        conn.close()
        cache_bytes = all_bytes(cache)
        assert cache_bytes  # cache untouched by close()


def test_resave_overwrites_in_place() -> None:
    with make_cache("llama3-8b-like", {"num_layers": 2}) as cache:
        conn = CPUOffloadConnector(cache, 4)
        fill(cache, seed=7)
        conn.save([3]).wait()
        first = conn.read_cpu_block(3)
        fill(cache, seed=8)
        newer = layer_blocks(cache, 3)
        slot = conn.slot_of(3)
        conn.save([3]).wait()
        assert conn.slot_of(3) == slot
        assert not torch.equal(conn.read_cpu_block(3), first)
        fill(cache, seed=9)
        conn.load([3]).wait()
        assert_same(layer_blocks(cache, 3), newer, "re-saved block")
        conn.close()


def test_non_contiguous_blocks_and_scattered_slots(vmm_device: str) -> None:
    with make_cache("llama3-8b-like", {"num_layers": 2}, vmm_device) as cache:
        fill(cache, seed=10)
        cold = {b: layer_blocks(cache, b) for b in range(NUM_BLOCKS)}
        # max_copy_runs=1 sends scattered batches on CUDA through the pinned-pool gather
        conn = CPUOffloadConnector(cache, 8, max_copy_runs=1)
        conn.save(list(range(8))).wait()
        conn.discard([1, 3, 4, 6])  # free slots 1, 3, 4, 6: scattered
        ids = [13, 2, 11, 9]
        h = conn.save(ids, keys=["a", "b", "c", "d"])
        assert sorted(h.slots) == [1, 3, 4, 6]
        assert len(block_runs(range(4), sorted(h.slots))) == 3
        fill(cache, seed=11)
        clobbered = {b: layer_blocks(cache, b) for b in range(NUM_BLOCKS)}
        # load scattered slots into non-contiguous, unordered blocks
        h = conn.load(torch.tensor([14, 0, 7, 5, 3]), keys=["d", 7, "a", "c", 0])
        h.wait(timeout_s=30)
        for dst, src in [(14, 9), (0, 7), (7, 13), (5, 11), (3, 0)]:
            assert_same(layer_blocks(cache, dst), cold[src], f"{dst} <- {src}")
        for b in (1, 2, 4, 6, 8, 15):
            assert_same(layer_blocks(cache, b), clobbered[b], f"block {b} untouched")
        conn.close()


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_copies_are_batched_not_per_block(scattered: bool, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """The number of data-moving calls per save/load does not grow with the number of
    blocks: on the host backend one row-gather copy per call (the plan's ``host`` method) and
    no torch data op at all, never one copy per block per layer."""
    import kvconnect.connectors.copy._host_block_copy as hb
    from kvconnect.connectors.copy._host_block_copy import HostRowCopier

    calls: list[str] = []

    def counting(name: str, fn):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch, "index_select", counting("index_select", torch.index_select))
    for meth in ("index_select", "index_copy_", "copy_", "index_put_", "__setitem__"):
        monkeypatch.setattr(torch.Tensor, meth, counting(meth, getattr(torch.Tensor, meth)))
    monkeypatch.setattr(HostRowCopier, "copy", counting("host", HostRowCopier.copy))
    # the memmove engine whatever the core count (the torch-rows engine is two torch ops
    # per copy; tests/test_block_copy.py covers it)
    monkeypatch.setattr(hb, "TORCH_ROWS_MIN_THREADS", 1 << 30)
    with make_cache("qwen-small-like", {"num_layers": 4}, num_blocks=64) as cache:
        fill(cache, seed=12)
        counts = []
        for n in (4, 48):
            conn = CPUOffloadConnector(cache, 64)
            assert conn.copy_plan.method == "host"
            if scattered:  # make every other slot the only free ones
                conn.save(list(range(64))).wait()
                conn.discard(list(range(0, 64, 2)))
            ids = list(range(64 - n, 64)) if not scattered else list(range(n, 0, -1))
            keys = [f"k{i}" for i in ids]
            calls.clear()
            conn.save(ids, keys=keys)
            conn.load(ids, keys=keys)
            counts.append(list(calls))
            conn.close()
        assert counts[0] == counts[1] == ["host", "host"], counts


@pytest.mark.gpu
@pytest.mark.parametrize("bound", ["staging", "chunk"])
@pytest.mark.parametrize("path", ["direct", "staged"])
def test_cuda_paths_are_byte_exact_and_leave_the_pinned_cache_alone(
        path: str, bound: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CUDA paths (one kernel over the pinned pool; kernel gather + one copy-engine copy
    per slot run through two small staging buffers, so batches move in several chunks) move
    the right bytes, and close() never empties the process's pinned-memory cache."""
    emptied: list[int] = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(1), raising=False)
    with make_cache("llama3-8b-like", {"num_layers": 2}, "cuda:0", num_blocks=64) as cache:
        fill(cache, seed=21)
        cold = {b: layer_blocks(cache, b) for b in range(64)}
        small = ({"max_staging_bytes": 6 * cache.bytes_per_block} if bound == "staging"
                 else {"staging_chunk_bytes": 2 * cache.bytes_per_block})
        conn = CPUOffloadConnector(cache, 32, path=path, **small)
        conn.save(list(range(20, 52)), keys=[f"k{b}" for b in range(20, 52)]).wait()
        conn.discard([f"k{b}" for b in range(21, 52, 3)])  # scattered free slots
        h = conn.save([3, 9, 1, 60, 7, 8, 12, 13, 14, 15, 16], keys=list("abcdefghijk"))
        assert conn.path_for(h.slots) == path
        h.wait(timeout_s=30)
        fill(cache, seed=22)
        dst = [0, 2, 4, 6, 10, 11, 17, 18, 19, 62, 63]
        conn.load(dst, keys=list("abcdefghijk")).wait(timeout_s=30)
        for d, src in zip(dst, [3, 9, 1, 60, 7, 8, 12, 13, 14, 15, 16], strict=True):
            assert_same(layer_blocks(cache, d), cold[src], f"{d} <- {src}")
        conn.load([5], keys=["k20"]).wait(timeout_s=30)
        assert_same(layer_blocks(cache, 5), cold[20], "5 <- k20")
        conn.close()
    assert emptied == []


# -- bad input, lifetime, sleep / wake -----------------------------------------------------
def test_bad_input_raises_clear_errors() -> None:
    with make_cache("qwen-small-like", {"num_layers": 2}) as cache:
        conn = CPUOffloadConnector(cache, 4)
        with pytest.raises(ValueError, match=r"outside the 16 committed blocks .*capacity"):
            conn.save([NUM_BLOCKS])
        with pytest.raises(ValueError, match="outside the 16 committed"):
            conn.load([-1])
        with pytest.raises(TypeError, match="must hold ints"):
            conn.save([1.0])
        with pytest.raises(TypeError, match="bool"):
            conn.save([True])
        with pytest.raises(ValueError, match="same key twice"):
            conn.save([1, 2], keys=["x", "x"])
        with pytest.raises(ValueError, match="2 keys for 3 block ids"):
            conn.save([1, 2, 3], keys=["x", "y"])
        with pytest.raises(TypeError, match="hashable"):
            conn.save([1], keys=[["unhashable"]])
        conn.save([1, 2]).wait()
        with pytest.raises(ValueError, match="same destination block id twice"):
            conn.load([5, 5], keys=[1, 2])
        assert conn.num_used_slots == 2  # failed calls changed nothing
        with pytest.raises(ValueError, match="positive"):
            CPUOffloadConnector(cache, 0)
        with pytest.raises(TypeError, match="ExtensibleKVCache"):
            CPUOffloadConnector(object(), 4)
        if not torch.cuda.is_available():
            with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
                CPUOffloadConnector(cache, 4, pin_memory=True)
        h = conn.save([])
        assert h.done() and h.slots == ()
        conn.close()
        conn.close()  # idempotent
        assert conn.is_closed
        with pytest.raises(KVConnectorError, match="after close"):
            conn.save([1])
        conn2 = CPUOffloadConnector(cache, 2)
    with pytest.raises(KVConnectorError, match="cache was closed"):
        conn2.save([0])
    conn2.close()


def test_sleep_wake_keeps_pool_and_rebinds_on_growth(vmm_device: str) -> None:
    cfg = preset("llama3-8b-like", num_blocks=NUM_BLOCKS, num_layers=2)
    with ExtensibleKVCache(cfg, vmm_device, capacity_blocks=CAPACITY) as cache:
        cache.allocate()
        cache.ensure_kv_cache_blocks(4)  # warm-up prefix only
        conn = CPUOffloadConnector(cache, 8)
        assert conn.num_blocks == 4
        fill(cache, seed=13)
        warm = layer_blocks(cache, 3)
        conn.save([3]).wait()
        with pytest.raises(ValueError, match="outside the 4 committed"):
            conn.save([4])
        cache.extend_kv_cache(NUM_BLOCKS)  # final commit: views re-derived automatically
        conn.load([15], keys=[3]).wait()
        assert conn.num_blocks == NUM_BLOCKS
        assert_same(layer_blocks(cache, 15), warm, "block 15 <- saved 3")
        fill(cache, seed=14)
        before_sleep = layer_blocks(cache, 9)
        conn.save([9]).wait()
        cache.release_physical()
        with pytest.raises(KVConnectorError, match="asleep"):
            conn.save([1])
        with pytest.raises(KVConnectorError, match="asleep"):
            conn.load([9])
        assert conn.contains(9)  # the pool survives sleep
        cache.recommit()  # zeroed pages at the same addresses
        assert int(layer_blocks(cache, 9)[next(iter(before_sleep))].float().abs().sum()) == 0
        conn.load([9]).wait()
        assert_same(layer_blocks(cache, 9), before_sleep, "block 9 after wake")
        conn.close()


# -- THE GUARD: upstream's storage-size geometry faults; ours does not ------------------------
_GUARD_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.connectors.offload.connector import CPUOffloadConnector


    device = sys.argv[2]


    def make(capacity):
        cfg = preset("llama3-8b-like", num_blocks=16, num_layers=2)
        cache = ExtensibleKVCache(cfg, device, capacity_blocks=capacity)
        cache.allocate()
        cache.extend_kv_cache(cache.capacity_blocks if capacity == 16 else 16)
        return cache


    def upstream(cache):
        # vLLM SimpleCPUOffloadWorker: view each storage as (num_blocks, nbytes // num_blocks)
        num_blocks = cache.num_blocks
        layer = next(iter(cache.kv_caches().values()))
        storage = layer.untyped_storage()
        block_bytes = storage.nbytes() // num_blocks
        rows = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        rows = rows.view(num_blocks, block_bytes)
        cpu = torch.empty(block_bytes, dtype=torch.uint8)
        print("storage", storage.nbytes(), "committed", cache.committed_bytes, flush=True)
        cpu.copy_(rows[num_blocks - 1])  # the last row
        if device != "cpu":
            torch.cuda.synchronize()


    def ours(cache):
        conn = CPUOffloadConnector(cache, 4)
        conn.save([cache.num_blocks - 1]).wait()
        conn.load([0], keys=[cache.num_blocks - 1]).wait()
        conn.close()


    capacity = int(sys.argv[1])
    # 1. ours on the over-reserved cache: the last committed block, saved and loaded back
    ours(make(capacity))
    print("OURS COPIED", flush=True)
    # 2. control: with committed == capacity the upstream geometry is harmless
    upstream(make(16))
    print("CONTROL COPIED", flush=True)
    # 3. upstream on the over-reserved cache: reads unmapped VA and dies here
    upstream(make(capacity))
    print("UPSTREAM COPIED", flush=True)
""")


def test_guard_storage_size_geometry_faults_ours_does_not(vmm_device: str) -> None:
    """In one subprocess: our connector copies the last committed block of an over-reserved
    cache; upstream's row geometry is harmless when committed == capacity (so the fault
    below comes from the over-reservation, not from the script); then upstream's geometry on
    the over-reserved cache reads unmapped VA and the process dies (host: SIGSEGV; CUDA: a
    CUDA error)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    proc = subprocess.run([sys.executable, "-c", _GUARD_SCRIPT, str(CAPACITY), vmm_device],
                          capture_output=True, text=True, timeout=300, env=env)
    detail = (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert "OURS COPIED" in proc.stdout, detail
    assert "CONTROL COPIED" in proc.stdout, detail
    assert "UPSTREAM COPIED" not in proc.stdout, detail
    if vmm_device == "cpu":
        assert proc.returncode == -signal.SIGSEGV, detail
    else:
        assert proc.returncode != 0 and "CUDA" in proc.stderr, detail
