"""Engine start-up, generation throughput and peak RSS with kvconnect's vLLM plugin on vs off.

Every round starts one engine with the plugin off and one with it on at the same time, each
in its own process pinned to its own core (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``; the cores
swap every round), so both see the same load from anything else on the machine (in-process
engine mode, the tiny seeded Llama of kvconnect.vllm.tiny_model). The ratios are plugin-on
over plugin-off per round (a pair), then the median over the rounds::

    VLLM_TARGET_DEVICE=cpu .venv-engine/bin/python benchmarks/bench_engine_plugin.py \\
        --rounds 5 --json benchmarks/results/engine-plugin-cpu.json

Start-up is ``LLM(...)`` construction (model load, KV allocation, warm-up); throughput is
output tokens per second of a batch (after one warm-up request; the best of
:data:`BATCHES` batches, and the first on its own); peak RSS is the engine process's
``VmHWM``. Units: seconds, tokens/s, bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


#: timed batches per engine: the first writes KV into blocks never touched before (first-touch
#: page faults of a fresh cache), the later ones into reused blocks
BATCHES = 3


def child(model: str, batch: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    from kvconnect.vllm.runtime import prepare_cpu_runtime

    prepare_cpu_runtime()
    from vllm import LLM, SamplingParams

    from kvconnect.vllm.tiny_model import engine_kwargs

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(model, enable_prefix_caching=False))
    startup = time.perf_counter() - t0
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(prompt_tokens)]}
               for _ in range(batch)]
    sp = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    rates = []
    for _ in range(BATCHES):
        t1 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t1
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.append(produced / seconds)
    facts = None
    if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1":
        (facts,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    return {"startup_s": startup, "output_tokens": produced, "batch_tokens_per_s": rates,
            "first_batch_tokens_per_s": rates[0], "tokens_per_s": max(rates),
            "vm_hwm_bytes": _hwm(), "facts": facts}


def start_engine(plugin: bool, core: int, args: argparse.Namespace, model: Path, work: Path
                 ) -> tuple[subprocess.Popen[bytes], Path]:
    out = work / f"result-{plugin}-{time.monotonic_ns()}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_LOGGING_LEVEL": "WARNING",
           "VLLM_CPU_OMP_THREADS_BIND": str(core),
           "KVCONNECT_EXTENSIBLE_KV": "1" if plugin else "0"}
    cmd = [sys.executable, __file__, "--child", str(model), str(out), str(args.batch),
           str(args.prompt_tokens), str(args.output_tokens)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    return proc, out


def run_pair(r: int, args: argparse.Namespace, model: Path, work: Path
             ) -> dict[str, dict[str, Any]]:
    """One round: plugin off and on side by side (cores swapped on odd rounds)."""
    procs = {name: start_engine(name == "on", (i + r) % 2, args, model, work)
             for i, name in enumerate(("off", "on"))}
    try:
        rows = {}
        for name, (proc, out) in procs.items():
            _, err = proc.communicate(timeout=900)
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"engine (plugin {name}) failed:\n{err.decode()[-3000:]}")
            rows[name] = json.loads(out.read_text())
        return rows
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the rounds."""
    return {k: statistics.median(r[k] for r in rows)
            for k in ("startup_s", "first_batch_tokens_per_s", "tokens_per_s", "vm_hwm_bytes")}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, out, batch, p_tok, o_tok = sys.argv[2:7]
        Path(out).write_text(json.dumps(child(model, int(batch), int(p_tok), int(o_tok))))
        return 0
    # SIGTERM becomes SystemExit: run_pair then kills the engines it is waiting for
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="pairs of engines (off, on)")
    ap.add_argument("--batch", type=int, default=32, help="prompts per timed batch")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=192)
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    from kvconnect.vllm.tiny_model import write_tiny_llama

    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    pairs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvconnect-bench-engine-") as tmp:
        model = write_tiny_llama(Path(tmp) / "model", seed=0)
        for r in range(args.rounds):
            pair = run_pair(r, args, model, Path(tmp))
            off_r, on_r = pair["off"], pair["on"]
            rows["off"].append(off_r)
            rows["on"].append(on_r)
            pairs.append({"startup_speed": off_r["startup_s"] / on_r["startup_s"],
                          "throughput": on_r["tokens_per_s"] / off_r["tokens_per_s"],
                          "first_batch_throughput": (on_r["first_batch_tokens_per_s"]
                                                     / off_r["first_batch_tokens_per_s"])})
            for name, row in pair.items():
                print(f"round {r} plugin {name:3}: start-up {row['startup_s']:.2f} s, batches "
                      f"{', '.join(f'{x:.0f}' for x in row['batch_tokens_per_s'])} tok/s, "
                      f"peak RSS {row['vm_hwm_bytes'] / 2**20:.0f} MiB", flush=True)
            print(f"round {r} on/off: start-up speed {pairs[-1]['startup_speed']:.3f}, "
                  f"throughput {pairs[-1]['throughput']:.3f}", flush=True)
    off, on = summarize(rows["off"]), summarize(rows["on"])
    facts = rows["on"][0]["facts"]
    report = {
        "off": off, "on": on, "pairs": pairs,
        "startup_speed_ratio": statistics.median(p["startup_speed"] for p in pairs),
        "throughput_ratio": statistics.median(p["throughput"] for p in pairs),
        "first_batch_throughput_ratio": statistics.median(p["first_batch_throughput"]
                                                          for p in pairs),
        "peak_rss_ratio": on["vm_hwm_bytes"] / off["vm_hwm_bytes"],
        "kv": {k: facts[k] for k in ("reserved_bytes", "committed_bytes", "num_blocks",
                                     "capacity_blocks", "backend")},
        "rounds": rows, "args": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    import torch
    import vllm

    report["machine"].update(torch=torch.__version__, vllm=vllm.__version__)
    print(f"median of {args.rounds} paired rounds, plugin on / off: start-up speed "
          f"{report['startup_speed_ratio']:.3f}, throughput {report['throughput_ratio']:.3f} "
          f"(first batch {report['first_batch_throughput_ratio']:.3f}); peak RSS "
          f"{report['peak_rss_ratio']:.3f} (off {off['vm_hwm_bytes'] / 2**20:.0f} MiB, on "
          f"{on['vm_hwm_bytes'] / 2**20:.0f} MiB; KV committed "
          f"{facts['committed_bytes'] / 2**20:.0f} MiB of {facts['reserved_bytes'] / 2**30:.1f}"
          f" GiB reserved)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
