"""vLLM's scheduler-side block pool, grown and shrunk in place (needs vLLM 0.32 / 0.33).

vLLM's scheduler hands out KV blocks from one :class:`~vllm.v1.core.block_pool.BlockPool`:
``blocks`` (one ``KVCacheBlock`` per block id), a doubly linked free queue (eviction
order: the head is handed out first) and a prefix-cache map from block hashes to blocks.
:class:`ElasticBlockPool` changes how many blocks it holds while requests run:

- **grow**: new ``KVCacheBlock`` objects for ids ``[old, new)`` go at the *tail* of the free
  queue (the blocks already there are handed out first, so a later shrink finds the tail
  free sooner); nothing else moves.
- **shrink** is two-phase. :meth:`begin_shrink` withdraws the free blocks at or past the new
  size from the free queue (their prefix-cache entries evicted, so no request can hit
  them) and evicts the prefix-cache entries of the busy ones (no new request shares them);
  from then on a tail block freed by its request is withdrawn as it comes back (a wrapper
  on the pool's ``free_blocks`` / ``unpin_blocks``). Nothing in use is touched. Once every
  tail block is withdrawn (:meth:`busy_tail` empty), :meth:`finish_shrink` drops them;
  :meth:`cancel_shrink` puts them back at the tail of the free queue instead.

While a shrink is pending the withdrawn blocks count as used (vLLM's
``reset_prefix_cache`` refuses then, as with requests running). Only a pool shared by every
KV cache group (one ``KVCacheCoordinator.block_pool``) is handled. Units: blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvconnect.errors import KvconnectError

__all__ = ["BlockPoolResizeError", "ElasticBlockPool"]


class BlockPoolResizeError(KvconnectError, RuntimeError):
    """The scheduler's block pool cannot be resized as asked (the message says why)."""


