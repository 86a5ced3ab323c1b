"""Host (Linux, no GPU) backend: a faithful model of CUDA VMM on ordinary memory.

- reserve:  ``mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)``
- create:   ``memfd_create`` + ``ftruncate``, then sealed against resizing (the "physical
  allocation"; its fd is the handle)
- map:      ``mmap(MAP_FIXED|MAP_SHARED, memfd)`` with ``PROT_NONE``
- set_access: ``mprotect(PROT_READ|PROT_WRITE)``
- unmap:    map ``PROT_NONE`` anonymous memory back over the range (the VA stays reserved)
- export:   ``dup`` of the memfd (send it with SCM_RIGHTS)

Touching reserved-but-uncommitted memory raises SIGSEGV, exactly like unmapped VA on a GPU.
Like ``cuMemAddressFree``, freeing a reservation that still has chunks mapped in it is refused
(:class:`~kvconnect.vmm.base.VmmError`): ``munmap`` alone would drop them silently and hide an
unmap order the GPU refuses.

Sealing: an importer maps the exporter's memfd; if the other side could truncate it, the next
read of the mapping would die with SIGBUS. Every chunk is therefore sealed with
``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` (its size is fixed for good, and no peer can
add other seals), and :meth:`HostVmmDriver.import_fd` accepts only memfds carrying the
shrink and grow seals: a regular file, a pipe or an unsealed memfd is refused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import sys
import threading
from collections.abc import Sequence

from ..checks import MAX_BYTES, checked_int, round_up
from .base import (
    DEFAULT_OPTIONS,
    DLPACK_CPU,
    AllocationOptions,
    DeviceCapabilities,
    GrantedFlags,
    PhysicalHandle,
    VmmDriver,
    VmmError,
)

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10
_PAGE = mmap.PAGESIZE
_PROT_NONE = 0
#: commit granularity of the host backend; the same 2 MiB that CUDA reports on H200
HOST_GRANULARITY = 2 * 1024 * 1024
#: seals every chunk's memfd carries: its size never changes, nobody adds other seals
CHUNK_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: seals an imported fd must carry (the size cannot change under our mapping)
REQUIRED_IMPORT_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.restype = ctypes.c_int
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _errno_error(call: str) -> VmmError:
    err = ctypes.get_errno()
    return VmmError(call, os.strerror(err) if err else "unknown error")


def _check_range(va: int, size: int) -> None:
    """Sizes and addresses are checked before ctypes sees them (it would truncate them)."""
    checked_int("size in bytes", size)
    checked_int("address", va, minimum=0, maximum=MAX_BYTES - size)
    if va % _PAGE or size % _PAGE:
        raise ValueError(f"va {va:#x} and size {size} must be multiples of the page size {_PAGE}")


class HostVmmDriver(VmmDriver):
    """VMM on host memory via mmap + memfd (Linux only). ``device_index`` is ignored."""

    name = "host"
    dlpack_device_type = DLPACK_CPU
    #: a fresh memfd reads as zeros (pages are allocated on first touch)
    creates_zeroed_memory = True

    def __init__(self, device_index: int = 0) -> None:
        if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
            raise OSError("the host VMM backend needs Linux with memfd_create")
        super().__init__(device_index)
        #: chunks mapped through this driver and not unmapped yet: va -> bytes
        self._mapped: dict[int, int] = {}
        self._mapped_lock = threading.Lock()

    def granularity(self, options: AllocationOptions = DEFAULT_OPTIONS) -> int:
        return HOST_GRANULARITY

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(vmm=True, posix_fd_handles=True, gpudirect_rdma_with_vmm=False,
                                  fabric_handles=False)

    def reserve(self, size: int, alignment: int = 0) -> int:
        _check_range(0, size)
        checked_int("alignment in bytes", alignment, minimum=0, maximum=1 << 40)
        align = max(alignment, HOST_GRANULARITY)
        # Over-reserve, then trim to an aligned window (like cuMemAddressReserve's alignment).
        total = size + align
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        raw = _libc.mmap(None, total, _PROT_NONE, flags, -1, 0)
        if raw in (None, _MAP_FAILED):
            raise _errno_error(f"mmap(PROT_NONE, {total} bytes)")
        base = round_up(raw, align)
        head, tail = base - raw, raw + total - (base + size)
        if head:
            _libc.munmap(raw, head)
        if tail:
            _libc.munmap(base + size, tail)
        return base

    def free_reserved(self, va: int, size: int) -> None:
        """Free a reservation; refused (VmmError, nothing freed) while chunks are mapped in
        it, as ``cuMemAddressFree`` refuses."""
        _check_range(va, size)
        with self._mapped_lock:
            inside = [(a, n) for a, n in self._mapped.items() if a < va + size and va < a + n]
        if inside:
            raise VmmError("munmap (free_reserved)", "mappings remain",
                           f"{len(inside)} chunk(s) still mapped in [{va:#x}, {va + size:#x}), "
                           f"the first at {inside[0][0]:#x}: unmap every chunk before freeing "
                           "its reservation (cuMemAddressFree refuses as well)")
        if _libc.munmap(va, size) != 0:
            raise _errno_error("munmap")

    def create(self, size: int, device: int | None = None,
               options: AllocationOptions = DEFAULT_OPTIONS) -> PhysicalHandle:
        checked_int("allocation size in bytes", size)
        if size % HOST_GRANULARITY:
            raise ValueError(f"size must be a positive multiple of {HOST_GRANULARITY} bytes, got {size}")
        fd = os.memfd_create("kvconnect-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, CHUNK_SEALS)
        except OSError:
            os.close(fd)
            raise
        # Host memory is always shareable (memfd); RDMA registration needs a NIC, not a flag.
        return PhysicalHandle(handle=fd, size=size, device=self.device_index,
                              granted=GrantedFlags(shareable=True, rdma_capable=False))

    def map(self, va: int, size: int, handle: PhysicalHandle, offset: int = 0) -> None:
        _check_range(va, size)
        if handle.released:
            raise ValueError("cannot map a released physical handle")
        checked_int("mapping offset in bytes", offset, minimum=0)
        if offset + size > handle.size:
            raise ValueError(f"mapping [{offset}, {offset + size}) exceeds the {handle.size}-byte allocation")
        got = _libc.mmap(va, size, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, handle.handle, offset)
        if got != va:
            raise _errno_error("mmap(MAP_FIXED|MAP_SHARED)")
        with self._mapped_lock:
            self._mapped[va] = size

    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        _check_range(va, size)
        if _libc.mprotect(va, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            raise _errno_error("mprotect")

    def unmap(self, va: int, size: int) -> None:
        _check_range(va, size)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        if _libc.mmap(va, size, _PROT_NONE, flags, -1, 0) != va:
            raise _errno_error("mmap(PROT_NONE) over unmapped range")
        with self._mapped_lock:
            for a in [a for a, n in self._mapped.items() if va <= a and a + n <= va + size]:
                del self._mapped[a]

    def release(self, handle: PhysicalHandle) -> None:
        if handle.released:
            return
        handle.released = True
        os.close(handle.handle)

    def memset(self, va: int, value: int, size: int) -> None:
        checked_int("memset size in bytes", size)
        checked_int("memset address", va, minimum=1, maximum=MAX_BYTES - size)
        checked_int("memset value", value, minimum=0, maximum=255)
        ctypes.memset(va, value, size)

    def export_fd(self, handle: PhysicalHandle) -> int:
        if handle.released:
            raise ValueError("cannot export a released physical handle")
        return os.dup(handle.handle)

    def import_fd(self, fd: int, size: int) -> PhysicalHandle:
        """A peer's chunk: ``fd`` must be a memfd sealed against shrinking and growing (see
        the module docstring) holding at least ``size`` bytes; ValueError otherwise."""
        checked_int("file descriptor", fd, minimum=0, maximum=(1 << 31) - 1)
        checked_int("imported allocation size in bytes", size)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError as exc:  # EINVAL: not a memfd (a regular file, a pipe, a socket)
            raise ValueError(f"imported fd is not a sealed memfd ({exc.strerror}): only "
                             "memory a peer cannot truncate under our mapping is accepted"
                             ) from None
        if seals & REQUIRED_IMPORT_SEALS != REQUIRED_IMPORT_SEALS:
            raise ValueError(f"imported memfd is not sealed against resizing (seals {seals:#x}"
                             f", need F_SEAL_SHRINK|F_SEAL_GROW = {REQUIRED_IMPORT_SEALS:#x}): "
                             "its owner could truncate it under our mapping")
        actual = os.fstat(fd).st_size
        if actual < size:
            raise ValueError(f"imported fd holds {actual} bytes, fewer than the {size} expected")
        return PhysicalHandle(handle=os.dup(fd), size=size, device=self.device_index,
                              granted=GrantedFlags(shareable=True), imported=True)
