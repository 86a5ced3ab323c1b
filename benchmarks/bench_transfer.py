"""Benchmark: moving random, non-contiguous KV blocks between two processes, every transport.

One run measures, for each layer-block size (``--block-kib``, bytes of one layer's K or V
page of one block) and each request size (``--request-mib``, bytes of one transfer over all
layers):

- ``ipc/<method>``: the library ipc transport (:class:`IpcTransport`: POSIX-fd mapping cached
  per peer, one block-copy launch per fetch); methods ``kernel`` (Triton; one CUDA graph
  replay per fetch, and with ``--launch eager`` also ``ipc/kernel-eager``: the same upload and
  kernel issued one by one), ``memcpy_batch`` (cuMemcpyBatchAsync), ``host`` (the host
  backend's default: torch row gathers or one memmove per run, chosen per batch; the row's
  ``host_engine`` names the one that ran) and ``torch`` (index_select + index_copy_ per
  column: the old path's shape); across GPUs each of ``push`` and ``pull``;
- ``nixl-vmm``: stock NIXL READs of the same VMM-backed caches;
- ``nixl-cudamalloc``: NIXL READs between ordinary cudaMalloc allocations of the same layout
  (the control: what NIXL does on memory UCX can export);
- references in the same run: ``d2d`` (one contiguous torch copy of the same bytes on the
  destination GPU) and, where two GPUs exist, ``peer`` (one contiguous copy source GPU ->
  destination GPU). Every ratio is to the reference of the same pair and bytes.

The serving side is a second process (this script with ``--serve``) that owns its cache(s),
fills them with a position-dependent pattern and serves them (an :class:`IpcExportServer`, a
NIXL agent). Each configuration is checked byte-exact once (destination blocks against the
source blocks read through the mapping) before it is timed. Throughput is payload bytes /
wall seconds between synchronizations (1 GB = 1e9 bytes), median of ``--iters`` after
``--warmup``. ``--latency-blocks`` adds per-transfer latency for small requests (p50 / p99
over ``--latency-iters`` fetches, interleaved with a plain copy of the same bytes timed the
same way): the fetch's own ``seconds`` and the whole ``fetch()`` call. Results: JSON
(``--json``) and a PNG plot (``--png``) of GB/s and ratio against request size.

    python benchmarks/bench_transfer.py --json out.json --png out.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from transfer_timing import back_to_back, latency_rows

from kvconnect import gbps
from kvconnect.connectors.ipc.transport import IpcExportServer, IpcTransport
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.layout import allocate_kv_caches, preset
from kvconnect.vmm import AllocationOptions

MIB = 1024 * 1024
#: prefix of the serving process's one line of offers (libraries may print other lines)
OFFERS = "KVC-OFFERS "
#: bytes per token of one llama3-8b-like layer's K (or V): 8 KV heads x 128 x bf16
TOKEN_BYTES = 8 * 128 * 2


def _sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _config(block_kib: int, num_layers: int, num_blocks: int) -> Any:
    return preset("llama3-8b-like", num_blocks=num_blocks, num_layers=num_layers,
                  block_size=block_kib * 1024 // TOKEN_BYTES)


def _fill(cache: ExtensibleKVCache, seed: int) -> None:
    """Position-dependent words over every committed byte (differs per tensor and seed)."""
    for ti, t in enumerate(cache.tensors):
        for s in range(t.num_segments):
            words = t.segment_view(s).view(torch.int64)
            h = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
            h += (seed << 48) + (ti << 36) + (s << 32)
            h *= -7046029254386353131
            h ^= h >> 29
            words.copy_(h)


def _nixl_worker(name: str) -> Any:
    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    return NixlRegionWorker(name, default_timeout=120.0, progress_thread=True)


def _plain_registration(worker: Any, cfg: Any, device: str, num_blocks: int
                        ) -> tuple[list[torch.Tensor], Any]:
    """An ordinary cudaMalloc allocation of ``cfg`` registered with NIXL (the control)."""
    from kvconnect.views import committed_regions

    raw, kv = allocate_kv_caches(cfg, device, num_blocks=num_blocks)
    for i, r in enumerate(raw):
        r.view(torch.int64).copy_(torch.arange(r.numel() // 8, device=device) * 31 + i)
    regions = committed_regions(kv, num_blocks, cfg)
    worker.register_regions(regions, [(r.data_ptr(), r.numel()) for r in raw], config=cfg)
    return raw, kv


# -- the serving process ---------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    """Own a cache (and a plain allocation) for one layer-block size and serve them until
    stdin closes. Prints one JSON line: the offers."""
    device = args.serve_device
    cfg = _config(args.block_kib[0], args.num_layers, args.num_blocks)
    cache = ExtensibleKVCache(cfg, device, capacity_blocks=args.num_blocks * 2,
                              options=AllocationOptions(shareable=True))
    server = nixl_vmm = nixl_plain = None
    keep: list[Any] = []
    try:
        cache.allocate()
        cache.extend_kv_cache(args.num_blocks, single_handle=True)
        _fill(cache, seed=1)
        _sync(torch.device(device))
        directory = tempfile.mkdtemp(prefix="kvc-bench-")
        os.chmod(directory, 0o700)
        server = IpcExportServer(cache, directory, "serve", lambda: {os.getppid()}, 60.0)
        offers: dict[str, Any] = {"ipc": server.describe()}
        if args.nixl:
            nixl_vmm = _nixl_worker("serve-vmm")
            nixl_vmm.register_kv_cache(cache)
            offers["nixl-vmm"] = {"metadata": nixl_vmm.metadata_json().decode()}
            nixl_plain = _nixl_worker("serve-plain")
            keep.append(_plain_registration(nixl_plain, cfg, device, args.num_blocks))
            offers["nixl-cudamalloc"] = {"metadata": nixl_plain.metadata_json().decode()}
        print(OFFERS + json.dumps(offers), flush=True)
        sys.stdin.read()  # until the parent closes our stdin
        return 0
    finally:
        for w in (nixl_vmm, nixl_plain):
            if w is not None:
                w.close()
        if server is not None:
            server.close()
        keep.clear()
        cache.close(force=True)  # cleanup: never mask the error that got us here


class _Server:
    """The serving subprocess for one block size and device (closed on every path)."""

    def __init__(self, args: argparse.Namespace, block_kib: int, num_blocks: int, device: str,
                 timeout: float = 300.0) -> None:
        cmd = [sys.executable, __file__, "--serve", "--serve-device", device,
               "--block-kib", str(block_kib), "--num-layers", str(args.num_layers),
               "--num-blocks", str(num_blocks)] + (["--nixl"] if args.nixl else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            self.offers = self._read_offers(timeout)
        except BaseException:
            self.close()
            raise

    def _read_offers(self, timeout: float) -> dict[str, Any]:
        """Read the child's stdout (raw fd, so select sees every byte) up to the offers
        line, with a deadline; other lines (library logs) are echoed."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(OFFERS):
                    return json.loads(text[len(OFFERS):])
                print(f"[serve] {text}", flush=True)
            left = deadline - time.monotonic()
            ready, _, _ = select.select([fd], [], [], max(0.0, left))
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk:
                raise RuntimeError(f"the serving process gave no offers within {timeout} s "
                                   f"(exit code {self.proc.poll()})")
            buf += chunk

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# -- timing ----------------------------------------------------------------------------------
def _median_seconds(fn: Any, devices: tuple[torch.device, ...], iters: int, warmup: int
                    ) -> float:
    times = []
    for i in range(warmup + iters):
        _sync(*devices)
        t0 = time.perf_counter()
        fn()
        _sync(*devices)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _reference(nbytes: int, src: torch.device, dst: torch.device, iters: int) -> float:
    """GB/s of one contiguous torch copy of ``nbytes`` from ``src`` to ``dst``."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=src).fill_(7)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    s = _median_seconds(lambda: b.copy_(a), (src, dst), iters, 2)
    return gbps(nbytes, s)


def _ids(rng: np.random.Generator, num_blocks: int, k: int) -> tuple[list[int], list[int]]:
    """Random non-contiguous source and destination ids (sorted source, shuffled dest)."""
    src = sorted(rng.choice(num_blocks, size=k, replace=False).tolist())
    dst = rng.choice(num_blocks, size=k, replace=False).tolist()
    return src, dst


# -- the measuring process -------------------------------------------------------------------
def measure(args: argparse.Namespace) -> dict[str, Any]:
    ngpu = torch.cuda.device_count()
    pairs = [("cuda:0", "cuda:0", "same-gpu")]
    if ngpu >= 2:
        pairs.append(("cuda:0", "cuda:1", "cross-gpu"))
    if args.host:
        pairs = [("cpu", "cpu", "host")]
    rng = np.random.default_rng(args.seed)
    results: list[dict[str, Any]] = []
    notes: list[str] = []
    if ngpu < 2 and not args.host:
        notes.append(f"{ngpu} GPU visible: the cross-GPU pair (ipc push / pull vs a peer copy) "
                     "was not run")
    for block_kib in args.block_kib:
        bytes_per_block = 2 * args.num_layers * block_kib * 1024
        sizes = [m for m in args.request_mib if m * MIB >= bytes_per_block]
        if not sizes:
            notes.append(f"{block_kib} KiB: no request size fits (one block is "
                         f"{bytes_per_block // MIB} MiB)")
            continue
        # twice the largest request, so random block sets are sparse
        num_blocks = max(8, 2 * max(sizes) * MIB // bytes_per_block)
        for src_dev, dst_dev, kind in pairs:
            results += _measure_pair(args, block_kib, num_blocks, sizes, src_dev, dst_dev,
                                     kind, rng)
    latency = [r for r in results if r.get("kind") == "latency"]
    return {"results": [r for r in results if r.get("kind") != "latency"],
            "latency": latency, "notes": notes}


def _measure_pair(args: argparse.Namespace, block_kib: int, num_blocks: int, sizes: list[int],
                  src_dev: str, dst_dev: str, kind: str, rng: np.random.Generator
                  ) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    sd, dd = torch.device(src_dev), torch.device(dst_dev)
    cfg = _config(block_kib, args.num_layers, num_blocks)
    server = _Server(args, block_kib, num_blocks, src_dev)
    cache = ExtensibleKVCache(cfg, dst_dev, capacity_blocks=num_blocks * 2,
                              options=AllocationOptions(shareable=True))
    transports: dict[str, IpcTransport] = {}
    nixl_workers: list[Any] = []
    plain_keep: list[Any] = []
    try:
        cache.allocate()
        cache.extend_kv_cache(num_blocks, single_handle=True)
        _fill(cache, seed=2)
        directions = ("push", "pull") if kind == "cross-gpu" else ("auto",)
        variants = [(m, d, "graph") for m in args.methods for d in directions]
        variants += [("kernel", d, "eager") for d in directions
                     if "eager" in args.launch and "kernel" in args.methods]
        for method, direction, launch in variants:
            name = f"ipc/{method}" + ("-eager" if launch == "eager" else "") + (
                f"/{direction}" if kind == "cross-gpu" else "")
            t = IpcTransport(cache, direction=direction, method=method, launch=launch)
            transports[name] = t
        nixl_readers: dict[str, tuple[Any, str]] = {}
        if args.nixl:
            w = _nixl_worker("bench-vmm")
            nixl_workers.append(w)
            w.register_kv_cache(cache)
            nixl_readers["nixl-vmm"] = (w, w.update_peer(server.offers["nixl-vmm"]["metadata"]
                                                         .encode()))
            w2 = _nixl_worker("bench-plain")
            nixl_workers.append(w2)
            plain_keep.append(_plain_registration(w2, cfg, dst_dev, num_blocks))
            nixl_readers["nixl-cudamalloc"] = (w2, w2.update_peer(
                server.offers["nixl-cudamalloc"]["metadata"].encode()))
        for mib in sizes:
            nbytes_target = mib * MIB
            k = max(1, nbytes_target // (2 * args.num_layers * block_kib * 1024))
            src_ids, dst_ids = _ids(rng, num_blocks, k)
            nbytes = k * 2 * args.num_layers * block_kib * 1024
            refs = {"d2d": _reference(nbytes, dd, dd, args.iters)}
            if kind == "cross-gpu":
                refs["peer"] = _reference(nbytes, sd, dd, args.iters)
            ref_name = "peer" if kind == "cross-gpu" else "d2d"
            base = {"pair": kind, "src": src_dev, "dst": dst_dev, "block_bytes": block_kib * 1024,
                    "request_bytes": nbytes, "blocks": k, "references_gbps": refs,
                    "reference": ref_name}
            for name, t in transports.items():
                out.append({**base, **_ipc_row(args, t, name, server.offers["ipc"], src_ids,
                                               dst_ids, num_blocks, dd, nbytes,
                                               refs[ref_name])})
                _print_row(out[-1])
            for name, (w, engine) in nixl_readers.items():
                if nbytes > (args.nixl_vmm_max_mib if name == "nixl-vmm"
                             else args.nixl_max_mib) * MIB:
                    continue
                iters = 1 if name == "nixl-vmm" else args.iters
                res = w.read_blocks(engine, src_ids, dst_ids, timeout=300)
                secs = [w.read_blocks(engine, src_ids, dst_ids, timeout=300).seconds
                        for _ in range(iters)]
                sec = statistics.median(secs)
                rate = gbps(nbytes, sec)
                out.append({**base, "transport": name, "gbps": rate, "seconds": sec,
                            "ratio": rate / refs[ref_name], "verified": None,
                            "backend": res.backend, "descriptors": res.descriptors})
                _print_row(out[-1])
        if args.latency_blocks and kind != "cross-gpu" and transports \
                and block_kib == args.latency_block_kib:
            name = "ipc/kernel" if "ipc/kernel" in transports else next(iter(transports))
            out += latency_rows(args, transports[name], name, server.offers["ipc"],
                                num_blocks, block_kib, dd, rng, _ids)
    finally:
        for t in transports.values():
            t.close()
        for w in nixl_workers:
            w.close()
        plain_keep.clear()
        cache.close(force=True)  # cleanup: never mask the error that got us here
        server.close()
    return out


def _ipc_row(args: argparse.Namespace, t: IpcTransport, name: str, offer: dict[str, Any],
             src_ids: list[int], dst_ids: list[int], num_blocks: int, dd: torch.device,
             nbytes: int, ref_gbps: float) -> dict[str, Any]:
    """One ipc transport at one request size (``nbytes``): checked byte-exact once, then
    timed."""
    t0 = time.perf_counter()
    first = t.open_peer("serve", offer)
    again = t.open_peer("serve", offer)
    open_s = time.perf_counter() - t0
    plan = t.plan_for("serve")
    # poison: other source blocks into the destination, so a no-op fetch fails
    t.fetch("serve", src_ids[1:] + src_ids[:1] if len(src_ids) > 1
            else [(src_ids[0] + 1) % num_blocks], dst_ids)
    before = plan.read_blocks("dst", dst_ids, dd)
    want = plan.read_blocks("src", src_ids, dd)
    res = t.fetch("serve", src_ids, dst_ids)
    got = plan.read_blocks("dst", dst_ids, dd)
    verified = bool(torch.equal(got, want)) and not torch.equal(before, want)
    del before, want, got
    for _ in range(args.warmup):
        t.fetch("serve", src_ids, dst_ids)
    sec = statistics.median(t.fetch("serve", src_ids, dst_ids).seconds
                            for _ in range(args.iters))
    rate = gbps(nbytes, sec)
    facts = plan.describe()
    return {"transport": name, "gbps": rate, "seconds": sec, "ratio": rate / ref_gbps,
            "verified": verified, "setup_seconds_first": first, "setup_seconds_cached": again,
            "open_seconds": open_s, "backend": res.backend, "plan": facts,
            "host_engine": facts.get("host_last_engine"),  # None unless the host method
            "copies_back_to_back_seconds": back_to_back(plan, src_ids, dst_ids)}


def _print_row(r: dict[str, Any]) -> None:
    ok = {True: "exact", False: "MISMATCH", None: "-"}[r["verified"]]
    if r.get("copies_back_to_back_seconds"):
        ok += (f"  (back to back: "
               f"{gbps(r['request_bytes'], r['copies_back_to_back_seconds']):.0f} GB/s)")
    print(f"{r['pair']:9s} {r['block_bytes'] // 1024:5d} KiB {r['request_bytes'] / MIB:8.0f} MiB "
          f"{r['transport']:26s} {r['gbps']:8.1f} GB/s  ratio {r['ratio']:5.2f} vs "
          f"{r['reference']} {r['references_gbps'][r['reference']]:7.1f}  {ok}"
          + (f"  [{r['host_engine']}]" if r.get("host_engine") else ""), flush=True)


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The kernel's launch shapes side by side on one GPU (plain allocations, 64 regions of
    ``--sweep-block-kib`` per block, random ids), against a d2d copy of the same bytes."""
    from kvconnect.connectors.copy.block_copy import BlockCopyPlan, BlockRegion

    dev = torch.device("cuda:0")
    blen = args.sweep_block_kib * 1024
    regions = 2 * args.num_layers
    rng = np.random.default_rng(args.seed + 1)
    out = []
    for mib in args.sweep_request_mib:
        k = max(1, mib * MIB // (regions * blen))
        nb = 2 * k
        src_t = [torch.randint(0, 1 << 30, (nb * blen // 8,), dtype=torch.int64, device=dev)
                 for _ in range(regions)]
        dst_t = [torch.zeros_like(x) for x in src_t]
        src = [BlockRegion(x.view(torch.uint8), blen, blen, nb) for x in src_t]
        dst = [BlockRegion(x.view(torch.uint8), blen, blen, nb) for x in dst_t]
        s_ids, d_ids = _ids(rng, nb, k)
        nbytes = k * regions * blen
        ref = _reference(nbytes, dev, dev, args.iters)
        for major in (True, False):
            for warps in (4, 8):
                for words in (1024, 2048):
                    for chunk in (32, 64, 128):
                        plan = BlockCopyPlan(src, dst, device=dev, method="kernel",
                                             chunk_bytes=chunk * 1024, kernel_options={
                                                 "column_major": major, "num_warps": warps,
                                                 "block_words": words})
                        plan.warm_up()
                        sec = _median_seconds(lambda p=plan, s=s_ids, d=d_ids: p.copy(s, d), (dev,),
                                              args.iters, args.warmup)
                        ok = torch.equal(plan.read_blocks("src", s_ids),
                                         plan.read_blocks("dst", d_ids))
                        row = {"request_bytes": nbytes, "column_major": major,
                               "num_warps": warps, "block_words": words,
                               "chunk_kib": chunk, "gbps": gbps(nbytes, sec),
                               "ratio": gbps(nbytes, sec) / ref, "d2d_gbps": ref,
                               "verified": bool(ok)}
                        out.append(row)
                        print(f"sweep {mib:5d} MiB major={int(major)} warps={warps} "
                              f"words={words} chunk={chunk:3d}K {row['gbps']:7.1f} GB/s "
                              f"ratio {row['ratio']:.2f} {'exact' if ok else 'MISMATCH'}",
                              flush=True)
        del src_t, dst_t, src, dst
        torch.cuda.empty_cache()
    return out


# -- report ----------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                            "python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "gpus": []}
    for i in range(torch.cuda.device_count()):
        info["gpus"].append(torch.cuda.get_device_name(i))
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def plot(report: dict[str, Any], path: str) -> None:
    """GB/s and ratio against request size, one column per layer-block size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    blocks = sorted({r["block_bytes"] for r in rows})
    fig, axes = plt.subplots(2, len(blocks), figsize=(4.5 * len(blocks), 8), squeeze=False)
    for col, bb in enumerate(blocks):
        sub = [r for r in rows if r["block_bytes"] == bb]
        for label in sorted({(r["pair"], r["transport"]) for r in sub}):
            pts = sorted((r["request_bytes"], r["gbps"], r["ratio"]) for r in sub
                         if (r["pair"], r["transport"]) == label)
            x = [p[0] / MIB for p in pts]
            axes[0][col].plot(x, [p[1] for p in pts], marker="o", label=" ".join(label))
            axes[1][col].plot(x, [p[2] for p in pts], marker="o", label=" ".join(label))
        for ref in ("d2d", "peer"):
            pts = sorted({(r["request_bytes"], r["references_gbps"][ref]) for r in sub
                          if ref in r["references_gbps"]})
            if pts:
                axes[0][col].plot([p[0] / MIB for p in pts], [p[1] for p in pts], "k--",
                                  label=f"reference {ref}")
        axes[0][col].set_title(f"{bb // 1024} KiB per layer-block")
        axes[1][col].axhline(0.85, color="grey", lw=0.8)
        for ax, ylabel in ((axes[0][col], "GB/s"), (axes[1][col], "ratio to reference")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("request size (MiB)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0][col].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"kvconnect transfers, {report['machine']['gpus']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=int, nargs="+", default=[16, 32, 256, 2048],
                    help="bytes of one layer's K (or V) page of one block, KiB")
    ap.add_argument("--request-mib", type=int, nargs="+", default=[48, 128, 512, 2048])
    ap.add_argument("--num-layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--methods", nargs="+", default=["kernel", "memcpy_batch", "torch"])
    ap.add_argument("--launch", nargs="+", default=["graph"], choices=["graph", "eager"],
                    help="kernel launch modes to measure (eager: ipc/kernel-eager)")
    ap.add_argument("--latency-blocks", type=int, nargs="*", default=[],
                    help="also p50/p99 latency of fetches of this many blocks (e.g. 1 4 16)")
    ap.add_argument("--latency-block-kib", type=int, default=32,
                    help="the layer-block size (one of --block-kib) the latency rows use")
    ap.add_argument("--latency-iters", type=int, default=200)
    ap.add_argument("--latency-warmup", type=int, default=20)
    ap.add_argument("--nixl", action="store_true", help="also NIXL on VMM and cudaMalloc")
    ap.add_argument("--nixl-max-mib", type=int, default=512)
    ap.add_argument("--nixl-vmm-max-mib", type=int, default=48)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true",
                    help="first compare the kernel's launch shapes on plain allocations")
    ap.add_argument("--sweep-block-kib", type=int, default=32)
    ap.add_argument("--sweep-request-mib", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--host", action="store_true",
                    help="run on the host VMM backend (methods host and torch; no GPU "
                         "figures; rows carry host_engine)")
    ap.add_argument("--json", default="")
    ap.add_argument("--png", default="")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serve-device", default="cuda:0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args)
    if not torch.cuda.is_available() and not args.host:
        print("bench_transfer needs CUDA (or --host for a smoke run on the host backend)",
              file=sys.stderr)
        return 2
    started = time.time()
    report = {"schema": "kvconnect-bench-transfer/1",
              "command": shlex.join([sys.executable, *sys.argv]),
              "machine": _machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime(started))}
    if args.sweep:
        report["sweep"] = sweep(args)
    report.update(measure(args))
    report["wall_seconds"] = time.time() - started
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png:
        try:
            plot(report, args.png)
        except ImportError as exc:
            print(f"note: no plot ({exc}); the JSON has every figure", file=sys.stderr)
    bad = [r for r in report["results"] + report.get("sweep", []) if r["verified"] is False]
    for n in report["notes"]:
        print("note:", n)
    if bad:
        print(f"{len(bad)} configurations moved wrong bytes", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
