"""The ``host`` method of :class:`~.block_copy.BlockCopyPlan`: block copies in host memory
(the host VMM backend's memfd mappings), as row gathers or as one memmove per run.

Each side of a plan (its regions' bounded views) is laid over one array of *rows*: the bytes
from the side's lowest region address to its highest end, cut into rows of ``row_bytes``,
the greatest common divisor of every column offset (from that lowest address), stride and
length on both sides. Every column of every block is then a run of whole rows on both sides,
so a batch is two row-index arrays built with numpy broadcasting (no per-column or per-block
Python). Rows that follow each other on both sides merge into *runs* (consecutive blocks,
adjacent columns), and the batch moves by one of two engines (:data:`ENGINES`), chosen per
batch by ``auto`` from the average run length (measured on a 16-core host,
``benchmarks/results/probe-host-copy-h200.json``):

- ``torch-rows`` (runs shorter than :data:`MEMMOVE_MIN_RUN_BYTES` on average, where torch
  has at least :data:`TORCH_ROWS_MIN_THREADS` intra-op threads):
  ``torch.index_select`` of the source rows into a reusable staging buffer, then
  ``index_copy_`` into the destination rows, both over views of the widest integer dtype
  dividing the rows and both sides' base addresses (int64 normally; int32/int16/uint8 as a
  correct, slower fallback). Torch runs each op on its intra-op threads with the GIL released
  (``torch.get_num_threads()``, never raised here): the one engine that scales for short runs
  (0.39-0.47 of a contiguous copy for 32 KiB runs, where Python threads convoy on the GIL).
  Rows wider than :data:`TORCH_ROW_MAX_BYTES` are cut into sub-rows (torch's gather turns
  serial on wider rows). Batches over :data:`STAGING_BYTES` move in chunks of at most that
  size; the staging buffer is one per process, grown up to that bound, and held under a lock
  for the copy;
- ``memmove`` (long runs, batches of at most :data:`SMALL_BATCH_RUNS` runs, and everything
  where torch has fewer threads, e.g. a 2-core CI machine): one
  ``ctypes.memmove`` per run straight from source to destination (ctypes releases the GIL
  during each call), batches of :data:`PARALLEL_MIN_BYTES` or more split by bytes over up to
  :data:`MEMMOVE_MAX_THREADS` threads (bounded by the cpu count and torch's thread count):
  0.30-0.77 of a contiguous copy for 256 KiB runs.

The row arrays span whatever lies between a side's regions (other reservations, unmapped
gaps): like the kernel's anchor-relative table, only rows of validated block ids are ever
touched (torch checks every index against the span again). A plan whose geometry gives rows
under :data:`MIN_ROW_BYTES`, or sides spanning more than :data:`MAX_SPAN_BYTES`, does not get
this method (:func:`host_row_copier` says why).

Units: bytes for sizes, offsets and addresses; rows of ``row_bytes``; logical blocks for ids.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvconnect.bounded_json import JSONObject

from .ops import WORD_DTYPES, word_size

__all__ = ["ENGINES", "MEMMOVE_MIN_RUN_BYTES", "MIN_ROW_BYTES", "STAGING_BYTES",
           "HostRowCopier", "host_row_copier"]

#: the host copy engines; ``auto`` picks per batch (see the module docstring)
ENGINES = ("auto", "torch-rows", "memmove")
#: rows narrower than this make a per-row copy too slow: such plans keep the torch method
MIN_ROW_BYTES = 256
#: a side whose regions spread over more virtual address space is not laid over one array
MAX_SPAN_BYTES = 1 << 46
#: average run length from which ``auto`` moves a batch by memmove (16-core H200 host, the
#: library engines in one run, benchmarks/results/probe-host-copy-h200.json: torch rows
#: (64 KiB sub-rows) 0.33-0.73 of torch's contiguous copy at 32 KiB runs against memmove
#: 0.04-0.12, 0.35-0.66 against 0.14-0.35 at 128 KiB, 0.80 against 0.75 at 256 KiB / 256 MiB;
#: memmove is kept for runs past what was measured)
MEMMOVE_MIN_RUN_BYTES = 512 << 10
#: batches of at most this many runs move by memmove on the calling thread whatever their
#: run length (two torch ops cost more than a few memmove calls)
SMALL_BATCH_RUNS = 8
#: fewest torch intra-op threads for ``auto`` to pick torch rows (16-core host: torch rows
#: gave about 1.9 GB/s per thread, one memmove thread 4.8 GB/s; a loaded 2-core machine makes
#: torch's threads slower still)
TORCH_ROWS_MIN_THREADS = 4
#: the memmove engine splits batches of at least this many bytes over its threads
PARALLEL_MIN_BYTES = 8 << 20
#: most threads of the memmove engine (4-8 measured best on 16 cores; 16 convoy)
MEMMOVE_MAX_THREADS = 8
#: the torch-rows engine's staging bound: larger batches move in chunks of this many bytes
#: (16-core H200 host: 4 or 16 MiB chunks 0.38-0.75 of a contiguous copy where one 64 MiB
#: staging gave 0.35-0.61; the two alike overall)
STAGING_BYTES = 16 << 20
#: widest row the torch-rows engine gathers as one (its gather is serial from 32768 elements)
TORCH_ROW_MAX_BYTES = 64 << 10


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[ThreadPoolExecutor, int]:
    """The process's memmove threads (created on first use) and their count."""
    workers = max(1, min(os.cpu_count() or 1, torch.get_num_threads(), MEMMOVE_MAX_THREADS))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvc-host-copy"), workers


