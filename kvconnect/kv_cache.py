"""ExtensibleKVCache: a :class:`~kvconnect.layout.KVCacheConfig` backed by ExtensibleTensors.

One :class:`~kvconnect.tensor.ExtensibleTensor` per KV cache tensor of the config (one for
the packed layout), with the segment count its physical layout needs (K/V split: 2, each a
block prefix; block-major, MLA, Mamba, packed: 1). The commit protocol::

    cache = ExtensibleKVCache(cfg, "cuda:0", options=AllocationOptions(shareable=True))
    cache.allocate()                    # reserve capacity, commit 1 block per segment
    graphs = capture(cache.kv_caches()) # pointer-stable views over the whole reservation
    cache.ensure_kv_cache_blocks(n)     # the prefix warm-up touches
    cache.extend_kv_cache(final)        # the final size; one physical allocation per segment
    regions = cache.committed_regions() # register these (and only these) with a connector
    cache.release_physical(); cache.recommit()   # sleep / wake: zeroed, same addresses
    cache.resize(4 * final)             # elastic: grow (one more allocation per segment) or
                                        # shrink (whole allocations past the new size go)
    cache.close()                       # refused while views are referenced: close(force=True)

Units: blocks are logical blocks of the config; bytes unless a name says blocks.
"""

from __future__ import annotations

import logging
import math

import torch

from .checks import checked_int, round_up
from .errors import KvconnectError
from .layout import KVCacheConfig, LayoutPlan, build_kv_caches, plan_layout
from .lifetime import Closeable, LiveViewsError
from .tensor import ExtensibleTensor
from .undo import UndoStack
from .views import CommittedRegion, committed_regions, narrow_kv_caches_to_num_blocks
from .vmm import AllocationOptions, DeviceSpec, VmmDriver, parse_device

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_CAPACITY_FACTOR", "ExtensibleKVCache", "KVCacheStateError"]

#: capacity_blocks defaults to this many times the config's num_blocks (rounded up)
DEFAULT_CAPACITY_FACTOR = 4


class KVCacheStateError(KvconnectError, RuntimeError):
    """An operation that the cache's current state (not allocated, released, final, closed)
    does not allow; the message says which state and what to call."""


def capacity_step_blocks(plan: LayoutPlan, granule: int) -> int:
    """Smallest block count ``c`` such that ``c * segment_bytes_per_block`` is a multiple of
    ``granule`` for every KV tensor (capacities are rounded up to multiples of it)."""
    step = 1
    for tp in plan.tensors:
        s = granule // math.gcd(granule, tp.segment_bytes_per_block)
        step = step * s // math.gcd(step, s)
    return step


