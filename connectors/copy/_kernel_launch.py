"""Launching a plan's block-copy kernel with almost no host work per copy.

A :class:`KernelLauncher` belongs to one :class:`~.block_copy.BlockCopyPlan` and its launch
device. It keeps the plan's descriptor table on the device (anchor-relative words) and, per
*bucket* of id counts, a ring of *slots*: a pinned host ids buffer, a device ids buffer and
(mode ``graph``) a CUDA graph that uploads the ids and runs the kernel over the bucket's grid.
A copy of ``n`` blocks then costs: write ``n`` id pairs into the pinned buffer of a free slot
of bucket ``b >= n``, one graph replay, one event record. The kernel copies the ``live``
blocks the ids buffer names and idles the bucket's slack (:mod:`._triton_block_copy`).

Buckets are 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two and 1.5 times them), capped at the
plan's block count: a grid at most 1.5x the live one, and about ``2 log2(blocks)`` graphs.
A slot is free again when the event recorded after its last replay has completed (its upload
has read the pinned buffer); when every slot of a bucket is busy the ring grows, up to
:data:`MAX_SLOTS`, and then the oldest is waited for (with a deadline). :meth:`warm_up`
compiles, loads, captures and launches (uploads) every bucket's graph ahead; without it a
bucket's first copy runs eagerly (compiling and loading the kernel outside any capture) and
later ones are captured.

A replay is one ``cuGraphLaunch`` on the captured executable graph where torch exposes it
(``CUDAGraph.raw_cuda_graph_exec``): torch's own ``replay()`` also refreshes its RNG state
with small kernels of its own, which these graphs never use.

Modes (:data:`LAUNCH_MODES`): ``graph`` (default) as above; ``eager``: the same upload and
kernel issued one by one (a driver memcpy, then Triton's launcher, tens of microseconds of
Python); kept for measurements and used when graph capture fails (logged once). Where the
CUDA driver library cannot be loaded (not CUDA), uploads use torch. Driver calls go through
the package's one binding of the driver (:mod:`kvconnect.vmm._driver_api`).

Units: bytes for sizes, logical blocks for ids and buckets, seconds for deadlines.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvconnect.bounded_json import JSONObject
from kvconnect.polling import poll_until
from kvconnect.vmm import _driver_api as api

from ._cuda_streams import current_device, current_stream, raw_stream
from .ops import WORD_DTYPES

logger = logging.getLogger(__name__)

__all__ = ["ITEMS_PER_PROGRAM", "LAUNCH_MODES", "MAX_SLOTS", "KernelLauncher",
           "anchored_table", "bucket_sizes", "grid_programs", "wait_events"]

#: how a launcher issues copies (module docstring)
LAUNCH_MODES = ("graph", "eager")
#: work items (one column of one block) each kernel program copies, by default (a plan's
#: ``kernel_options`` may override it; :mod:`._triton_block_copy`)
ITEMS_PER_PROGRAM = 1
#: slots per bucket at most (copies of one bucket in flight at once)
MAX_SLOTS = 4
#: int64 words before the id pairs in an ids buffer: live count, padding
HEADER_WORDS = 2
#: seconds a completion wait spins (copies take microseconds to milliseconds) before backing off
SPIN_SECONDS = 0.1


def bucket_sizes(max_blocks: int) -> list[int]:
    """Id-count buckets for copies of up to ``max_blocks`` blocks: 1, 2, 3, 4, 6, 8, 12, ...
    (powers of two and 1.5 times them), the last one ``max_blocks`` itself."""
    if max_blocks <= 0:
        raise ValueError(f"max_blocks must be positive, got {max_blocks}")
    out, p = [], 1
    while p < max_blocks:
        out.append(p)
        if p >= 2 and p + p // 2 < max_blocks:
            out.append(p + p // 2)
        p *= 2
    out.append(max_blocks)
    return out


def grid_programs(num_blocks: int, num_columns: int, items_per_program: int = 1) -> int:
    """Programs of one kernel launch over ``num_blocks`` blocks of ``num_columns`` columns
    (work items) when each program copies ``items_per_program`` consecutive items:
    ``ceil(num_blocks * num_columns / items_per_program)`` (:mod:`._triton_block_copy`)."""
    if min(num_blocks, num_columns, items_per_program) <= 0:
        raise ValueError(f"num_blocks {num_blocks}, num_columns {num_columns} and "
                         f"items_per_program {items_per_program} must be positive")
    return -(-num_blocks * num_columns // items_per_program)


def anchored_table(table: np.ndarray, word: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchor, table)`` on ``device``: a small tensor of ``word``-byte elements and a plan's
    ``(columns, 5)`` byte table in words, its addresses (columns 0 and 2) from the anchor's."""
    anchor = torch.empty(64, dtype=WORD_DTYPES[word], device=device)
    rel = table.copy()
    rel[:, 0] -= anchor.data_ptr()
    rel[:, 2] -= anchor.data_ptr()
    if np.any(rel % word):  # word_size() chose a word dividing every value
        raise AssertionError("descriptor table is not word-aligned")
    return anchor, torch.from_numpy(rel // word).to(device)


def wait_events(events: Sequence[torch.cuda.Event], timeout: float, what: str = "copy"
                ) -> None:
    """Wait until every CUDA event in ``events`` has completed, at most ``timeout`` seconds:
    spin for :data:`SPIN_SECONDS`, then poll with back-off. Raises ``TimeoutError``."""
    start = time.monotonic()

    def done() -> bool:
        return all(ev.query() for ev in events)

    while not done():
        if time.monotonic() - start > SPIN_SECONDS:
            poll_until(done, max(0.0, timeout - (time.monotonic() - start)), max_pause=1e-2,
                       on_timeout=lambda _s: TimeoutError(
                           f"{what} not done after {timeout:.3g} s"))
            return


@dataclass
class _Slot:
    """One staging slot: pinned and device ids buffers of one bucket, and its graph."""

    host: torch.Tensor  # pinned int64, HEADER_WORDS + 2 * bucket
    words: np.ndarray  # numpy view of ``host``
    device: torch.Tensor  # int64 on the launch device, same length
    event: Any  # recorded after the last use; the slot is free once it completed
    graph: Any = None
    graph_exec: int = 0  # the graph's CUgraphExec where torch exposes it (0: use replay())
    used: bool = False

    def free(self) -> bool:
        return not self.used or bool(self.event.query())


@dataclass
class _Bucket:
    blocks: int
    slots: list[_Slot] = field(default_factory=list)
    turn: int = 0  # next slot to wait for when all are busy (oldest first)
    loaded: bool = False  # launched eagerly once: compiled and loaded, safe to capture


class KernelLauncher:
    """Issues one plan's kernel on ``device`` (see the module docstring).

    ``table``: the plan's ``(columns, 5)`` int64 rows of absolute byte values; ``word``: the
    copy word in bytes (divides every table value); ``options``: launch options of
    :func:`._triton_block_copy.launch_block_copy` without ``num_blocks``; ``max_blocks``: the
    most ids one copy can carry; ``mode``: one of :data:`LAUNCH_MODES`.
    """

    def __init__(self, table: np.ndarray, word: int, options: dict[str, Any],
                 device: torch.device, max_blocks: int, mode: str = "graph") -> None:
        if mode not in LAUNCH_MODES:
            raise ValueError(f"launch mode must be one of {LAUNCH_MODES}, got {mode!r}")
        self.device = device
        self._index = device.index if device.index is not None else current_device()
        self.mode = mode
        self.options = dict(options)
        self.buckets = bucket_sizes(max_blocks)
        self._bucket: dict[int, _Bucket] = {b: _Bucket(b) for b in self.buckets}
        with torch.cuda.device(device):
            self.anchor, self.table = anchored_table(table, word, device)
        #: the CUDA driver's table (None without libcuda: torch uploads, replay() replays)
        self._driver = api.optional_library(api.CUDA)
        self._upload = self._driver.raw("memcpy_htod_async") if self._driver else None
        self._graph_launch = self._driver.raw("graph_launch") if self._driver else None
        self._pool: Any = None
        self._capture_stream: Any = None
        self._warned = False

    # -- public ------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int:
        """The smallest bucket holding ``n`` ids."""
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            raise ValueError(f"{n} ids exceed this launcher's {self.buckets[-1]} blocks")
        return self.buckets[i]

    def warm_up(self, capture_all: bool = True) -> None:
        """Compile the kernel, load it with an empty launch per bucket and, in ``graph`` mode,
        capture and launch once (empty) slot 0 of every bucket (``capture_all``) or of none
        (captured on first use)."""
        from ._triton_block_copy import launch_block_copy

        with torch.cuda.device(self.device):
            for b in self.buckets:
                slot = self._slot(self._bucket[b], timeout=60.0)
                slot.words[0] = 0  # no live blocks: every program returns at once
                self._enqueue(slot, b, launch_block_copy)
                slot.event.record(current_stream(self._index))
                slot.used = True
                self._bucket[b].loaded = True
            torch.cuda.synchronize(self.device)
            if self.mode == "graph" and capture_all:
                for b in self.buckets:
                    slot = self._bucket[b].slots[0]
                    if slot.graph is None and not self._capture(slot, b):
                        break
                    # a graph's first launch also uploads it to the device: do that now,
                    # with no live blocks, so a copy never pays for it
                    slot.words[0] = 0
                    self._replay(slot)
                    slot.event.record(current_stream(self._index))
                torch.cuda.synchronize(self.device)

    def submit(self, src: np.ndarray, dst: np.ndarray, timeout: float = 60.0) -> None:
        """Enqueue the copy of blocks ``src[i] -> dst[i]`` on the launch device's current
        stream (ids already validated; at most the launcher's block count)."""
        n = int(src.size)
        b = self.bucket_for(n)
        bucket = self._bucket[b]
        with self._on_device():
            slot = self._slot(bucket, timeout)
            w = slot.words
            w[0] = n
            pairs = w[HEADER_WORDS:HEADER_WORDS + 2 * n]
            pairs[0::2] = src
            pairs[1::2] = dst
            if self.mode == "graph" and slot.graph is None and bucket.loaded:
                self._capture(slot, b)  # first use of this slot (the kernel is loaded)
            if self.mode == "graph" and slot.graph is not None:
                self._replay(slot)
            else:  # eager mode, or a bucket's first copy: compile and load it uncaptured
                from ._triton_block_copy import launch_block_copy

                self._enqueue(slot, b, launch_block_copy)
                bucket.loaded = True
            slot.event.record(current_stream(self._index))
            slot.used = True

    def describe(self) -> JSONObject:
        """JSON-able facts: mode, buckets, slots and graphs held."""
        slots = [s for bk in self._bucket.values() for s in bk.slots]
        items = int(self.options.get("items_per_program", ITEMS_PER_PROGRAM))
        return {"launch": self.mode, "buckets": len(self.buckets),
                "max_blocks": self.buckets[-1], "items_per_program": items,
                "max_programs": grid_programs(self.buckets[-1], self.options["num_columns"],
                                              items),
                "slots": len(slots),
                "graphs": sum(s.graph is not None for s in slots),
                "driver_replays": sum(bool(s.graph_exec) for s in slots)}

    # -- internals ---------------------------------------------------------------------
    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The launch device made current for the block (a no-op when it already is)."""
        if current_device() == self._index:
            return contextlib.nullcontext()
        return torch.cuda.device(self._index)

    def _stream_handle(self) -> int:
        """The launch device's current stream as a raw handle."""
        return raw_stream(self._index)

    def _replay(self, slot: _Slot) -> None:
        """Launch the slot's captured graph on the current stream: one ``cuGraphLaunch``
        where torch exposes the executable graph, else torch's ``replay()``."""
        if slot.graph_exec and self._graph_launch is not None:
            rc = self._graph_launch(slot.graph_exec, self._stream_handle())
            if rc != 0:  # a VmmError (a RuntimeError) named by the driver's error
                assert self._driver is not None
                raise self._driver.error("graph_launch", rc, "a block copy's graph")
        else:
            slot.graph.replay()

    def _slot(self, bucket: _Bucket, timeout: float) -> _Slot:
        for s in bucket.slots:
            if s.free():
                return s
        if len(bucket.slots) < MAX_SLOTS:
            n = HEADER_WORDS + 2 * bucket.blocks
            host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
            bucket.slots.append(_Slot(host, host.numpy(), torch.zeros(n, dtype=torch.int64,
                                                                      device=self.device),
                                      torch.cuda.Event()))
            return bucket.slots[-1]
        slot = bucket.slots[bucket.turn % len(bucket.slots)]
        bucket.turn += 1
        wait_events([slot.event], timeout, "an earlier copy of the same size")
        return slot

    def _enqueue(self, slot: _Slot, blocks: int, launch: Callable[..., None]) -> None:
        """Upload the slot's ids and launch the kernel over ``blocks`` on the current stream."""
        if self._upload is not None:
            rc = self._upload(slot.device.data_ptr(), slot.host.data_ptr(),
                              slot.host.numel() * 8, self._stream_handle())
            if rc != 0:
                assert self._driver is not None
                raise self._driver.error("memcpy_htod_async", rc, "the block ids upload")
        else:
            slot.device.copy_(slot.host, non_blocking=True)
        launch(self.anchor, self.table, slot.device, **self.options, num_blocks=blocks)

    def _capture(self, slot: _Slot, blocks: int) -> bool:
        """Capture the slot's upload + kernel into a CUDA graph; on failure switch to eager
        mode (logged once) and return False."""
        from ._triton_block_copy import launch_block_copy

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(device=self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    self._enqueue(slot, blocks, launch_block_copy)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any capture failure: fall back, logged
            self.mode = "eager"
            if not self._warned:
                self._warned = True
                logger.warning("block copy on %s: CUDA graph capture failed (%s: %s); "
                               "launching eagerly", self.device, type(exc).__name__, exc)
            return False
        slot.graph = graph
        raw = getattr(graph, "raw_cuda_graph_exec", None)
        if self._graph_launch is not None and raw is not None:
            try:
                slot.graph_exec = int(raw())
            except (RuntimeError, TypeError, ValueError):
                slot.graph_exec = 0
        return True
