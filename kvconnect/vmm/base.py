"""The virtual-memory driver interface shared by the CUDA, HIP and host backends.

All sizes and offsets are in **bytes**. Virtual addresses are plain ``int``s.
A driver is bound to one device (``device_index``); every method acts on that device.

The protocol mirrors CUDA's VMM API:

    va = drv.reserve(size)                   # cuMemAddressReserve
    h  = drv.create(size, options=AllocationOptions(shareable=True))   # cuMemCreate
    drv.map(va, size, h)                     # cuMemMap
    drv.set_access(va, size)                 # cuMemSetAccess (read/write)
    drv.unmap(va, size)                      # cuMemUnmap (whole mappings only)
    drv.release(h)                           # cuMemRelease
    drv.free_reserved(va, size)              # cuMemAddressFree
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from ..checks import round_up
from ..errors import KvconnectError

__all__ = [
    "DEFAULT_OPTIONS", "DLPACK_CPU", "DLPACK_CUDA", "DLPACK_ROCM", "AllocationOptions",
    "DeviceCapabilities",
    "GrantedFlags", "PhysicalHandle", "VmmDriver", "VmmError", "VmmProbe", "round_up",
]

#: DLPack device types (dlpack.h ``DLDeviceType``).
DLPACK_CPU = 1
DLPACK_CUDA = 2
DLPACK_ROCM = 10


class VmmError(KvconnectError, RuntimeError):
    """A driver call failed. ``call`` is the driver entry point, ``code`` its status."""

    def __init__(self, call: str, code: int | str, detail: str = "") -> None:
        self.call = call
        self.code = code
        msg = f"{call} failed: {code}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


@dataclass(frozen=True)
class AllocationOptions:
    """What physical allocations are requested with; one value carried from the caller
    (``ExtensibleTensor``, ``ExtensibleKVCache``) down to :meth:`VmmDriver.create`, as
    cuda.core's ``VirtualMemoryResourceOptions``.

    ``shareable``: exportable as a POSIX file descriptor (IPC, :meth:`VmmDriver.export_fd`).
    ``rdma_capable``: GPUDirect-RDMA capable (``gpuDirectRDMACapable``), for NIC access.
    A flag the device cannot grant is dropped with one warning per device; the handle's
    :class:`GrantedFlags` say what it really has.
    """

    shareable: bool = False
    rdma_capable: bool = False

    def __post_init__(self) -> None:
        for name in ("shareable", "rdma_capable"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def resolve(cls, options: AllocationOptions | None) -> AllocationOptions:
        """``options``, or the plain options (neither flag) for ``None``; ``TypeError`` for
        anything else."""
        if options is None:
            return cls()
        if not isinstance(options, AllocationOptions):
            raise TypeError(f"options must be an AllocationOptions, got {options!r}")
        return options


@dataclass(frozen=True)
class GrantedFlags(AllocationOptions):
    """The options one physical allocation really has (requested flags may be refused)."""


#: plain allocations: not shareable, not RDMA-capable
DEFAULT_OPTIONS = AllocationOptions()


@dataclass(frozen=True)
class DeviceCapabilities:
    """What a device supports, as its driver reports it."""

    vmm: bool
    posix_fd_handles: bool
    gpudirect_rdma_with_vmm: bool
    fabric_handles: bool


@dataclass
class PhysicalHandle:
    """One physical allocation (``cuMemCreate`` result, or a host memfd).

    ``handle`` is the backend's opaque value (a ``CUmemGenericAllocationHandle`` or an fd).
    Owned by whoever created or imported it; release it with :meth:`VmmDriver.release`.
    """

    handle: int
    size: int
    device: int
    granted: GrantedFlags
    imported: bool = False
    released: bool = False


class VmmDriver(abc.ABC):
    """One backend of the VMM API, bound to one device."""

    #: backend name: ``"cuda"``, ``"hip"`` or ``"host"``
    name: str = ""
    #: DLPack device type of memory this driver maps
    dlpack_device_type: int = DLPACK_CPU
    #: True where :meth:`create` always returns zero-filled memory (so zeroing can be skipped)
    creates_zeroed_memory: bool = False

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = int(device_index)

    # -- queries ---------------------------------------------------------------
    @abc.abstractmethod
    def granularity(self, options: AllocationOptions = DEFAULT_OPTIONS) -> int:
        """Minimum allocation/mapping granularity in bytes for allocations with ``options``."""

    @abc.abstractmethod
    def capabilities(self) -> DeviceCapabilities:
        """Device capability attributes (VMM, POSIX-FD handles, GDR with VMM, fabric)."""

    @property
    def torch_device(self) -> str:
        """The torch device string for memory of this driver (``"cpu"`` or ``"cuda:N"``)."""
        return "cpu" if self.dlpack_device_type == DLPACK_CPU else f"cuda:{self.device_index}"

    # -- context ---------------------------------------------------------------
    def ensure_context(self) -> None:  # noqa: B027 - optional hook
        """Make the device's primary context current on this thread (no-op on host)."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait for all work on the device (no-op on host). Call before unmapping."""

    # -- address space ---------------------------------------------------------
    @abc.abstractmethod
    def reserve(self, size: int, alignment: int = 0) -> int:
        """Reserve ``size`` bytes of virtual address space; returns the base address."""

    @abc.abstractmethod
    def free_reserved(self, va: int, size: int) -> None:
        """Return a reservation made by :meth:`reserve` (everything must be unmapped)."""

    # -- physical memory -------------------------------------------------------
    @abc.abstractmethod
    def create(self, size: int, device: int | None = None,
               options: AllocationOptions = DEFAULT_OPTIONS) -> PhysicalHandle:
        """Create a physical allocation of ``size`` bytes (a granularity multiple).

        Flags that the device cannot grant fall back (with one warning per driver, and there
        is one driver per device: :func:`kvconnect.vmm.probe_vmm`); the returned handle's
        ``granted`` says what it really has.
        """

    @abc.abstractmethod
    def map(self, va: int, size: int, handle: PhysicalHandle, offset: int = 0) -> None:
        """Map ``size`` bytes of ``handle`` (from ``offset``) at ``va``; no access yet."""

    @abc.abstractmethod
    def set_access(self, va: int, size: int, devices: Sequence[int] | None = None) -> None:
        """Grant this device (and peer ``devices``, where the backend has peers) read/write
        access to a mapped range."""

    @abc.abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Unmap a range that covers whole mappings. Touching it afterwards faults."""

    @abc.abstractmethod
    def release(self, handle: PhysicalHandle) -> None:
        """Release a physical allocation (memory is freed once it is also unmapped)."""

    def unmap_and_release(self, va: int, size: int, handle: PhysicalHandle) -> None:
        """Unmap one whole mapping and release its handle (released even if unmap fails)."""
        try:
            self.unmap(va, size)
        finally:
            self.release(handle)

    @abc.abstractmethod
    def memset(self, va: int, value: int, size: int) -> None:
        """Fill ``size`` mapped bytes at ``va`` with ``value`` (synchronously)."""

    # -- sharing ---------------------------------------------------------------
    @abc.abstractmethod
    def export_fd(self, handle: PhysicalHandle) -> int:
        """Export a shareable allocation as a POSIX file descriptor owned by the caller."""

    @abc.abstractmethod
    def import_fd(self, fd: int, size: int) -> PhysicalHandle:
        """Import an allocation from a POSIX fd (the fd stays owned by the caller)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}:{self.device_index}>"


@dataclass(frozen=True)
class VmmProbe:
    """Result of probing a device: the driver, or ``None`` and the reason."""

    driver: VmmDriver | None
    reason: str = ""
