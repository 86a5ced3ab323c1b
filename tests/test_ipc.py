"""The fd-passing wire format: batches of fds, error frames, bounds, malformed peers,
credentials, cleanup (real Unix sockets, real SCM_RIGHTS, real memfds)."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnect import ExtensibleTensor
from kvconnect.framing import (
    MAGIC,
    MAX_FDS,
    MAX_MESSAGE_BYTES,
    SCM_MAX_FD,
    IpcError,
    PeerError,
    check_peer,
    peer_credentials,
    private_socket_dir,
    recv_json,
    recv_message,
    send_error,
    send_message,
)
from kvconnect.ipc import PeerMapping, export_message, import_message
from kvconnect.vmm import AllocationOptions
from kvconnect.vmm.host import HostVmmDriver

G = 2 * 1024 * 1024
FRAME = struct.Struct(">4sBBHII")


def frame(kind: int, body: bytes = b"", nfds: int = 0, total: int = 0,
          magic: bytes = MAGIC) -> bytes:
    return FRAME.pack(magic, kind, 0, nfds, len(body), total) + body


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_with_fds(pair) -> None:
    a, b = pair
    r, w = os.pipe()
    try:
        send_message(a, {"hello": [1, 2, 3]}, [r, w])
        msg, fds = recv_message(b, timeout=5)
        assert msg == {"hello": [1, 2, 3]}
        assert len(fds) == 2 and set(fds).isdisjoint({r, w})
        os.write(fds[1], b"x")  # the received fd is the same pipe
        assert os.read(r, 1) == b"x"
        for fd in fds:
            os.close(fd)
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("count", [SCM_MAX_FD, SCM_MAX_FD + 1, 600])
def test_more_fds_than_one_sendmsg_carries(pair, count: int) -> None:
    """Linux passes at most 253 fds per SCM_RIGHTS message (EINVAL above): they go in
    batches, and every fd arrives, in order."""
    a, b = pair
    memfds = [os.memfd_create(f"kvc-test-{i}") for i in range(3)]
    try:
        for i, fd in enumerate(memfds):
            os.ftruncate(fd, 4096 * (i + 1))
        sent = [memfds[i % 3] for i in range(count)]
        before = open_fds()
        send_message(a, {"n": count}, sent)
        msg, fds = recv_message(b, timeout=10)
        assert msg == {"n": count} and len(fds) == count == len(set(fds))
        assert [os.fstat(fd).st_size for fd in fds] == [os.fstat(fd).st_size for fd in sent]
        for fd in fds:
            os.close(fd)
        assert open_fds() == before
    finally:
        for fd in memfds:
            os.close(fd)


def test_fd_bounds(pair) -> None:
    a, _ = pair
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match=f"at most {MAX_FDS} fds"):
            send_message(a, {}, [r] * (MAX_FDS + 1))
        before = open_fds()
        cases = [  # (fds sent, max_fds, error); after an IpcError the stream is out of step,
            ([r] * 300, 10, "could not take: more than 10"),  # so each case has its own pair
            ([r, w], 0, "could not take: more than 0"),
            ([r] * 20, 19, "announced 20 fds, more than the 19"),
            ([r] * 300, 299, "announced 300 fds, more than the 299"),
        ]
        for sent, max_fds, error in cases:
            c, d = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with c, d:
                send_message(c, {"x": 1}, sent)
                with pytest.raises(IpcError, match=error):
                    if max_fds:
                        recv_message(d, timeout=1, max_fds=max_fds)
                    else:
                        recv_json(d, timeout=1)  # a message that must carry no fds
            assert open_fds() <= before  # what arrived was closed
    finally:
        os.close(r)
        os.close(w)


def test_timeout_and_closed_peer(pair) -> None:
    a, b = pair
    with pytest.raises(IpcError, match="timed out"):
        recv_message(b, timeout=0.2)
    a.close()
    with pytest.raises(IpcError, match="closed"):
        recv_message(b, timeout=1)


def test_error_frame_carries_the_peers_error(pair) -> None:
    a, b = pair
    assert send_error(a, RuntimeError("export_handles() needs shareable allocations"))
    with pytest.raises(PeerError) as err:
        recv_message(b, timeout=1)
    assert err.value.remote_type == "RuntimeError"
    assert err.value.remote_message == "export_handles() needs shareable allocations"
    assert isinstance(err.value, IpcError)
    assert send_error(a, "x" * 100_000)  # long text is cut, not refused
    with pytest.raises(PeerError) as err:
        recv_message(b, timeout=1)
    assert len(err.value.remote_message) <= 8192


def test_error_frame_in_place_of_the_remaining_fds(pair) -> None:
    """A sender that fails between fd batches: the receiver gets the error and closes the
    fds of the first batch."""
    a, b = pair
    r, w = os.pipe()
    try:
        before = open_fds()
        body = b'{"op":"chunks"}'
        socket.send_fds(a, [frame(1, body, nfds=SCM_MAX_FD, total=300)], [r] * SCM_MAX_FD)
        send_error(a, OSError("ran out of fds"))
        with pytest.raises(PeerError) as err:
            recv_message(b, timeout=1)
        assert err.value.remote_type == "OSError"
        assert open_fds() == before
    finally:
        os.close(r)
        os.close(w)
    send_error(a, ValueError("x"))
    b.close()
    a.close()
    assert not send_error(a, "socket closed: False, not an exception")


@pytest.mark.parametrize(("raw", "error"), [
    (b"PICKLE!!PICKLE!!", "bad message header"),
    (frame(1, magic=b"KVC1"), "bad message header"),
    (FRAME.pack(MAGIC, 1, 0, 0, MAX_MESSAGE_BYTES + 1, 0), "over the"),
    (frame(1, b"[1,2]"), "expected an object"),
    (frame(1, b"{nope"), "invalid JSON"),
    (frame(1, b"\xff\xfe"), "invalid JSON"),
    (frame(1, b"[" * 1000 + b"]" * 1000), "nested deeper"),
    (frame(1, b'{"a":' + b"7" * 5000 + b"}"), "digit limit"),
    (frame(9), "unknown frame kind"),
    (frame(2), "expected a message frame"),
    (frame(1, b"{}", nfds=2, total=2), "announced 2 fds but carried 0"),
    (frame(3, b"[" * 5000), "unreadable error report"),
])
def test_malformed_frames_raise_ipc_error(pair, raw: bytes, error: str) -> None:
    a, b = pair
    a.sendall(raw)
    with pytest.raises(IpcError, match=error):
        recv_message(b, timeout=1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(
    st.binary(max_size=300),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                 lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
                 max_leaves=40).map(lambda doc: json.dumps(doc).encode()),
    st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 3000).map(lambda n: b'{"a":[' * n + b"0" + b"]}" * n),
    st.integers(1, 6000).map(lambda n: b'{"n":-' + b"9" * n + b"}"),
))
def test_any_body_gives_an_object_or_ipc_error(body: bytes) -> None:
    """Whatever a peer puts in a frame, recv_message returns a dict or raises IpcError
    (never RecursionError, ValueError, UnicodeDecodeError)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        a.sendall(frame(1, body))
        try:
            msg, fds = recv_message(b, timeout=5)
        except IpcError:
            return
        assert isinstance(msg, dict) and fds == []
    finally:
        a.close()
        b.close()


