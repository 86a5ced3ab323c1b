"""VMM drivers: one interface (:class:`VmmDriver`), three backends (CUDA, HIP, host).

:func:`probe_vmm` picks and checks a backend for a device and says why not when it can't;
:func:`get_vmm_driver` does the same and warns with the reason when it falls back.

There is one driver per device and process: the first successful probe of a device builds
it, later probes (every ``ExtensibleTensor`` of a KV cache) get the same object, as
cuda.core keeps one ``Device`` per device. Per-driver state (the granularity and capability
caches, the once-only fallback warning) is therefore per device.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING, TypeAlias

from ..lazy_exports import lazy_exports
from .base import (
    DEFAULT_OPTIONS,
    DLPACK_CPU,
    DLPACK_CUDA,
    DLPACK_ROCM,
    AllocationOptions,
    DeviceCapabilities,
    GrantedFlags,
    PhysicalHandle,
    VmmDriver,
    VmmError,
    VmmProbe,
    round_up,
)
from .reservation import Reservation

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_OPTIONS", "DLPACK_CPU", "DLPACK_CUDA", "DLPACK_ROCM", "AllocationOptions",
    "DeviceCapabilities", "DeviceSpec", "GrantedFlags", "PhysicalHandle", "Reservation", "VmmDriver",
    "VmmError", "VmmProbe", "get_vmm_driver", "probe_vmm", "parse_device", "round_up",
    "HostVmmDriver", "CudaVmmDriver", "HipVmmDriver",
]

#: what names a device (:func:`parse_device`): ``"cpu"``, ``"cuda:1"``, ``"hip:0"``, a
#: torch.device, or the VmmDriver to use
DeviceSpec: TypeAlias = "str | torch.device | VmmDriver"

# (pid, backend kind, device index) -> the driver of that device in this process. A forked
# child gets its own (CUDA contexts do not survive fork).
_DRIVERS: dict[tuple[int, str, int], VmmDriver] = {}
_DRIVERS_LOCK = threading.Lock()


#: the backends load lazily (their libraries are only opened when a driver is built)
__getattr__, __dir__ = lazy_exports(__name__, {"HostVmmDriver": ".host",
                                               "CudaVmmDriver": ".cuda", "HipVmmDriver": ".hip"})


def parse_device(device: object) -> tuple[str, int]:
    """Normalise ``"cpu"``, ``"host"``, ``"cuda"``, ``"cuda:1"``, ``"hip:0"`` or a torch.device.

    Returns ``(kind, index)`` with kind one of ``"host"``, ``"cuda"``, ``"hip"``.
    """
    if isinstance(device, VmmDriver):
        return device.name, device.device_index
    text = str(device).strip().lower()
    kind, _, idx = text.partition(":")
    if kind in ("cpu", "host"):
        return "host", 0
    if kind in ("cuda", "gpu", "hip", "rocm"):
        try:
            index = int(idx) if idx else 0
        except ValueError:
            raise ValueError(f"bad device index in {device!r}: expected e.g. 'cuda:0'") from None
        if kind == "cuda" or kind == "gpu":
            try:
                import torch

                if getattr(torch.version, "hip", None):
                    return "hip", index
            except ImportError:
                pass
            return "cuda", index
        return "hip", index
    raise ValueError(f"unknown device {device!r}: use 'cpu'/'host', 'cuda[:N]' or 'hip[:N]'")


def probe_vmm(device: object = "cpu") -> VmmProbe:
    """The driver of ``device``, built and checked on the first call (library loads, a VA
    reservation works, the device attribute says VMM is supported) and the same object on
    every later call in this process. Never raises for a missing backend: returns
    ``VmmProbe(None, reason)`` (failures are not cached; the next call probes again)."""
    if isinstance(device, VmmDriver):
        return VmmProbe(device)
    kind, index = parse_device(device)
    key = (os.getpid(), kind, index)
    with _DRIVERS_LOCK:
        driver = _DRIVERS.get(key)
        if driver is not None:
            return VmmProbe(driver)
        probe = _probe_backend(kind, index)
        if probe.driver is not None:
            _DRIVERS[key] = probe.driver
        return probe


def _probe_backend(kind: str, index: int) -> VmmProbe:
    if kind == "host":
        try:
            from .host import HostVmmDriver

            drv = HostVmmDriver(index)
            va = drv.reserve(drv.granularity())
            drv.free_reserved(va, drv.granularity())
            return VmmProbe(drv)
        except (OSError, VmmError) as exc:
            return VmmProbe(None, f"host VMM backend unavailable: {exc}")
    if kind == "cuda":
        from .cuda import probe_cuda

        return probe_cuda(index)
    from .hip import probe_hip

    return probe_hip(index)


def get_vmm_driver(device: object = "cpu") -> VmmDriver | None:
    """The VMM driver for ``device``, or ``None`` after a warning naming the reason.

    Callers then fall back to ordinary (non-extensible) allocation.
    """
    probe = probe_vmm(device)
    if probe.driver is None:
        logger.warning("VMM unavailable for %s, falling back to ordinary allocation: %s",
                       device, probe.reason)
    return probe.driver
