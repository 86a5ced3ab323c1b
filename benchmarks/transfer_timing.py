"""Timing helpers of the transfer benchmarks and probes: copies back to back between CUDA
events, and per-transfer latency of small fetches (p50 / p99) against a plain copy of the
same bytes.

Units: seconds, bytes, logical blocks.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

MIB = 1024 * 1024


def events_ms(fn: Callable[[], Any], batch: int, iters: int) -> float:
    """Median milliseconds per call of ``fn`` over ``iters`` rounds of ``batch`` calls back to
    back between two CUDA events (after one untimed call): host work hidden."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(batch):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / batch)
    return float(np.median(times))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def back_to_back(plan: Any, src: list[int], dst: list[int], reps: int = 5) -> float | None:
    """Seconds per copy of the same plan and ids issued ``reps`` times back to back between
    two CUDA events (host work hidden behind the copies): what the copy itself costs."""
    if plan.device.type != "cuda":
        return None
    s, d = np.asarray(src), np.asarray(dst)
    with torch.cuda.device(plan.device):
        for _ in range(reps):  # untimed: the staging ring grows to what back-to-back needs
            plan.copy(s, d, validate=False)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            plan.copy(s, d, validate=False)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / reps


def percentiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"p50": v[len(v) // 2], "p99": v[min(len(v) - 1, int(len(v) * 0.99))],
            "min": v[0]}


def latency_rows(args: argparse.Namespace, t: Any, name: str, offer: dict[str, Any],
                 num_blocks: int, block_kib: int, dev: torch.device, rng: np.random.Generator,
                 pick_ids: Callable[..., tuple[list[int], list[int]]]) -> list[dict[str, Any]]:
    """p50 / p99 of fetches of ``args.latency_blocks`` blocks through transport ``t`` and of a
    plain copy of the same bytes, interleaved (``pick_ids(rng, num_blocks, k)``: new random
    ids per fetch)."""
    t.open_peer("serve", offer)
    out = []
    for k in args.latency_blocks:
        nbytes = k * 2 * args.num_layers * block_kib * 1024
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(5)
        b = torch.empty_like(a)
        fetch_s, call_s, ref_s = [], [], []
        for i in range(args.latency_warmup + args.latency_iters):
            src, dst = pick_ids(rng, num_blocks, k)
            sync(dev)
            c0 = time.perf_counter()
            res = t.fetch("serve", src, dst)
            c1 = time.perf_counter()
            sync(dev)
            r0 = time.perf_counter()
            b.copy_(a)
            sync(dev)
            r1 = time.perf_counter()
            if i >= args.latency_warmup:
                fetch_s.append(res.seconds)
                call_s.append(c1 - c0)
                ref_s.append(r1 - r0)
        row = {"kind": "latency", "transport": name, "block_bytes": block_kib * 1024,
               "blocks": k, "request_bytes": nbytes, "iters": args.latency_iters,
               "fetch_seconds": percentiles(fetch_s), "call_seconds": percentiles(call_s),
               "reference_seconds": percentiles(ref_s), "reference": "plain copy"}
        out.append(row)
        print(f"latency {k:3d} blocks ({nbytes / MIB:6.2f} MiB) {name}: fetch p50 "
              f"{row['fetch_seconds']['p50'] * 1e6:6.1f} us p99 "
              f"{row['fetch_seconds']['p99'] * 1e6:6.1f} us | call p50 "
              f"{row['call_seconds']['p50'] * 1e6:6.1f} us p99 "
              f"{row['call_seconds']['p99'] * 1e6:6.1f} us | plain copy p50 "
              f"{row['reference_seconds']['p50'] * 1e6:6.1f} us p99 "
              f"{row['reference_seconds']['p99'] * 1e6:6.1f} us", flush=True)
        del a, b
    return out