class _Staging:
    """The process's staging buffer of the torch-rows engine: grown on demand up to
    :data:`STAGING_BYTES`, never shrunk; ``lock`` is held for the whole of a copy that uses
    it (torch already spreads each copy over every intra-op thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buf = torch.empty(0, dtype=torch.uint8)

    def rows(self, nrows: int, row_elems: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``(nrows, row_elems)`` view of the buffer (caller holds ``lock``)."""
        nbytes = nrows * row_elems * torch.empty(0, dtype=dtype).element_size()
        if nbytes > self._buf.numel():  # grow by doubling, to the bound at most
            grown = max(nbytes, min(2 * self._buf.numel(), STAGING_BYTES))
            self._buf = torch.empty(grown, dtype=torch.uint8)
        return self._buf[:nbytes].view(dtype).view(nrows, row_elems)


_STAGING = _Staging()


def _span_rows(flats: Sequence[torch.Tensor], row_bytes: int) -> tuple[int, np.ndarray]:
    """``(lowest address, rows array)`` laid over every byte from the lowest flat view's
    first byte to the highest one's last (no memory is read here)."""
    lo = min(f.data_ptr() for f in flats)
    hi = max(f.data_ptr() + f.numel() for f in flats)
    nrows = (hi - lo) // row_bytes
    buf = (ctypes.c_uint8 * (nrows * row_bytes)).from_address(lo)
    return lo, np.frombuffer(memoryview(buf), dtype=np.uint8).reshape(nrows, row_bytes)


