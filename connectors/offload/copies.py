"""How a CPU offload batch moves between the KV cache and the pool (:mod:`..copy.block_copy`).

The pool is slot-major: slot ``s`` is bytes ``[s * bytes_per_block, (s + 1) *
bytes_per_block)``, so consecutive slots are one contiguous range. Each direction has a
:class:`~..copy.block_copy.BlockCopyPlan` built once (again on rebind), and a batch is one
launch over every region and block:

- host backend: the plan's ``torch`` method, straight between KV memory and the pool;
- CUDA, ``direct``: one kernel between KV memory and the pinned pool (unified addressing);
- CUDA, ``staged``: one kernel gathers the blocks into a device staging buffer (save) or
  scatters them from it (load), and the copy engines move one contiguous copy per run of
  consecutive slots; a batch moves in chunks of at most ``staging_chunk_bytes`` through two
  alternating staging buffers, so one chunk's copy overlaps the next chunk's kernel.

``path="auto"`` takes ``staged`` when the batch's slots form at most ``max_copy_runs`` runs
and ``direct`` otherwise (and always when the pool is not pinned: ``staged``). Kernels run
on a side stream, copy-engine copies on a second one; both first wait for the caller's
current stream and for earlier operations of the connector, and each batch ends with an
event recorded on the side stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..copy._cuda_streams import current_stream, use_stream
from ..copy.block_copy import BlockCopyPlan, BlockRegion, block_runs
from .layout import RowSlice

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
class CopyPlans:
    """The copy plans of one binding (rebuilt by :meth:`PoolCopies.bind`)."""

    save: BlockCopyPlan  # cache -> pool
    load: BlockCopyPlan  # pool -> cache
    cache_regions: list[BlockRegion]
    staging: list[_Staging] = field(default_factory=list)


class PoolCopies:
    """The copies between a KV cache and the CPU ``pool`` (rows of ``bytes_per_block``):
    the plans of the binding (:meth:`bind`), the staging buffers, on CUDA the two streams;
    owns the pool. Settings as :class:`~.connector.CPUOffloadConnector` takes them."""

    def __init__(self, pool: torch.Tensor, bytes_per_block: int, device: torch.device, *,
                 path: str, max_copy_runs: int, max_staging_bytes: int,
                 staging_chunk_bytes: int) -> None:
        self.pool: torch.Tensor | None = pool
        self._row = bytes_per_block
        self._num_rows = pool.numel() // bytes_per_block
        self._device = device
        self._is_cuda = device.type == "cuda"
        self._path, self._max_copy_runs = path, max_copy_runs
        self._max_staging_bytes, self._staging_chunk_bytes = max_staging_bytes, staging_chunk_bytes
        self._slices: list[RowSlice] = []
        self.plans: CopyPlans | None = None
        #: kernels run on the first, copy-engine copies on the second
        self._stream: Any = torch.cuda.Stream(device=device) if self._is_cuda else None
        self._copy_stream: Any = torch.cuda.Stream(device=device) if self._is_cuda else None

    @property
    def pinned(self) -> bool:
        return self.pool is not None and self.pool.is_pinned()

    def bind(self, cache: list[BlockRegion], slices: list[RowSlice]) -> None:
        """Build the plans between the cache's ``cache`` regions (``slices[i]``'s region
        ``cache[i]``) and the pool's rows."""
        assert self.pool is not None
        self._slices = slices
        pool = self._row_regions(self.pool, self._num_rows)
        device = self._device if self.pinned else None
        self.plans = CopyPlans(BlockCopyPlan(cache, pool, device=device),
                               BlockCopyPlan(pool, cache, device=device), cache)

    def _row_regions(self, rows: torch.Tensor, num_rows: int) -> list[BlockRegion]:
        """The slices of ``num_rows`` slot-major rows in ``rows`` (the pool or staging)."""
        row = self._row
        return [BlockRegion(rows[sl.column:num_rows * row], sl.width, row, num_rows,
                            name=f"row:{'+'.join(sl.members)}") for sl in self._slices]

    def _staging(self, plans: CopyPlans) -> list[_Staging]:
        """The two staging buffers (allocated on first use of the staged path)."""
        if not plans.staging:
            rows = max(1, min(self._num_rows, self._max_staging_bytes // 2 // self._row,
                              self._staging_chunk_bytes // self._row))
            cache = plans.cache_regions
            for _ in range(2):
                buf = torch.empty(rows * self._row, dtype=torch.uint8, device=self._device)
                staged = self._row_regions(buf, rows)
                plans.staging.append(_Staging(
                    buf, rows, BlockCopyPlan(cache, staged, device=self._device),
                    BlockCopyPlan(staged, cache, device=self._device)))
        return plans.staging

    def path_for(self, slots: Sequence[int]) -> str:
        """The path a batch into / out of ``slots`` takes: ``host``, ``direct`` or
        ``staged`` (see the module docstring)."""
        if not self._is_cuda:
            return "host"
        if not self.pinned:
            return "staged"
        if self._path != "auto":
            return self._path
        runs = len(block_runs(range(len(slots)), sorted(slots)))
        return "staged" if runs <= self._max_copy_runs else "direct"

    def copy(self, block_ids: Sequence[int], slots: Sequence[int], *,
             to_cpu: bool) -> torch.cuda.Event | None:
        """Copy blocks ``block_ids`` to (``to_cpu``) or from pool ``slots`` (pairwise); on
        CUDA returns the event that marks the end of the batch, None on the host."""
        # Sort by slot so consecutive slots form runs whatever the batch order.
        order = sorted(range(len(slots)), key=slots.__getitem__)
        slot_list = [slots[i] for i in order]
        ids = [block_ids[i] for i in order]
        plans = self.plans
        assert plans is not None
        plan, src, dst = (plans.save, ids, slot_list) if to_cpu else (plans.load, slot_list, ids)
        if not self._is_cuda:
            plan.copy(src, dst, validate=False)
            return None
        current = current_stream(self._device.index)
        compute, copy = self._stream, self._copy_stream
        # Start after the caller's queued work and after every earlier offload operation
        # (so a slot reused after eviction is never written before an earlier read of it).
        compute.wait_stream(current)
        compute.wait_stream(copy)
        copy.wait_stream(compute)
        if self.path_for(slot_list) == "direct":
            with use_stream(compute):
                plan.copy(src, dst, validate=False)
        else:
            self._copy_staged(plans, ids, slot_list, to_cpu)
        compute.wait_stream(copy)
        event = torch.cuda.Event()
        event.record(compute)
        return event

    def _copy_staged(self, plans: CopyPlans, ids: list[int], slots: list[int],
                     to_cpu: bool) -> None:
        """Kernel gather / scatter through two alternating device staging buffers, one
        copy-engine copy per run of consecutive slots."""
        assert self.pool is not None
        compute, copy = self._stream, self._copy_stream
        staging = self._staging(plans)
        row = self._row
        pool = self.pool
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

    def close(self) -> None:
        """Drop the pool, the staging buffers, the plans and the streams."""
        self.plans = None
        self.pool = None
        self._copy_stream = None
        self._stream = None
