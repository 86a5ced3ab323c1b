"""Same-run reference copies: what a plain torch copy of the same bytes reaches, beside each
transfer and sweep point (the transports themselves are specs in
:mod:`kvconnect.connectors.registry`). Units: bytes, seconds, GB/s = 1e9 bytes per second.
"""
from __future__ import annotations

import time

import torch

from kvconnect.units import gbps

__all__ = ["reference_copy_gbps"]


def reference_copy_gbps(nbytes: int, src: str, dst: str, repeats: int = 5) -> float:
    """Same-run reference for a transfer of ``nbytes``: median GB/s (1e9 bytes/s) of one
    contiguous torch copy between ordinary allocations on ``src`` and ``dst`` (e.g. a
    cudaMalloc peer copy cuda:0 -> cuda:1). Allocates ``2 * nbytes`` for the duration."""
    if nbytes <= 0:
        raise ValueError(f"reference copy needs a positive byte count, got {nbytes}")
    s_dev, d_dev = torch.device(src), torch.device(dst)
    source = torch.empty(nbytes, dtype=torch.uint8, device=s_dev).fill_(0x5A)
    target = torch.empty(nbytes, dtype=torch.uint8, device=d_dev)
    times = []
    for i in range(repeats + 1):
        _sync(s_dev)
        _sync(d_dev)
        t0 = time.perf_counter()
        target.copy_(source)
        _sync(s_dev)
        _sync(d_dev)
        if i:  # the first copy warms up (allocation, peer mappings)
            times.append(time.perf_counter() - t0)
    times.sort()
    return gbps(nbytes, times[len(times) // 2])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
