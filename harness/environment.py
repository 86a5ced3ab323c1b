"""What this machine has: versions, GPUs, RDMA devices, boot id; and device resolution.

Cheap functions (no torch import) come first: the coordinator uses them before it spawns
workers, so a run that cannot work fails fast with exit code 3 and says what is missing.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Any

from kvconnect.errors import KvconnectError
from kvconnect.framing import kernel_boot_id
from kvconnect.vmm._driver_api import CUDA, optional_library

#: test hook: pretend to run on another host. ``"<boot id>"`` for this process, or
#: ``"<worker>=<boot id>"`` for one worker of a local run (e.g. ``decode0=other-host``)
FAKE_BOOT_ID_ENV = "KVCONNECT_FAKE_BOOT_ID_FOR_TEST"

#: NIXL Python packages, tried in order (``nixl`` is the meta package; avoid depending on it)
NIXL_DISTRIBUTIONS = ("nixl-cu13", "nixl-cu12", "nixl")


class EnvironmentProblem(KvconnectError, RuntimeError):
    """The environment cannot run what was asked (exit code 3); the message says what is
    missing."""


def boot_id(worker: str = "") -> str:
    """This kernel's boot id: processes with the same boot id share a host (and memfds)."""
    fake = os.environ.get(FAKE_BOOT_ID_ENV, "")
    who, sep, value = fake.partition("=")
    if fake and not sep:
        return fake
    if sep and who == worker:
        return value
    return kernel_boot_id() or f"unknown-{socket.gethostname()}"


def hostname() -> str:
    return socket.gethostname()


def package_version(*names: str) -> str | None:
    """Installed version of the first distribution in ``names`` that exists, else None."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def torch_version() -> str | None:
    """torch's own version string (with the local tag, e.g. ``2.11.0+cu130``) when torch is
    already imported, else the installed distribution's version (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__version__", None):
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        return str(torch.__version__) + (f" (CUDA {cuda})" if cuda else "")
    return package_version("torch")


def ucx_version() -> str | None:
    """UCX version as the UCX library NIXL bundles (or the system one) reports it."""
    candidates: list[str] = []
    for top in ("nixl_cu13", "nixl_cu12", "nixl"):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for loc in spec.submodule_search_locations:
            parent = os.path.dirname(loc)
            for libdir in (os.path.join(parent, f"{top}.libs"), loc, os.path.join(loc, "lib")):
                if os.path.isdir(libdir):
                    candidates += [os.path.join(libdir, n) for n in sorted(os.listdir(libdir))
                                   if n.startswith("libucp") and ".so" in n]
    candidates.append("libucp.so.0")
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.ucp_get_version_string
            fn.restype = ctypes.c_char_p
            return fn().decode()
        except (OSError, AttributeError):
            continue
    return None


def cuda_driver_version() -> str | None:
    """The CUDA driver version (``cuDriverGetVersion``) or None without a driver."""
    lib = optional_library(CUDA)
    v = ctypes.c_int(0)
    if lib is None or not lib.has("driver_get_version") \
            or lib.try_call("driver_get_version", ctypes.byref(v)) != 0:
        return None
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def cuda_driver_present() -> bool:
    """Cheap pre-check: can libcuda be loaded at all? (torch needs it for CUDA.)"""
    return optional_library(CUDA) is not None


def rdma_devices() -> list[str]:
    """RDMA devices the kernel knows (``/sys/class/infiniband`` entries)."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def gpus() -> list[str]:
    """Names of the CUDA GPUs torch sees (imports torch; empty without CUDA)."""
    if not cuda_driver_present():
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class ResolvedDevice:
    """The backend a run uses: ``kind`` ``host`` or ``cuda``, and how many GPUs to spread on."""

    kind: str
    num_gpus: int = 0
    note: str = ""


def _probe_cuda() -> tuple[int, str]:
    """``(num_gpus with working VMM, reason if 0)``; imports torch only when a driver exists."""
    if not cuda_driver_present():
        return 0, "no CUDA driver (libcuda.so.1 cannot be loaded)"
    import torch

    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)"
    from kvconnect.vmm import probe_vmm

    probe = probe_vmm("cuda:0")
    if probe.driver is None:
        return 0, f"CUDA VMM is unavailable: {probe.reason}"
    return torch.cuda.device_count(), ""


def resolve_device(requested: str) -> ResolvedDevice:
    """``auto`` -> cuda when a GPU with VMM works, else host; ``cuda``/``host`` as asked.

    Raises EnvironmentProblem when the requested backend cannot run here.
    """
    if requested in ("host", "cpu"):
        return _require_host()
    n, reason = _probe_cuda()
    if n:
        return ResolvedDevice("cuda", n)
    if requested == "cuda":
        raise EnvironmentProblem(f"--device cuda was asked for but {reason}")
    _require_host()
    return ResolvedDevice("host", 0, f"--device auto chose host: {reason}")


def _require_host() -> ResolvedDevice:
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        raise EnvironmentProblem("the host backend needs Linux with memfd_create "
                                 f"(this is {sys.platform})")
    return ResolvedDevice("host")


def describe(device: ResolvedDevice | None = None, with_gpus: bool = False) -> dict[str, Any]:
    """The environment record of a report (versions, GPUs, hostname, boot id)."""
    env: dict[str, Any] = {
        "kvconnect": package_version("kvconnect") or "unknown",
        "torch": torch_version(),
        "nixl": package_version(*NIXL_DISTRIBUTIONS),
        "ucx": ucx_version(),
        "cuda_driver": cuda_driver_version(),
        "gpus": gpus() if with_gpus else [],
        "rdma_devices": rdma_devices(),
        "hostname": hostname(),
        "boot_id": boot_id(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    if device is not None:
        env["device"] = device.kind
        if device.note:
            env["device_note"] = device.note
    return env
