"""KV sizing: numbers in, blocks out."""

from __future__ import annotations

import warnings

import pytest

from kvconnect.sizing import (
    InsufficientMemoryError,
    blocks_for_kv_cache_memory_bytes,
    blocks_for_utilization,
    committed_bytes_for_blocks,
    measure_non_kv_memory_bytes,
)

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def test_utilization_second_pass_on_an_h200_like_device() -> None:
    # 140 GiB device, 0.9 utilization, 30 GiB weights+activations+graphs after warm-up,
    # Llama-3-8B: 32 layers x 64 KiB = 2 MiB per block
    s = blocks_for_utilization(140 * GIB, 0.9, 30 * GIB, 2 * MIB)
    usable = int(140 * GIB * 0.9)
    assert s.budget_bytes == usable - 30 * GIB
    assert s.num_blocks == (usable - 30 * GIB) // (2 * MIB) == 49152
    assert s.committed_bytes == s.num_blocks * 2 * MIB and s.mode == "utilization"
    # more non-KV memory measured after warm-up -> fewer blocks, one for one
    t = blocks_for_utilization(140 * GIB, 0.9, 30 * GIB + 20 * MIB, 2 * MIB)
    assert t.num_blocks == s.num_blocks - 10


def test_granule_rounding_counts_against_the_budget() -> None:
    # 3 segments of 96 KiB per block: 288 KiB per block
    segs = [96 * KIB] * 3
    budget = 64 * MIB
    plain = blocks_for_kv_cache_memory_bytes(budget, 288 * KIB)
    assert plain.num_blocks == budget // (288 * KIB) == 227
    rounded = blocks_for_kv_cache_memory_bytes(budget, 288 * KIB, segment_bytes_per_block=segs,
                                               granule=2 * MIB)
    # 227 blocks x 96 KiB = 21.28 MiB per segment -> 22 MiB mapped each = 66 MiB > 64 MiB
    assert committed_bytes_for_blocks(227, segs, 2 * MIB) == 66 * MIB
    assert rounded.num_blocks == 213  # 213 x 96 KiB = 19.97 MiB -> 20 MiB each, 60 MiB
    assert committed_bytes_for_blocks(213, segs, 2 * MIB) == 60 * MIB
    assert committed_bytes_for_blocks(214, segs, 2 * MIB) == 66 * MIB  # 20.06 -> 22 each
    assert rounded.committed_bytes == 60 * MIB <= budget


def test_kv_cache_memory_bytes_is_committed_as_is() -> None:
    s = blocks_for_kv_cache_memory_bytes(10 * GIB, 2 * MIB)
    assert (s.num_blocks, s.committed_bytes, s.mode) == (5120, 10 * GIB,
                                                         "kv_cache_memory_bytes")
    assert blocks_for_kv_cache_memory_bytes(10 * GIB + MIB, 2 * MIB).num_blocks == 5120


def test_capacity_caps_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="reservation holds 1000"):
        s = blocks_for_utilization(80 * GIB, 1.0, 0, MIB, capacity_blocks=1000)
    assert s.num_blocks == 1000 and s.capped
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not blocks_for_utilization(80 * GIB, 1.0, 0, MIB,
                                          capacity_blocks=10**6).capped


@pytest.mark.parametrize("util", [0.0, -0.1, 1.01, float("nan"), True])
def test_utilization_outside_unit_interval(util) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        blocks_for_utilization(GIB, util, 0, MIB)


def test_not_enough_memory_says_how_much_is_missing() -> None:
    with pytest.raises(InsufficientMemoryError, match="1048576 bytes") as exc:
        blocks_for_utilization(10 * GIB, 0.5, 5 * GIB - MIB, 2 * MIB)
    assert exc.value.missing_bytes == MIB
    with pytest.raises(InsufficientMemoryError) as exc:
        blocks_for_utilization(10 * GIB, 0.5, 6 * GIB, 2 * MIB)
    assert exc.value.missing_bytes == 2 * MIB  # the budget is negative: a whole block
    # granule rounding: one block of 3 x 4 KiB segments maps 3 x 2 MiB
    with pytest.raises(InsufficientMemoryError) as exc:
        blocks_for_kv_cache_memory_bytes(5 * MIB, 12 * KIB, segment_bytes_per_block=[4 * KIB] * 3,
                                          granule=2 * MIB)
    assert exc.value.missing_bytes == MIB


@pytest.mark.parametrize("kwargs, match", [
    (dict(total_memory_bytes=0), "total_memory_bytes"),
    (dict(non_kv_memory_bytes=-1), "non_kv_memory_bytes"),
    (dict(bytes_per_block=0), "bytes_per_block"),
    (dict(segment_bytes_per_block=[MIB]), "sums to"),
])
def test_bad_numbers(kwargs, match) -> None:
    args = dict(total_memory_bytes=GIB, utilization=0.5, non_kv_memory_bytes=0,
                bytes_per_block=2 * MIB)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        blocks_for_utilization(**args)


def test_measure_without_cuda_raises_clearly() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        measure_non_kv_memory_bytes("cuda:0", 0)


@pytest.mark.gpu
def test_measure_non_kv_memory_on_cuda() -> None:
    import torch

    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset

    with ExtensibleKVCache(preset("llama3-8b-like", num_blocks=64, num_layers=4), "cuda:0",
                           capacity_blocks=4096) as cache:
        cache.allocate()
        cache.extend_kv_cache(1024)  # 4 layers x 64 KiB x 1024 = 256 MiB
        assert cache.committed_bytes == 256 * MIB
        before = measure_non_kv_memory_bytes("cuda:0", cache.committed_bytes)
        ballast = torch.empty(512 * MIB, dtype=torch.uint8, device="cuda:0")
        after = measure_non_kv_memory_bytes("cuda:0", cache.committed_bytes)
        # torch's allocator rounds segments up to 2 MiB; other processes may allocate too
        assert 512 * MIB <= after - before < 600 * MIB
        del ballast
        with pytest.raises(ValueError, match="exceeds"):
            measure_non_kv_memory_bytes("cuda:0", 10**15)
