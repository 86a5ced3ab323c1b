"""The block-copy engine: every layer, region and block of a transfer in one launch.

A :class:`BlockCopyPlan` is built **once per pair of block layouts** (a source cache and a
destination cache, or a cache and a CPU pool). It pairs the regions of both sides, cuts every
logical block of every region into *columns* (byte ranges that are contiguous on both sides,
merged across regions where both sides happen to be contiguous, then split into pieces of at
most ``chunk_bytes``), and keeps them as a descriptor table: per column the source address
of block 0, the source block stride, the destination address and stride, and the length.
A transfer only supplies block ids: ``copy(src_ids, dst_ids)`` moves logical block
``src_ids[i]`` of every region to block ``dst_ids[i]``.

Methods (:data:`COPY_METHODS`), chosen per plan or per call:

- ``kernel``: one Triton kernel launch over ``bucket x columns`` programs, each copying one
  column of one block (:mod:`._triton_block_copy`). Addresses are anchor-relative word
  offsets, so the kernel reaches any memory the launch device can address (VMM mappings of
  another process, a peer GPU's memory with access granted, pinned host memory by unified
  addressing). The table lives on the launch device; a call stages only the ids, through
  pinned memory, and replays one CUDA graph (upload + kernel) captured per id-count bucket
  (:mod:`._kernel_launch`; ``launch="eager"`` issues the same two steps one by one).
- ``memcpy_batch``: one ``cuMemcpyBatchAsync`` call (copy engines) with one descriptor per
  column and *run* of consecutive blocks (:func:`block_runs`): merged runs mean fewer,
  larger copies (:mod:`._cuda_memcpy_batch`).
- ``host``: host memory on both sides (the host VMM backend): a batch as rows over the sides'
  address spans, moved by torch row gathers or one memmove per run, chosen per batch
  (:mod:`._host_block_copy`). ``auto``'s choice on the host where the geometry allows it.
- ``torch``: the portable fallback, and the reference shape: per column, one strided
  ``copy_`` per run when a batch has at most two runs, else one ``index_select`` + one
  ``index_copy_``. Never one copy per block.

``copy_many`` merges several requests into one launch (one copy for the host method).

Units: bytes for lengths, offsets, strides and addresses; logical blocks for ids.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvconnect.block_ids import BlockIds, as_block_ids, merged_block_ids
from kvconnect.bounded_json import JSONObject
from kvconnect.peer_layout import LayoutRegion
from kvconnect.views import block_span

from ._host_block_copy import HostRowCopier, host_row_copier
from ._kernel_launch import ITEMS_PER_PROGRAM, LAUNCH_MODES, KernelLauncher, anchored_table
from .ops import WORD_DTYPES, word_size

logger = logging.getLogger(__name__)

__all__ = [
    "COPY_METHODS",
    "DEFAULT_CHUNK_BYTES",
    "LAUNCH_MODES",
    "BlockCopyPlan",
    "BlockRegion",
    "block_runs",
    "kernel_available",
    "layout_block_region",
]

#: ways a plan can move blocks (see the module docstring)
COPY_METHODS = ("kernel", "memcpy_batch", "host", "torch")
#: longest column one kernel program copies (bytes); longer block pieces are split
DEFAULT_CHUNK_BYTES = 32 * 1024
#: table row: src address (words from the anchor), src block stride (words), dst address,
#: dst block stride, length (words)
_ROW = 5


@dataclass(frozen=True)
class BlockRegion:
    """One region's logical blocks on one side of a copy (bytes).

    ``flat`` is a 1-D uint8 tensor **bounded** to the region's committed span and starting at
    block 0 (a ``committed_view``, a ``PeerMapping.view`` or a slice of a pool). Logical block
    ``b`` is ``sub_blocks`` pieces of ``block_len`` bytes at ``flat + (b * sub_blocks + p) *
    block_stride`` for ``p < sub_blocks``. ``num_blocks`` counts logical blocks.
    """

    flat: torch.Tensor
    block_len: int
    block_stride: int
    num_blocks: int
    sub_blocks: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        f = self.flat
        if f.dtype != torch.uint8 or f.dim() != 1:
            raise ValueError(f"region {self.name!r}: flat must be a 1-D uint8 tensor, got "
                             f"{f.dtype} of shape {tuple(f.shape)}")
        if min(self.block_len, self.num_blocks, self.sub_blocks) <= 0:
            raise ValueError(f"region {self.name!r}: block_len {self.block_len}, num_blocks "
                             f"{self.num_blocks} and sub_blocks {self.sub_blocks} must be positive")
        if self.sub_blocks > 1 and self.block_stride < self.block_len:
            raise ValueError(f"region {self.name!r}: block_stride {self.block_stride} < "
                             f"block_len {self.block_len}: kernel blocks would overlap")
        if self.num_blocks > 1 and self.logical_stride < self.width:
            raise ValueError(f"region {self.name!r}: logical blocks {self.width} bytes wide "
                             f"overlap at a stride of {self.logical_stride} bytes")
        if self.span > f.numel():
            raise ValueError(f"region {self.name!r}: {self.num_blocks} blocks need {self.span} "
                             f"bytes but the bounded view holds {f.numel()}")

    @property
    def width(self) -> int:
        """Bytes of one logical block: ``sub_blocks * block_len``."""
        return self.sub_blocks * self.block_len

    @property
    def logical_stride(self) -> int:
        """Bytes between logical blocks: ``sub_blocks * block_stride``."""
        return self.sub_blocks * self.block_stride

    @property
    def span(self) -> int:
        """Bytes from block 0's first byte to the last block's last byte."""
        return block_span(self.num_blocks * self.sub_blocks, self.block_stride, self.block_len)

    def pieces(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of each contiguous piece of block 0 (adjacent pieces joined)."""
        out: list[tuple[int, int]] = []
        for p in range(self.sub_blocks):
            off = p * self.block_stride
            if out and out[-1][0] + out[-1][1] == off:
                out[-1] = (out[-1][0], out[-1][1] + self.block_len)
            else:
                out.append((off, self.block_len))
        return out


