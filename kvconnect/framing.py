"""Messages between processes on one host: JSON objects and file descriptors over a Unix
socket (torch-free; :mod:`kvconnect.ipc` maps the chunks these messages carry).

Wire format: a sequence of frames, each a 16-byte header then ``length`` body bytes::

    >4s B  B   H     I       I
     |  |  |   |     |       total fds of the message (MESSAGE frames; 0 otherwise)
     |  |  |   |     length of the body that follows (bytes)
     |  |  |   fds attached to this frame as SCM_RIGHTS (at most SCM_MAX_FD = 253)
     |  |  flags: none defined, must be 0 (a frame with any bit set is refused)
     |  kind: 1 MESSAGE (body: UTF-8 JSON object), 2 FDS (no body), 3 ERROR (body: JSON
     |        {"type", "message"} -- the sender failed; the receiver raises PeerError)
     magic b"KVC2"

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
import json
import os
import resource
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .bounded_json import BoundedJSONError
from .bounded_json import loads as bounded_loads
from .errors import KvconnectError

__all__ = [
    "MAGIC", "MAX_FDS", "MAX_MESSAGE_BYTES", "SCM_MAX_FD", "WIRE_VERSION", "IpcError",
    "PeerCredentials", "PeerError", "PeerRefusedError", "PeerTimeoutError", "check_peer",
    "connect_unix", "kernel_boot_id", "listen_unix", "peer_credentials", "private_socket_dir",
    "recv_json", "recv_message", "send_error", "send_message",
]

#: version of the frame format (bump when the header changes); the magic's last byte
WIRE_VERSION = 2
MAGIC = b"KVC" + str(WIRE_VERSION).encode("ascii")
_FRAME = struct.Struct(">4sBBHII")
_MESSAGE, _FDS, _ERROR = 1, 2, 3
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
_T = TypeVar("_T")


class IpcError(KvconnectError, RuntimeError):
    """A peer sent something malformed, closed the socket, or did not answer in time."""


class PeerTimeoutError(IpcError):
    """The peer did not answer (or accept the connection) within the deadline: it may be
    busy rather than gone, so a later attempt can succeed."""


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


@contextlib.contextmanager
def private_socket_dir(prefix: str = "kvconnect-") -> Iterator[str]:
    """A fresh 0700 directory for Unix sockets, removed on exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        os.chmod(path, 0o700)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def kernel_boot_id() -> str:
    """This kernel's boot id (``/proc/sys/kernel/random/boot_id``; one per host and boot,
    containers share their host's): processes with equal ids can pass fds and share memfds.
    ``""`` when it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def listen_unix(path: str, backlog: int = socket.SOMAXCONN,
                accept_timeout: float | None = None) -> socket.socket:
    """A stream socket listening on the Unix socket ``path`` (created here, mode 0600: this
    uid only), with ``accept_timeout`` seconds set on it (None: blocking). The socket is
    closed again if any step fails."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(backlog)
        sock.settimeout(accept_timeout)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_unix(path: str, timeout: float) -> socket.socket:
    """A stream socket connected to the Unix socket ``path`` within ``timeout`` seconds, with
    that timeout set on it.

    Linux answers a connect to a listener whose backlog is full with ``EAGAIN`` at once when
    the socket has a timeout (Python's ``BlockingIOError``), where a TCP connect would wait:
    retry, backing off, until the deadline, then raise :class:`PeerTimeoutError` saying so.
    Other errors (no such socket, refused) are raised as they are (``OSError``)."""
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
                raise PeerTimeoutError(f"{path}: the listener's backlog stayed full for "
                                       f"{timeout:g} s (it is not accepting connections)"
                                       ) from None
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
                total_fds: int = 0) -> None:
    data = _FRAME.pack(MAGIC, kind, 0, len(fds), len(body), total_fds) + body
    sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


