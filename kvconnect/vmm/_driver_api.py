"""One ctypes symbol table for the CUDA driver (``libcuda.so.1``) and HIP (``libamdhip64.so``).

HIP's VMM API mirrors CUDA's: the same entry points (``cuMemCreate`` <-> ``hipMemCreate``), the
same struct layouts and the same enum values for handle types, locations and access flags. Each
:class:`Entry` names one logical call, its CUDA symbol and its HIP twin, and the ctypes
signature both share; :func:`load_library` resolves a table for one backend and sets
``argtypes``/``restype`` once.

Every number here was checked against the real headers:

- CUDA: ``cuda.h`` of CUDA 12.6.3 (``CUDA_VERSION 12060``), compiled with gcc to read
  ``sizeof``/``offsetof``; the VMM types and these enums are unchanged in CUDA 13.
- HIP: ``include/hip/hip_runtime_api.h`` (ROCm/HIP), the VMM structs compiled with gcc; the
  device attributes of HIP 7.13 (``hipDeviceAttributeGPUDirectRDMAWithHipVMMSupported = 94``).

Device attributes are the one place where the two differ: HIP numbers its
``hipDeviceAttribute_t`` enum on its own (VMM support is 89, not 102), so each :class:`Backend`
carries its own attribute numbers.

Where the driver exports a versioned symbol that the header maps the plain name to, the table
names the versioned one (``cuMemsetD8_v2``, ``cuDevicePrimaryCtxRelease_v2``, ...). It never
picks ``_v2`` blindly: CUDA 13's ``cuCtxSynchronize_v2`` takes a context argument, so the table
binds plain ``cuCtxSynchronize``. ``cuMemcpyBatchAsync`` has an entry per ABI: CUDA 12.8's
with ``failIdx`` (HIP's twin too) and CUDA 13's ``_v2`` without; a CUDA 13 driver has both.

The table also holds the block-copy engine's stream calls: it is the package's one binding of
the driver, loaded once per process by :func:`load_library`.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import KvconnectError
from .base import VmmError

# -- scalar types (cuda.h) -------------------------------------------------------------------
#: ``CUresult`` / ``hipError_t`` (C enums, 4 bytes)
CUresult = ctypes.c_int
#: ``CUdevice`` / ``hipDevice_t`` (a device ordinal)
CUdevice = ctypes.c_int
#: ``CUdeviceptr`` is ``unsigned long long`` on 64-bit; HIP uses ``void*`` (same ABI on LP64)
CUdeviceptr = ctypes.c_ulonglong
#: ``CUmemGenericAllocationHandle`` is ``unsigned long long``; HIP's is an opaque pointer
CUmemGenericAllocationHandle = ctypes.c_ulonglong
#: ``CUcontext`` / ``hipCtx_t``: opaque pointers
CUcontext = ctypes.c_void_p
#: ``CUstream`` / ``hipStream_t`` and ``CUgraphExec`` / ``hipGraphExec_t``: opaque pointers
CUstream = ctypes.c_void_p
CUgraphExec = ctypes.c_void_p

# -- constants (cuda.h, CUDA 12.6.3; identical hip* values in hip_runtime_api.h) --------------
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_DEVICE = 101
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
#: hipErrorOutOfMemory (hip_runtime_api.h ``hipError_t``)
HIP_ERROR_OUT_OF_MEMORY = 2

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1  # hipMemAllocationTypePinned
CU_MEM_LOCATION_TYPE_DEVICE = 0x1  # hipMemLocationTypeDevice
CU_MEM_HANDLE_TYPE_NONE = 0x0  # hipMemHandleTypeNone
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1  # hipMemHandleTypePosixFileDescriptor
CU_MEM_HANDLE_TYPE_FABRIC = 0x8  # CUDA only (IMEX)
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3  # hipMemAccessFlagsProtReadWrite
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0  # hipMemAllocationGranularityMinimum
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1  # hipMemAllocationGranularityRecommended
CU_MEM_ALLOCATION_COMP_NONE = 0x0
# batch copies (cuda.h of CUDA 12.8 and later)
CU_MEM_LOCATION_TYPE_INVALID = 0x0  # hipMemLocationTypeInvalid
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1  # hipMemcpySrcAccessOrderStream

# CUdevice_attribute (cuda.h). NB: 110, not 112 (112 is SPARSE_CUDA_ARRAY_SUPPORTED).
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 128

# hipDeviceAttribute_t (hip_runtime_api.h; counted from hipDeviceAttributeCudaCompatibleBegin=0)
HIP_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 89
HIP_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_HIP_VMM_SUPPORTED = 94  # HIP >= 7.13
HIP_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED = 95  # newer HIP; absent before


# -- structs ---------------------------------------------------------------------------------
class CUmemLocation(ctypes.Structure):
    """``CUmemLocation`` (8 bytes): ``{CUmemLocationType type; int id;}``."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    """The anonymous ``allocFlags`` struct of ``CUmemAllocationProp`` (8 bytes)."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    """``CUmemAllocationProp`` (32 bytes, 8-byte aligned)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    """``CUmemAccessDesc`` (12 bytes): ``{CUmemLocation location; CUmemAccess_flags flags;}``."""

    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (24 bytes; CUDA >= 12.8): ``{CUmemcpySrcAccessOrder
    srcAccessOrder; CUmemLocation srcLocHint, dstLocHint; unsigned int flags;}``; HIP's
    ``hipMemcpyAttributes`` has the same layout."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", CUmemLocation),
                ("dstLocHint", CUmemLocation), ("flags", ctypes.c_uint)]


