"""The block-copy engine: descriptor tables, run merging, and every copy method byte-exact.

On the host: the ``torch`` method, the ``memcpy_batch`` descriptors applied with
``ctypes.memmove`` (the same addresses the driver would get), and, where Triton is installed,
the kernel itself in Triton's interpreter (a subprocess with ``TRITON_INTERPRET=1``). On a
GPU (``gpu`` marker): the kernel and ``cuMemcpyBatchAsync`` on real device memory, VMM
memory included, and pinned host memory through unified addressing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kvconnect.block_ids import as_block_ids
from kvconnect.connectors.copy._host_block_copy import HostRowCopier, host_row_copier
from kvconnect.connectors.copy._kernel_launch import bucket_sizes, grid_programs
from kvconnect.connectors.copy.block_copy import BlockCopyPlan, BlockRegion, block_runs

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _random_bytes(n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _layouts(num_blocks: int, device: str = "cpu", seed: int = 0
             ) -> tuple[list[BlockRegion], list[BlockRegion], list[torch.Tensor]]:
    """Source: a K/V-split cache of 3 layers (stride == len), a region with 2 kernel blocks
    per logical block at a padded stride, and a 48-byte region. Destination: a slot-major
    pool row holding every region side by side (a CPU offload pool's layout)."""
    keep = []
    src = []
    shapes = [(256, 256, 1), (256, 256, 1), (512, 512, 1), (128, 192, 2), (48, 48, 1)]
    for i, (blen, stride, sub) in enumerate(shapes):
        span = (num_blocks * sub - 1) * stride + blen
        flat = _random_bytes(span, seed + i, device)
        keep.append(flat)
        src.append(BlockRegion(flat, blen, stride, num_blocks, sub, name=f"r{i}"))
    row = sum(r.width for r in src)
    pool = torch.zeros(num_blocks * row, dtype=torch.uint8, device=device)
    keep.append(pool)
    dst, col = [], 0
    for r in src:
        view = pool[col:]
        dst.append(BlockRegion(view, r.width, row, num_blocks, 1, name=f"pool:{r.name}"))
        col += r.width
    return src, dst, keep


def _block_bytes(regions: list[BlockRegion], b: int) -> list[bytes]:
    out = []
    for r in regions:
        f = r.flat.cpu()
        parts = [f[(b * r.sub_blocks + p) * r.block_stride:][:r.block_len]
                 for p in range(r.sub_blocks)]
        out.append(torch.cat(parts).numpy().tobytes())
    return out


def _check(src: list[BlockRegion], dst: list[BlockRegion], before: list[list[bytes]],
           src_ids: list[int], dst_ids: list[int], num_blocks: int) -> None:
    moved = dict(zip(dst_ids, src_ids, strict=True))
    for b in range(num_blocks):
        got = _block_bytes(dst, b)
        want = _block_bytes(src, moved[b]) if b in moved else before[b]
        assert got == want, f"destination block {b} differs"


def _row_layouts(num_blocks: int, seed: int = 0
                 ) -> tuple[list[BlockRegion], list[BlockRegion], list[torch.Tensor]]:
    """Host regions with 4 KiB-multiple pieces (rows for the ``host`` method): two K/V-split
    regions, one with 2 kernel blocks per logical block at a padded stride, one of two
    contiguous 8 KiB regions sharing a tensor; destination: a slot-major pool row."""
    shapes = [(8192, 8192, 1), (4096, 12288, 2), (16384, 16384, 1)]
    spans = [(num_blocks * sub - 1) * stride + blen for blen, stride, sub in shapes]
    gap = 3 * 4096  # regions 4 KiB-aligned relative to each other, with unused bytes between
    base = _random_bytes(sum(spans) + gap * len(spans), seed)
    keep, src, off = [base], [], 0
    for i, ((blen, stride, sub), span) in enumerate(zip(shapes, spans, strict=True)):
        src.append(BlockRegion(base[off:off + span], blen, stride, num_blocks, sub,
                               name=f"r{i}"))
        off += span + gap
    row = sum(r.width for r in src)
    pool = torch.zeros(num_blocks * row, dtype=torch.uint8)
    keep.append(pool)
    dst, col = [], 0
    for r in src:
        dst.append(BlockRegion(pool[col:], r.width, row, num_blocks, 1, name=f"pool:{r.name}"))
        col += r.width
    return src, dst, keep


def _id_sets(kind: str, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Source and destination ids of ``n`` blocks: ``runs`` (consecutive on both sides),
    ``scattered`` (12 random on both) or ``single`` (one block)."""
    if kind == "runs":
        return list(range(3, 13)), list(range(10, 20))
    if kind == "scattered":
        rng = np.random.default_rng(seed)
        return rng.permutation(n)[:12].tolist(), rng.permutation(n)[:12].tolist()
    return [n - 1], [0]


def test_block_runs_merge_consecutive_pairs() -> None:
    assert block_runs([], []) == []
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    assert block_runs([1, 2, 3], [7, 6, 5]) == [(1, 7, 1), (2, 6, 1), (3, 5, 1)]
    # batch positions against pool slots: runs of consecutive slots
    slots = [0, 2, 3, 7, 8, 9, 1]
    assert block_runs(range(len(slots)), slots) == [(0, 0, 1), (1, 2, 2), (3, 7, 3), (6, 1, 1)]


def test_as_block_ids_takes_1d_integers_only() -> None:
    for ids in ([3, 1], (3, 1), np.array([3, 1], dtype=np.uint16), torch.tensor([3, 1]),
                iter([3, 1])):
        out = as_block_ids(ids, "ids")
        assert out.dtype == np.int64 and out.tolist() == [3, 1]
    assert as_block_ids([], "ids").tolist() == []
    for bad in ([True, 2], [1.0, 2], ["1"], np.zeros((2, 2), dtype=np.int64),
                torch.tensor([True]), torch.tensor([1.5]), torch.zeros(2, 2, dtype=torch.int64)):
        with pytest.raises(TypeError, match="remote_ids"):
            as_block_ids(bad, "remote_ids")
    # a bool anywhere in a short list (checked in Python) or a long one (through numpy) is
    # refused; the ints 0 and 1 are ids
    for n in (3, 100):
        for flag in (True, False):
            with pytest.raises(TypeError, match="bool"):
                as_block_ids([*range(2, n + 1), flag], "ids")
        ids = [0, *range(2, n), 1]
        assert as_block_ids(ids, "ids").tolist() == ids


@pytest.mark.parametrize("ids", ["runs", "scattered", "single"])
def test_torch_method_is_byte_exact(ids: str) -> None:
    n = 24
    src, dst, _keep = _layouts(n)
    plan = BlockCopyPlan(src, dst, method="torch")
    assert plan.bytes_per_block == sum(r.width for r in src)
    s_ids, d_ids = _id_sets(ids, n, seed=1)
    before = [_block_bytes(dst, b) for b in range(n)]
    assert plan.copy(s_ids, torch.tensor(d_ids)) == len(s_ids) * plan.bytes_per_block
    _check(src, dst, before, s_ids, d_ids, n)


def _force_engine(monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    """Make ``auto`` pick ``engine`` for every batch (through its thresholds)."""
    import kvconnect.connectors.copy._host_block_copy as hb

    monkeypatch.setattr(hb, "SMALL_BATCH_RUNS", 0)
    monkeypatch.setattr(hb, "TORCH_ROWS_MIN_THREADS", 1)
    monkeypatch.setattr(hb, "MEMMOVE_MIN_RUN_BYTES", 0 if engine == "memmove" else 1 << 40)


@pytest.mark.parametrize("engine", ["memmove", "torch-rows"])
@pytest.mark.parametrize("ids", ["runs", "scattered", "single"])
@pytest.mark.parametrize("direction", ["to_pool", "from_pool"])
def test_host_method_is_byte_exact(ids: str, direction: str, engine: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Both host engines (a memmove per merged run; torch gather + scatter of int64 rows)
    byte-exact, picked by ``auto``'s thresholds and reported by ``describe()``."""
    _force_engine(monkeypatch, engine)
    n = 24
    src, dst, _keep = _row_layouts(n)
    if direction == "from_pool":
        src, dst = dst, src
    plan = BlockCopyPlan(src, dst)
    assert plan.method == "host" and plan.describe()["row_bytes"] == 4096
    s_ids, d_ids = _id_sets(ids, n, seed=3)
    before = [_block_bytes(dst, b) for b in range(n)]
    assert plan.copy(np.array(s_ids), d_ids) == len(s_ids) * plan.bytes_per_block
    _check(src, dst, before, s_ids, d_ids, n)
    facts = plan.describe()
    assert facts["host_last_engine"] == engine and facts["host_element_bytes"] == 8


def test_host_auto_engine_follows_run_length_and_torch_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: memmove for few runs, long runs, or too few torch threads; else torch rows."""
    import kvconnect.connectors.copy._host_block_copy as hb

    src, dst, _keep = _row_layouts(40, seed=9)
    plan = BlockCopyPlan(src, dst)
    rng = np.random.default_rng(2)
    many = (rng.permutation(40)[:30], rng.permutation(40)[:30])  # ~120 runs of 4-16 KiB
    monkeypatch.setattr(hb, "TORCH_ROWS_MIN_THREADS", 1)
    plan.copy([5], [7])  # 4 runs (2 in the region of 2 kernel blocks)
    assert plan.describe()["host_last_engine"] == "memmove"
    plan.copy(*many)
    assert plan.describe()["host_last_engine"] == "torch-rows"
    monkeypatch.setattr(hb, "MEMMOVE_MIN_RUN_BYTES", 4096)
    plan.copy(*many)
    assert plan.describe()["host_last_engine"] == "memmove"
    monkeypatch.setattr(hb, "MEMMOVE_MIN_RUN_BYTES", 1 << 40)
    monkeypatch.setattr(hb, "TORCH_ROWS_MIN_THREADS", torch.get_num_threads() + 1)
    plan.copy(*many)
    assert plan.describe()["host_last_engine"] == "memmove"


def test_host_method_threads_a_large_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the parallel threshold the memmove engine splits the runs by bytes over its
    threads, byte-exact."""
    import kvconnect.connectors.copy._host_block_copy as hb

    _force_engine(monkeypatch, "memmove")
    monkeypatch.setattr(hb, "PARALLEL_MIN_BYTES", 1)
    pool = ThreadPoolExecutor(3)  # 3 threads: uneven byte shares
    monkeypatch.setattr(hb, "_pool", lambda: (pool, 3))
    n = 40
    src, dst, _keep = _row_layouts(n, seed=4)
    plan = BlockCopyPlan(src, dst, method="host")
    s_ids = np.random.default_rng(5).permutation(n)[:30]
    d_ids = np.random.default_rng(6).permutation(n)[:30]
    before = [_block_bytes(dst, b) for b in range(n)]
    try:
        plan.copy(s_ids, d_ids)
    finally:
        pool.shutdown()
    _check(src, dst, before, s_ids.tolist(), d_ids.tolist(), n)


def _one_region_copy(block: int, n: int, engine: str, s_ids: list[int], d_ids: list[int],
                     offset: int = 0, seed: int = 0) -> tuple[HostRowCopier, bool]:
    """A copier over one region of ``n`` back-to-back ``block``-byte blocks per side (each
    ``offset`` bytes into a buffer with guard bytes around it), forced to ``engine``; copies
    ``s_ids -> d_ids`` and says whether the whole destination buffer, guards included, holds
    exactly the expected bytes."""
    guard = 1024
    src_buf = _random_bytes(2 * guard + offset + n * block, seed)
    dst_buf = _random_bytes(src_buf.numel(), seed + 1)
    lo = guard + offset
    src, dst = src_buf[lo:lo + n * block], dst_buf[lo:lo + n * block]
    columns = np.array([[src.data_ptr(), block, dst.data_ptr(), block, block]], dtype=np.int64)
    copier = host_row_copier(columns, [src], [dst], (src_buf, dst_buf), engine=engine)
    assert isinstance(copier, HostRowCopier)
    want = dst_buf.clone()
    for s, d in zip(s_ids, d_ids, strict=True):
        want[lo + d * block:lo + (d + 1) * block] = src[s * block:(s + 1) * block]
    copier.copy(np.array(s_ids, dtype=np.int64), np.array(d_ids, dtype=np.int64))
    assert copier.last_engine == engine
    return copier, bool(torch.equal(dst_buf, want))


@pytest.mark.parametrize("engine", ["memmove", "torch-rows"])
@pytest.mark.parametrize(("block", "offset", "element"),
                         [(264, 0, 8), (300, 0, 4), (258, 0, 2), (257, 0, 1), (264, 4, 4)])
def test_host_engines_handle_rows_not_multiple_of_8(block: int, offset: int, element: int,
                                                    engine: str) -> None:
    """Rows (or a base address) not a multiple of 8 bytes: the torch engine falls back to
    the widest dividing integer; both engines byte-exact, also at the first and last block of
    each side (the ends of the row arrays), guard bytes untouched."""
    n = 16
    s_ids, d_ids = [15, 0, 3, 4, 9], [0, 15, 7, 8, 2]
    copier, exact = _one_region_copy(block, n, engine, s_ids, d_ids, offset)
    assert exact
    assert copier.row_bytes == block and copier.describe()["host_element_bytes"] == element


def test_host_torch_rows_chunks_large_batches_and_splits_wide_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch over the staging bound moves in chunks through a buffer that stays within the
    bound; rows wider than the torch row bound move as sub-rows; byte-exact."""
    import kvconnect.connectors.copy._host_block_copy as hb

    monkeypatch.setattr(hb, "STAGING_BYTES", 5 * 4096)  # 40 blocks: 8 chunks
    monkeypatch.setattr(hb, "TORCH_ROW_MAX_BYTES", 1024)
    monkeypatch.setattr(hb, "_STAGING", hb._Staging())
    rng = np.random.default_rng(11)
    s_ids, d_ids = rng.permutation(64)[:40].tolist(), rng.permutation(64)[:40].tolist()
    copier, exact = _one_region_copy(4096, 64, "torch-rows", s_ids, d_ids, seed=12)
    assert exact and copier.describe()["host_torch_row_bytes"] == 1024
    assert hb._STAGING._buf.numel() == 5 * 4096  # grown to the bound, not to the batch


def test_host_torch_rows_share_the_staging_buffer_across_threads() -> None:
    """Copiers driven from several threads at once (each plan from one thread) stay exact:
    the process's staging buffer is held for a whole copy."""
    rng = np.random.default_rng(13)
    jobs = [(rng.permutation(48)[:32].tolist(), rng.permutation(48)[:32].tolist(), seed)
            for seed in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda j: _one_region_copy(8192, 48, "torch-rows", j[0], j[1],
                                                           seed=j[2])[1], jobs * 3))
    assert all(results)


def test_host_engine_must_be_known() -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    columns = np.array([[buf.data_ptr(), 1024, buf.data_ptr(), 1024, 1024]], dtype=np.int64)
    with pytest.raises(ValueError, match="unknown host copy engine 'numpy'"):
        host_row_copier(columns, [buf], [buf], buf, engine="numpy")


def test_copy_many_is_one_copy_and_checks_ids_across_requests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    n = 16
    src, dst, _keep = _row_layouts(n, seed=8)
    plan = BlockCopyPlan(src, dst)
    calls = []
    real = HostRowCopier.copy
    monkeypatch.setattr(HostRowCopier, "copy",
                        lambda self, s, d: (calls.append(len(s)), real(self, s, d)))
    before = [_block_bytes(dst, b) for b in range(n)]
    moved = plan.copy_many([([1, 2], [5, 6]), (np.array([9]), [0]), ([], [])])
    assert moved == 3 * plan.bytes_per_block and calls == [3]
    _check(src, dst, before, [1, 2, 9], [5, 6, 0], n)
    with pytest.raises(ValueError, match="appears twice"):
        plan.copy_many([([1], [3]), ([2], [3])])
    with pytest.raises(ValueError, match="request 1"):
        plan.copy_many([([1], [3]), ([2, 4], [5])])
    assert plan.copy_many([]) == 0


def test_host_method_is_refused_for_narrow_rows_and_auto_falls_back() -> None:
    src, dst, _keep = _layouts(8)  # a 48-byte region: rows of 16 bytes at most
    with pytest.raises(ValueError, match="'host' is unavailable.*16-byte rows"):
        BlockCopyPlan(src, dst, method="host")
    assert BlockCopyPlan(src, dst).method == "torch"


def test_id_count_buckets() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert bucket_sizes(20) == [1, 2, 3, 4, 6, 8, 12, 16, 20]
    b = bucket_sizes(4096)
    assert b[-1] == 4096 and b == sorted(set(b)) and len(b) <= 2 * 12 + 1
    assert all(nxt <= 1.5 * cur + 1e-9 for cur, nxt in zip(b[2:], b[3:], strict=False))
    with pytest.raises(ValueError, match="positive"):
        bucket_sizes(0)


def test_grid_programs_cover_every_work_item_once() -> None:
    """Programs x items per program cover every (column, block) item, with less than one
    program's worth of overshoot (the kernel skips items past the end)."""
    for blocks, columns, items in ((4096, 8, 1), (4096, 8, 4), (7, 3, 4), (1, 1, 8),
                                   (512, 64, 3)):
        programs = grid_programs(blocks, columns, items)
        assert programs * items >= blocks * columns > (programs - 1) * items
    with pytest.raises(ValueError, match="items_per_program"):
        grid_programs(16, 8, 0)


def test_plan_refuses_a_bad_items_per_program() -> None:
    src, dst, _keep = _layouts(8)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="items_per_program"):
            BlockCopyPlan(src, dst, method="torch", kernel_options={"items_per_program": bad})
    plan = BlockCopyPlan(src, dst, method="torch", kernel_options={"items_per_program": 4})
    assert plan.kernel_arguments(np.arange(3), np.arange(3), torch.device("cpu"))[3][
        "items_per_program"] == 4


