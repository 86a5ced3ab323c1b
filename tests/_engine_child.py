"""One real vLLM engine scenario in this process: ``python _engine_child.py SCENARIO SPEC``.

Started by tests/_engine_runs.py (one process per engine, its own session, killed on any
path); ``SPEC`` is a JSON file naming the model folder, the prompts and ``result`` (where
this process writes its JSON result, atomically). The environment (plugin switch, engine
mode, capacity) comes from the parent. Scenarios: ``generate`` (tokens, facts, storages,
memory, sleep / wake through the workers), ``bad_input``, ``offload``, ``pd_prefill``,
``pd_decode``. Units: bytes; tokens are token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from _engine_runs import exit_engine_child

from kvconnect.json_files import write_json_file
from kvconnect.vllm.runtime import prepare_runtime

prepare_runtime(os.environ.get("VLLM_TARGET_DEVICE", "cpu"))


# -- files and memory ----------------------------------------------------------------------
def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def range_memory(pid: int, base: int, size: int) -> dict[str, int]:
    """Bytes of ``[base, base+size)`` mapped with access (committed) and resident there."""
    mapped = rss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo >= base and hi <= base + size
            if inside and head[1] != "---p":
                mapped += hi - lo
        elif inside and head[0] == "Rss:":
            rss += int(head[1]) * 1024
    return {"mapped_bytes": mapped, "rss_bytes": rss}


def kvconnect_chunk_mappings(pid: int) -> int:
    return sum("kvconnect-chunk" in ln for ln in Path(f"/proc/{pid}/maps").read_text().splitlines())


# -- engine helpers --------------------------------------------------------------------------
def make_llm(spec: dict[str, Any]) -> Any:
    """An engine for ``spec["model"]`` (tiny_model.engine_kwargs, on the device the parent
    chose: its CUDA settings there) with ``spec["engine"]`` on top."""
    from vllm import LLM

    from kvconnect.vllm.tiny_model import engine_kwargs

    device = os.environ.get("VLLM_TARGET_DEVICE", "cpu")
    return LLM(**engine_kwargs(spec["model"], device=device, **spec.get("engine", {})))


def generate(llm: Any, prompts: list[list[int]], max_tokens: int,
             transfer: list[dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = []
    for i in range(len(prompts)):
        extra = {} if not transfer or transfer[i] is None else {
            "kv_transfer_params": transfer[i]}
        params.append(SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                     extra_args=extra or None))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
             "num_cached_tokens": o.num_cached_tokens,
             "kv_transfer_params": o.kv_transfer_params} for o in outs]


def in_process_worker(llm: Any) -> Any:
    """The worker object of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    return llm.llm_engine.model_executor.driver_worker.worker


def runner_storages(llm: Any) -> list[list[int]]:
    """``[data_ptr, nbytes]`` of every distinct storage under vLLM's KV cache tensors."""
    seen: dict[int, int] = {}
    for t in in_process_worker(llm).model_runner.kv_caches:
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    return sorted([p, n] for p, n in seen.items())


def patch_state() -> dict[str, Any]:
    import vllm.v1.worker.gpu_model_runner as gmr
    import vllm.v1.worker.utils as utils
    from vllm.v1.worker.worker_base import WorkerBase

    return {"allocation_patched": bool(getattr(gmr.allocate_kv_cache, "_kvconnect", False)),
            "utils_patched": bool(getattr(utils.allocate_kv_cache, "_kvconnect", False)),
            "worker_methods": sorted(m for m in vars(WorkerBase) if m.startswith("kvconnect")),
            "plugin_module_loaded": "kvconnect.vllm.plugin" in sys.modules}


def error_chain(exc: BaseException) -> dict[str, Any]:
    """``{"chain": [{"type", "message"}, ...]}`` of ``exc`` and its causes."""
    chain = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 8:
        chain.append({"type": type(e).__name__, "message": str(e)[:1200]})
        e = e.__cause__ or e.__context__
    return {"chain": chain}


# -- scenarios -------------------------------------------------------------------------------
def _memory(llm: Any, facts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in facts:
        pid = f["pid"]
        out = {"worker_pid": pid, "vm_hwm_bytes": status_bytes(pid, "VmHWM"),
               "ranges": [range_memory(pid, b, f["reserved_bytes"] // len(
                   f["reservation_bases"])) for b in f["reservation_bases"]]}
    return out


