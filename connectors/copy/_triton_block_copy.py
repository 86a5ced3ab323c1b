"""The Triton kernel behind :class:`~.block_copy.BlockCopyPlan`'s ``kernel`` method.

A *work item* is one column of one block; each program copies ``ITEMS`` consecutive items
(``items_per_program``, default 1: one program per item). Items are numbered column-major by
default (``COLUMN_MAJOR``): item ``t`` is column ``j = t // blocks`` and block ``i = t %
blocks``, so programs running at the same time work on few regions and, with sorted source
ids, on nearby addresses (few pages, few TLB misses); block-major numbering (``i = t //
columns``) is kept for measurements. Program ``p`` copies items ``p * ITEMS`` to ``p * ITEMS
+ ITEMS - 1``: with several items per program, fewer programs each amortise their start
(the table row and id loads) over more bytes, and a program's items are neighbouring blocks
of one column. An item reads row ``j`` of the descriptor table
(source word offset of block 0, source stride, destination offset, destination stride,
length; all in words from the *anchor*) and the pair of block ids ``i``, and copies
``length`` words. Addresses are anchor-relative offsets, so the only pointer argument Triton
checks is the anchor (a small allocation on the launch device); the copied memory may be a
VMM mapping of another process, a peer GPU's memory or pinned host memory, anything the
launch device can address.

The ids buffer (int64): ``[live, 0, src0, dst0, src1, dst1, ...]``. The grid covers
``num_blocks`` blocks (an id-count *bucket*, :mod:`._kernel_launch`), of which the first
``live`` are copied; items of the others are skipped at once. So one compiled launch, or one
captured CUDA graph, serves every batch of up to ``num_blocks`` blocks.

Importing this module imports Triton; :mod:`.block_copy` imports it only on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: words each loop iteration of a program moves (per program: ceil(column / BLOCK) steps)
BLOCK_WORDS = 1024
NUM_WARPS = 4


@triton.jit
def _copy_item(anchor, table, ids, i, j, COLUMN: tl.constexpr, BLOCK: tl.constexpr,
               VEC: tl.constexpr, EVEN: tl.constexpr, STREAMING: tl.constexpr):
    """Copy column ``j`` of the ``i``-th id pair (both int64 scalars, in range)."""
    row = table + j * 5
    src0 = tl.load(row)
    src_stride = tl.load(row + 1)
    dst0 = tl.load(row + 2)
    dst_stride = tl.load(row + 3)
    length = tl.load(row + 4)
    sid = tl.load(ids + 2 + 2 * i)
    did = tl.load(ids + 3 + 2 * i)
    so = tl.multiple_of(src0 + sid * src_stride, VEC)
    do = tl.multiple_of(dst0 + did * dst_stride, VEC)
    offs = tl.arange(0, BLOCK)
    for k in tl.static_range(0, COLUMN, BLOCK):
        if EVEN and STREAMING:  # evict early: every byte is touched once
            v = tl.load(anchor + so + k + offs, eviction_policy="evict_first")
            tl.store(anchor + do + k + offs, v, cache_modifier=".cs")
        elif EVEN:
            v = tl.load(anchor + so + k + offs)
            tl.store(anchor + do + k + offs, v)
        else:
            n = tl.multiple_of(length, VEC)
            m = k + offs < n
            v = tl.load(anchor + so + k + offs, mask=m)
            tl.store(anchor + do + k + offs, v, mask=m)


@triton.jit
def _block_copy_kernel(anchor, table, ids, num_blocks, num_columns, COLUMN: tl.constexpr,
                       BLOCK: tl.constexpr, VEC: tl.constexpr, EVEN: tl.constexpr,
                       COLUMN_MAJOR: tl.constexpr, STREAMING: tl.constexpr,
                       ITEMS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    live = tl.load(ids)  # blocks of this batch; the rest of the grid is the bucket's slack
    for q in tl.static_range(ITEMS):
        t = pid * ITEMS + q  # work item: one column of one block
        if COLUMN_MAJOR:
            j = t // num_blocks
            i = t - j * num_blocks
        else:
            i = t // num_columns
            j = t - i * num_columns
        if (i < live) & (j < num_columns):  # the last program may run past the items
            _copy_item(anchor, table, ids, i, j, COLUMN, BLOCK, VEC, EVEN, STREAMING)


def launch_block_copy(anchor: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, *,
                      num_blocks: int, num_columns: int, column_words: int, vec: int,
                      even: bool, column_major: bool = True, num_warps: int = NUM_WARPS,
                      block_words: int = BLOCK_WORDS, streaming: bool = False,
                      items_per_program: int = 1, compile_only: bool = False) -> None:
    """Launch one kernel over the ``num_blocks x num_columns`` work items (one column of
    one block each) on ``anchor``'s device (its current stream); ``ids`` holds the live block
    count and the id pairs (module docstring). ``column_words``: the longest column; ``vec``:
    a word count that divides every offset, stride and length (2 for 16-byte aligned int64
    words); ``even``: every column has exactly ``column_words`` words (no masks);
    ``column_major``: item numbering (module docstring); ``num_warps`` / ``block_words``:
    launch shape; ``streaming``: streaming cache hints on loads and stores (even columns
    only); ``items_per_program``: consecutive items each program copies (grid:
    :func:`._kernel_launch.grid_programs`); ``compile_only``: an empty grid with the same
    arguments (Triton compiles one variant per ``num_blocks`` class: 1, a multiple of 16, any
    other)."""
    block = min(block_words, triton.next_power_of_2(max(column_words, 1)))
    column = triton.cdiv(column_words, block) * block
    if even and column != column_words:
        even = False
    programs = triton.cdiv(num_blocks * num_columns, items_per_program)  # grid_programs()
    grid = (0 if compile_only else programs,)  # empty: compile, no launch
    _block_copy_kernel[grid](anchor, table, ids, num_blocks, num_columns,
                             COLUMN=column, BLOCK=block, VEC=vec, EVEN=even,
                             COLUMN_MAJOR=column_major, STREAMING=streaming,
                             ITEMS=items_per_program, num_warps=num_warps)
