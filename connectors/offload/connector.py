"""CPU offload of KV blocks, with geometry taken from committed extents only.

:class:`CPUOffloadConnector` copies whole logical KV blocks between an
:class:`~kvconnect.kv_cache.ExtensibleKVCache` (or ordinary per-layer tensors, see
:meth:`~CPUOffloadConnector.from_kv_caches`) and a CPU pool (pinned on CUDA), keyed by a
hashable key per block (default: the block id), with LRU slots (:mod:`.slots`).

Geometry. One pool slot ("row") holds one logical block, its regions' pages side by side
(:mod:`.layout`). Every region is read through a **bounded** flat view (:mod:`.sources`), so
no copy can reach uncommitted memory; nothing here looks at ``untyped_storage().nbytes()``
(upstream's ``storage.nbytes() // num_blocks`` faults on an over-reserved cache).

Copies (:mod:`..copy.block_copy`). The pool is slot-major: slot ``s`` is bytes ``[s *
bytes_per_block, (s + 1) * bytes_per_block)``, so consecutive slots are one contiguous range.
Each direction has a :class:`~..copy.block_copy.BlockCopyPlan` built once (again on rebind), and a
batch is one launch over every region and block:

- host backend: the plan's ``torch`` method, straight between KV memory and the pool;
- CUDA, ``direct``: one kernel between KV memory and the pinned pool (unified addressing);
- CUDA, ``staged``: one kernel gathers the blocks into a device staging buffer (save) or
  scatters them from it (load), and the copy engines move one contiguous copy per run of
  consecutive slots; a batch moves in chunks of at most ``staging_chunk_bytes`` through two
  alternating staging buffers, so one chunk's copy overlaps the next chunk's kernel.

``path="auto"`` takes ``staged`` when the batch's slots form at most ``max_copy_runs`` runs
and ``direct`` otherwise (and always when the pool is not pinned: ``staged``). Kernels run
on a side stream, copy-engine copies on a second one; both first wait for the caller's
current stream and for earlier operations of the connector, and the returned
:class:`OffloadHandle` holds an event.

Ordering contract (CUDA): do not overwrite GPU blocks passed to :meth:`save` before its handle
is done; do not read blocks passed to :meth:`load` before ``handle.wait()`` (or
``handle.wait_on_stream()``). Operations of one connector run in issue order, so a slot
reused after eviction is never written before an earlier load from it has read it.

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
from dataclasses import dataclass, field
from typing import Any

import torch

from kvconnect.block_ids import BlockIds, as_block_ids
from kvconnect.cache_source import KVCacheSource
from kvconnect.checks import checked_int
from kvconnect.peer_layout import PeerLayout
from kvconnect.views import CommittedRegion, KVCacheConfigLike, KVCaches

from ..copy._cuda_streams import current_stream, use_stream
from ..copy.block_copy import (
    BlockCopyPlan,
    BlockRegion,
    block_runs,
    layout_block_region,
)
from ..errors import KVConnectorError, KVTransferError
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

#: default bound on the device staging buffers of the ``staged`` path (bytes, both together)
DEFAULT_MAX_STAGING_BYTES = 256 * 1024 * 1024
#: default bound on the bytes of one staged chunk (smaller chunks overlap the kernel with
#: the copy engines sooner; each costs one kernel launch and one copy per run)
DEFAULT_STAGING_CHUNK_BYTES = 32 * 1024 * 1024
#: with ``path="auto"``, batches whose slots form more runs than this take the direct path
DEFAULT_MAX_COPY_RUNS = 8
#: how a CUDA batch moves (see the module docstring)
OFFLOAD_PATHS = ("auto", "direct", "staged")


@dataclass
class _Staging:
    """One device staging buffer of ``rows`` pool rows and its two plans."""

    buffer: torch.Tensor
    rows: int
    gather: BlockCopyPlan  # cache -> staging rows
    scatter: BlockCopyPlan  # staging rows -> cache
    free_event: Any = None  # recorded after the last use; the next user waits for it


@dataclass
class _Plans:
    """The copy plans of one binding (rebuilt by rebind)."""

    save: BlockCopyPlan  # cache -> pool
    load: BlockCopyPlan  # pool -> cache
    cache_regions: list[BlockRegion]
    staging: list[_Staging] = field(default_factory=list)


class CPUOffloadConnector:
    """Save / load logical KV blocks of ``cache`` to / from a CPU pool of ``num_cpu_blocks``.

    ``cache``: an ``ExtensibleKVCache`` (any :class:`~kvconnect.cache_source.KVCacheSource`);
    for ordinary tensors use :meth:`from_kv_caches`.
    ``num_cpu_blocks``: pool slots, each :attr:`bytes_per_block` bytes. ``pin_memory``: pin
    the pool (default: on CUDA only). ``max_staging_bytes``: bound on the device staging
    buffers of the ``staged`` path (bytes, both buffers together); ``staging_chunk_bytes``:
    bound on one staged chunk (bytes; at least one block). ``max_copy_runs`` and ``path``
    choose the CUDA path (:data:`OFFLOAD_PATHS`, module docstring).
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
        self._num_cpu_blocks = num_cpu_blocks
        self._max_staging_bytes = max_staging_bytes
        self._staging_chunk_bytes = staging_chunk_bytes
        self._max_copy_runs = max_copy_runs
        self._path = path
        self._closed = False
        self._pool: torch.Tensor | None = None
        self._plans: _Plans | None = None
        self._stream: Any = None
        self._copy_stream: Any = None
        self._pending: list[OffloadHandle] = []

        self._src.check_usable()
        self._layout, regions = self._derive_layout()
        self._slices = offload_row_layout(self._layout)
        self._num_blocks = self._layout.num_blocks
        self._token = self._src.state_token()
        self._bytes_per_block = sum(s.width for s in self._slices)
        flat0 = self._src.flat_view(regions[0], regions[0].block_len)
        self._device = flat0.device
        self._is_cuda = self._device.type == "cuda"
        pin = self._is_cuda if pin_memory is None else bool(pin_memory)
        if pin and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; use pin_memory=False on the host backend")
        total = num_cpu_blocks * self._bytes_per_block
        try:
            self._pool = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as exc:
            raise KVConnectorError(
                f"cannot allocate a {'pinned ' if pin else ''}CPU pool of {num_cpu_blocks} blocks "
                f"x {self._bytes_per_block} bytes = {total} bytes: {exc}"
            ) from exc
        if self._is_cuda:
            self._stream = torch.cuda.Stream(device=self._device)
            self._copy_stream = torch.cuda.Stream(device=self._device)
        self._plans = self._build_plans(regions)
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
        return self._num_cpu_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one logical block over all committed regions (one CPU pool row)."""
        return self._bytes_per_block

    @property
    def pool_bytes(self) -> int:
        """Bytes of the CPU pool: ``num_cpu_blocks * bytes_per_block``."""
        return self._num_cpu_blocks * self._bytes_per_block

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
        return self._num_blocks

    @property
    def num_used_slots(self) -> int:
        return len(self._slots)

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    @property
    def is_pinned(self) -> bool:
        return self._pool is not None and self._pool.is_pinned()

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def copy_plan(self) -> BlockCopyPlan:
        """The cache -> pool plan (for reports: columns, word size, method)."""
        self._check_alive()
        assert self._plans is not None
        return self._plans.save

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
        assert self._pool is not None
        n = self._bytes_per_block
        return self._pool[slot * n:(slot + 1) * n].clone()

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
        self._layout, self._num_blocks = layout, layout.num_blocks
        self._slices = offload_row_layout(layout)
        self._plans = self._build_plans(regions)
        self._token = self._src.state_token()

    def _derive_layout(self) -> tuple[PeerLayout, list[CommittedRegion]]:
        """The cache's layout now and its regions (``regions[slice.index]``: a slice's)."""
        if self._src.num_blocks <= 0:
            raise KVConnectorError("the KV cache has no committed blocks")
        regions = self._src.regions()
        return self._src.layout(regions), regions

    def _cache_regions(self, regions: list[CommittedRegion]) -> list[BlockRegion]:
        out = []
        n = self._num_blocks
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

    def _row_regions(self, rows: torch.Tensor, num_rows: int) -> list[BlockRegion]:
        """The slices of ``num_rows`` slot-major rows in ``rows`` (the pool or staging)."""
        row = self._bytes_per_block
        return [BlockRegion(rows[sl.column:num_rows * row], sl.width, row, num_rows,
                            name=f"row:{'+'.join(sl.members)}") for sl in self._slices]

    def _build_plans(self, regions: list[CommittedRegion]) -> _Plans:
        assert self._pool is not None
        cache = self._cache_regions(regions)
        pool = self._row_regions(self._pool, self._num_cpu_blocks)
        device = self._device if self.is_pinned else None
        return _Plans(BlockCopyPlan(cache, pool, device=device),
                      BlockCopyPlan(pool, cache, device=device), cache)

    def _staging(self, plans: _Plans) -> list[_Staging]:
        """The two staging buffers (allocated on first use of the staged path)."""
        if not plans.staging:
            rows = max(1, min(self._num_cpu_blocks,
                              self._max_staging_bytes // 2 // self._bytes_per_block,
                              self._staging_chunk_bytes // self._bytes_per_block))
            pool_like = [BlockRegion(r.flat, r.block_len, r.block_stride, r.num_blocks,
                                     r.sub_blocks, r.name) for r in plans.cache_regions]
            for _ in range(2):
                buf = torch.empty(rows * self._bytes_per_block, dtype=torch.uint8,
                                  device=self._device)
                staged = self._row_regions(buf, rows)
                plans.staging.append(_Staging(
                    buf, rows, BlockCopyPlan(pool_like, staged, device=self._device),
                    BlockCopyPlan(staged, pool_like, device=self._device)))
        return plans.staging

    def _refresh(self) -> None:
        self._check_alive()
        self._src.check_usable()
        if self._src.state_token() != self._token:
            self.rebind()

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
        self._refresh()
        ids = self._validate_ids(block_ids, "save")
        key_list = self._validate_keys(ids, keys)
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
        self._refresh()
        ids = self._validate_ids(block_ids, "load")
        key_list = self._validate_keys(ids, keys)
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
        ``staged`` (see the module docstring)."""
        if not self._is_cuda:
            return "host"
        if not self.is_pinned:
            return "staged"
        if self._path != "auto":
            return self._path
        runs = len(block_runs(range(len(slots)), sorted(slots)))
        return "staged" if runs <= self._max_copy_runs else "direct"

    def _copy(self, handle: OffloadHandle, *, to_cpu: bool) -> None:
        # Sort by slot so consecutive slots form runs whatever the batch order.
        order = sorted(range(len(handle.slots)), key=handle.slots.__getitem__)
        slots = [handle.slots[i] for i in order]
        ids = [handle.block_ids[i] for i in order]
        plans = self._plans
        assert plans is not None
        if not self._is_cuda:
            if to_cpu:
                plans.save.copy(ids, slots, validate=False)
            else:
                plans.load.copy(slots, ids, validate=False)
            return
        current = current_stream(self._device.index)
        compute, copy = self._stream, self._copy_stream
        # Start after the caller's queued work and after every earlier offload operation
        # (so a slot reused after eviction is never written before an earlier read of it).
        compute.wait_stream(current)
        compute.wait_stream(copy)
        copy.wait_stream(compute)
        if self.path_for(slots) == "direct":
            with use_stream(compute):
                if to_cpu:
                    plans.save.copy(ids, slots, validate=False)
                else:
                    plans.load.copy(slots, ids, validate=False)
        else:
            self._copy_staged(plans, ids, slots, to_cpu)
        compute.wait_stream(copy)
        event = torch.cuda.Event()
        event.record(compute)
        handle._event = event
        handle._device = self._device
        self._pending = [h for h in self._pending if not h.done()]
        self._pending.append(handle)

    def _copy_staged(self, plans: _Plans, ids: list[int], slots: list[int],
                     to_cpu: bool) -> None:
        """Kernel gather / scatter through two alternating device staging buffers, one
        copy-engine copy per run of consecutive slots."""
        assert self._pool is not None
        compute, copy = self._stream, self._copy_stream
        staging = self._staging(plans)
        row = self._bytes_per_block
        pool = self._pool
        step = staging[0].rows
        for k, c0 in enumerate(range(0, len(ids), step)):
            st = staging[k % 2]
            c_ids, c_slots = ids[c0:c0 + step], slots[c0:c0 + step]
            n = len(c_ids)
            positions = list(range(n))
            runs = block_runs(positions, c_slots)  # (staging row, first slot, length)
            first_user = compute if to_cpu else copy
            if st.free_event is not None:
                first_user.wait_event(st.free_event)
            ready = torch.cuda.Event()
            done = torch.cuda.Event()
            if to_cpu:
                with use_stream(compute):
                    st.gather.copy(c_ids, positions, validate=False)
                    ready.record(compute)
                copy.wait_event(ready)
                with use_stream(copy):
                    for pos, first, length in runs:
                        pool[first * row:(first + length) * row].copy_(
                            st.buffer[pos * row:(pos + length) * row], non_blocking=True)
                    done.record(copy)
            else:
                with use_stream(copy):
                    for pos, first, length in runs:
                        st.buffer[pos * row:(pos + length) * row].copy_(
                            pool[first * row:(first + length) * row], non_blocking=True)
                    ready.record(copy)
                compute.wait_event(ready)
                with use_stream(compute):
                    st.scatter.copy(positions, c_ids, validate=False)
                    done.record(compute)
            st.free_event = done

    # -- validation ------------------------------------------------------------
    def _validate_ids(self, block_ids: BlockIds, op: str) -> list[int]:
        ids = as_block_ids(block_ids, f"{op}() block_ids", allow_negative=True).tolist()
        bad = [b for b in ids if not 0 <= b < self._num_blocks]
        if bad:
            cap = self._src.capacity_blocks
            extra = f" (capacity {cap} blocks, but only committed blocks exist)" if cap else ""
            raise ValueError(
                f"{op}(): block id(s) {bad[:8]} outside the {self._num_blocks} committed blocks "
                f"(valid ids 0..{self._num_blocks - 1}){extra}"
            )
        return ids

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
            self._plans = None
            self._pool = None
            self._copy_stream = None
            self._stream = None

    def __enter__(self) -> CPUOffloadConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._slots)}/{self._num_cpu_blocks} used"
        return (f"CPUOffloadConnector({self._num_cpu_blocks} x {self._bytes_per_block} bytes, "
                f"{len(self._slices)} regions, {state})")
