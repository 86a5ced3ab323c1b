"""The optional elastic KV policy's settings (no vLLM import): grow when the scheduler would
preempt for lack of blocks, up to a cap; shrink after an idle period, down to a floor.
Off unless a variable below is set. Every size is bytes of KV cache per worker (as
``KVCONNECT_KV_CAPACITY_BYTES``), turned into blocks by the engine core; ``_`` separators
are accepted. Units: bytes, seconds.

| variable | meaning | default |
| --- | --- | --- |
| ``KVCONNECT_KV_GROW_MAX_BYTES`` | grow instead of preempting, up to this size | off |
| ``KVCONNECT_KV_GROW_STEP_BYTES`` | bytes each such grow adds at least | the start-up size |
| ``KVCONNECT_KV_SHRINK_IDLE_SECONDS`` | shrink after this long without requests | off |
| ``KVCONNECT_KV_SHRINK_FLOOR_BYTES`` | the size an idle shrink goes down to | the start-up size |
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .plugin_settings import PluginConfigError

__all__ = ["GROW_MAX_ENV", "GROW_STEP_ENV", "SHRINK_FLOOR_ENV", "SHRINK_IDLE_ENV",
           "ElasticPolicy"]

GROW_MAX_ENV = "KVCONNECT_KV_GROW_MAX_BYTES"
GROW_STEP_ENV = "KVCONNECT_KV_GROW_STEP_BYTES"
SHRINK_IDLE_ENV = "KVCONNECT_KV_SHRINK_IDLE_SECONDS"
SHRINK_FLOOR_ENV = "KVCONNECT_KV_SHRINK_FLOOR_BYTES"


def _bytes(environ: dict[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw.replace("_", ""))
    except ValueError:
        raise PluginConfigError(f"{name}={raw!r} is not a whole number of bytes (e.g. "
                                f"{name}=8589934592 for 8 GiB)") from None
    if value <= 0:
        raise PluginConfigError(f"{name}={value}: give a positive number of bytes, or unset "
                                f"it to turn this part of the policy off")
    return value


def _seconds(environ: dict[str, str], name: str) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise PluginConfigError(f"{name}={raw!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise PluginConfigError(f"{name}={raw}: give a positive number of seconds, or unset "
                                f"it to turn idle shrinking off")
    return value


@dataclass(frozen=True)
class ElasticPolicy:
    """The policy's knobs (None: that part is off); see the module docstring."""

    grow_max_bytes: int | None = None
    grow_step_bytes: int | None = None
    shrink_idle_seconds: float | None = None
    shrink_floor_bytes: int | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ElasticPolicy:
        """The settings from the environment; PluginConfigError names a bad one."""
        env = dict(os.environ if environ is None else environ)
        return cls(_bytes(env, GROW_MAX_ENV), _bytes(env, GROW_STEP_ENV),
                   _seconds(env, SHRINK_IDLE_ENV), _bytes(env, SHRINK_FLOOR_ENV))

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
        return {"grow_max_bytes": self.grow_max_bytes, "grow_step_bytes": self.grow_step_bytes,
                "shrink_idle_seconds": self.shrink_idle_seconds,
                "shrink_floor_bytes": self.shrink_floor_bytes}
