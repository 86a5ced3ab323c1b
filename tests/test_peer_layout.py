"""kvconnect.peer_layout: one description of a peer's KV layout and THE compatibility rule.

Round trips on every preset layout, the bounded parser against mutated and hostile documents
(hypothesis), each kind of mismatch in :meth:`PeerLayout.differences` (and what is allowed to
differ), and that every user of a cache (NIXL handshake, ipc export reply, CPU offload,
harness) publishes the same layout for it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import _reliability as fuzz
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import PRESETS, preset
from kvconnect.peer_layout import (
    PEER_LAYOUT_SCHEMA,
    LayoutRegion,
    PeerLayout,
    PeerLayoutError,
)
from kvconnect.views import CommittedRegion
from kvconnect.vmm import AllocationOptions

#: the caches the layouts come from: every preset (K/V split, MLA, hybrid, packed, vLLM's)
NAMES = sorted(PRESETS)


@pytest.fixture(scope="module")
def layouts() -> Iterator[dict[str, PeerLayout]]:
    out = {}
    for name in NAMES:
        with _cache(name) as cache:
            out[name] = PeerLayout.from_cache(cache)
    yield out


def _cache(name: str, num_blocks: int = 4, capacity: int = 16) -> ExtensibleKVCache:
    cache = ExtensibleKVCache(preset(name, num_blocks=num_blocks, num_layers=4), "cpu",
                              capacity_blocks=capacity,
                              options=AllocationOptions(shareable=True))
    cache.allocate()
    cache.extend_kv_cache(num_blocks)
    return cache


def _kv(block_len: int = 4096, stride: int | None = None) -> PeerLayout:
    """A two-layer K/V layout built by hand."""
    regions = tuple(LayoutRegion(f"layer{i}", part, block_len, stride or block_len,
                                 tensor_index=i, segment=s, offset=s << 20)
                    for i in range(2) for s, part in enumerate("kv"))
    return PeerLayout(regions, 8, block_size=16, dtype="bfloat16", layout="kv_split_nhd",
                      kernel_block_size=None, layer_names=("layer0", "layer1"))


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_through_json_text_and_object(layouts: dict[str, PeerLayout],
                                                 name: str) -> None:
    layout = layouts[name]
    doc = layout.to_json()
    assert doc["schema"] == PEER_LAYOUT_SCHEMA
    assert PeerLayout.from_json(doc) == layout
    assert PeerLayout.from_json(json.dumps(doc)) == layout
    assert PeerLayout.from_json(json.dumps(doc).encode()) == layout
    assert layout.differences(PeerLayout.from_json(doc)) == []
    # the holders carry every region once, and every region's holder holds its own pages
    members = [m for _, _, ms in layout.holders() for m in ms]
    assert sorted(members) == sorted(r.key for r in layout.regions)
    assert all(layout.regions[r.held_by].holds_own for r in layout.regions if not r.holds_own)


def test_a_layout_says_its_units_and_facts(layouts: dict[str, PeerLayout]) -> None:
    hybrid = layouts["jamba-hybrid-like"]
    assert (hybrid.block_size, hybrid.kernel_block_size) == (48, 16)
    assert hybrid.dtype == "bfloat16,float32" and hybrid.num_blocks == 4
    packed = layouts["packed"]
    (row,) = packed.regions
    assert row.block_len == row.block_stride and len(packed.layer_names) == 4
    # a region of k * num_blocks blocks is k kernel blocks per logical block
    regions = [CommittedRegion("a", "kv", 0, 512, 512, 16, "cpu")]
    split = PeerLayout.from_regions(regions, 8)
    assert split.regions[0].sub_blocks == 2 and split.regions[0].bytes_per_block == 1024
    assert split.kernel_blocks(split.regions[0]) == 16 and split.regions[0].offset is None
    assert PeerLayout.from_regions(regions).num_blocks == 16  # default: the common divisor


# -- the bounded, type-checked parser -------------------------------------------------------
@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: d.update(schema="kvconnect.peer_layout/0"), "unknown layout schema"),
    (lambda d: d.pop("regions"), "layout: missing field 'regions'"),
    (lambda d: d.update(num_blocks=0), "layout.num_blocks must be positive"),
    (lambda d: d.update(num_blocks="8"), "layout.num_blocks must be an int"),
    (lambda d: d.update(block_size=True), "layout.block_size must be an int"),
    (lambda d: d.update(dtype=7), "layout.dtype must be a string"),
    (lambda d: d.update(layers=[1]), r"layout.layers\[0\] must be a name"),
    (lambda d: d["regions"][1].pop("block_len"), r"regions\[1\]: missing field 'block_len'"),
    (lambda d: d["regions"][1].update(block_stride=-1), r"regions\[1\].block_stride must be"),
    (lambda d: d["regions"][1].update(block_stride=1), r"regions\[1\].block_stride 1 is below"),
    (lambda d: d["regions"][1].update(sub_blocks=1 << 20), r"regions\[1\].sub_blocks = "),
    (lambda d: d["regions"][1].update(held_by=1), r"regions\[1\].held_by 1 does not name"),
    (lambda d: d["regions"][1].update(held_by=9), r"regions\[1\].held_by = 9 exceeds 3"),
    (lambda d: d["regions"][1].update(part="k"), "lists layer/part 'layer0/k' twice"),
    (lambda d: d["regions"][1].update(layer=""), r"regions\[1\].layer must be a name"),
    (lambda d: d["regions"][1].update(offset=1.5), r"regions\[1\].offset must be an int"),
    (lambda d: d["regions"].append([]), r"regions\[4\] must be an object"),
    (lambda d: d.update(num_blocks=1 << 40, regions=[{**d["regions"][0], "block_len": 1 << 60,
                                                      "block_stride": 1 << 60}]),
     "span more than 2"),
])
def test_malformed_documents_name_the_field(mutate: Any, match: str) -> None:
    doc = json.loads(json.dumps(_kv().to_json()))
    mutate(doc)
    with pytest.raises(PeerLayoutError, match=match):
        PeerLayout.from_json(doc)


def test_text_documents_are_bounded() -> None:
    text = json.dumps(_kv().to_json())
    with pytest.raises(PeerLayoutError, match="above the 100-byte limit"):
        PeerLayout.from_json(text, max_bytes=100)
    with pytest.raises(PeerLayoutError, match="not valid JSON"):
        PeerLayout.from_json("[" * 200 + "]" * 200)
    with pytest.raises(PeerLayoutError, match="not valid JSON"):
        PeerLayout.from_json(b"\xff{}")
    with pytest.raises(PeerLayoutError, match="peer: must be an object, got NoneType"):
        PeerLayout.from_json(None, where="peer:")


def test_mutated_documents_give_a_layout_or_a_peer_layout_error() -> None:
    """Any field of a real (hybrid) layout replaced, deleted or added, as an object and as
    text: a PeerLayout or PeerLayoutError, never TypeError / KeyError / RecursionError."""
    with _cache("jamba-hybrid-like") as cache:
        base = PeerLayout.from_cache(cache).to_json()
    n = fuzz.examples(300)
    tally = fuzz.Tally("layout documents: PeerLayout.from_json", "PeerLayoutError", n)

    @fuzz.fuzz_settings(300)
    @given(fuzz.mutated(base), st.booleans())
    def run(doc: Any, as_text: bool) -> None:
        data = json.dumps(doc) if as_text else doc
        got = tally.run(lambda: PeerLayout.from_json(data), (PeerLayoutError,))
        if isinstance(got, PeerLayout):  # accepted: it round-trips
            assert PeerLayout.from_json(got.to_json()) == got

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["PeerLayoutError"] > 0


# -- the rule --------------------------------------------------------------------------------
def _kinds(diffs: list[str]) -> list[str]:
    """The field each difference names (its text before the first colon)."""
    return [d.split(":")[0] for d in diffs]


@pytest.mark.parametrize(("change", "kinds"), [
    (lambda a: replace(a, block_size=32), ["block_size (tokens)"]),
    (lambda a: replace(a, dtype="float16"), ["dtype"]),
    (lambda a: replace(a, layout="kv_split_hnd"), ["layout"]),
    (lambda a: replace(a, kernel_block_size=None), []),  # unknown on one side: not compared
    (lambda a: replace(replace(a, kernel_block_size=16), kernel_block_size=8), []),
    (lambda a: replace(a, layer_names=("layer0",)), ["number of layers"]),
    (lambda a: replace(a, layer_names=("layer1", "layer0")), ["layer names"]),
    (lambda a: replace(a, regions=a.regions[:3]), ["regions missing on remote"]),
    (lambda a: replace(a, regions=(*a.regions, LayoutRegion("layer2", "k", 4096, 4096))),
     ["regions only on remote"]),
    (lambda a: replace(a, regions=(replace(a.regions[0], block_len=2048), *a.regions[1:])),
     ["block_len (bytes per kernel block) of region layer0/k"]),
    (lambda a: replace(a, regions=(replace(a.regions[0], block_stride=8192), *a.regions[1:])),
     ["block_stride (bytes between kernel blocks) of region layer0/k"]),
    (lambda a: replace(a, regions=(replace(a.regions[0], sub_blocks=2), *a.regions[1:])),
     ["sub_blocks (kernel blocks per block) of region layer0/k"]),
    (lambda a: replace(a, regions=(*a.regions[:3], replace(a.regions[3], held_by=2))),
     ["holder (region whose pages hold its bytes) of region layer1/v"]),
], ids=["block_size", "dtype", "layout", "unknown-fact", "kernel_block_size-unknown-locally",
        "layer-count", "layer-names", "missing-region", "extra-region", "block_len",
        "block_stride", "sub_blocks", "holder"])
def test_each_mismatch_is_named(change: Any, kinds: list[str]) -> None:
    local = _kv()
    remote = change(local)
    diffs = local.differences(remote)
    assert _kinds(diffs) == kinds
    for d in diffs:  # local and remote values (or which side lacks regions), what to do
        assert ("local" in d and "remote" in d) or " on remote: " in d
        assert "same" in d or "both sides" in d


def test_what_may_differ_gives_no_difference() -> None:
    local = _kv()
    assert local.differences(local) == []
    elsewhere = replace(local, num_blocks=64, kvconnect_version="9.9.9", regions=tuple(
        replace(r, offset=(r.offset or 0) + (1 << 30), tensor_index=0, segment=3)
        for r in reversed(local.regions)))
    assert local.differences(elsewhere) == []
    assert elsewhere.differences(local) == []


def test_a_difference_shared_by_many_regions_is_one_sentence() -> None:
    local = _kv()
    doubled = replace(local, regions=tuple(replace(r, block_len=8192, block_stride=8192)
                                           for r in local.regions))
    diffs = local.differences(doubled)
    assert _kinds(diffs) == ["block_len (bytes per kernel block) of 4 regions (layer0/k, "
                             "layer0/v, layer1/k, layer1/v)",
                             "block_stride (bytes between kernel blocks) of 4 regions (layer0/k, "
                             "layer0/v, layer1/k, layer1/v)"]
    assert "local 4096 != remote 8192" in diffs[0]


def test_presets_differ_from_each_other(layouts: dict[str, PeerLayout]) -> None:
    """No two preset layouts are compatible (each is another model or page format)."""
    for a in NAMES:
        for b in NAMES:
            assert (layouts[a].differences(layouts[b]) == []) == (a == b), (a, b)


def test_a_grown_cache_keeps_its_layout() -> None:
    """More committed blocks and another capacity: the same layout by the rule."""
    with _cache("jamba-hybrid-like", 4, 16) as small, _cache("jamba-hybrid-like", 12, 64) as big:
        a, b = PeerLayout.from_cache(small), PeerLayout.from_cache(big)
    assert (a.num_blocks, b.num_blocks) == (4, 12)
    assert a.differences(b) == [] and b.differences(a) == []


# -- one layout per cache, whoever builds it --------------------------------------------------
def test_every_user_of_a_cache_publishes_the_same_layout(nixl_worker: Any) -> None:
    """The NIXL handshake, the ipc export reply, the CPU offload connector and the harness
    (PeerLayout.from_cache) describe one hybrid cache by one equal layout."""
    from kvconnect.connectors.ipc.transport import IpcExportServer
    from kvconnect.connectors.nixl.agent import nixl_importable
    from kvconnect.connectors.offload.connector import CPUOffloadConnector

    directory = tempfile.mkdtemp(prefix="kvl-", dir="/tmp")
    try:
        with _cache("jamba-hybrid-like") as cache:
            harness = PeerLayout.from_cache(cache)
            server = IpcExportServer(cache, directory, "x", lambda: {os.getpid()}, timeout=5.0)
            try:
                assert PeerLayout.from_json(server._reply({})["layout"]) == harness
            finally:
                server.close()
            offload = CPUOffloadConnector(cache, num_cpu_blocks=2)
            try:
                assert offload.layout == harness
            finally:
                offload.close()
            if nixl_importable():
                md = nixl_worker("layout", progress_thread=False).register_kv_cache(cache)
                assert md.layout == harness
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# -- a peer's declared page sharing must match its addresses (NIXL) ---------------------------
def test_a_peer_whose_holders_do_not_match_its_addresses_is_refused() -> None:
    from kvconnect.connectors.errors import IncompatiblePeerError
    from kvconnect.connectors.nixl.handshake import HandshakeMetadata, RegionAddress
    from kvconnect.connectors.nixl.peers import remote_paged_regions

    attn = LayoutRegion("attn", "kv", 1024, 1024)
    state = LayoutRegion("mamba", "state", 512, 1024, held_by=0)
    layout = PeerLayout((attn, state), 8)
    base = 1 << 30

    def md(layout: PeerLayout, state_at: int) -> HandshakeMetadata:
        return HandshakeMetadata("p", "p-1", b"x", "DRAM", layout,
                                 (RegionAddress(base), RegionAddress(state_at)),
                                 ((base, 1 << 20, 0),))

    assert [r.num_blocks for r in remote_paged_regions(md(layout, base))] == [8, 8]
    with pytest.raises(IncompatiblePeerError, match="says region mamba/state is held by "
                                                    "attn/kv, its addresses put it in "
                                                    "mamba/state"):
        remote_paged_regions(md(layout, base + (1 << 19)))  # the state lies elsewhere
    honest = PeerLayout((attn, replace(state, held_by=-1)), 8)
    with pytest.raises(IncompatiblePeerError, match="says region mamba/state is held by "
                                                    "mamba/state, its addresses put it in "
                                                    "attn/kv"):
        remote_paged_regions(md(honest, base))


def test_a_decode_names_a_prefill_layout_it_cannot_read() -> None:
    from kvconnect.harness.worker.decode import _layout_differences

    local = _kv()
    assert _layout_differences(local, local.to_json()) == []
    (text,) = _layout_differences(local, {"schema": "other"})
    assert text.startswith("its layout cannot be read: layout: unknown layout schema")
    assert _kinds(_layout_differences(local, replace(local, dtype="fp8").to_json())) == ["dtype"]
