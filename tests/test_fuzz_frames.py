"""IPC frames fuzzed (hypothesis): whatever a peer writes on the socket -- any header
(magic, kind, flags, fd count, length, total fds), any body, real fds attached in any
number, the stream cut anywhere -- ``recv_message`` returns a JSON object with exactly the
fds the message announced, or raises IpcError; no fd stays open."""

from __future__ import annotations

import json
import os
import socket
import struct

import _reliability as fuzz
from hypothesis import given
from hypothesis import strategies as st

from kvconnect.framing import (
    MAGIC,
    MAX_FDS,
    MAX_MESSAGE_BYTES,
    SCM_MAX_FD,
    IpcError,
    recv_message,
)

HEADER = struct.Struct(">4sBBHII")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=8), kids,
                                                               max_size=5),
    max_leaves=20)

bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(max_size=8), json_values, max_size=6).map(
        lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.integers(1, 2000).map(lambda n: b'{"a":' + b"[" * n + b"]" * n + b"}"),
    st.integers(30, 5000).map(lambda n: b'{"n":' + b"9" * n + b"}"),
    st.just(b"\x80\x04\x95pickle"),
)


@st.composite
def frames(draw: st.DrawFn) -> tuple[bytes, int]:
    """One frame: (bytes, number of real fds to attach to it)."""
    body = draw(bodies)
    attach = draw(st.integers(0, 4))
    if draw(st.integers(0, 3)) == 0:  # a well-formed header (the body may still be bad)
        return HEADER.pack(MAGIC, 1, 0, attach, len(body), attach) + body, attach
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"KVC1", b"KVC3", b"\x00" * 4]))
    kind = draw(st.sampled_from([1, 1, 1, 2, 3, 0, 4, 255]))
    flags = draw(st.sampled_from([0, 0, 0, 1, 2, 0x80]))
    nfds = draw(st.one_of(st.just(attach), st.integers(0, 300)))
    length = draw(st.one_of(st.just(len(body)), st.integers(0, len(body) + 64),
                            st.sampled_from([MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES + 1,
                                             (1 << 32) - 1])))
    total = draw(st.one_of(st.just(nfds), st.just(attach), st.integers(0, MAX_FDS + 8),
                           st.just((1 << 32) - 1)))
    return HEADER.pack(magic, kind, flags, nfds, length, total) + body, attach


streams = st.tuples(
    st.lists(frames(), min_size=1, max_size=3),
    st.one_of(st.none(), st.integers(0, 400)),        # cut the stream after this many bytes
    st.sampled_from([0, 1, 3, SCM_MAX_FD, MAX_FDS]),  # max_fds of the receiver
)


def _send_stream(sock: socket.socket, frame_list: list[tuple[bytes, int]], cut: int | None,
                 pipe: tuple[int, int]) -> int:
    """Write the frames (each with its real fds); returns how many bytes went out."""
    sent = 0
    for data, attach in frame_list:
        if cut is not None:
            if sent >= cut:
                break
            data = data[:cut - sent]
        fds = [pipe[0]] * attach
        if fds:
            n = socket.send_fds(sock, [data[:16]], fds)
            sock.sendall(data[n:])
        else:
            sock.sendall(data)
        sent += len(data)
    return sent


def test_any_byte_stream_gives_a_message_or_ipc_error() -> None:
    """Any header, body, attached fds and cut of the stream: a JSON object with exactly
    the announced fds, or IpcError; no fd left open; a frame with any flag bit set is
    refused (none is defined)."""
    n = fuzz.examples(1000)
    tally = fuzz.Tally("IPC frames: recv_message", "IpcError", n)
    pipe = os.pipe()
    baseline = fuzz.open_fds()

    @fuzz.fuzz_settings(1000)
    @given(streams)
    def run(stream: tuple) -> None:
        frame_list, cut, max_fds = stream
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _send_stream(a, frame_list, cut, pipe)
            a.shutdown(socket.SHUT_WR)  # the peer is done: a short stream reads as closed
            got = tally.run(lambda: recv_message(b, timeout=5, max_fds=max_fds), (IpcError,))
            if not isinstance(got, IpcError):
                msg, fds = got
                assert isinstance(msg, dict)
                first = HEADER.unpack(frame_list[0][0][:16])
                assert first[2] == 0, "a frame with a flag bit set was accepted"
                assert len(fds) == first[5] <= max_fds  # exactly the fds announced
                for fd in fds:
                    os.close(fd)
        finally:
            a.close()
            b.close()
        assert fuzz.open_fds() == baseline, "a received fd was left open"

    try:
        run()
    finally:
        os.close(pipe[0])
        os.close(pipe[1])
    tally.record()
    assert tally.tried >= n and tally.outcomes["IpcError"] > 0

