"""CPU offload of KV blocks, with geometry taken from committed extents only.

:class:`CPUOffloadConnector` copies whole logical KV blocks between an
:class:`~kvconnect.kv_cache.ExtensibleKVCache` and a CPU pool (pinned on CUDA), keyed by a
hashable key per block (default: the block id), with LRU eviction.

Geometry. One CPU block ("row") holds every committed region's page of one logical block,
side by side: ``bytes_per_block = sum(sub_blocks * region.block_len)`` over the cache's
``committed_regions()`` (K and V separately for split layouts; a layer's summed states for
Mamba; the bounded block-stride row for packed layouts). Each region is read through an
``as_strided`` view of shape ``(num_blocks, sub_blocks, block_len)`` laid over a **bounded**
``committed_view`` of its ExtensibleTensor, so no view can reach uncommitted memory. Nothing
here looks at ``untyped_storage().nbytes()``: upstream's ``storage.nbytes() // num_blocks``
row geometry is exactly what faults on an over-reserved cache (see tests/test_cpu_offload.py).

Pool and copies. The pool is one buffer of ``num_cpu_blocks * bytes_per_block`` bytes, laid
out group-major: the regions are split into at most :data:`MAX_COPY_GROUPS` groups of about
equal width, and group ``g`` owns a ``(num_cpu_blocks, group_width)`` sub-pool, so consecutive
slots of one group are one contiguous range. Copies are batched: per call and group, one
``index_select`` (save) / ``index_copy_`` (load) per region into / out of a device staging
buffer, plus one copy-engine copy per run of consecutive slots; a batch whose slots form more
than ``max_copy_runs`` runs instead moves with one ``index_copy_`` / ``index_select`` per group
over the pinned pool's unified-address alias. Never one copy per block per layer. On CUDA the
gathers / scatters run on a side stream and the copy-engine copies on a second one, so group
``g``'s transfer overlaps group ``g + 1``'s kernels; both streams first wait for the caller's
current stream and for earlier operations of the connector, and the returned
:class:`OffloadHandle` holds an event. On the host backend copies are synchronous and go
straight between the KV memory and the pool when the slots form one run.

Ordering contract (CUDA): do not overwrite GPU blocks passed to :meth:`save` before its handle
is done; do not read blocks passed to :meth:`load` before ``handle.wait()`` (or
``handle.wait_on_stream()``). Operations of one connector run in issue order, so a slot
reused after eviction is never written before an earlier load from it has read it.

Sleep / wake and growth. The connector's views are bounded to committed extents, so before
every operation it compares a cheap state token of the cache (block count, committed bytes
and physical chunk count per tensor) with the one its views were built from, and calls
:meth:`CPUOffloadConnector.rebind` when it differs: after ``ensure_kv_cache_blocks`` /
``extend_kv_cache`` (more blocks; a single-handle recommit) the views are re-derived from
``committed_regions()``. A sleep / wake cycle (``release_physical()`` + ``recommit()``) brings
the same sizes back at the same addresses, so the views stay valid as they are; call
``rebind()`` to re-derive them anyway. While the cache is asleep, ``save`` / ``load`` raise
:class:`KVConnectorError`; the CPU pool and its keys survive sleep, so blocks saved before
sleep can be loaded back after wake. Call :meth:`CPUOffloadConnector.wait` before
``release_physical()`` (the CUDA driver synchronizes the device before unmapping anyway).
The layout (layers, parts, block lengths) is fixed for a connector's life: ``rebind`` raises
if it changes.
"""

from __future__ import annotations

import heapq
import logging
import operator
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvconnect.views import CommittedRegion

from .copy_ops import WORD_DTYPES, block_row_view, contiguous_runs, word_size
from .errors import KVConnectorError, KVTransferError

logger = logging.getLogger(__name__)

__all__ = [
    "CPUOffloadConnector",
    "OffloadHandle",
    "OffloadKeyError",
    "RowSlice",
    "offload_row_layout",
]

#: default bound on the device staging buffer of one copy batch (bytes)
DEFAULT_MAX_STAGING_BYTES = 256 * 1024 * 1024
#: on CUDA, batches whose pool slots form more runs than this use one gather kernel over the
#: pinned pool (unified addressing) instead of one copy-engine copy per run
DEFAULT_MAX_COPY_RUNS = 8
_PEER_NAME = "cpu-offload"


