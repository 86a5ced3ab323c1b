"""Elastic KV capacity in vLLM's engine core: resize requests, their state, the policy
(needs vLLM 0.32 / 0.33; runs in the engine core process, where the scheduler lives).

The plugin adds two utility methods to vLLM's ``EngineCore`` (reached from the front end
through the engine-core client's ``call_utility``, or directly in an in-process engine;
:func:`kvconnect.vllm.elastic.resize_kv_cache` does either):

- ``kvconnect_resize_kv_cache(num_blocks, timeout)``: **grow** commits the new blocks in
  every worker (``collective_rpc``; a worker failing rolls the others back), then adds them
  to the scheduler's block pool (:class:`~kvconnect.vllm.elastic_pool.ElasticBlockPool`),
  then serves the connectors' refreshed handshake metadata and bumps the engine's KV
  version; **shrink** withdraws the tail of the block pool at once and completes when every
  tail block is free (workers release the memory, the pool drops the blocks): within the
  step it is asked in if the tail is free, else at a later step or poll; past ``timeout``
  seconds it is cancelled (the blocks go back, the size is unchanged, ``busy_timeout``).
- ``kvconnect_resize_status(op)``: the state of resize ``op`` (``pending`` / ``done`` /
  refused with a ``code``), advancing a pending shrink first.

Every answer is a JSON object (``ok``, ``state``, ``op``, ``from``, ``to``, ``code``,
``message``, ...): nothing is pickled, and an error's reason survives the process boundary.
Only one resize runs at a time (``pending`` refuses another). The policy
(:class:`~kvconnect.vllm.plugin_settings.ElasticPolicy`) grows when a running request cannot
get blocks (vLLM would preempt it) and shrinks after an idle period; it is off by default,
and off with asynchronous scheduling (the workers may be mid-step then). Units: blocks are
vLLM's logical blocks; seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from .elastic_pool import BlockPoolResizeError, ElasticBlockPool
from .plugin_settings import ElasticPolicy, settings

logger = logging.getLogger(__name__)
engine_log = logging.getLogger("vllm.kvconnect.elastic")

__all__ = ["CoreElastic", "core_elastic"]

#: finished results kept for kvconnect_resize_status
_KEPT_RESULTS = 64


def core_elastic(core: Any) -> CoreElastic:
    """The engine core's elastic state (made on first use)."""
    state = core.__dict__.get("_kvconnect_elastic")
    if state is None:
        state = core.__dict__["_kvconnect_elastic"] = CoreElastic(core)
    return state


def _error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"ok": False, "state": "refused", "code": code, "message": message, **extra}


