"""CUDA and HIP VMM backends.

CPU part: the ctypes table against the real headers (struct sizes/offsets, constants, symbol
names and arities), probing on a machine without a driver, and the flag-fallback logic of the
shared GPU driver run against a simulated driver library (no GPU exists here).

GPU part (``@pytest.mark.gpu``, skipped without a CUDA device with VMM): the real driver on
real memory: reserve/create/map/access/memset/unmap/release, POSIX-FD export to a spawned
process over SCM_RIGHTS, granted flags, GPUDirect-RDMA flag per attribute, fresh threads.

Expected numbers below were read from the headers by compiling them with gcc:
- cuda.h of CUDA 12.6.3 (``#define CUDA_VERSION 12060``); VMM types unchanged in CUDA 13.
- include/hip/hip_runtime_api.h (ROCm/HIP); HIP 7.13 device attributes.
They guard machines without headers; tests/test_driver_headers.py compiles a probe against
the headers found on the machine (layouts, constants, the bytes of a filled struct).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _simulated_driver import SimulatedDriverLibraryNoGpu, create_props, deref, simulated_driver

from kvconnect.vmm import _driver_api as api
from kvconnect.vmm.base import (
    DLPACK_CUDA,
    DLPACK_ROCM,
    AllocationOptions,
    GrantedFlags,
    VmmError,
)
from kvconnect.vmm.cuda import CudaVmmDriver, probe_cuda
from kvconnect.vmm.hip import HipVmmDriver, probe_hip

REPO = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024

# ---------------------------------------------------------------------------------------------
# Struct layouts: (field, offset, size) from gcc offsetof/sizeof over cuda.h 12.6.3
# ---------------------------------------------------------------------------------------------
CUDA_LAYOUTS: dict[type[ctypes.Structure], tuple[int, list[tuple[str, int, int]]]] = {
    api.CUmemLocation: (8, [("type", 0, 4), ("id", 4, 4)]),
    api.CUmemAllocationProp: (32, [("type", 0, 4), ("requestedHandleTypes", 4, 4),
                                   ("location", 8, 8), ("win32HandleMetaData", 16, 8),
                                   ("allocFlags", 24, 8)]),
    api.CUmemAllocFlags: (8, [("compressionType", 0, 1), ("gpuDirectRDMACapable", 1, 1),
                              ("usage", 2, 2), ("reserved", 4, 4)]),
    api.CUmemAccessDesc: (12, [("location", 0, 8), ("flags", 8, 4)]),
    # cuda.h of CUDA 13.0 (batch copies, CUDA >= 12.8); hipMemcpyAttributes is the same
    api.CUmemcpyAttributes: (24, [("srcAccessOrder", 0, 4), ("srcLocHint", 4, 8),
                                  ("dstLocHint", 12, 8), ("flags", 20, 4)]),
}
# hip_runtime_api.h: hipMemAllocationProp is 32 bytes (its 4-byte allocFlags, which lacks
# reserved[4], sits at 24 and the struct pads to 8-byte alignment); the rest as CUDA's.
HIP_LAYOUTS: dict[type[ctypes.Structure], tuple[int, list[tuple[str, int, int]]]] = {
    api.HipMemLocation: (8, [("type", 0, 4), ("id", 4, 4)]),
    api.HipMemAllocationProp: (32, [("type", 0, 4), ("requestedHandleTypes", 4, 4),
                                    ("location", 8, 8), ("win32HandleMetaData", 16, 8),
                                    ("allocFlags", 24, 4)]),
    api.HipMemAllocFlags: (4, [("compressionType", 0, 1), ("gpuDirectRDMACapable", 1, 1),
                               ("usage", 2, 2)]),
    api.HipMemAccessDesc: (12, [("location", 0, 8), ("flags", 8, 4)]),
}


@pytest.mark.parametrize("struct", list(CUDA_LAYOUTS) + list(HIP_LAYOUTS),
                         ids=lambda s: s.__name__)
def test_struct_layout_matches_header(struct: type[ctypes.Structure]) -> None:
    size, fields = {**CUDA_LAYOUTS, **HIP_LAYOUTS}[struct]
    assert ctypes.sizeof(struct) == size
    for name, offset, fsize in fields:
        descr = getattr(struct, name)
        assert (descr.offset, descr.size) == (offset, fsize), f"{struct.__name__}.{name}"


@pytest.mark.parametrize(("cuda", "hip"), [
    (api.CUmemLocation, api.HipMemLocation),
    (api.CUmemAllocationProp, api.HipMemAllocationProp),
    (api.CUmemAccessDesc, api.HipMemAccessDesc),
], ids=["location", "alloc_prop", "access_desc"])
def test_hip_structs_equal_cuda(cuda: type[ctypes.Structure],
                                hip: type[ctypes.Structure]) -> None:
    assert ctypes.sizeof(cuda) == ctypes.sizeof(hip)
    assert ctypes.alignment(cuda) == ctypes.alignment(hip)
    for name, *_ in hip._fields_:
        assert getattr(hip, name).offset == getattr(cuda, name).offset, name


def test_constants_match_headers() -> None:
    # cuda.h enums (CUDA 12.6.3); identical hip* values in hip_runtime_api.h
    assert api.CU_MEM_ALLOCATION_TYPE_PINNED == 1
    assert api.CU_MEM_LOCATION_TYPE_DEVICE == 1
    assert api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR == 1
    assert api.CU_MEM_HANDLE_TYPE_FABRIC == 8
    assert api.CU_MEM_ACCESS_FLAGS_PROT_READWRITE == 3
    assert api.CU_MEM_ALLOC_GRANULARITY_MINIMUM == 0
    assert api.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED == 1
    assert api.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == 102
    assert api.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED == 103
    # 110 in cuda.h (112 is CU_DEVICE_ATTRIBUTE_SPARSE_CUDA_ARRAY_SUPPORTED)
    assert api.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED == 110
    assert api.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED == 128
    # batch copies (cuda.h of CUDA 13.0; hipMemcpySrcAccessOrderStream, hipMemLocationTypeInvalid)
    assert api.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM == 1
    assert api.CU_MEM_LOCATION_TYPE_INVALID == 0
    assert (api.CUDA_ERROR_OUT_OF_MEMORY, api.CUDA_ERROR_NOT_PERMITTED,
            api.CUDA_ERROR_NOT_SUPPORTED, api.CUDA_ERROR_NO_DEVICE) == (2, 800, 801, 100)
    # hipDeviceAttribute_t, counted from hipDeviceAttributeCudaCompatibleBegin = 0
    assert api.HIP_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED == 89
    assert api.HIP_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_HIP_VMM_SUPPORTED == 94
    assert api.HIP_ERROR_OUT_OF_MEMORY == api.CUDA_ERROR_OUT_OF_MEMORY
    assert api.CUDA.attr_vmm == 102 and api.HIP.attr_vmm == 89
    assert api.CUDA.attr_gpudirect_rdma_with_vmm == 110
    assert api.HIP.attr_posix_fd is None


# ---------------------------------------------------------------------------------------------
# Symbol table: names, twins, arities (prototypes in cuda.h / hip_runtime_api.h)
# ---------------------------------------------------------------------------------------------
#: CUDA symbol -> (HIP twin per HIPIFY / hip_runtime_api.h or None, parameter count in cuda.h)
EXPECTED_TWINS: dict[str, tuple[str | None, int]] = {
    "cuInit": ("hipInit", 1),
    "cuGetErrorName": ("hipGetErrorName", 2),
    "cuGetErrorString": ("hipGetErrorString", 2),
    "cuDriverGetVersion": ("hipDriverGetVersion", 1),
    "cuDeviceGetCount": ("hipGetDeviceCount", 1),
    "cuDeviceGet": ("hipDeviceGet", 2),
    "cuDeviceGetAttribute": ("hipDeviceGetAttribute", 3),
    "cuDevicePrimaryCtxRetain": ("hipDevicePrimaryCtxRetain", 2),
    "cuDevicePrimaryCtxRelease_v2": ("hipDevicePrimaryCtxRelease", 1),
    "cuCtxGetCurrent": ("hipCtxGetCurrent", 1),
    "cuCtxSetCurrent": ("hipCtxSetCurrent", 1),
    "cuCtxPushCurrent_v2": ("hipCtxPushCurrent", 1),
    "cuCtxPopCurrent_v2": ("hipCtxPopCurrent", 1),
    "cuCtxGetDevice": ("hipGetDevice", 1),
    "cuCtxSynchronize": ("hipCtxSynchronize", 0),
    "cuMemGetInfo_v2": ("hipMemGetInfo", 2),
    "cuMemsetD8_v2": ("hipMemsetD8", 3),
    "cuMemAddressReserve": ("hipMemAddressReserve", 5),
    "cuMemAddressFree": ("hipMemAddressFree", 2),
    "cuMemCreate": ("hipMemCreate", 4),
    "cuMemRelease": ("hipMemRelease", 1),
    "cuMemMap": ("hipMemMap", 5),
    "cuMemUnmap": ("hipMemUnmap", 2),
    "cuMemSetAccess": ("hipMemSetAccess", 4),
    "cuMemGetAllocationGranularity": ("hipMemGetAllocationGranularity", 3),
    "cuMemGetAllocationPropertiesFromHandle": ("hipMemGetAllocationPropertiesFromHandle", 2),
    "cuMemExportToShareableHandle": ("hipMemExportToShareableHandle", 4),
    "cuMemImportFromShareableHandle": ("hipMemImportFromShareableHandle", 3),
    # the block-copy engine's stream work (cuda.h of CUDA 13.0)
    "cuMemcpyHtoDAsync_v2": ("hipMemcpyHtoDAsync", 4),
    "cuGraphLaunch": ("hipGraphLaunch", 2),
    "cuMemcpyBatchAsync": ("hipMemcpyBatchAsync", 9),  # CUDA 12.8 ABI: with failIdx
    "cuMemcpyBatchAsync_v2": (None, 8),  # CUDA 13 ABI: without; HIP has no twin
}
#: HIP-only entries (implicit context) and HIP signatures that differ from CUDA's
HIP_ONLY = {"hipSetDevice": 1, "hipDeviceSynchronize": 0}
HIP_ARITY_OVERRIDES = {"hipGetErrorName": 1, "hipGetErrorString": 1}  # return const char*

REQUIRED_LOGICAL = {
    "mem_address_reserve", "mem_address_free", "mem_create", "mem_map", "mem_set_access",
    "mem_unmap", "mem_release", "mem_export_to_shareable_handle",
    "mem_import_from_shareable_handle", "mem_get_allocation_granularity", "device_get_attribute",
    "device_get", "device_primary_ctx_retain", "ctx_set_current", "ctx_synchronize",
    "memset_d8", "init", "get_error_name", "get_error_string",
}


def test_table_covers_every_logical_entry() -> None:
    assert REQUIRED_LOGICAL <= set(api.ENTRIES)
    assert len(api.ENTRIES) == len(api.SYMBOLS), "duplicate logical names"


def test_every_cuda_symbol_has_its_hip_twin() -> None:
    cuda_entries = [e for e in api.SYMBOLS if e.cuda is not None]
    assert {e.cuda for e in cuda_entries} == set(EXPECTED_TWINS)
    for e in cuda_entries:
        assert e.hip == EXPECTED_TWINS[e.cuda][0], e.logical
    hip_only = {e.hip for e in api.SYMBOLS if e.cuda is None}
    assert hip_only == set(HIP_ONLY)


def test_arities_match_header_prototypes() -> None:
    for e in api.SYMBOLS:
        if e.cuda is not None:
            argtypes, _ = e.signature("cuda")
            assert len(argtypes) == EXPECTED_TWINS[e.cuda][1], e.cuda
        hip_args, _ = e.signature("hip")
        want = HIP_ARITY_OVERRIDES.get(e.hip) or HIP_ONLY.get(e.hip)
        if want is None:
            want = EXPECTED_TWINS[e.cuda][1]
        assert len(hip_args) == want, e.hip


def test_versioned_symbols_only_where_the_abi_matches() -> None:
    names = {e.logical: e.cuda for e in api.SYMBOLS}
    # cuda.h maps these plain names to the _v2 ABI
    assert names["memset_d8"] == "cuMemsetD8_v2"
    assert names["device_primary_ctx_release"] == "cuDevicePrimaryCtxRelease_v2"
    assert names["mem_get_info"] == "cuMemGetInfo_v2"
    assert names["ctx_push_current"] == "cuCtxPushCurrent_v2"
    # CUDA 13's cuCtxSynchronize_v2 takes a CUcontext: the plain symbol is the right one
    assert names["ctx_synchronize"] == "cuCtxSynchronize"
    assert names["memcpy_htod_async"] == "cuMemcpyHtoDAsync_v2"
    # cuMemcpyBatchAsync: one entry per ABI (12.8 with failIdx, 13.0's _v2 without)
    assert (names["memcpy_batch_async"], names["memcpy_batch_async_v2"]) == \
        ("cuMemcpyBatchAsync", "cuMemcpyBatchAsync_v2")


def test_pointer_sized_types() -> None:
    assert ctypes.sizeof(api.CUdeviceptr) == 8
    assert ctypes.sizeof(api.CUmemGenericAllocationHandle) == 8
    assert ctypes.sizeof(api.CUdevice) == 4
    reserve = api.ENTRIES["mem_address_reserve"].argtypes
    assert reserve[1] is ctypes.c_size_t and reserve[3] is api.CUdeviceptr
    assert api.ENTRIES["mem_map"].argtypes[3] is api.CUmemGenericAllocationHandle


def test_driver_classes() -> None:
    assert (CudaVmmDriver.name, CudaVmmDriver.dlpack_device_type) == ("cuda", DLPACK_CUDA)
    assert (HipVmmDriver.name, HipVmmDriver.dlpack_device_type) == ("hip", DLPACK_ROCM)
    assert DLPACK_CUDA == 2 and DLPACK_ROCM == 10


# ---------------------------------------------------------------------------------------------
# Probing without a driver
# ---------------------------------------------------------------------------------------------
def _loadable(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def test_probe_with_missing_library_returns_reason() -> None:
    probe = probe_cuda(0, library="libkvconnect-absent-cuda.so.1")
    assert probe.driver is None
    assert "libkvconnect-absent-cuda.so.1 not found (no NVIDIA driver)" in probe.reason
    probe = probe_hip(0, library="libkvconnect-absent-hip.so")
    assert probe.driver is None
    assert "libkvconnect-absent-hip.so not found (no ROCm/HIP runtime)" in probe.reason


@pytest.mark.skipif(_loadable("libcuda.so.1"), reason="an NVIDIA driver is installed here")
def test_probe_cuda_on_a_driverless_machine(caplog: pytest.LogCaptureFixture) -> None:
    from kvconnect.vmm import get_vmm_driver, probe_vmm

    probe = probe_cuda(0)
    assert probe.driver is None and "libcuda.so.1" in probe.reason
    assert "no NVIDIA driver" in probe.reason
    assert probe_vmm("cuda:0").reason == probe.reason
    with caplog.at_level(logging.WARNING):
        assert get_vmm_driver("cuda:0") is None
    assert "libcuda.so.1" in caplog.text
    with pytest.raises(OSError, match="libcuda.so.1"):
        CudaVmmDriver(0)


@pytest.mark.skipif(_loadable("libamdhip64.so"), reason="a ROCm runtime is installed here")
def test_probe_hip_on_a_machine_without_rocm() -> None:
    probe = probe_hip(0)
    assert probe.driver is None and "libamdhip64.so" in probe.reason


# ---------------------------------------------------------------------------------------------
# Flag fallback logic against a simulated driver library (tests/_simulated_driver.py; no GPU
# can exist on this machine)
# ---------------------------------------------------------------------------------------------
def test_flags_granted_when_supported(caplog: pytest.LogCaptureFixture) -> None:
    drv, lib = simulated_driver(gdr=1)
    with caplog.at_level(logging.WARNING):
        h = drv.create(4 * MiB, options=AllocationOptions(shareable=True, rdma_capable=True))
    assert h.granted == GrantedFlags(shareable=True, rdma_capable=True)
    assert create_props(lib) == [(api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1)]
    plain = drv.create(2 * MiB)
    assert plain.granted == GrantedFlags(False, False)
    assert create_props(lib)[-1] == (api.CU_MEM_HANDLE_TYPE_NONE, 0)
    assert not caplog.records and drv.fallback_reasons == []


def test_rdma_flag_only_where_attribute_is_one(caplog: pytest.LogCaptureFixture) -> None:
    drv, lib = simulated_driver(gdr=0)
    with caplog.at_level(logging.WARNING, logger="kvconnect.vmm.cuda"):
        a = drv.create(2 * MiB, options=AllocationOptions(rdma_capable=True))
        b = drv.create(2 * MiB, options=AllocationOptions(shareable=True, rdma_capable=True))
    assert a.granted == GrantedFlags(False, False)
    assert b.granted == GrantedFlags(True, False)
    # the flag was never sent to cuMemCreate
    assert [rdma for _, rdma in create_props(lib)] == [0, 0]
    assert len(caplog.records) == 1, "one warning per driver instance"
    assert "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED=0" in caplog.text
    assert len(drv.fallback_reasons) == 2
    # a new driver instance warns again
    drv2, _ = simulated_driver(gdr=0)
    with caplog.at_level(logging.WARNING, logger="kvconnect.vmm.cuda"):
        drv2.create(2 * MiB, options=AllocationOptions(rdma_capable=True))
    assert len(caplog.records) == 2


def test_refused_flags_fall_back_and_are_recorded(caplog: pytest.LogCaptureFixture) -> None:
    drv, lib = simulated_driver(gdr=1, refuse_rdma=True, refuse_posix=True)
    with caplog.at_level(logging.WARNING, logger="kvconnect.vmm.cuda"):
        h = drv.create(2 * MiB, options=AllocationOptions(shareable=True, rdma_capable=True))
    assert h.granted == GrantedFlags(False, False)
    # RDMA dropped first, then the handle type
    assert create_props(lib) == [(1, 1), (1, 0), (0, 0)]
    assert len(caplog.records) == 1 and "refused gpuDirectRDMACapable" in caplog.text
    assert len(drv.fallback_reasons) == 2
    with pytest.raises(ValueError, match="not created shareable"):
        drv.export_fd(h)


def test_out_of_memory_is_not_retried() -> None:
    drv, lib = simulated_driver(gdr=1, oom=True)
    with pytest.raises(VmmError, match="CUDA_ERROR_OUT_OF_MEMORY") as err:
        drv.create(2 * MiB, options=AllocationOptions(shareable=True, rdma_capable=True))
    assert err.value.call == "cuMemCreate"
    assert len(create_props(lib)) == 1
    assert drv.fallback_reasons == []


def test_bad_sizes_and_handles_raise_before_the_driver() -> None:
    drv, lib = simulated_driver()
    with pytest.raises(ValueError, match="multiple of the 2097152-byte granularity; use 4194304"):
        drv.create(3 * MiB)
    with pytest.raises(ValueError, match="positive"):
        drv.create(0)
    with pytest.raises(ValueError, match="positive"):
        drv.reserve(-2 * MiB)
    h = drv.create(2 * MiB)
    with pytest.raises(ValueError, match="does not fit"):
        drv.map(0x7000_0000_0000, 4 * MiB, h)
    with pytest.raises(ValueError, match="byte"):
        drv.memset(0x7000_0000_0000, 256, 2 * MiB)
    drv.release(h)
    drv.release(h)  # idempotent
    assert lib.released == [h.handle]
    with pytest.raises(ValueError, match="released"):
        drv.map(0x7000_0000_0000, 2 * MiB, h)


def test_context_made_current_only_when_none_is() -> None:
    drv, lib = simulated_driver()
    lib.current_ctx = 0
    drv.create(2 * MiB)
    assert lib.current_ctx == 0xC0, "no context: the primary one is made current and stays"
    assert not any(name == "ctx_push_current" for name, _ in lib.calls)


def test_hip_driver_uses_implicit_device_and_offset_zero() -> None:
    drv, lib = simulated_driver(HipVmmDriver, gdr=1)
    assert drv.capabilities().posix_fd_handles  # no HIP attribute: follows VMM support
    lib.current_device = 0
    h = drv.create(4 * MiB, options=AllocationOptions(shareable=True))
    assert h.granted.shareable
    with pytest.raises(ValueError, match="hipMemMap requires offset 0"):
        drv.map(0x7000_0000_0000, 2 * MiB, h, offset=2 * MiB)
    drv.map(0x7000_0000_0000, 2 * MiB, h)
    assert lib.mapped == [(0x7000_0000_0000, 2 * MiB, 0, h.handle)]
    drv.ensure_context()
    assert ("set_device", (0,)) in lib.calls


def test_hip_rdma_attribute_missing_reads_as_unsupported() -> None:
    """Runtimes before HIP 7.13 reject attribute 94: that means 'no GPUDirect RDMA'."""
    drv, lib = simulated_driver(HipVmmDriver, gdr=None)
    caps = drv.capabilities()
    assert caps.vmm and not caps.gpudirect_rdma_with_vmm
    h = drv.create(2 * MiB, options=AllocationOptions(rdma_capable=True))
    assert h.granted.rdma_capable is False


# ---------------------------------------------------------------------------------------------
# The benchmark runs on the host backend (keeps it from rotting; the GPU run is the lead's)
# ---------------------------------------------------------------------------------------------
def test_bench_commit_host_smoke(tmp_path: Path) -> None:
    pytest.importorskip("kvconnect.tensor")
    spec = importlib.util.spec_from_file_location("bench_commit",
                                                  REPO / "benchmarks" / "bench_commit.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    rc = bench.main(["--device", "cpu", "--final-gib", "0.03125", "--warmup-gib", "0.0078125",
                     "--repeats", "2", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    steps = {row["step"]: row for row in data["results"]}
    for step in ("reserve", "commit_1_block", "commit_warmup", "commit_final",
                 "recommit_single_handle", "release_physical", "recommit",
                 "commit_final_single_handle", "zero_fill",
                 "torch_empty_final", "torch_zeros_final"):
        assert steps[step]["median_ms"] >= 0 and len(steps[step]["samples_ms"]) == 2, step
    assert data["config"]["final_bytes"] == 32 * MiB
    assert data["target"]["applies"] is False and data["config"]["isolation"] == "none"
    assert data["machine"]["hostname"] and data["versions"]["torch"]
    md = tmp_path / "r.md"
    assert bench.main(["--device", "cpu", "--final-gib", "0.015625", "--warmup-gib", "0.0078125",
                       "--repeats", "1", "--out", str(md)]) == 0
    assert "| commit_final |" in md.read_text()


# ---------------------------------------------------------------------------------------------
# GPU tests (real driver, real memory). Run on the GPU machine with:
#   python -m pytest tests/test_vmm_gpu_backends.py -m gpu -v
# ---------------------------------------------------------------------------------------------
def _view(ptr: int, nbytes: int) -> Any:
    """A uint8 tensor over raw device bytes (kvconnect's one ``__cuda_array_interface__``
    holder; it reads nothing)."""
    import torch

    from kvconnect._pointer_view import bytes_tensor

    return bytes_tensor(ptr, nbytes, torch.device("cuda:0"), None)


@pytest.fixture
def cuda_driver() -> CudaVmmDriver:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    probe = probe_cuda(0)
    if probe.driver is None:
        pytest.skip(probe.reason)
    assert isinstance(probe.driver, CudaVmmDriver)
    return probe.driver


@pytest.mark.gpu
def test_gpu_probe_and_capabilities(cuda_driver: CudaVmmDriver) -> None:
    caps = cuda_driver.capabilities()
    assert caps.vmm
    assert cuda_driver.granularity() > 0
    assert cuda_driver.granularity() % (64 * 1024) == 0
    assert cuda_driver.driver_version() >= 11000
    bad = probe_cuda(999)
    assert bad.driver is None and "does not exist" in bad.reason


@pytest.mark.gpu
def test_gpu_round_trip(cuda_driver: CudaVmmDriver) -> None:
    import torch

    drv = cuda_driver
    g = drv.granularity()
    size = max(g, 64 * MiB) // g * g
    va = drv.reserve(4 * size)
    mapped: list[tuple[int, int]] = []
    handles: list[Any] = []

    def unmap_all() -> None:
        drv.synchronize()
        while mapped:
            drv.unmap(*mapped.pop())

    try:
        assert va % g == 0
        h = drv.create(2 * size)
        handles.append(h)
        drv.map(va, 2 * size, h)
        mapped.append((va, 2 * size))
        drv.set_access(va, 2 * size)
        drv.memset(va, 0xAB, 2 * size)
        v = _view(va, 2 * size)
        assert int((v == 0xAB).sum()) == 2 * size
        v[:size] = 7
        torch.cuda.synchronize()
        drv.memset(va + size, 0x11, size)
        assert int(v[:size].eq(7).sum()) == size and int(v[size:].eq(0x11).sum()) == size
        # cuMemMap's offset "currently must be zero": refused before the driver sees it
        with pytest.raises(ValueError, match="cuMemMap requires offset 0"):
            drv.map(va + 2 * size, size, h, offset=size)
        # the whole allocation mapped at a second address aliases the same bytes
        drv.map(va + 2 * size, 2 * size, h)
        mapped.append((va + 2 * size, 2 * size))
        drv.set_access(va + 2 * size, 2 * size)
        alias = _view(va + 2 * size, 2 * size)
        assert int(alias[:size].eq(7).sum()) == size
        alias[size:].fill_(0x22)
        torch.cuda.synchronize()
        assert int(v[size:].eq(0x22).sum()) == size
        del v, alias
        drv.synchronize()
        free_mapped, _ = drv.mem_get_info()
        unmap_all()
        drv.release(handles.pop())
        free_after, _ = drv.mem_get_info()
        assert free_after - free_mapped >= size, "released VRAM did not come back"
        # recommit at the same address works after release
        h2 = drv.create(size)
        handles.append(h2)
        drv.map(va, size, h2)
        mapped.append((va, size))
        drv.set_access(va, size)
        drv.memset(va, 0, size)
        assert int(_view(va, size).sum()) == 0
    finally:
        unmap_all()
        for h in handles:
            drv.release(h)
        drv.free_reserved(va, 4 * size)


@pytest.mark.gpu
def test_gpu_errors_are_named(cuda_driver: CudaVmmDriver) -> None:
    g = cuda_driver.granularity()
    va = cuda_driver.reserve(2 * g)
    try:
        with pytest.raises(VmmError, match="CUDA_ERROR_") as err:
            cuda_driver.set_access(va, g)  # nothing mapped there
        assert err.value.call == "cuMemSetAccess"
    finally:
        cuda_driver.free_reserved(va, 2 * g)


@pytest.mark.gpu
def test_gpu_granted_flags_follow_attributes(cuda_driver: CudaVmmDriver) -> None:
    drv = cuda_driver
    caps = drv.capabilities()
    g = drv.granularity(AllocationOptions(shareable=True, rdma_capable=True))
    handles = []
    try:
        plain = drv.create(g)
        handles.append(plain)
        assert plain.granted == GrantedFlags(False, False)
        both = drv.create(g, options=AllocationOptions(shareable=True, rdma_capable=True))
        handles.append(both)
        assert both.granted.shareable == caps.posix_fd_handles
        assert both.granted.rdma_capable == caps.gpudirect_rdma_with_vmm
        # the driver itself confirms the handle type and the RDMA flag
        prop = api.CUmemAllocationProp()
        drv.lib.call("mem_get_allocation_properties_from_handle", ctypes.byref(prop),
                     both.handle)
        assert bool(prop.requestedHandleTypes & 1) == both.granted.shareable
        assert bool(prop.allocFlags.gpuDirectRDMACapable) == both.granted.rdma_capable
    finally:
        for h in handles:
            drv.release(h)


@pytest.mark.gpu
def test_gpu_rdma_fallback_warns_once(cuda_driver: CudaVmmDriver,
                                      caplog: pytest.LogCaptureFixture) -> None:
    drv = CudaVmmDriver(0)  # own instance: its warning budget is fresh
    drv._caps[0] = replace(drv.capabilities(), gpudirect_rdma_with_vmm=False)
    g = drv.granularity()
    with caplog.at_level(logging.WARNING, logger="kvconnect.vmm.cuda"):
        a = drv.create(g, options=AllocationOptions(rdma_capable=True))
        b = drv.create(g, options=AllocationOptions(rdma_capable=True))
    try:
        assert not a.granted.rdma_capable and not b.granted.rdma_capable
        assert len(caplog.records) == 1
    finally:
        drv.release(a)
        drv.release(b)


_CHILD = r"""
import json, os, socket, sys
import torch
from kvconnect._pointer_view import bytes_tensor
from kvconnect.vmm.cuda import CudaVmmDriver

