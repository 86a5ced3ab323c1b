"""CPU offload of KV blocks, with geometry taken from committed extents only.

:class:`CPUOffloadConnector` copies whole logical KV blocks between an
:class:`~kvconnect.kv_cache.ExtensibleKVCache` (or ordinary per-layer tensors, see
:meth:`~CPUOffloadConnector.from_kv_caches`) and a CPU pool (pinned on CUDA), keyed by a
hashable key per block (default: the block id), with LRU slots (:mod:`.slots`).

Geometry. One pool slot ("row") holds one logical block, its regions' pages side by side
(:mod:`.layout`). Every region is read through a **bounded** flat view (:mod:`.sources`), so
no copy can reach uncommitted memory; nothing here looks at ``untyped_storage().nbytes()``
(upstream's ``storage.nbytes() // num_blocks`` faults on an over-reserved cache).

Copies (:mod:`.copies`): one launch per batch over every region and block, on CUDA
``direct`` or ``staged`` (``path``, ``max_copy_runs``); the :class:`OffloadHandle` holds its event.

Ordering contract (CUDA): do not overwrite GPU blocks passed to :meth:`save` before its handle
is done; do not read blocks passed to :meth:`load` before ``handle.wait()``. Operations of
one connector run in issue order, so a slot reused after eviction is never written before an
earlier load from it has read it.

Sleep / wake and growth. Before every operation the connector compares a cheap state token of
the cache (block count, committed bytes and physical chunk count per tensor) with the one its
plans were built from and calls :meth:`CPUOffloadConnector.rebind` when it differs (after
``ensure_kv_cache_blocks`` / ``extend_kv_cache``). A sleep / wake cycle brings the same sizes
back at the same addresses, so the plans stay valid. While the cache is asleep, ``save`` /
``load`` raise :class:`KVConnectorError`; the pool and its keys survive sleep. Call
:meth:`CPUOffloadConnector.wait` before ``release_physical()``. The layout is fixed for a
connector's life (:meth:`CPUOffloadConnector.rebind`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

import torch

from kvconnect.block_ids import BlockIds, as_block_ids
from kvconnect.cache_source import KVCacheSource
from kvconnect.checks import checked_int
from kvconnect.lifetime import ClosesOnExit
from kvconnect.peer_layout import PeerLayout
from kvconnect.views import CommittedRegion, KVCacheConfigLike, KVCaches

from ..copy.block_copy import BlockCopyPlan, BlockRegion, layout_block_region
from ..errors import KVConnectorError, KVTransferError
from .copies import (
    DEFAULT_MAX_COPY_RUNS,
    DEFAULT_MAX_STAGING_BYTES,
    DEFAULT_STAGING_CHUNK_BYTES,
    OFFLOAD_PATHS,
    PoolCopies,
)
from .handle import PEER_NAME, OffloadHandle, OffloadKeyError
from .layout import RowSlice, offload_row_layout
from .slots import LruSlots
from .sources import CacheSource, TensorsSource, block_source

logger = logging.getLogger(__name__)

__all__ = [
    "OFFLOAD_PATHS",
    "CPUOffloadConnector",
    "OffloadHandle",
    "OffloadKeyError",
    "RowSlice",
    "offload_row_layout",
]


class CPUOffloadConnector(ClosesOnExit):
    """Save / load logical KV blocks of ``cache`` to / from a CPU pool of ``num_cpu_blocks``.

    ``cache``: an ``ExtensibleKVCache`` (any :class:`~kvconnect.cache_source.KVCacheSource`);
    for ordinary tensors use :meth:`from_kv_caches`.
    ``num_cpu_blocks``: pool slots, each :attr:`bytes_per_block` bytes. ``pin_memory``: pin
    the pool (default: on CUDA only). ``max_staging_bytes``: bound on the device staging
    buffers of the ``staged`` path (bytes, both buffers together); ``staging_chunk_bytes``:
    bound on one staged chunk (bytes; at least one block). ``max_copy_runs`` and ``path``
    choose the CUDA path (:data:`OFFLOAD_PATHS`, :mod:`.copies`).
    """

    def __init__(
        self,
        cache: KVCacheSource | CacheSource | TensorsSource,
        num_cpu_blocks: int,
        *,
        pin_memory: bool | None = None,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        max_copy_runs: int = DEFAULT_MAX_COPY_RUNS,
        path: str = "auto",
        staging_chunk_bytes: int = DEFAULT_STAGING_CHUNK_BYTES,
    ) -> None:
        self._slots = LruSlots(num_cpu_blocks)
        checked_int("max_staging_bytes", max_staging_bytes)
        checked_int("staging_chunk_bytes", staging_chunk_bytes)
        checked_int("max_copy_runs", max_copy_runs)
        if path not in OFFLOAD_PATHS:
            raise ValueError(f"path must be one of {OFFLOAD_PATHS}, got {path!r}")
        self._src: CacheSource | TensorsSource = block_source(cache)
        self._closed = False
        self._pending: list[OffloadHandle] = []

        self._src.check_usable()
        self._layout, regions = self._derive_layout()
        self._slices = offload_row_layout(self._layout)
        self._token = self._src.state_token()
        self._bytes_per_block = sum(s.width for s in self._slices)
        flat0 = self._src.flat_view(regions[0], regions[0].block_len)
        self._device = flat0.device
        pin = self._device.type == "cuda" if pin_memory is None else bool(pin_memory)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; use pin_memory=False on the host backend")
        total = num_cpu_blocks * self._bytes_per_block
        try:
            pool = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:
            raise KVConnectorError(
                f"cannot allocate a {'pinned ' if pin else ''}CPU pool of {num_cpu_blocks} blocks "
                f"x {self._bytes_per_block} bytes = {total} bytes: {exc}"
            ) from exc
        self._copies = PoolCopies(pool, self._bytes_per_block, self._device, path=path,
                                  max_copy_runs=max_copy_runs,
                                  max_staging_bytes=max_staging_bytes,
                                  staging_chunk_bytes=staging_chunk_bytes)
        self._copies.bind(self._cache_regions(regions), self._slices)
        logger.debug("CPU offload pool: %d blocks x %d bytes (%d regions) on %s",
                     num_cpu_blocks, self._bytes_per_block, len(self._slices), self._device)

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: KVCaches,
        num_blocks: int,
        kv_cache_config: KVCacheConfigLike,
        num_cpu_blocks: int,
        **kwargs: Any,
    ) -> CPUOffloadConnector:
        """A connector over per-layer tensors (an ordinary allocation, e.g.
        :func:`kvconnect.layout.allocate_kv_caches`, or any ``kv_caches`` of the config) for
        their first ``num_blocks`` blocks. Geometry comes from
        :func:`kvconnect.views.committed_regions`; views from the narrowed, storage-bounded
        layers. The tensors must outlive the connector; there is no automatic rebind."""
        return cls(TensorsSource(kv_caches, num_blocks, kv_cache_config), num_cpu_blocks,
                   **kwargs)

    # -- properties ------------------------------------------------------------
    @property
    def num_cpu_blocks(self) -> int:
        """Slots in the CPU pool."""
        return self._slots.num_slots

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block over all committed regions (one CPU pool row)."""
        return self._bytes_per_block

    @property
    def pool_bytes(self) -> int:
        """Bytes of the CPU pool: ``num_cpu_blocks * bytes_per_block``."""
        return self.num_cpu_blocks * self._bytes_per_block

    @property
    def layout(self) -> PeerLayout:
        """The cache's layout the pool was built for (:class:`~kvconnect.peer_layout.PeerLayout`)."""
        return self._layout

    @property
    def row_layout(self) -> list[RowSlice]:
        """Where each committed region lands inside a CPU row."""
        return list(self._slices)

    @property
    def device(self) -> torch.device:
        """The KV cache's device."""
        return self._device

    @property
    def num_blocks(self) -> int:
        """Committed logical blocks of the cache as last bound (valid ids: ``0..num_blocks-1``)."""
        return self._layout.num_blocks

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    @property
    def is_pinned(self) -> bool:
        return self._copies.pinned

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def copy_plan(self) -> BlockCopyPlan:
        """The cache -> pool plan (for reports: columns, word size, method)."""
        self._check_alive()
        assert self._copies.plans is not None
        return self._copies.plans.save

    # -- slot accounting -------------------------------------------------------
    def contains(self, key: Hashable) -> bool:
        """Whether ``key`` has a block in the pool (its save may still be in flight)."""
        return key in self._slots

    __contains__ = contains

    def slot_of(self, key: Hashable) -> int | None:
        """The pool slot holding ``key``, or ``None``."""
        return self._slots.slot_of(key)

    def keys(self) -> list[Hashable]:
        """Saved keys, least recently used first (the eviction order)."""
        return self._slots.keys()

    def discard(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Forget ``keys`` and free their slots; returns the keys that were present."""
        self._check_alive()
        return self._slots.discard(keys)

    def read_cpu_block(self, key: Hashable) -> torch.Tensor:
        """A copy of the block saved under ``key``: ``bytes_per_block`` uint8, the regions'
        pages side by side in :attr:`row_layout` order, after waiting for outstanding
        copies. For checks and debugging."""
        self._check_alive()
        slot = self._slots.slot_of(key)
        if slot is None:
            raise OffloadKeyError([key])
        self.wait()
        pool = self._copies.pool
        assert pool is not None
        n = self._bytes_per_block
        return pool[slot * n:(slot + 1) * n].clone()

    # -- binding ---------------------------------------------------------------
    def rebind(self) -> None:
        """Re-derive the bounded views and copy plans from the cache's committed regions.

        Called automatically when the cache's commit state changes. The layout (layers,
        parts, block lengths) must be the one the pool was built for; block count and
        addresses may change. Raises :class:`KVConnectorError` otherwise.
        """
        self._check_alive()
        self._src.check_usable()
        self.wait()
        layout, regions = self._derive_layout()
        diffs = self._layout.differences(layout)
        if diffs:
            raise KVConnectorError(
                "the KV cache's region layout changed under the CPU offload pool "
                f"({'; '.join(diffs[:8])}); close this connector and create a new one"
            )
        self._layout = layout
        self._slices = offload_row_layout(layout)
        self._copies.bind(self._cache_regions(regions), self._slices)
        self._token = self._src.state_token()

    def _derive_layout(self) -> tuple[PeerLayout, list[CommittedRegion]]:
        """The cache's layout now and its regions (``regions[slice.index]``: a slice's)."""
        if self._src.num_blocks <= 0:
            raise KVConnectorError("the KV cache has no committed blocks")
        regions = self._src.regions()
        return self._src.layout(regions), regions

    def _cache_regions(self, regions: list[CommittedRegion]) -> list[BlockRegion]:
        out = []
        n = self.num_blocks
        for sl in self._slices:
            r = regions[sl.index]
            span = sl.region.span(n)
            try:
                flat = self._src.flat_view(r, span)
            except ValueError as exc:
                raise KVConnectorError(
                    f"region {r.layer_name}/{r.part} ({n} blocks, {span} bytes at "
                    f"{r.base_ptr:#x}) is not inside committed memory: {exc}"
                ) from exc
            out.append(layout_block_region(flat, sl.region, n, name="+".join(sl.members)))
        return out

    # -- operations ------------------------------------------------------------
    def save(self, block_ids: BlockIds,
             keys: Sequence[Hashable] | None = None) -> OffloadHandle:
        """Copy GPU blocks ``block_ids`` into the pool under ``keys`` (default: the ids).

        A key already in the pool is overwritten in its slot; new keys take free slots,
        evicting least recently used keys outside this batch when the pool is full (listed
        in ``handle.evicted``). Raises ``ValueError`` for ids outside the committed blocks,
        repeated keys, or more keys than the pool holds; :class:`KVTransferError` if a copy
        fails (the batch's keys are then dropped from the pool).
        """
        ids, key_list = self._batch("save", block_ids, keys)
        if len(set(key_list)) != len(key_list):
            raise ValueError("save() got the same key twice in one batch")
        reservation = self._slots.reserve(key_list)
        handle = OffloadHandle("save", tuple(ids), tuple(key_list), reservation.slots,
                               len(ids) * self._bytes_per_block, reservation.evicted)
        if ids:
            try:
                self._copy(handle, to_cpu=True)
            except Exception as exc:
                self._slots.abandon(reservation)
                raise KVTransferError(PEER_NAME, ids, exc) from exc
        self._slots.commit(reservation)
        if reservation.evicted:
            logger.debug("CPU offload evicted %d keys", len(reservation.evicted))
        return handle

    def load(self, block_ids: BlockIds,
             keys: Sequence[Hashable] | None = None) -> OffloadHandle:
        """Copy the pool blocks saved under ``keys`` (default: the ids) into GPU blocks
        ``block_ids``; marks the keys most recently used.

        Raises :class:`OffloadKeyError` for keys not in the pool, ``ValueError`` for ids
        outside the committed blocks or repeated destination ids, :class:`KVTransferError`
        if a copy fails. On CUDA, wait on the handle before reading the blocks.
        """
        ids, key_list = self._batch("load", block_ids, keys)
        if len(set(ids)) != len(ids):
            raise ValueError("load() got the same destination block id twice in one batch")
        slots, missing = self._slots.lookup(key_list)
        if missing:
            raise OffloadKeyError(missing)
        handle = OffloadHandle("load", tuple(ids), tuple(key_list), tuple(slots),
                               len(ids) * self._bytes_per_block)
        if ids:
            try:
                self._copy(handle, to_cpu=False)
            except Exception as exc:
                raise KVTransferError(PEER_NAME, ids, exc) from exc
        self._slots.touch(key_list)
        return handle

    def wait(self, handle: OffloadHandle | None = None, timeout_s: float | None = None) -> None:
        """Wait for ``handle``, or for every outstanding operation when ``None``."""
        if handle is not None:
            handle.wait(timeout_s)
        else:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            for h in list(self._pending):
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                h.wait(left)
        self._pending = [h for h in self._pending if not h.done()]

    # -- copies ------------------------------------------------------------------
    def path_for(self, slots: Sequence[int]) -> str:
        """The path a batch into / out of ``slots`` takes: ``host``, ``direct`` or
        ``staged`` (see :mod:`.copies`)."""
        return self._copies.path_for(slots)

    def _copy(self, handle: OffloadHandle, *, to_cpu: bool) -> None:
        event = self._copies.copy(handle.block_ids, handle.slots, to_cpu=to_cpu)
        if event is not None:
            handle._event = event
            self._pending = [h for h in self._pending if not h.done()]
            self._pending.append(handle)

    # -- validation ------------------------------------------------------------
    def _batch(self, op: str, block_ids: BlockIds, keys: Sequence[Hashable] | None
               ) -> tuple[list[int], list[Hashable]]:
        """The checked ids and keys (default: the ids) of a ``save`` / ``load``, after a
        :meth:`rebind` when the cache's commit state moved."""
        self._check_alive()
        self._src.check_usable()
        if self._src.state_token() != self._token:
            self.rebind()
        ids = as_block_ids(block_ids, f"{op}() block_ids", allow_negative=True).tolist()
        n = self.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            cap = self._src.capacity_blocks
            extra = f" (capacity {cap} blocks, but only committed blocks exist)" if cap else ""
            raise ValueError(
                f"{op}(): block id(s) {bad[:8]} outside the {n} committed blocks "
                f"(valid ids 0..{n - 1}){extra}"
            )
        return ids, self._validate_keys(ids, keys)

    @staticmethod
    def _validate_keys(ids: list[int], keys: Sequence[Hashable] | None) -> list[Hashable]:
        if keys is None:
            return list(ids)
        key_list = list(keys)
        if len(key_list) != len(ids):
            raise ValueError(f"got {len(key_list)} keys for {len(ids)} block ids")
        for k in key_list:
            try:
                hash(k)
            except TypeError:
                raise TypeError(f"keys must be hashable, got {type(k).__name__}") from None
        return key_list

    # -- lifetime --------------------------------------------------------------
    def _check_alive(self) -> None:
        if self._closed:
            raise KVConnectorError("CPUOffloadConnector used after close()")

    def close(self) -> None:
        """Wait for outstanding copies, then drop the pool, the staging buffers and the
        plans. Idempotent. A pinned pool goes back to torch's pinned-memory cache (the
        process's, which this library never empties)."""
        if self._closed:
            return
        try:
            if self._pending:
                self.wait()
        finally:
            self._closed = True
            self._pending = []
            self._slots.clear()
            self._copies.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)}/{self.num_cpu_blocks} used"
        return (f"CPUOffloadConnector({self.num_cpu_blocks} x {self._bytes_per_block} bytes, "
                f"{len(self._slices)} regions, {state})")
