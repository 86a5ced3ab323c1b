"""Probe: which engine moves scattered KV blocks fastest in host memory (issue 18, item 5).

One process, memfd-backed shared mappings like the host VMM backend's (touched once, so no
first-touch faults are timed). ``--blocks`` random source blocks of ``--run-kib`` bytes go to
random destination blocks (both sides 4x as large as the request). Each engine is timed over
``--reps`` copies (best and median), against a contiguous copy of the same bytes in the same
run (``numpy.copyto``, and torch's ``copy_``, which uses its thread pool):

- ``memmove-T``: one ``ctypes.memmove`` per run, the runs split over T Python threads
  (ctypes releases the GIL during each call);
- ``torch-rows``: ``index_select`` of whole runs into a staging tensor, then ``index_copy_``
  (torch's own threads, GIL released for the whole batch);
- ``torch-rows-direct``: ``dst.index_copy_(0, d, src.index_select(0, s))`` without staging
  reuse (what a one-liner costs);
- ``numpy-take``: ``np.take`` into a chunked buffer + fancy assignment (the engine before
  ``torch-rows``);
- ``numpy-void-T``: ``dst[d] = src[s]`` over views whose one element is a whole run (a void
  dtype of the run's bytes), in chunks of about 4 MiB, split over T threads;
- ``torch-i64-rows``: ``torch-rows`` over int64 views of the same rows;
- ``copy_file_range-T``: the kernel copies each run between the two memfds
  (``os.copy_file_range``), split over T threads;
- ``torch-i64-rows-chunk-M``: ``torch-i64-rows`` through a staging buffer of M MiB, chunk by
  chunk (does a cache-sized staging help?);
- ``process_vm_readv-T``: the kernel copies up to 1024 runs per call from this very process
  (iovec lists built by numpy, the GIL released for each whole call), split over T threads;
- ``engine-auto``, ``engine-torch-rows``, ``engine-memmove``: the library's
  :class:`HostRowCopier` (the ``host`` copy method) with that engine setting; the row's
  ``engine`` field names the engine that ran.

``--only`` keeps the engines whose names start with one of its prefixes (the references
always run).

    python benchmarks/probe_host_copy.py --mib 64 256 --json probe-host-copy.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from kvconnect.connectors.copy._host_block_copy import HostRowCopier, host_row_copier
from kvconnect.units import gbps

#: most iovecs per process_vm_readv call (Linux's UIO_MAXIOV)
IOV_MAX = 1024


def _shared(nbytes: int) -> tuple[np.ndarray, int]:
    """A memfd of ``nbytes`` mapped shared, every page touched, and the memfd (kept open for
    the process's life: the probe is one short process)."""
    fd = os.memfd_create("kvc-probe")
    os.ftruncate(fd, nbytes)
    m = mmap.mmap(fd, nbytes)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 1
    return a, fd


def _timed(fn: Any, reps: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _split(pool: ThreadPoolExecutor, fn: Any, n: int, parts: int) -> None:
    """``fn(lo, hi)`` over ``parts`` slices of ``range(n)`` on ``pool``."""
    cut = -(-n // parts)
    for f in [pool.submit(fn, i, min(n, i + cut)) for i in range(0, n, cut)]:
        f.result()


def _more_engines(src: np.ndarray, dst: np.ndarray, fds: tuple[int, int], s_idx: np.ndarray,
                  d_idx: np.ndarray, run: int, threads: list[int]) -> dict[str, Any]:
    """The void-dtype, int64-torch and copy_file_range candidates."""
    engines: dict[str, Any] = {}
    void = np.dtype((np.void, run))
    sv, dv = src.view(void), dst.view(void)
    step = max(1, (4 << 20) // run)
    so, do = (s_idx * run).tolist(), (d_idx * run).tolist()

    def void_slice(lo: int, hi: int) -> None:
        for i in range(lo, hi, step):
            j = min(hi, i + step)
            dv[d_idx[i:j]] = sv[s_idx[i:j]]

    def cfr_slice(lo: int, hi: int) -> None:
        cfr, (fs, fd) = os.copy_file_range, fds
        for x, y in zip(so[lo:hi], do[lo:hi], strict=True):
            cfr(fs, fd, run, x, y)
    for t in threads:
        pool = ThreadPoolExecutor(t)
        engines[f"numpy-void-{t}"] = (lambda p=pool, k=t: _split(p, void_slice, len(so), k))
        engines[f"copy_file_range-{t}"] = (lambda p=pool, k=t: _split(p, cfr_slice, len(so), k))
    ts = torch.from_numpy(src).view(torch.int64).view(-1, run // 8)
    td = torch.from_numpy(dst).view(torch.int64).view(-1, run // 8)
    si, di = torch.from_numpy(s_idx), torch.from_numpy(d_idx)
    stage = torch.empty((len(s_idx), run // 8), dtype=torch.int64)

    def rows64() -> None:
        torch.index_select(ts, 0, si, out=stage)
        td.index_copy_(0, di, stage)
    engines["torch-i64-rows"] = rows64
    for mib in (4, 16):
        step = max(1, (mib << 20) // run)

        def chunked(step: int = step) -> None:
            for i in range(0, len(s_idx), step):
                out = stage[:min(step, len(s_idx) - i)]
                torch.index_select(ts, 0, si[i:i + step], out=out)
                td.index_copy_(0, di[i:i + step], out)
        engines[f"torch-i64-rows-chunk-{mib}"] = chunked
    return engines


def _process_vm_engines(src: np.ndarray, dst: np.ndarray, s_idx: np.ndarray,
                        d_idx: np.ndarray, run: int, threads: list[int]) -> dict[str, Any]:
    """``process_vm_readv`` on this process: iovec lists (address, length) as numpy rows."""
    libc = ctypes.CDLL(None, use_errno=True)
    readv = libc.process_vm_readv
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
    local = np.empty((len(d_idx), 2), dtype=np.uint64)  # where the bytes go
    remote = np.empty((len(s_idx), 2), dtype=np.uint64)  # where they come from
    local[:, 0], local[:, 1] = dst.ctypes.data + d_idx * run, run
    remote[:, 0], remote[:, 1] = src.ctypes.data + s_idx * run, run
    pid = os.getpid()

    def pvm_slice(lo: int, hi: int) -> None:
        for i in range(lo, hi, IOV_MAX):
            m = min(IOV_MAX, hi - i)
            got = readv(pid, local[i:].ctypes.data, m, remote[i:].ctypes.data, m, 0)
            if got != m * run:
                raise OSError(ctypes.get_errno(), f"process_vm_readv moved {got} bytes")
    engines: dict[str, Any] = {}
    for t in threads:
        pool = ThreadPoolExecutor(t)
        engines[f"process_vm_readv-{t}"] = (
            lambda p=pool, k=t: _split(p, pvm_slice, len(s_idx), k))
    return engines


def _library_engines(src: np.ndarray, dst: np.ndarray, s_idx: np.ndarray, d_idx: np.ndarray,
                     run: int) -> dict[str, tuple[Any, HostRowCopier]]:
    """The library's host copier over the two mappings (one column: a block is a run)."""
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    columns = np.array([[src.ctypes.data, run, dst.ctypes.data, run, run]], dtype=np.int64)
    out = {}
    for engine in ("auto", "torch-rows", "memmove"):
        copier = host_row_copier(columns, [ts], [td], (ts, td), engine=engine)
        assert isinstance(copier, HostRowCopier), copier
        out[f"engine-{engine}"] = (lambda c=copier: c.copy(s_idx, d_idx), copier)
    return out


def _engines(src: np.ndarray, dst: np.ndarray, s_idx: np.ndarray, d_idx: np.ndarray,
             run: int, threads: list[int]) -> dict[str, Any]:
    sp, dp = src.ctypes.data, dst.ctypes.data
    so, do = (s_idx * run).tolist(), (d_idx * run).tolist()

    def memmove_slice(a: list[int], b: list[int]) -> None:
        move = ctypes.memmove
        for x, y in zip(a, b, strict=True):
            move(dp + y, sp + x, run)

    engines: dict[str, Any] = {}
    for t in threads:
        pool = ThreadPoolExecutor(t)
        cut = -(-len(so) // t)

        def mm(pool: ThreadPoolExecutor = pool, cut: int = cut) -> None:
            fs = [pool.submit(memmove_slice, so[i:i + cut], do[i:i + cut])
                  for i in range(0, len(so), cut)]
            for f in fs:
                f.result()
        engines[f"memmove-{t}"] = mm
    ts = torch.from_numpy(src).view(-1, run)
    td = torch.from_numpy(dst).view(-1, run)
    si, di = torch.from_numpy(s_idx), torch.from_numpy(d_idx)
    stage = torch.empty((len(s_idx), run), dtype=torch.uint8)

    def rows() -> None:
        torch.index_select(ts, 0, si, out=stage)
        td.index_copy_(0, di, stage)
    engines["torch-rows"] = rows
    engines["torch-rows-direct"] = lambda: td.index_copy_(0, di, ts.index_select(0, si))
    ns, nd = src.reshape(-1, run), dst.reshape(-1, run)
    step = max(1, (1 << 20) // run)
    buf = np.empty((step, run), dtype=np.uint8)

    def take() -> None:
        for i in range(0, len(s_idx), step):
            m = min(step, len(s_idx) - i)
            np.take(ns, s_idx[i:i + m], axis=0, out=buf[:m], mode="clip")
            nd[d_idx[i:i + m]] = buf[:m]
    engines["numpy-take"] = take
    return engines


def probe(mib: int, run_kib: int, reps: int, threads: list[int], only: list[str]
          ) -> dict[str, Any]:
    run = run_kib << 10
    nbytes = mib << 20
    blocks = nbytes // run
    src, src_fd = _shared(4 * nbytes)
    dst, dst_fd = _shared(4 * nbytes)
    rng = np.random.default_rng(0)
    s_idx = np.sort(rng.permutation(4 * blocks)[:blocks]).astype(np.int64)
    d_idx = rng.permutation(4 * blocks)[:blocks].astype(np.int64)
    src[:] = np.arange(src.size, dtype=np.uint64).astype(np.uint8)  # position-dependent
    rows: dict[str, Any] = {}
    ref = _timed(lambda: np.copyto(dst[:nbytes], src[:nbytes]), reps)
    tref = torch.from_numpy(dst[:nbytes])
    tsrc = torch.from_numpy(src[:nbytes])
    tref_t = _timed(lambda: tref.copy_(tsrc), reps)
    rows["reference numpy.copyto"] = ref
    rows["reference torch copy_"] = tref_t
    engines = _engines(src, dst, s_idx, d_idx, run, threads)
    engines.update(_more_engines(src, dst, (src_fd, dst_fd), s_idx, d_idx, run, threads))
    engines.update(_process_vm_engines(src, dst, s_idx, d_idx, run, threads))
    library = _library_engines(src, dst, s_idx, d_idx, run)
    engines.update({name: fn for name, (fn, _) in library.items()})
    for name, fn in engines.items():
        if only and not name.startswith(tuple(only)):
            continue
        dst[:] = 0
        try:
            times = _timed(fn, reps)
        except OSError as exc:  # e.g. process_vm_readv refused by a seccomp policy
            rows[name] = f"{type(exc).__name__}: {exc}"
            continue
        ok = all(np.array_equal(dst[d * run:(d + 1) * run], src[s * run:(s + 1) * run])
                 for s, d in zip(s_idx[:64].tolist(), d_idx[:64].tolist(), strict=True))
        rows[name] = times if ok else "wrong bytes"
    out = {"mib": mib, "run_kib": run_kib, "blocks": blocks, "engines": {}}
    best_ref = gbps(nbytes, min(min(ref), min(tref_t)))
    for name, times in rows.items():
        if isinstance(times, str):
            out["engines"][name] = {"error": times}
            continue
        best = gbps(nbytes, min(times))
        out["engines"][name] = {"best_gbps": round(best, 2),
                                "median_gbps": round(gbps(nbytes, statistics.median(times)), 2),
                                "ratio_to_best_reference": round(best / best_ref, 3)}
        if name in library:
            out["engines"][name]["engine"] = library[name][1].last_engine
        print(f"{mib:5d} MiB {run_kib:4d} KiB runs  {name:24s} {best:8.2f} GB/s  "
              f"ratio {best / best_ref:5.2f}", flush=True)
    return out  # the mappings close when their last view is collected


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--run-kib", type=int, nargs="+", default=[32])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only the engines whose names start with one of these")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                           "numpy": np.__version__},
               "probes": [probe(m, r, args.reps, args.threads, args.only)
                          for m in args.mib for r in args.run_kib]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
