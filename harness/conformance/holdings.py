"""The tensors a connector keeps over the KV cache, and whether they reach uncommitted memory.

A connector of a kind the kit does not know (any ``KVConnectorBase_V1`` subclass) is checked
by what it registers (NIXL, through :class:`~kvconnect.harness.conformance.probes.NixlRegistrations`)
and by the views it holds after ``register_kv_caches``: :func:`held_tensors` walks its
attributes breadth-first (bounded in depth and objects), and :func:`holdings_check` finds
the ones that address uncommitted bytes of the reservation. A view that addresses exactly
the bytes of one view vLLM handed it is that view (reshaped or reinterpreted): vLLM's own
views span the reservation, so holding them is allowed; one derived from the storage size
(``untyped_storage().nbytes() // num_blocks`` rows, a ``set_`` of the whole storage) is not.
Units: bytes.
"""

from __future__ import annotations

import itertools
import types
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from kvconnect.verdicts import FAIL, PASS, check_entry

__all__ = ["addressed_runs", "held_tensors", "holdings_check", "outside_bytes"]

_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
         types.MethodType, str, bytes, int, float, bool, type(None))
#: more contiguous runs than this: judge the tensor by its span instead
_MAX_RUNS = 200_000


def held_tensors(root: Any, *, max_depth: int = 6, max_objects: int = 50_000
                 ) -> list[tuple[str, torch.Tensor]]:
    """``(attribute path, tensor)`` for every tensor reachable from ``root`` through
    attributes, dicts, lists, tuples and sets, breadth-first, at most ``max_depth`` steps and
    ``max_objects`` objects (each object once)."""
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    queue: deque[tuple[Any, str, int]] = deque([(root, "connector", 0)])
    while queue and len(seen) < max_objects:
        obj, path, depth = queue.popleft()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append((path, obj))
            continue
        if depth >= max_depth:
            continue
        queue.extend((child, name, depth + 1) for name, child in _children(obj, path))
    return out


def _children(obj: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(obj, dict):
        return ((f"{path}[{k!r}]", v) for k, v in list(obj.items()))
    if isinstance(obj, (list, tuple)):
        return ((f"{path}[{i}]", v) for i, v in enumerate(obj))
    if isinstance(obj, (set, frozenset)):
        return ((f"{path}{{}}", v) for v in list(obj))
    try:
        attrs = vars(obj)
    except TypeError:
        return ()
    return ((f"{path}.{k}", v) for k, v in list(attrs.items()))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """``(first byte, byte count)`` of the memory ``t`` can address (non-negative strides)."""
    e = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), (last + 1) * e


def addressed_runs(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """The ``(address, nbytes)`` runs ``t``'s elements occupy (innermost contiguous dims
    merged), or None when there are more than ``_MAX_RUNS``."""
    e = t.element_size()
    dims = [(n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:  # fold contiguous inner dims into one run
        run *= dims.pop()[0]
    outer = 1
    for n, _ in dims:
        outer *= n
    if outer > _MAX_RUNS:
        return None
    base = t.data_ptr()
    return [(base + e * sum(i * s for i, (_, s) in zip(idx, dims, strict=True)), run * e)
            for idx in itertools.product(*(range(n) for n, _ in dims))]


def outside_bytes(extents: list[tuple[int, int]], a: int, n: int) -> int:
    """Bytes of ``[a, a + n)`` outside every committed extent ``(address, nbytes)``."""
    inside = sum(max(0, min(a + n, s + m) - max(a, s)) for s, m in extents)
    return n - inside


def holdings_check(connector: Any, handed: dict[str, torch.Tensor],
                   reservation: tuple[int, int], extents: list[tuple[int, int]]
                   ) -> dict[str, Any]:
    """Which tensors ``connector`` holds over ``reservation`` ``(base, nbytes)`` that
    address bytes outside the committed ``extents`` and are not one of the ``handed``
    views. ``status`` pass / fail; ``views``: how many it holds over the reservation."""
    base, size = reservation
    handed_spans = {_span(v) for v in handed.values() if v.numel()}
    bad: list[dict[str, Any]] = []
    views = 0
    for path, t in held_tensors(connector):
        if not t.numel() or t.device.type != next(iter(handed.values())).device.type:
            continue
        a, n = _span(t)
        if a + n <= base or a >= base + size:
            continue  # not over the KV cache (its own buffers)
        views += 1
        if (a, n) in handed_spans:
            continue
        runs = addressed_runs(t) or [(a, n)]
        outside = sum(outside_bytes(extents, ra, rn) for ra, rn in runs)
        if outside:
            bad.append({"attribute": path[:120], "shape": list(t.shape),
                        "offset_bytes": a - base, "span_bytes": n,
                        "uncommitted_bytes": outside})
    return check_entry(FAIL if bad else PASS, held_views=views,
                       views_reaching_uncommitted=len(bad), examples=bad[:4])
