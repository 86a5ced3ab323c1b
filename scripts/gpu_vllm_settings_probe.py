"""Which engine settings a vLLM carried to a GPU machine needs (scripts/gpu_vllm_setup.sh),
found by leaving each out in turn: one engine per variant, all at once, plugin on, each in
its own process under a deadline; each answers a prompt and its first-token control.

Variants: ``recipe`` (everything of ``env.sh``: ``KVCONNECT_ENGINE_KWARGS`` and
``VLLM_USE_FLASHINFER_SAMPLER=0``, eager mode); ``sampler`` (vLLM's FlashInfer sampler
default); ``attention`` (vLLM's attention backend choice); ``custom_ops`` (vLLM's compiled
custom ops, not the torch-native ones); ``cuda_graphs`` (``enforce_eager=False``: vLLM
compiles and captures CUDA graphs over the plugin's cache). Writes one JSON object (each
variant: ok, seconds, tokens equal the recipe's, the control differs, or the error) to
``--json`` and prints a table. Exit 0 whenever the probe itself ran::

    . /tmp/kvc-vllm/env.sh && python3 scripts/gpu_vllm_settings_probe.py --json probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD = r"""
import json, os, sys, time, traceback
out = {}
t0 = time.monotonic()
try:
    from kvconnect.vllm.runtime import prepare_runtime
    prepare_runtime("cuda")
    from vllm import LLM, SamplingParams
    from kvconnect.vllm.tiny_model import engine_kwargs, first_token_changed
    spec = json.loads(sys.argv[1])
    kw = engine_kwargs(spec["model"], device="cuda", **spec["engine"])
    for key in spec["drop"]:
        kw.pop(key, None)
    llm = LLM(**kw)
    out["startup_s"] = time.monotonic() - t0
    prompt = [(i * 37) % 1000 + 3 for i in range(48)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in (prompt, first_token_changed(prompt))],
                        sp, use_tqdm=False)
    out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    out["ok"] = True
except BaseException as e:
    out.update(ok=False, error=f"{type(e).__name__}: {e}"[:600],
               trace=traceback.format_exc()[-1500:])
print("KVC_PROBE " + json.dumps(out), flush=True)
os._exit(0)
"""

#: variant -> (environment changes, engine_kwargs keys to drop, engine kwargs to add)
VARIANTS: dict[str, tuple[dict[str, str | None], list[str], dict[str, Any]]] = {
    "recipe": ({}, [], {}),
    "sampler": ({"VLLM_USE_FLASHINFER_SAMPLER": None}, [], {}),
    "attention": ({}, ["attention_backend"], {}),
    "custom_ops": ({}, ["compilation_config"], {}),
    "cuda_graphs": ({}, [], {"enforce_eager": False}),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    from kvconnect.vllm.tiny_model import write_tiny_llama

    deadline = time.monotonic() + args.timeout
    results: dict[str, Any] = {"engine_kwargs_env": os.environ.get("KVCONNECT_ENGINE_KWARGS")}
    with tempfile.TemporaryDirectory(prefix="kvc-probe-") as tmp:
        model = str(write_tiny_llama(Path(tmp) / "model", seed=0))
        procs = {}
        for name in args.variants:
            env_change, drop, add = VARIANTS[name]
            env = {**os.environ, "KVCONNECT_EXTENSIBLE_KV": "1", "HF_HUB_OFFLINE": "1",
                   "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
            for k, v in env_change.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = v
            spec = {"model": model, "drop": drop, "engine": add}
            log = open(Path(tmp) / f"{name}.log", "w+")  # noqa: SIM115 - closed below
            procs[name] = (subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)],
                                            env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True), log, time.monotonic())
        for name, (proc, log, t0) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            log.seek(0)
            text = log.read()
            log.close()
            lines = [x for x in text.splitlines() if x.startswith("KVC_PROBE ")]
            r = json.loads(lines[-1][len("KVC_PROBE "):]) if lines else {
                "ok": False, "error": f"no result (exit {proc.returncode}); log tail: "
                                      + " | ".join(text.splitlines()[-6:])[-600:]}
            r["seconds"] = round(time.monotonic() - t0, 1)
            results[name] = r
    ref = results.get("recipe", {}).get("tokens")
    for name in args.variants:
        r = results[name]
        if r.get("tokens"):
            r["control_differs"] = r["tokens"][0] != r["tokens"][1]
            r["equal_to_recipe"] = r["tokens"] == ref
        print(f"{name:<12} ok={r['ok']!s:<5} {r.get('seconds')} s  "
              f"equal_to_recipe={r.get('equal_to_recipe')} control_differs="
              f"{r.get('control_differs')} {r.get('error', '')[:200]}", flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