def _sleep_wake(llm: Any, prompt: list[int], max_tokens: int, want: list[int]
                ) -> dict[str, Any]:
    """Release and recommit through the workers; then the same prompt without and with a
    prefix-cache reset (without: vLLM reuses the zeroed blocks, so tokens must differ).

    The reference is the same call made before the release (the prompt alone, prefix cache
    reset): ``want`` came from a batch of several prompts, and on a CPU whose matrix kernels
    depend on the batch shape (AMX) the tiny model's greedy tokens for a prompt alone differ
    from its tokens in a batch (seen: index 4), sleep or not."""
    llm.reset_prefix_cache()
    alone = generate(llm, [prompt], max_tokens)[0]["tokens"]
    released = llm.collective_rpc("kvconnect_release_kv_cache")
    asleep = [range_memory(f["pid"], b, f["reserved_bytes"] // len(f["reservation_bases"]))
              for f in released for b in f["reservation_bases"]]
    woken = llm.collective_rpc("kvconnect_recommit_kv_cache")
    stale = generate(llm, [prompt], max_tokens)[0]
    llm.reset_prefix_cache()
    fresh = generate(llm, [prompt], max_tokens)[0]
    return {"released": released, "asleep_memory": asleep, "woken": woken,
            "stale_prefix_cache": stale, "after_reset": fresh, "before": alone,
            "before_in_batch": want}


def scenario_generate(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    llm = make_llm(spec)
    t1 = time.monotonic()
    outs = generate(llm, spec["prompts"], spec["max_tokens"])
    result: dict[str, Any] = {"outputs": outs, "patch": patch_state(),
                              "startup_s": t1 - t0, "generate_s": time.monotonic() - t1,
                              "front_end_pid": os.getpid()}
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        result["storages"] = runner_storages(llm)
    if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1":
        facts = llm.collective_rpc("kvconnect_kv_cache_facts")
        result["facts"] = facts
        result["memory"] = _memory(llm, facts)
        if spec.get("sleep_wake"):
            result["sleep_wake"] = _sleep_wake(llm, spec["prompts"][0], spec["max_tokens"],
                                               outs[0]["tokens"])
    else:
        result["memory"] = {"worker_pid": os.getpid(),
                            "vm_hwm_bytes": status_bytes(os.getpid(), "VmHWM")}
    return result


def gpu_memory() -> dict[str, int | None]:
    """This process's device memory: ``used_bytes`` as NVML accounts it to this pid (None
    where NVML cannot say), and the device's ``free_bytes`` (cudaMemGetInfo: every process
    on the device counts there)."""
    import torch

    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    used = None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    used = int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here, or no per-process accounting (a VM may hide it)
        used = None
    return {"used_bytes": used, "free_bytes": int(free)}


def scenario_sleep_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own ``LLM.sleep(level=1)`` / ``wake_up()`` (0.33, CUDA) with the plugin's wrap:
    the prompt before, the memory and facts awake / asleep / woken, the prompt after. The
    engine is in-process, so this process is the worker whose memory NVML reports."""
    llm = make_llm({**spec, "engine": {"enable_sleep_mode": True}})
    prompt, n = spec["prompts"][0], spec["max_tokens"]
    before = generate(llm, [prompt], n)[0]
    again = generate(llm, [prompt], n)[0]  # the prefix cache serves it: it is not reset yet
    out: dict[str, Any] = {"before": before, "cached_before_sleep": again,
                           "facts_before": llm.collective_rpc("kvconnect_kv_cache_facts"),
                           "memory_before": gpu_memory()}
    llm.sleep(level=1)
    out.update(memory_asleep=gpu_memory(),
               facts_asleep=llm.collective_rpc("kvconnect_kv_cache_facts"))
    llm.wake_up()
    out.update(memory_woken=gpu_memory(),
               facts_woken=llm.collective_rpc("kvconnect_kv_cache_facts"),
               after=generate(llm, [prompt], n)[0])
    return out


def scenario_bad_input(spec: dict[str, Any]) -> dict[str, Any]:
    """An engine that must refuse to start: the error's type and message, and what is left."""
    import vllm

    from kvconnect.vllm import engine_cache
    from kvconnect.vmm import VmmProbe

    if spec["kind"] == "unsupported_version":  # simulated: pretend another vLLM is installed
        vllm.__version__ = spec["pretend_version"]
    if spec["kind"] == "backend_without_vmm":  # simulated: no device without VMM exists here
        def fake_probe_without_vmm(device: object) -> VmmProbe:
            return VmmProbe(None, f"simulated device {device} without VMM support")

        engine_cache.probe_vmm = fake_probe_without_vmm  # type: ignore[assignment]
    error: dict[str, Any] | None = None
    try:
        make_llm(spec)
    except Exception as exc:  # the error is the result
        error = error_chain(exc)
    return {"error": error, "patch": patch_state(),
            "live_plugin_caches": len(engine_cache.kv_cache_facts()),
            "kvconnect_chunk_mappings": kvconnect_chunk_mappings(os.getpid())}


SCENARIOS = {"generate": scenario_generate, "bad_input": scenario_bad_input,
             "sleep_vllm": scenario_sleep_vllm}


def main() -> int:
    name, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    if name in ("offload", "pd_prefill", "pd_decode"):
        import _engine_transfer_child as transfer

        run = transfer.SCENARIOS[name]
    else:
        run = SCENARIOS[name]
    try:
        result = run(spec)
    except BaseException:
        write_json_file(spec["result"], {"crash": traceback.format_exc()[-4000:]})
        return 1
    write_json_file(spec["result"], result)
    return 0


if __name__ == "__main__":
    exit_engine_child(main())  # the result file is written
