"""One real vLLM engine of an engine-mode conformance case (runs in its own process).

``python -m kvconnect.harness.conformance.engine_child SCENARIO SPEC_JSON_FILE``; the parent
(:mod:`.engine`) sets the environment (``KVCONNECT_EXTENSIBLE_KV`` on or off, an in-process
engine, vLLM's CPU platform) and reads the JSON result this process writes to
``spec["result"]`` (atomically; ``{"crash": traceback}`` when the scenario raised).

Scenarios (tokens are token ids; prompts are lists of them):

- ``reference``: no connector; greedy tokens of every prompt (the comparison's reference).
- ``reload``: the connector in ``kv_both``: the prompt (the connector may store its KV),
  the prefix cache reset, the prompt again (what the connector loads, ``num_cached_tokens``
  counting only its tokens then), and, where the connector API has sleep hooks, sleep /
  wake through the plugin's worker RPCs and the prompt once more.
- ``pd_prefill`` / ``pd_decode``: a producer engine prefills both prompts and serves their
  KV until the consumer is done, after zeroing the second prompt's blocks (the control);
  the consumer decodes both from the producer's ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvconnect.json_files import wait_for_json_file, write_json_file
from kvconnect.verdicts import SKIP, check_entry
from kvconnect.vllm.plugin_settings import settings

__all__ = ["SCENARIOS", "main"]


def _stage(spec: dict[str, Any], name: str) -> None:
    """Record the step this engine is in (the parent names it when the engine dies)."""
    if spec.get("stage_file"):
        Path(spec["stage_file"]).write_text(name)


def _llm(spec: dict[str, Any], role: str | None) -> Any:
    """The engine (stage ``engine start``), with the connector in ``role`` unless None."""
    from vllm import LLM

    from kvconnect.vllm.tiny_model import engine_kwargs

    extra: dict[str, Any] = {"block_size": spec["block_size"]}
    if role is not None:
        from vllm.config import KVTransferConfig

        ktc: dict[str, Any] = {"kv_connector": spec["connector_class"], "kv_role": role,
                               "engine_id": spec["engine_id"],
                               "kv_connector_extra_config": spec.get("extra_config", {})}
        if spec.get("connector_module"):
            ktc["kv_connector_module_path"] = spec["connector_module"]
        extra["kv_transfer_config"] = KVTransferConfig(**ktc)
    _stage(spec, "engine start")
    return LLM(**engine_kwargs(spec["model"], device=spec.get("device", "cpu"), **extra))


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int,
              params: list[dict[str, Any] | None] | None = None) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sampling = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                               extra_args=None if not params or params[i] is None
                               else {"kv_transfer_params": params[i]})
                for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
             "kv_transfer_params": o.kv_transfer_params} for o in outs]


def _facts(llm: Any) -> list[dict[str, Any]] | None:
    if not settings().enabled:
        return None
    return llm.collective_rpc("kvconnect_kv_cache_facts")


def _stand_ins(spec: dict[str, Any]) -> bool:
    """SimpleCPUOffload's CUDA streams / copy engine on a CPU-only machine (see
    :mod:`kvconnect.vllm.host_stand_ins`); nothing for other kinds. True when installed."""
    if spec["kind"] != "simple_cpu_offload":
        return False
    from kvconnect.vllm.host_stand_ins import install_simple_cpu_offload_host_stand_ins

    return install_simple_cpu_offload_host_stand_ins()


def reference(spec: dict[str, Any]) -> dict[str, Any]:
    llm = _llm(spec, None)
    return {"outputs": _generate(llm, spec["prompts"], spec["max_tokens"]),
            "facts": _facts(llm)}


def _sleep_wake(llm: Any, spec: dict[str, Any]) -> dict[str, Any]:
    from .compat import vllm_version

    if not settings().enabled:
        return check_entry(SKIP, reason="plain cache: the plugin's release / recommit needs "
                                        "the extensible cache")
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if not hasattr(get_kv_transfer_group(), "unregister_kv_caches"):
        return check_entry(SKIP, reason=f"vLLM {vllm_version()}'s connector API has no "
                                        "unregister_kv_caches / restore_kv_caches")
    released = llm.collective_rpc("kvconnect_release_kv_cache")
    llm.collective_rpc("kvconnect_recommit_kv_cache")
    llm.reset_prefix_cache()
    again = _generate(llm, spec["prompts"][:1], spec["max_tokens"])[0]
    return {"status": "ran", "released_bytes": [f.get("committed_bytes") for f in released],
            "after_wake": again}


def reload(spec: dict[str, Any]) -> dict[str, Any]:
    stand_ins = _stand_ins(spec)
    llm = _llm(spec, "kv_both")
    n = spec["max_tokens"]
    _stage(spec, "store (first pass)")
    first = _generate(llm, spec["prompts"], n)
    llm.reset_prefix_cache()
    time.sleep(spec.get("settle_s", 0.5))  # asynchronous stores land before the reload
    _stage(spec, "reload")
    again = _generate(llm, spec["prompts"][:1], n)[0]
    _stage(spec, "sleep / wake")
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return {"first": first, "reloaded": again, "sleep_wake": _sleep_wake(llm, spec),
            "facts": _facts(llm), "stand_ins": stand_ins,
            "connector": type(get_kv_transfer_group()).__name__}


def _zero_blocks(llm: Any, block_ids: list[int]) -> int:
    """Zero ``block_ids`` in every layer of an in-process engine's KV cache; bytes zeroed."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    zeroed = 0
    for t in runner.kv_caches:
        t[block_ids] = 0
        zeroed += t[block_ids].numel() * t.element_size()
    return zeroed


