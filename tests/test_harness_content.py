"""Block contents and digests of the validation harness: they must catch what constant fills
miss (a flipped byte, a block in the wrong slot, the wrong layer or K/V half, a shift)."""

from __future__ import annotations

import torch

from kvconnect.harness.worker.content import (
    content_key,
    digest_blocks,
    fill,
    first_difference,
    generate,
    owners,
    paired_owners,
    region_label,
    rows_view,
)
from kvconnect.peer_layout import LayoutRegion, PeerLayout


def _spec(layer: str = "model.layers.0", part: str = "k", block_len: int = 4096,
          stride: int = 4096, offset: int = 0, tensor: int = 0) -> LayoutRegion:
    return LayoutRegion(layer, part, block_len, stride, tensor_index=tensor, offset=offset)


def _rows(spec: LayoutRegion, blocks: int = 16) -> torch.Tensor:
    flat = torch.zeros(spec.span(blocks), dtype=torch.uint8)
    return rows_view(flat, spec, blocks)


def test_generate_is_deterministic_and_block_dependent() -> None:
    ids = torch.tensor([0, 1, 2, 7], dtype=torch.int64)
    a = generate(1234, ids, 1000)
    assert a.shape == (4, 1000) and a.dtype == torch.uint8
    assert torch.equal(a, generate(1234, ids, 1000))
    # the same block alone gives the same bytes (position, not batch, decides)
    assert torch.equal(a[3], generate(1234, torch.tensor([7]), 1000)[0])
    # every pair of distinct blocks differs in (nearly) every 4-byte word
    for i in range(4):
        for j in range(i + 1, 4):
            words_i, words_j = a[i, :1000 // 4 * 4].view(torch.int32), a[j, :1000 // 4 * 4].view(
                torch.int32)
            assert (words_i != words_j).float().mean() > 0.99
    # another key (layer, part, seed or source) gives other bytes
    assert (generate(1235, ids, 1000) != a).float().mean() > 0.9


def test_content_key_depends_on_every_coordinate() -> None:
    base = content_key(0, "prefill0", _spec())
    others = {
        content_key(1, "prefill0", _spec()),
        content_key(0, "prefill1", _spec()),
        content_key(0, "prefill0", _spec(layer="model.layers.1")),
        content_key(0, "prefill0", _spec(part="v")),
    }
    assert base not in others and len(others) == 4


def test_digest_catches_a_single_flipped_byte_anywhere() -> None:
    spec = _spec(block_len=512, stride=1024)
    rows = _rows(spec, 4)
    fill(rows, 77)
    before = digest_blocks(rows, [0, 1, 2, 3])
    for block, offset in ((0, 0), (2, 511), (3, 200)):
        rows[block, offset] ^= 0x01
        after = digest_blocks(rows, [0, 1, 2, 3])
        assert after[block] != before[block]
        assert [a == b for i, (a, b) in enumerate(zip(after, before, strict=True))
                if i != block] == [True] * 3
        rows[block, offset] ^= 0x01
    assert digest_blocks(rows, [0, 1, 2, 3]) == before


def test_fill_touches_only_the_block_bytes_not_the_gaps() -> None:
    spec = _spec(block_len=100, stride=256)
    flat = torch.zeros(2 * 256 + 100, dtype=torch.uint8)
    fill(rows_view(flat, spec, 3), 5)
    assert not flat[100:256].any() and not flat[356:512].any()
    assert flat[:100].any() and flat[256:356].any() and flat[512:].any()


def test_a_misplaced_block_and_a_shifted_block_are_caught_with_the_offset() -> None:
    spec = _spec(block_len=256)
    src, dst = _rows(spec, 8), _rows(spec, 8)
    fill(src, 9)
    digests = digest_blocks(src, [3, 5])
    dst[0] = src[5]  # block 5 landed where block 3 should be
    dst[1] = torch.roll(src[5], 4)  # right block, shifted by 4 bytes
    got = digest_blocks(dst, [0, 1])
    assert got[0] != digests[0] and got[1] != digests[1]
    expected = generate(9, torch.tensor([3]), 256)[0]
    diff = first_difference(dst[0], expected)
    assert diff is not None and diff[0] == 0
    assert first_difference(generate(9, torch.tensor([5]), 256)[0], src[5]) is None
    flipped = src[5].clone()
    flipped[123] ^= 0xFF
    assert first_difference(flipped, src[5]) == (123, int(src[5, 123]), int(flipped[123]))


def test_the_layout_marks_the_pages_another_region_holds() -> None:
    """A hybrid cache: every Mamba state region lies inside the attention page of the same KV
    tensor, so it is held by that attention region (kvconnect.views.page_owners); each
    attention region holds its own pages, and only those are filled and checked."""
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset

    cfg = preset("jamba-hybrid-like", num_blocks=4, num_layers=8, attn_period=4)
    with ExtensibleKVCache(cfg, "cpu") as cache:
        cache.allocate()
        cache.extend_kv_cache(4)
        layout = PeerLayout.from_cache(cache)
    regions = layout.regions
    holders = [r for r in regions if r.holds_own]
    held = [r for r in regions if not r.holds_own]
    assert holders and held and len(holders) == len(cache.tensors) and owners(layout) == holders
    for s in held:
        h = regions[s.held_by]
        assert h.holds_own and h.tensor_index == s.tensor_index
        assert h.offset <= s.offset and s.offset + s.block_len <= h.offset + h.block_len


def test_owners_pair_by_name_whatever_the_order() -> None:
    """A decode pairs its owners with the prefill's by layer/part, and finds each one's
    digest column in the prefill's owner order."""
    mine = PeerLayout((_spec(part="k"), _spec(part="v", offset=1 << 20)), 8)
    theirs = PeerLayout(tuple(reversed(mine.regions)), 8)
    assert mine.differences(theirs) == []
    assert [(a.key, b.key, j) for a, b, j in paired_owners(mine, theirs)] == [
        ("model.layers.0/k", "model.layers.0/k", 1), ("model.layers.0/v", "model.layers.0/v", 0)]
    assert "part V" in region_label(mine.regions[1])


def test_fill_writes_the_same_bytes_through_every_path() -> None:
    spec = _spec(block_len=256, stride=512)
    expected = generate(42, torch.arange(10), 256)
    aligned = _rows(spec, 10)
    fill(aligned, 42)  # direct XOR into the aligned rows
    assert torch.equal(aligned, expected)
    flat = torch.zeros(9 * 512 + 256 + 1, dtype=torch.uint8)[1:]  # misaligned by one byte
    misaligned = rows_view(flat, spec, 10)
    fill(misaligned, 42)
    assert torch.equal(misaligned, expected)
    chosen = _rows(spec, 10)
    fill(chosen, 42, [7, 2])
    assert torch.equal(chosen[7], expected[7]) and torch.equal(chosen[2], expected[2])
    assert not chosen[0].any()