def test_private_dir_and_peer_credentials() -> None:
    with private_socket_dir() as d:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        path = os.path.join(d, "sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        cli.connect(path)
        conn, _ = srv.accept()
        creds = peer_credentials(conn)
        assert creds.pid == os.getpid() and creds.uid == os.getuid()
        check_peer(conn)
        with pytest.raises(IpcError, match="expected uid"):
            check_peer(conn, uid=os.getuid() + 1)
        for s in (conn, cli, srv):
            s.close()
    assert not os.path.exists(d)


# -- mapping a peer's chunks ------------------------------------------------------------------
@pytest.fixture
def exported():
    """A shareable two-segment tensor with one chunk per segment (segment 1 filled with 7),
    its chunk records and fds; everything closed afterwards."""
    drv = HostVmmDriver()
    with ExtensibleTensor(2 * 4 * G, drv, num_segments=2,
                          options=AllocationOptions(shareable=True)) as t:
        t.commit(G)
        t.segment_view(1).fill_(7)
        chunks = t.export_handles()
        fds = [e.fd for e in chunks]
        recs = [{"segment": e.segment, "offset": e.offset, "size": e.size} for e in chunks]
        try:
            yield drv, t, recs, fds
        finally:
            for fd in fds:
                os.close(fd)


def test_peer_mapping_maps_and_cleans_up(exported) -> None:
    drv, t, recs, fds = exported
    before = open_fds()
    with PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds) as m:
        view = m.view(4 * G, G)
        assert int(view.min()) == 7
        with pytest.raises(ValueError, match="not inside one imported chunk"):
            m.view(G - 1, 2)
        with pytest.raises(ValueError, match="view offset"):
            m.view(-5, 1)
        del view
    assert open_fds() == before


