"""Messages between processes on one host: JSON objects and file descriptors over a Unix
socket (torch-free; :mod:`kvconnect.ipc` re-exports every name here).

Wire format: a sequence of frames, each a 16-byte header then ``length`` body bytes::

    >4s B  B   H     I       I
     |  |  |   |     |       total fds of the message (MESSAGE frames; 0 otherwise)
     |  |  |   |     length of the body that follows (bytes)
     |  |  |   fds attached to this frame as SCM_RIGHTS (at most SCM_MAX_FD = 253)
     |  |  flags: bit 0 SEALED (the body starts with a seal, below); other bits must be 0
     |  kind: 1 MESSAGE (body: UTF-8 JSON object), 2 FDS (no body), 3 ERROR (body: JSON
     |        {"type", "message"} -- the sender failed; the receiver raises PeerError)
     magic b"KVC2"

A SEALED frame (a MESSAGE or ERROR sent through a :class:`FrameSeal`, whose key the two
ends of a connection share) carries ``>Q`` sequence number + 32-byte
HMAC-SHA256 before its JSON; the MAC covers the direction, the sequence number, the kind,
the total fd count and the JSON bytes. The receiver checks the MAC before parsing and wants
exactly the next sequence number: a frame from outside the session (forged), a changed byte
(tampered), a frame sent again (replayed), one sent back to its sender (reflected) or a
frame missing in between are all refused with :class:`IpcError`.

A message with more fds than one ``sendmsg`` may carry (Linux: 253, EINVAL above) is one
MESSAGE frame with the first 253 and FDS frames with the rest. Payloads are bounded
(:data:`MAX_MESSAGE_BYTES`, JSON nesting and integer digits through
:mod:`kvconnect.bounded_json`), fds too (:data:`MAX_FDS` per message). Nothing is unpickled.

Sockets live in a private 0700 directory (:func:`private_socket_dir`) and the peer is
checked with SO_PEERCRED (:func:`peer_credentials`). ``pidfd_getfd`` is never used: it needs
ptrace permission and one PID namespace, which containers often deny.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import hmac
import json
import os
import resource
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from .bounded_json import BoundedJSONError
from .bounded_json import loads as bounded_loads
from .errors import KvconnectError

__all__ = [
    "MAGIC", "MAX_FDS", "MAX_MESSAGE_BYTES", "SCM_MAX_FD", "SEAL_BYTES", "FrameSeal",
    "IpcError", "PeerCredentials", "PeerError", "PeerRefusedError", "check_peer",
    "check_peer_uid", "connect_unix", "peer_credentials", "private_socket_dir", "recv_json",
    "recv_message", "send_error", "send_message",
]

MAGIC = b"KVC2"
_FRAME = struct.Struct(">4sBBHII")
_MESSAGE, _FDS, _ERROR = 1, 2, 3
#: header flag: the body starts with a seal (sequence number + MAC)
_SEALED = 0x01
_SEAL = struct.Struct(">Q32s")
#: bytes a seal adds in front of a sealed frame's JSON body
SEAL_BYTES = _SEAL.size
#: largest JSON payload accepted from a peer (bytes)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: most fds in one message (sent in frames of :data:`SCM_MAX_FD`); the receiver must also
#: have that many descriptors free under its RLIMIT_NOFILE
MAX_FDS = 8192
#: most fds Linux passes in one SCM_RIGHTS message (``SCM_MAX_FD``; more gives EINVAL)
SCM_MAX_FD = 253
#: longest error text an ERROR frame carries (characters; longer text is cut)
MAX_ERROR_CHARS = 8192
_FD_SIZE = array.array("i").itemsize


class IpcError(KvconnectError, RuntimeError):
    """A peer sent something malformed, closed the socket, or did not answer in time."""


class PeerError(IpcError):
    """The peer failed and said why (an ERROR frame): ``remote_type`` is the name of the
    peer's exception class, ``remote_message`` its text."""

    def __init__(self, remote_type: str, remote_message: str) -> None:
        self.remote_type = remote_type
        self.remote_message = remote_message
        super().__init__(f"peer failed with {remote_type}: {remote_message}")


class PeerRefusedError(IpcError):
    """The process at the other end is not one this side may talk to: another uid, a pid
    that was not announced, an unknown protocol version."""


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int


