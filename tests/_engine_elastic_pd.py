"""1P1D scenarios with elastic KV caches (started through tests/_engine_elastic_child.py).

Phases ``a``, ``b``, ``c``. A prefill engine (``pd_prefill``) prefills its phase's
prompts (``do_remote_decode``), writes their ``kv_transfer_params`` and waits for the
decode's ``<phase>.done``; before phase ``b`` it grows from ``N`` to ``4N`` blocks (between
its requests), and phase ``b`` has more prompts than ``N`` blocks hold, so the decode
reads blocks past the old size; before phase ``c`` it shrinks back to ``N`` (stepping
itself until the decode's reads of phase ``b`` freed the tail). The decode (``pd_decode``) receives phase ``a`` from every
prefill, then adds all of phase ``b`` at once (more than ``N`` blocks), steps, grows to
``4N`` while they are in flight, and steps to the end; then it decodes every prompt
locally (the single-engine reference). Both report the plugin's facts, the NIXL
connector's (registrations, resizes, refreshed peers) and the fast path's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from _engine_elastic_child import Stepper, connector_facts, generate, make_llm, params, worker_facts

from kvconnect.json_files import wait_for_json_file, write_json_file


def _with_connector(spec: dict[str, Any], role: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(kv_connector=spec["connector"], kv_role=role,
                           engine_id=spec["engine_id"],
                           kv_connector_module_path=spec["connector_module"],
                           kv_connector_extra_config=spec.get("extra_config", {}))
    return dict(spec, engine={**spec.get("engine", {}), "kv_transfer_config": ktc})


def pd_prefill(spec: dict[str, Any]) -> dict[str, Any]:
    from kvconnect.vllm import elastic_facts, resize_kv_cache

    deadline = time.monotonic() + spec["timeout"]
    n = int(spec["blocks"])
    llm = make_llm(_with_connector(spec, "kv_producer"), num_gpu_blocks_override=n)
    out: dict[str, Any] = {"phases": {}}
    for phase in ("a", "b", "c"):
        if phase == "b" and spec.get("double"):
            import _engine_elastic_child as child  # the module vLLM loaded the double from

            from kvconnect.vllm import KVCacheResizeError

            try:  # keeping the old registration: NIXL itself refuses the descriptors
                out["keep_registration"] = resize_kv_cache(llm, 4 * n)
            except KVCacheResizeError as exc:
                out["keep_registration"] = {"code": exc.code, "message": str(exc),
                                            "facts": worker_facts(llm)}
            child.IgnoringResizeNixlConnector.MODE = "ignore"
        if phase == "b":
            out["resize"] = resize_kv_cache(llm, 4 * n)
            out["facts_after_resize"] = worker_facts(llm)
        if phase == "c" and not spec.get("double"):  # the double's unread tail stays held
            out["shrink"] = _shrink(llm, n, deadline)
            out["facts_after_shrink"] = worker_facts(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"][phase]],
                            params(1, {"do_remote_decode": True}), use_tqdm=False)
        tp = [o.kv_transfer_params for o in outs]
        out["phases"][phase] = tp
        write_json_file(spec["params_out"][phase], {"kv_transfer_params": tp})
        wait_for_json_file(spec["done"][phase], deadline)
    out["facts"] = worker_facts(llm)
    out["core"] = elastic_facts(llm)
    out["connector"] = connector_facts()
    return out


def _shrink(llm: Any, num_blocks: int, deadline: float) -> dict[str, Any]:
    """Shrink this in-process engine, stepping it (its held blocks are freed in a step,
    once the decode's notification arrived) until the shrink is done."""
    from kvconnect.vllm import kv_cache_resize_status, resize_kv_cache

    result = resize_kv_cache(llm, num_blocks, timeout=deadline - time.monotonic(), wait=False)
    while result["state"] == "pending" and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.01)
        result = kv_cache_resize_status(llm, result["op"])
    return result


def pd_decode(spec: dict[str, Any]) -> dict[str, Any]:
    from kvconnect.vllm import resize_kv_cache

    deadline = time.monotonic() + spec["timeout"]
    n = int(spec["blocks"])
    llm = make_llm(_with_connector(spec, "kv_consumer"), num_gpu_blocks_override=n)
    out: dict[str, Any] = {"remote": {}}
    prompts: dict[str, list[int]] = {}
    steps = Stepper(llm, deadline)
    try:
        for phase in ("a", "b", "c"):
            for prefill, files in spec["prefills"].items():
                tp = wait_for_json_file(files[phase], deadline)["kv_transfer_params"]
                for i, (prompt, p) in enumerate(zip(spec["prompts"][prefill][phase], tp,
                                                    strict=True)):
                    name = f"{prefill}-{phase}{i}"
                    prompts[name] = prompt
                    steps.add(name, prompt, spec["max_tokens"], p)
            if phase == "b":
                for _ in range(3):
                    steps.step()
                out["unfinished_at_grow"] = steps.engine.has_unfinished_requests()
                out["resize"] = resize_kv_cache(llm, 4 * n)
            steps.run()
            write_json_file(spec["done"][phase], {"done": True})
    finally:
        for files in (spec["done"],):
            for path in files.values():
                if not os.path.exists(path):
                    write_json_file(path, {"done": False})
    out["remote"] = steps.done
    llm.reset_prefix_cache()
    names = sorted(prompts)
    local = generate(llm, [prompts[k] for k in names], spec["max_tokens"])
    out["local"] = dict(zip(names, local, strict=True))
    out["facts"] = worker_facts(llm)
    out["connector"] = connector_facts()
    return out


SCENARIOS = {"pd_prefill": pd_prefill, "pd_decode": pd_decode}