#: ``hipMemLocation`` and ``hipMemAccessDesc`` have CUDA's layouts: one ctypes type each
HipMemLocation, HipMemAccessDesc = CUmemLocation, CUmemAccessDesc


class HipMemAllocFlags(ctypes.Structure):
    """HIP's ``allocFlags``: like CUDA's but without ``reserved[4]`` (4 bytes)."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
    ]


class HipMemAllocationProp(ctypes.Structure):
    """``hipMemAllocationProp``: 32 bytes, every field at CUDA's offset (the missing
    ``reserved[4]`` falls into tail padding). ``requestedHandleType`` is a union with
    ``requestedHandleTypes`` in newer headers; we name it as CUDA does."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", HipMemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", HipMemAllocFlags),
    ]


# -- the symbol table ------------------------------------------------------------------------
_P = ctypes.POINTER
_int, _uint, _size = ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_ull, _vp, _cp = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_char_p


@dataclass(frozen=True)
class Entry:
    """One logical driver call: its CUDA symbol, its HIP twin and their ctypes signature.

    ``cuda``/``hip`` is ``None`` where a backend has no such call (HIP's implicit context needs
    ``hipSetDevice``, which CUDA's driver API does not have). ``hip_argtypes``/``hip_restype``
    override the shared signature where HIP's differs (``hipGetErrorName`` returns the string).
    """

    logical: str
    cuda: str | None
    hip: str | None
    #: ctypes types (c_int, c_void_p, POINTER(...), structures)
    argtypes: tuple[type, ...]
    restype: type | None = CUresult
    hip_argtypes: tuple[type, ...] | None = None
    hip_restype: type | None = None

    def symbol(self, backend: str) -> str | None:
        """The exported symbol name for ``backend`` (``"cuda"`` or ``"hip"``)."""
        return self.cuda if backend == "cuda" else self.hip

    def signature(self, backend: str) -> tuple[tuple[type, ...], type | None]:
        """``(argtypes, restype)`` for ``backend``."""
        if backend == "hip" and self.hip_argtypes is not None:
            return self.hip_argtypes, self.hip_restype
        return self.argtypes, self.restype


