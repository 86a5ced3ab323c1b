"""The two ways decode gets prefill's blocks: ``ipc`` (POSIX fds over SCM_RIGHTS) and ``nixl``.

``ipc`` (same host only): the prefill worker runs an :class:`IpcExportServer` on a Unix socket
in a private 0700 directory. A decode worker connects, both sides check each other with
SO_PEERCRED (uid, and the pid the peer announced), and prefill sends its KV tensors' chunk
fds (``ExtensibleTensor.export_handles()``) with a JSON description. Decode maps them
(:class:`kvconnect.ipc.PeerMapping`: import, reserve, map, set access) and copies the chosen
blocks into its own cache with one gather + one scatter per region (:func:`ipc_fetch`).

``nixl``: decode READs through :class:`kvconnect.connectors.nixl.NixlConnectorWorker`
(:func:`nixl_fetch`).

Units: bytes, blocks for block ids, seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.connectors.copy_ops import block_row_view, word_size
from kvconnect.ipc import (
    IpcError,
    PeerMapping,
    export_message,
    import_message,
    peer_credentials,
    recv_message,
    send_error,
    send_message,
)

from .content import RegionSpec, owners
from .ucx_lanes import LaneTracker

log = logging.getLogger(__name__)


@dataclass
class FetchResult:
    """One transfer into decode's cache: ``bytes`` moved in ``seconds`` (the copy/READ only),
    ``backend`` what carried it, ``setup_seconds`` spent mapping / handshaking before."""

    bytes: int
    seconds: float
    backend: str
    setup_seconds: float = 0.0
    note: str = ""


class IpcExportServer:
    """Serves this worker's KV chunk fds to allowed decode processes (prefill side).

    ``allowed`` returns the pids that may connect (checked with SO_PEERCRED, as well as the
    uid). Each request gets the chunks as they are *now*, so after sleep / wake a decode
    receives the new allocations. One thread; :meth:`close` stops it and removes the socket.
    """

    def __init__(self, cache: Any, directory: str, name: str,
                 allowed: Callable[[], set[int]], timeout: float) -> None:
        self.cache = cache
        self.path = os.path.join(directory, f"{name}.sock")
        self.allowed = allowed
        self.timeout = timeout
        self.served = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._open = True
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self._sock.listen(16)
            self._sock.settimeout(0.2)
        except BaseException:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="kvv-ipc-export", daemon=True)
        self._thread.start()

    def describe(self) -> dict[str, Any]:
        """What a decode needs to connect: the socket path and our pid."""
        return {"path": self.path, "pid": os.getpid()}

    def pause(self) -> None:
        """Hold requests (while the cache sleeps): they wait until :meth:`resume`."""
        self._lock.acquire()

    def resume(self) -> None:
        self._lock.release()

    def _serve(self) -> None:
        while self._open:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._handle(conn)
                except (IpcError, OSError, RuntimeError, ValueError) as exc:
                    log.warning("ipc export: %s", exc)
                    self.errors.append(str(exc))
                    send_error(conn, exc)  # the decode sees this error, not a closed socket

    def _handle(self, conn: socket.socket) -> None:
        creds = peer_credentials(conn)
        if creds.uid != os.getuid() or creds.pid not in self.allowed():
            raise IpcError(f"refused a connection from pid {creds.pid} uid {creds.uid}: not a "
                           "decode worker of this run")
        request, fds = recv_message(conn, timeout=self.timeout, max_fds=0)
        for fd in fds:
            os.close(fd)
        if request.get("op") != "export":
            raise IpcError(f"unexpected request {request.get('op')!r}")
        with self._lock:
            message, out_fds = export_message(self.cache.tensors)
            try:
                send_message(conn, message, out_fds)
            finally:
                for fd in out_fds:
                    os.close(fd)
        ack, fds = recv_message(conn, timeout=self.timeout, max_fds=0)
        for fd in fds:
            os.close(fd)
        self.served += 1

    def close(self) -> None:
        self._open = False
        try:
            self._sock.close()
        finally:
            self._thread.join(timeout=2)
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def ipc_fetch(cache: Any, local_specs: Sequence[RegionSpec], remote_specs: Sequence[RegionSpec],
              server: dict[str, Any], remote_ids: Sequence[int], local_ids: Sequence[int],
              timeout: float) -> FetchResult:
    """Map the prefill's chunks and copy blocks ``remote_ids`` into local ``local_ids``.

    One ``index_select`` + one ``index_copy_`` per region (never one copy per block). The
    mappings are released before returning, on every path.
    """
    t_setup = time.perf_counter()
    driver = cache.tensors[0].driver
    mappings: list[PeerMapping] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(server["path"])
        creds = peer_credentials(sock)
        if creds.pid != int(server["pid"]) or creds.uid != os.getuid():
            raise IpcError(f"{server['path']} is served by pid {creds.pid} uid {creds.uid}, "
                           f"not by the prefill (pid {server['pid']})")
        send_message(sock, {"op": "export", "pid": os.getpid()})
        reply, fds = recv_message(sock, timeout=timeout)
        try:
            mappings.extend(import_message(driver, reply, fds))  # validates every field
        finally:
            for fd in fds:
                os.close(fd)
        send_message(sock, {"op": "mapped"})
        setup = time.perf_counter() - t_setup
        pairs = []
        for lspec, rspec in zip(owners(local_specs), owners(remote_specs), strict=True):
            span = (rspec.num_blocks - 1) * rspec.block_stride + rspec.block_len
            src_flat = mappings[rspec.tensor_index].view(rspec.offset, span)
            t = cache.tensors[lspec.tensor_index]
            lspan = (lspec.num_blocks - 1) * lspec.block_stride + lspec.block_len
            dst_flat = t.committed_view(lspec.offset, lspan)
            # Move whole words (up to 8 bytes): byte-wise index ops are ~8x slower.
            word = min(word_size(rspec.block_len, rspec.block_stride, src_flat.data_ptr(), span),
                       word_size(lspec.block_len, lspec.block_stride, dst_flat.data_ptr(), lspan))
            src = block_row_view(src_flat, num_blocks=rspec.num_blocks,
                                 block_len=rspec.block_len, block_stride=rspec.block_stride,
                                 word=word)
            dst = block_row_view(dst_flat, num_blocks=lspec.num_blocks,
                                 block_len=lspec.block_len, block_stride=lspec.block_stride,
                                 word=word)
            pairs.append((src, dst))
        device = cache.tensors[0].device
        r_idx = torch.tensor(list(remote_ids), dtype=torch.int64, device=device)
        l_idx = torch.tensor(list(local_ids), dtype=torch.int64, device=device)
        nbytes = sum(d[0].numel() * d.element_size() for _, d in pairs) * len(local_ids)
        _sync(device)
        t0 = time.perf_counter()
        for src, dst in pairs:
            dst.index_copy_(0, l_idx, src.index_select(0, r_idx))
        _sync(device)
        seconds = time.perf_counter() - t0
        pairs.clear()
        return FetchResult(nbytes, seconds, f"copy:{device.type}", setup,
                           f"{len(reply['chunks'])} chunks of {len(mappings)} tensors mapped")
    finally:
        sock.close()
        for m in mappings:
            m.close()


def reference_copy_gbps(nbytes: int, src: str, dst: str, repeats: int = 5) -> float:
    """Same-run reference for a transfer of ``nbytes``: median GB/s (1e9 bytes/s) of one
    contiguous torch copy between ordinary allocations on ``src`` and ``dst`` (e.g. a
    cudaMalloc peer copy cuda:0 -> cuda:1). Allocates ``2 * nbytes`` for the duration."""
    if nbytes <= 0:
        raise ValueError(f"reference copy needs a positive byte count, got {nbytes}")
    s_dev, d_dev = torch.device(src), torch.device(dst)
    source = torch.empty(nbytes, dtype=torch.uint8, device=s_dev).fill_(0x5A)
    target = torch.empty(nbytes, dtype=torch.uint8, device=d_dev)
    times = []
    for i in range(repeats + 1):
        _sync(s_dev)
        _sync(d_dev)
        t0 = time.perf_counter()
        target.copy_(source)
        _sync(s_dev)
        _sync(d_dev)
        if i:  # the first copy warms up (allocation, peer mappings)
            times.append(time.perf_counter() - t0)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nixl_fetch(nixl: Any, peer_metadata: str, remote_ids: Sequence[int],
               local_ids: Sequence[int], timeout: float,
               lanes: LaneTracker | None = None) -> FetchResult:
    """Load (or refresh) the peer's NIXL metadata and READ the blocks through NIXL.

    ``backend`` names the NIXL backend and, when ``lanes`` can tell, the UCX lane(s) that
    carried the READ (e.g. ``UCX cma/memory zero-copy (host<-host)``)."""
    t0 = time.perf_counter()
    peer = nixl.update_peer(peer_metadata.encode())
    setup = time.perf_counter() - t0
    res = nixl.read_blocks(peer, list(remote_ids), list(local_ids), timeout=timeout)
    via = res.backend if res.transport == res.backend else f"{res.backend}/{res.transport}"
    used = lanes.lanes_after_read(peer) if lanes is not None else []
    if used:
        via = f"{via} " + ", ".join(used)
    return FetchResult(int(res.bytes), float(res.seconds), via, setup,
                       f"{res.descriptors} descriptors")