def layout_block_region(flat: torch.Tensor, region: LayoutRegion, num_blocks: int,
                        name: str = "") -> BlockRegion:
    """The copy engine's view of one :class:`~kvconnect.peer_layout.PeerLayout` region (the
    one place a layout region becomes a :class:`BlockRegion`): ``num_blocks`` logical blocks
    of ``region.sub_blocks`` kernel blocks each, over ``flat`` (bounded to
    ``region.span(num_blocks)`` bytes from block 0). Raises ``ValueError`` as
    :class:`BlockRegion`."""
    return BlockRegion(flat, region.block_len, region.block_stride, num_blocks,
                       region.sub_blocks, name=name)


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of a transfer whose source and destination ids both go up by one.

    Returns ``(src_first, dst_first, length)`` triples in batch order: batch entries of one
    run move blocks ``[src_first, src_first + length)`` to ``[dst_first, dst_first +
    length)``. An empty batch gives an empty list.
    """
    runs: list[tuple[int, int, int]] = []
    n = len(src_ids)
    start = 0
    for i in range(1, n + 1):
        if i == n or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            runs.append((int(src_ids[start]), int(dst_ids[start]), i - start))
            start = i
    return runs


def kernel_available(device: torch.device | str | None = None) -> str | None:
    """None when the Triton block-copy kernel can run on ``device``, else why not."""
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return "the kernel needs a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    return None


@dataclass(frozen=True)
class _Column:
    src: int  # region index on the source side
    dst: int
    src_off: int  # bytes from the region's block 0
    dst_off: int
    length: int


def _pair_columns(si: int, s: BlockRegion, di: int, d: BlockRegion) -> list[_Column]:
    """Split one logical block of a region pair into byte ranges contiguous on both sides."""
    if s.width != d.width:
        raise ValueError(f"regions {s.name!r} and {d.name!r} hold {s.width} and {d.width} bytes "
                         "per logical block: they are not the same data")
    out = []
    sp, dp = s.pieces(), d.pieces()
    a = b = 0  # current piece on each side
    a_used = b_used = 0  # bytes of it already paired
    while a < len(sp) and b < len(dp):
        n = min(sp[a][1] - a_used, dp[b][1] - b_used)
        out.append(_Column(si, di, sp[a][0] + a_used, dp[b][0] + b_used, n))
        a_used += n
        b_used += n
        if a_used == sp[a][1]:
            a, a_used = a + 1, 0
        if b_used == dp[b][1]:
            b, b_used = b + 1, 0
    return out


class BlockCopyPlan:
    """Copies logical blocks from ``src`` regions to ``dst`` regions (paired by position).

    ``device``: where kernels and copy-engine batches run (``None`` or a CPU device: the
    ``host`` and ``torch`` methods). For a cross-GPU copy this decides push (the source's GPU
    writes into the peer) or pull (the destination's GPU reads). ``method``: the default of
    :meth:`copy` (``"auto"``: ``kernel`` where Triton and CUDA are present, else ``host``
    where the geometry allows it, else ``torch``). ``chunk_bytes``: the longest column
    (kernel work item); ``kernel_options``: launch shape overrides (``num_warps``,
    ``block_words``, ``column_major``, ``streaming``, ``items_per_program``: work items each
    kernel program copies) for measurements; ``launch``: how the
    kernel is issued (:data:`LAUNCH_MODES`). Validation happens here, once: the regions must
    pair up with equal bytes per logical block; every view is bounded. Not thread-safe: one
    plan is driven by one thread at a time.
    """

    def __init__(self, src: Sequence[BlockRegion], dst: Sequence[BlockRegion], *,
                 device: torch.device | str | None = None, method: str = "auto",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 kernel_options: dict[str, Any] | None = None, launch: str = "graph") -> None:
        if len(src) != len(dst) or not src:
            raise ValueError(f"a plan pairs regions one to one: got {len(src)} source and "
                             f"{len(dst)} destination regions")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if launch not in LAUNCH_MODES:
            raise ValueError(f"launch must be one of {LAUNCH_MODES}, got {launch!r}")
        self.src = list(src)
        self.dst = list(dst)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.src_blocks = min(r.num_blocks for r in self.src)
        self.dst_blocks = min(r.num_blocks for r in self.dst)
        self.bytes_per_block = sum(r.width for r in self.src)
        cols = [c for i, (s, d) in enumerate(zip(self.src, self.dst, strict=True))
                for c in _pair_columns(i, s, i, d)]
        self._columns = cols  # per region pair, before merging across regions (torch method)
        self.word = word_size(
            *(v for c in cols for v in (c.src_off, c.dst_off, c.length)),
            *(v for r in (*self.src, *self.dst) for v in (r.flat.data_ptr(), r.logical_stride)))
        self._merged = np.zeros((0, _ROW), dtype=np.int64)
        self._table = self._kernel_table(chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.launch = launch
        aligned = self.word < 16 and not np.any(self._table % 16)
        #: launch options of the kernel method (:func:`._triton_block_copy.launch_block_copy`)
        self._kernel_options: dict[str, Any] = {
            "num_columns": self.num_columns,
            "column_words": int(self._table[:, 4].max()) // self.word,
            "vec": 16 // self.word if aligned else 1,
            "even": bool(np.all(self._table[:, 4] == self._table[0, 4])),
            "column_major": True, "items_per_program": ITEMS_PER_PROGRAM,
            **(kernel_options or {})}
        items = self._kernel_options["items_per_program"]
        if type(items) is not int or items <= 0:
            raise ValueError(f"kernel option items_per_program must be a positive int, got "
                             f"{items!r}")
        self._host: HostRowCopier | str | None = None  # built on first need
        self._seen = np.zeros(self.dst_blocks, dtype=bool)  # check_ids' scratch marks
        self.method = self._resolve(method)
        self._launcher: KernelLauncher | None = None
        self._stream: Any = None

    # -- the descriptor table --------------------------------------------------------------
    def _kernel_table(self, chunk_bytes: int) -> np.ndarray:
        """``(columns, 5)`` int64 rows of absolute byte values: src address of block 0, src
        logical stride, dst address, dst logical stride, length. Columns contiguous on both
        sides with equal strides merge; then each is cut to at most ``chunk_bytes``."""
        rows: list[list[int]] = []
        for c in self._columns:
            s, d = self.src[c.src], self.dst[c.dst]
            row = [s.flat.data_ptr() + c.src_off, s.logical_stride,
                   d.flat.data_ptr() + c.dst_off, d.logical_stride, c.length]
            last = rows[-1] if rows else None
            if last is not None and last[1] == row[1] and last[3] == row[3] \
                    and last[0] + last[4] == row[0] and last[2] + last[4] == row[2]:
                last[4] += row[4]
            else:
                rows.append(row)
        self._merged = np.asarray(rows, dtype=np.int64).reshape(-1, _ROW)
        step = max(self.word, chunk_bytes - chunk_bytes % self.word)
        out = []
        for sa, ss, da, ds, n in rows:
            for off in range(0, n, step):
                out.append((sa + off, ss, da + off, ds, min(step, n - off)))
        return np.asarray(out, dtype=np.int64).reshape(-1, _ROW)

    @property
    def num_columns(self) -> int:
        """Work items per block of the kernel (descriptor table rows)."""
        return int(self._table.shape[0])

    def _host_copier(self) -> HostRowCopier | str:
        """The host method's copier, or why this plan has none."""
        if self._host is None:
            self._host = host_row_copier(self._merged, [r.flat for r in self.src],
                                         [r.flat for r in self.dst], (self.src, self.dst))
        return self._host

    def _resolve(self, method: str) -> str:
        if method == "auto":
            if kernel_available(self.device) is None:
                return "kernel"
            if self.device.type == "cpu" and isinstance(self._host_copier(), HostRowCopier):
                return "host"
            return "torch"
        if method not in COPY_METHODS:
            raise ValueError(f"unknown copy method {method!r}; choose from {COPY_METHODS}")
        if method == "kernel" and (why := kernel_available(self.device)):
            raise ValueError(f"copy method 'kernel' is unavailable on {self.device}: {why}")
        if method == "memcpy_batch" and self.device.type != "cuda":
            raise ValueError("copy method 'memcpy_batch' needs a CUDA launch device")
        if method == "host" and isinstance(host := self._host_copier(), str):
            raise ValueError(f"copy method 'host' is unavailable for this plan: {host}")
        return method

    # -- copies ----------------------------------------------------------------------------
    def copy(self, src_ids: BlockIds, dst_ids: BlockIds, *, method: str | None = None,
             validate: bool = True) -> int:
        """Copy logical blocks ``src_ids[i]`` to ``dst_ids[i]`` in every region pair.

        Asynchronous on CUDA (ordered on the launch device's current stream; the
        ``memcpy_batch`` method on a side stream joined back to it); synchronous on the host.
        Raises ``BlockIdsError`` for ids that are not ints (an int64 array passes unchanged),
        ``ValueError`` for mismatched lengths, ids out of range or destination ids repeated
        (``validate=False`` skips these checks for callers that made them already). Returns
        the bytes moved (``len(ids) * bytes_per_block``).
        """
        # negative ids: check_ids reports them with the valid range (or the caller did)
        src = as_block_ids(src_ids, "src_ids", allow_negative=True)
        dst = as_block_ids(dst_ids, "dst_ids", allow_negative=True)
        if src.size != dst.size:
            raise ValueError(f"{src.size} source ids but {dst.size} destination ids")
        if src.size == 0:
            return 0
        if validate:
            self.check_ids(src, dst)
        how = self.method if method is None else self._resolve(method)
        if how == "kernel":
            self.launcher().submit(src, dst)
        elif how == "memcpy_batch":
            self._copy_memcpy_batch(src, dst)
        elif how == "host":
            copier = self._host_copier()
            assert isinstance(copier, HostRowCopier)
            copier.copy(src, dst)
        else:
            self._copy_torch(src, dst)
        return int(src.size) * self.bytes_per_block

    def copy_many(self, requests: Sequence[tuple[BlockIds, BlockIds]], *,
                  method: str | None = None) -> int:
        """Several ``(src_ids, dst_ids)`` requests merged into **one** copy (one launch):
        destination ids must be distinct across all of them. Returns the bytes moved."""
        if not requests:
            return 0
        return self.copy(*merged_block_ids(requests, allow_negative=True), method=method)

    def check_ids(self, src: np.ndarray, dst: np.ndarray) -> None:
        """``ValueError`` unless every id is in range and no destination id repeats."""
        small = dst.size <= 32  # plain Python is faster than numpy's per-call cost here
        for ids, limit, side in ((src, self.src_blocks, "source"),
                                 (dst, self.dst_blocks, "destination")):
            values = ids.tolist() if small else ids
            lo, hi = (min(values), max(values)) if small else (int(ids.min()), int(ids.max()))
            if lo < 0 or hi >= limit:
                raise ValueError(f"{side} block ids must lie in [0, {limit}), got {lo}..{hi}")
        if small:
            repeated = len(set(dst.tolist())) != dst.size
        else:  # mark the ids in a scratch array: linear, no sort (np.unique costs 100+ us)
            seen = self._seen
            seen[dst] = True
            repeated = int(np.count_nonzero(seen)) != dst.size
            seen[dst] = False
        if repeated:
            raise ValueError("a destination block id appears twice in one copy")

    def _copy_torch(self, src: np.ndarray, dst: np.ndarray) -> None:
        runs = block_runs(src.tolist(), dst.tolist())
        dtype = WORD_DTYPES[self.word]
        index: tuple[torch.Tensor, torch.Tensor] | None = None
        for c in self._columns:
            s, d = self.src[c.src], self.dst[c.dst]
            sv = _column_view(s, c.src_off, c.length, dtype)
            dv = _column_view(d, c.dst_off, c.length, dtype)
            if len(runs) <= 2:
                for s0, d0, n in runs:
                    dv[d0:d0 + n].copy_(sv[s0:s0 + n], non_blocking=True)
                continue
            if index is None or index[0].device != sv.device or index[1].device != dv.device:
                index = (torch.from_numpy(src).to(sv.device, non_blocking=True),
                         torch.from_numpy(dst).to(dv.device, non_blocking=True))
            rows = sv.index_select(0, index[0])
            dv.index_copy_(0, index[1], rows.to(dv.device, non_blocking=True))

    def kernel_arguments(self, src: np.ndarray, dst: np.ndarray, device: torch.device
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """``(anchor, table, ids, options)`` for :func:`._triton_block_copy.launch_block_copy`
        on ``device`` without the launcher (for tests that run the kernel in Triton's
        interpreter on the host): the table as anchor-relative words, ``ids`` as the kernel
        reads them (``[live, 0, src0, dst0, ...]``), a grid of exactly ``len(src)`` blocks."""
        anchor, table = anchored_table(self._table, self.word, device)
        words = np.zeros(2 + 2 * src.size, dtype=np.int64)
        words[0] = src.size
        words[2::2], words[3::2] = src, dst
        ids = torch.from_numpy(words).to(device)
        return anchor, table, ids, {**self._kernel_options, "num_blocks": int(src.size)}

    def launcher(self) -> KernelLauncher:
        """The kernel method's launcher (device table, pinned id staging, CUDA graphs per
        id-count bucket), created on first use."""
        if self._launcher is None:
            self._launcher = KernelLauncher(self._table, self.word,
                                            dict(self._kernel_options), self.device,
                                            self.dst_blocks, self.launch)
        return self._launcher

    def warm_up(self, capture_all: bool = True) -> None:
        """Compile and load the kernel for this plan, upload its table and (``graph`` launch,
        ``capture_all``) capture every id-count bucket's graph now, so no later :meth:`copy`
        pays for any of it. No-op for other methods."""
        if self.method != "kernel":
            return
        self.launcher().warm_up(capture_all)

    def batch_descriptors(self, src: np.ndarray, dst: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(dst_addresses, src_addresses, sizes)`` of the ``memcpy_batch`` method: one copy
        per column and run (:func:`block_runs`) where the column is contiguous across blocks
        on both sides (stride == length), else one per column and block."""
        runs = np.asarray(block_runs(src.tolist(), dst.tolist()), dtype=np.int64).reshape(-1, 3)
        t = self._merged  # columns before the kernel's chunking: fewer, larger copies
        whole = (t[:, 1] == t[:, 4]) & (t[:, 3] == t[:, 4])
        srcs, dsts, sizes = [], [], []
        if whole.any():
            w = t[whole]
            srcs.append((w[:, None, 0] + runs[None, :, 0] * w[:, None, 1]).reshape(-1))
            dsts.append((w[:, None, 2] + runs[None, :, 1] * w[:, None, 3]).reshape(-1))
            sizes.append((w[:, None, 4] * runs[None, :, 2]).reshape(-1))
        if (~whole).any():
            p = t[~whole]
            srcs.append((p[:, None, 0] + src[None, :] * p[:, None, 1]).reshape(-1))
            dsts.append((p[:, None, 2] + dst[None, :] * p[:, None, 3]).reshape(-1))
            sizes.append(np.repeat(p[:, 4], src.size))
        return np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes)

    def _copy_memcpy_batch(self, src: np.ndarray, dst: np.ndarray) -> None:
        from ._cuda_memcpy_batch import memcpy_batch

        dsts, srcs, sizes = self.batch_descriptors(src, dst)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        memcpy_batch(dsts, srcs, sizes, self._stream.cuda_stream, self.device.index or 0)
        current.wait_stream(self._stream)

    def read_blocks(self, side: str, ids: BlockIds,
                    device: torch.device | str | None = None) -> torch.Tensor:
        """A copy of logical blocks ``ids`` of the ``"src"`` or ``"dst"`` side as one
        ``(len(ids), bytes_per_block)`` uint8 tensor on ``device`` (default: the first
        region's), regions in plan order. For checks and benchmarks, not the data path."""
        if side not in ("src", "dst"):
            raise ValueError(f"side must be 'src' or 'dst', got {side!r}")
        regions = self.src if side == "src" else self.dst
        idx = as_block_ids(ids, "ids")
        out = torch.device(device) if device is not None else regions[0].flat.device
        parts = []
        for c in self._columns:
            r = regions[c.src if side == "src" else c.dst]
            rows = _column_view(r, c.src_off if side == "src" else c.dst_off, c.length,
                                torch.uint8)
            parts.append(rows.index_select(0, torch.from_numpy(idx).to(rows.device)).to(out))
        return torch.cat(parts, dim=1)

    def describe(self) -> JSONObject:
        """JSON-able facts of the plan (for reports)."""
        lengths = self._table[:, 4]
        out = {"regions": len(self.src), "columns": self.num_columns,
               "bytes_per_block": self.bytes_per_block, "word": self.word,
               "chunk_bytes": self.chunk_bytes, "method": self.method,
               "device": str(self.device),
               "column_bytes": [int(lengths.min()), int(lengths.max())]}
        if self.method == "kernel":
            out.update(self._launcher.describe() if self._launcher is not None
                       else {"launch": self.launch})
        elif self.method == "host" and isinstance(self._host, HostRowCopier):
            out.update(self._host.describe())
        return out


def _column_view(r: BlockRegion, offset: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """``(num_blocks, length // word)`` view of one column of region ``r``, inside ``r.flat``."""
    flat = r.flat
    word = torch.empty(0, dtype=dtype).element_size()
    rows = flat.as_strided((r.num_blocks, length), (r.logical_stride, 1),
                           flat.storage_offset() + offset)
    if word == 1:
        return rows
    if r.num_blocks > 1 and r.logical_stride % word:
        raise ValueError(f"region {r.name!r}: stride {r.logical_stride} is not a multiple of "
                         f"{word}-byte words")
    return rows.view(dtype)

