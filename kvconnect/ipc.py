"""POSIX-FD handle exchange between processes on one host, and mapping a peer's chunks.

Wire format (one message): an 8-byte header ``b"KVC1"`` + big-endian uint32 payload length,
then that many bytes of UTF-8 JSON (a JSON object). File descriptors ride on the first
``sendmsg`` as SCM_RIGHTS. Payloads are bounded (:data:`MAX_MESSAGE_BYTES`), fds too
(:data:`MAX_FDS`). Nothing is ever unpickled.

Sockets live in a private 0700 directory (:func:`private_socket_dir`) and the peer is
checked with SO_PEERCRED (:func:`peer_credentials`). ``pidfd_getfd`` is never used: it needs
ptrace permission and one PID namespace, which containers often deny.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ._pointer_view import pointer_view
from .vmm import PhysicalHandle, VmmDriver

MAGIC = b"KVC1"
_HEADER = struct.Struct(">4sI")
#: largest JSON payload accepted from a peer (bytes)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: most fds accepted with one message
MAX_FDS = 1024


class IpcError(RuntimeError):
    """A peer sent something malformed, closed the socket, or did not answer in time."""


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


def peer_credentials(sock: socket.socket) -> PeerCredentials:
    """The connected peer's pid/uid/gid (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def check_peer_uid(sock: socket.socket, uid: int | None = None) -> PeerCredentials:
    """Raise IpcError unless the peer runs as ``uid`` (default: our own uid)."""
    creds = peer_credentials(sock)
    want = os.getuid() if uid is None else uid
    if creds.uid != want:
        raise IpcError(f"peer pid {creds.pid} runs as uid {creds.uid}, expected uid {want}")
    return creds


def _deadline_left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise IpcError("timed out waiting for the peer")
    return left


def send_message(sock: socket.socket, payload: dict, fds: Sequence[int] = ()) -> None:
    """Send one JSON object (and optional fds, which stay owned by the caller)."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per message, got {len(fds)}")
    body = json.dumps(payload, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    data = _HEADER.pack(MAGIC, len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
    else:
        sent = sock.send(data)
    if sent < len(data):
        sock.sendall(data[sent:])


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


def recv_message(
    sock: socket.socket, timeout: float | None = None, max_fds: int = MAX_FDS
) -> tuple[dict, list[int]]:
    """Receive one message: ``(payload, fds)``. The caller owns the returned fds.

    Raises IpcError on timeout, a closed peer, a bad header, an oversized or non-object payload.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    sock.settimeout(_deadline_left(deadline))
    fds_arr = array.array("i")
    try:
        msg, anc, flags, _ = sock.recvmsg(
            _HEADER.size, socket.CMSG_SPACE(max_fds * fds_arr.itemsize)
        )
    except TimeoutError:
        raise IpcError("timed out waiting for the peer") from None
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % fds_arr.itemsize
            fds_arr.frombytes(data[:usable])
    fds = list(fds_arr)
    try:
        if flags & socket.MSG_CTRUNC:
            raise IpcError(f"peer sent more than {max_fds} fds")
        if not msg:
            raise IpcError("peer closed the connection")
        if len(msg) < _HEADER.size:
            msg += _recv_exact(sock, _HEADER.size - len(msg), deadline)
        magic, length = _HEADER.unpack(msg)
        if magic != MAGIC:
            raise IpcError(f"bad message header {magic!r} (not a kvconnect peer?)")
        if length > MAX_MESSAGE_BYTES:
            raise IpcError(f"peer announced {length} bytes, over the {MAX_MESSAGE_BYTES} limit")
        body = _recv_exact(sock, length, deadline)
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise IpcError(f"peer sent invalid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise IpcError(f"peer sent a JSON {type(payload).__name__}, expected an object")
        return payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


@dataclass
class _ImportedChunk:
    va: int
    size: int
    handle: PhysicalHandle


class PeerMapping:
    """A peer's exported chunks mapped into a local reservation with the peer's layout.

    Byte ``x`` of the peer's reservation appears at ``base_ptr + x``, so a peer address
    ``a`` translates to ``base_ptr + (a - peer_base_ptr)``. Owns its reservation and
    imported handles; :meth:`close` releases them (idempotent).
    """

    def __init__(self, driver: VmmDriver, capacity_bytes: int, segment_capacity: int,
                 access_devices: Sequence[int] = ()) -> None:
        self.driver = driver
        self.access_devices = tuple(access_devices)
        self.capacity_bytes = capacity_bytes
        self.segment_capacity = segment_capacity
        driver.ensure_context()
        self.base_ptr = driver.reserve(capacity_bytes)
        self._chunks: list[_ImportedChunk] = []
        self._closed = False

    @classmethod
    def import_chunks(
        cls,
        driver: VmmDriver,
        capacity_bytes: int,
        segment_capacity: int,
        chunks: Sequence[dict],
        fds: Sequence[int],
        access_devices: Sequence[int] = (),
    ) -> PeerMapping:
        """Map chunks described as ``{"segment", "offset", "size"}`` (one fd each, same order).

        ``access_devices`` are peer GPUs that also get access (e.g. the exporter's device, so
        copies driven from either side work). Validates every record against the capacity
        before mapping; on any failure nothing stays mapped. The fds remain owned by the caller.
        """
        if len(chunks) != len(fds):
            raise IpcError(f"{len(chunks)} chunk records but {len(fds)} fds")
        if segment_capacity <= 0 or capacity_bytes % segment_capacity:
            raise IpcError(f"bad peer geometry: capacity {capacity_bytes}, segment {segment_capacity}")
        mapping = cls(driver, capacity_bytes, segment_capacity, access_devices)
        try:
            for rec, fd in zip(chunks, fds, strict=True):
                seg, off, size = (int(rec["segment"]), int(rec["offset"]), int(rec["size"]))
                start = seg * segment_capacity + off
                if seg < 0 or off < 0 or size <= 0 or off + size > segment_capacity \
                        or start + size > capacity_bytes:
                    raise IpcError(f"chunk record {rec} lies outside the peer's reservation")
                mapping._map(start, size, fd)
        except BaseException:
            mapping.close()
            raise
        return mapping

    def _map(self, offset: int, size: int, fd: int) -> None:
        handle = self.driver.import_fd(fd, size)
        va = self.base_ptr + offset
        try:
            self.driver.map(va, size, handle)
        except BaseException:
            self.driver.release(handle)
            raise
        self._chunks.append(_ImportedChunk(va, size, handle))
        self.driver.set_access(va, size, self.access_devices)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor of ``nbytes`` at reservation offset ``offset``; must lie in one chunk."""
        if self._closed:
            raise RuntimeError("PeerMapping used after close()")
        addr = self.base_ptr + offset
        for c in self._chunks:
            if c.va <= addr and addr + nbytes <= c.va + c.size:
                return pointer_view(addr, nbytes, self.driver, self)
        raise ValueError(f"range [{offset}, {offset + nbytes}) is not inside one imported chunk")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._chunks:
            self.driver.synchronize()
        try:
            while self._chunks:
                c = self._chunks.pop()
                self.driver.unmap_and_release(c.va, c.size, c.handle)
        finally:
            self.driver.free_reserved(self.base_ptr, self.capacity_bytes)

    def __enter__(self) -> PeerMapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