#: The table. Signatures follow cuda.h (CUDA 12.6.3) and hip_runtime_api.h.
SYMBOLS: tuple[Entry, ...] = (
    # initialisation, errors, versions
    Entry("init", "cuInit", "hipInit", (_uint,)),
    Entry("get_error_name", "cuGetErrorName", "hipGetErrorName", (CUresult, _P(_cp)),
          hip_argtypes=(CUresult,), hip_restype=_cp),
    Entry("get_error_string", "cuGetErrorString", "hipGetErrorString", (CUresult, _P(_cp)),
          hip_argtypes=(CUresult,), hip_restype=_cp),
    Entry("driver_get_version", "cuDriverGetVersion", "hipDriverGetVersion", (_P(_int),)),
    # devices
    Entry("device_get_count", "cuDeviceGetCount", "hipGetDeviceCount", (_P(_int),)),
    Entry("device_get", "cuDeviceGet", "hipDeviceGet", (_P(CUdevice), _int)),
    Entry("device_get_attribute", "cuDeviceGetAttribute", "hipDeviceGetAttribute",
          (_P(_int), _int, CUdevice)),
    # contexts (HIP: implicit, per-thread current device)
    Entry("device_primary_ctx_retain", "cuDevicePrimaryCtxRetain", "hipDevicePrimaryCtxRetain",
          (_P(CUcontext), CUdevice)),
    Entry("device_primary_ctx_release", "cuDevicePrimaryCtxRelease_v2",
          "hipDevicePrimaryCtxRelease", (CUdevice,)),
    Entry("ctx_get_current", "cuCtxGetCurrent", "hipCtxGetCurrent", (_P(CUcontext),)),
    Entry("ctx_set_current", "cuCtxSetCurrent", "hipCtxSetCurrent", (CUcontext,)),
    Entry("ctx_push_current", "cuCtxPushCurrent_v2", "hipCtxPushCurrent", (CUcontext,)),
    Entry("ctx_pop_current", "cuCtxPopCurrent_v2", "hipCtxPopCurrent", (_P(CUcontext),)),
    Entry("ctx_get_device", "cuCtxGetDevice", "hipGetDevice", (_P(CUdevice),)),
    Entry("ctx_synchronize", "cuCtxSynchronize", "hipCtxSynchronize", ()),
    Entry("set_device", None, "hipSetDevice", (_int,)),
    Entry("device_synchronize", None, "hipDeviceSynchronize", ()),
    # memory
    Entry("mem_get_info", "cuMemGetInfo_v2", "hipMemGetInfo", (_P(_size), _P(_size))),
    Entry("memset_d8", "cuMemsetD8_v2", "hipMemsetD8", (CUdeviceptr, ctypes.c_ubyte, _size)),
    Entry("mem_address_reserve", "cuMemAddressReserve", "hipMemAddressReserve",
          (_P(CUdeviceptr), _size, _size, CUdeviceptr, _ull)),
    Entry("mem_address_free", "cuMemAddressFree", "hipMemAddressFree", (CUdeviceptr, _size)),
    Entry("mem_create", "cuMemCreate", "hipMemCreate",
          (_P(CUmemGenericAllocationHandle), _size, _vp, _ull)),
    Entry("mem_release", "cuMemRelease", "hipMemRelease", (CUmemGenericAllocationHandle,)),
    Entry("mem_map", "cuMemMap", "hipMemMap",
          (CUdeviceptr, _size, _size, CUmemGenericAllocationHandle, _ull)),
    Entry("mem_unmap", "cuMemUnmap", "hipMemUnmap", (CUdeviceptr, _size)),
    Entry("mem_set_access", "cuMemSetAccess", "hipMemSetAccess", (CUdeviceptr, _size, _vp, _size)),
    Entry("mem_get_allocation_granularity", "cuMemGetAllocationGranularity",
          "hipMemGetAllocationGranularity", (_P(_size), _vp, _int)),
    Entry("mem_get_allocation_properties_from_handle", "cuMemGetAllocationPropertiesFromHandle",
          "hipMemGetAllocationPropertiesFromHandle", (_vp, CUmemGenericAllocationHandle)),
    Entry("mem_export_to_shareable_handle", "cuMemExportToShareableHandle",
          "hipMemExportToShareableHandle", (_vp, CUmemGenericAllocationHandle, _int, _ull)),
    Entry("mem_import_from_shareable_handle", "cuMemImportFromShareableHandle",
          "hipMemImportFromShareableHandle", (_P(CUmemGenericAllocationHandle), _vp, _int)),
    # stream work of the block-copy engine (optional: an old driver lacks the batch copy)
    Entry("memcpy_htod_async", "cuMemcpyHtoDAsync_v2", "hipMemcpyHtoDAsync",
          (CUdeviceptr, _vp, _size, CUstream)),
    Entry("graph_launch", "cuGraphLaunch", "hipGraphLaunch", (CUgraphExec, CUstream)),
    # (dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream): arrays of
    # CUdeviceptr / size_t passed as pointers
    Entry("memcpy_batch_async", "cuMemcpyBatchAsync", "hipMemcpyBatchAsync",
          (_vp, _vp, _vp, _size, _P(CUmemcpyAttributes), _vp, _size, _P(_size), CUstream)),
    Entry("memcpy_batch_async_v2", "cuMemcpyBatchAsync_v2", None,
          (_vp, _vp, _vp, _size, _P(CUmemcpyAttributes), _vp, _size, CUstream)),
)

