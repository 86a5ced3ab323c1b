"""Benchmark: CPU offload save + load bandwidth on an extensible KV cache vs a plain copy.

Measures, in one run on one device:

- ``save``: :meth:`CPUOffloadConnector.save` of ``--batch`` non-contiguous blocks, waited for;
- ``load``: :meth:`CPUOffloadConnector.load` of the same keys into other blocks, waited for;
- the reference: ONE contiguous torch copy of the same number of bytes between the same
  memories (device -> pinned host and back on CUDA; host -> host on the host backend).

Bandwidth is payload bytes / seconds (1 GB = 1e9 bytes), median over ``--iters`` runs after
``--warmup``. Every run checks once that loaded blocks equal the saved ones (through the model-
shaped tensors, not the connector's own geometry) and exits non-zero if they do not.

    python benchmarks/bench_offload.py --device cuda:0 --out benchmarks/results/offload.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from typing import Any

import torch

from kvconnect import gbps
from kvconnect.connectors.offload.connector import CPUOffloadConnector
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import PRESETS, preset


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fill(cache: ExtensibleKVCache, seed: int) -> None:
    """Position-dependent bytes over the committed block prefix of every segment."""
    per_segment = iter(cache.segment_bytes_per_block)
    for ti, t in enumerate(cache.tensors):
        for s in range(t.num_segments):
            used = cache.num_blocks * next(per_segment)
            words = t.segment_view(s)[:used].view(torch.int64)
            h = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
            h += (seed << 48) + (ti << 36) + (s << 32)
            h *= -7046029254386353131
            h ^= h >> 29
            words.copy_(h)


def _gather_blocks(cache: ExtensibleKVCache, ids: list[int]) -> list[torch.Tensor]:
    """Blocks ``ids`` of every layer through the narrowed model-shaped tensors (one op per
    view; index_select may copy its whole input, so never give it the reservation-wide view)."""
    out = []
    kv = cache.narrowed_kv_caches()  # bounded: ops that copy whole inputs stay in bounds
    for name, lp in cache.plan.layers.items():
        tensors = kv[name] if lp.is_list else [kv[name]]
        for t, g in zip(tensors, lp.views, strict=True):
            k = g.blocks_per_block
            idx = torch.tensor([b * k + j for b in ids for j in range(k)], device=t.device)
            out.append(t.index_select(g.block_dim, idx).contiguous().view(torch.uint8))
    return out


def _time(fn: Any, device: torch.device, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = models[0] if models else ""
    except OSError:
        info["cpu_model"] = ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _versions() -> dict[str, Any]:
    def ver(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "kvconnect": ver("kvconnect"),
        "numpy": ver("numpy"),
    }


def _gbps(nbytes: int, seconds: list[float]) -> dict[str, float]:
    med = statistics.median(seconds)
    return {"median_s": med, "best_s": min(seconds), "median_gbps": gbps(nbytes, med),
            "best_gbps": gbps(nbytes, min(seconds))}


def _one(cache: ExtensibleKVCache, device: torch.device, n: int, path: str, slots: str,
         args: argparse.Namespace, chunk_mib: int) -> dict[str, Any]:
    """Save + load of ``n`` random non-contiguous blocks over ``path`` (staged chunks of at most
    ``chunk_mib``), and the references."""
    gen = torch.Generator().manual_seed(n)
    perm = torch.randperm(args.num_blocks, generator=gen).tolist()
    src_ids, dst_ids = perm[:n], perm[n:2 * n]  # non-contiguous, unordered block sets
    keys = [f"blk{b}" for b in src_ids]
    pool_blocks = 2 * n if slots == "scattered" else n
    conn = CPUOffloadConnector(cache, pool_blocks, max_copy_runs=args.max_copy_runs, path=path,
                               staging_chunk_bytes=chunk_mib << 20)
    try:
        if slots == "scattered":  # leave every other slot free
            conn.save(list(range(2 * n)), keys=[("pad", i) for i in range(2 * n)]).wait()
            conn.discard([("pad", i) for i in range(0, 2 * n, 2)])
        nbytes = n * conn.bytes_per_block
        # correctness, once: save, clobber everything, load into other blocks, compare
        _fill(cache, seed=1)
        want = _gather_blocks(cache, src_ids)
        h = conn.save(src_ids, keys=keys)
        taken = conn.path_for(h.slots)
        h.wait()
        _fill(cache, seed=2)
        conn.load(dst_ids, keys=keys).wait()
        got = _gather_blocks(cache, dst_ids)
        ok = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        save_t = _time(lambda: conn.save(src_ids, keys=keys).wait(), device, args.iters,
                       args.warmup)
        load_t = _time(lambda: conn.load(dst_ids, keys=keys).wait(), device, args.iters,
                       args.warmup)
        # reference: one contiguous copy of the same bytes between the same memories
        pinned = device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dev.fill_(7)
        out_t = _time(lambda: host.copy_(dev, non_blocking=True), device, args.iters,
                      args.warmup)
        in_t = _time(lambda: dev.copy_(host, non_blocking=True), device, args.iters,
                     args.warmup)
        r = {"batch_blocks": n, "path": taken, "asked_path": path, "slots": slots,
             "staging_chunk_bytes": (chunk_mib << 20) if taken == "staged" else None,
             "correct": ok, "payload_bytes": nbytes, "bytes_per_block": conn.bytes_per_block,
             "regions": len(conn.row_layout), "plan": conn.copy_plan.describe(),
             "save": _gbps(nbytes, save_t), "load": _gbps(nbytes, load_t),
             "reference_to_cpu": _gbps(nbytes, out_t),
             "reference_from_cpu": _gbps(nbytes, in_t)}
        r["save_vs_reference"] = r["save"]["median_gbps"] / r["reference_to_cpu"]["median_gbps"]
        r["load_vs_reference"] = (r["load"]["median_gbps"]
                                  / r["reference_from_cpu"]["median_gbps"])
        return r
    finally:
        conn.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    overrides: dict[str, Any] = {}
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    if args.layout:
        overrides["layout"] = args.layout
    cfg = preset(args.preset, num_blocks=args.num_blocks, **overrides)
    cache = ExtensibleKVCache(cfg, args.device, capacity_blocks=args.capacity_blocks)
    try:
        cache.allocate()
        cache.extend_kv_cache(args.num_blocks)
        for n in args.batch:
            if not 0 < n <= args.num_blocks // 2:
                raise SystemExit(f"--batch must be in 1..num_blocks/2 ({args.num_blocks // 2})")
        paths = args.path if device.type == "cuda" else ["auto"]
        results = [_one(cache, device, n, path, slots, args, chunk)
                   for n in args.batch for path in paths for slots in args.slots
                   for chunk in (args.staging_chunk_mib if path == "staged"
                                 else args.staging_chunk_mib[:1])]
        return {
            "benchmark": "cpu_offload",
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "machine": _machine(device),
            "versions": _versions(),
            "parameters": {
                "device": args.device, "preset": args.preset, "layout": cfg.layout,
                "num_layers": len(cfg.layer_names), "num_blocks": args.num_blocks,
                "capacity_blocks": cache.capacity_blocks, "max_copy_runs": args.max_copy_runs,
                "iters": args.iters, "warmup": args.warmup,
            },
            "results": results,
        }
    finally:
        cache.close(force=True)  # cleanup: never mask the error that got us here


def _chunk(r: dict[str, Any]) -> str:
    return "-" if r.get("staging_chunk_bytes") is None else f"{r['staging_chunk_bytes'] >> 20}"


def _markdown(report: dict[str, Any]) -> str:
    p, m, v = report["parameters"], report["machine"], report["versions"]
    lines = [
        f"# CPU offload bandwidth: {p['device']} ({m.get('gpu') or m.get('cpu_model') or 'host'})",
        "",
        f"- when: {report['timestamp']}",
        f"- command: `{report['command']}`",
        "- machine: " + ", ".join(f"{k}={val}" for k, val in m.items()),
        "- versions: " + ", ".join(f"{k}={val}" for k, val in v.items()),
        "- parameters: " + ", ".join(f"{k}={val}" for k, val in p.items()),
        "- reference: one contiguous copy of the same bytes between the same memories "
        "(device <-> pinned host), same run; GB/s = 1e9 bytes/s, medians",
        "",
        "| batch | MiB | slots | path | chunk MiB | save GB/s | ref -> CPU | save ratio | "
        "load GB/s | ref <- CPU | load ratio | correct |",
        "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['batch_blocks']} | {r['payload_bytes'] / 2**20:.0f} | {r['slots']} | "
            f"{r['path']} | {_chunk(r)} | {r['save']['median_gbps']:.1f} | "
            f"{r['reference_to_cpu']['median_gbps']:.1f} | {r['save_vs_reference']:.2f} | "
            f"{r['load']['median_gbps']:.1f} | {r['reference_from_cpu']['median_gbps']:.1f} | "
            f"{r['load_vs_reference']:.2f} | {r['correct']} |")
    lines += ["", "```json", json.dumps(report, indent=2), "```", ""]
    return "\n".join(lines)


def _print(report: dict[str, Any]) -> None:
    p = report["parameters"]
    print(f"cpu offload on {p['device']} ({report['machine'].get('gpu') or 'host'}): "
          f"{p['preset']} {p['layout']}, {p['num_layers']} layers")
    for r in report["results"]:
        print(f"  {r['batch_blocks']:5d} blocks {r['payload_bytes'] / 2**20:7.0f} MiB "
              f"{r['slots']:9s} {r['path']:6s} {_chunk(r):>3s} save {r['save']['median_gbps']:7.1f} GB/s "
              f"({r['save_vs_reference']:.2f} of {r['reference_to_cpu']['median_gbps']:.1f}) "
              f"load {r['load']['median_gbps']:7.1f} GB/s ({r['load_vs_reference']:.2f} of "
              f"{r['reference_from_cpu']['median_gbps']:.1f}) correct={r['correct']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="llama3-8b-like", choices=sorted(PRESETS))
    ap.add_argument("--num-layers", type=int, default=0, help="override the preset (0: keep)")
    ap.add_argument("--layout", default="", help="override the preset's layout")
    ap.add_argument("--num-blocks", type=int, default=1024, help="committed blocks")
    ap.add_argument("--capacity-blocks", type=int, default=None,
                    help="reserved blocks (default: the cache's default, 4x)")
    ap.add_argument("--batch", type=int, nargs="+", default=[256],
                    help="blocks per save / load (several: a sweep)")
    ap.add_argument("--slots", choices=("runs", "scattered"), nargs="+", default=["runs"],
                    help="pool slots consecutive, or every other slot (scattered)")
    ap.add_argument("--path", choices=("auto", "direct", "staged"), nargs="+",
                    default=["auto"], help="CUDA copy path(s) of the connector")
    ap.add_argument("--max-copy-runs", type=int, default=8)
    ap.add_argument("--staging-chunk-mib", type=int, nargs="+", default=[32],
                    help="bound on one staged chunk (MiB); several: a sweep of the staged path")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="",
                    help="write the report here: JSON for *.json, else Markdown (+ JSON block)")
    ap.add_argument("--json", default="", help="also write the report as JSON here")
    args = ap.parse_args(argv)
    report = run(args)
    _print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            if args.out.endswith(".json"):
                json.dump(report, f, indent=2)
            else:
                f.write(_markdown(report))
        print(f"wrote {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(r["correct"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
