"""Elastic KV capacity from the front end: grow or shrink a running engine's KV cache.

With the plugin on (``KVCONNECT_EXTENSIBLE_KV=1``), an engine's KV cache is a reservation
whose committed prefix can change while it serves::

    from kvconnect.vllm import resize_kv_cache
    llm = LLM(...)                               # or llm.llm_engine (LLMEngine)
    resize_kv_cache(llm, 4 * n)                  # grow: returns once every worker committed
                                                 # the blocks and the scheduler hands them out
    resize_kv_cache(llm, n, timeout=30.0)        # shrink: waits until the tail is free
    op = resize_kv_cache(llm, n, wait=False)     # ... or not (drive the engine meanwhile)
    kv_cache_resize_status(llm, op["op"])        # pending / done / refused

It reaches the engine core (where the scheduler lives): directly in an in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), through the engine-core client's ``call_utility``
otherwise (vLLM's default; only the method name and numbers cross the process boundary,
answers are JSON objects). An ``AsyncLLM`` (``vllm serve``) reaches the same methods with
``await engine.engine_core.call_utility_async("kvconnect_resize_kv_cache", n, timeout)``.
:mod:`kvconnect.vllm.elastic_core` says what the engine core does, and
:mod:`kvconnect.vllm.elastic_worker` what each worker does. Units: blocks are vLLM's
logical blocks; seconds.
"""

from __future__ import annotations

import time
from typing import Any

from kvconnect.errors import KvconnectError

__all__ = ["KVCacheResizeError", "elastic_facts", "kv_cache_resize_status", "resize_kv_cache"]

#: polling period of a waiting resize (seconds)
_POLL_S = 0.01
#: how long past its own timeout a waiting front end trusts the engine core to answer
_GRACE_S = 60.0


class KVCacheResizeError(KvconnectError, RuntimeError):
    """A resize was refused or failed. ``code``: ``beyond_capacity`` (past the
    reservation), ``beyond_device`` (the device cannot commit it), ``released`` (the cache
    is asleep), ``pending`` (another shrink is pending), ``busy_timeout`` (the tail stayed
    in use: cancelled, the size is unchanged), ``too_small`` (below one ``max_model_len``
    request), ``connector`` (the KV connector cannot follow), ``unsupported``, ``failed``.
    ``result``: the engine core's answer (JSON)."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(str(result.get("message") or result))
        self.code = str(result.get("code") or "failed")
        self.result = result


def _engine_core(llm: Any) -> tuple[Any, bool]:
    """(the engine core object or its client, whether it is the object itself)."""
    engine = getattr(llm, "llm_engine", llm)
    client = getattr(engine, "engine_core", None)
    if client is None:
        raise TypeError(f"{type(llm).__name__} is neither vLLM's LLM nor LLMEngine (it has no "
                        f"engine_core); for an AsyncLLM use engine_core.call_utility_async")
    inproc = getattr(client, "engine_core", None)
    if inproc is not None and hasattr(inproc, "scheduler"):
        return inproc, True
    return client, False


def _call(llm: Any, method: str, *args: Any) -> Any:
    core, direct = _engine_core(llm)
    if direct:
        return getattr(core, method)(*args)
    return core.call_utility(method, *args)


def resize_kv_cache(llm: Any, num_blocks: int, *, timeout: float = 30.0,
                    wait: bool = True) -> dict[str, Any]:
    """Resize the KV cache of ``llm`` (vLLM's ``LLM`` or ``LLMEngine``, plugin on) to
    ``num_blocks`` blocks per worker, at the same addresses.

    Grow: every worker commits the new blocks (one more physical allocation per segment;
    connectors register them), then the scheduler hands them out; requests in flight keep
    running. Shrink: the blocks at or past ``num_blocks`` stop being handed out at once
    (free cached ones are evicted), and once none is in use the workers release their
    memory (addresses stay reserved); a tail still busy after ``timeout`` seconds cancels
    it, the size unchanged. With ``wait=False`` a pending shrink returns at once
    (``state == "pending"``); follow it with :func:`kv_cache_resize_status`. In an
    in-process engine nothing steps while this waits: use ``wait=False`` and keep stepping
    when the tail is busy.

    Returns the engine core's answer (``op``, ``state``, ``from``, ``to``, ``seconds``,
    ``version``, ...); raises :class:`KVCacheResizeError` (nothing changed) when refused.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
    result = dict(_call(llm, "kvconnect_resize_kv_cache", int(num_blocks), float(timeout)))
    deadline = time.monotonic() + float(timeout) + _GRACE_S
    while wait and result.get("state") == "pending":
        if time.monotonic() > deadline:
            raise KVCacheResizeError({**result, "code": "failed", "message": (
                f"the engine core did not finish resize {result.get('op')} in time")})
        time.sleep(_POLL_S)
        result = dict(_call(llm, "kvconnect_resize_status", int(result["op"])))
    if not result.get("ok"):
        raise KVCacheResizeError(result)
    return result


def kv_cache_resize_status(llm: Any, op: int) -> dict[str, Any]:
    """The engine core's answer for resize ``op`` (advancing a pending shrink first): a
    ``state`` of ``pending``, ``done`` or ``refused`` (with ``code`` and ``message``)."""
    return dict(_call(llm, "kvconnect_resize_status", int(op)))


def elastic_facts(llm: Any) -> dict[str, Any]:
    """The engine core's elastic facts: KV version, block count, pending shrink, the
    policy's settings (in blocks) and how often it grew / shrank."""
    return dict(_call(llm, "kvconnect_elastic_facts"))
