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

    python benchmarks/probe_fetch_path.py --json probe.json
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


def _kvcache_regions(nb: int, block_kib: int, keep: list[Any]) -> list[BlockRegion]:
    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.views import page_holders
    from kvconnect.vmm import AllocationOptions

    cfg = preset("llama3-8b-like", num_blocks=nb, num_layers=REGIONS // 2,
                 block_size=block_kib * 1024 // (8 * 128 * 2))
    cache = ExtensibleKVCache(cfg, "cuda:0", capacity_blocks=2 * nb,
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


def _time_one_copy(plan: BlockCopyPlan, nb: int, k: int, rng: np.random.Generator,
                   iters: int) -> dict[str, float]:
    """p50 microseconds of the pieces of ``iters`` whole copies of ``k`` random blocks (ids
    -> array + checks, ``plan.copy``, event + completion wait) and of a plain copy of the same
    bytes, interleaved; plus the p99 of the whole and of the plain copy."""
    from kvconnect.connectors.copy._kernel_launch import wait_events
    from kvconnect.connectors.copy.block_copy import as_block_ids

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
        ev = torch.cuda.Event()
        ev.record()
        wait_events([ev], 10.0)
        t3 = time.perf_counter()
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
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    if "memory" in args.part:
        rows += part_memory(args)
    if "host" in args.part:
        rows += part_host(args)
    if "offload" in args.part:
        rows += part_offload(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