class ExtensibleKVCache(Closeable):
    """A KV cache whose tensors keep their addresses while their committed block count grows.

    ``capacity_blocks`` (default: ``DEFAULT_CAPACITY_FACTOR * cfg.num_blocks``) is rounded up
    so every segment's capacity is a granule multiple; the reservation is virtual. The
    geometry at ``capacity_blocks`` committed blocks equals an ordinary allocation of the
    same layout with that many blocks (:func:`kvconnect.layout.allocate_kv_caches`).
    ``device`` is ``"cpu"`` (host VMM backend), ``"cuda:N"`` or a VmmDriver. ``options``
    (:class:`~kvconnect.vmm.AllocationOptions`) is what every tensor's physical memory is
    requested with.
    """

    def __init__(self, cfg: KVCacheConfig, device: DeviceSpec = "cpu",
                 capacity_blocks: int | None = None, *,
                 options: AllocationOptions | None = None) -> None:
        self._plan = plan_layout(cfg)
        self._config = cfg
        self._device_arg = device
        self._options = AllocationOptions.resolve(options)
        self._granule = ExtensibleTensor.commit_granule(device, self._options)
        wanted = (DEFAULT_CAPACITY_FACTOR * cfg.num_blocks if capacity_blocks is None
                  else checked_int("capacity_blocks", capacity_blocks))
        step = capacity_step_blocks(self._plan, self._granule)
        self._capacity_blocks = round_up(wanted, step)
        if self._capacity_blocks != wanted:
            logger.debug("capacity_blocks %d rounded up to %d (multiple of %d blocks keeps "
                         "every segment a %d-byte granule multiple)", wanted,
                         self._capacity_blocks, step, self._granule)
        self._tensors: list[ExtensibleTensor] = []
        self._kv_caches: dict[str, torch.Tensor | list[torch.Tensor]] | None = None
        self._num_blocks = 0
        self._final = False
        self._released = False
        self._closed = False

    # -- properties ----------------------------------------------------------------------
    @property
    def config(self) -> KVCacheConfig:
        """The config this cache was built from (its ``num_blocks`` is the planned count)."""
        return self._config

    @property
    def plan(self) -> LayoutPlan:
        return self._plan

    @property
    def tensors(self) -> list[ExtensibleTensor]:
        """One ExtensibleTensor per planned KV tensor (``CommittedRegion.tensor_index``)."""
        return list(self._tensors)

    @property
    def num_blocks(self) -> int:
        """Logical blocks committed (usable) now; 0 before :meth:`allocate`."""
        return self._num_blocks

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block over every layer and KV tensor."""
        return self._plan.bytes_per_block

    @property
    def segment_bytes_per_block(self) -> list[int]:
        """Per segment of every KV tensor (tensor order, then segment order): bytes one
        block adds to it. ``sum(...) == bytes_per_block``."""
        return [tp.segment_bytes_per_block for tp in self._plan.tensors
                for _ in range(tp.num_segments)]

    @property
    def options(self) -> AllocationOptions:
        """What every tensor's physical memory is requested with."""
        return self._options

    @property
    def granule(self) -> int:
        """Bytes every segment commit rounds up to."""
        return self._granule

    @property
    def committed_bytes(self) -> int:
        """Physical bytes committed over all tensors and segments (granule-rounded)."""
        return sum(sum(t.committed_bytes) for t in self._tensors)

    @property
    def num_physical_chunks(self) -> int:
        return sum(t.num_physical_chunks for t in self._tensors)

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_final(self) -> bool:
        """True once :meth:`extend_kv_cache` committed the final size."""
        return self._final

    @property
    def is_released(self) -> bool:
        return self._released

    @property
    def device(self) -> torch.device:
        if self._tensors:
            return self._tensors[0].device
        if isinstance(self._device_arg, VmmDriver):
            return torch.device(self._device_arg.torch_device)
        kind, index = parse_device(self._device_arg)
        return torch.device("cpu" if kind == "host" else f"cuda:{index}")

    # -- lifecycle -------------------------------------------------------------------------
    def allocate(self) -> None:
        """Reserve ``capacity_blocks`` for every KV tensor and commit one block per segment.
        On failure everything reserved so far is released."""
        if self._closed:
            raise KVCacheStateError("allocate() after close(): build a new ExtensibleKVCache")
        if self._tensors:
            raise KVCacheStateError("allocate() called twice")
        made: list[ExtensibleTensor] = []
        with UndoStack() as undo:
            for tp in self._plan.tensors:
                t = ExtensibleTensor(self._capacity_blocks * tp.bytes_per_block,
                                     self._device_arg, num_segments=tp.num_segments,
                                     options=self._options)
                undo.push(t.close, force=True)
                made.append(t)
                t.commit(tp.segment_bytes_per_block)
            kv = self._build_views(made)
        self._tensors = made
        self._kv_caches = kv
        self._num_blocks = 1

    def ensure_kv_cache_blocks(self, num_blocks: int) -> None:
        """Commit at least ``num_blocks`` blocks (the prefix warm-up touches). Grow-only: a
        smaller count is a no-op. Raises past ``capacity_blocks`` or after the final commit;
        a failed commit leaves ``num_blocks`` and every mapping as they were."""
        self._check_ready()
        num_blocks = checked_int("num_blocks", num_blocks)
        if num_blocks <= self._num_blocks:
            return
        if self._final:
            raise KVCacheStateError(
                f"the KV cache is final at {self._num_blocks} blocks (extend_kv_cache ran and "
                f"connectors may have registered it); cannot grow to {num_blocks}")
        self._grow(num_blocks)

    def extend_kv_cache(self, num_blocks: int, single_handle: bool = True) -> None:
        """Commit the final ``num_blocks`` blocks and mark the cache final.

        With ``single_handle`` (what a connector needs), the warm-up chunks are released and
        each segment's final prefix is committed as ONE physical allocation
        (``ExtensibleTensor.commit(..., single_handle=True)``); contents are discarded (only
        warm-up garbage lives there; undefined on GPUs, zeros on the host backend). On failure
        the block count is restored (a segment may keep more committed bytes than it needs).
        Register with connectors only after this returns.
        """
        self._check_ready()
        num_blocks = checked_int("num_blocks", num_blocks)
        if self._final:
            if num_blocks == self._num_blocks:
                return
            raise KVCacheStateError(f"extend_kv_cache({num_blocks}): the cache is already final "
                                    f"at {self._num_blocks} blocks")
        if num_blocks < self._num_blocks:
            raise ValueError(f"extend_kv_cache({num_blocks}) is below the {self._num_blocks} "
                             f"blocks already committed; the cache never shrinks")
        if not single_handle:
            self._grow(num_blocks)
            self._final = True
            return
        self._check_capacity(num_blocks)
        before_blocks = self._num_blocks
        before = [t.committed_bytes for t in self._tensors]
        try:
            # One fused step per tensor: release the warm-up chunks, commit the final prefix
            # as one allocation. Committing first and re-creating afterwards costs ~100x more
            # on CUDA (the driver scrubs memory just freed): benchmarks/results/.
            for t, tp in zip(self._tensors, self._plan.tensors, strict=True):
                t.commit(num_blocks * tp.segment_bytes_per_block, single_handle=True)
        except BaseException:
            self._undo_extend(before_blocks, before)
            raise
        self._num_blocks = num_blocks
        self._final = True

    def _undo_extend(self, blocks: int, sizes: list[tuple[int, ...]]) -> None:
        """After a failed single-handle recommit (which leaves a tensor released): map back
        what it dropped, zeroed, then shrink to the sizes held before extend_kv_cache (best
        effort; logged if that fails too)."""
        try:
            self._recommit_tensors()
            for t, kept in zip(self._tensors, sizes, strict=True):
                t.shrink_to(kept)
            self._num_blocks = blocks
        except Exception:  # the original error is what the caller must see
            for t in self._tensors:
                t.release_physical()
            self._released = True
            logger.exception("could not restore the KV cache after a failed extend_kv_cache: "
                             "it is left released at %d blocks; call recommit() to retry",
                             self._num_blocks)

    def resize(self, num_blocks: int) -> int:
        """Grow or shrink a final cache to ``num_blocks`` blocks at the same addresses (the
        elastic step, after connectors registered it); returns the change of committed bytes
        (negative when memory was released).

        Grow commits each segment's new tail as one more physical allocation (the blocks
        already committed keep their contents); all-or-nothing: on failure nothing new stays
        mapped. Shrink releases every physical allocation lying wholly at or past the new
        tail (granule-rounded); an allocation that straddles it cannot be split (a CUDA
        mapping is unmapped whole) and stays, committed but unused (if a release fails
        part-way the cache is still at ``num_blocks``, holding more memory). The caller makes sure
        nothing reads or writes blocks ``>= num_blocks`` and that connectors dropped them
        before a shrink. Raises past ``capacity_blocks``, below 1 block, before
        :meth:`extend_kv_cache`, and while released.
        """
        self._check_ready()
        num_blocks = checked_int("num_blocks", num_blocks)
        if not self._final:
            raise KVCacheStateError(
                f"resize({num_blocks}) before extend_kv_cache(): commit the final size first "
                f"(ensure_kv_cache_blocks grows a cache that is not final yet)")
        self._check_capacity(num_blocks)
        before = self.committed_bytes
        if num_blocks > self._num_blocks:
            self._grow(num_blocks)
        elif num_blocks < self._num_blocks:
            # the block count first: if a release fails part-way, the cache is still
            # consistent at num_blocks (every tensor keeps at least that much committed)
            self._num_blocks = num_blocks
            for t, tp in zip(self._tensors, self._plan.tensors, strict=True):
                keep = round_up(num_blocks * tp.segment_bytes_per_block, self._granule)
                t.shrink_to([min(keep, c) for c in t.committed_bytes])
        return self.committed_bytes - before

    def release_physical(self) -> None:
        """Sleep: unmap and release every physical allocation, keep the addresses. Touching
        the KV memory faults until :meth:`recommit`; connectors must deregister first."""
        self._check_alive()
        if self._released:
            return
        for t in self._tensors:
            t.release_physical()
        self._released = True

    def recommit(self) -> None:
        """Wake: commit the same block count again, zero-filled, at the same addresses, one
        physical allocation per segment. Connectors must re-derive regions and re-register.
        On failure the cache stays released (and a later recommit() can be retried)."""
        self._check_alive()
        if not self._released:
            raise KVCacheStateError("recommit() without release_physical()")
        self._recommit_tensors()
        self._released = False

    def _recommit_tensors(self) -> None:
        """Recommit every released tensor (each comes back whole: ExtensibleTensor.recommit
        maps all of its remembered sizes or, on failure, nothing). On failure every tensor is
        released again, so the whole cache can be retried."""
        try:
            for t in self._tensors:
                if t.is_released:
                    t.recommit()
        except BaseException:
            for t in self._tensors:
                t.release_physical()  # a no-op for a tensor already released
            raise

    def close(self, *, force: bool = False) -> None:
        """Release every tensor (idempotent).

        Refused with :class:`~kvconnect.lifetime.LiveViewsError` (nothing released, the cache
        stays usable) while views handed out (:meth:`kv_caches`, :meth:`narrowed_kv_caches`,
        :meth:`region_view`, a tensor's views, or tensors derived from any of them) are still
        referenced outside the cache. ``force=True`` releases the physical memory anyway and
        keeps the address ranges reserved until the last view is gone: a stale view faults
        instead of reaching a later allocation.
        """
        if self._closed:
            return
        self._kv_caches = None  # the cache's own views; what is left is held by others
        live = sum(t.live_views for t in self._tensors)
        if live and not force:
            self._kv_caches = self._build_views(self._tensors)
            raise LiveViewsError("KV cache", live,
                                 "kv_caches()/narrowed_kv_caches()/region_view()")
        self._closed = True
        first_error: Exception | None = None
        for t in self._tensors:  # every tensor is closed even if one fails
            try:
                t.close(force=True)
            except Exception as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error

    # -- views -----------------------------------------------------------------------------
    def kv_caches(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """Per-layer tensors in the model's shape over the WHOLE reservation
        (``capacity_blocks`` blocks; pointer-stable: what CUDA graphs capture). Only the
        first :attr:`num_blocks` blocks are backed; give connectors
        :meth:`narrowed_kv_caches` or :meth:`committed_regions` instead."""
        self._check_alive()
        if self._kv_caches is None:
            raise KVCacheStateError("kv_caches() before allocate()")
        return dict(self._kv_caches)

    def narrowed_kv_caches(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """:func:`~kvconnect.views.narrow_kv_caches_to_num_blocks` at :attr:`num_blocks`."""
        self._check_ready()
        return narrow_kv_caches_to_num_blocks(self.kv_caches(), self._num_blocks, self._plan)

    def committed_regions(self) -> list[CommittedRegion]:
        """Registration regions of the committed blocks (see
        :func:`kvconnect.views.committed_regions`), each checked to lie inside its segment's
        committed prefix. Derive them again after every wake."""
        self._check_ready()
        regions = committed_regions(self.kv_caches(), self._num_blocks, self._plan)
        for r in regions:
            self._check_region(r)
        return regions

    def region_view(self, region: CommittedRegion) -> torch.Tensor:
        """uint8 tensor over ``region.span`` bytes from ``region.base_ptr``; raises unless
        the whole span is committed memory of this cache."""
        self._check_ready()
        t = self._check_region(region)
        return t.committed_view(region.base_ptr - t.base_ptr, region.span)

    # -- internals -------------------------------------------------------------------------
    def _build_views(self, tensors: list[ExtensibleTensor]
                     ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        return build_kv_caches(self._plan, [t.full_view() for t in tensors],
                               self._capacity_blocks)

    def _check_region(self, r: CommittedRegion) -> ExtensibleTensor:
        if not 0 <= r.tensor_index < len(self._tensors):
            raise ValueError(f"region {r.layer_name}/{r.part}: tensor_index {r.tensor_index} "
                             f"is not a tensor of this cache")
        t = self._tensors[r.tensor_index]
        tp = self._plan.tensors[r.tensor_index]
        start = r.base_ptr - t.segment_base(r.segment)
        end = start + r.span
        logical = self._num_blocks * tp.segment_bytes_per_block
        if start < 0 or end > min(logical, t.committed_bytes[r.segment]):
            raise ValueError(
                f"region {r.layer_name}/{r.part} [{start}, {end}) of segment {r.segment} of "
                f"tensor {r.tensor_index} lies outside its committed {logical} bytes "
                f"({self._num_blocks} blocks)")
        return t

    def _check_capacity(self, num_blocks: int) -> None:
        if num_blocks > self._capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} blocks: the reservation holds capacity_blocks="
                f"{self._capacity_blocks}; build the cache with a larger capacity_blocks")

    def _grow(self, num_blocks: int) -> None:
        self._check_capacity(num_blocks)
        with UndoStack() as undo:
            for t, tp in zip(self._tensors, self._plan.tensors, strict=True):
                undo.push(t.shrink_to, t.committed_bytes)
                t.commit(num_blocks * tp.segment_bytes_per_block)
        self._num_blocks = num_blocks

    def _check_alive(self) -> None:
        if self._closed:
            raise KVCacheStateError("the KV cache was closed")
        if not self._tensors:
            raise KVCacheStateError("the KV cache is not allocated: call allocate() first")

    def _check_ready(self) -> None:
        self._check_alive()
        if self._released:
            raise KVCacheStateError("the KV cache's physical memory is released (sleeping): "
                                    "call recommit() first")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._config.layout}, tensors={len(self._plan.tensors)}, "
                f"num_blocks={self._num_blocks}, capacity_blocks={self._capacity_blocks}, "
                f"bytes_per_block={self.bytes_per_block}, final={self._final}, "
                f"released={self._released})")
