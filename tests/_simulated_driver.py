"""A SIMULATED CUDA/HIP driver library, for the VMM driver's flag and fallback logic on a
machine without a GPU (no GPU can exist where the CPU tests run).

:class:`SimulatedDriverLibraryNoGpu` stands in for the ``DriverLibrary`` that
:class:`kvconnect.vmm.cuda.CudaVmmDriver` (and the HIP driver) call: it answers every entry
point the driver uses (and the block-copy engine's stream calls: ``cuMemcpyBatchAsync``,
``cuMemcpyHtoDAsync_v2``, ``cuGraphLaunch``), with configurable device attributes and
``cuMemCreate`` refusals, and records every call. It allocates and copies nothing; the real
driver is exercised by the ``gpu`` tests on the GPU machine.
"""

from __future__ import annotations

from typing import Any

from kvconnect.vmm import _driver_api as api
from kvconnect.vmm.base import VmmError
from kvconnect.vmm.cuda import CudaVmmDriver

MiB = 1024 * 1024


def deref(arg: Any) -> Any:
    """The object behind a ``ctypes.byref`` argument."""
    return arg._obj


class SimulatedDriverLibraryNoGpu:
    """Stands in for libcuda/libamdhip64 on a GPU-less machine: answers the calls the driver
    makes, with configurable attributes and cuMemCreate refusals, and records every call."""

    def __init__(self, backend: api.Backend, *, gdr: int = 1, posix: int = 1,
                 refuse_rdma: bool = False, refuse_posix: bool = False, oom: bool = False,
                 granularity: int = 2 * MiB, missing: frozenset[str] = frozenset(),
                 driver_version: int = 13000, stream_rc: int = 0) -> None:
        self.backend = backend
        #: logical entries this library does not export; the version cuDriverGetVersion
        #: reports; the status every stream call returns (a failed batch fails at copy 1)
        self.missing, self.driver_version, self.stream_rc = missing, driver_version, stream_rc
        self.path = f"simulated-{backend.name}"
        self.attrs = {backend.attr_vmm: 1, backend.attr_posix_fd: posix,
                      backend.attr_gpudirect_rdma_with_vmm: gdr, backend.attr_fabric: 0}
        self.refuse_rdma, self.refuse_posix, self.oom = refuse_rdma, refuse_posix, oom
        self.gran = granularity
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.created: dict[int, tuple[int, int, int]] = {}  # handle -> (size, types, rdma)
        self.released: list[int] = []
        self.mapped: list[tuple[int, int, int, int]] = []
        self.current_ctx = 0
        self.current_device = 0
        self._next = 0x1000

    # DriverLibrary interface ------------------------------------------------------------------
    def has(self, logical: str) -> bool:
        return logical in api.ENTRIES and logical not in self.missing

    def raw(self, logical: str) -> Any:
        if not self.has(logical):
            raise VmmError(self.symbol(logical), "symbol not exported")
        return lambda *args: self.try_call(logical, *args)

    def symbol(self, logical: str) -> str:
        return api.ENTRIES[logical].symbol(self.backend.name) or logical

    def error_name(self, code: int) -> str:
        return {1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY"}.get(code, str(code))

    def error_string(self, code: int) -> str:
        return ""

    def error(self, logical: str, code: int, detail: str = "") -> VmmError:
        return VmmError(self.symbol(logical), self.error_name(code), detail)

    def call(self, logical: str, *args: Any) -> None:
        rc = self.try_call(logical, *args)
        if rc:
            raise self.error(logical, rc)

    def try_call(self, logical: str, *args: Any) -> int:
        self.calls.append((logical, args))
        return getattr(self, "_" + logical)(*args)

    # simulated entry points --------------------------------------------------------------------
    def _init(self, flags: int) -> int:
        return 0

    def _device_get(self, out: Any, ordinal: int) -> int:
        deref(out).value = ordinal
        return 0

    def _device_get_attribute(self, out: Any, attr: int, dev: int) -> int:
        if attr not in self.attrs or self.attrs[attr] is None:
            return 1
        deref(out).value = self.attrs[attr]
        return 0

    def _device_primary_ctx_retain(self, out: Any, dev: int) -> int:
        deref(out).value = 0xC0 + dev
        return 0

    def _ctx_get_current(self, out: Any) -> int:
        deref(out).value = self.current_ctx or None
        return 0

    def _ctx_set_current(self, ctx: int) -> int:
        self.current_ctx = ctx
        return 0

    def _ctx_get_device(self, out: Any) -> int:
        deref(out).value = self.current_device
        return 0

    def _set_device(self, dev: int) -> int:
        self.current_device = dev
        return 0

    def _mem_get_allocation_granularity(self, out: Any, prop: Any, option: int) -> int:
        deref(out).value = self.gran
        return 0

    def _mem_create(self, out: Any, size: int, prop: Any, flags: int) -> int:
        p = deref(prop)
        rdma, types = p.allocFlags.gpuDirectRDMACapable, p.requestedHandleTypes
        if self.oom:
            return 2
        if (rdma and self.refuse_rdma) or (types and self.refuse_posix):
            return 1
        self._next += 1
        self.created[self._next] = (size, types, rdma)
        deref(out).value = self._next
        return 0

    def _mem_get_allocation_properties_from_handle(self, prop: Any, handle: int) -> int:
        size, types, rdma = self.created[handle]
        p = deref(prop)
        p.requestedHandleTypes = types
        p.allocFlags.gpuDirectRDMACapable = rdma
        return 0

    def _mem_map(self, va: int, size: int, offset: int, handle: int, flags: int) -> int:
        self.mapped.append((va, size, offset, handle))
        return 0

    def _mem_release(self, handle: int) -> int:
        self.released.append(handle)
        return 0

    def _device_get_count(self, out: Any) -> int:
        deref(out).value = 1
        return 0

    def _mem_address_reserve(self, out: Any, size: int, align: int, addr: int,
                             flags: int) -> int:
        self._next_va = getattr(self, "_next_va", 0x7000_0000_0000)
        deref(out).value = self._next_va
        self._next_va += size
        return 0

    def _mem_address_free(self, va: int, size: int) -> int:
        return 0

    def _mem_set_access(self, va: int, size: int, descs: Any, count: int) -> int:
        return 0

    def _mem_unmap(self, va: int, size: int) -> int:
        return 0

    def _ctx_synchronize(self) -> int:
        return 0

    def _driver_get_version(self, out: Any) -> int:
        deref(out).value = self.driver_version
        return 0

    def _memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        return self.stream_rc

    def _graph_launch(self, graph_exec: int, stream: int) -> int:
        return self.stream_rc

    def _memcpy_batch_async(self, *args: Any) -> int:  # CUDA 12.8 ABI: failIdx at 7
        if self.stream_rc:
            deref(args[7]).value = 1
        return self.stream_rc

    def _memcpy_batch_async_v2(self, *args: Any) -> int:
        return self.stream_rc


def simulated_driver(cls: type = CudaVmmDriver, **kw: Any) -> tuple[Any, SimulatedDriverLibraryNoGpu]:
    lib = SimulatedDriverLibraryNoGpu(cls.backend, **kw)
    return cls(0, library=lib), lib


def create_props(lib: SimulatedDriverLibraryNoGpu) -> list[tuple[int, int]]:
    return [(deref(a[2]).requestedHandleTypes, deref(a[2]).allocFlags.gpuDirectRDMACapable)
            for name, a in lib.calls if name == "mem_create"]
