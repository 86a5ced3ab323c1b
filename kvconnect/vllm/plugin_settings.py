"""The kvconnect vLLM plugin's settings, every one read here (no vLLM import): the opt-in
switch, the capacity knob and the optional elastic policy's knobs, as one
:class:`PluginSettings` that :func:`settings` reads once per process (``register()`` first,
in every engine process, so a bad value stops the engine before it builds anything); the
version check and the errors. Units: bytes, seconds.

The elastic policy grows when the scheduler would preempt for lack of blocks, up to a cap,
and shrinks after an idle period, down to a floor. It is off unless a variable below is set.
Every size is bytes of KV cache per worker (as ``KVCONNECT_KV_CAPACITY_BYTES``), turned into
blocks by the engine core; ``_`` separators are accepted.

| variable | meaning | default |
| --- | --- | --- |
| ``KVCONNECT_KV_GROW_MAX_BYTES`` | grow instead of preempting, up to this size | off |
| ``KVCONNECT_KV_GROW_STEP_BYTES`` | bytes each such grow adds at least | the start-up size |
| ``KVCONNECT_KV_SHRINK_IDLE_SECONDS`` | shrink after this long without requests | off |
| ``KVCONNECT_KV_SHRINK_FLOOR_BYTES`` | the size an idle shrink goes down to | the start-up size |
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from kvconnect.checks import checked_seconds, parse_whole_number
from kvconnect.errors import KvconnectError

__all__ = ["CAPACITY_ENV", "ENTRY_POINT", "GROW_MAX_ENV", "GROW_STEP_ENV", "SHRINK_FLOOR_ENV",
           "SHRINK_IDLE_ENV", "SUPPORTED_VLLM_SERIES", "SWITCH_ENV", "ElasticPolicy",
           "PluginConfigError", "PluginSettings", "UnsupportedVllmError",
           "capacity_bytes_from_env", "check_vllm_version", "enabled", "settings"]

#: the opt-in switch (off unless "1"/"true"/"yes"/"on")
SWITCH_ENV = "KVCONNECT_EXTENSIBLE_KV"
#: KV reservation per worker in bytes (default: the device's total memory)
CAPACITY_ENV = "KVCONNECT_KV_CAPACITY_BYTES"
GROW_MAX_ENV = "KVCONNECT_KV_GROW_MAX_BYTES"
GROW_STEP_ENV = "KVCONNECT_KV_GROW_STEP_BYTES"
SHRINK_IDLE_ENV = "KVCONNECT_KV_SHRINK_IDLE_SECONDS"
SHRINK_FLOOR_ENV = "KVCONNECT_KV_SHRINK_FLOOR_BYTES"
#: the entry point's name in the ``vllm.general_plugins`` group (what VLLM_PLUGINS lists)
ENTRY_POINT = "kvconnect_extensible_kv"
#: vLLM release series the plugin knows the allocation point and worker of
SUPPORTED_VLLM_SERIES = ("0.32", "0.33")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}
_T = TypeVar("_T")
#: what a refused elastic-policy value's error adds
_POLICY_HINT = "or unset it to turn this part of the elastic policy off"


class UnsupportedVllmError(KvconnectError, RuntimeError):
    """The installed vLLM is not a version the plugin supports (nothing was patched)."""


class PluginConfigError(KvconnectError, ValueError):
    """A kvconnect plugin setting (environment variable) or request vLLM cannot honour."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``KVCONNECT_EXTENSIBLE_KV`` opts in; raises PluginConfigError for a value
    that is neither on nor off (a typo must not silently mean "off")."""
    raw = (os.environ if environ is None else environ).get(SWITCH_ENV, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise PluginConfigError(f"{SWITCH_ENV}={raw!r}: use 1 to turn kvconnect's extensible KV "
                            f"cache on, 0 (or unset) to leave vLLM's own allocation")


def capacity_bytes_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``KVCONNECT_KV_CAPACITY_BYTES`` as an int from 1 to 2**63-1 (bytes, per worker), or
    None when unset or blank (then the device's total memory is reserved): ASCII digits,
    ``_`` only between digits. Anything else raises :class:`PluginConfigError`."""
    return _from_env(os.environ if environ is None else environ, CAPACITY_ENV,
                     parse_whole_number, f"bytes of KV reservation per worker, e.g. "
                     f"{CAPACITY_ENV}=8589934592 or 8_589_934_592 for 8 GiB")


def _from_env(environ: Mapping[str, str], name: str, parse: Callable[[str, str], _T],
              hint: str) -> _T | None:
    """``environ[name]`` read by ``parse(name, text)`` (a :mod:`kvconnect.checks` parser),
    None when unset or blank; a value it refuses raises :class:`PluginConfigError`: the
    parser's words, then ``hint``."""
    raw = environ.get(name, "")
    if not raw.strip(" \t\r\n"):
        return None
    try:
        return parse(name, raw)
    except ValueError as exc:
        raise PluginConfigError(f"{exc} ({hint})") from None


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


@dataclass(frozen=True)
class ElasticPolicy:
    """The elastic policy's knobs (None: that part is off); see the module docstring."""

    grow_max_bytes: int | None = None
    grow_step_bytes: int | None = None
    shrink_idle_seconds: float | None = None
    shrink_floor_bytes: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ElasticPolicy:
        """The knobs from the environment; PluginConfigError names a bad one."""
        env = os.environ if environ is None else environ
        def size(name: str) -> int | None:
            return _from_env(env, name, parse_whole_number, _POLICY_HINT)

        return cls(size(GROW_MAX_ENV), size(GROW_STEP_ENV),
                   _from_env(env, SHRINK_IDLE_ENV, checked_seconds, _POLICY_HINT),
                   size(SHRINK_FLOOR_ENV))

    @property
    def grows(self) -> bool:
        return self.grow_max_bytes is not None

    @property
    def shrinks(self) -> bool:
        return self.shrink_idle_seconds is not None

    @property
    def enabled(self) -> bool:
        return self.grows or self.shrinks

    def to_json(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PluginSettings:
    """What the environment asks of the plugin; with the switch off nothing else is read."""

    enabled: bool = False
    #: KV reservation per worker; None: the device's total memory
    capacity_bytes: int | None = None
    elastic: ElasticPolicy = field(default_factory=ElasticPolicy)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        """Every setting from the environment; PluginConfigError names a bad one."""
        env = os.environ if environ is None else environ
        if not enabled(env):
            return cls()
        return cls(True, capacity_bytes_from_env(env), ElasticPolicy.from_env(env))


@functools.cache
def settings() -> PluginSettings:
    """This process's settings, read from the environment on first use and kept (until
    ``kvconnect.vllm.plugin.uninstall()``): what every plugin module reads."""
    return PluginSettings.from_env()