class ElasticBlockPool:
    """Resizes ``scheduler``'s block pool (vLLM's ``Scheduler``: its ``kv_cache_manager``).
    ``min_blocks``: the smallest size a shrink may ask for (a request of ``max_model_len``
    tokens must still fit)."""

    def __init__(self, scheduler: Any) -> None:
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        coordinator = getattr(kvm, "coordinator", None)
        managers = getattr(coordinator, "single_type_managers", ())
        if any(getattr(m, "block_pool", pool) is not pool for m in managers):
            raise BlockPoolResizeError(
                "this model's KV cache groups use several block pools (a hybrid or host-"
                "resident cache); kvconnect resizes one pool shared by every group only")
        self.scheduler = scheduler
        self.manager = kvm
        self.pool = pool
        block_size = int(getattr(scheduler, "block_size", 0) or 0)
        max_len = int(getattr(scheduler, "max_model_len", 0) or
                      scheduler.vllm_config.model_config.max_model_len)
        #: a request of max_model_len tokens (plus the null block) must fit after a shrink
        self.min_blocks = (-(-max_len // block_size) + 1) if block_size else 2
        self._watermark = (kvm.watermark_blocks / pool.num_gpu_blocks
                           if getattr(kvm, "watermark_blocks", 0) else 0.0)
        self.target: int | None = None
        self._withdrawn: dict[int, Any] = {}
        self._originals: dict[str, Any] = {}

    # -- what it is ----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks the pool holds now (block 0 is vLLM's null block)."""
        return int(self.pool.num_gpu_blocks)

    @property
    def shrink_pending(self) -> bool:
        return self.target is not None

    def num_free(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def busy_tail(self) -> list[int]:
        """Ids at or past the pending shrink's size still held by requests."""
        if self.target is None:
            return []
        return [b.block_id for b in self.pool.blocks[self.target:]
                if b.block_id not in self._withdrawn]

    # -- grow ------------------------------------------------------------------------------
    def grow(self, num_blocks: int) -> None:
        """Add blocks ``[num_blocks_now, num_blocks)`` at the tail of the free queue (the
        KV memory behind them must already be committed in every worker)."""
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        if self.target is not None:
            raise BlockPoolResizeError(f"a shrink to {self.target} blocks is pending")
        old = self.num_blocks
        if num_blocks <= old:
            raise BlockPoolResizeError(f"grow({num_blocks}) is not above the {old} blocks "
                                       f"the pool holds")
        pool = self.pool
        new = [KVCacheBlock(i, pool=pool) for i in range(old, num_blocks)]
        pool.blocks.extend(new)
        pool.free_block_queue.append_n(new)
        self._set_size(num_blocks)

    # -- shrink ----------------------------------------------------------------------------
    def begin_shrink(self, num_blocks: int) -> None:
        """Stop handing out blocks ``>= num_blocks``: withdraw the free ones, evict the
        prefix-cache entries of all of them, and withdraw each busy one when it is freed."""
        if self.target is not None:
            raise BlockPoolResizeError(f"a shrink to {self.target} blocks is pending already")
        old = self.num_blocks
        if not self.min_blocks <= num_blocks < old:
            raise BlockPoolResizeError(
                f"cannot shrink the block pool from {old} to {num_blocks} blocks: the size "
                f"must be below {old} and at least {self.min_blocks} (one request of "
                f"max_model_len tokens plus vLLM's null block)")
        self.target = num_blocks
        pool = self.pool
        for name in ("free_blocks", "unpin_blocks"):
            original = getattr(pool, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(pool, name, self._withdrawing(original))
        for block in pool.blocks[num_blocks:]:
            if block.ref_cnt == 0:
                self._withdraw(block)
            else:
                pool._maybe_evict_cached_block(block)  # no new request may share it

    def _withdrawing(self, original: Any) -> Any:
        def call(blocks: Iterable[Any], *args: Any, **kwargs: Any) -> Any:
            blocks = list(blocks)
            result = original(blocks, *args, **kwargs)
            target = self.target
            if target is not None:
                for block in blocks:
                    if block.block_id >= target and block.ref_cnt == 0 \
                            and block.block_id not in self._withdrawn:
                        self._withdraw(block)
            return result
        return call

    def _withdraw(self, block: Any) -> None:
        pool = self.pool
        if block.prev_free_block is not None and block.next_free_block is not None:
            pool.free_block_queue.remove(block)
        pool._maybe_evict_cached_block(block)
        watchers = getattr(pool, "_reuse_watchers", None)
        if watchers:  # a reader of an unpinned block must stop: the block is going
            watcher = watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)
        self._withdrawn[block.block_id] = block

    def finish_shrink(self) -> None:
        """Drop the withdrawn tail (every tail block must be withdrawn: raises otherwise,
        changing nothing)."""
        target = self._pending()
        busy = self.busy_tail()
        if busy:
            raise BlockPoolResizeError(f"{len(busy)} blocks at or past {target} are still in "
                                       f"use (e.g. {busy[:4]})")
        self._restore_methods()
        del self.pool.blocks[target:]
        self._withdrawn.clear()
        self.target = None
        self._set_size(target)

    def cancel_shrink(self) -> None:
        """Put the withdrawn blocks back at the tail of the free queue; the size stays."""
        self._pending()
        self._restore_methods()
        back = [self._withdrawn[i] for i in sorted(self._withdrawn)]
        self._withdrawn.clear()
        self.target = None
        self.pool.free_block_queue.append_n(back)

    # -- internals -------------------------------------------------------------------------
    def _pending(self) -> int:
        if self.target is None:
            raise BlockPoolResizeError("no shrink is pending")
        return self.target

    def _restore_methods(self) -> None:
        for name in list(self._originals):
            self._originals.pop(name)
            if name in vars(self.pool):
                delattr(self.pool, name)

    def _set_size(self, num_blocks: int) -> None:
        """The pool's size and every copy of vLLM's block count the scheduler reads."""
        self.pool.num_gpu_blocks = num_blocks
        kvm = self.manager
        if self._watermark:
            kvm.watermark_blocks = int(self._watermark * num_blocks)
        for cfg in {id(c): c for c in (getattr(kvm, "kv_cache_config", None),
                                       getattr(self.scheduler, "kv_cache_config", None),
                                       getattr(getattr(kvm, "coordinator", None),
                                               "kv_cache_config", None))
                    if c is not None}.values():
            cfg.num_blocks = num_blocks
        cache_config = getattr(self.scheduler, "cache_config", None)
        if cache_config is not None:
            cache_config.num_gpu_blocks = num_blocks
