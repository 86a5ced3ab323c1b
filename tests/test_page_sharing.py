"""One page-sharing rule (kvconnect.views.page_owners / page_holders) against the three rules
it replaced, on every layout kvconnect builds, and on the edge cases where they differed.

The old rules are copied here verbatim in substance, as references:
- ``union`` (connectors/offload_layout.merge_shared_pages: CPU offload and the ipc transport):
  overlapping regions merged into their union;
- ``longest`` (connectors/nixl_descriptors.transfer_regions: NIXL): per (base_ptr, stride,
  device) the longest region;
- ``containment`` (harness/content.mark_covered: the harness's fill and checks): a region
  inside an earlier one is covered by it, a partial overlap is a ValueError.
On every layout we build all three agree with the new rule; the new one is also independent
of the order of aliasing layers and works on a peer's regions rebuilt from its handshake.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvconnect.connectors.nixl.descriptors import registration_extents, transfer_regions
from kvconnect.connectors.nixl.handshake import HandshakeMetadata, RegionAddress
from kvconnect.connectors.nixl.peers import peer_descriptors
from kvconnect.connectors.offload.layout import offload_row_layout
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import (
    PRESETS,
    VLLM_LAYOUTS,
    KVCacheConfig,
    allocate_kv_caches,
    attention_config,
    hybrid_config,
    mla_config,
    preset,
)
from kvconnect.peer_layout import PeerLayout
from kvconnect.views import (
    CommittedRegion,
    PagedRegion,
    committed_regions,
    page_holders,
    page_owners,
)


# -- the three rules this replaced ----------------------------------------------------------
def old_union(regions: list[CommittedRegion]) -> list[tuple[CommittedRegion, tuple[str, ...]]]:
    merged: list[tuple[CommittedRegion, list[str]]] = []
    for r in regions:
        name = f"{r.layer_name}/{r.part}"
        lo, hi = r.base_ptr, r.base_ptr + r.block_len
        hit = None
        for j, (m, _members) in enumerate(merged):
            if m.base_ptr < hi and lo < m.base_ptr + m.block_len:
                if (m.tensor_index, m.segment, m.block_stride, m.num_blocks) != (
                        r.tensor_index, r.segment, r.block_stride, r.num_blocks):
                    raise ValueError("overlap with different tensor/segment/stride/count")
                hit = j
                break
        if hit is None:
            merged.append((r, [name]))
            continue
        m, members = merged[hit]
        start, end = min(m.base_ptr, lo), max(m.base_ptr + m.block_len, hi)
        if end - start > m.block_stride:
            raise ValueError("union spans more than one block stride")
        merged[hit] = (replace(m, base_ptr=start, block_len=end - start,
                               layers=tuple(dict.fromkeys(m.layers + r.layers)),
                               segment_offset=m.segment_offset - (m.base_ptr - start)),
                       [*members, name])
    return [(r, tuple(members)) for r, members in merged]


def old_longest(regions: list[Any]) -> list[Any]:
    best: dict[tuple[int, int, str], Any] = {}
    order: list[tuple[int, int, str]] = []
    for r in regions:
        key = (int(r.base_ptr), int(r.block_stride), str(r.device))
        if key not in best:
            best[key] = r
            order.append(key)
        elif int(r.block_len) > int(best[key].block_len):
            best[key] = r
    return [best[k] for k in order]


def old_containment(regions: list[CommittedRegion], tensor_bases: list[int]) -> list[int]:
    """``covered_by`` per region, as harness/content.mark_covered computed it (offsets from
    the tensor's base)."""
    specs = [(i, r.tensor_index, r.segment, r.base_ptr - tensor_bases[r.tensor_index],
              r.block_len, r.block_stride, r.num_blocks) for i, r in enumerate(regions)]
    covered: list[int] = []
    for i, ti, seg, off, blen, stride, n in specs:
        cover = -1
        for j, tj, segj, offj, blenj, stridej, nj in specs[:i]:
            if covered[j] >= 0 or tj != ti:
                continue
            if stridej == stride and offj <= off and off + blen <= offj + blenj and n <= nj:
                cover = j
                break
            end, endj = off + (n - 1) * stride + blen, offj + (nj - 1) * stridej + blenj
            if seg == segj and not (end <= offj or endj <= off):
                if stride != stridej or (off % stride < offj % stridej + blenj
                                         and offj % stridej < off % stride + blen):
                    raise ValueError("partial overlap")
        covered.append(cover)
    return covered


# -- every layout we build ------------------------------------------------------------------
def _configs() -> dict[str, KVCacheConfig]:
    out: dict[str, KVCacheConfig] = {}
    for name in PRESETS:
        kw: dict[str, Any] = {"num_layers": 4}
        if name == "jamba-hybrid-like":
            kw = {"num_layers": 8, "attn_period": 4}
        out[name] = preset(name, num_blocks=4, **kw)
    for layout in VLLM_LAYOUTS:  # two overlaid cache groups (full + sliding window)
        out[f"{layout}-sliding"] = attention_config(
            num_layers=5, num_kv_heads=2, head_size=8, num_blocks=3, layout=layout,
            sliding_window=32, sliding_window_every=2)
        out[f"{layout}-mla"] = mla_config(num_layers=3, kv_lora_rank=16, qk_rope_head_dim=8,
                                          block_size=16, num_blocks=3, layout=layout)
    for layout in ("kv_split_nhd", "kv_split_hnd", "blocks_first", "blocks_first_hnd"):
        for kbs in (None, 8, 16):
            out[f"hybrid-{layout}-kbs{kbs}"] = hybrid_config(
                num_layers=5, attn_period=2, num_kv_heads=1, head_size=16, num_blocks=4,
                mamba_shapes=((8, 3), (8, 16)), layout=layout, kernel_block_size=kbs)
        out[f"sliding-{layout}"] = attention_config(
            num_layers=3, num_kv_heads=2, head_size=16, num_blocks=4, layout=layout,
            sliding_window=32, sliding_window_every=2, block_size=16, kernel_block_size=8)
    out["mla-packed"] = mla_config(num_layers=3, kv_lora_rank=16, qk_rope_head_dim=8,
                                   block_size=16, num_blocks=4, layout="packed")
    return out


CONFIGS = _configs()


def _regions(cfg: KVCacheConfig) -> tuple[list[CommittedRegion], list[int], list[Any]]:
    raw, kv = allocate_kv_caches(cfg)
    return committed_regions(kv, cfg.num_blocks, cfg), [t.data_ptr() for t in raw], raw


def _geometry(r: Any) -> tuple[int, int, int, int, str]:
    return (r.base_ptr, r.block_len, r.block_stride, r.num_blocks, str(r.device))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_new_rule_equals_each_old_rule_on_every_layout(name: str) -> None:
    regions, bases, _raw = _regions(CONFIGS[name])
    owners = page_owners(regions)
    holders = page_holders(regions)
    assert [r for r, _ in holders] == [regions[i] for i in dict.fromkeys(owners)]
    # union (offload, ipc): the same byte ranges, the same member names, the same order
    union = old_union(regions)
    assert [(_geometry(r), m) for r, m in union] == [(_geometry(r), m) for r, m in holders]
    # longest per base (nixl): the same regions
    assert old_longest(regions) == [r for r, _ in holders] == transfer_regions(regions)
    # containment (harness): covered_by is the owner of every region that does not own
    assert old_containment(regions, bases) == [-1 if o == i else o
                                               for i, o in enumerate(owners)]
    # the owners' blocks hold every region's bytes, each byte once
    for i, o in enumerate(owners):
        r, h = regions[i], regions[o]
        assert h.block_stride == r.block_stride and r.num_blocks <= h.num_blocks
        assert h.base_ptr <= r.base_ptr and r.base_ptr + r.block_len <= h.base_ptr + h.block_len


def test_the_layouts_above_do_share_pages() -> None:
    """The comparison above covers aliasing (hybrid, overlaid groups), not only disjoint
    regions."""
    shared = {name for name, cfg in CONFIGS.items()
              if len(page_holders(_regions(cfg)[0])) < len(_regions(cfg)[0])}
    assert "jamba-hybrid-like" in shared
    assert {f"{layout}-sliding" for layout in VLLM_LAYOUTS} <= shared
    assert {f"hybrid-{lay}-kbs16" for lay in ("kv_split_nhd", "blocks_first")} <= shared


@pytest.mark.parametrize("name", ["jamba-hybrid-like", "BHLNC-sliding", "LHBNC-sliding",
                                  "packed", "llama3-8b-like"])
def test_the_rule_on_an_extensible_cache_and_on_a_peers_handshake(name: str) -> None:
    """Regions of an extensible cache (capacity far above the committed blocks), and the
    same regions rebuilt by a reader from the handshake (no tensor index or segment): the
    same holders; the reader's descriptors pair up with its own transfer regions."""
    cfg = CONFIGS[name]
    with ExtensibleKVCache(cfg, "cpu", capacity_blocks=64) as cache:
        cache.allocate()
        cache.extend_kv_cache(cfg.num_blocks)
        regions = cache.committed_regions()
        chunks = [c for t in cache.tensors for c in t.physical_chunks()]
        md = HandshakeMetadata(
            engine_id="peer", agent_name="peer-agent", agent_metadata=b"x", memory_type="DRAM",
            layout=PeerLayout.from_cache(cache),
            regions=tuple(RegionAddress(r.base_ptr, 0) for r in regions),
            registrations=tuple(registration_extents(regions, chunks)))
        local = transfer_regions(regions)
        assert local == old_longest(regions)
        descs, offsets, counts = peer_descriptors(md, local)
        assert counts.tolist() == [r.num_blocks for r in local]
        assert descs[:, 1].tolist() == [r.block_len for r in local for _ in range(r.num_blocks)]
        slices = offload_row_layout(md.layout)
        assert [regions[s.index] for s in slices] == local
        assert [s.members for s in slices] == [m for _, m in page_holders(regions)]


# -- the edge cases where the old rules differed ----------------------------------------------
ATTN = PagedRegion("attn", "kv", 4096, 1024, 1024, 8, "cpu")
STATE = PagedRegion("mamba", "state", 4096, 560, 1024, 8, "cpu")


def test_the_holder_does_not_depend_on_the_order_of_aliasing_layers() -> None:
    """containment marked only later regions (Mamba listed first raised); union named the
    merged region after the first. The new rule picks the largest either way."""
    assert page_owners([ATTN, STATE]) == [0, 0]
    assert page_owners([STATE, ATTN]) == [1, 1]
    assert page_holders([STATE, ATTN]) == [(ATTN, ("mamba/state", "attn/kv"))]


def test_a_region_inside_another_at_another_offset_is_held() -> None:
    """longest-per-base kept both (the bytes moved twice); union and containment held it."""
    inner = replace(STATE, base_ptr=ATTN.base_ptr + 256, block_len=512)
    assert page_owners([ATTN, inner]) == [0, 0]
    assert old_longest([ATTN, inner]) == [ATTN, inner]


def test_identical_regions_are_held_by_the_first() -> None:
    twin = replace(ATTN, layer_name="attn2")
    assert page_owners([ATTN, twin, STATE]) == [0, 0, 0]


@pytest.mark.parametrize("other", [
    replace(STATE, base_ptr=ATTN.base_ptr + 512),                 # runs past the page's end
    replace(STATE, base_ptr=ATTN.base_ptr + 1024 + 100, num_blocks=4),  # block b in block b+1
    replace(STATE, num_blocks=9),                                 # one block more
    replace(STATE, block_stride=2048, num_blocks=2),              # another stride, same span
], ids=["partial", "shifted-block", "more-blocks", "other-stride"])
def test_bytes_shared_without_holding_raise(other: PagedRegion) -> None:
    with pytest.raises(ValueError, match="share bytes"):
        page_owners([ATTN, other])
    with pytest.raises(ValueError, match="share bytes"):
        page_owners([other, ATTN])


@pytest.mark.parametrize("other", [
    replace(ATTN, base_ptr=ATTN.base_ptr + 8 * 1024),          # the next 8 blocks
    replace(ATTN, device="cuda:0"),                            # same address, other device
    replace(ATTN, base_ptr=ATTN.base_ptr + 512, block_len=512, block_stride=1024,
            layer_name="half"),                                # interleaved halves of rows
], ids=["adjacent", "other-device", "interleaved"])
def test_disjoint_regions_own_their_pages(other: PagedRegion) -> None:
    first = replace(ATTN, block_len=512) if other.layer_name == "half" else ATTN
    assert page_owners([first, other]) == [0, 1]
