"""vLLM 0.33's layouts as kvconnect presets: one buffer, segments as vLLM places layers, and
the 1P1D validation harness moving blocks byte-exact over them (no vLLM needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import PRESETS, VLLM_LAYOUTS, allocate_kv_caches, preset

BLOCK_OUTER = ("BLHNC", "BLNHC", "BHLNC")


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_vllm_layout_presets_back_one_reservation(layout: str) -> None:
    assert layout in PRESETS
    cfg = preset(layout, num_blocks=16, num_layers=3)
    assert cfg.is_placement and len({t.size for t in cfg.kv_cache_tensors}) == 1
    with ExtensibleKVCache(cfg, "cpu", capacity_blocks=512) as cache:
        cache.allocate()
        cache.extend_kv_cache(16)
        (t,) = cache.tensors
        assert t.num_segments == (1 if layout in BLOCK_OUTER else 3 * (8 if layout == "LHBNC"
                                                                         else 1))
        regions = cache.committed_regions()  # each checked inside committed memory
        assert sum(r.block_len for r in regions) == cache.bytes_per_block
        # the reservation's views equal a plain allocation of its capacity
        raw, plain = allocate_kv_caches(cfg, num_blocks=cache.capacity_blocks)
        for n, v in cache.kv_caches().items():
            p = plain[n]
            assert (v.shape, v.stride(), v.data_ptr() - t.base_ptr) == (
                p.shape, p.stride(), p.data_ptr() - raw[0].data_ptr())


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_validate_harness_runs_vllm_layouts(tmp_path, layout: str) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvconnect.harness.cli", "--layout", layout, "--num-layers", "2",
         "--json", str(out)], capture_output=True, text=True, timeout=240,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    report = json.loads(out.read_text())
    assert report["passed"] and report["exit_code"] == proc.returncode == 0, proc.stdout[-2000:]
    assert report["config"]["layout"] == layout
    assert report["transfers"] and all(t["verified"] for t in report["transfers"])
