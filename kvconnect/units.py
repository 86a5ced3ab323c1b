"""Units every layer shares: the one throughput rule.

GB/s throughout kvconnect are 1e9 bytes per second (not GiB/s), computed by :func:`gbps`
(transport results, NIXL READs, the harness's reports, the benchmarks).
"""

from __future__ import annotations

__all__ = ["gbps"]


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes per second) of ``nbytes`` moved in ``seconds``.

    Zero (or negative) seconds give 0.0, never infinity: a transfer too fast for the clock
    has no measured rate; 0.0 keeps reports valid JSON and makes a bandwidth floor
    (``--min-gbps``) fail instead of passing on a rate nobody measured.
    """
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
