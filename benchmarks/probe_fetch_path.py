"""Probe: where a same-GPU block copy loses against a device-to-device copy.

Two questions, one GPU, one process:

1. **Memory** (``--part memory``): the block-copy kernel alone (CUDA events around
   ``--reps`` back-to-back copies, host work hidden) over 64 regions of ``--block-kib``
   pages, random ids (sorted source, shuffled destination, 2x as many blocks as copied), on
   memory allocated different ways: ``cudamalloc-64`` (one torch allocation per region),
   ``cudamalloc-1`` (one allocation, regions inside), ``vmm`` (one cuMemCreate handle mapped
   at a reservation aligned to the 2 MiB granule), ``vmm-1g`` (the same, reservation aligned
   to 1 GiB), ``vmm-alias`` (source read through a second mapping of the exported and
   re-imported handle, as an ipc peer mapping is), ``kvcache`` (two ExtensibleKVCaches of
   the llama3-8b-like layout, regions as the ipc transport pairs them), ``ipc-peer`` (the ipc
   transport's own plan: the source cache in a second process, mapped here). Reference: a
   contiguous d2d copy of the same bytes timed the same way.
2. **Host work** (``--part host``): a whole copy of 1 and 16 blocks (``plan.copy`` + an
   event + its wait) and its pieces, for the graph replay through ``cuGraphLaunch``, through
   torch's ``replay()``, and eager launches; then a cProfile of many such copies.
3. **Geometry and launch shape** (``--part shapes``): the harness preset (8 regions of 32
   KiB pages, 4096 blocks per GiB, every block of the cache) against 64 regions, same bytes.
   Per launch shape (:data:`SHAPES`): the kernel alone (CUDA events), the fetch as
   ``IpcTransport`` times it (list ids; and its pieces), with array ids, and pipelined
   (``--slice-ids``); ``--ipc``: ``IpcTransport.fetch`` from a second process, as the
   harness sweep reports it. Reference: a d2d copy, by events and as the harness times it.

    python benchmarks/probe_fetch_path.py --json probe.json
    python benchmarks/probe_fetch_path.py --part shapes --ipc --json shapes.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from transfer_timing import events_ms as _events_ms  # benchmarks/ is sys.path[0]

from kvconnect.connectors.copy.block_copy import BlockCopyPlan, BlockRegion

MIB = 1024 * 1024
REGIONS = 64
DEV = torch.device("cuda:0")


def _vmm_flat(nbytes: int, alignment: int, alias: bool, keep: list[Any]) -> torch.Tensor:
    from kvconnect._pointer_view import bytes_tensor
    from kvconnect.vmm import AllocationOptions, get_vmm_driver

    drv = get_vmm_driver("cuda:0")
    gran = drv.granularity(AllocationOptions(shareable=True))
    size = -(-nbytes // gran) * gran
    h = drv.create(size, options=AllocationOptions(shareable=True))
    va = drv.reserve(size, alignment)
    drv.map(va, size, h)
    drv.set_access(va, size)
    keep.append((drv, va, size, h))
    if alias:
        fd = drv.export_fd(h)
        h2 = drv.import_fd(fd, size)
        import os

        os.close(fd)
        va2 = drv.reserve(size, alignment)
        drv.map(va2, size, h2)
        drv.set_access(va2, size)
        keep.append((drv, va2, size, h2))
        va = va2
    return bytes_tensor(va, nbytes, DEV, keep)


def _release(keep: list[Any]) -> None:
    for item in reversed(keep):
        if isinstance(item, tuple):
            drv, va, size, h = item
            drv.unmap_and_release(va, size, h)
            drv.free_reserved(va, size)
        elif type(item).__name__ == "ExtensibleKVCache":
            item.close(force=True)
        elif hasattr(item, "close"):
            item.close()
    keep.clear()


def _flats(kind: str, nb: int, blen: int, keep: list[Any]) -> list[torch.Tensor]:
    span = nb * blen
    if kind == "cudamalloc-64":
        return [torch.empty(span, dtype=torch.uint8, device=DEV) for _ in range(REGIONS)]
    if kind == "cudamalloc-1":
        big = torch.empty(span * REGIONS, dtype=torch.uint8, device=DEV)
    elif kind in ("vmm", "vmm-1g", "vmm-alias"):
        big = _vmm_flat(span * REGIONS, (1 << 30) if kind == "vmm-1g" else 0,
                        kind == "vmm-alias", keep)
    else:
        raise ValueError(kind)
    return [big[i * span:(i + 1) * span] for i in range(REGIONS)]


def _kvcache_regions(nb: int, block_kib: int, keep: list[Any], regions: int = REGIONS
                     ) -> list[BlockRegion]:
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.views import page_holders
    from kvconnect.vmm import AllocationOptions

    cfg = preset("llama3-8b-like", num_blocks=nb, num_layers=regions // 2,
                 block_size=block_kib * 1024 // (8 * 128 * 2))
    cache = ExtensibleKVCache(cfg, str(DEV), capacity_blocks=2 * nb,
                              options=AllocationOptions(shareable=True))
    cache.allocate()
    cache.extend_kv_cache(nb, single_handle=True)
    keep.append(cache)
    out = []
    for r, _members in page_holders(cache.committed_regions()):
        t = cache.tensors[r.tensor_index]
        out.append(BlockRegion(t.committed_view(r.base_ptr - t.base_ptr, r.span), r.block_len,
                               r.block_stride, nb, r.num_blocks // nb))
    return out


def _ipc_peer_plan(nb: int, block_kib: int, keep: list[Any]) -> BlockCopyPlan:
    """The ipc transport's own plan: the source is a second process's kvcache (served by
    bench_transfer.py --serve), mapped here; the destination a kvcache of this process."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_transfer import _Server

    from kvconnect.connectors.ipc.transport import IpcTransport

    dst = _kvcache_regions(nb, block_kib, keep)
    cache = keep[-1]
    server = _Server(argparse.Namespace(num_layers=REGIONS // 2, nixl=False), block_kib, nb,
                     "cuda:0")
    keep.append(server)
    t = IpcTransport(cache)
    keep.append(t)
    t.open_peer("serve", server.offers["ipc"])
    del dst
    return t.plan_for("serve")


def part_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    blen = args.block_kib * 1024
    rng = np.random.default_rng(0)
    for mib in args.mib:
        k = max(1, mib * MIB // (REGIONS * blen))
        nb = 2 * k
        nbytes = k * REGIONS * blen
        a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).fill_(3)
        b = torch.empty_like(a)
        ref = _events_ms(lambda a=a, b=b: b.copy_(a), args.reps, 5)
        s_ids = np.sort(rng.permutation(nb)[:k])
        d_ids = rng.permutation(nb)[:k]
        for kind in args.kinds:
            keep: list[Any] = []
            try:
                if kind == "kvcache":
                    src = _kvcache_regions(nb, args.block_kib, keep)
                    dst = _kvcache_regions(nb, args.block_kib, keep)
                elif kind == "ipc-peer":
                    plan = _ipc_peer_plan(nb, args.block_kib, keep)
                    src, dst = plan.src, plan.dst
                else:
                    src = [BlockRegion(f, blen, blen, nb) for f in _flats(kind, nb, blen, keep)]
                    dkind = "vmm" if kind == "vmm-alias" else kind
                    dst = [BlockRegion(f, blen, blen, nb) for f in _flats(dkind, nb, blen, keep)]
                if kind != "ipc-peer":
                    for r in src:
                        r.flat.fill_(1)
                    plan = BlockCopyPlan(src, dst, device=DEV, method="kernel")
                    plan.warm_up()
                ms = _events_ms(lambda p=plan, s=s_ids, d=d_ids: p.copy(s, d, validate=False),
                                args.reps, 5)
                ok = bool(torch.equal(plan.read_blocks("src", s_ids),
                                      plan.read_blocks("dst", d_ids)))
                row = {"part": "memory", "kind": kind, "request_bytes": nbytes,
                       "block_bytes": blen, "kernel_ms": ms, "d2d_ms": ref,
                       "ratio": ref / ms, "verified": ok}
            except Exception as exc:  # noqa: BLE001 - a kind that cannot be built is a finding
                row = {"part": "memory", "kind": kind, "request_bytes": nbytes,
                       "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            print(json.dumps(row), flush=True)
            plan = src = dst = None  # noqa: F841 - drop every view before unmapping
            torch.cuda.synchronize()
            _release(keep)
            torch.cuda.empty_cache()
        del a, b
    return rows


def _percentile(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(len(v) * q))]


def _completed(timeout: float = 30.0) -> float:
    """Wait (event + poll, as the transport does) until the current stream's work is done;
    returns ``time.perf_counter()`` then."""
    from kvconnect.connectors.copy._kernel_launch import wait_events

    ev = torch.cuda.Event()
    ev.record()
    wait_events([ev], timeout)
    return time.perf_counter()


def _time_one_copy(plan: BlockCopyPlan, nb: int, k: int, rng: np.random.Generator,
                   iters: int) -> dict[str, float]:
    """p50 microseconds of the pieces of ``iters`` whole copies of ``k`` random blocks (ids
    -> array + checks, ``plan.copy``, event + completion wait) and of a plain copy of the same
    bytes, interleaved; plus the p99 of the whole and of the plain copy."""
    from kvconnect.block_ids import as_block_ids

    a = torch.empty(k * plan.bytes_per_block, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    times: dict[str, list[float]] = {n: [] for n in ("whole", "ids", "submit", "wait",
                                                     "plain_copy")}
    for i in range(iters + 20):
        s_ids = rng.permutation(nb)[:k].tolist()
        d_ids = rng.permutation(nb)[:k].tolist()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s_arr, d_arr = as_block_ids(s_ids, "s"), as_block_ids(d_ids, "d")
        plan.check_ids(s_arr, d_arr)
        t1 = time.perf_counter()
        plan.copy(s_arr, d_arr, validate=False)
        t2 = time.perf_counter()
        t3 = _completed()
        torch.cuda.synchronize()
        r0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        r1 = time.perf_counter()
        if i >= 20:  # warm-up: ring growth, first replays
            for n, v in (("whole", t3 - t0), ("ids", t1 - t0), ("submit", t2 - t1),
                         ("wait", t3 - t2), ("plain_copy", r1 - r0)):
                times[n].append(v)
    out = {f"{n}_us_p50": statistics.median(v) * 1e6 for n, v in times.items()}
    out["whole_us_p99"] = _percentile(times["whole"], 0.99) * 1e6
    out["plain_copy_us_p99"] = _percentile(times["plain_copy"], 0.99) * 1e6
    return out


def part_host(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Host work of whole small copies, per launch mode, and a cProfile of many."""
    from kvconnect.connectors.copy._kernel_launch import wait_events

    rows = []
    blen = args.block_kib * 1024
    nb = 512
    keep: list[Any] = []
    src = [BlockRegion(f, blen, blen, nb) for f in _flats("cudamalloc-1", nb, blen, keep)]
    dst = [BlockRegion(f, blen, blen, nb) for f in _flats("cudamalloc-1", nb, blen, keep)]
    rng = np.random.default_rng(1)
    for mode in ("driver", "torch-replay", "eager"):
        plan = BlockCopyPlan(src, dst, device=DEV, method="kernel",
                             launch="eager" if mode == "eager" else "graph")
        plan.warm_up()
        if mode == "torch-replay":  # replay() instead of cuGraphLaunch
            for bk in plan.launcher()._bucket.values():
                for s in bk.slots:
                    s.graph_exec = 0
        for k in (1, 16):
            rows.append({"part": "host", "mode": mode, "blocks": k,
                         **_time_one_copy(plan, nb, k, rng, args.host_iters)})
            print(json.dumps(rows[-1]), flush=True)
    plan = BlockCopyPlan(src, dst, device=DEV, method="kernel")
    plan.warm_up()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        plan.copy([5], [7])
        ev = torch.cuda.Event()
        ev.record()
        wait_events([ev], 10.0)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue())
    rows.append({"part": "host-profile", "text": out.getvalue()[-6000:]})
    return rows


def part_offload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """cProfile of CPU offload saves + loads of 16 blocks (32 MiB), each path."""
    from kvconnect.connectors.offload.connector import CPUOffloadConnector
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset

    rows = []
    cache = ExtensibleKVCache(preset("llama3-8b-like", num_blocks=1024), "cuda:0")
    cache.allocate()
    cache.extend_kv_cache(1024)
    try:
        for path in ("direct", "staged"):
            conn = CPUOffloadConnector(cache, 64, path=path)
            ids = list(range(100, 116))
            for _ in range(5):
                conn.save(ids).wait()
                conn.load(ids).wait()
            prof = cProfile.Profile()
            times = []
            prof.enable()
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                conn.save(ids).wait()
                times.append(time.perf_counter() - t0)
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
            print(path, "save 32 MiB p50 us (profiled)", statistics.median(times) * 1e6)
            print(out.getvalue())
            rows.append({"part": "offload-profile", "path": path,
                         "save_us_p50_profiled": statistics.median(times) * 1e6,
                         "text": out.getvalue()[-6000:]})
            conn.close()
    finally:
        cache.close(force=True)
    return rows


#: launch shapes the ``shapes`` part compares: name -> (chunk_bytes, kernel_options)
SHAPES: dict[str, tuple[int, dict[str, Any]]] = {
    "default": (32 * 1024, {}),
    "items2": (32 * 1024, {"items_per_program": 2}),
    "items4": (32 * 1024, {"items_per_program": 4}),
    "items8": (32 * 1024, {"items_per_program": 8}),
    "chunk16k": (16 * 1024, {}),
    "warps8": (32 * 1024, {"num_warps": 8}),
    "bw2048": (32 * 1024, {"block_words": 2048}),
    "bw4096": (32 * 1024, {"block_words": 4096}),  # a 32 KiB column loaded in one step
    "bw4096w8": (32 * 1024, {"block_words": 4096, "num_warps": 8}),
    "streaming": (32 * 1024, {"streaming": True}),
}


def _fetch_like(plan: BlockCopyPlan, remote: Any, local: Any, iters: int,
                slice_ids: int = 0) -> dict[str, float]:
    """p50 microseconds of ``iters`` copies timed as ``IpcTransport.fetch`` times its
    ``seconds``, and of the pieces; ids as lists (as the harness passes them) or arrays.
    ``slice_ids``: convert, check and launch that many ids at a time (a pipelined fetch)."""
    from kvconnect.block_ids import as_block_ids

    n = len(remote)
    times: dict[str, list[float]] = {k: [] for k in ("whole", "ids", "check", "submit", "wait")}
    for i in range(iters + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if slice_ids:
            for lo in range(0, n, slice_ids):
                s_arr = as_block_ids(remote[lo:lo + slice_ids], "remote_ids")
                d_arr = as_block_ids(local[lo:lo + slice_ids], "local_ids")
                plan.check_ids(s_arr, d_arr)
                plan.copy(s_arr, d_arr, validate=False)
            t1 = t2 = t3 = time.perf_counter()
        else:
            s_arr, d_arr = as_block_ids(remote, "remote_ids"), as_block_ids(local, "local_ids")
            t1 = time.perf_counter()
            plan.check_ids(s_arr, d_arr)
            t2 = time.perf_counter()
            plan.copy(s_arr, d_arr, validate=False)
            t3 = time.perf_counter()
        t4 = _completed()
        if i >= 3:
            for k, v in (("whole", t4 - t0), ("ids", t1 - t0), ("check", t2 - t1),
                         ("submit", t3 - t2), ("wait", t4 - t3)):
                times[k].append(v)
    return {f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items()}


def _host_timed_copy_us(nbytes: int, reps: int) -> float:
    """Median microseconds of one contiguous d2d torch copy timed as the harness's
    reference is (synchronize, copy, synchronize)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).fill_(5)
    b = torch.empty_like(a)
    out = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def _single_copy_ms(fn: Any, reps: int) -> float:
    """Median milliseconds of one call of ``fn`` alone between two CUDA events."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _id_conversion_us(ids: list[int]) -> dict[str, float]:
    """Microseconds to turn one Python list of ids into int64 values, three ways."""
    import array
    import struct
    import timeit

    ways = {"array": lambda: array.array("q", ids), "fromiter": lambda: np.fromiter(
        ids, np.int64, len(ids)), "struct": lambda: struct.pack(f"{len(ids)}q", *ids)}
    return {f"list_to_int64_{k}_us": min(timeit.repeat(f, number=20, repeat=5)) / 20 * 1e6
            for k, f in ways.items()}


def _shape_ids(regions: int, nb: int, k: int) -> tuple[list[int], list[int]]:
    """Ids as the harness sweep makes them: a seeded sorted sample, a shuffled sample."""
    import random

    rng = random.Random(f"probe/{regions}/{nb}/{k}")
    return sorted(rng.sample(range(nb), k)), rng.sample(range(nb), k)


def _shape_row(args: argparse.Namespace, shape: str, src: list[BlockRegion],
               dst: list[BlockRegion], base: dict[str, Any], ids: tuple[list[int], list[int]],
               want: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor]:
    """One launch shape on one geometry: checked byte-exact, then the kernel alone and the
    fetch-like timings. Returns the row and the source blocks read (reused as ``want``)."""
    remote, local = ids
    s_arr, d_arr = np.asarray(remote), np.asarray(local)
    chunk, options = SHAPES[shape]
    plan = BlockCopyPlan(src, dst, device=DEV, method="kernel", chunk_bytes=chunk,
                         kernel_options=options)
    plan.warm_up()
    for r in dst:
        r.flat.zero_()
    plan.copy(s_arr, d_arr)
    if want is None:
        want = plan.read_blocks("src", s_arr)
    ok = bool(torch.equal(plan.read_blocks("dst", d_arr), want))

    def copy() -> None:
        plan.copy(s_arr, d_arr, validate=False)

    row = {**base, "shape": shape, "chunk_bytes": chunk, "options": options,
           "columns": plan.num_columns, "verified": ok,
           "programs": plan.describe().get("max_programs"),
           "kernel_ms": _single_copy_ms(copy, args.reps),
           "kernel_b2b_ms": _events_ms(copy, args.reps, 3)}
    row["kernel_ratio"] = row["d2d_ms"] / row["kernel_ms"]
    fetch = _fetch_like(plan, remote, local, args.fetch_iters)
    row.update({f"fetch_{n}": v for n, v in fetch.items()})
    row["fetch_ratio"] = base["d2d_host_timed_us"] / fetch["whole_us"]
    row["fetch_arrays_us"] = _fetch_like(plan, s_arr, d_arr, args.fetch_iters)["whole_us"]
    for sl in args.slice_ids:
        row[f"fetch_sliced{sl}_us"] = _fetch_like(plan, remote, local, args.fetch_iters,
                                                  sl)["whole_us"]
    return row, want


def part_shapes(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per ``--regions`` count at ``--shape-mib``: the kernel alone (one copy; copies back to
    back) and the fetch as the transport times it, for each ``--shapes`` launch shape, on two
    ExtensibleKVCaches of the llama3-8b-like layout in this process."""
    rows = []
    blen = args.block_kib * 1024
    for regions in args.regions:
        k = max(1, args.shape_mib * MIB // (regions * blen))
        nb = k * args.cache_factor
        nbytes = k * regions * blen
        remote, local = _shape_ids(regions, nb, k)
        keep: list[Any] = []
        base: dict[str, Any] = {"part": "shapes", "regions": regions, "block_bytes": blen,
                                "blocks": k, "cache_blocks": nb, "request_bytes": nbytes}
        a = torch.empty(nbytes, dtype=torch.uint8, device=DEV).fill_(3)
        b = torch.empty_like(a)
        base["d2d_ms"] = _single_copy_ms(lambda a=a, b=b: b.copy_(a), args.reps)
        base["d2d_b2b_ms"] = _events_ms(lambda a=a, b=b: b.copy_(a), args.reps, 3)
        del a, b
        base["d2d_host_timed_us"] = _host_timed_copy_us(nbytes, 5)
        base.update(_id_conversion_us(local))
        try:
            src = _kvcache_regions(nb, args.block_kib, keep, regions)
            dst = _kvcache_regions(nb, args.block_kib, keep, regions)
            g = torch.Generator(device=DEV).manual_seed(regions)
            for r in src:
                r.flat.copy_(torch.randint(0, 256, (r.flat.numel(),), dtype=torch.uint8,
                                           device=DEV, generator=g))
            want = None
            for shape in args.shapes:
                try:
                    row, want = _shape_row(args, shape, src, dst, base, (remote, local), want)
                except Exception as exc:  # noqa: BLE001 - one failed shape is a finding
                    row = {**base, "shape": shape, "error": f"{type(exc).__name__}: {exc}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if args.ipc:
                rows += _ipc_shapes(args, regions, nb, remote, local, keep[1], keep, base)
        except Exception as exc:  # noqa: BLE001 - a geometry that cannot be built is a finding
            rows.append({**base, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
        src = dst = want = None
        torch.cuda.synchronize()
        _release(keep)
        torch.cuda.empty_cache()
        _dump(args, rows)
    return rows


def _ipc_shapes(args: argparse.Namespace, regions: int, nb: int, remote: list[int],
                local: list[int], cache: Any, keep: list[Any], base: dict[str, Any]
                ) -> list[dict[str, Any]]:
    """``IpcTransport.fetch`` from a second process's cache (bench_transfer's server) into
    ``cache``, ``FetchResult.seconds`` as the harness sweep reports it, per
    ``--ipc-shapes`` (the transport's plan re-launched with that shape's kernel options)."""
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_transfer import _Server

    from kvconnect.connectors.ipc.transport import IpcTransport

    rows = []
    server = _Server(argparse.Namespace(num_layers=regions // 2, nixl=False), args.block_kib,
                     nb, "cuda:0")
    keep.append(server)
    t = IpcTransport(cache)
    keep.append(t)
    t.open_peer("serve", server.offers["ipc"])
    plan = t.plan_for("serve")
    defaults = dict(plan._kernel_options)
    for shape in args.ipc_shapes:
        chunk, options = SHAPES[shape]
        if chunk != plan.chunk_bytes:
            continue  # the transport's plan has the default chunking
        plan._kernel_options = {**defaults, **options}  # the probe re-shapes the launch
        plan._launcher = None
        plan.warm_up()
        res = t.fetch("serve", remote, local)
        ok = bool(torch.equal(plan.read_blocks("dst", local), plan.read_blocks("src", remote)))
        for _ in range(5):
            t.fetch("serve", remote, local)
        lists = statistics.median(t.fetch("serve", remote, local).seconds
                                  for _ in range(args.fetch_iters))
        arrays = statistics.median(t.fetch("serve", np.asarray(remote), np.asarray(local))
                                   .seconds for _ in range(args.fetch_iters))
        row = {**base, "part": "ipc-shapes", "shape": shape, "verified": ok,
               "backend": res.backend, "fetch_seconds_lists_us": lists * 1e6,
               "fetch_seconds_arrays_us": arrays * 1e6,
               "ratio_lists": base["d2d_host_timed_us"] / (lists * 1e6),
               "ratio_arrays": base["d2d_host_timed_us"] / (arrays * 1e6)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", default=["memory", "host", "offload"])
    ap.add_argument("--kinds", nargs="+", default=["cudamalloc-64", "cudamalloc-1", "vmm",
                                                   "vmm-1g", "vmm-alias", "kvcache",
                                                   "ipc-peer"])
    ap.add_argument("--mib", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--block-kib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--host-iters", type=int, default=300)
    ap.add_argument("--regions", type=int, nargs="+", default=[8, 64],
                    help="shapes part: K/V regions (2 per layer; the harness preset has 8)")
    ap.add_argument("--shape-mib", type=int, default=1024, help="shapes part: bytes per copy")
    ap.add_argument("--cache-factor", type=int, default=1,
                    help="shapes part: cache blocks per copied block (the harness's 1 GiB "
                         "sweep point: 1, every block of the cache)")
    ap.add_argument("--shapes", nargs="+", default=["default", "items2", "items4", "items8",
                                                    "chunk16k", "warps8", "bw2048", "bw4096",
                                                    "bw4096w8"],
                    choices=sorted(SHAPES))
    ap.add_argument("--ipc", action="store_true",
                    help="shapes part: also IpcTransport.fetch from a second process")
    ap.add_argument("--ipc-shapes", nargs="+", default=["default", "items4"],
                    choices=sorted(SHAPES))
    ap.add_argument("--slice-ids", type=int, nargs="*", default=[512],
                    help="shapes part: also a pipelined fetch, this many ids per launch")
    ap.add_argument("--fetch-iters", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    if "memory" in args.part:
        rows += part_memory(args)
    if "host" in args.part:
        rows += part_host(args)
    if "offload" in args.part:
        rows += part_offload(args)
    if "shapes" in args.part:
        rows += part_shapes(args)
    _dump(args, rows)
    return 0


def _dump(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``--json`` (also after each geometry: a cut-short run keeps them)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