def _torch_row_shape(row_bytes: int, src_lo: int, dst_lo: int) -> tuple[torch.dtype, int]:
    """The torch-rows engine's element dtype (the widest integer dividing the rows and both
    base addresses) and sub-rows per row: the fewest that keep a sub-row of whole elements
    under :data:`TORCH_ROW_MAX_BYTES`, none if that needs sub-rows under
    :data:`MIN_ROW_BYTES`."""
    width = word_size(row_bytes, src_lo, dst_lo)
    elems = row_bytes // width
    fewest = -(-row_bytes // TORCH_ROW_MAX_BYTES)
    split = next((k for k in range(fewest, row_bytes // MIN_ROW_BYTES + 1) if elems % k == 0),
                 1)
    return WORD_DTYPES[width], split


class HostRowCopier:
    """Host copies for one plan's columns (see the module docstring); build it with
    :func:`host_row_copier`. ``columns``: the plan's ``(columns, 5)`` int64 rows of absolute
    byte values (src address of block 0, src stride, dst address, dst stride, length);
    ``keep``: objects the row arrays depend on (the regions' views); ``engine``: one of
    :data:`ENGINES` (``auto`` outside measurements and tests). Not thread-safe, like its
    plan; :attr:`last_engine` names the engine of the latest batch."""

    def __init__(self, columns: np.ndarray, src: Sequence[torch.Tensor],
                 dst: Sequence[torch.Tensor], row_bytes: int, keep: object,
                 engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown host copy engine {engine!r}; choose from {ENGINES}")
        self.row_bytes = row_bytes
        self.engine = engine
        #: the engine that moved the latest batch (``None`` before the first)
        self.last_engine: str | None = None
        self._keep = keep
        self._src_lo, self._src_rows = _span_rows(src, row_bytes)
        self._dst_lo, self._dst_rows = _span_rows(dst, row_bytes)
        self._dtype, self._split = _torch_row_shape(row_bytes, self._src_lo, self._dst_lo)
        sub_elems = row_bytes // self._split // torch.empty(0, dtype=self._dtype).element_size()
        self._src_t = torch.from_numpy(self._src_rows).view(self._dtype).view(-1, sub_elems)
        self._dst_t = torch.from_numpy(self._dst_rows).view(self._dtype).view(-1, sub_elems)
        t = columns // 1  # int64 copy
        rows = t[:, 4] // row_bytes
        #: per distinct rows-per-column: (src base row, src stride rows, dst base, dst stride)
        self._groups: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for per in sorted(set(rows.tolist())):
            g = t[rows == per]
            self._groups.append((int(per), (g[:, 0] - self._src_lo) // row_bytes,
                                 g[:, 1] // row_bytes, (g[:, 2] - self._dst_lo) // row_bytes,
                                 g[:, 3] // row_bytes))

    def describe(self) -> JSONObject:
        """JSON-able facts: ``row_bytes``, the ``host_engine`` setting, the
        ``host_last_engine`` of the latest batch, and the torch-rows engine's element and
        sub-row bytes."""
        element = torch.empty(0, dtype=self._dtype).element_size()
        return {"row_bytes": self.row_bytes, "host_engine": self.engine,
                "host_last_engine": self.last_engine, "host_element_bytes": element,
                "host_torch_row_bytes": self.row_bytes // self._split}

    def row_indices(self, src_ids: np.ndarray, dst_ids: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination row numbers of a batch, column by column, block by block."""
        s_parts, d_parts = [], []
        for per, s_base, s_stride, d_base, d_stride in self._groups:
            r = np.arange(per, dtype=np.int64)[None, None, :]
            s_parts.append((s_base[:, None, None] + src_ids[None, :, None]
                            * s_stride[:, None, None] + r).reshape(-1))
            d_parts.append((d_base[:, None, None] + dst_ids[None, :, None]
                            * d_stride[:, None, None] + r).reshape(-1))
        if len(s_parts) == 1:
            return s_parts[0], d_parts[0]
        return np.concatenate(s_parts), np.concatenate(d_parts)

    def choose_engine(self, nbytes: int, runs: int) -> str:
        """The engine of a batch of ``nbytes`` in ``runs`` runs (:attr:`engine` unless
        ``auto``; see the module docstring)."""
        if self.engine != "auto":
            return self.engine
        if runs <= SMALL_BATCH_RUNS or nbytes >= MEMMOVE_MIN_RUN_BYTES * runs \
                or torch.get_num_threads() < TORCH_ROWS_MIN_THREADS:
            return "memmove"
        return "torch-rows"

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Copy logical blocks ``src_ids[i] -> dst_ids[i]`` of every column (ids validated
        by the plan); synchronous."""
        s, d = self.row_indices(src_ids, dst_ids)
        nbytes = s.size * self.row_bytes
        # runs: where both row numbers go on by one, the copy goes on in one piece
        starts = np.concatenate(([0], np.flatnonzero((np.diff(s) != 1)
                                                     | (np.diff(d) != 1)) + 1))
        engine = self.choose_engine(nbytes, int(starts.size))
        if engine == "memmove":
            lengths = np.diff(np.concatenate((starts, [s.size]))) * self.row_bytes
            self._memmove_runs(s[starts] * self.row_bytes, d[starts] * self.row_bytes,
                               lengths, nbytes)
        else:
            self._torch_rows(s, d)
        self.last_engine = engine

    def _torch_rows(self, s: np.ndarray, d: np.ndarray) -> None:
        """Rows ``s[i] -> d[i]``: gather into the staging buffer, scatter from it, in chunks
        of at most :data:`STAGING_BYTES`."""
        k = self._split
        if k > 1:  # sub-rows: row r is sub-rows r*k .. r*k+k-1
            sub = np.arange(k, dtype=np.int64)
            s = (s[:, None] * k + sub).reshape(-1)
            d = (d[:, None] * k + sub).reshape(-1)
        step = max(1, STAGING_BYTES * k // self.row_bytes)
        row_elems = self._src_t.shape[1]
        with _STAGING.lock:
            for i in range(0, s.size, step):
                si = torch.from_numpy(s[i:i + step])
                stage = _STAGING.rows(si.numel(), row_elems, self._dtype)
                torch.index_select(self._src_t, 0, si, out=stage)
                self._dst_t.index_copy_(0, torch.from_numpy(d[i:i + step]), stage)

    def _memmove_runs(self, src_off: np.ndarray, dst_off: np.ndarray, lengths: np.ndarray,
                      nbytes: int) -> None:
        """One memmove per run (byte offsets from each side's lowest address): on this
        thread under :data:`PARALLEL_MIN_BYTES`, else split by bytes over the threads."""
        pool, workers = _pool()
        tasks = 1 if nbytes < PARALLEL_MIN_BYTES else min(workers, lengths.size)
        if tasks <= 1:
            self._memmove_slice(src_off, dst_off, lengths)
            return
        ends = np.cumsum(lengths)
        cuts = np.searchsorted(ends, np.arange(1, tasks) * (nbytes / tasks), side="right")
        bounds = [0, *sorted(set(cuts.tolist()) - {0, lengths.size}), lengths.size]
        futures = [pool.submit(self._memmove_slice, src_off[a:b], dst_off[a:b], lengths[a:b])
                   for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        for f in futures:
            f.result()  # re-raises a worker's error here

    def _memmove_slice(self, src_off: np.ndarray, dst_off: np.ndarray,
                       lengths: np.ndarray) -> None:
        sp, dp = self._src_rows.ctypes.data, self._dst_rows.ctypes.data
        move = ctypes.memmove
        for so, do, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(),
                             strict=True):
            move(dp + do, sp + so, n)


def host_row_copier(columns: np.ndarray, src: Sequence[torch.Tensor],
                    dst: Sequence[torch.Tensor], keep: object, engine: str = "auto"
                    ) -> HostRowCopier | str:
    """A :class:`HostRowCopier` for a plan's merged ``columns`` over the flat views ``src``
    and ``dst`` (host tensors), or why the plan cannot have one."""
    if any(f.device.type != "cpu" for f in (*src, *dst)):
        return "the host method needs host memory on both sides"
    if columns.size == 0:
        return "the plan has no columns"
    values = [int(v) for v in np.concatenate([columns[:, 1], columns[:, 3], columns[:, 4]])]
    for flats, col in ((src, 0), (dst, 2)):
        lo = min(f.data_ptr() for f in flats)
        hi = max(f.data_ptr() + f.numel() for f in flats)
        if hi - lo > MAX_SPAN_BYTES:
            return f"regions spread over {hi - lo} bytes of address space"
        values += [int(a) - lo for a in columns[:, col]]
    row = functools.reduce(math.gcd, values)
    if row < MIN_ROW_BYTES:
        return (f"columns, strides and offsets share only {row}-byte rows "
                f"(< {MIN_ROW_BYTES})")
    return HostRowCopier(columns, src, dst, row, keep, engine)