def pd_prefill(spec: dict[str, Any]) -> dict[str, Any]:
    """Prefill both prompts for remote decode, publish their ``kv_transfer_params``, then
    zero the KV blocks of the second (the control: a decode that really reads this KV
    must then answer it differently from the reference)."""
    deadline = time.monotonic() + spec["timeout"]
    llm = _llm(spec, "kv_producer")
    _stage(spec, "prefill")
    outs = _generate(llm, spec["prompts"], 1, [{"do_remote_decode": True}] * 2)
    params = [o["kv_transfer_params"] for o in outs]
    zeroed = 0
    control = (params[1] or {}).get("remote_block_ids")
    if control:
        ids = control[0] if control and isinstance(control[0], list) else control
        zeroed = _zero_blocks(llm, [int(b) for b in ids])
    write_json_file(spec["params_out"], {"kv_transfer_params": params,
                                         "control_zeroed_bytes": zeroed})
    _stage(spec, "serving KV to the consumer")
    wait_for_json_file(spec["done_file"], deadline)
    return {"outputs": outs, "control_zeroed_bytes": zeroed, "facts": _facts(llm)}


def pd_decode(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode both prompts from the producer's KV (the second one's was zeroed there)."""
    deadline = time.monotonic() + spec["timeout"]
    llm = _llm(spec, "kv_consumer")
    try:
        got = wait_for_json_file(spec["params_in"], deadline)
        _stage(spec, "decode from the producer's KV")
        remote = _generate(llm, spec["prompts"], spec["max_tokens"], got["kv_transfer_params"])
    finally:
        write_json_file(spec["done_file"], {"done": True})
    return {"remote": remote[0], "control": remote[1],
            "control_zeroed_bytes": got.get("control_zeroed_bytes", 0), "facts": _facts(llm)}


SCENARIOS = {"reference": reference, "reload": reload, "pd_prefill": pd_prefill,
             "pd_decode": pd_decode}


def main(argv: list[str]) -> int:
    from kvconnect.vllm.runtime import prepare_runtime

    name, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    prepare_runtime(spec.get("device", "cpu"))
    for path in spec.get("sys_path", []):
        sys.path.insert(0, path)
    try:
        result = SCENARIOS[name](spec)
    except BaseException:  # noqa: BLE001 - the traceback is the result
        write_json_file(spec["result"], {"crash": traceback.format_exc()[-4000:]})
        return 1
    write_json_file(spec["result"], result)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's atexit teardown can hang or crash: the result is written
