"""Driver calls through ctypes: ``cuMemcpyBatchAsync`` (many pointer-to-pointer copies in
one driver call), and for :mod:`._kernel_launch` ``cuMemcpyHtoDAsync`` (the block-id upload,
capturable into a CUDA graph without torch's pinned-memory bookkeeping) and ``cuGraphLaunch``
(a captured graph replayed without torch's per-replay work).

The batch entry point is resolved with ``cuGetProcAddress`` at the driver's own version, so the
CUDA 12.8 ABI (with a ``failIdx`` argument) and the CUDA 13 ABI (without) both work. The
copies run on the copy engines; sources are read in stream order
(``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``). Arrays are passed as numpy buffers: no Python loop
per copy.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvconnect.errors import KvconnectError

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEM_LOCATION_TYPE_INVALID = 0
_SUCCESS = 0


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


class MemcpyBatchUnavailable(KvconnectError, RuntimeError):
    """The driver has no ``cuMemcpyBatchAsync`` (CUDA < 12.8) or no CUDA driver is loaded."""


@functools.lru_cache(maxsize=1)
def _entry() -> tuple[Any, bool, Any]:
    """``(function, has_fail_index, libcuda)``."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise MemcpyBatchUnavailable(f"libcuda.so.1 cannot be loaded: {exc}") from exc
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != _SUCCESS:
        raise MemcpyBatchUnavailable("cuDriverGetVersion failed")
    if version.value < 12080:
        raise MemcpyBatchUnavailable(f"driver API {version.value} < 12080 has no batch memcpy")
    pfn = ctypes.c_void_p()
    status = ctypes.c_int(0)
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    rc = get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), version.value, 0, ctypes.byref(status))
    if rc != _SUCCESS or not pfn.value:
        raise MemcpyBatchUnavailable(f"cuGetProcAddress(cuMemcpyBatchAsync) failed: {rc}")
    has_fail_index = version.value < 13000
    vp = ctypes.c_void_p
    size_t = ctypes.c_size_t
    args: list[type[ctypes._SimpleCData[Any]] | type[ctypes._Pointer[Any]]] = [
        vp, vp, vp, size_t, ctypes.POINTER(_MemcpyAttributes), vp, size_t]
    if has_fail_index:
        args.append(ctypes.POINTER(size_t))
    args.append(vp)
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *args)(pfn.value)
    return fn, has_fail_index, lib


def _bound(name: str, argtypes: list[Any]) -> Any:
    """libcuda's ``name`` with ``argtypes`` and a CUresult return; raises
    :class:`MemcpyBatchUnavailable` when libcuda cannot be loaded."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise MemcpyBatchUnavailable(f"libcuda.so.1 cannot be loaded: {exc}") from exc
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=1)
def memcpy_htod_async_entry() -> Callable[..., int]:
    """``cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: void*, nbytes: size_t, stream) ->
    CUresult`` (the context current on the calling thread must own ``dst``)."""
    return _bound("cuMemcpyHtoDAsync_v2",
                  [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p])


@functools.lru_cache(maxsize=1)
def graph_launch_entry() -> Callable[..., int]:
    """``cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult``."""
    return _bound("cuGraphLaunch", [ctypes.c_void_p, ctypes.c_void_p])


def memcpy_batch_available() -> str | None:
    """None when ``cuMemcpyBatchAsync`` can be called, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        _entry()
    except MemcpyBatchUnavailable as exc:
        return str(exc)
    return None


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                 device_index: int) -> None:
    """Enqueue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes) on ``stream`` (not the legacy
    default stream 0) of device ``device_index``. Raises ``RuntimeError`` with the driver's
    error code (and the failing copy's index on 12.x drivers)."""
    if stream == 0:
        raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream: use a stream")
    fn, has_fail_index, _ = _entry()
    d = np.ascontiguousarray(dsts, dtype=np.uint64)
    s = np.ascontiguousarray(srcs, dtype=np.uint64)
    n = np.ascontiguousarray(sizes, dtype=np.uint64)
    if not d.size == s.size == n.size:
        raise ValueError(f"{d.size} destinations, {s.size} sources, {n.size} sizes")
    if d.size == 0:
        return
    attrs = _MemcpyAttributes(CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                              _MemLocation(CU_MEM_LOCATION_TYPE_INVALID, 0),
                              _MemLocation(CU_MEM_LOCATION_TYPE_INVALID, 0), 0)
    idx = np.zeros(1, dtype=np.uint64)
    args: list[Any] = [d.ctypes.data, s.ctypes.data, n.ctypes.data, d.size,
                       ctypes.byref(attrs), idx.ctypes.data, 1]
    fail = ctypes.c_size_t(0)
    if has_fail_index:
        args.append(ctypes.byref(fail))
    args.append(stream)
    with torch.cuda.device(device_index):
        rc = fn(*args)
    if rc != _SUCCESS:
        where = f" at copy {fail.value}" if has_fail_index else ""
        raise RuntimeError(f"cuMemcpyBatchAsync of {d.size} copies failed with CUresult "
                           f"{rc}{where}")