def test_table_merges_contiguous_columns_and_chunks_long_ones() -> None:
    n = 8
    base = _random_bytes(n * 1024, 3)
    # blocks-first: K and V halves of one block are adjacent on both sides -> one column
    src = [BlockRegion(base, 512, 1024, n, name="k"), BlockRegion(base[512:], 512, 1024, n,
                                                                   name="v")]
    out = torch.zeros_like(base)
    dst = [BlockRegion(out, 512, 1024, n, name="k"), BlockRegion(out[512:], 512, 1024, n,
                                                                  name="v")]
    assert BlockCopyPlan(src, dst, method="torch").num_columns == 1
    assert BlockCopyPlan(src, dst, method="torch", chunk_bytes=256).num_columns == 4
    d = BlockCopyPlan(src, dst, method="torch").describe()
    assert d["column_bytes"] == [1024, 1024] and d["word"] == 8


def test_plan_rejects_bad_geometry_and_ids() -> None:
    n = 4
    a = _random_bytes(n * 64, 0)
    b = torch.zeros(n * 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bounded view holds"):
        BlockRegion(a[:100], 64, 64, n)
    with pytest.raises(ValueError, match="per logical block"):
        BlockCopyPlan([BlockRegion(a, 64, 64, n)], [BlockRegion(b, 32, 64, n)], method="torch")
    with pytest.raises(ValueError, match="one to one"):
        BlockCopyPlan([BlockRegion(a, 64, 64, n)], [], method="torch")
    plan = BlockCopyPlan([BlockRegion(a, 64, 64, n)], [BlockRegion(b, 64, 64, n)],
                         method="torch")
    with pytest.raises(ValueError, match=r"lie in \[0, 4\)"):
        plan.copy([4], [0])
    with pytest.raises(ValueError, match="appears twice"):
        plan.copy([0, 1], [2, 2])
    with pytest.raises(ValueError, match="destination ids"):
        plan.copy([0, 1], [2])
    with pytest.raises(TypeError, match="bool"):
        plan.copy([True], [0])
    with pytest.raises(ValueError, match="unknown copy method"):
        plan.copy([0], [0], method="carrier-pigeon")
    with pytest.raises(ValueError, match="unavailable"):
        BlockCopyPlan([BlockRegion(a, 64, 64, n)], [BlockRegion(b, 64, 64, n)],
                      method="kernel")
    assert plan.copy([], []) == 0


@pytest.mark.parametrize("scattered", [False, True], ids=["runs", "scattered"])
def test_memcpy_batch_descriptors_move_the_right_bytes(scattered: bool) -> None:
    """The copy list the driver would get, applied with memmove on host memory."""
    n = 16
    src, _, _keep = _layouts(n, seed=5)
    # a second cache of the same geometry: its contiguous regions merge runs
    dst = [BlockRegion(torch.zeros_like(r.flat), r.block_len, r.block_stride, n, r.sub_blocks)
           for r in src]
    plan = BlockCopyPlan(src, dst, method="torch")
    if scattered:
        s_ids, d_ids = [9, 2, 14, 3], [0, 7, 8, 15]
    else:
        s_ids, d_ids = [4, 5, 6, 7, 8], [1, 2, 3, 4, 5]
    before = [_block_bytes(dst, b) for b in range(n)]
    dsts, srcs, sizes = plan.batch_descriptors(np.array(s_ids), np.array(d_ids))
    if not scattered:  # one run: one copy per contiguous column, one per block elsewhere
        assert len(sizes) == 3 + 2 * len(s_ids) + 1
        assert sizes.sum() == len(s_ids) * plan.bytes_per_block
    for d, s, k in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, k)
    _check(src, dst, before, s_ids, d_ids, n)


