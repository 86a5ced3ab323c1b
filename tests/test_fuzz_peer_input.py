"""What a peer sends, fuzzed (hypothesis): chunk records for ``PeerMapping.import_chunks``,
whole export messages for ``import_message``, handshake documents for
``HandshakeMetadata.from_json`` and, through a registered NIXL worker, ``add_peer``.

Inputs start from a real, valid value (real exported chunks with real memfds; real NIXL
metadata) and are mutated: fields deleted or replaced by huge or negative integers, wrong
types, deep nesting, long strings, another schema version, another peer layout,
corrupted agent metadata. Each gives the module's own error (IpcError; MetadataError /
IncompatiblePeerError / KVConnectorError) or a valid result, and leaves nothing behind:
no fd, no mapped chunk, no reservation, no loaded peer.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import re
from typing import Any

import _nixl_peer as peerlib
import _reliability as fuzz
import pytest
from _reliability import vmm_footprint
from hypothesis import given
from hypothesis import strategies as st

from kvconnect import ExtensibleTensor
from kvconnect.framing import IpcError
from kvconnect.ipc import PeerMapping, import_message
from kvconnect.vmm import AllocationOptions
from kvconnect.vmm.host import HostVmmDriver

G = 2 * 1024 * 1024

# -- chunk records and export messages -------------------------------------------------------

@pytest.fixture
def exported():
    """A shareable 2-segment tensor, one 2 MiB chunk per segment, exported: the driver, its
    chunk records, their fds and decoy fds (a pipe, a memfd too small); all closed after."""
    drv = HostVmmDriver()
    small = os.memfd_create("kvc-fuzz-small")
    os.ftruncate(small, G // 2)
    pipe_r, pipe_w = os.pipe()
    with ExtensibleTensor(2 * 4 * G, drv, num_segments=2,
                          options=AllocationOptions(shareable=True)) as t:
        t.commit(G)
        chunks = t.export_handles()
        fds = [e.fd for e in chunks]
        recs = [{"segment": e.segment, "offset": e.offset, "size": e.size} for e in chunks]
        try:
            yield drv, recs, fds, [small, pipe_r, -1, 99999]
        finally:
            for fd in [*fds, small, pipe_r, pipe_w]:
                os.close(fd)


def _check_mapping(m: PeerMapping, chunks: list[dict]) -> None:
    """An accepted import maps exactly the records, inside its reservation."""
    (mapped,) = m._state.chunks  # one list holds every segment's chunks
    assert len(mapped) == len(chunks)
    for c in mapped:
        assert m.base_ptr <= c.va and c.va + c.size <= m.base_ptr + m.capacity_bytes


def test_chunk_records_from_a_peer(exported) -> None:
    """Mutated chunk records, geometry and fds: a mapping of exactly the records, or
    IpcError; no fd, chunk or reservation left behind."""
    drv, recs, fds, decoys = exported
    n = fuzz.examples(750)
    tally = fuzz.Tally("peer chunk records: PeerMapping.import_chunks", "IpcError", n)
    base = {"capacity_bytes": 8 * G, "segment_capacity": 4 * G, "chunks": recs}
    fd_choices = st.lists(st.sampled_from(fds + decoys), max_size=4)
    baseline_fds, baseline_vmm = fuzz.open_fds(), vmm_footprint()

    @fuzz.fuzz_settings(750)
    @given(fuzz.mutated(base), st.one_of(st.just(fds), fd_choices))
    def run(doc: Any, use_fds: list[int]) -> None:
        def attempt() -> PeerMapping:
            return PeerMapping.import_chunks(drv, doc.get("capacity_bytes"),
                                             doc.get("segment_capacity"), doc.get("chunks"),
                                             use_fds)

        got = tally.run(attempt, (IpcError,))
        if isinstance(got, PeerMapping):
            try:
                _check_mapping(got, doc["chunks"])
            finally:
                got.close()
        assert fuzz.open_fds() == baseline_fds, "an fd was left open"
        assert vmm_footprint() == baseline_vmm, "a chunk or reservation was left mapped"

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["IpcError"] > 0


def test_export_messages_from_a_peer(exported) -> None:
    """Mutated export messages and fds: mappings, or IpcError; nothing left behind."""
    drv, recs, fds, decoys = exported
    n = fuzz.examples(500)
    tally = fuzz.Tally("peer export messages: import_message", "IpcError", n)
    base = {"op": "chunks",
            "tensors": [{"capacity_bytes": 8 * G, "segment_capacity": 4 * G}],
            "chunks": [dict(r, tensor=0) for r in recs]}
    baseline_fds, baseline_vmm = fuzz.open_fds(), vmm_footprint()

    @fuzz.fuzz_settings(500)
    @given(st.one_of(fuzz.mutated(base), fuzz.evil_values),
           st.one_of(st.just(fds), st.lists(st.sampled_from(fds + decoys), max_size=3)))
    def run(message: Any, use_fds: list[int]) -> None:
        got = tally.run(lambda: import_message(drv, message, use_fds), (IpcError,))
        if isinstance(got, list):
            for m in got:
                m.close()
        assert fuzz.open_fds() == baseline_fds
        assert vmm_footprint() == baseline_vmm

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["IpcError"] > 0


# -- handshake documents --------------------------------------------------------------------

@st.composite
def raw_documents(draw: st.DrawFn, base_json: bytes) -> bytes:
    """A mutated document, then perhaps damaged as text: cut, wrapped in deep nesting, a
    4300+-digit integer spliced in, invalid UTF-8, another schema version."""
    doc = draw(fuzz.mutated(json.loads(base_json)))
    text = json.dumps(doc).encode()
    damage = draw(st.sampled_from(["none", "none", "cut", "nest", "bigint", "utf8", "schema",
                                   "b64"]))
    if damage == "cut":
        text = text[:draw(st.integers(0, len(text)))]
    elif damage == "nest":
        n = draw(st.integers(60, 3000))
        text = b'{"x":' + b"[" * n + b"]" * n + b"," + text[1:]
    elif damage == "bigint":
        text = text.replace(b'"generation":', b'"generation":' + b"7" * 5000 + b",\"g\":", 1)
    elif damage == "utf8":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + b"\xff\xfe" + text[at:]
    elif damage == "schema":
        text = re.sub(rb"handshake/1", b"handshake/" + str(draw(st.integers(0, 99))).encode(),
                      text)
    elif damage == "b64":
        text = text.replace(b'"agent_metadata_b64":"', b'"agent_metadata_b64":"%!', 1)
    return text


def test_handshake_documents_parse_or_raise_metadata_error() -> None:
    """Mutated, cut, deeply nested, huge-integer, non-UTF-8, other-schema documents:
    metadata that round-trips, or MetadataError."""
    from kvconnect.connectors.nixl.handshake import HandshakeMetadata, MetadataError

    base = peerlib.sample_metadata().to_json()
    n = fuzz.examples(1200)
    tally = fuzz.Tally("handshake documents: HandshakeMetadata.from_json", "MetadataError", n)

    @fuzz.fuzz_settings(1200)
    @given(st.one_of(raw_documents(base), st.binary(max_size=200)))
    def run(data: bytes) -> None:
        got = tally.run(lambda: HandshakeMetadata.from_json(data), (MetadataError,))
        if isinstance(got, HandshakeMetadata):  # accepted: it round-trips exactly
            assert HandshakeMetadata.from_json(got.to_json()) == got

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["MetadataError"] > 0


def test_handshake_metadata_that_is_not_text_is_a_metadata_error() -> None:
    """Issue 16: ``from_json(None)`` raised a TypeError from ``len``."""
    from kvconnect.connectors.nixl.handshake import HandshakeMetadata, MetadataError

    for bad in (None, 17, 1.5, [b"{}"], {"schema": 1}):
        with pytest.raises(MetadataError, match="must be JSON bytes or text"):
            HandshakeMetadata.from_json(bad)  # type: ignore[arg-type]


needs_nixl = pytest.mark.skipif(
    not importlib.util.find_spec("nixl_cu13") and not importlib.util.find_spec("nixl_cu12")
    and not importlib.util.find_spec("nixl"), reason="NIXL Python bindings not installed")


@pytest.fixture
def registered_pair(nixl_worker):
    """Two registered NIXL workers in this process (real agents, host-backend caches):
    ``(decode, prefill metadata JSON)``."""
    spec = {"preset": "llama3-8b-like", "overrides": {"num_layers": 2}, "num_blocks": 8,
            "capacity_blocks": 64}
    caches = [peerlib.make_cache(spec), peerlib.make_cache(spec)]
    try:
        prefill = nixl_worker("fuzz-prefill", progress_thread=False)
        decode = nixl_worker("fuzz-decode", progress_thread=False)
        prefill.register_kv_cache(caches[0])
        decode.register_kv_cache(caches[1])
        yield decode, prefill.metadata_json()
        decode.close()
        prefill.close()
    finally:
        for c in caches:
            c.close()


@needs_nixl
@pytest.mark.nixl
def test_handshake_documents_through_add_peer(registered_pair) -> None:
    """Mutated real metadata (any field, another layout's PeerLayout, the agent name inside
    NIXL's blob) through a registered worker's add_peer: a loaded peer, or a
    KVConnectorError (MetadataError for malformed documents, IncompatiblePeerError for
    another layout); no peer stays loaded."""
    from kvconnect.connectors.errors import KVConnectorError

    decode, base = registered_pair
    n = fuzz.examples(300)
    tally = fuzz.Tally("handshake documents: NixlRegionWorker.add_peer",
                       "KVConnectorError", n)

    @st.composite
    def blob_damaged(draw: st.DrawFn) -> bytes:
        """Agent metadata whose agent name (inside NIXL's blob) is changed: NIXL loads it
        under that name, which then differs from the handshake's. Only the name's bytes
        change: damage elsewhere in the blob can crash NIXL 1.5.1 / UCX 1.23 inside
        add_remote_agent (docs/reliability.md), which no caller can catch."""
        doc = json.loads(base)
        blob = bytearray(base64.b64decode(doc["agent_metadata_b64"]))
        at = blob.index(doc["agent_name"].encode())
        for _ in range(draw(st.integers(1, 4))):
            blob[at + draw(st.integers(0, len(doc["agent_name"]) - 1))] = draw(
                st.integers(1, 255))
        doc["agent_metadata_b64"] = base64.b64encode(bytes(blob)).decode()
        return json.dumps(doc).encode()

    @st.composite
    def other_layout(draw: st.DrawFn) -> bytes:
        """A well-formed document for another layout: one layout field changed to another
        value of the right type."""
        doc = json.loads(base)
        lay = doc["layout"]
        field = draw(st.sampled_from(["block_len", "block_stride", "sub_blocks", "block_size",
                                      "dtype", "layout", "kernel_block_size",
                                      "kvconnect_version", "layers", "part", "num_blocks"]))
        if field in ("block_len", "block_stride", "sub_blocks", "part"):
            region = lay["regions"][draw(st.integers(0, len(lay["regions"]) - 1))]
            region[field] = draw(st.integers(1, 1 << 40) if field != "part" else
                                 st.sampled_from(["kv", "latent", "state"]))
        elif field in ("block_size", "kernel_block_size", "num_blocks"):
            lay[field] = draw(st.integers(1, 1 << 20))
        elif field == "layers":
            lay["layers"] = draw(st.lists(st.text(min_size=1, max_size=8), max_size=3))
        else:
            lay[field] = draw(st.text(min_size=1, max_size=12))
        return json.dumps(doc).encode()

    @fuzz.fuzz_settings(300)
    @given(st.one_of(raw_documents(base), blob_damaged(), other_layout(),
                     st.just(base)))
    def run(data: bytes) -> None:
        got = tally.run(lambda: decode.add_peer(data), (KVConnectorError,))
        if isinstance(got, str):
            assert decode.peers == [got]
            decode.remove_peer(got)
        assert decode.peers == []

    run()
    tally.record()
    assert tally.tried >= n and tally.outcomes["accepted"] > 0
    assert {"MetadataError", "IncompatiblePeerError"} <= set(tally.outcomes)


@needs_nixl
@pytest.mark.nixl
def test_agent_name_that_is_not_utf8_is_refused_and_unloaded(registered_pair) -> None:
    """Regression (found by the fuzz above): a blob naming its agent with non-UTF-8 bytes
    was loaded by NIXL, then its name's decode raised UnicodeDecodeError and the remote agent
    stayed loaded."""
    from kvconnect.connectors.errors import KVConnectorError

    decode, base = registered_pair
    doc = json.loads(base)
    name = doc["agent_name"].encode()
    bad_name = name[:1] + b"\x80" + name[2:]
    blob = base64.b64decode(doc["agent_metadata_b64"]).replace(name, bad_name, 1)
    doc["agent_metadata_b64"] = base64.b64encode(blob).decode()
    with pytest.raises(KVConnectorError, match="agent metadata names") as err:
        decode.add_peer(json.dumps(doc))
    del err
    assert not decode._agent.check_remote_metadata(bad_name)
    assert decode.peers == []


def test_unreservable_capacity_is_an_ipc_error(exported) -> None:
    """Regression (found by the fuzz above): a peer capacity the address space cannot hold
    raised VmmError from the reservation instead of IpcError."""
    drv, recs, fds, _ = exported
    before = vmm_footprint()
    with pytest.raises(IpcError, match="cannot reserve the peer's capacity"):
        PeerMapping.import_chunks(drv, 1 << 47, 4 * G, recs, fds)
    assert vmm_footprint() == before
