"""Current CUDA device and stream without torch's per-call Python bookkeeping.

``torch.cuda.current_stream(device)``, ``torch.cuda.stream(s)`` and ``Event.record()``
without a stream resolve the device through several Python layers (``_get_device_index``,
``is_available``, environment lookups): about 10 microseconds each on the H200 machine, and a
block copy called them a dozen times (benchmarks/results/transfer-h200-graphs.md). These
helpers make the same torch calls those functions end in (``torch._C._cuda_getCurrentStream``
and friends, which torch itself uses), falling back to the public API where a torch build
lacks them. CUDA only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["current_device", "current_stream", "raw_stream", "synchronize", "use_stream"]

_get_stream = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream = getattr(torch._C, "_cuda_setStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_sync = getattr(torch._C, "_cuda_synchronize", None)


def current_device() -> int:
    """The calling thread's current CUDA device index."""
    return int(_get_device()) if _get_device is not None else torch.cuda.current_device()


def current_stream(index: int | None) -> torch.cuda.Stream:
    """Device ``index``'s current stream (None: the current device's), as
    ``torch.cuda.current_stream(index)``."""
    if index is None:
        index = current_device()
    if _get_stream is None:
        return torch.cuda.current_stream(index)
    sid, dev, dtype = _get_stream(index)
    return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=dtype)


def raw_stream(index: int | None) -> int:
    """Device ``index``'s current stream (None: the current device's) as a raw
    ``cudaStream_t`` value."""
    if index is None:
        index = current_device()
    if _get_raw is not None:
        return int(_get_raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def synchronize(index: int | None) -> None:
    """Wait until device ``index`` (None: the current one) has finished all queued work, as
    ``torch.cuda.synchronize``."""
    if index is None:
        index = current_device()
    if _sync is not None and current_device() == index:
        _sync()
    else:
        torch.cuda.synchronize(index)


@contextlib.contextmanager
def use_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make ``stream`` current for the block (as ``torch.cuda.stream(stream)``); the fast
    path applies when ``stream``'s device is already the current device."""
    index = stream.device_index
    if _get_stream is None or _set_stream is None or current_device() != index:
        with torch.cuda.stream(stream):
            yield
        return
    prev = _get_stream(index)
    _set_stream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield
    finally:
        _set_stream(stream_id=prev[0], device_index=prev[1], device_type=prev[2])