class CoreElastic:
    """One engine core's resizes (see the module docstring)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._pool: ElasticBlockPool | None = None
        self.version = 0
        self.next_op = 1
        self.pending: dict[str, Any] | None = None
        self.results: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.policy = ElasticPolicy()
        self.policy_blocks: dict[str, int] = {}
        self.policy_grows = 0
        self.policy_shrinks = 0
        self.last_busy = time.monotonic()
        self._policy_ready = False
        self._timer: threading.Thread | None = None

    @property
    def pool(self) -> ElasticBlockPool:
        if self._pool is None:
            self._pool = ElasticBlockPool(self.core.scheduler)
        return self._pool

    # -- requests --------------------------------------------------------------------------
    def resize(self, num_blocks: int, timeout: float, *, source: str = "api") -> dict[str, Any]:
        """Start (and, when it can, finish) a resize to ``num_blocks`` blocks."""
        op = self.next_op
        self.next_op += 1
        if self.pending is not None:
            return self._keep(op, _error(
                "pending", f"a shrink to {self.pending['to']} blocks (resize "
                           f"{self.pending['op']}) is pending; wait for it (or its timeout) "
                           f"before resizing again. Nothing was changed.", op=op))
        try:
            pool = self.pool
        except BlockPoolResizeError as exc:
            return self._keep(op, _error("unsupported", str(exc), op=op))
        old = pool.num_blocks
        base = {"op": op, "from": old, "to": int(num_blocks), "source": source}
        if num_blocks == old:
            return self._keep(op, {"ok": True, "state": "done", **base, "seconds": 0.0,
                                   "num_blocks": old, "version": self.version})
        if num_blocks > old:
            return self._keep(op, self._grow(int(num_blocks), base))
        try:
            pool.begin_shrink(int(num_blocks))
        except BlockPoolResizeError as exc:
            return self._keep(op, _error("too_small", str(exc), **base))
        now = time.monotonic()
        self.pending = {**base, "started": now, "deadline": now + max(0.0, float(timeout)),
                        "timeout": float(timeout)}
        return self._keep(op, self._advance() or self._pending_state())

    def status(self, op: int) -> dict[str, Any]:
        """The result of resize ``op`` (advancing a pending shrink first)."""
        self._advance()
        result = self.results.get(int(op))
        if result is None:
            return _error("unknown", f"no resize {op} is known here (results are kept for "
                                     f"the last {_KEPT_RESULTS} resizes)", op=op)
        return dict(result)

    def _keep(self, op: int, result: dict[str, Any]) -> dict[str, Any]:
        self.results[op] = result
        while len(self.results) > _KEPT_RESULTS:
            self.results.popitem(last=False)
        return dict(result)

    def _pending_state(self) -> dict[str, Any]:
        p = self.pending
        assert p is not None
        busy = self.pool.busy_tail()
        return {"ok": True, "state": "pending", **{k: p[k] for k in ("op", "from", "to",
                                                                      "source")},
                "busy_blocks": len(busy), "waited_seconds": time.monotonic() - p["started"],
                "version": self.version}

    # -- grow ------------------------------------------------------------------------------
    def _grow(self, num_blocks: int, base: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        old = base["from"]
        failure = self._workers(num_blocks, rollback_to=old)
        if failure is not None:
            return {**failure, **base}
        self.pool.grow(num_blocks)
        return self._changed(base, t0)

    def _workers(self, num_blocks: int, rollback_to: int | None) -> dict[str, Any] | None:
        """Check, then resize, every worker; the first refusal (nothing changed), or, when a
        worker fails part-way, the others put back (``rollback_to``) and the failure."""
        rpc = self.core.model_executor.collective_rpc
        try:
            for answers in (rpc("kvconnect_resize_kv_cache", args=(num_blocks, True)),
                            rpc("kvconnect_resize_kv_cache", args=(num_blocks, False))):
                refused = next((a for a in answers if not a.get("ok")), None)
                if refused is not None:
                    break
        except Exception as exc:
            refused = {"code": getattr(exc, "code", "failed"), "message": str(exc)}
            answers = []
        if refused is None:
            return None
        if rollback_to is not None and any(a.get("ok") and a.get("facts") for a in answers):
            try:  # workers that did resize go back; those that refused are unchanged
                rpc("kvconnect_resize_kv_cache", args=(rollback_to, False))
            except Exception:
                logger.exception("kvconnect: rolling the workers back to %d blocks failed",
                                 rollback_to)
        return _error(str(refused.get("code") or "failed"), str(refused.get("message")))

    def _changed(self, base: dict[str, Any], t0: float) -> dict[str, Any]:
        """After the workers and the pool changed: peers learn it, the result."""
        self.version += 1
        served = self._serve_new_metadata()
        seconds = time.perf_counter() - t0
        engine_log.info("kvconnect elastic KV cache (%s): %d -> %d blocks in %.1f ms, KV "
                        "version %d", base["source"], base["from"], base["to"], seconds * 1e3,
                        self.version)
        return {"ok": True, "state": "done", **base, "seconds": seconds,
                "num_blocks": self.pool.num_blocks, "version": self.version,
                "handshake_entries": served}

    def _serve_new_metadata(self) -> int:
        """Bump the scheduler connector's KV version and serve the workers' refreshed
        handshake payloads (kvconnect's NIXL connector; others have none)."""
        connector = self.core.scheduler.get_kv_connector()
        if connector is None:
            return 0
        setter = getattr(connector, "kvconnect_set_kv_version", None)
        if setter is not None:
            setter(self.version)
        update = getattr(connector, "kvconnect_update_handshake_metadata", None)
        if update is None:
            return 0
        content: dict[tuple[int, int], Any] = {}
        for worker_dict in self.core.model_executor.get_kv_connector_handshake_metadata():
            if worker_dict:
                content.update(worker_dict)
        return int(update(content)) if content else 0

    # -- shrink ----------------------------------------------------------------------------
    def _advance(self) -> dict[str, Any] | None:
        """Finish or time out the pending shrink when it can; its result, or None."""
        p = self.pending
        if p is None:
            return None
        pool = self.pool
        busy = pool.busy_tail()
        if busy:
            if time.monotonic() < p["deadline"]:
                return None
            pool.cancel_shrink()
            self.pending = None
            result = _error(
                "busy_timeout",
                f"the shrink to {p['to']} blocks did not complete within {p['timeout']} s: "
                f"{len(busy)} blocks at or past {p['to']} were still in use (e.g. {busy[:4]}). "
                f"It was cancelled: the cache stays at {p['from']} blocks, everything "
                f"withdrawn is back in use.", **{k: p[k] for k in ("op", "from", "to",
                                                                   "source")},
                busy_blocks=len(busy))
            return self._keep(p["op"], result)
        t0 = time.perf_counter()
        failure = self._workers(p["to"], rollback_to=None)
        base = {k: p[k] for k in ("op", "from", "to", "source")}
        self.pending = None
        if failure is not None:
            pool.cancel_shrink()
            return self._keep(p["op"], {**failure, **base})
        pool.finish_shrink()
        result = self._changed(base, t0)
        result["waited_seconds"] = time.monotonic() - p["started"]
        return self._keep(p["op"], result)

    # -- ticks and the policy --------------------------------------------------------------
    def tick(self) -> None:
        """After every engine step (and on idle wake-ups): advance a pending shrink, run the
        idle part of the policy."""
        if not self._policy_ready:
            self._start_policy()
        if self.pending is not None:
            self._advance()
        if self.core.scheduler.has_requests():
            self.last_busy = time.monotonic()
            return
        if self.policy.shrinks and self.pending is None:
            floor = self.policy_blocks.get("floor", 0)
            idle = time.monotonic() - self.last_busy
            if floor and idle >= float(self.policy.shrink_idle_seconds or 0) \
                    and self.pool.num_blocks > floor:
                result = self.resize(floor, 30.0, source="policy:idle")
                if result.get("ok"):
                    self.policy_shrinks += 1

    def _start_policy(self) -> None:
        self._policy_ready = True
        try:
            policy = settings().elastic
        except Exception:
            logger.exception("kvconnect: the elastic KV policy settings are invalid; the "
                             "policy stays off")
            return
        if not policy.enabled:
            return
        if getattr(self.core, "async_scheduling", False):
            logger.warning("kvconnect: the elastic KV policy is off with asynchronous "
                           "scheduling (a worker may be mid-step when the scheduler grows)")
            return
        try:
            facts = self.core.model_executor.collective_rpc("kvconnect_kv_cache_facts")[0]
            per_block = int(facts["bytes_per_block"])
            start = self.pool.num_blocks
        except Exception:
            logger.exception("kvconnect: the elastic KV policy needs the plugin's KV cache; "
                             "it stays off")
            return
        self.policy = policy
        self.policy_blocks = {
            "start": start, "per_block_bytes": per_block,
            "cap": min(int(facts["capacity_blocks"]),
                       (policy.grow_max_bytes or 0) // per_block),
            "step": max(1, (policy.grow_step_bytes or start * per_block) // per_block),
            "floor": max(self.pool.min_blocks,
                         (policy.shrink_floor_bytes or start * per_block) // per_block)}
        if policy.grows:
            self._wrap_allocate_slots()
        if policy.shrinks and hasattr(self.core, "input_queue"):
            self._start_idle_timer()
        engine_log.info("kvconnect elastic KV policy on: %s (blocks: %s)", policy.to_json(),
                        self.policy_blocks)

    def _wrap_allocate_slots(self) -> None:
        from vllm.v1.request import RequestStatus

        kvm = self.core.scheduler.kv_cache_manager
        original = kvm.allocate_slots

        def allocate_slots(request: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = original(request, *args, **kwargs)
            if blocks is not None or request.status != RequestStatus.RUNNING:
                return blocks
            if not self._policy_grow():
                return blocks
            return original(request, *args, **kwargs)

        kvm.allocate_slots = allocate_slots

    def _policy_grow(self) -> bool:
        """Grow by the policy's step (up to its cap) instead of a preemption."""
        if self.pending is not None:
            return False
        now = self.pool.num_blocks
        target = min(self.policy_blocks["cap"], now + self.policy_blocks["step"])
        if target <= now:
            return False
        result = self.resize(target, 0.0, source="policy:preempt")
        if result.get("ok"):
            self.policy_grows += 1
            return True
        logger.warning("kvconnect elastic KV policy could not grow to %d blocks: %s", target,
                       result.get("message"))
        return False

    def _start_idle_timer(self) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        period = max(0.05, float(self.policy.shrink_idle_seconds or 1.0) / 4)
        core = self.core

        def wake() -> None:  # an idle busy loop blocks on its input queue: wake it to tick
            while getattr(core, "shutdown_state", None) is None or str(
                    getattr(core.shutdown_state, "name", "RUNNING")) == "RUNNING":
                time.sleep(period)
                if self.pool.num_blocks > self.policy_blocks.get("floor", 0):
                    core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

        self._timer = threading.Thread(target=wake, name="kvc-elastic-idle", daemon=True)
        self._timer.start()

    def facts(self) -> dict[str, Any]:
        """JSON-able: KV version, the pool's size and use (``max_block_in_use``: the highest
        block id a request holds now, -1 for none), the pending shrink, the policy."""
        pool = self.pool
        used = [b.block_id for b in pool.pool.blocks[1:] if b.ref_cnt > 0]
        return {"version": self.version, "num_blocks": pool.num_blocks,
                "free_blocks": pool.num_free(), "used_blocks": len(used),
                "max_block_in_use": max(used, default=-1),
                "pending": dict(self.pending) if self.pending else None,
                "policy": self.policy.to_json(), "policy_blocks": dict(self.policy_blocks),
                "policy_grows": self.policy_grows, "policy_shrinks": self.policy_shrinks}
