"""The fd-passing wire format: bounds, malformed peers, credentials, cleanup."""

from __future__ import annotations

import os
import socket
import stat
import struct

import pytest

from kvconnect import ExtensibleTensor
from kvconnect.ipc import (
    MAX_MESSAGE_BYTES,
    IpcError,
    PeerMapping,
    check_peer_uid,
    peer_credentials,
    private_socket_dir,
    recv_message,
    send_message,
)
from kvconnect.vmm.host import HostVmmDriver

G = 2 * 1024 * 1024


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


def test_timeout_and_closed_peer(pair) -> None:
    a, b = pair
    with pytest.raises(IpcError, match="timed out"):
        recv_message(b, timeout=0.2)
    a.close()
    with pytest.raises(IpcError, match="closed"):
        recv_message(b, timeout=1)


def test_rejects_bad_header_oversize_and_non_objects(pair) -> None:
    a, b = pair
    a.sendall(b"PICKLE!!")
    with pytest.raises(IpcError, match="bad message header"):
        recv_message(b, timeout=1)
    a.sendall(struct.pack(">4sI", b"KVC1", MAX_MESSAGE_BYTES + 1))
    with pytest.raises(IpcError, match="over the"):
        recv_message(b, timeout=1)
    for body, err in ((b"[1,2]", "expected an object"), (b"{nope", "invalid JSON")):
        a.sendall(struct.pack(">4sI", b"KVC1", len(body)) + body)
        with pytest.raises(IpcError, match=err):
            recv_message(b, timeout=1)


def test_too_many_fds_are_closed_not_leaked(pair) -> None:
    a, b = pair
    r, w = os.pipe()
    before = set(os.listdir("/proc/self/fd"))
    send_message(a, {"x": 1}, [r, w, r, w])
    with pytest.raises(IpcError, match="more than 1 fds"):
        recv_message(b, timeout=1, max_fds=1)
    assert set(os.listdir("/proc/self/fd")) <= before
    os.close(r)
    os.close(w)


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
        check_peer_uid(conn)
        with pytest.raises(IpcError, match="expected uid"):
            check_peer_uid(conn, uid=os.getuid() + 1)
        for s in (conn, cli, srv):
            s.close()
    assert not os.path.exists(d)


def test_peer_mapping_validates_records_and_cleans_up() -> None:
    drv = HostVmmDriver()
    with ExtensibleTensor(2 * 4 * G, drv, num_segments=2, shareable=True) as t:
        t.commit(G)
        t.segment_view(1).fill_(7)
        exported = t.export_handles()
        fds = [e.fd for e in exported]
        recs = [{"segment": e.segment, "offset": e.offset, "size": e.size} for e in exported]
        before = set(os.listdir("/proc/self/fd"))
        bad = [dict(recs[0]), dict(recs[1], offset=4 * G)]  # past segment 1
        with pytest.raises(IpcError, match="outside the peer's reservation"):
            PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, bad, fds)
        with pytest.raises(IpcError, match="2 chunk records but 1 fds"):
            PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds[:1])
        assert set(os.listdir("/proc/self/fd")) == before  # rollback released the imports
        with PeerMapping.import_chunks(drv, t.capacity_bytes, t.segment_capacity, recs, fds) as m:
            assert int(m.view(4 * G, G).min()) == 7
            with pytest.raises(ValueError, match="not inside one imported chunk"):
                m.view(G - 1, 2)
        assert set(os.listdir("/proc/self/fd")) == before
        for fd in fds:
            os.close(fd)
