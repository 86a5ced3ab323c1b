"""ExtensibleTensor: a reserved virtual range whose segments commit a growing prefix.

Units are bytes throughout. A tensor of ``capacity_bytes`` is split into ``num_segments``
equal segments (segment ``i`` starts at ``base_ptr + i * segment_capacity``); each segment
commits a prefix that only grows. Pointers never move across commit, release and recommit.

Typical life (the extensible KV cache's protocol)::

    t = ExtensibleTensor(capacity, "cuda:0", num_segments=2,
                         options=AllocationOptions(shareable=True))
    t.commit(one_block)            # before warm-up / graph capture
    t.commit(warmup_prefix)
    t.commit(final_size, single_handle=True)   # one physical allocation per segment
                                               # (UCX, ucx #11283), warm-up chunks released
    ... register with a connector ...
    t.release_physical(); t.recommit()   # sleep / wake (zeroed pages, same addresses)
    t.close()                      # refused while views are referenced (LiveViewsError)

Every view this tensor hands out is tracked (weakly): :meth:`close` refuses while one is
referenced, and ``close(force=True)`` (what leaving a ``with`` block does) releases the
physical memory at once but keeps the address range reserved until the last view is gone,
so a stale view faults instead of reaching whatever is mapped there next.

Threads: one lock per tensor serializes every call that changes or reads its mapped state
(commit, shrink, release, recommit, views, export, close, ``committed_bytes``), so
concurrent callers see one commit after another, never chunks mapped over each other. The
bytes behind views are not guarded: writing them is the caller's business, as with any
tensor.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .checks import checked_int, round_up
from .errors import KvconnectError
from .lifetime import Closeable, LiveViewsError
from .mapped_memory import MappedChunk, MappedMemory
from .undo import UndoStack
from .vmm import AllocationOptions, GrantedFlags, Reservation, VmmDriver, probe_vmm

logger = logging.getLogger(__name__)

#: commits never go below this granule, whatever the driver reports
MIN_COMMIT_GRANULE = 2 * 1024 * 1024


class VmmUnavailableError(KvconnectError, RuntimeError):
    """No VMM backend works for the requested device (the message says why)."""


@dataclass(frozen=True)
class Chunk:
    """One physical allocation mapped into a segment. ``va`` and ``size`` in bytes."""

    segment: int
    va: int
    size: int
    #: byte offset of the chunk from the start of its segment
    offset: int


@dataclass(frozen=True)
class ExportedChunk:
    """A chunk exported as a POSIX fd; the fd belongs to whoever received this record."""

    segment: int
    offset: int
    size: int
    fd: int


@dataclass
class _State(MappedMemory):
    """What an ExtensibleTensor must release (owned by its finalizer), with its lock."""

    #: grows on every call that may change the mapped state (ExtensibleTensor.state_version)
    version: int = 0
    #: serializes the tensor's calls (see the module docstring); re-entrant
    lock: threading.RLock = field(default_factory=threading.RLock)


_F = TypeVar("_F", bound=Callable[..., Any])


def _locked(changes_mapping: bool) -> Callable[[_F], _F]:
    """Run the method holding its tensor's lock (one caller at a time per tensor); with
    ``changes_mapping``, :attr:`ExtensibleTensor.state_version` grows when it returns or
    raises (it may have mapped or unmapped memory either way)."""
    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def locked(self: ExtensibleTensor, *args: Any, **kwargs: Any) -> Any:
            with self._state.lock:
                try:
                    return method(self, *args, **kwargs)
                finally:
                    if changes_mapping:
                        self._state.version += 1

        return locked  # type: ignore[return-value]

    return decorate


_serialized, _changes_mapping = _locked(False), _locked(True)


def _resolve_driver(device: object) -> VmmDriver:
    if isinstance(device, VmmDriver):
        return device
    probe = probe_vmm(device)
    if probe.driver is None:
        raise VmmUnavailableError(
            f"no VMM backend for device {device!r}: {probe.reason}. "
            "Use ordinary allocation (torch.empty) for this device instead."
        )
    return probe.driver


class ExtensibleTensor(Closeable):
    """A VA reservation of ``capacity_bytes`` in ``num_segments`` equal segments, each
    committing a grow-only prefix of physical memory.

    ``options`` (:class:`~kvconnect.vmm.AllocationOptions`) says what the physical memory is
    requested with: ``shareable`` for POSIX-FD exportable allocations (CUDA IPC,
    :meth:`export_handles`), ``rdma_capable`` for GPUDirect-RDMA-capable ones. Flags the
    device cannot grant are dropped with a warning; :attr:`granted` says what every chunk really has.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: object = "cpu",
        *,
        num_segments: int = 1,
        options: AllocationOptions | None = None,
    ) -> None:
        capacity_bytes = checked_int("capacity_bytes", capacity_bytes)
        num_segments = checked_int("num_segments", num_segments, maximum=capacity_bytes)
        options = AllocationOptions.resolve(options)
        driver = _resolve_driver(device)
        granule = self.commit_granule(driver, options)
        if capacity_bytes % num_segments:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} does not split into {num_segments} equal segments"
            )
        seg_cap = capacity_bytes // num_segments
        if seg_cap % granule:
            good = round_up(seg_cap, granule) * num_segments
            raise ValueError(
                f"segment capacity {seg_cap} bytes is not a multiple of the commit granule "
                f"{granule} bytes; round capacity_bytes up to {good} (a multiple of "
                f"num_segments * granule = {num_segments * granule})"
            )
        self._options = options
        self._granule = granule
        self._num_segments = num_segments
        self._segment_capacity = seg_cap
        self._committed = [0] * num_segments
        self._released_sizes: list[int] | None = None
        reservation = Reservation(driver, capacity_bytes, alignment=granule)
        self._base_ptr, self._capacity_bytes = reservation.va, capacity_bytes
        self._state = _State(driver, reservation, [[] for _ in range(num_segments)])
        self._finalizer = weakref.finalize(self, _State.close, self._state)

    # -- static helpers --------------------------------------------------------
    @staticmethod
    def commit_granule(device: object = "cpu", options: AllocationOptions | None = None) -> int:
        """Bytes every commit rounds up to: max(driver granularity for ``options``, 2 MiB)."""
        options = AllocationOptions.resolve(options)
        return max(_resolve_driver(device).granularity(options), MIN_COMMIT_GRANULE)

    # -- properties ------------------------------------------------------------
    @property
    def driver(self) -> VmmDriver:
        return self._state.driver

    @property
    def device(self) -> torch.device:
        return torch.device(self.driver.torch_device)

    @property
    def base_ptr(self) -> int:
        """Start of the reservation (bytes address); never changes."""
        return self._base_ptr

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def segment_capacity(self) -> int:
        return self._segment_capacity

    @property
    def num_segments(self) -> int:
        return self._num_segments

    @property
    def granule(self) -> int:
        return self._granule

    @property
    def committed_bytes(self) -> tuple[int, ...]:
        """Bytes physically committed per segment (granule-rounded). 0 while released."""
        with self._state.lock:
            return tuple(self._committed)

    @property
    def num_physical_chunks(self) -> int:
        return sum(len(seg) for seg in self._state.chunks)

    @property
    def state_version(self) -> int:
        """A counter that grows on every call that may change the mapped state (commit,
        shrink_to, release_physical, recommit, recommit_single_handle, close): an unchanged
        value means :attr:`committed_bytes` and the chunks are as they were. Read without the
        lock (one int), so a connector can check it per transfer; a changed value says only
        *may* have changed (a sleep / wake brings the same sizes back)."""
        return self._state.version

    @property
    def granted(self) -> GrantedFlags:
        """Flags held by every mapped chunk (requested flags when nothing is mapped yet)."""
        handles = [m.handle for seg in self._state.chunks for m in seg]
        if not handles:
            return GrantedFlags(self._options.shareable, self._options.rdma_capable)
        return GrantedFlags(
            shareable=all(h.granted.shareable for h in handles),
            rdma_capable=all(h.granted.rdma_capable for h in handles),
        )

    @property
    def options(self) -> AllocationOptions:
        """What the physical memory is requested with (see :attr:`granted` for what it has)."""
        return self._options

    @property
    def is_released(self) -> bool:
        return self._released_sizes is not None

    @property
    def is_closed(self) -> bool:
        return self._state.closed

    @property
    def live_views(self) -> int:
        """How many views handed out by this tensor (and tensors derived from them) are
        still referenced somewhere; :meth:`close` refuses while this is not 0."""
        return len(self._state.views)

    def segment_base(self, segment: int) -> int:
        """Address of segment ``segment``'s first byte (RuntimeError after :meth:`close`)."""
        self._check_alive()
        self._check_segment(segment)
        return self.base_ptr + segment * self._segment_capacity

    @_serialized
    def physical_chunks(self) -> list[Chunk]:
        """Every physical allocation now mapped, in address order."""
        self._check_alive()
        out: list[Chunk] = []
        for s, seg in enumerate(self._state.chunks):
            start = self.segment_base(s)
            out.extend(Chunk(s, m.va, m.size, m.va - start) for m in seg)
        return out

    # -- growth ----------------------------------------------------------------
    @_changes_mapping
    def commit(self, bytes_per_segment: int, *, single_handle: bool = False) -> None:
        """Grow every segment's committed prefix to at least ``bytes_per_segment`` bytes.

        Rounds up to the granule; never shrinks (a smaller request is a no-op). Raises
        ValueError past the segment capacity. On failure nothing new stays mapped.

        ``single_handle=True`` is the final commit before connector registration: each
        segment's earlier (warm-up) chunks are released and the whole prefix is committed as
        ONE physical allocation, contents discarded. This is :meth:`recommit_single_handle`
        fused with the growth, and much cheaper on CUDA: the driver scrubs memory a process
        has just freed, so committing 100 GiB and then re-creating it costs ~300 ms, while
        freeing the small warm-up chunks and creating the final size once costs a few ms
        (benchmarks/results/commit-h200.md). If it fails after the release, the tensor is
        left *released* with the target sizes remembered: :meth:`recommit` retries.
        """
        self._check_alive()
        bytes_per_segment = checked_int("bytes_per_segment", bytes_per_segment)
        if self.is_released:
            raise RuntimeError("commit() while physical memory is released: call recommit() first")
        if bytes_per_segment > self._segment_capacity:
            raise ValueError(
                f"cannot commit {bytes_per_segment} bytes per segment: the segment capacity is "
                f"{self._segment_capacity} bytes (capacity_bytes {self.capacity_bytes} over "
                f"{self._num_segments} segments)"
            )
        target = round_up(bytes_per_segment, self._granule)
        if single_handle:
            self._rebuild_single([max(target, c) for c in self._committed], zero=False)
            return
        grown = []
        with UndoStack() as undo:
            for s in range(self._num_segments):
                have = self._committed[s]
                if target > have:
                    m = self._map_new(self.segment_base(s) + have, target - have)
                    self._state.chunks[s].append(m)
                    undo.push(self._drop_chunk, s, m)
                    grown.append(s)
        for s in grown:
            self._committed[s] = target

    def _rebuild_single(self, sizes: list[int], *, zero: bool) -> None:
        """Back each segment with ONE allocation of ``sizes[s]`` bytes, releasing its chunks
        first; segments already single and at that size are left alone (contents kept)."""
        chunks = self._state.chunks
        todo = [s for s in range(self._num_segments)
                if sizes[s] > self._committed[s] or len(chunks[s]) > 1]
        if not todo:
            return
        self.driver.synchronize()
        for s in todo:
            while chunks[s]:
                self._unmap_one(chunks[s].pop())
            self._committed[s] = 0
        self._commit_single(sizes, zero=zero)

    def _map_new(self, va: int, size: int) -> MappedChunk:
        handle = self.driver.create(size, self.driver.device_index, self._options)
        return self._state.map(va, size, handle)

    def _unmap_one(self, m: MappedChunk) -> None:
        self.driver.unmap_and_release(m.va, m.size, m.handle)

    def _drop_chunk(self, segment: int, m: MappedChunk) -> None:
        self._state.chunks[segment].remove(m)
        self._unmap_one(m)

    @_changes_mapping
    def shrink_to(self, bytes_per_segment: Sequence[int]) -> None:
        """Undo later commits: unmap and release each segment's chunks that start at or past
        ``bytes_per_segment[s]`` (a size this tensor had earlier, in ``[0, segment_capacity]``;
        anything else raises ValueError before anything is released). A chunk straddling
        that size cannot be split and stays whole. Used to roll back a commit spread over
        several tensors that failed part-way."""
        self._check_alive()
        if isinstance(bytes_per_segment, (str, bytes)) or not isinstance(bytes_per_segment,
                                                                         Sequence):
            raise ValueError(f"shrink_to takes one size per segment, got {bytes_per_segment!r}")
        if len(bytes_per_segment) != self._num_segments:
            raise ValueError(f"need {self._num_segments} sizes, got {len(bytes_per_segment)}")
        bytes_per_segment = [checked_int(f"shrink_to size of segment {s}", n, minimum=0,
                                         maximum=self._segment_capacity)
                             for s, n in enumerate(bytes_per_segment)]
        if tuple(bytes_per_segment) == self.committed_bytes:
            return
        self.driver.synchronize()
        for s, keep in enumerate(bytes_per_segment):
            seg_base = self.segment_base(s)
            chunks = self._state.chunks[s]
            while chunks and chunks[-1].va - seg_base >= keep:
                self._unmap_one(chunks.pop())
            self._committed[s] = chunks[-1].va + chunks[-1].size - seg_base if chunks else 0

    # -- sleep / wake / single handle -----------------------------------------
    @_changes_mapping
    def release_physical(self) -> None:
        """Synchronize, unmap and release every chunk; keep the VA reservation.

        Touching the memory afterwards faults. :meth:`recommit` brings the same sizes back.
        """
        self._check_alive()
        if self.is_released:
            return
        sizes = list(self._committed)
        self._state.unmap_all()
        self._committed = [0] * self._num_segments
        self._released_sizes = sizes

    @_changes_mapping
    def recommit(self) -> None:
        """Commit the sizes held before :meth:`release_physical`, zero-filled, at the same
        addresses, as one physical allocation per segment."""
        self._check_alive()
        if self._released_sizes is None:
            raise RuntimeError("recommit() without a preceding release_physical()")
        sizes, self._released_sizes = self._released_sizes, None
        self._commit_single(sizes, zero=True)

    @_changes_mapping
    def recommit_single_handle(self, *, zero: bool = False) -> None:
        """Release the chunks of each segment and recommit its prefix as ONE physical
        allocation (UCX exports only the first handle of a multi-handle region, ucx #11283).

        Contents are discarded: at this point they are only warm-up garbage. The new memory
        is undefined on GPUs unless ``zero`` (the host backend always gives zeros). Segments
        already backed by a single allocation are left as they are, contents included.
        """
        self._check_alive()
        if self.is_released:
            raise RuntimeError("recommit_single_handle() while released: call recommit()")
        self._rebuild_single(list(self._committed), zero=zero)

    def _commit_single(self, sizes: list[int], *, zero: bool) -> None:
        """Map ``sizes[s]`` bytes as one allocation at each segment that has none mapped.

        On failure everything is released and the tensor is left *released* with the full
        sizes remembered, so a later :meth:`recommit` can retry.
        """
        try:
            for s, size in enumerate(sizes):
                if size == 0 or self._state.chunks[s]:
                    continue
                m = self._map_new(self.segment_base(s), size)
                self._state.chunks[s].append(m)
                self._committed[s] = size
                if zero and not self.driver.creates_zeroed_memory:
                    self.driver.memset(m.va, 0, size)
        except BaseException:
            full = [max(a, b) for a, b in zip(sizes, self._committed, strict=True)]
            self._state.unmap_all()
            self._committed = [0] * self._num_segments
            self._released_sizes = full
            raise

    # -- views -----------------------------------------------------------------
    @_serialized
    def segment_view(self, segment: int) -> torch.Tensor:
        """uint8 tensor over exactly the committed prefix of ``segment``."""
        self._check_alive()
        self._check_segment(segment)
        n = self._committed[segment]
        if n == 0:
            raise ValueError(f"segment {segment} has no committed memory")
        return self._state.view(self, self.segment_base(segment), n)

    @_serialized
    def committed_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor of ``nbytes`` at ``base_ptr + offset``; its storage is exactly that
        size. The range must lie inside one segment's committed prefix (else ValueError)."""
        self._check_alive()
        checked_int("view offset in bytes", offset, minimum=0)
        checked_int("view size in bytes", nbytes)
        seg, inner = divmod(offset, self._segment_capacity)
        if seg >= self._num_segments or inner + nbytes > self._committed[seg]:
            where = f"segment {seg}" if seg < self._num_segments else "past the reservation"
            have = self._committed[seg] if seg < self._num_segments else 0
            raise ValueError(
                f"view [{offset}, {offset + nbytes}) is not inside committed memory: {where} has "
                f"{have} committed bytes from offset {seg * self._segment_capacity}"
            )
        return self._state.view(self, self.base_ptr + offset, nbytes)

    @_serialized
    def full_view(self) -> torch.Tensor:
        """uint8 tensor over the WHOLE reservation; pointer-stable (what CUDA graphs capture).

        Unsafe past the committed prefixes: touching uncommitted bytes faults.
        """
        self._check_alive()
        return self._state.view(self, self.base_ptr, self.capacity_bytes)

    # -- sharing ---------------------------------------------------------------
    @_serialized
    def export_handles(self) -> list[ExportedChunk]:
        """Export every chunk as a POSIX fd (caller owns and must close the fds)."""
        self._check_alive()
        if not self.granted.shareable or not self._options.shareable:
            raise RuntimeError(
                "export_handles() needs shareable allocations: create the ExtensibleTensor with "
                f"options=AllocationOptions(shareable=True) (granted here: {self.granted})"
            )
        out: list[ExportedChunk] = []
        with UndoStack() as undo:
            for s, seg in enumerate(self._state.chunks):
                start = self.segment_base(s)
                for m in seg:
                    fd = self.driver.export_fd(m.handle)
                    undo.push(os.close, fd)
                    out.append(ExportedChunk(s, m.va - start, m.size, fd))
        return out

    # -- lifetime --------------------------------------------------------------
    @_changes_mapping
    def close(self, *, force: bool = False) -> None:
        """Unmap and release every chunk and free the reservation. Idempotent.

        Refused with :class:`LiveViewsError` (nothing released) while views handed out by
        :meth:`segment_view`, :meth:`committed_view` or :meth:`full_view` (or tensors
        derived from them) are still referenced: drop them first. ``force=True`` releases
        the physical memory anyway and keeps only the address range reserved until the last
        view is gone, so touching a stale view faults (SIGSEGV on the host, an illegal
        address on a GPU) rather than reading or writing a later allocation.
        """
        if self._state.closed:
            return
        live = self.live_views
        if live and not force:
            raise LiveViewsError("ExtensibleTensor", live,
                                 "segment_view/committed_view/full_view")
        self._finalizer()

    def _check_alive(self) -> None:
        if self._state.closed:
            raise RuntimeError("ExtensibleTensor used after close()")

    def _check_segment(self, segment: object) -> None:
        """TypeError unless ``segment`` is an ``int`` (not a bool: ``True`` is no index),
        IndexError unless it is in range."""
        if isinstance(segment, bool) or not isinstance(segment, int):
            raise TypeError(f"segment must be an int in [0, {self._num_segments}), got "
                            f"{type(segment).__name__} {segment!r:.40}")
        if not 0 <= segment < self._num_segments:
            raise IndexError(f"segment {segment} out of range (tensor has {self._num_segments})")

    def __repr__(self) -> str:
        state = "closed" if self.is_closed else ("released" if self.is_released else "live")
        return (f"ExtensibleTensor({self.driver.name}:{self.driver.device_index}, capacity="
                f"{self.capacity_bytes}, segments={self._num_segments}, committed="
                f"{list(self._committed)}, chunks={self.num_physical_chunks}, {state})")