ENTRIES: dict[str, Entry] = {e.logical: e for e in SYMBOLS}


@dataclass(frozen=True)
class Backend:
    """What differs between CUDA and HIP beyond symbol names."""

    name: str
    #: sonames tried in order
    library_names: tuple[str, ...]
    prop_struct: type[ctypes.Structure]
    access_desc_struct: type[ctypes.Structure]
    attr_vmm: int
    #: ``None``: the backend has no such attribute
    attr_posix_fd: int | None
    attr_gpudirect_rdma_with_vmm: int | None
    attr_fabric: int | None
    #: logical entries that must resolve for the driver to work
    required: frozenset[str] = field(default_factory=frozenset)


_COMMON_REQUIRED = frozenset({
    "init", "get_error_name", "device_get_count", "device_get", "device_get_attribute",
    "mem_address_reserve", "mem_address_free", "mem_create", "mem_release", "mem_map",
    "mem_unmap", "mem_set_access", "mem_get_allocation_granularity", "memset_d8",
    "mem_export_to_shareable_handle", "mem_import_from_shareable_handle",
})

CUDA = Backend(
    name="cuda",
    library_names=("libcuda.so.1", "libcuda.so"),
    prop_struct=CUmemAllocationProp,
    access_desc_struct=CUmemAccessDesc,
    attr_vmm=CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    attr_posix_fd=CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    attr_gpudirect_rdma_with_vmm=CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
    attr_fabric=CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
    required=_COMMON_REQUIRED | {"device_primary_ctx_retain", "ctx_get_current",
                                 "ctx_set_current", "ctx_push_current", "ctx_pop_current",
                                 "ctx_synchronize"},
)

HIP = Backend(
    name="hip",
    library_names=("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"),
    prop_struct=HipMemAllocationProp,
    access_desc_struct=HipMemAccessDesc,
    attr_vmm=HIP_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    attr_posix_fd=None,
    attr_gpudirect_rdma_with_vmm=HIP_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_HIP_VMM_SUPPORTED,
    attr_fabric=HIP_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
    required=_COMMON_REQUIRED | {"set_device", "ctx_get_device", "device_synchronize"},
)


class DriverLibraryError(KvconnectError, OSError):
    """The backend's shared library is missing or lacks a required symbol."""