class OffloadKeyError(KVConnectorError):
    """``load`` asked for keys that are not in the CPU pool (never saved, or evicted)."""

    def __init__(self, missing: Sequence[Hashable]) -> None:
        self.missing = list(missing)
        shown = ", ".join(repr(k) for k in self.missing[:16])
        more = f", ... ({len(self.missing)} keys)" if len(self.missing) > 16 else ""
        super().__init__(
            f"{len(self.missing)} key(s) not in the CPU offload pool (never saved or evicted): "
            f"[{shown}{more}]; check contains(key) before load()"
        )


@dataclass(frozen=True)
class RowSlice:
    """Where one committed region's page of a logical block sits inside a CPU row (bytes).

    ``sub_blocks`` kernel blocks of ``block_len`` bytes, ``block_stride`` apart, form one
    logical block of the region; they occupy ``[column, column + width)`` of the CPU row.
    ``members`` names every ``layer/part`` whose bytes the slice covers (several when layers
    share a KV tensor, as attention and Mamba layers do in hybrid models).
    """

    layer_name: str
    part: str
    tensor_index: int
    segment: int
    block_len: int
    block_stride: int
    sub_blocks: int
    column: int
    members: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        """Bytes of this region per logical block: ``sub_blocks * block_len``."""
        return self.sub_blocks * self.block_len

    @property
    def signature(self) -> tuple[object, ...]:
        """What must stay the same for saved rows to remain loadable."""
        return (self.members, self.block_len, self.sub_blocks)


def offload_row_layout(
    regions: Sequence[CommittedRegion], num_blocks: int
) -> tuple[list[RowSlice], list[CommittedRegion]]:
    """The CPU row layout for ``regions`` of a cache with ``num_blocks`` logical blocks.

    Returns the row slices and the region each one reads (same order). Regions that overlap
    (layers sharing one KV tensor: hybrid attention + Mamba) are merged into one region
    covering their union, so shared bytes are stored once; this needs the same tensor,
    segment, block stride and block count, else ``ValueError``. The row size
    (``bytes_per_block``) is the sum of the slices' widths. A region with ``k * num_blocks``
    blocks (kernel block = logical block / k) gives ``sub_blocks = k``. Raises ``ValueError``
    for an empty region list or a block count that is not a multiple of ``num_blocks``.
    """
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if not regions:
        raise ValueError("the cache reports no committed regions: nothing to offload")
    for r in regions:
        if r.block_len <= 0 or r.block_stride < r.block_len:
            raise ValueError(
                f"region {r.layer_name}/{r.part}: block_len {r.block_len} and block_stride "
                f"{r.block_stride} bytes do not describe disjoint blocks"
            )
        if r.num_blocks <= 0 or r.num_blocks % num_blocks:
            raise ValueError(
                f"region {r.layer_name}/{r.part} has {r.num_blocks} committed blocks, not a "
                f"multiple of the cache's {num_blocks} logical blocks"
            )
    # Merge overlapping regions (per block) into their union; keep first-appearance order.
    merged: list[tuple[int, CommittedRegion, list[str]]] = []  # (first index, region, members)
    for i, r in enumerate(regions):
        name = f"{r.layer_name}/{r.part}"
        lo, hi = r.base_ptr, r.base_ptr + r.block_len
        hit = None
        for j, (_, m, members) in enumerate(merged):
            if m.base_ptr < hi and lo < m.base_ptr + m.block_len:
                if (m.tensor_index, m.segment, m.block_stride, m.num_blocks) != (
                        r.tensor_index, r.segment, r.block_stride, r.num_blocks):
                    raise ValueError(
                        f"regions {members[0]} and {name} overlap but differ in tensor, "
                        "segment, block stride or block count; cannot offload them as one"
                    )
                hit = j
                break
        if hit is None:
            merged.append((i, r, [name]))
            continue
        first, m, members = merged.pop(hit)
        start = min(m.base_ptr, lo)
        end = max(m.base_ptr + m.block_len, hi)
        union = replace(m, base_ptr=start, block_len=end - start,
                        layers=tuple(dict.fromkeys(m.layers + r.layers)),
                        segment_offset=m.segment_offset - (m.base_ptr - start))
        if end - start > m.block_stride:
            raise ValueError(f"regions {members[0]} and {name} span more than one block stride")
        merged.insert(hit, (first, union, [*members, name]))
    slices: list[RowSlice] = []
    kept: list[CommittedRegion] = []
    column = 0
    for _, r, members in merged:
        sub = r.num_blocks // num_blocks
        slices.append(RowSlice(r.layer_name, r.part, r.tensor_index, r.segment, r.block_len,
                               r.block_stride, sub, column, tuple(members)))
        kept.append(r)
        column += sub * r.block_len
    return slices, kept


