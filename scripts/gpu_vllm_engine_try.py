"""One more try at a vLLM 0.33 *engine* on a GPU machine that has no vLLM: its Python sources
(no compiled extensions), Triton attention, kvconnect's plugin on and off.

The last try (benchmarks/results/vllm-gpu-try-h200.md) stopped at vLLM's model registry:
"Model architectures ['LlamaForCausalLM'] failed to be inspected" (the registry inspects a
lazily registered architecture in a subprocess, which imports the model code). This try
goes step by step, each in its own process under a deadline, and records where it stops:

1. ``unpack``: the carry of scripts/pack_vllm_for_gpu.sh (vLLM's sources, the wheels the
   image lacks) into /tmp, and kvconnect (``pip install --no-deps -e .``).
2. ``model_code``: kvconnect's CUDA runtime (shims for the absent extensions), then vLLM's
   Llama module imported in-process: the root cause of the failed inspection, if any.
3. ``engine_off`` / ``engine_on``: the stub architecture (``LlamaForCausalLM`` registered
   again with the class object, which vLLM inspects in-process, no subprocess), the tiny
   seeded Llama of kvconnect.vllm.tiny_model, an in-process ``LLM`` with
   ``attention_backend=TRITON_ATTN``, ``custom_ops: ["none"]`` (torch-native
   norms / rotary / activations instead of the absent ``_C`` kernels), eager mode; greedy
   tokens for a prompt and its first-token control; with the plugin on, its facts.

Writes ``$OUT/engine-try.json`` (every step: status, seconds, the error with the first
missing module) and ``$OUT/summary.md``. Exit 0 when every step ran, whatever it found.
``--device cpu`` dry-runs the same steps on a CPU machine (a carry packed for its Python)::

    python3 scripts/gpu_vllm_engine_try.py --carry .vllm-carry --out "$OUT" --budget 420
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

SITE, SRC = "/tmp/vllm-site", "/tmp/vllm-src"
REPO = Path(__file__).resolve().parents[1]

# The first try on the H200 (benchmarks/results/vllm-gpu-engine-try.md) stopped importing
# vLLM's Llama module: its attention layers import vllm.vllm_flash_attn, which raises without
# the compiled FA2/FA3 extensions. This try stands a stub in its place (script-local: the
# conformance kit's shims do not need it): flash attention reported unavailable, its kernels
# raising if called, so that vLLM must take the Triton attention backend it is asked for.
FLASH_ATTN_STUB = textwrap.dedent("""
    import sys, types
    def _absent(*a, **k):
        raise RuntimeError("kvconnect engine try: vLLM flash attention is absent (sources only)")
    fa = types.ModuleType("vllm.vllm_flash_attn")
    fa.__kvconnect_shim__ = True
    fa.FA2_AVAILABLE = fa.FA3_AVAILABLE = False
    fa.is_fa_version_supported = lambda *a, **k: False
    fa.fa_version_unsupported_reason = lambda *a, **k: "absent: vLLM carried as sources"
    for _n in ("flash_attn_varlen_func", "get_scheduler_metadata",
               "compile_flash_attn_varlen_func_from_specs"):
        setattr(fa, _n, _absent)
    sys.modules["vllm.vllm_flash_attn"] = fa
""")

RUNTIME = FLASH_ATTN_STUB + textwrap.dedent("""
    import json, os, sys, time, traceback
    from kvconnect.vllm.runtime import prepare_runtime
    shims = prepare_runtime(os.environ["KVC_DEVICE"])
    if os.environ["KVC_DEVICE"].startswith("cuda"):
        shims.append("vllm.vllm_flash_attn (stub)")
    def report(obj):
        print("KVC_RESULT " + json.dumps(obj), flush=True)
""")

MODEL_CODE = RUNTIME + textwrap.dedent("""
    t0 = time.monotonic()
    try:
        import vllm.model_executor.models.llama as llama
        from vllm.model_executor.models.registry import _ModelInfo
        info = _ModelInfo.from_model_cls(llama.LlamaForCausalLM)
        report({"status": "ok", "shims": shims, "seconds": time.monotonic() - t0,
                "text_generation": bool(getattr(info, "is_text_generation_model", False))})
    except BaseException as e:
        report({"status": "fail", "shims": shims, "error": f"{type(e).__name__}: {e}",
                "missing_module": getattr(e, "name", None),
                "trace": traceback.format_exc()[-2500:]})
