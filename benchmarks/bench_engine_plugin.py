"""Engine start-up, generation throughput and peak RSS with kvconnect's vLLM plugin on vs off.

Every round starts one engine with the plugin off and one with it on (order alternating),
each in its own process, one at a time (in-process engine mode, the tiny seeded Llama of
kvconnect.vllm.tiny_model); the figures are medians over the rounds and the ratios are
plugin-on over plugin-off from the same run::

    VLLM_TARGET_DEVICE=cpu .venv-engine/bin/python benchmarks/bench_engine_plugin.py \\
        --rounds 5 --json benchmarks/results/engine-plugin-cpu.json

Start-up is ``LLM(...)`` construction (model load, KV allocation, warm-up); throughput is
output tokens per second of one batch (after one warm-up request); peak RSS is the engine
process's ``VmHWM``. Units: seconds, tokens/s, bytes.
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
    t1 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - t1
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    facts = None
    if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1":
        (facts,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    return {"startup_s": startup, "generate_s": seconds, "output_tokens": produced,
            "tokens_per_s": produced / seconds, "vm_hwm_bytes": _hwm(), "facts": facts}


def run_engine(plugin: bool, args: argparse.Namespace, model: Path, work: Path
               ) -> dict[str, Any]:
    out = work / f"result-{plugin}-{time.monotonic_ns()}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu"),
           "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib), "VLLM_LOGGING_LEVEL": "WARNING",
           "KVCONNECT_EXTENSIBLE_KV": "1" if plugin else "0"}
    cmd = [sys.executable, __file__, "--child", str(model), str(out), str(args.batch),
           str(args.prompt_tokens), str(args.output_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"engine (plugin={plugin}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians, and the best round of each (least disturbed by other load on the machine:
    the shortest start-up, the highest throughput)."""
    out = {k: statistics.median(r[k] for r in rows)
           for k in ("startup_s", "generate_s", "tokens_per_s", "vm_hwm_bytes")}
    out["best_startup_s"] = min(r["startup_s"] for r in rows)
    out["best_tokens_per_s"] = max(r["tokens_per_s"] for r in rows)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        model, out, batch, p_tok, o_tok = sys.argv[2:7]
        Path(out).write_text(json.dumps(child(model, int(batch), int(p_tok), int(o_tok))))
        return 0
    # SIGTERM becomes SystemExit: subprocess.run then kills the engine it is waiting for
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32, help="prompts per timed batch")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=192)
    ap.add_argument("--kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    from kvconnect.vllm.tiny_model import write_tiny_llama

    rows: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="kvconnect-bench-engine-") as tmp:
        model = write_tiny_llama(Path(tmp) / "model", seed=0)
        for r in range(args.rounds):
            for plugin in ((False, True) if r % 2 == 0 else (True, False)):
                row = run_engine(plugin, args, model, Path(tmp))
                rows["on" if plugin else "off"].append(row)
                print(f"round {r} plugin {'on ' if plugin else 'off'}: start-up "
                      f"{row['startup_s']:.2f} s, {row['tokens_per_s']:.1f} tok/s, peak RSS "
                      f"{row['vm_hwm_bytes'] / 2**20:.0f} MiB", flush=True)
    off, on = summarize(rows["off"]), summarize(rows["on"])
    facts = rows["on"][0]["facts"]
    report = {
        "off": off, "on": on,
        "startup_speed_ratio": off["startup_s"] / on["startup_s"],
        "throughput_ratio": on["tokens_per_s"] / off["tokens_per_s"],
        "best_startup_speed_ratio": off["best_startup_s"] / on["best_startup_s"],
        "best_throughput_ratio": on["best_tokens_per_s"] / off["best_tokens_per_s"],
        "peak_rss_ratio": on["vm_hwm_bytes"] / off["vm_hwm_bytes"],
        "kv": {k: facts[k] for k in ("reserved_bytes", "committed_bytes", "num_blocks",
                                     "capacity_blocks", "backend")},
        "rounds": rows, "args": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    import torch
    import vllm

    report["machine"].update(torch=torch.__version__, vllm=vllm.__version__)
    print(f"best rounds: start-up speed on/off {report['best_startup_speed_ratio']:.3f}, "
          f"throughput on/off {report['best_throughput_ratio']:.3f}")
    print(f"medians: start-up speed on/off {report['startup_speed_ratio']:.3f} (off {off['startup_s']:.2f}"
          f" s, on {on['startup_s']:.2f} s); throughput on/off {report['throughput_ratio']:.3f} "
          f"(off {off['tokens_per_s']:.1f}, on {on['tokens_per_s']:.1f} tok/s); peak RSS on/off "
          f"{report['peak_rss_ratio']:.3f} (off {off['vm_hwm_bytes'] / 2**20:.0f} MiB, on "
          f"{on['vm_hwm_bytes'] / 2**20:.0f} MiB; KV committed "
          f"{facts['committed_bytes'] / 2**20:.0f} MiB of {facts['reserved_bytes'] / 2**30:.1f}"
          f" GiB reserved)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