def send_message(sock: socket.socket, payload: Mapping[str, Any], fds: Sequence[int] = ()
                 ) -> None:
    """Send one JSON object and any number (up to :data:`MAX_FDS`) of fds, which stay owned
    by the caller. Raises ValueError (before sending anything) for too many fds or an oversized payload, OSError when the socket fails."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per message, got {len(fds)}")
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    fds = list(fds)
    _send_frame(sock, _MESSAGE, body, fds[:SCM_MAX_FD], len(fds))
    for start in range(SCM_MAX_FD, len(fds), SCM_MAX_FD):
        _send_frame(sock, _FDS, b"", fds[start:start + SCM_MAX_FD])


def send_error(sock: socket.socket, error: BaseException | str) -> bool:
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
        _send_frame(sock, _ERROR, body, ())
    except OSError:
        return False
    return True


# -- receiving -----------------------------------------------------------------------------------
def _before(deadline: float | None, sock: socket.socket, call: Callable[..., _T],
            *args: Any) -> _T:
    """``call(*args)``, a read of ``sock``, with the time left until ``deadline`` (None: no
    limit) as the socket's timeout; :class:`PeerTimeoutError` once it passes."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
        raise PeerTimeoutError("timed out waiting for the peer")
    sock.settimeout(left)
    try:
        return call(*args)
    except TimeoutError:
        raise PeerTimeoutError("timed out waiting for the peer") from None


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = _before(deadline, sock, sock.recv, n - len(buf))
        if not chunk:
            raise IpcError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket, deadline: float | None, room: int,
                fds: list[int]) -> tuple[int, int, int, int]:
    """Read one frame header, appending the fds that came with it to ``fds`` (room for at
    most ``room``). Returns ``(kind, nfds, length, total_fds)``; an ERROR frame raises
    :class:`PeerError`."""
    msg, anc, flags, _ = _before(deadline, sock, sock.recvmsg, _FRAME.size,
                                 socket.CMSG_SPACE(room * _FD_SIZE) if room else 0)
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
    if frame_flags:
        raise IpcError(f"unknown frame flags {frame_flags:#04x} (another version of "
                       "kvconnect?)")
    if kind == _ERROR:
        _raise_peer_error(sock, length, deadline)
    if kind not in (_MESSAGE, _FDS):
        raise IpcError(f"unknown frame kind {kind}")
    if nfds != len(got):
        raise IpcError(f"frame announced {nfds} fds but carried {len(got)}")
    return kind, nfds, length, total


def _raise_peer_error(sock: socket.socket, length: int, deadline: float | None) -> None:
    limit = 4 * MAX_ERROR_CHARS + 1024
    if length > limit:
        raise IpcError(f"peer sent an error report of {length} bytes (limit {limit})")
    body = _recv_exact(sock, length, deadline)
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
    sock: socket.socket, timeout: float | None = None, max_fds: int = MAX_FDS,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> tuple[dict, list[int]]:
    """Receive one message: ``(payload, fds)``. The caller owns the returned fds.

    Raises :class:`PeerError` when the peer sent an error instead, and IpcError on a
    timeout (``timeout`` seconds for the whole message), a closed peer, a bad header, more
    than ``max_fds`` fds, a payload over ``max_bytes`` (at most :data:`MAX_MESSAGE_BYTES`),
    too deeply nested or not an object. On any error every fd received so far is closed,
    and the stream is out of step (the rest of that message is still queued): close the
    connection.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    max_fds = max(0, min(int(max_fds), MAX_FDS))
    max_bytes = max(0, min(int(max_bytes), MAX_MESSAGE_BYTES))
    fds: list[int] = []
    try:
        kind, _, length, total = _recv_frame(sock, deadline, min(max_fds, SCM_MAX_FD), fds)
        if kind != _MESSAGE:
            raise IpcError(f"expected a message frame, got frame kind {kind}")
        if total > max_fds:
            raise IpcError(f"peer announced {total} fds, more than the {max_fds} accepted here")
        if len(fds) > total:
            raise IpcError(f"peer sent {len(fds)} fds with a message announcing {total}")
        if length > max_bytes:
            raise IpcError(f"peer announced {length} bytes, over the {max_bytes} limit")
        body = _recv_exact(sock, length, deadline)
        while len(fds) < total:
            kind, nfds, extra, _ = _recv_frame(sock, deadline,
                                               min(total - len(fds), SCM_MAX_FD), fds)
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


def recv_json(sock: socket.socket, timeout: float | None = None,
              max_bytes: int = MAX_MESSAGE_BYTES) -> dict:
    """Receive one message that must carry no fds (one with fds raises IpcError, and the
    kernel closes them) and at most ``max_bytes`` of JSON; returns its JSON object."""
    payload, _ = recv_message(sock, timeout, max_fds=0, max_bytes=max_bytes)
    return payload