class DriverLibrary:
    """A loaded driver library with the table's functions bound (``argtypes`` set once).

    ``call(logical, *args)`` runs one entry and raises :class:`VmmError` (named by the
    driver's own error name) on a non-zero status; ``raw(logical)`` gives the ctypes function.
    """

    def __init__(self, backend: Backend, handle: ctypes.CDLL, path: str) -> None:
        self.backend = backend
        self.path = path
        self._lib = handle
        self._fns: dict[str, Callable[..., Any]] = {}
        missing: list[str] = []
        for entry in SYMBOLS:
            sym = entry.symbol(backend.name)
            if sym is None:
                continue
            try:
                fn = getattr(handle, sym)
            except AttributeError:
                missing.append(entry.logical)
                continue
            argtypes, restype = entry.signature(backend.name)
            fn.argtypes = list(argtypes)
            fn.restype = restype
            self._fns[entry.logical] = fn
        self.missing = frozenset(missing)
        lacking = sorted(self.missing & backend.required)
        if lacking:
            names = ", ".join(str(ENTRIES[n].symbol(backend.name)) for n in lacking)
            raise DriverLibraryError(f"{path} lacks required symbols: {names} (driver too old?)")

    def has(self, logical: str) -> bool:
        """Whether the library exports ``logical``'s symbol."""
        return logical in self._fns

    def symbol(self, logical: str) -> str:
        """The exported symbol name of a logical entry (for messages)."""
        return ENTRIES[logical].symbol(self.backend.name) or logical

    def raw(self, logical: str) -> Callable[..., Any]:
        """The bound ctypes function; :class:`VmmError` if this library does not export it."""
        try:
            return self._fns[logical]
        except KeyError:
            raise VmmError(self.symbol(logical), "symbol not exported",
                           f"{self.path} has no {self.symbol(logical)}") from None

    def try_call(self, logical: str, *args: object) -> int:
        """Run one entry and return its status code (0 = success) without raising."""
        return int(self.raw(logical)(*args))

    def call(self, logical: str, *args: object) -> None:
        """Run one entry; raise :class:`VmmError` with the driver's error name on failure."""
        rc = self.raw(logical)(*args)
        if rc:
            raise self.error(logical, rc)

    def error(self, logical: str, code: int, detail: str = "") -> VmmError:
        """A :class:`VmmError` for status ``code`` of ``logical``'s call."""
        desc = self.error_string(code)
        if detail and desc:
            detail = f"{desc}; {detail}"
        return VmmError(self.symbol(logical), self.error_name(code), detail or desc)

    def _error_text(self, logical: str, code: int) -> str:
        fn = self._fns.get(logical)
        if fn is None:
            return ""
        try:
            if self.backend.name == "hip":
                out = fn(code)
                return out.decode(errors="replace") if out else ""
            text = ctypes.c_char_p()
            if fn(code, ctypes.byref(text)) != 0 or not text.value:
                return ""
            return text.value.decode(errors="replace")
        except Exception:  # noqa: BLE001 - never mask the original failure
            return ""

    def error_name(self, code: int) -> str:
        """The driver's name for a status code (``CUDA_ERROR_OUT_OF_MEMORY``), or the number."""
        return self._error_text("get_error_name", code) or f"error {code}"

    def error_string(self, code: int) -> str:
        """The driver's description of a status code ('' if unknown)."""
        return self._error_text("get_error_string", code)


_LOADED: dict[tuple[str, str | None], DriverLibrary] = {}
_LOAD_LOCK = threading.Lock()


def load_library(backend: Backend, path: str | None = None) -> DriverLibrary:
    """Load (once per process) and bind the driver library of ``backend``.

    ``path`` overrides the sonames tried. Raises :class:`DriverLibraryError` naming every
    soname tried when none loads.
    """
    key = (backend.name, path)
    with _LOAD_LOCK:
        lib = _LOADED.get(key)
        if lib is not None:
            return lib
        names = (path,) if path else backend.library_names
        errors: list[str] = []
        for name in names:
            try:
                handle = ctypes.CDLL(name)
            except OSError as exc:
                errors.append(str(exc) if name in str(exc) else f"{name}: {exc}")
                continue
            lib = DriverLibrary(backend, handle, name)
            _LOADED[key] = lib
            return lib
        raise DriverLibraryError("; ".join(errors) or f"no library for {backend.name}")


def optional_library(backend: Backend) -> DriverLibrary | None:
    """:func:`load_library` of ``backend``'s default sonames, or None where none loads (no such
    driver on this machine, or one lacking a required symbol)."""
    try:
        return load_library(backend)
    except DriverLibraryError:
        return None