""")

ENGINE = RUNTIME + textwrap.dedent("""
    stage = "import"
    try:
        from vllm import LLM, SamplingParams, ModelRegistry
        import vllm.model_executor.models.llama as llama
        stage = "register stub architecture"
        ModelRegistry.register_model("LlamaForCausalLM", llama.LlamaForCausalLM)
        from kvconnect.vllm.tiny_model import engine_kwargs, first_token_changed
        stage = "engine start-up"
        t0 = time.monotonic()
        kw = engine_kwargs(sys.argv[1], compilation_config={"custom_ops": ["none"]})
        if os.environ["KVC_DEVICE"].startswith("cuda"):
            from vllm.v1.attention.backends.registry import AttentionBackendEnum
            kw.update(attention_backend=AttentionBackendEnum["TRITON_ATTN"],
                      gpu_memory_utilization=0.3)
        llm = LLM(**kw)
        startup = time.monotonic() - t0
        stage = "generate"
        prompt = [(i * 37) % 1000 + 3 for i in range(200)]
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in (prompt, first_token_changed(prompt))],
                            sp, use_tqdm=False)
        out = {"status": "ok", "startup_s": startup,
               "tokens": [list(o.outputs[0].token_ids) for o in outs]}
        if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1":
            stage = "plugin facts"
            out["facts"] = llm.collective_rpc("kvconnect_kv_cache_facts")
        report(out)
    except BaseException as e:
        report({"status": "fail", "stage": stage, "error": f"{type(e).__name__}: {e}"[:1500],
                "missing_module": getattr(e, "name", None),
                "trace": traceback.format_exc()[-3000:]})
""")


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_step(name: str, cmd: list[str], env: dict[str, str], limit: float, out: Path
             ) -> dict[str, Any]:
    """Run one step under ``limit`` seconds; its log goes to ``out/<name>.log``; the result
    is the last ``KVC_RESULT`` line it printed (or what stopped it)."""
    t0 = time.monotonic()
    if limit < 5:
        return {"status": "skipped", "reason": "budget spent"}
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=limit, start_new_session=True)
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if ln.startswith("KVC_RESULT ")]
    result = json.loads(lines[-1][len("KVC_RESULT "):]) if lines else {
        "status": "fail", "error": f"exit {rc} without a result",
        "log_tail": log.read_text(errors="replace").splitlines()[-25:]}
    result.update(rc=rc, seconds=round(time.monotonic() - t0, 1))
    return result


def unpack(carry: Path, python: str, out: Path) -> dict[str, Any]:
    src = carry / "vllm-src.tar.gz"
    if not src.exists():
        return {"status": "fail", "error": f"no {src}: pack it with scripts/pack_vllm_for_gpu.sh"}
    script = (f"rm -rf {SRC} {SITE} && mkdir -p {SRC} {SITE} && tar xzf {src} -C {SRC} && "
              f"{python} -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
              f"--target {SITE} {carry}/wheels/*.whl && {python} -m pip install -q --no-deps "
              f"--no-build-isolation --no-index -e . && echo 'KVC_RESULT {{\"status\": \"ok\"}}'")
    return run_step("unpack", ["bash", "-c", script], dict(os.environ), 120, out)


def summary(steps: dict[str, Any], device: str) -> str:
    lines = [f"# vLLM 0.33 engine from Python sources on {device} (Triton attention)", "",
             "| step | status | seconds | what |", "| --- | --- | ---: | --- |"]
    for name, r in steps.items():
        what = r.get("error") or r.get("reason") or ""
        if r.get("tokens"):
            what = f"tokens {r['tokens'][0][:6]}..., control differs: " \
                   f"{r['tokens'][0] != r['tokens'][1]}"
        lines.append(f"| {name} | {r['status']} | {r.get('seconds', '')} | "
                     f"{str(what)[:300].replace('|', '/')} |")
    on, off = steps.get("engine_on", {}), steps.get("engine_off", {})
    if on.get("tokens") and off.get("tokens"):
        lines += ["", f"plugin on vs off: tokens equal: {on['tokens'] == off['tokens']}"]
    stops = [(n, r) for n, r in steps.items() if r["status"] != "ok"]
    lines += ["", "first stop: " + (f"{stops[0][0]} ({stops[0][1].get('stage', '')}): "
                                    f"{stops[0][1].get('error', stops[0][1].get('reason'))}"
                                    if stops else "none: an engine ran")]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--carry", type=Path, default=Path(".vllm-carry"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-vllm-out")))
    ap.add_argument("--budget", type=float, default=420, help="seconds for everything")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a dry run")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    steps: dict[str, Any] = {"unpack": unpack(args.carry, args.python, args.out)}
    env = {**os.environ, "KVC_DEVICE": args.device, "HF_HUB_OFFLINE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "INFO",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{SITE}:{SRC}" + (
               f":{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else "")}
    if steps["unpack"]["status"] == "ok":
        steps["model_code"] = run_step("model_code", [args.python, "-c", MODEL_CODE], env,
                                       min(90, budget.left()), args.out)
        with tempfile.TemporaryDirectory(prefix="kvc-engine-try-") as tmp:
            sys.path.insert(0, str(REPO))  # the checkout's kvconnect (torch + safetensors)
            from kvconnect.vllm.tiny_model import write_tiny_llama

            model = write_tiny_llama(Path(tmp) / "model", seed=0)
            for name, plugin in (("engine_off", "0"), ("engine_on", "1")):
                steps[name] = run_step(name, [args.python, "-c", ENGINE, str(model)],
                                       {**env, "KVCONNECT_EXTENSIBLE_KV": plugin},
                                       min(200, budget.left()), args.out)
    report = {"device": args.device, "steps": steps, "budget_s": args.budget,
              "command": " ".join(sys.argv)}
    (args.out / "engine-try.json").write_text(json.dumps(report, indent=1))
    text = summary(steps, args.device)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