_INTERPRETER_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, torch
    sys.path.insert(0, {tests!r})
    from test_block_copy import _layouts, _block_bytes, _check
    from kvconnect.connectors.copy.block_copy import BlockCopyPlan
    from kvconnect.connectors.copy._triton_block_copy import launch_block_copy
    n = 12
    # items per program: 1 (one program per column of a block), 3 (the last program runs
    # past the items: 5 blocks x 6 or 17 columns), 16 (one program holds several columns)
    for chunk, major, items in ((64, True, 1), (32 * 1024, True, 1), (32 * 1024, False, 1),
                                (64, True, 3), (32 * 1024, False, 3), (64, True, 16)):
        src, dst, keep = _layouts(n, seed=7)
        plan = BlockCopyPlan(src, dst, method="torch", chunk_bytes=chunk,
                             kernel_options={{"column_major": major,
                                              "items_per_program": items}})
        s_ids, d_ids = np.array([11, 0, 5, 6, 7]), np.array([2, 3, 4, 10, 9])
        before = [_block_bytes(dst, b) for b in range(n)]
        anchor, table, ids, options = plan.kernel_arguments(s_ids, d_ids, torch.device("cpu"))
        launch_block_copy(anchor, table, ids, **options)
        _check(src, dst, before, s_ids.tolist(), d_ids.tolist(), n)
        print("columns", plan.num_columns, "ok")
    # a bucket's grid over 8 blocks with 3 live: the slack pairs (here 11 -> 1) stay uncopied
    src, dst, keep = _layouts(n, seed=9)
    plan = BlockCopyPlan(src, dst, method="torch")
    s_ids, d_ids = np.array([4, 8, 2]), np.array([7, 0, 5])
    before = [_block_bytes(dst, b) for b in range(n)]
    anchor, table, ids, options = plan.kernel_arguments(np.array([4, 8, 2] + [11] * 5),
                                                        np.array([7, 0, 5] + [1] * 5),
                                                        torch.device("cpu"))
    ids[0] = 3
    launch_block_copy(anchor, table, ids, **options)
    _check(src, dst, before, s_ids.tolist(), d_ids.tolist(), n)
    print("slack ok")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed here")
