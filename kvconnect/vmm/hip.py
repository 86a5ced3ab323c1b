"""HIP VMM backend (AMD ROCm): the CUDA implementation bound to ``libamdhip64.so``.

**Untested on AMD hardware.** No AMD GPU was available: what is tested is that the HIP table
mirrors CUDA's (every CUDA symbol has its HIP twin, struct sizes and field offsets equal CUDA's,
constants match ``hip_runtime_api.h``). Treat a first run on ROCm as a bring-up.

Differences from CUDA, handled here:

- HIP's context is implicit: :meth:`HipVmmDriver.ensure_context` is ``hipSetDevice``, and each
  call switches the thread's current device for its duration if another one is current.
- ``hipDeviceSynchronize`` replaces ``cuCtxSynchronize``; ``hipGetErrorName`` names errors.
- Device attributes have HIP's own numbers (VMM = 89; GPUDirect RDMA with VMM = 94, HIP >= 7.13;
  older runtimes reject it, which reads as "not supported"). HIP has no POSIX-FD attribute: VMM
  allocations are exported as fds on Linux, so it is reported as supported wherever VMM is.
- DLPack device type ``kDLROCM`` (10); torch on ROCm still names the device ``cuda:N``.

ROCm caveats (field notes):

- ``hipMemCreate`` holds one file descriptor per handle: ``ulimit -n`` caps how many physical
  chunks a process can have (single-handle recommit keeps the count low).
- ``hipMemMap`` requires ``offset == 0`` (so does ``cuMemMap``: "currently must be zero");
  :meth:`map` raises ``ValueError`` otherwise.
- ``hipMemRelease`` may not return VRAM to the device while the VA reservation that mapped it is
  still held; free the reservation to get memory back for sure.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

from . import _driver_api as api
from .base import DLPACK_ROCM, VmmProbe
from .cuda import GpuVmmDriver, probe_gpu


class HipVmmDriver(GpuVmmDriver):
    """AMD HIP runtime (``libamdhip64.so``); DLPack ``kDLROCM`` (10). Untested on hardware."""

    name = "hip"
    dlpack_device_type = DLPACK_ROCM
    backend = api.HIP
    sync_entry = "device_synchronize"

    def ensure_context(self) -> None:
        """Make this device current on this thread (``hipSetDevice``)."""
        self.lib.call("set_device", self.device_index)

    @contextmanager
    def _active(self) -> Iterator[None]:
        cur = ctypes.c_int()
        self.lib.call("ctx_get_device", ctypes.byref(cur))
        if cur.value == self.device_index:
            yield
            return
        self.lib.call("set_device", self.device_index)
        try:
            yield
        finally:
            self.lib.try_call("set_device", cur.value)


def probe_hip(index: int = 0, library: str | None = None) -> VmmProbe:
    """Probe the HIP backend on device ``index`` (never raises for a missing runtime)."""
    return probe_gpu(HipVmmDriver, index, library)
