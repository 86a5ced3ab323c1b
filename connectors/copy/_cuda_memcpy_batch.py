"""``cuMemcpyBatchAsync`` (many pointer-to-pointer copies in one driver call) through the
package's one driver binding, :mod:`kvconnect.vmm._driver_api`: CUDA 13's ABI
(``cuMemcpyBatchAsync_v2``) where the driver exports it, else CUDA 12.8's (with ``failIdx``).
Copies run on the copy engines, sources read in stream order; arrays pass as numpy buffers.
Errors: ``DriverLibraryError`` without a CUDA driver, else ``VmmError`` (the driver's name).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from kvconnect.vmm import VmmError
from kvconnect.vmm import _driver_api as api

#: the batch entries, preferred first (CUDA 13 ABI, then CUDA 12.8's)
BATCH_ENTRIES = ("memcpy_batch_async_v2", "memcpy_batch_async")


def batch_entry() -> tuple[api.DriverLibrary, str]:
    """The CUDA driver library and the batch entry it exports (one of :data:`BATCH_ENTRIES`).
    Raises ``DriverLibraryError`` without libcuda, ``VmmError`` when the driver has no batch
    copy (CUDA < 12.8)."""
    lib = api.load_library(api.CUDA)
    if logical := next((e for e in BATCH_ENTRIES if lib.has(e)), None):
        return lib, logical
    raise VmmError("cuMemcpyBatchAsync", "symbol not exported",
                   f"{lib.path} has no batch memcpy (a CUDA 12.8 or newer driver has)")


def memcpy_batch_available() -> str | None:
    """None when ``cuMemcpyBatchAsync`` can be called, else why not."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        batch_entry()
    except (api.DriverLibraryError, VmmError) as exc:
        return str(exc)
    return None


def memcpy_batch(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int,
                 device_index: int) -> None:
    """Enqueue ``dsts[i] <- srcs[i]`` (``sizes[i]`` bytes) on ``stream`` (not the legacy
    default stream 0) of device ``device_index``. Raises ``VmmError`` (a ``RuntimeError``)
    with the driver's error name (and the failing copy's index on 12.x drivers)."""
    if stream == 0:
        raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream: use a stream")
    lib, logical = batch_entry()
    d = np.ascontiguousarray(dsts, dtype=np.uint64)
    s = np.ascontiguousarray(srcs, dtype=np.uint64)
    n = np.ascontiguousarray(sizes, dtype=np.uint64)
    if not d.size == s.size == n.size:
        raise ValueError(f"{d.size} destinations, {s.size} sources, {n.size} sizes")
    if d.size == 0:
        return
    invalid = api.CUmemLocation(api.CU_MEM_LOCATION_TYPE_INVALID, 0)
    attrs = api.CUmemcpyAttributes(api.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM, invalid, invalid, 0)
    idx = np.zeros(1, dtype=np.uint64)
    args: list[Any] = [d.ctypes.data, s.ctypes.data, n.ctypes.data, d.size,
                       ctypes.byref(attrs), idx.ctypes.data, 1]
    fail = ctypes.c_size_t(0)
    has_fail_index = logical == "memcpy_batch_async"
    if has_fail_index:
        args.append(ctypes.byref(fail))
    args.append(stream)
    with torch.cuda.device(device_index):
        rc = lib.try_call(logical, *args)
    if rc:
        where = f", at copy {fail.value}" if has_fail_index else ""
        raise lib.error(logical, rc, f"{d.size} copies{where}")