def test_kernel_in_triton_interpreter_is_byte_exact() -> None:
    """The real kernel source and descriptor table, run by Triton's interpreter on host
    memory (addresses are anchor-relative, as on the GPU)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = _INTERPRETER_SCRIPT.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == 7 and "slack ok" in proc.stdout


# -- on a GPU ------------------------------------------------------------------------------
def _gpu_methods() -> list[str]:
    return ["kernel", "memcpy_batch", "torch"]


@pytest.mark.gpu
@pytest.mark.parametrize("method", _gpu_methods())
def test_gpu_methods_are_byte_exact(method: str) -> None:
    from kvconnect.connectors.copy._cuda_memcpy_batch import memcpy_batch_available

    if method == "memcpy_batch" and (why := memcpy_batch_available()):
        pytest.skip(why)
    n = 64
    src, dst, _keep = _layouts(n, "cuda:0", seed=11)
    plan = BlockCopyPlan(src, dst, device="cuda:0", method=method)
    rng = np.random.default_rng(2)
    s_ids = rng.permutation(n)[:40].tolist()
    d_ids = rng.permutation(n)[:40].tolist()
    before = [_block_bytes(dst, b) for b in range(n)]
    plan.copy(s_ids, d_ids)
    torch.cuda.synchronize()
    _check(src, dst, before, s_ids, d_ids, n)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kernel", "memcpy_batch"])
def test_gpu_vmm_to_pinned_pool_and_back(method: str) -> None:
    """VMM memory of an ExtensibleTensor into a pinned host pool (unified addressing) and
    back into other blocks: the CPU offload's direct path."""
    from kvconnect.connectors.copy._cuda_memcpy_batch import memcpy_batch_available
    from kvconnect.tensor import ExtensibleTensor

    if method == "memcpy_batch" and (why := memcpy_batch_available()):
        pytest.skip(why)
    n, blen = 32, 32 * 1024
    with ExtensibleTensor(64 << 20, "cuda:0") as t:
        t.commit(n * blen)
        flat = t.committed_view(0, n * blen)
        flat.copy_(_random_bytes(n * blen, 3, "cuda:0"))
        pool = torch.zeros(n * blen, dtype=torch.uint8, pin_memory=True)
        cache = [BlockRegion(flat, blen, blen, n)]
        slots = [BlockRegion(pool, blen, blen, n)]
        out = BlockCopyPlan(cache, slots, device="cuda:0", method=method)
        back = BlockCopyPlan(slots, cache, device="cuda:0", method=method)
        ids = [5, 6, 7, 30, 1]
        want = [flat[b * blen:(b + 1) * blen].cpu().clone() for b in ids]
        out.copy(ids, [0, 1, 2, 3, 4])
        torch.cuda.synchronize()
        for i, w in enumerate(want):
            assert torch.equal(pool[i * blen:(i + 1) * blen], w)
        back.copy([0, 1, 2, 3, 4], [10, 11, 12, 20, 21])
        torch.cuda.synchronize()
        for b, w in zip([10, 11, 12, 20, 21], want, strict=True):
            assert torch.equal(flat[b * blen:(b + 1) * blen].cpu(), w)