@dataclass
class OffloadHandle:
    """One save or load. ``slots[i]`` is the pool slot of ``keys[i]`` / ``block_ids[i]``.

    ``evicted`` lists the keys a save pushed out of the pool to make room (oldest first).
    ``nbytes`` is the payload moved (blocks x bytes per block). On the host backend a handle
    is done when returned.
    """

    op: str
    block_ids: tuple[int, ...]
    keys: tuple[Hashable, ...]
    slots: tuple[int, ...]
    nbytes: int
    evicted: tuple[Hashable, ...] = ()
    _event: Any = None
    _device: Any = None
    _keepalive: list[Any] = field(default_factory=list, repr=False)

    def done(self) -> bool:
        """True once the copies have finished (never blocks)."""
        if self._event is None:
            return True
        if self._event.query():
            self._release()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; with ``timeout_s``, raise :class:`KVTransferError` past it."""
        if self._event is None:
            return
        if timeout_s is None:
            try:
                self._event.synchronize()
            except RuntimeError as exc:
                raise KVTransferError(_PEER_NAME, self.block_ids, exc) from exc
            self._release()
            return
        deadline = time.monotonic() + timeout_s
        pause = 1e-4
        while not self.done():
            if time.monotonic() >= deadline:
                raise KVTransferError(
                    _PEER_NAME, self.block_ids,
                    f"{self.op} of {len(self.block_ids)} blocks not done after {timeout_s} s",
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-2)

    def wait_on_stream(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for this handle without
        blocking the host. No-op on the host backend."""
        if self._event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        stream.wait_event(self._event)

    def _release(self) -> None:
        self._keepalive.clear()


class _CudaArrayInterface:
    """``__cuda_array_interface__`` over pinned host memory (UVA alias); keeps ``owner``."""

    def __init__(self, ptr: int, shape: tuple[int, ...], owner: torch.Tensor) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


def _as_block_ids(block_ids: Iterable[int] | torch.Tensor, what: str) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.is_floating_point() or block_ids.is_complex():
            raise TypeError(f"{what} must be a 1-D integer tensor, got {block_ids.dtype} "
                            f"of shape {tuple(block_ids.shape)}")
        return [int(b) for b in block_ids.tolist()]
    out = []
    for b in block_ids:
        if isinstance(b, bool):
            raise TypeError(f"{what} must hold ints, got a bool ({b})")
        try:
            out.append(operator.index(b))
        except TypeError:
            raise TypeError(f"{what} must hold ints, got {type(b).__name__} {b!r}") from None
    return out


#: regions are copied in up to this many groups, so one group's copy-engine transfer
#: overlaps the next group's gather kernels
MAX_COPY_GROUPS = 8


@dataclass(frozen=True)
class _Group:
    """Consecutive row slices ``[first, last)`` copied together; bytes ``[column, column +
    width)`` of a row."""

    first: int
    last: int
    column: int
    width: int