BIG = 1 << 70


@pytest.mark.parametrize(("mutate", "error"), [
    (lambda r: r[1].pop("size"), "lacks"),
    (lambda r: r.__setitem__(1, "chunk"), "not an object"),
    (lambda r: r[1].update(offset=4 * G), "chunk 1 offset"),          # past segment 1
    (lambda r: r[1].update(segment=2), "chunk 1 segment"),
    (lambda r: r[1].update(segment=-1), "chunk 1 segment"),
    (lambda r: r[1].update(size=BIG), "chunk 1 size"),
    (lambda r: r[1].update(size=(1 << 64) + G), "chunk 1 size"),
    (lambda r: r[1].update(offset=BIG), "chunk 1 offset"),
    (lambda r: r[1].update(size="2097152"), "must be an int"),
    (lambda r: r[1].update(size=True), "must be an int"),
    (lambda r: r[1].update(size=2.0 * G), "must be an int"),
    (lambda r: r[1].update(size=None), "must be an int"),
    (lambda r: r[1].update(size=4096), "granularity"),
    (lambda r: r[1].update(size=0), "chunk 1 size"),
    (lambda r: r[1].update(size=2 * G), "cannot be imported"),          # fd holds only G
    (lambda r: r[1].update(segment=0), "overlap"),
])
def test_malformed_chunk_records_raise_ipc_error(exported, mutate, error: str) -> None:
    drv, t, recs, fds = exported
    before = open_fds()
    mutate(recs)
    with pytest.raises(IpcError, match=error):
        PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds)
    assert open_fds() == before  # the rollback released every import and the reservation


@pytest.mark.parametrize(("capacity", "segment", "error"), [
    (BIG, 4 * G, "capacity_bytes"),
    ((1 << 64) + 4 * 1024 * 1024, 4 * G, "capacity_bytes"),
    (8 * G, BIG, "segment_capacity"),
    (8 * G, 3 * G, "whole number"),
    (8 * G, 0, "segment_capacity"),
    ("8", 4 * G, "capacity_bytes"),
    (8 * G + 4096, 8 * G + 4096, "multiples of"),
])
def test_malformed_peer_geometry_raises_ipc_error(exported, capacity, segment, error) -> None:
    drv, _, recs, fds = exported
    with pytest.raises(IpcError, match=error):
        PeerMapping.import_chunks(drv, capacity, segment, recs, fds)


def test_export_and_import_messages(exported) -> None:
    drv, t, _, _ = exported
    message, fds = export_message([t, t])
    try:
        assert json.loads(json.dumps(message)) == message  # plain JSON
        assert [c["tensor"] for c in message["chunks"]] == [0, 0, 1, 1]
        mappings = import_message(drv, message, fds)
        try:
            assert [m.capacity_bytes for m in mappings] == [t.capacity_bytes] * 2
            assert int(mappings[1].view(4 * G, G).max()) == 7
        finally:
            for m in mappings:
                m.close()
        before = open_fds()
        bad = [
            ("not a dict", "expected an object"),
            ({**message, "op": "other"}, "op 'chunks'"),
            ({**message, "chunks": {}}, "must be lists"),
            ({**message, "tensors": []}, "no tensors"),
            ({**message, "chunks": message["chunks"][:3]}, "3 chunk records but 4 fds"),
            ({**message, "chunks": [{**c, "tensor": 2} for c in message["chunks"]]},
             "tensor index"),
            ({**message, "chunks": [{**c, "tensor": "0"} for c in message["chunks"]]},
             "tensor index"),
            ({**message, "tensors": [{"capacity_bytes": BIG, "segment_capacity": 4 * G}] * 2},
             "capacity_bytes"),
            ({**message, "tensors": [{}, {}]}, "capacity_bytes and segment_capacity"),
        ]
        for doc, error in bad:
            with pytest.raises(IpcError, match=error):
                import_message(drv, doc, fds)
        assert open_fds() == before
    finally:
        for fd in fds:
            os.close(fd)


def test_peer_mapping_views_outlive_close_without_aliasing(exported) -> None:
    """After close() the addresses stay reserved while a view is referenced: the next
    mapping cannot land where the stale view points."""
    drv, t, recs, fds = exported
    m = PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds)
    view = m.view(0, G)
    stale_base = m.base_ptr
    m.close()
    assert m.live_views == 1
    again = PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds)
    try:
        assert not (stale_base <= again.base_ptr < stale_base + t.capacity_bytes)
    finally:
        again.close()
    del view


