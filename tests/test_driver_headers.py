"""The ctypes driver table (kvconnect/vmm/_driver_api.py) against the real headers.

Where ``cuda.h`` (``$CUDA_HOME``, ``/usr/local/cuda*``, triton's bundled copy) or
``hip/hip_runtime_api.h`` (``$ROCM_PATH``, ``/opt/rocm``, triton's copy) and a C compiler
exist, a probe program compiled against the header prints ``sizeof``/``offsetof`` of the VMM
structs (fields taken from the ctypes structs themselves), the value of every enum constant
the table uses, and the bytes of an allocation-properties struct filled field by field with
distinct values; each is compared with what ctypes gives. Skips where no header is found
(test_vmm_gpu_backends.py keeps the numbers read from the headers for such machines).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvconnect.vmm import _driver_api as api

#: the fields filled in the allocation-properties image (C statements and ctypes writes)
WIN32_META = 0x1122334455667788
COMPRESSION, USAGE = 0x5A, 0x0102


def _triton_include(backend: str) -> list[str]:
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [str(Path(p) / "backends" / backend / "include")
            for p in spec.submodule_search_locations]


def _find(header: str, env: tuple[str, ...], dirs: list[str], backend: str) -> str | None:
    candidates = [os.path.join(os.environ[e], "include") for e in env if os.environ.get(e)]
    candidates += dirs + _triton_include(backend)
    return next((d for d in candidates if os.path.isfile(os.path.join(d, header))), None)


CC = shutil.which("cc") or shutil.which("gcc")
CUDA_INCLUDE = _find("cuda.h", ("CUDA_HOME", "CUDA_PATH"),
                     ["/usr/local/cuda/include",
                      *sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)], "nvidia")
HIP_INCLUDE = _find("hip/hip_runtime_api.h", ("ROCM_PATH", "HIP_PATH"), ["/opt/rocm/include"],
                    "amd")

#: ctypes struct -> (C type, member path inside it: "" for the type itself)
CUDA_STRUCTS = {api.CUmemLocation: ("CUmemLocation", ""),
                api.CUmemAllocationProp: ("CUmemAllocationProp", ""),
                api.CUmemAllocFlags: ("CUmemAllocationProp", "allocFlags"),
                api.CUmemAccessDesc: ("CUmemAccessDesc", ""),
                api.CUmemcpyAttributes: ("CUmemcpyAttributes", "")}
#: what cuda.h has only from a version on (``CUDA_VERSION``): compared where the header has it
CUDA_SINCE = {"CUmemcpyAttributes": 12080, "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM": 12080,
              "CU_MEM_LOCATION_TYPE_INVALID": 12080}
HIP_STRUCTS = {api.HipMemLocation: ("hipMemLocation", ""),
               api.HipMemAllocationProp: ("hipMemAllocationProp", ""),
               api.HipMemAllocFlags: ("hipMemAllocationProp", "allocFlags"),
               api.HipMemAccessDesc: ("hipMemAccessDesc", "")}
#: kvconnect constant -> its name in hip_runtime_api.h (the CUDA names are cuda.h's own)
HIP_NAMES = {
    "CU_MEM_ALLOCATION_TYPE_PINNED": "hipMemAllocationTypePinned",
    "CU_MEM_LOCATION_TYPE_DEVICE": "hipMemLocationTypeDevice",
    "CU_MEM_HANDLE_TYPE_NONE": "hipMemHandleTypeNone",
    "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR": "hipMemHandleTypePosixFileDescriptor",
    "CU_MEM_ACCESS_FLAGS_PROT_READWRITE": "hipMemAccessFlagsProtReadWrite",
    "CU_MEM_ALLOC_GRANULARITY_MINIMUM": "hipMemAllocationGranularityMinimum",
    "CU_MEM_ALLOC_GRANULARITY_RECOMMENDED": "hipMemAllocationGranularityRecommended",
    "HIP_ERROR_OUT_OF_MEMORY": "hipErrorOutOfMemory",
    "CU_MEMCPY_SRC_ACCESS_ORDER_STREAM": "hipMemcpySrcAccessOrderStream",
    "CU_MEM_LOCATION_TYPE_INVALID": "hipMemLocationTypeInvalid",
    "HIP_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED":
        "hipDeviceAttributeVirtualMemoryManagementSupported",
    # newer HIP only (these two, and the two batch-copy ones above): compared where the
    # header has them
    "HIP_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_HIP_VMM_SUPPORTED":
        "hipDeviceAttributeGPUDirectRDMAWithHipVMMSupported",
    "HIP_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED":
        "hipDeviceAttributeHandleTypeFabricSupported",
}


def _layout_exprs(structs: dict[type[ctypes.Structure], tuple[str, str]]) -> dict[str, str]:
    """C expressions for the size of each struct and the offset and size of each field."""
    out = {}
    for struct, (ctype, member) in structs.items():
        base = f"(({ctype}*)0)->{member}" if member else f"*(({ctype}*)0)"
        origin = f"offsetof({ctype}, {member})" if member else "0"
        out[f"{struct.__name__}"] = f"sizeof({base})"
        for name, *_ in struct._fields_:
            path = f"{member}.{name}" if member else name
            out[f"{struct.__name__}.{name}.offset"] = f"offsetof({ctype}, {path}) - {origin}"
            out[f"{struct.__name__}.{name}.size"] = f"sizeof((({ctype}*)0)->{path})"
    return out


def _ctypes_layout(structs: dict[type[ctypes.Structure], tuple[str, str]]) -> dict[str, int]:
    out = {}
    for struct in structs:
        out[struct.__name__] = ctypes.sizeof(struct)
        for name, *_ in struct._fields_:
            descr = getattr(struct, name)
            out[f"{struct.__name__}.{name}.offset"] = descr.offset
            out[f"{struct.__name__}.{name}.size"] = descr.size
    return out


def _probe(tmp_path: Path, include: str, header: str, defines: list[str], prop_type: str,
           handle_types: str, exprs: dict[str, str]) -> dict:
    """Compile and run a program printing ``exprs`` (as integers) and the bytes of a filled
    ``prop_type``, as JSON."""
    lines = [f'printf("\\"%s\\": %lld, ", "{k}", (long long)({v}));' for k, v in exprs.items()]
    src = f"""
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <{header}>
int main(void) {{
  {prop_type} p;
  memset(&p, 0, sizeof p);
  p.type = {HIP_NAMES['CU_MEM_ALLOCATION_TYPE_PINNED'] if 'hip' in header else
            'CU_MEM_ALLOCATION_TYPE_PINNED'};
  p.requestedHandleTypes = {handle_types};
  p.location.type = {HIP_NAMES['CU_MEM_LOCATION_TYPE_DEVICE'] if 'hip' in header else
                     'CU_MEM_LOCATION_TYPE_DEVICE'};
  p.location.id = 3;
  p.win32HandleMetaData = (void*){WIN32_META:#x}ULL;
  p.allocFlags.compressionType = {COMPRESSION:#x};
  p.allocFlags.gpuDirectRDMACapable = 1;
  p.allocFlags.usage = {USAGE:#x};
  printf("{{");
  {chr(10).join(lines)}
  printf("\\"image\\": [");
  for (size_t i = 0; i < sizeof p; i++) printf("%s%u", i ? "," : "", ((unsigned char*)&p)[i]);
  printf("]}}\\n");
  return 0;
}}
"""
    (tmp_path / "probe.c").write_text(src)
    exe = tmp_path / "probe"
    build = subprocess.run([CC, *defines, f"-I{include}", str(tmp_path / "probe.c"), "-o",
                            str(exe)], capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(run.stdout)


def _ctypes_image(struct: type[ctypes.Structure], handle_types: int) -> list[int]:
    p = struct()
    p.type = api.CU_MEM_ALLOCATION_TYPE_PINNED
    p.requestedHandleTypes = handle_types
    p.location.type = api.CU_MEM_LOCATION_TYPE_DEVICE
    p.location.id = 3
    p.win32HandleMetaData = WIN32_META
    p.allocFlags.compressionType = COMPRESSION
    p.allocFlags.gpuDirectRDMACapable = 1
    p.allocFlags.usage = USAGE
    return list(bytes(p))


def _cuda_version(include: str) -> int:
    """``CUDA_VERSION`` of ``include/cuda.h``."""
    text = Path(include, "cuda.h").read_text(errors="replace")
    found = re.search(r"^#define CUDA_VERSION (\d+)", text, re.MULTILINE)
    assert found, "cuda.h defines no CUDA_VERSION"
    return int(found.group(1))


@pytest.mark.skipif(CC is None or CUDA_INCLUDE is None, reason="no cuda.h or C compiler here")
def test_cuda_table_matches_cuda_h(tmp_path: Path) -> None:
    assert CUDA_INCLUDE is not None
    version = _cuda_version(CUDA_INCLUDE)
    constants = {n: getattr(api, n) for n in dir(api)
                 if n.startswith(("CU_", "CUDA_")) and type(getattr(api, n)) is int
                 and CUDA_SINCE.get(n, 0) <= version}
    assert len(constants) >= 15
    structs = {k: v for k, v in CUDA_STRUCTS.items()
               if CUDA_SINCE.get(k.__name__, 0) <= version}
    exprs = {**_layout_exprs(structs), **{f"const.{n}": n for n in constants}}
    got = _probe(tmp_path, CUDA_INCLUDE, "cuda.h", [], "CUmemAllocationProp",
                 "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | CU_MEM_HANDLE_TYPE_FABRIC", exprs)
    image = got.pop("image")
    assert {k: v for k, v in got.items() if not k.startswith("const.")} == \
        _ctypes_layout(structs)
    assert {k[len("const."):]: v for k, v in got.items() if k.startswith("const.")} == constants
    # every field lands where the driver reads it
    assert _ctypes_image(api.CUmemAllocationProp, api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                         | api.CU_MEM_HANDLE_TYPE_FABRIC) == image


@pytest.mark.skipif(CC is None or HIP_INCLUDE is None,
                    reason="no hip/hip_runtime_api.h or C compiler here")
def test_hip_table_matches_hip_runtime_api_h(tmp_path: Path) -> None:
    assert HIP_INCLUDE is not None
    text = "".join(Path(p).read_text(errors="replace")
                   for p in glob.glob(os.path.join(HIP_INCLUDE, "hip", "*.h")))
    names = {k: v for k, v in HIP_NAMES.items() if v in text}
    assert len(names) >= len(HIP_NAMES) - 4  # only the newer names may be missing
    exprs = {**_layout_exprs(HIP_STRUCTS), **{f"const.{k}": v for k, v in names.items()}}
    got = _probe(tmp_path, HIP_INCLUDE, "hip/hip_runtime_api.h", ["-D__HIP_PLATFORM_AMD__"],
                 "hipMemAllocationProp", HIP_NAMES["CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"],
                 exprs)
    image = got.pop("image")
    assert {k: v for k, v in got.items() if not k.startswith("const.")} == \
        _ctypes_layout(HIP_STRUCTS)
    assert {k[len("const."):]: v for k, v in got.items() if k.startswith("const.")} == \
        {k: getattr(api, k) for k in names}
    assert _ctypes_image(api.HipMemAllocationProp,
                         api.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == image
