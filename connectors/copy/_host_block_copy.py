"""The ``host`` method of :class:`~.block_copy.BlockCopyPlan`: block copies in host memory as
row gathers, one vectorised copy per batch.

Each side of a plan (its regions' bounded views) is laid over one numpy array of *rows*: the
bytes from the side's lowest region address to its highest end, cut into rows of
``row_bytes``, the greatest common divisor of every column offset (from that lowest
address), stride and length on both sides. Every column of every block is then a run of
whole rows on both sides, so a batch is two row-index arrays built with numpy broadcasting
(no per-column or per-block Python, no per-column index tensors). Rows that follow each
other on both sides merge into *runs* (a run of consecutive blocks, adjacent columns), and
the batch moves as one of two copies:

- runs of at least :data:`MEMMOVE_MIN_RUN_BYTES` on average: one ``memmove`` per run, straight
  from source to destination (ctypes releases the GIL during each call, so threads overlap);
- shorter runs: ``dst_rows[d] = src_rows[s]`` with numpy, in chunks of about
  :data:`CHUNK_BYTES` (the gathered rows stay in cache between the gather and the scatter).

Batches of at least :data:`PARALLEL_MIN_BYTES` are split over the process's host-copy
threads.

The row arrays span whatever lies between a side's regions (other reservations, unmapped
gaps): like the kernel's anchor-relative table, only rows of validated block ids are ever
touched. A plan whose geometry gives rows under :data:`MIN_ROW_BYTES`, or sides spanning more
than :data:`MAX_SPAN_BYTES`, does not get this method (:func:`host_row_copier` says why).

Units: bytes for sizes, offsets and addresses; rows of ``row_bytes``; logical blocks for ids.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "MIN_ROW_BYTES", "HostRowCopier", "host_row_copier"]

#: rows narrower than this make a per-row copy too slow: such plans keep the torch method
MIN_ROW_BYTES = 256
#: a side whose regions spread over more virtual address space is not laid over one array
MAX_SPAN_BYTES = 1 << 46
#: bytes gathered per step (stays in cache between the gather and the scatter)
CHUNK_BYTES = 1 << 20
#: batches smaller than this run on the calling thread
PARALLEL_MIN_BYTES = 8 << 20
#: average run length from which a batch moves by one memmove per run (measured on the host
#: backend: a memmove per 32 KiB run beats numpy's gather + scatter, whose scatter holds the
#: GIL; for short runs the per-call Python cost wins)
MEMMOVE_MIN_RUN_BYTES = 16 << 10


@functools.lru_cache(maxsize=1)
def _pool() -> tuple[ThreadPoolExecutor, int]:
    """The process's host-copy threads (created on first use) and their count."""
    workers = max(1, min(os.cpu_count() or 1, torch.get_num_threads(), 16))
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvc-host-copy"), workers


def _span_rows(flats: Sequence[torch.Tensor], row_bytes: int) -> tuple[int, np.ndarray]:
    """``(lowest address, rows array)`` laid over every byte from the lowest flat view's
    first byte to the highest one's last (no memory is read here)."""
    lo = min(f.data_ptr() for f in flats)
    hi = max(f.data_ptr() + f.numel() for f in flats)
    nrows = (hi - lo) // row_bytes
    buf = (ctypes.c_uint8 * (nrows * row_bytes)).from_address(lo)
    return lo, np.frombuffer(buf, dtype=np.uint8).reshape(nrows, row_bytes)


class HostRowCopier:
    """Row-gather copies for one plan's columns (see the module docstring); build it with
    :func:`host_row_copier`. ``columns``: the plan's ``(columns, 5)`` int64 rows of absolute
    byte values (src address of block 0, src stride, dst address, dst stride, length);
    ``keep``: objects the row arrays depend on (the regions' views)."""

    def __init__(self, columns: np.ndarray, src: Sequence[torch.Tensor],
                 dst: Sequence[torch.Tensor], row_bytes: int, keep: Any) -> None:
        self.row_bytes = row_bytes
        self._keep = keep
        self._src_lo, self._src_rows = _span_rows(src, row_bytes)
        self._dst_lo, self._dst_rows = _span_rows(dst, row_bytes)
        t = columns // 1  # int64 copy
        rows = t[:, 4] // row_bytes
        #: per distinct rows-per-column: (src base row, src stride rows, dst base, dst stride)
        self._groups: list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for per in sorted(set(rows.tolist())):
            g = t[rows == per]
            self._groups.append((int(per), (g[:, 0] - self._src_lo) // row_bytes,
                                 g[:, 1] // row_bytes, (g[:, 2] - self._dst_lo) // row_bytes,
                                 g[:, 3] // row_bytes))

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

    def copy(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
        """Copy logical blocks ``src_ids[i] -> dst_ids[i]`` of every column (ids validated
        by the plan); synchronous."""
        s, d = self.row_indices(src_ids, dst_ids)
        nbytes = s.size * self.row_bytes
        # runs: where both row numbers go on by one, the copy goes on in one piece
        cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
        starts = np.concatenate(([0], cut))
        if nbytes >= MEMMOVE_MIN_RUN_BYTES * starts.size:
            lengths = np.diff(np.concatenate((starts, [s.size]))) * self.row_bytes
            work = (self._memmove_runs, (s[starts] * self.row_bytes,
                                         d[starts] * self.row_bytes, lengths))
        else:
            work = (self._copy_range, (s, d))
        self._run_parallel(work, nbytes)

    def _run_parallel(self, work: tuple[Any, tuple[np.ndarray, ...]], nbytes: int) -> None:
        """Run ``fn(*arrays)`` over slices of the arrays: on this thread for small batches,
        else split over the host-copy threads."""
        fn, arrays = work
        n = arrays[0].size
        pool, workers = _pool()
        tasks = 1 if nbytes < PARALLEL_MIN_BYTES else min(workers, n)
        if tasks <= 1:
            fn(*arrays)
            return
        cut = math.ceil(n / tasks)
        futures = [pool.submit(fn, *(a[i:i + cut] for a in arrays)) for i in range(0, n, cut)]
        for f in futures:
            f.result()  # re-raises a worker's error here

    def _memmove_runs(self, src_off: np.ndarray, dst_off: np.ndarray,
                      lengths: np.ndarray) -> None:
        """One memmove per run (byte offsets from each side's lowest address)."""
        sp, dp = self._src_rows.ctypes.data, self._dst_rows.ctypes.data
        move = ctypes.memmove
        for so, do, n in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(),
                             strict=True):
            move(dp + do, sp + so, n)

    def _copy_range(self, s: np.ndarray, d: np.ndarray) -> None:
        """Rows ``s[i] -> d[i]`` as numpy gathers + scatters of :data:`CHUNK_BYTES`."""
        step = max(1, CHUNK_BYTES // self.row_bytes)
        src, dst = self._src_rows, self._dst_rows
        buf = np.empty((min(step, s.size), self.row_bytes), dtype=np.uint8)
        for i in range(0, s.size, step):
            m = min(step, s.size - i)
            out = buf[:m]
            # mode="clip": no bounds buffering; the plan validated every id already
            np.take(src, s[i:i + m], axis=0, out=out, mode="clip")
            dst[d[i:i + m]] = out


def host_row_copier(columns: np.ndarray, src: Sequence[torch.Tensor],
                    dst: Sequence[torch.Tensor], keep: Any) -> HostRowCopier | str:
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
    return HostRowCopier(columns, src, dst, row, keep)
