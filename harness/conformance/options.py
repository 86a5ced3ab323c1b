"""The kit's option checks, shared by the CLI and the pytest plugin (no vLLM, no CUDA init).

Each checker returns the parsed value or raises :class:`kvconnect.errors.OptionError` (a
``ValueError``; the harness's option error too) saying what was wrong and what to give instead;
callers turn it into their usage error (exit 2, pytest's ``UsageError``).
:func:`gpu_absent_reason` is an environment check (exit 3): it loads the CUDA driver library and
counts devices through NVML, never initialising CUDA in a process that will fork cases.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvconnect.checks import check_can_create_file, checked_seconds, parse_whole_number
from kvconnect.errors import OptionError
from kvconnect.layout.formats import VLLM_LAYOUTS
from kvconnect.vmm._driver_api import CUDA, optional_library

__all__ = ["OptionError", "check_output_path", "gpu_absent_reason", "parse_caches",
           "parse_device", "parse_layouts", "parse_positive", "parse_timeout"]

#: the caches engine mode runs a connector over (see :mod:`.engine`)
ENGINE_CACHES = ("extensible", "plain")


def parse_layouts(text: str) -> list[str]:
    """``"LBHNC,BLHNC"`` -> the layouts; every name must be one of vLLM's six."""
    return _parse_names(text, VLLM_LAYOUTS, "layouts")


def parse_caches(text: str) -> list[str]:
    """``"extensible,plain"`` -> the engine-mode caches (each one of :data:`ENGINE_CACHES`)."""
    return _parse_names(text, ENGINE_CACHES, "caches")


def _parse_names(text: str, choices: Sequence[str], what: str) -> list[str]:
    """A comma-separated list of at least one of ``choices``."""
    out = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in out if x not in choices]
    if bad or not out:
        raise OptionError(f"unknown {what} {bad or [text]}; choose from {', '.join(choices)}")
    return out


#: the most blocks or layers an option takes
MAX_COUNT = 1 << 24


def parse_positive(text: object, what: str = "the value") -> int:
    """A whole number from 1 to :data:`MAX_COUNT` (blocks, layers) in ASCII digits
    (:func:`kvconnect.checks.parse_whole_number`)."""
    try:
        return parse_whole_number(what, str(text), minimum=1, maximum=MAX_COUNT)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def parse_timeout(text: object) -> float:
    """Seconds per case: above 0 and at most a day (:data:`kvconnect.checks.MAX_SECONDS`),
    a number or ASCII digits (``nan``, ``inf``, 0, negatives, 1e300 are refused)."""
    try:
        return checked_seconds("timeout (seconds per case)", text)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


def parse_device(text: str) -> str:
    """``cpu`` or ``cuda[:N]`` (see :func:`kvconnect.vllm.runtime.is_cuda_device`)."""
    from kvconnect.vllm.runtime import is_cuda_device

    try:
        cuda = is_cuda_device(text)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if cuda and ":" in text:
        index = text.split(":", 1)[1]
        if not index.isdigit():
            raise OptionError(f"device {text!r}: expected cuda:N with N a GPU index")
    return text


def check_output_path(flag: str, path: str | None) -> None:
    """Fail before any case runs when ``path`` cannot be written as the kit will write it
    (a temporary file beside it, renamed into place)."""
    if path is None:
        return
    if os.path.isdir(path):
        raise OptionError(f"{flag} {path}: is a directory, expected a file path")
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise OptionError(f"{flag} {path}: directory {directory} does not exist")
    try:
        check_can_create_file(directory)
    except OSError as exc:
        raise OptionError(f"{flag} {path}: cannot create a file in {directory}: "
                          f"{exc.strerror or exc}") from None


def gpu_absent_reason(device: str) -> str | None:
    """None when ``device`` (``cuda[:N]``) names a GPU this machine has; else why not. The CUDA
    driver is loaded (the package's one binding of it), devices are counted through NVML (CUDA
    stays uninitialised)."""
    if optional_library(CUDA) is None:
        return f"no GPU: {device} was asked for, but no CUDA driver is installed " \
               "(libcuda.so.1 cannot be loaded)"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    count = torch.cuda.device_count()
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if count == 0:
        return f"no GPU: {device} was asked for, but torch {torch.__version__} sees no " \
               "CUDA device"
    if index >= count:
        return f"no GPU {device}: this machine has {count} CUDA device(s), cuda:0 to " \
               f"cuda:{count - 1}"
    return None