class FrameSeal:
    """Authenticates the frames of one connection, in both directions (HMAC-SHA256).

    ``key`` is the connection's secret (a fresh one per connection, agreed by its two
    ends); ``send_label`` / ``recv_label`` name the two directions (different on the
    two ends, so a frame sent back to its sender does not verify). Sequence numbers start
    at 0 in each direction and grow by one per sealed frame. Not thread-safe: one sender
    and one receiver at a time.
    """

    def __init__(self, key: bytes, send_label: bytes, recv_label: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"a frame seal needs a key of at least 16 bytes, got {len(key)}")
        if send_label == recv_label:
            raise ValueError("the two directions of a frame seal need different labels")
        self._key = bytes(key)
        self._send_label = bytes(send_label)
        self._recv_label = bytes(recv_label)
        #: sequence number of the next frame this side sends / expects
        self.send_seq = 0
        self.recv_seq = 0

    def _mac(self, label: bytes, seq: int, kind: int, total_fds: int, body: bytes) -> bytes:
        head = struct.pack(">B", len(label)) + label + struct.pack(">QBI", seq, kind, total_fds)
        return hmac.new(self._key, head + body, hashlib.sha256).digest()

    def seal(self, kind: int, total_fds: int, body: bytes) -> bytes:
        """The seal to put in front of ``body`` (uses up one send sequence number)."""
        seq = self.send_seq
        self.send_seq += 1
        return _SEAL.pack(seq, self._mac(self._send_label, seq, kind, total_fds, body))

    def open(self, kind: int, total_fds: int, sealed: bytes) -> bytes:
        """Verify a received sealed body and return the JSON behind the seal; IpcError when
        the MAC does not match (forged, tampered, reflected or from another connection) or
        the sequence number is not the next one (replayed, reordered or missing)."""
        if len(sealed) < SEAL_BYTES:
            raise IpcError(f"sealed frame of {len(sealed)} bytes is shorter than its "
                           f"{SEAL_BYTES}-byte seal")
        seq, mac = _SEAL.unpack_from(sealed)
        body = sealed[SEAL_BYTES:]
        if not hmac.compare_digest(mac, self._mac(self._recv_label, seq, kind, total_fds, body)):
            raise IpcError("refused a frame whose seal does not verify: forged, tampered with, "
                           "sent back to its sender or from another connection")
        if seq != self.recv_seq:
            what = "replayed (already received)" if seq < self.recv_seq else \
                "out of order (frames are missing before it)"
            raise IpcError(f"refused frame number {seq}, expected {self.recv_seq}: {what}")
        self.recv_seq += 1
        return body


