"""CUDA VMM backend: ctypes over ``libcuda.so.1`` through the shared table in ``_driver_api``.

:class:`GpuVmmDriver` is the implementation shared with HIP (``hip.py``); it is parameterised
by a :class:`~kvconnect.vmm._driver_api.Backend` and differs per backend only in how a context
is made current and how the device is synchronised.

Contracts (all sizes in bytes):

- ``create(size, options=AllocationOptions(shareable=True))`` requests POSIX file-descriptor
  handles; ``AllocationOptions(rdma_capable=True)`` sets ``gpuDirectRDMACapable`` only where
  ``GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`` is 1. A flag the device cannot grant (attribute 0,
  or ``cuMemCreate`` refuses it) is dropped with one ``logging`` warning per driver, and there
  is one driver per device (:func:`kvconnect.vmm.probe_vmm` caches it);
  :attr:`PhysicalHandle.granted` records the flags the allocation really has (read back with
  ``cuMemGetAllocationPropertiesFromHandle``).
- Every call runs with this device's primary context current. On a thread with no current
  context the primary context is made current and left so (as ``torch`` would); on a thread
  where another context is current it is pushed for the call and popped after.
- Errors raise :class:`~kvconnect.vmm.base.VmmError` named with ``cuGetErrorName``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..checks import checked_int, round_up
from . import _driver_api as api
from .base import (
    DEFAULT_OPTIONS,
    DLPACK_CUDA,
    AllocationOptions,
    DeviceCapabilities,
    GrantedFlags,
    PhysicalHandle,
    VmmDriver,
    VmmError,
    VmmProbe,
)

logger = logging.getLogger(__name__)

# (pid, library path, device ordinal) -> retained primary context. Retained once per process and
# never released: releasing it while allocations live would destroy them with the context.
_PRIMARY_CTX: dict[tuple[int, str, int], int] = {}
_PRIMARY_LOCK = threading.Lock()


def _check_va(va: int, size: int) -> None:
    """A device range ``[va, va+size)`` that fits ``CUdeviceptr``/``size_t`` untruncated."""
    checked_int("size in bytes", size)
    checked_int("device address", va, minimum=0, maximum=(1 << 64) - 1 - size)


class GpuVmmDriver(VmmDriver):
    """VMM on a GPU through a :class:`~kvconnect.vmm._driver_api.DriverLibrary`.

    Subclasses set ``backend``, ``name`` and ``dlpack_device_type``. ``library`` overrides the
    shared object loaded (a soname or path), or is an already loaded library object.
    """

    backend: api.Backend = api.CUDA
    #: ``cuMemMap``'s offset "currently must be zero" (cuda.h); ``hipMemMap``'s likewise
    map_offset_must_be_zero: bool = True
    #: the table entry that waits for the device's work (HIP: ``device_synchronize``)
    sync_entry: str = "ctx_synchronize"

    def __init__(self, device_index: int = 0, *,
                 library: str | api.DriverLibrary | None = None) -> None:
        super().__init__(device_index)
        if self.device_index < 0:
            raise ValueError(f"device index must be >= 0, got {self.device_index}")
        if isinstance(library, str) or library is None:
            self.lib = api.load_library(self.backend, library)
        else:
            self.lib = library
        self.lib.call("init", 0)
        dev = api.CUdevice()
        self.lib.call("device_get", ctypes.byref(dev), self.device_index)
        self._device = dev.value
        self._lock = threading.Lock()
        self._granularity: dict[tuple[bool, bool], int] = {}
        self._caps: dict[int, DeviceCapabilities] = {}
        self._warned = False
        #: every flag fallback this driver made, in order (the warning is logged only once)
        self.fallback_reasons: list[str] = []

    # -- context ------------------------------------------------------------------------------
    def _primary_context(self) -> int:
        key = (os.getpid(), self.lib.path, self._device)
        ctx = _PRIMARY_CTX.get(key)
        if ctx is not None:
            return ctx
        with _PRIMARY_LOCK:
            ctx = _PRIMARY_CTX.get(key)
            if ctx is None:
                out = api.CUcontext()
                self.lib.call("device_primary_ctx_retain", ctypes.byref(out), self._device)
                ctx = int(out.value or 0)
                _PRIMARY_CTX[key] = ctx
            return ctx

    def ensure_context(self) -> None:
        """Retain the device's primary context and make it current on this thread."""
        self.lib.call("ctx_set_current", self._primary_context())

    @contextmanager
    def _active(self) -> Iterator[None]:
        """Run a block with this device's context current, restoring any other context."""
        ctx = self._primary_context()
        cur = api.CUcontext()
        self.lib.call("ctx_get_current", ctypes.byref(cur))
        current = int(cur.value or 0)
        if current == ctx:
            yield
            return
        if current == 0:
            self.lib.call("ctx_set_current", ctx)
            yield
            return
        self.lib.call("ctx_push_current", ctx)
        try:
            yield
        finally:
            popped = api.CUcontext()
            self.lib.try_call("ctx_pop_current", ctypes.byref(popped))

    def synchronize(self) -> None:
        """Wait for all work in this device's context (``cuCtxSynchronize``; HIP:
        ``hipDeviceSynchronize``)."""
        with self._active():
            self.lib.call(self.sync_entry)

    # -- queries -------------------------------------------------------------------------------
    def _attribute(self, attr: int | None, device: int | None = None) -> int | None:
        """A device attribute, or ``None`` if the backend lacks it or the driver rejects it."""
        if attr is None:
            return None
        value = ctypes.c_int()
        dev = self._device if device is None else self._device_handle(device)
        if self.lib.try_call("device_get_attribute", ctypes.byref(value), attr, dev) != 0:
            return None
        return value.value

    def _device_handle(self, ordinal: int) -> int:
        if ordinal == self.device_index:
            return self._device
        dev = api.CUdevice()
        self.lib.call("device_get", ctypes.byref(dev), int(ordinal))
        return dev.value

    def capabilities(self, device: int | None = None) -> DeviceCapabilities:
        """The four VMM attributes of ``device`` (default: this driver's device)."""
        ordinal = self.device_index if device is None else int(device)
        caps = self._caps.get(ordinal)
        if caps is None:
            b = self.backend
            vmm = bool(self._attribute(b.attr_vmm, ordinal))
            posix = self._attribute(b.attr_posix_fd, ordinal)
            caps = DeviceCapabilities(
                vmm=vmm,
                # HIP has no such attribute: VMM allocations are shared as fds on Linux.
                posix_fd_handles=vmm if b.attr_posix_fd is None else bool(posix),
                gpudirect_rdma_with_vmm=bool(self._attribute(b.attr_gpudirect_rdma_with_vmm,
                                                             ordinal)),
                fabric_handles=bool(self._attribute(b.attr_fabric, ordinal)),
            )
            self._caps[ordinal] = caps
        return caps

    def _prop(self, device: int, posix_fd: bool, rdma: bool) -> ctypes.Structure:
        prop = self.backend.prop_struct()
        prop.type = api.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = (api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix_fd
                                     else api.CU_MEM_HANDLE_TYPE_NONE)
        prop.location.type = api.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = int(device)
        prop.allocFlags.compressionType = api.CU_MEM_ALLOCATION_COMP_NONE
        prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        return prop

    def granularity(self, options: AllocationOptions = DEFAULT_OPTIONS) -> int:
        """Minimum granularity (bytes) for allocations with the flags the device would grant."""
        caps = self.capabilities()
        key = (options.shareable and caps.posix_fd_handles,
               options.rdma_capable and caps.gpudirect_rdma_with_vmm)
        gran = self._granularity.get(key)
        if gran is None:
            out = ctypes.c_size_t()
            prop = self._prop(self.device_index, *key)
            with self._active():
                self.lib.call("mem_get_allocation_granularity", ctypes.byref(out),
                              ctypes.byref(prop), api.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
            gran = int(out.value)
            self._granularity[key] = gran
        return gran

    def driver_version(self) -> int:
        """The driver API version (e.g. 13000 for CUDA 13.0)."""
        out = ctypes.c_int()
        self.lib.call("driver_get_version", ctypes.byref(out))
        return out.value

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` device memory in bytes."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._active():
            self.lib.call("mem_get_info", ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    # -- address space -------------------------------------------------------------------------
    def _check_size(self, what: str, size: int, multiple: int) -> None:
        """Sizes are checked before ctypes sees them (``c_size_t`` would truncate them)."""
        checked_int(f"{what} size in bytes", size)
        if size % multiple:
            raise ValueError(f"{what} size {size} is not a multiple of the {multiple}-byte "
                             f"granularity; use {round_up(size, multiple)}")

    def reserve(self, size: int, alignment: int = 0) -> int:
        """Reserve ``size`` bytes (a granularity multiple) of device VA; returns the base."""
        self._check_size("reservation", size, self.granularity())
        checked_int("alignment in bytes", alignment, minimum=0)
        out = api.CUdeviceptr()
        with self._active():
            self.lib.call("mem_address_reserve", ctypes.byref(out), size, alignment, 0, 0)
        return int(out.value)

    def free_reserved(self, va: int, size: int) -> None:
        """Free a reservation (every mapping in it must be unmapped first)."""
        _check_va(va, size)
        with self._active():
            self.lib.call("mem_address_free", va, size)

    # -- physical memory -----------------------------------------------------------------------
    def _fallback(self, reason: str) -> None:
        self.fallback_reasons.append(reason)
        if not self._warned:
            self._warned = True
            logger.warning("%s: %s. Falling back without that flag (warned once per device; "
                           "PhysicalHandle.granted records each allocation's real flags).",
                           self, reason)

    def _try_create(self, size: int, device: int, posix_fd: bool, rdma: bool) -> tuple[int, int]:
        handle = api.CUmemGenericAllocationHandle()
        prop = self._prop(device, posix_fd, rdma)
        with self._active():
            rc = self.lib.try_call("mem_create", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        return rc, int(handle.value)

    def _granted(self, handle: int, posix_fd: bool, rdma: bool) -> GrantedFlags:
        """Read the flags back from the driver; keep the requested ones if it can't say."""
        if not self.lib.has("mem_get_allocation_properties_from_handle"):
            return GrantedFlags(shareable=posix_fd, rdma_capable=rdma)
        prop = self.backend.prop_struct()
        with self._active():
            rc = self.lib.try_call("mem_get_allocation_properties_from_handle",
                                   ctypes.byref(prop), handle)
        if rc != 0:
            return GrantedFlags(shareable=posix_fd, rdma_capable=rdma)
        return GrantedFlags(
            shareable=bool(prop.requestedHandleTypes & api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            rdma_capable=bool(prop.allocFlags.gpuDirectRDMACapable),
        )

    def create(self, size: int, device: int | None = None,
               options: AllocationOptions = DEFAULT_OPTIONS) -> PhysicalHandle:
        """``cuMemCreate`` ``size`` bytes (a granularity multiple) on ``device``.

        Flags the device cannot grant are dropped (one warning per driver, i.e. per device);
        out-of-memory and every other failure raise :class:`VmmError`.
        """
        ordinal = (self.device_index if device is None
                   else checked_int("device ordinal", device, minimum=0, maximum=1 << 16))
        self._check_size("allocation", size, self.granularity(options))
        caps = self.capabilities(ordinal)
        posix_fd, rdma = options.shareable, options.rdma_capable
        if posix_fd and not caps.posix_fd_handles:
            self._fallback(f"device {ordinal} cannot export POSIX file descriptors "
                           "(HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED=0): not shareable")
            posix_fd = False
        if rdma and not caps.gpudirect_rdma_with_vmm:
            self._fallback(f"device {ordinal} reports GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED=0: "
                           "allocation is not gpuDirectRDMACapable")
            rdma = False
        rc, handle = self._try_create(size, ordinal, posix_fd, rdma)
        # Refused flags: drop RDMA first, then the handle type; never retry out-of-memory.
        while rc not in (api.CUDA_SUCCESS, api.CUDA_ERROR_OUT_OF_MEMORY) and (rdma or posix_fd):
            dropped = "gpuDirectRDMACapable" if rdma else "POSIX_FD handle type"
            self._fallback(f"{self.lib.symbol('mem_create')} refused {dropped} on device "
                           f"{ordinal} with {self.lib.error_name(rc)}")
            if rdma:
                rdma = False
            else:
                posix_fd = False
            rc, handle = self._try_create(size, ordinal, posix_fd, rdma)
        if rc != api.CUDA_SUCCESS:
            raise self.lib.error("mem_create", rc, f"{size} bytes on device {ordinal}")
        try:
            granted = self._granted(handle, posix_fd, rdma)
        except BaseException:
            self.lib.try_call("mem_release", handle)
            raise
        return PhysicalHandle(handle=handle, size=size, device=ordinal, granted=granted)

    def map(self, va: int, size: int, handle: PhysicalHandle, offset: int = 0) -> None:
        """Map ``size`` bytes of ``handle`` from ``offset`` at ``va`` (no access yet)."""
        if handle.released:
            raise ValueError("cannot map a released physical handle")
        _check_va(va, size)
        checked_int("mapping offset in bytes", offset, minimum=0)
        if offset + size > handle.size:
            raise ValueError(f"mapping [{offset}, {offset + size}) does not fit the "
                             f"{handle.size}-byte allocation")
        if offset and self.map_offset_must_be_zero:
            raise ValueError(f"{self.lib.symbol('mem_map')} requires offset 0 (got {offset}): "
                             "map an allocation from its start")
        with self._active():
            self.lib.call("mem_map", va, size, offset, handle.handle, 0)

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        """Grant read/write access to ``[va, va+size)`` to this device and ``devices``
        (peer GPUs, e.g. the device that owns an imported allocation)."""
        _check_va(va, size)
        peers = [checked_int("peer device ordinal", d, minimum=0, maximum=1 << 16)
                 for d in devices or ()]
        ordinals = [self.device_index, *(d for d in peers if d != self.device_index)]
        descs = (self.backend.access_desc_struct * len(ordinals))()
        for desc, ordinal in zip(descs, ordinals, strict=True):
            desc.location.type = api.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = ordinal
            desc.flags = api.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        with self._active():
            self.lib.call("mem_set_access", va, size, descs, len(ordinals))

    def unmap(self, va: int, size: int) -> None:
        """Unmap whole mappings in ``[va, va+size)``; call :meth:`synchronize` first."""
        _check_va(va, size)
        with self._active():
            self.lib.call("mem_unmap", va, size)

    def release(self, handle: PhysicalHandle) -> None:
        """Release a physical allocation (idempotent); memory returns once also unmapped."""
        if handle.released:
            return
        with self._active():
            self.lib.call("mem_release", handle.handle)
        handle.released = True

    def memset(self, va: int, value: int, size: int) -> None:
        """Fill ``size`` mapped bytes at ``va`` with ``value`` and wait for it."""
        checked_int("memset value (a byte)", value, minimum=0, maximum=255)
        _check_va(va, size)
        with self._active():
            self.lib.call("memset_d8", va, value, size)
            self.lib.call(self.sync_entry)

    # -- sharing -------------------------------------------------------------------------------
    def export_fd(self, handle: PhysicalHandle) -> int:
        """A POSIX fd for a shareable allocation; the caller owns (and closes) it."""
        if handle.released:
            raise ValueError("cannot export a released physical handle")
        if not handle.granted.shareable:
            raise ValueError("allocation was not created shareable (granted flags: "
                             f"{handle.granted}); create it with AllocationOptions(shareable="
                             "True) on a device "
                             "that supports POSIX file-descriptor handles")
        # The driver writes an int; an 8-byte zeroed slot also fits a pointer-sized write.
        slot = ctypes.c_uint64(0)
        with self._active():
            self.lib.call("mem_export_to_shareable_handle", ctypes.byref(slot), handle.handle,
                          api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        fd = ctypes.c_int.from_buffer(slot).value
        if fd < 0:
            raise VmmError(self.lib.symbol("mem_export_to_shareable_handle"), "bad fd", str(fd))
        return fd

    def import_fd(self, fd: int, size: int) -> PhysicalHandle:
        """Import an allocation from a POSIX fd (which stays owned by the caller)."""
        checked_int("file descriptor", fd, minimum=0, maximum=(1 << 31) - 1)
        self._check_size("imported allocation", size,
                         self.granularity(AllocationOptions(shareable=True)))
        out = api.CUmemGenericAllocationHandle()
        with self._active():
            # For POSIX fds the driver takes the fd *value* in the pointer argument.
            self.lib.call("mem_import_from_shareable_handle", ctypes.byref(out),
                          ctypes.c_void_p(fd), api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        # The driver reports neither the handle type nor gpuDirectRDMACapable of an imported
        # handle (both read 0 on driver 580 even when the exporter set them): it came from an
        # fd, so it is shareable; RDMA capability is the exporter's to tell.
        return PhysicalHandle(handle=int(out.value), size=size, device=self.device_index,
                              granted=GrantedFlags(shareable=True, rdma_capable=False),
                              imported=True)


class CudaVmmDriver(GpuVmmDriver):
    """NVIDIA CUDA driver API (``libcuda.so.1``); DLPack ``kDLCUDA`` (2)."""

    name = "cuda"
    dlpack_device_type = DLPACK_CUDA
    backend = api.CUDA


def probe_gpu(cls: type[GpuVmmDriver], index: int, library: str | None = None) -> VmmProbe:
    """Check ``cls``'s backend on device ``index``: library, init, device, VMM attribute and a
    granularity-sized reserve+free. Returns ``VmmProbe(driver)`` or ``VmmProbe(None, reason)``."""
    backend = cls.backend
    try:
        lib = api.load_library(backend, library)
    except OSError as exc:
        soname = library or backend.library_names[0]
        what = "no NVIDIA driver" if backend.name == "cuda" else "no ROCm/HIP runtime"
        return VmmProbe(None, f"{soname} not found ({what}): {exc}")
    rc = lib.try_call("init", 0)
    if rc != 0:
        return VmmProbe(None, f"{lib.symbol('init')} failed: {lib.error_name(rc)} "
                              f"({lib.error_string(rc) or 'no usable GPU'})")
    count = ctypes.c_int()
    rc = lib.try_call("device_get_count", ctypes.byref(count))
    if rc != 0:
        return VmmProbe(None, f"{lib.symbol('device_get_count')} failed: {lib.error_name(rc)}")
    if not 0 <= index < count.value:
        return VmmProbe(None, f"{backend.name} device {index} does not exist "
                              f"({count.value} device(s) visible)")
    try:
        drv = cls(index, library=library)
        if not drv.capabilities().vmm:
            return VmmProbe(None, f"{backend.name} device {index} does not support virtual "
                                  f"memory management (attribute {backend.attr_vmm} is 0)")
        gran = drv.granularity()
        va = drv.reserve(gran)
        drv.free_reserved(va, gran)
    except (VmmError, OSError, ValueError) as exc:
        return VmmProbe(None, f"{backend.name} device {index}: VMM self-test failed: {exc}")
    return VmmProbe(drv)


def probe_cuda(index: int = 0, library: str | None = None) -> VmmProbe:
    """Probe the CUDA backend on device ``index`` (never raises for a missing driver)."""
    return probe_gpu(CudaVmmDriver, index, library)
