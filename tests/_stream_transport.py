"""A third-party transport in one file: ``stream`` copies KV blocks through a Unix stream
socket (the serving worker gathers the blocks' bytes, the receiving one scatters them).

It exists to prove the extension point (tests/test_transport_plugin.py): this module and its
one registration line at the bottom are all it takes for ``kvconnect-validate --transport-module
_stream_transport --transports stream`` to run it end to end. It uses only the public API:
the spec types, ``TransportContext`` and the cache's committed regions. Slow on purpose
(a copy through the kernel per request), never used for measurements.

Wire: a request is a 4-byte big-endian length and JSON ``{"ids": [...]}``; the answer an
8-byte length and the blocks' bytes, region by region (each region's blocks in request
order), or a length of 2**64-1 followed by a 4-byte length and a UTF-8 error text.
Units: bytes, seconds, logical blocks for block ids.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvconnect.connectors.errors import KVConnectorError, KVTransferError
from kvconnect.connectors.registry import register_transport
from kvconnect.connectors.transport import FetchResult, TransportContext, TransportSpec
from kvconnect.framing import peer_credentials

_FAILED = 2**64 - 1
_MAX_REQUEST = 1 << 20


def _rows(cache: Any) -> list[torch.Tensor]:
    """``(num_blocks, block_len)`` uint8 views of every committed region, in region order."""
    out = []
    for r in cache.committed_regions():
        view = cache.region_view(r)
        out.append(view.as_strided((r.num_blocks, r.block_len), (r.block_stride, 1)))
    return out


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"peer closed the stream after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


class StreamExporter:
    """Serves this worker's blocks on ``<directory>/<name>.stream.sock`` to allowed pids."""

    def __init__(self, ctx: TransportContext) -> None:
        self.cache, self.allowed, self.timeout = ctx.cache, ctx.allowed_pids, ctx.timeout
        self.path = os.path.join(ctx.directory, f"{ctx.name}.stream.sock")
        self._open = threading.Event()  # cleared while paused (the cache sleeps)
        self._open.set()
        self._closed = False
        self._clients: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(8)
        self._listener.settimeout(0.05)
        self._threads.append(threading.Thread(target=self._accept, daemon=True))
        self._threads[0].start()

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "block_lens": [r.shape[1] for r in _rows(self.cache)]}

    def pause(self) -> None:
        self._open.clear()

    def resume(self) -> None:
        self._open.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            creds = peer_credentials(conn)
            if creds.uid != os.getuid() or creds.pid not in self.allowed():
                conn.close()
                continue
            self._clients.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                (n,) = struct.unpack(">I", _recv(conn, 4))
                if n > _MAX_REQUEST:
                    raise ValueError(f"request of {n} bytes")
                ids = [int(i) for i in json.loads(_recv(conn, n))["ids"]]
                if not self._open.wait(self.timeout):
                    raise TimeoutError("the cache slept for longer than the deadline")
                try:
                    idx = torch.tensor(ids, dtype=torch.int64)
                    payload = b"".join(rows.index_select(0, idx.to(rows.device)).cpu()
                                       .numpy().tobytes() for rows in _rows(self.cache))
                except Exception as exc:  # noqa: BLE001 - told to the peer
                    text = f"{type(exc).__name__}: {exc}".encode()
                    conn.sendall(struct.pack(">QI", _FAILED, len(text)) + text)
                    continue
                conn.sendall(struct.pack(">Q", len(payload)) + payload)
        except (OSError, ValueError, KeyError, ConnectionError):
            pass  # the peer left (or sent garbage): drop the connection

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._threads[0].join(timeout=5)  # the accept loop sees _closed within 50 ms
        self._listener.close()
        for conn in self._clients:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread out of recv()
            except OSError:
                pass
            conn.close()
        for t in self._threads[1:]:
            t.join(timeout=5)
        if os.path.exists(self.path):
            os.unlink(self.path)


class StreamTransport:
    """Fetches a peer's blocks through its :class:`StreamExporter` (one connection per
    peer, opened by :meth:`open_peer`)."""

    name = "stream"

    def __init__(self, ctx: TransportContext) -> None:
        self.cache, self.timeout = ctx.cache, ctx.timeout
        self._peers: dict[str, tuple[str, socket.socket]] = {}

    def open_peer(self, peer: str, offer: Mapping[str, Any]) -> float:
        path = str(offer["path"])
        if peer in self._peers and self._peers[peer][0] == path:
            return 0.0
        mine = [r.shape[1] for r in _rows(self.cache)]
        if list(offer["block_lens"]) != mine:
            raise KVConnectorError(f"stream: {peer}'s regions {offer['block_lens']} != {mine}")
        t0 = time.perf_counter()
        self.invalidate(peer)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        self._peers[peer] = (path, sock)
        return time.perf_counter() - t0

    def fetch(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int], *,
              timeout: float | None = None) -> FetchResult:
        if peer not in self._peers:
            raise KVConnectorError(f"stream: no open peer {peer!r}; call open_peer() first")
        sock = self._peers[peer][1]
        sock.settimeout(self.timeout if timeout is None else timeout)
        t0 = time.perf_counter()
        try:
            request = json.dumps({"ids": [int(i) for i in remote_ids]}).encode()
            sock.sendall(struct.pack(">I", len(request)) + request)
            (n,) = struct.unpack(">Q", _recv(sock, 8))
            if n == _FAILED:
                (k,) = struct.unpack(">I", _recv(sock, 4))
                raise KVConnectorError(f"{peer} failed: {_recv(sock, k).decode()}")
            rows = _rows(self.cache)
            want = len(local_ids) * sum(r.shape[1] for r in rows)
            if n != want:
                raise KVConnectorError(f"{peer} sent {n} bytes, expected {want}")
            data = torch.frombuffer(bytearray(_recv(sock, n)), dtype=torch.uint8)
            idx = torch.tensor(list(local_ids), dtype=torch.int64)
            at = 0
            for r in rows:
                size = len(local_ids) * r.shape[1]
                part = data[at:at + size].view(len(local_ids), r.shape[1]).to(r.device)
                r.index_copy_(0, idx.to(r.device), part)
                at += size
        except (OSError, KVConnectorError) as exc:
            self.invalidate(peer)
            raise KVTransferError(peer, local_ids, exc) from exc
        return FetchResult(n, time.perf_counter() - t0, "unix-stream", blocks=len(local_ids))

    def invalidate(self, peer: str | None = None) -> None:
        for name in list(self._peers) if peer is None else [peer]:
            entry = self._peers.pop(name, None)
            if entry is not None:
                entry[1].close()

    def close(self) -> None:
        self.invalidate()


register_transport(TransportSpec(
    "stream", lambda ctx, _: StreamTransport(ctx), lambda ctx, _: StreamExporter(ctx),
    same_host_only=True, needs_directory=True,
    description="a test transport: blocks through a Unix stream socket"))