@contextlib.contextmanager
def private_socket_dir(prefix: str = "kvconnect-") -> Iterator[str]:
    """A fresh 0700 directory for Unix sockets, removed on exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        os.chmod(path, 0o700)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A stream socket connected to the Unix socket ``path`` within ``timeout`` seconds, with
    that timeout set on it.

    Linux answers a connect to a listener whose backlog is full with ``EAGAIN`` at once when
    the socket has a timeout (Python's ``BlockingIOError``), where a TCP connect would wait:
    retry, backing off, until the deadline, then raise :class:`IpcError` saying so. Other
    errors (no such socket, refused) are raised as they are (``OSError``)."""
    deadline = time.monotonic() + timeout
    pause = 1e-3
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.connect(path)
            sock.settimeout(timeout)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise IpcError(f"{path}: the listener's backlog stayed full for {timeout:g} s "
                               "(it is not accepting connections)") from None
        except BaseException:
            sock.close()
            raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid/uid/gid (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def check_peer_uid(sock: socket.socket, uid: int | None = None) -> PeerCredentials:
    """Raise :class:`PeerRefusedError` unless the peer runs as ``uid`` (default: ours)."""
    return check_peer(sock, uid=uid)


def check_peer(sock: socket.socket, *, allowed_pids: Collection[int] | None = None,
               uid: int | None = None) -> PeerCredentials:
    """The peer's credentials (SO_PEERCRED, taken by the kernel at ``connect``), or
    :class:`PeerRefusedError` when it runs as another uid than ``uid`` (default: ours) or,
    with ``allowed_pids`` given, its pid is not one of them."""
    creds = peer_credentials(sock)
    want = os.getuid() if uid is None else uid
    if creds.uid != want:
        raise PeerRefusedError(f"refused peer pid {creds.pid}: it runs as uid {creds.uid}, "
                               f"expected uid {want}")
    if allowed_pids is not None and creds.pid not in allowed_pids:
        raise PeerRefusedError(f"refused peer pid {creds.pid} (uid {creds.uid}): not an "
                               "announced peer of this process")
    return creds


# -- sending -------------------------------------------------------------------------------------
def _send_frame(sock: socket.socket, kind: int, body: bytes, fds: Sequence[int],
                total_fds: int = 0, seal: FrameSeal | None = None) -> None:
    flags = 0
    if seal is not None:
        body = seal.seal(kind, total_fds, body) + body
        flags = _SEALED
    data = _FRAME.pack(MAGIC, kind, flags, len(fds), len(body), total_fds) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def send_message(sock: socket.socket, payload: dict, fds: Sequence[int] = (), *,
                 seal: FrameSeal | None = None) -> None:
    """Send one JSON object and any number (up to :data:`MAX_FDS`) of fds, which stay owned
    by the caller; sealed with ``seal`` inside a session. Raises ValueError (before sending
    anything) for too many fds or an oversized payload, OSError when the socket fails."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per message, got {len(fds)}")
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    fds = list(fds)
    _send_frame(sock, _MESSAGE, body, fds[:SCM_MAX_FD], len(fds), seal)
    for start in range(SCM_MAX_FD, len(fds), SCM_MAX_FD):
        _send_frame(sock, _FDS, b"", fds[start:start + SCM_MAX_FD])


def send_error(sock: socket.socket, error: BaseException | str, *,
               seal: FrameSeal | None = None) -> bool:
    """Tell the peer that this side failed, so its :func:`recv_message` raises
    :class:`PeerError` with our error instead of "peer closed the connection".

    Best effort, never raises: returns False when the socket is already broken. Send it
    only at a message boundary (not after a :func:`send_message` that failed part-way)."""
    if isinstance(error, BaseException):
        kind, text = type(error).__name__, str(error)
    else:
        kind, text = "Error", str(error)
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS - 3] + "..."
    body = json.dumps({"type": kind[:200], "message": text}).encode()
    try:
        _send_frame(sock, _ERROR, body, (), seal=seal)
    except OSError:
        return False
    return True


# -- receiving -----------------------------------------------------------------------------------
def _deadline_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise IpcError("timed out waiting for the peer")
    return left


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(_deadline_left(deadline))
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise IpcError("timed out waiting for the peer") from None
        if not chunk:
            raise IpcError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float | None, room: int, fds: list[int],
                seal: FrameSeal | None) -> tuple[int, int, int, int, int]:
    """Read one frame header, appending the fds that came with it to ``fds`` (room for at
    most ``room``). Returns ``(kind, flags, nfds, length, total_fds)``; an ERROR frame
    raises (:class:`PeerError`, after its seal is checked inside a session)."""
    sock.settimeout(_deadline_left(deadline))
    try:
        msg, anc, flags, _ = sock.recvmsg(
            _FRAME.size, socket.CMSG_SPACE(room * _FD_SIZE) if room else 0)
    except TimeoutError:
        raise IpcError("timed out waiting for the peer") from None
    got = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got.frombytes(data[:len(data) - len(data) % _FD_SIZE])
    fds.extend(got)
    if flags & socket.MSG_CTRUNC:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise IpcError(f"the peer sent fds this side could not take: more than {room} "
                       f"expected here, or this process reached its open-file limit "
                       f"(RLIMIT_NOFILE {soft})")
    if not msg:
        raise IpcError("peer closed the connection")
    if len(msg) < _FRAME.size:
        msg += _recv_exact(sock, _FRAME.size - len(msg), deadline)
    magic, kind, frame_flags, nfds, length, total = _FRAME.unpack(msg)
    if magic != MAGIC:
        raise IpcError(f"bad message header {magic!r} (not a kvconnect peer, or another "
                       f"version of it: expected {MAGIC!r})")
    if frame_flags & ~_SEALED:
        raise IpcError(f"unknown frame flags {frame_flags:#04x} (another version of "
                       "kvconnect?)")
    sealed = bool(frame_flags & _SEALED)
    if kind in (_MESSAGE, _ERROR) and sealed != (seal is not None):
        raise IpcError("refused an unsealed frame inside an authenticated session" if seal
                       else "got a sealed frame outside an authenticated session")
    if kind == _FDS and sealed:
        raise IpcError("an fd frame cannot be sealed (the message frame before it is)")
    if kind == _ERROR:
        _raise_peer_error(sock, length, total, deadline, seal)
    if kind not in (_MESSAGE, _FDS):
        raise IpcError(f"unknown frame kind {kind}")
    if nfds != len(got):
        raise IpcError(f"frame announced {nfds} fds but carried {len(got)}")
    return kind, frame_flags, nfds, length, total


def _raise_peer_error(sock: socket.socket, length: int, total: int, deadline: float | None,
                      seal: FrameSeal | None) -> None:
    limit = 4 * MAX_ERROR_CHARS + 1024 + (SEAL_BYTES if seal else 0)
    if length > limit:
        raise IpcError(f"peer sent an error report of {length} bytes (limit {limit})")
    body = _recv_exact(sock, length, deadline)
    if seal is not None:
        body = seal.open(_ERROR, total, body)
    try:
        doc = bounded_loads(body, max_depth=2)
    except BoundedJSONError as exc:
        raise IpcError(f"peer failed and sent an unreadable error report: {exc}") from None
    if not isinstance(doc, dict):
        raise IpcError("peer failed and sent an unreadable error report")
    kind, text = doc.get("type"), doc.get("message")
    raise PeerError(kind[:200] if isinstance(kind, str) else "Error",
                    text[:MAX_ERROR_CHARS] if isinstance(text, str) else repr(text)[:200])


def recv_message(
    sock: socket.socket, timeout: float | None = None, max_fds: int = MAX_FDS, *,
    seal: FrameSeal | None = None,
) -> tuple[dict, list[int]]:
    """Receive one message: ``(payload, fds)``. The caller owns the returned fds.

    Raises :class:`PeerError` when the peer sent an error instead, and IpcError on a
    timeout (``timeout`` seconds for the whole message), a closed peer, a bad header, more
    than ``max_fds`` fds, an oversized, too deeply nested or non-object payload, and, with
    ``seal`` (inside a session), a frame that is unsealed, does not verify or is not the
    next in sequence. On any error every fd received so far is closed, and the stream is
    out of step (the rest of that message is still queued): close the connection.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    max_fds = max(0, min(int(max_fds), MAX_FDS))
    fds: list[int] = []
    try:
        kind, _, _, length, total = _recv_frame(sock, deadline, min(max_fds, SCM_MAX_FD), fds,
                                                seal)
        if kind != _MESSAGE:
            raise IpcError(f"expected a message frame, got frame kind {kind}")
        if total > max_fds:
            raise IpcError(f"peer announced {total} fds, more than the {max_fds} accepted here")
        if len(fds) > total:
            raise IpcError(f"peer sent {len(fds)} fds with a message announcing {total}")
        limit = MAX_MESSAGE_BYTES + (SEAL_BYTES if seal else 0)
        if length > limit:
            raise IpcError(f"peer announced {length} bytes, over the {limit} limit")
        body = _recv_exact(sock, length, deadline)
        if seal is not None:  # checked before anything of the body is parsed
            body = seal.open(_MESSAGE, total, body)
        while len(fds) < total:
            kind, _, nfds, extra, _ = _recv_frame(sock, deadline,
                                                  min(total - len(fds), SCM_MAX_FD), fds, seal)
            if kind != _FDS or nfds == 0 or extra or len(fds) > total:
                raise IpcError(f"malformed fd frame after a message announcing {total} fds "
                               f"(kind {kind}, {nfds} fds, {extra} body bytes)")
        try:
            payload = bounded_loads(body)
        except BoundedJSONError as exc:
            raise IpcError(f"peer sent invalid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise IpcError(f"peer sent a JSON {type(payload).__name__}, expected an object")
        return payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def recv_json(sock: socket.socket, timeout: float | None = None, *,
              seal: FrameSeal | None = None) -> dict:
    """Receive one message that must carry no fds (one with fds raises IpcError, and the
    kernel closes them); returns its JSON object."""
    payload, _ = recv_message(sock, timeout, max_fds=0, seal=seal)
    return payload
