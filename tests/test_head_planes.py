"""LHBNC head planes for vLLM's connectors: the registration split (no vLLM needed) and the
bounding opt-in (vLLM). The connector-level proofs (every layout passes, the plain
OffloadingConnector control) are in tests/test_vllm_connectors.py."""

from __future__ import annotations

import pytest
import torch

from kvconnect.vllm.head_planes import split_to_committed, view_head_planes

MIB = 1 << 20


def test_a_range_spanning_planes_registers_only_their_committed_runs() -> None:
    committed = [(0, MIB), (8 * MIB, MIB)]
    # one storage from plane 0 to the end of plane 1's committed run: a 7 MiB gap inside
    assert split_to_committed([(0, 9 * MIB, 0, "")], committed) == [
        (0, MIB, 0, ""), (8 * MIB, MIB, 0, "")]
    assert split_to_committed([(4096, 100, 0, "")], committed) == [(4096, 100, 0, "")]
    assert split_to_committed([(2 * MIB, MIB, 0, "")], committed) == []
    assert split_to_committed([(MIB - 10, 20, 1, "x")], committed) == [(MIB - 10, 10, 1, "x")]


def test_head_planes_come_from_the_view_stride() -> None:
    raw = torch.zeros(4 * 1024, dtype=torch.bfloat16)
    # [blocks=4, heads=2, N=2, C=8]: heads 1024 elements apart (a reservation's spacing)
    view = raw.as_strided((4, 2, 2, 8), (16, 1024, 8, 1))
    assert view_head_planes(view) == (raw.data_ptr(), raw.data_ptr() + 2048)


@pytest.mark.vllm
def test_bounding_lhbnc_over_a_reservation_needs_the_opt_in(tmp_path) -> None:
    from kvconnect.vllm.runtime import prepare_cpu_runtime

    prepare_cpu_runtime()
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from kvconnect.harness.conformance.compat import kv_cache_config_from_groups
    from kvconnect.layout import LayoutError
    from kvconnect.vllm.bounding import bound_for_connector
    from kvconnect.vllm.cache import VllmKVCache
    from kvconnect.vllm.runtime import make_vllm_config, write_tiny_model

    vc = make_vllm_config(write_tiny_model(tmp_path / "m"), layout="LHBNC")
    page = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    cfg = kv_cache_config_from_groups(vc, [KVCacheGroupSpec(names, page)],
                                      128 * 2 * page.page_size_bytes)
    with set_current_vllm_config(vc), VllmKVCache(cfg, "cpu", layout="LHBNC",
                                                  capacity_blocks=1024) as cache:
        cache.allocate()
        cache.extend_kv_cache(128)
        views, ccfg = cache.kv_caches(), cache.connector_config()
        with pytest.raises(LayoutError, match="head_planes=True"):
            bound_for_connector(views, ccfg)
        b = bound_for_connector(views, ccfg, head_planes=True)
        base = cache.tensors[0].base_ptr
        plane = 1024 * 8192
        assert {n: [a - base for a in p] for n, p in b.head_planes.items()} == {
            names[0]: [0, plane], names[1]: [2 * plane, 3 * plane]}
        assert b.plane_bytes == 128 * 8192
        assert b.committed_ranges() == sorted((a, 128 * 8192) for a, _ in
                                              cache.committed_extents())
        del views, b