def _make_groups(slices: Sequence[RowSlice], max_groups: int = MAX_COPY_GROUPS) -> list[_Group]:
    """Split the row into at most ``max_groups`` runs of slices of about equal width."""
    total = sum(s.width for s in slices)
    target = -(-total // min(max_groups, len(slices)))
    groups: list[_Group] = []
    first, width = 0, 0
    for i, sl in enumerate(slices):
        width += sl.width
        if width >= target or i == len(slices) - 1:
            groups.append(_Group(first, i + 1, slices[first].column, width))
            first, width = i + 1, 0
    return groups


class _CacheSource:
    """Geometry and bounded views from an ExtensibleKVCache (re-derived on state changes)."""

    def __init__(self, cache: Any) -> None:
        for attr in ("committed_regions", "num_blocks", "tensors"):
            if not hasattr(cache, attr):
                raise TypeError(
                    f"cache must be an ExtensibleKVCache (no {attr!r} on "
                    f"{type(cache).__name__}); for ordinary tensors use "
                    "CPUOffloadConnector.from_kv_caches()"
                )
        self.cache = cache
        self.capacity_blocks: int | None = getattr(cache, "capacity_blocks", None)

    @property
    def num_blocks(self) -> int:
        return int(self.cache.num_blocks)

    def regions(self) -> list[CommittedRegion]:
        return list(self.cache.committed_regions())

    def flat_view(self, r: CommittedRegion, span: int) -> torch.Tensor:
        tensors = self.cache.tensors
        if not 0 <= r.tensor_index < len(tensors):
            raise KVConnectorError(
                f"region {r.layer_name}/{r.part} names tensor {r.tensor_index}, but the cache "
                f"has {len(tensors)} tensors"
            )
        t = tensors[r.tensor_index]
        # committed_view raises unless the whole span is committed memory of one segment
        return t.committed_view(r.base_ptr - t.base_ptr, span)

    def state_token(self) -> object:
        return (self.num_blocks,
                tuple((t.committed_bytes, t.num_physical_chunks) for t in self.cache.tensors))

    def check_usable(self) -> None:
        tensors = self.cache.tensors
        if not tensors:
            raise KVConnectorError("the KV cache is not allocated: call cache.allocate() first")
        if any(t.is_freed for t in tensors):
            raise KVConnectorError("the KV cache was freed; free() this CPU offload connector")
        if getattr(self.cache, "is_released", False) or any(t.is_released for t in tensors):
            raise KVConnectorError(
                "the KV cache is asleep (physical memory released): call cache.recommit() "
                "before save/load; blocks already in the CPU pool are kept"
            )


class _TensorsSource:
    """Geometry from ``committed_regions(kv_caches, num_blocks, config)`` over ordinary (or
    already narrowed) tensors; views come from the narrowed, storage-bounded layers."""

    capacity_blocks: int | None = None

    def __init__(self, kv_caches: Any, num_blocks: int, kv_cache_config: Any) -> None:
        from kvconnect.views import committed_regions, narrow_kv_caches_to_num_blocks

        self.num_blocks = int(num_blocks)
        self._regions = committed_regions(kv_caches, self.num_blocks, kv_cache_config)
        narrowed = narrow_kv_caches_to_num_blocks(kv_caches, self.num_blocks, kv_cache_config)
        self._storages: dict[str, torch.UntypedStorage] = {}
        self._device: dict[str, torch.device] = {}
        for name, value in narrowed.items():
            first = value[0] if isinstance(value, (list, tuple)) else value
            self._storages[name] = first.untyped_storage()
            self._device[name] = first.device

    def regions(self) -> list[CommittedRegion]:
        return list(self._regions)

    def flat_view(self, r: CommittedRegion, span: int) -> torch.Tensor:
        name = r.layers[0] if r.layers else r.layer_name
        storage = self._storages[name]
        start = r.base_ptr - storage.data_ptr()
        # The narrowed storage is bounded to the committed extent, so this is a bounds check
        # against committed memory, not a source of geometry.
        if start < 0 or start + span > storage.nbytes():
            raise KVConnectorError(
                f"region {r.layer_name}/{r.part} ({span} bytes at {r.base_ptr:#x}) is not "
                f"inside the committed storage of layer {name!r}"
            )
        out = torch.empty(0, dtype=torch.uint8, device=self._device[name])
        return out.set_(storage, start, (span,))

    def state_token(self) -> object:
        return self.num_blocks

    def check_usable(self) -> None:
        return None


class CPUOffloadConnector:
    """Save / load logical KV blocks of ``cache`` to / from a CPU pool of ``num_cpu_blocks``.

    ``cache``: an ``ExtensibleKVCache`` (anything with ``committed_regions()``, ``num_blocks``
    and ``tensors``, a list of ExtensibleTensors); for ordinary tensors use
    :meth:`from_kv_caches`. ``num_cpu_blocks``: pool slots, each :attr:`bytes_per_block`
    bytes. ``pin_memory``: pin the pool (default: on CUDA only). ``max_staging_bytes``: bound
    on the device staging buffer per copy batch (bytes; larger batches are cut in chunks).
    ``max_copy_runs``: on CUDA, above this many runs of consecutive slots a batch moves with
    one index op per group over the pinned pool's unified-address alias instead of one
    copy-engine copy per run and group.
    """

    def __init__(
        self,
        cache: Any,
        num_cpu_blocks: int,
        *,
        pin_memory: bool | None = None,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        max_copy_runs: int = DEFAULT_MAX_COPY_RUNS,
    ) -> None:
        if isinstance(num_cpu_blocks, bool) or not isinstance(num_cpu_blocks, int):
            raise TypeError(f"num_cpu_blocks must be an int, got {type(num_cpu_blocks).__name__}")
        if num_cpu_blocks <= 0:
            raise ValueError(f"num_cpu_blocks must be positive, got {num_cpu_blocks}")
        if max_staging_bytes <= 0:
            raise ValueError(f"max_staging_bytes must be positive, got {max_staging_bytes}")
        if max_copy_runs < 1:
            raise ValueError(f"max_copy_runs must be >= 1, got {max_copy_runs}")
        self._src: _CacheSource | _TensorsSource = (
            cache if isinstance(cache, (_CacheSource, _TensorsSource)) else _CacheSource(cache))
        self._num_cpu_blocks = num_cpu_blocks
        self._max_staging_bytes = max_staging_bytes
        self._max_copy_runs = max_copy_runs
        self._freed = False
        self._pool: torch.Tensor | None = None
        self._pool_dev: torch.Tensor | None = None
        self._gpools: list[torch.Tensor] = []
        self._gpools_dev: list[torch.Tensor] | None = None
        self._stream: Any = None
        self._copy_stream: Any = None
        self._pending: list[OffloadHandle] = []
        self._lru: OrderedDict[Hashable, int] = OrderedDict()
        self._free_slots: list[int] = list(range(num_cpu_blocks))  # a heap (sorted = valid)
        self._token: object = None

        self._src.check_usable()
        self._slices, self._sources, self._num_blocks, self._word = self._derive_views()
        self._signature = [s.signature for s in self._slices]
        self._token = self._src.state_token()
        self._bytes_per_block = sum(s.width for s in self._slices)
        self._groups = _make_groups(self._slices)
        self._columns = self._group_columns()
        self._device = self._sources[0].device
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
            if pin:
                self._pool_dev = self._uva_alias(self._pool)
        self._gpools = self._pool_views(self._pool)
        self._gpools_dev = None if self._pool_dev is None else self._pool_views(self._pool_dev)
        logger.debug("CPU offload pool: %d blocks x %d bytes (%d regions) on %s",
                     num_cpu_blocks, self._bytes_per_block, len(self._slices), self._device)

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Any,
        num_blocks: int,
        kv_cache_config: Any,
        num_cpu_blocks: int,
        **kwargs: Any,
    ) -> CPUOffloadConnector:
        """A connector over per-layer tensors (an ordinary allocation, e.g.
        :func:`kvconnect.layout.allocate_kv_caches`, or any ``kv_caches`` of the config) for
        their first ``num_blocks`` blocks. Geometry comes from
        :func:`kvconnect.views.committed_regions`; views from the narrowed, storage-bounded
        layers. The tensors must outlive the connector; there is no automatic rebind."""
        return cls(_TensorsSource(kv_caches, num_blocks, kv_cache_config), num_cpu_blocks,
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
        return len(self._lru)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def is_pinned(self) -> bool:
        return self._pool is not None and self._pool.is_pinned()

    @property
    def is_freed(self) -> bool:
        return self._freed

    # -- slot accounting -------------------------------------------------------
    def contains(self, key: Hashable) -> bool:
        """Whether ``key`` has a block in the pool (its save may still be in flight)."""
        return key in self._lru

    __contains__ = contains

    def slot_of(self, key: Hashable) -> int | None:
        """The pool slot holding ``key``, or ``None``."""
        return self._lru.get(key)

    def keys(self) -> list[Hashable]:
        """Saved keys, least recently used first (the eviction order)."""
        return list(self._lru)

    def discard(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Forget ``keys`` and free their slots; returns the keys that were present."""
        self._check_alive()
        gone = []
        for k in keys:
            slot = self._lru.pop(k, None)
            if slot is not None:
                heapq.heappush(self._free_slots, slot)
                gone.append(k)
        return gone

    def read_cpu_block(self, key: Hashable) -> torch.Tensor:
        """A copy of the block saved under ``key``: ``bytes_per_block`` uint8, the regions'
        pages side by side in :attr:`row_layout` order, after waiting for outstanding
        copies. For checks and debugging."""
        self._check_alive()
        if key not in self._lru:
            raise OffloadKeyError([key])
        self.wait()
        slot = self._lru[key]
        return torch.cat([gp[slot].view(torch.uint8) for gp in self._gpools])

    # -- binding ---------------------------------------------------------------
    def rebind(self) -> None:
        """Re-derive the bounded region views from ``cache.committed_regions()``.

        Called automatically when the cache's commit state changes. The layout (layers,
        parts, block lengths) must be the one the pool was built for; block count and
        addresses may change. Raises :class:`KVConnectorError` otherwise.
        """
        self._check_alive()
        self._src.check_usable()
        self.wait()
        slices, sources, num_blocks, word = self._derive_views()
        sig = [s.signature for s in slices]
        if sig != self._signature:
            diff = [f"{a} -> {b}" for a, b in zip(self._signature, sig, strict=False) if a != b]
            if len(sig) != len(self._signature):
                diff.append(f"{len(self._signature)} regions -> {len(sig)}")
            raise KVConnectorError(
                "the KV cache's region layout changed under the CPU offload pool "
                f"({'; '.join(diff[:8])}); free this connector and create a new one"
            )
        self._slices, self._sources, self._num_blocks = slices, sources, num_blocks
        if word != self._word:
            self._word = word
            self._columns = self._group_columns()
            self._gpools = self._pool_views(self._pool)
            if self._gpools_dev is not None:
                self._gpools_dev = self._pool_views(self._pool_dev)
        self._token = self._src.state_token()

    def _derive_views(self) -> tuple[list[RowSlice], list[torch.Tensor], int, int]:
        """(row slices, block-row views, committed blocks, word size in bytes)."""
        src = self._src
        num_blocks = src.num_blocks
        if num_blocks <= 0:
            raise KVConnectorError("the KV cache has no committed blocks")
        slices, regions = offload_row_layout(src.regions(), num_blocks)
        # move bytes as the widest word every size, offset and address allows
        word = word_size(sum(s.width for s in slices), *(s.column for s in slices),
                         *(v for r in regions for v in (r.block_len, r.block_stride, r.base_ptr)))
        sources = []
        for sl, r in zip(slices, regions, strict=True):
            span = (num_blocks * sl.sub_blocks - 1) * r.block_stride + r.block_len
            try:
                flat = src.flat_view(r, span)
            except ValueError as exc:
                raise KVConnectorError(
                    f"region {r.layer_name}/{r.part} ({num_blocks} blocks, {span} bytes at "
                    f"{r.base_ptr:#x}) is not inside committed memory: {exc}"
                ) from exc
            sources.append(block_row_view(flat, num_blocks=num_blocks, block_len=r.block_len,
                                          block_stride=r.block_stride,
                                          sub_blocks=sl.sub_blocks, word=word))
        return slices, sources, num_blocks, word

    def _refresh(self) -> None:
        self._check_alive()
        self._src.check_usable()
        if self._src.state_token() != self._token:
            self.rebind()

    # -- operations ------------------------------------------------------------
    def save(self, block_ids: Iterable[int] | torch.Tensor,
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
        if len(key_list) > self._num_cpu_blocks:
            raise ValueError(
                f"cannot save {len(key_list)} blocks into a CPU pool of {self._num_cpu_blocks} "
                "slots: split the batch or grow the pool"
            )
        new = [k for k in key_list if k not in self._lru]
        evicted: list[Hashable] = []
        shortfall = len(new) - len(self._free_slots)
        if shortfall > 0:
            batch = set(key_list)
            for k in self._lru:
                if len(evicted) == shortfall:
                    break
                if k not in batch:
                    evicted.append(k)
            for k in evicted:
                heapq.heappush(self._free_slots, self._lru.pop(k))
        new_slots = {k: heapq.heappop(self._free_slots) for k in new}
        slots = [new_slots[k] if k in new_slots else self._lru[k] for k in key_list]
        handle = OffloadHandle("save", tuple(ids), tuple(key_list), tuple(slots),
                               len(ids) * self._bytes_per_block, tuple(evicted))
        if ids:
            try:
                self._copy(handle, to_cpu=True)
            except Exception as exc:
                for k, s in zip(key_list, slots, strict=True):
                    self._lru.pop(k, None)
                    heapq.heappush(self._free_slots, s)
                raise KVTransferError(_PEER_NAME, ids, exc) from exc
        for k, s in zip(key_list, slots, strict=True):
            self._lru[k] = s
            self._lru.move_to_end(k)
        if evicted:
            logger.debug("CPU offload evicted %d keys", len(evicted))
        return handle

    def load(self, block_ids: Iterable[int] | torch.Tensor,
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
        missing = [k for k in key_list if k not in self._lru]
        if missing:
            raise OffloadKeyError(missing)
        slots = [self._lru[k] for k in key_list]
        handle = OffloadHandle("load", tuple(ids), tuple(key_list), tuple(slots),
                               len(ids) * self._bytes_per_block)
        if ids:
            try:
                self._copy(handle, to_cpu=False)
            except Exception as exc:
                raise KVTransferError(_PEER_NAME, ids, exc) from exc
        for k in key_list:
            self._lru.move_to_end(k)
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

    # -- copy engine -----------------------------------------------------------
    def _copy(self, handle: OffloadHandle, *, to_cpu: bool) -> None:
        # Sort by slot so consecutive slots form runs whatever the batch order.
        order = sorted(range(len(handle.slots)), key=handle.slots.__getitem__)
        slots = [handle.slots[i] for i in order]
        ids = [handle.block_ids[i] for i in order]
        if not self._is_cuda:
            self._copy_host(ids, slots, to_cpu)
            return
        current = torch.cuda.current_stream(self._device)
        compute, copy = self._stream, self._copy_stream
        # Start after the caller's queued work and after every earlier offload operation
        # (so a slot reused after eviction is never written before an earlier read of it).
        compute.wait_stream(current)
        compute.wait_stream(copy)
        copy.wait_stream(compute)
        self._copy_cuda(ids, slots, to_cpu, handle._keepalive)
        compute.wait_stream(copy)
        event = torch.cuda.Event()
        event.record(compute)
        handle._event = event
        handle._device = self._device
        self._pending = [h for h in self._pending if not h.done()]
        self._pending.append(handle)

    def _group_columns(self) -> list[tuple[int, int]]:
        """Per region: (column inside its group's row, width), in words."""
        out = []
        for g in self._groups:
            for sl in self._slices[g.first:g.last]:
                out.append(((sl.column - g.column) // self._word, sl.width // self._word))
        return out

    def _pool_views(self, pool: torch.Tensor) -> list[torch.Tensor]:
        """Per group, a ``(num_cpu_blocks, width // word)`` view of its sub-pool. The pool is
        group-major: group ``g`` owns bytes ``[num_cpu_blocks * column, num_cpu_blocks *
        (column + width))``, so a run of consecutive slots of one group is one contiguous
        range (one copy-engine copy)."""
        n = self._num_cpu_blocks
        dtype = WORD_DTYPES[self._word]
        return [pool[n * g.column : n * (g.column + g.width)].view(dtype).view(n, -1)
                for g in self._groups]

    def _gather(self, group: _Group, ids_t: torch.Tensor, staging: torch.Tensor) -> None:
        """One ``index_select`` per region of ``group`` into its columns of ``staging``."""
        n = ids_t.numel()
        for i in range(group.first, group.last):
            src, (col, width) = self._sources[i], self._columns[i]
            torch.index_select(src, 0, ids_t,
                               out=staging[:, col:col + width].view(n, *src.shape[1:]))

    def _scatter(self, group: _Group, staging: torch.Tensor, ids_t: torch.Tensor) -> None:
        """One ``index_copy_`` per region of ``group`` from its columns of ``staging``."""
        n = ids_t.numel()
        for i in range(group.first, group.last):
            dst, (col, width) = self._sources[i], self._columns[i]
            dst.index_copy_(0, ids_t, staging[:, col:col + width].view(n, *dst.shape[1:]))

    def _chunks(self, ids: list[int], slots: list[int]) -> Iterator[tuple[list[int], list[int]]]:
        step = max(1, self._max_staging_bytes // self._bytes_per_block)
        for c0 in range(0, len(ids), step):
            yield ids[c0:c0 + step], slots[c0:c0 + step]

    def _copy_host(self, ids: list[int], slots: list[int], to_cpu: bool) -> None:
        """Host backend, synchronous. One run of slots: each region moves straight between
        its blocks and its pool columns (one index op per region). Otherwise one index op
        per region plus one per group, through a staging buffer."""
        dtype = WORD_DTYPES[self._word]
        for c_ids, c_slots in self._chunks(ids, slots):
            n = len(c_ids)
            ids_t = torch.tensor(c_ids, dtype=torch.int64)
            runs = contiguous_runs(c_slots)
            slots_t = None if len(runs) == 1 else torch.tensor(c_slots, dtype=torch.int64)
            for group, gpool in zip(self._groups, self._gpools, strict=True):
                if slots_t is None:
                    s0 = runs[0][1]
                    if to_cpu:
                        self._gather(group, ids_t, gpool[s0:s0 + n])
                    else:
                        self._scatter(group, gpool[s0:s0 + n], ids_t)
                elif to_cpu:
                    staging = torch.empty((n, gpool.shape[1]), dtype=dtype)
                    self._gather(group, ids_t, staging)
                    gpool.index_copy_(0, slots_t, staging)
                else:
                    self._scatter(group, gpool.index_select(0, slots_t), ids_t)

    def _copy_cuda(self, ids: list[int], slots: list[int], to_cpu: bool,
                   keep: list[Any]) -> None:
        """CUDA, asynchronous: gathers / scatters on the compute side stream, copy-engine
        copies on the copy stream, group by group, so group ``g``'s copy overlaps the
        gathers of group ``g + 1``. Batches with more than ``max_copy_runs`` runs of slots
        move with one ``index_copy_`` / ``index_select`` per group over the pinned pool's
        unified-address alias instead of one copy per run."""
        dev = self._device
        dtype = WORD_DTYPES[self._word]
        compute, copy = self._stream, self._copy_stream
        for c_ids, c_slots in self._chunks(ids, slots):
            n = len(c_ids)
            runs = contiguous_runs(c_slots)
            indexed = len(runs) > self._max_copy_runs and self._gpools_dev is not None
            with torch.cuda.stream(compute):
                ids_t = self._index_tensor(c_ids, keep)
                slots_t = self._index_tensor(c_slots, keep) if indexed else None
            for g, group in enumerate(self._groups):
                gpool = self._gpools[g]
                if indexed:
                    with torch.cuda.stream(compute):
                        gdev = self._gpools_dev[g]
                        if to_cpu:
                            staging = torch.empty((n, gpool.shape[1]), dtype=dtype, device=dev)
                            self._gather(group, ids_t, staging)
                            gdev.index_copy_(0, slots_t, staging)
                        else:
                            self._scatter(group, gdev.index_select(0, slots_t), ids_t)
                    continue
                ready = torch.cuda.Event()
                if to_cpu:
                    with torch.cuda.stream(compute):
                        staging = torch.empty((n, gpool.shape[1]), dtype=dtype, device=dev)
                        self._gather(group, ids_t, staging)
                        ready.record(compute)
                    copy.wait_event(ready)
                    with torch.cuda.stream(copy):
                        for pos, first, length in runs:
                            gpool[first:first + length].copy_(staging[pos:pos + length],
                                                              non_blocking=True)
                    staging.record_stream(copy)  # not reused before the copy has read it
                else:
                    with torch.cuda.stream(copy):
                        staging = torch.empty((n, gpool.shape[1]), dtype=dtype, device=dev)
                        for pos, first, length in runs:
                            staging[pos:pos + length].copy_(gpool[first:first + length],
                                                            non_blocking=True)
                        ready.record(copy)
                    compute.wait_event(ready)
                    with torch.cuda.stream(compute):
                        self._scatter(group, staging, ids_t)
                    staging.record_stream(compute)

    def _index_tensor(self, values: list[int], keep: list[Any] | None) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.int64)
        if not self._is_cuda:
            return t
        t = t.pin_memory()
        if keep is not None:
            keep.append(t)
        return t.to(self._device, non_blocking=True)

    def _uva_alias(self, pool: torch.Tensor) -> torch.Tensor | None:
        """A CUDA tensor over the pinned pool (unified addressing), or None if refused."""
        try:
            return torch.as_tensor(
                _CudaArrayInterface(pool.data_ptr(), tuple(pool.shape), pool),
                device=self._device)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.warning("pinned CPU pool is not addressable from the GPU (%s); scattered "
                           "slots will move with one copy per run of consecutive slots", exc)
            return None

    # -- validation ------------------------------------------------------------
    def _validate_ids(self, block_ids: Iterable[int] | torch.Tensor, op: str) -> list[int]:
        ids = _as_block_ids(block_ids, f"{op}() block_ids")
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
        if self._freed:
            raise KVConnectorError("CPUOffloadConnector used after free()")

    def free(self) -> None:
        """Wait for outstanding copies, then release the pool and the views. Idempotent.

        A pinned pool goes back to torch's pinned-memory cache, which keeps freed pinned
        blocks for reuse; ``torch._C._host_emptyCache()`` (called here when it exists)
        returns the unused ones to the system."""
        if self._freed:
            return
        try:
            if self._pending:
                self.wait()
        finally:
            self._freed = True
            self._pending = []
            self._lru.clear()
            self._free_slots = []
            self._sources = []
            self._pool_dev = None
            self._pool = None
            self._gpools = []
            self._gpools_dev = None
            self._copy_stream = None
            if self._is_cuda and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()
            self._stream = None

    def __enter__(self) -> CPUOffloadConnector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._freed else f"{len(self._lru)}/{self._num_cpu_blocks} used"
        return (f"CPUOffloadConnector({self._num_cpu_blocks} x {self._bytes_per_block} bytes, "
                f"{len(self._slices)} regions, {state})")