sock = socket.socket(fileno=int(sys.argv[1]))
msg, fds, _, _ = socket.recv_fds(sock, 4096, 1)
size = json.loads(msg)["size"]
drv = CudaVmmDriver(0)
h = drv.import_fd(fds[0], size)
os.close(fds[0])
va = drv.reserve(size)
drv.map(va, size, h)
drv.set_access(va, size)
t = bytes_tensor(va, size, torch.device("cuda:0"), None)
want = (torch.arange(size, device="cuda:0") % 251).to(torch.uint8)
ok = bool(torch.equal(t, want))
t[size // 2:] = 0x5A
torch.cuda.synchronize()
del t
drv.synchronize()
drv.unmap(va, size)
drv.release(h)
drv.free_reserved(va, size)
sock.sendall(json.dumps({"ok": ok, "imported": [h.imported, h.granted.shareable]}).encode())
"""


@pytest.mark.gpu
def test_gpu_posix_fd_export_import_in_another_process(cuda_driver: CudaVmmDriver) -> None:
    import torch

    drv = cuda_driver
    if not drv.capabilities().posix_fd_handles:
        pytest.skip("device cannot export POSIX file descriptors")
    size = drv.granularity(AllocationOptions(shareable=True)) * 4
    va = drv.reserve(size)
    h = drv.create(size, options=AllocationOptions(shareable=True))
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = -1
    proc = None
    try:
        drv.map(va, size, h)
        drv.set_access(va, size)
        v = _view(va, size)
        v.copy_((torch.arange(size, device="cuda:0") % 251).to(torch.uint8))
        torch.cuda.synchronize()
        fd = drv.export_fd(h)
        assert fd >= 0 and os.fstat(fd)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(child.fileno())],
                                pass_fds=(child.fileno(),), env=env)
        child.close()
        socket.send_fds(parent, [json.dumps({"size": size}).encode()], [fd])
        os.close(fd)
        fd = -1
        parent.settimeout(180)
        reply = json.loads(parent.recv(4096).decode())
        assert proc.wait(timeout=60) == 0
        assert reply == {"ok": True, "imported": [True, True]}
        # the child's writes are visible here
        assert int(v[size // 2:].eq(0x5A).sum()) == size - size // 2
        head = (torch.arange(size // 2, device="cuda:0") % 251).to(torch.uint8)
        assert torch.equal(v[: size // 2], head)
        del v
    finally:
        if fd >= 0:
            os.close(fd)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        parent.close()
        child.close()
        drv.synchronize()
        try:
            drv.unmap(va, size)
        except VmmError:
            pass
        drv.release(h)
        drv.free_reserved(va, size)


@pytest.mark.gpu
def test_gpu_fresh_thread_gets_a_context(cuda_driver: CudaVmmDriver) -> None:
    """A thread that never touched CUDA can reserve, commit and memset."""
    errors: list[BaseException] = []
    seen: dict[str, int] = {}

    def work() -> None:
        try:
            drv = CudaVmmDriver(0)
            cur = api.CUcontext()
            drv.lib.call("ctx_get_current", ctypes.byref(cur))
            seen["before"] = int(cur.value or 0)
            g = drv.granularity()
            va = drv.reserve(g)
            h = drv.create(g)
            drv.map(va, g, h)
            drv.set_access(va, g)
            drv.memset(va, 3, g)
            drv.synchronize()
            drv.unmap(va, g)
            drv.release(h)
            drv.free_reserved(va, g)
            drv.lib.call("ctx_get_current", ctypes.byref(cur))
            seen["after"] = int(cur.value or 0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=120)
    assert not errors, errors
    assert seen["before"] == 0 and seen["after"] != 0


@pytest.mark.gpu
def test_gpu_commit_latency_sanity(cuda_driver: CudaVmmDriver) -> None:
    """Commit of 1 GiB (create+map+access) takes milliseconds, not seconds."""
    drv = cuda_driver
    size = 1024 * MiB
    va = drv.reserve(size)
    try:
        t0 = time.perf_counter()
        h = drv.create(size)
        drv.map(va, size, h)
        drv.set_access(va, size)
        elapsed = time.perf_counter() - t0
        drv.unmap(va, size)
        drv.release(h)
    finally:
        drv.free_reserved(va, size)
    assert elapsed < 1.0, f"1 GiB commit took {elapsed * 1e3:.1f} ms"


def test_one_driver_per_device_and_one_fallback_warning(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Eight ExtensibleTensors on "cuda:0" (a simulated driver without GPUDirect RDMA) probe
    once, build one driver and warn once about the dropped RDMA flag, not once per tensor."""
    import kvconnect.vmm as vmm
    from kvconnect import AllocationOptions as Options
    from kvconnect import ExtensibleTensor

    lib = SimulatedDriverLibraryNoGpu(api.CUDA, gdr=0)
    monkeypatch.setattr(vmm, "_DRIVERS", {})
    monkeypatch.setattr(api, "load_library", lambda backend, path=None: lib)
    with caplog.at_level(logging.WARNING, logger="kvconnect.vmm.cuda"):
        tensors = [ExtensibleTensor(4 * MiB, "cuda:0", options=Options(rdma_capable=True))
                   for _ in range(8)]
        for t in tensors:
            t.commit(2 * MiB)
    try:
        assert len({id(t.driver) for t in tensors}) == 1
        assert sum(1 for name, _ in lib.calls if name == "device_get_count") == 1  # one probe
        assert sum(1 for name, _ in lib.calls if name == "mem_address_reserve") == 1 + 8
        assert len(caplog.records) == 1  # warned once for the device
        assert len(tensors[0].driver.fallback_reasons) == 8  # every fallback still recorded
        assert all(t.granted == GrantedFlags(False, False) for t in tensors)
    finally:
        for t in tensors:
            t.close()


# ---------------------------------------------------------------------------------------------
# The one binding: the copy engine, the kit and the harness call the driver through the table
# (a simulated library stands in for libcuda; no GPU here)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def simulated_libcuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a simulated CUDA library as the process's loaded libcuda; returns a setter
    ``install(**kw) -> library``."""
    import contextlib

    import torch

    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())

    def install(**kw: Any) -> SimulatedDriverLibraryNoGpu:
        lib = SimulatedDriverLibraryNoGpu(api.CUDA, **kw)
        monkeypatch.setitem(api._LOADED, ("cuda", None), lib)
        return lib
    return install


def _batch(n: int = 3) -> tuple[Any, Any, Any]:
    import numpy as np

    return (np.arange(n, dtype=np.uint64) + 0x1000, np.arange(n, dtype=np.uint64) + 0x2000,
            np.full(n, 64, dtype=np.uint64))


def test_memcpy_batch_calls_the_tables_cuda13_entry(simulated_libcuda: Any) -> None:
    from kvconnect.connectors.copy._cuda_memcpy_batch import memcpy_batch

    lib = simulated_libcuda()
    memcpy_batch(*_batch(), stream=0x5, device_index=0)
    [(name, args)] = [c for c in lib.calls if c[0].startswith("memcpy_batch")]
    assert name == "memcpy_batch_async_v2" and len(args) == 8  # CUDA 13 ABI: no failIdx
    assert args[3] == 3 and args[-1] == 0x5
    attrs = deref(args[4])
    assert attrs.srcAccessOrder == api.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    assert attrs.srcLocHint.type == api.CU_MEM_LOCATION_TYPE_INVALID


def test_memcpy_batch_falls_back_to_the_cuda12_abi_and_names_the_failing_copy(
        simulated_libcuda: Any) -> None:
    from kvconnect.connectors.copy._cuda_memcpy_batch import memcpy_batch

    lib = simulated_libcuda(missing=frozenset({"memcpy_batch_async_v2"}), stream_rc=1)
    with pytest.raises(VmmError, match=r"cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE "
                                       r"\(3 copies, at copy 1\)"):
        memcpy_batch(*_batch(), stream=0x5, device_index=0)
    assert [len(a) for n, a in lib.calls if n == "memcpy_batch_async"] == [9]


def test_memcpy_batch_unavailable_without_either_entry(simulated_libcuda: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvconnect.connectors.copy import _cuda_memcpy_batch as batch

    simulated_libcuda(missing=frozenset({"memcpy_batch_async", "memcpy_batch_async_v2"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "no batch memcpy (a CUDA 12.8 or newer driver has)" in \
        str(batch.memcpy_batch_available())
    with pytest.raises(VmmError, match="cuMemcpyBatchAsync failed: symbol not exported"):
        batch.memcpy_batch(*_batch(), stream=0x5, device_index=0)


def test_kit_and_harness_probe_the_driver_through_the_table(
        simulated_libcuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvconnect.harness.conformance.options import gpu_absent_reason
    from kvconnect.harness.environment import cuda_driver_present, cuda_driver_version

    simulated_libcuda(driver_version=12080)
    assert cuda_driver_present() and cuda_driver_version() == "12.8"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert "torch" in str(gpu_absent_reason("cuda:0"))  # past the driver check