# -- the library's ipc export server ------------------------------------------------------------
def test_export_failure_reaches_the_importer_as_the_real_error(tmp_path) -> None:
    """An exporter that fails (here: its cache is not shareable) sends an error frame: the
    importer raises PeerError with the exporter's exception, not 'peer closed'."""
    from kvconnect.connectors.ipc.transport import IpcExportServer, IpcTransport
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset

    cfg = preset("llama3-8b-like", num_blocks=4, num_layers=1)
    with ExtensibleKVCache(cfg, "cpu") as plain, \
            ExtensibleKVCache(cfg, "cpu", options=AllocationOptions(shareable=True)) as local:
        plain.allocate()
        local.allocate()
        server = IpcExportServer(plain, str(tmp_path), "prefill", lambda: {os.getpid()}, 5.0)
        try:
            with IpcTransport(local, timeout=5.0) as transport, \
                    pytest.raises(PeerError) as err:
                transport.open_peer("prefill", server.describe())
        finally:
            server.close()
    assert err.value.remote_type == "RuntimeError"
    assert "shareable" in err.value.remote_message
    assert len(server.errors) == 1


_TRUNCATING_PEER = """
import os, sys
from kvconnect import ExtensibleTensor
from kvconnect.ipc import PeerMapping
from kvconnect.vmm import AllocationOptions
from kvconnect.vmm.host import HostVmmDriver
G = 2 * 1024 * 1024
drv = HostVmmDriver()
with ExtensibleTensor(2 * G, drv, options=AllocationOptions(shareable=True)) as t:
    t.commit(G)
    (chunk,) = t.export_handles()
    m = PeerMapping.import_chunks(drv, 2 * G, 2 * G, [{"segment": 0, "offset": 0,
                                                        "size": G}], [chunk.fd])
    view = m.view(0, G)
    try:
        os.ftruncate(chunk.fd, 0)  # what a hostile exporter does to the memfd it sent
        print("truncated", flush=True)
    except OSError as exc:
        print("refused", exc.errno, flush=True)
    print("read", int(view[G - 1]), flush=True)  # SIGBUS here when the memfd shrank
    del view
    m.close()
    os.close(chunk.fd)
"""


def test_a_peer_cannot_truncate_a_mapped_chunk() -> None:
    """Issue 16 defect 7: an exporter truncating its memfd after the importer mapped it
    killed the importer with SIGBUS on its next read. Chunks are sealed (shrink, grow,
    seal): the truncation is refused and the read works."""
    import errno
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _TRUNCATING_PEER], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert proc.stdout.split("\n")[:2] == [f"refused {errno.EPERM}", "read 0"]


def test_import_accepts_only_sealed_memfds(tmp_path) -> None:
    """A regular file on disk was accepted (and written through); an unsealed memfd could be
    truncated under the mapping. Both are refused, as is a pipe."""
    import fcntl

    drv = HostVmmDriver()
    path = tmp_path / "chunk.bin"
    path.write_bytes(b"\0" * G)
    plain = os.open(path, os.O_RDWR)
    unsealed = os.memfd_create("kvc-test-unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, G)
    half = os.memfd_create("kvc-test-half", os.MFD_ALLOW_SEALING)
    os.ftruncate(half, G)
    fcntl.fcntl(half, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)  # may still grow: refused too
    r, w = os.pipe()
    try:
        for fd, error in ((plain, "not a sealed memfd"), (r, "not a sealed memfd"),
                          (unsealed, "not sealed against resizing"),
                          (half, "not sealed against resizing")):
            with pytest.raises(ValueError, match=error):
                drv.import_fd(fd, G)
            with pytest.raises(IpcError, match=error):
                PeerMapping.import_chunks(drv, 2 * G, 2 * G, [{"segment": 0, "offset": 0,
                                                                "size": G}], [fd])
        with ExtensibleTensor(2 * G, drv, options=AllocationOptions(shareable=True)) as t:
            t.commit(G)
            (chunk,) = t.export_handles()
            try:
                seals = fcntl.fcntl(chunk.fd, fcntl.F_GET_SEALS)
                assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
                assert seals & fcntl.F_SEAL_SEAL  # nobody can add F_SEAL_WRITE under us
                drv.release(drv.import_fd(chunk.fd, G))
            finally:
                os.close(chunk.fd)
    finally:
        for fd in (plain, unsealed, half, r, w):
            os.close(fd)
