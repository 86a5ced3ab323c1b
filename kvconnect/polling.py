"""poll_until: wait for a condition with exponential back-off, always against a deadline."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["poll_until"]

T = TypeVar("T")


def poll_until(ready: Callable[[], T | None], timeout: float, *,
               on_timeout: Callable[[float], BaseException],
               first_pause: float = 1e-4, max_pause: float = 1e-2,
               factor: float = 2.0) -> T:
    """Call ``ready()`` until it returns something truthy, and return that.

    Sleeps ``first_pause`` seconds after the first miss, multiplying by ``factor`` up to
    ``max_pause``; the last sleep ends at the deadline and ``ready`` is called once more
    there (so a condition met during that sleep is not lost). If it is still falsy, raises
    ``on_timeout(elapsed_seconds)``. ``timeout`` is in seconds, finite and >= 0.
    """
    if not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
    if not (0 < first_pause <= max_pause and factor >= 1):
        raise ValueError(f"bad back-off: first_pause {first_pause}, max_pause {max_pause}, "
                         f"factor {factor}")
    start = time.monotonic()
    deadline = start + timeout
    pause = first_pause
    while True:
        result = ready()
        if result:
            return result
        now = time.monotonic()
        if now >= deadline:
            raise on_timeout(now - start)
        time.sleep(min(pause, deadline - now))
        pause = min(pause * factor, max_pause)
