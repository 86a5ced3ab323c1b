"""The kvconnect vLLM plugin's settings: the opt-in switch, the capacity knob, the version
check and their errors (no vLLM import; shared by :mod:`kvconnect.vllm.plugin` and
:mod:`kvconnect.vllm.engine_cache`). Units: bytes.
"""

from __future__ import annotations

import os

from kvconnect.checks import MAX_BYTES, parse_whole_number
from kvconnect.errors import KvconnectError

__all__ = ["CAPACITY_ENV", "ENTRY_POINT", "SUPPORTED_VLLM_SERIES", "SWITCH_ENV",
           "PluginConfigError", "UnsupportedVllmError", "capacity_bytes_from_env",
           "check_vllm_version", "enabled"]

#: the opt-in switch (off unless "1"/"true"/"yes"/"on")
SWITCH_ENV = "KVCONNECT_EXTENSIBLE_KV"
#: KV reservation per worker in bytes (default: the device's total memory)
CAPACITY_ENV = "KVCONNECT_KV_CAPACITY_BYTES"
#: the entry point's name in the ``vllm.general_plugins`` group (what VLLM_PLUGINS lists)
ENTRY_POINT = "kvconnect_extensible_kv"
#: vLLM release series the plugin knows the allocation point and worker of
SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class UnsupportedVllmError(KvconnectError, RuntimeError):
    """The installed vLLM is not a version the plugin supports (nothing was patched)."""


class PluginConfigError(KvconnectError, ValueError):
    """A kvconnect plugin setting (environment variable) or request vLLM cannot honour."""


def enabled(environ: dict[str, str] | None = None) -> bool:
    """True when ``KVCONNECT_EXTENSIBLE_KV`` opts in; raises PluginConfigError for a value
    that is neither on nor off (a typo must not silently mean "off")."""
    raw = (os.environ if environ is None else environ).get(SWITCH_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise PluginConfigError(f"{SWITCH_ENV}={raw!r}: use 1 to turn kvconnect's extensible KV "
                            f"cache on, 0 (or unset) to leave vLLM's own allocation")


def capacity_bytes_from_env(environ: dict[str, str] | None = None) -> int | None:
    """``KVCONNECT_KV_CAPACITY_BYTES`` as an int from 1 to 2**63-1 (bytes, per worker), or
    None when unset or blank (then the device's total memory is reserved): ASCII digits,
    ``_`` only between digits. Anything else raises :class:`PluginConfigError`."""
    raw = (os.environ if environ is None else environ).get(CAPACITY_ENV, "")
    if not raw.strip(" \t\r\n"):
        return None
    try:
        return parse_whole_number(CAPACITY_ENV, raw, minimum=1, maximum=MAX_BYTES)
    except ValueError as exc:
        raise PluginConfigError(f"{exc} (bytes of KV reservation per worker, e.g. "
                                f"{CAPACITY_ENV}=8589934592 or 8_589_934_592 for 8 GiB)"
                                ) from None


def check_vllm_version(version: str) -> str:
    """The release series (``"0.32"``, ``"0.33"``) of ``version``; raises
    UnsupportedVllmError naming the supported series for any other."""
    parts = str(version).split("+", 1)[0].split(".")
    series = ".".join(parts[:2])
    if series not in SUPPORTED_VLLM_SERIES or len(parts) < 3:
        supported = ", ".join(f"{s}.x" for s in SUPPORTED_VLLM_SERIES)
        raise UnsupportedVllmError(
            f"kvconnect's extensible KV cache plugin supports vLLM {supported}; this is vLLM "
            f"{version}. Nothing was patched. Unset {SWITCH_ENV} (or leave "
            f"{ENTRY_POINT} out of VLLM_PLUGINS) to run vLLM's own KV allocation, or install "
            f"a supported vLLM.")
    return series
