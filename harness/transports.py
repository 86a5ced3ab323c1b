"""The harness's side of transports: same-run reference copies.

The transports themselves live in the library and are chosen by name through its registry
(:mod:`kvconnect.connectors.transport`): ``ipc`` (:mod:`kvconnect.connectors.ipc.transport`:
the export server, cached peer mappings, one block-copy launch per fetch) and ``nixl``
(:mod:`kvconnect.connectors.nixl.transport`). :mod:`.scenario` builds each worker's halves
from a ``TransportContext`` and never compares transport names.

Units: bytes, seconds, GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import time

import torch

from kvconnect.connectors.transport import FetchResult

__all__ = ["FetchResult", "notifies_exporter", "reference_copy_gbps"]

#: transports whose every completed fetch notifies the serving side, and how
_COMPLETION_NOTICES = {"nixl": "a NIXL notification sent with each READ"}


def notifies_exporter(transport: str) -> bool:
    """True when each completed fetch over ``transport`` notifies the serving worker (its
    prefill counts them: :meth:`~.prefill.PrefillWorker.check_notifications`)."""
    return transport in _COMPLETION_NOTICES


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
    return nbytes / times[len(times) // 2] / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