@pytest.mark.gpu
@pytest.mark.parametrize("launch", ["graph", "eager"])
def test_gpu_kernel_launches_are_byte_exact_across_buckets(launch: str) -> None:
    """Counts inside, at and just past id-count buckets, one plan, each copy checked."""
    from kvconnect.connectors.copy.block_copy import kernel_available

    if why := kernel_available("cuda:0"):
        pytest.skip(why)
    n = 64
    src, dst, _keep = _layouts(n, "cuda:0", seed=13)
    plan = BlockCopyPlan(src, dst, device="cuda:0", method="kernel", launch=launch)
    plan.warm_up()
    facts = plan.describe()
    assert facts["launch"] == launch and facts["max_blocks"] == n
    assert (facts["graphs"] == facts["buckets"]) if launch == "graph" else facts["graphs"] == 0
    rng = np.random.default_rng(4)
    for k in (1, 2, 3, 5, 16, 17, 40, 64):
        s_ids = rng.permutation(n)[:k].tolist()
        d_ids = rng.permutation(n)[:k].tolist()
        before = [_block_bytes(dst, b) for b in range(n)]
        plan.copy(s_ids, d_ids)
        torch.cuda.synchronize()
        _check(src, dst, before, s_ids, d_ids, n)


@pytest.mark.gpu
def test_gpu_copies_in_flight_never_share_a_staging_slot() -> None:
    """Many copies of one bucket queued behind a slow kernel, never waited for one by one:
    each keeps its own ids (the ring grows, then the oldest slot is waited for)."""
    from kvconnect.connectors.copy._kernel_launch import MAX_SLOTS
    from kvconnect.connectors.copy.block_copy import kernel_available

    if why := kernel_available("cuda:0"):
        pytest.skip(why)
    n = 48
    src, dst, _keep = _layouts(n, "cuda:0", seed=17)
    plan = BlockCopyPlan(src, dst, device="cuda:0", method="kernel")
    plan.warm_up()
    before = [_block_bytes(dst, b) for b in range(n)]
    big = torch.empty(1 << 28, dtype=torch.uint8, device="cuda:0")
    big.fill_(1)  # keeps the stream busy while the copies are queued
    pairs = [([3 * i, 3 * i + 1], [47 - 2 * i, 46 - 2 * i]) for i in range(12)]
    for s_ids, d_ids in pairs:
        plan.copy(s_ids, d_ids)
    torch.cuda.synchronize()
    _check(src, dst, before, [s for p in pairs for s in p[0]], [d for p in pairs for d in p[1]],
           n)
    assert plan.describe()["slots"] <= len(plan.launcher().buckets) + MAX_SLOTS


@pytest.mark.gpu
def test_gpu_graph_capture_failure_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    from kvconnect.connectors.copy.block_copy import kernel_available

    if why := kernel_available("cuda:0"):
        pytest.skip(why)

    def refuse(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError("capture refused for this test")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", refuse)
    n = 16
    src, dst, _keep = _layouts(n, "cuda:0", seed=19)
    plan = BlockCopyPlan(src, dst, device="cuda:0", method="kernel")
    with caplog.at_level("WARNING"):
        plan.warm_up()
    assert plan.describe()["launch"] == "eager" and "capture failed" in caplog.text
    before = [_block_bytes(dst, b) for b in range(n)]
    plan.copy([1, 2, 3], [9, 8, 7])
    torch.cuda.synchronize()
    _check(src, dst, before, [1, 2, 3], [9, 8, 7], n)
