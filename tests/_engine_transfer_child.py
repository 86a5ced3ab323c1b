"""Engine scenarios with a KV connector (started through tests/_engine_child.py).

- ``pd_prefill``: a producer engine (NIXL) prefills the prompt, writes the request's
  ``kv_transfer_params`` to ``params_out`` and serves its KV until ``done_file`` appears
  (with ``may_fail_to_start``, an engine that refuses to start reports why instead); with
  ``check_notified``, then polls upstream's ``get_finished`` for the requests the decode's
  notification marked read. Both report kvconnect's fast-path facts where the connector
  has them (``fast_path``).
- ``pd_decode``: a consumer engine reads the parameters of every prefill engine in
  ``prefills``, decodes each request from the remote KV (after a prefix-cache reset each:
  every read moves the whole prompt), then the prompt locally (after a reset too): the
  single-engine reference, same weights, same engine.
- ``offload``: kvconnect's SimpleCPUOffload in an in-process engine (CPU stand-ins for CUDA
  streams: :mod:`kvconnect.vllm.host_stand_ins`): store, reload, and a control whose CPU copy
  was zeroed before the reload.
"""

from __future__ import annotations

import os
import time
from typing import Any

from _engine_child import (
    error_chain,
    generate,
    in_process_worker,
    make_llm,
)

from kvconnect.json_files import wait_for_json_file, write_json_file


def _with_connector(spec: dict[str, Any], role: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    ktc: dict[str, Any] = {"kv_connector": spec["connector"], "kv_role": role,
                           "engine_id": spec["engine_id"],
                           "kv_connector_extra_config": spec.get("extra_config", {})}
    if spec.get("connector_module"):
        ktc["kv_connector_module_path"] = spec["connector_module"]
    return dict(spec, engine={**spec.get("engine", {}),
                              "kv_transfer_config": KVTransferConfig(**ktc)})


def _facts(llm: Any) -> list[dict[str, Any]] | None:
    if os.environ.get("KVCONNECT_EXTENSIBLE_KV") != "1":
        return None
    return llm.collective_rpc("kvconnect_kv_cache_facts")


def _connector() -> Any:
    """This process's worker-side connector (in-process engines), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _fast_path_facts() -> dict[str, Any] | None:
    facts = getattr(_connector(), "kvconnect_fast_path_facts", None)
    return facts() if facts is not None else None


def _finished_sending(deadline: float) -> list[str]:
    """Requests the decode's notification marked read (upstream's get_finished, polled:
    an idle engine does not step, so nothing else would look)."""
    connector = _connector()
    while time.monotonic() < deadline:
        sending, _ = connector.get_finished(set())
        if sending:
            return sorted(sending)
        time.sleep(0.1)
    return []


def pd_prefill(spec: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + spec["timeout"]
    try:
        llm = make_llm(_with_connector(spec, "kv_producer"))
    except Exception as exc:  # a connector refusing the cache at registration
        if not spec.get("may_fail_to_start"):
            raise
        write_json_file(spec["params_out"], {"start_error": error_chain(exc)})
        return {"start_error": error_chain(exc)}
    out = generate(llm, [spec["prompt"]], 1, [{"do_remote_decode": True}])[0]
    write_json_file(spec["params_out"], {"kv_transfer_params": out["kv_transfer_params"]})
    done = wait_for_json_file(spec["done_file"], deadline)
    result = {"output": out, "facts": _facts(llm), "fast_path": _fast_path_facts()}
    if spec.get("check_notified") and done.get("ok"):
        result["finished_sending"] = _finished_sending(min(deadline, time.monotonic() + 30))
    return result


def pd_decode(spec: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + spec["timeout"]
    try:
        llm = make_llm(_with_connector(spec, "kv_consumer"))
    except Exception as exc:  # a connector refusing the cache at registration
        write_json_file(spec["done_file"], {"done": True, "ok": False})
        if not spec.get("may_fail_to_start"):
            raise
        return {"start_error": error_chain(exc)}
    remote: dict[str, Any] = {}
    ok = False
    try:
        for name, params_file in spec["prefills"].items():
            got = wait_for_json_file(params_file, deadline)
            if "start_error" in got:  # that prefill refused to start: nothing to read
                remote[name] = {"prefill_start_error": got["start_error"]}
                continue
            params = got["kv_transfer_params"]
            llm.reset_prefix_cache()  # every remote read moves the whole prompt
            remote[name] = generate(llm, [spec["prompt"]], spec["max_tokens"], [params])[0]
        llm.reset_prefix_cache()
        local = generate(llm, [spec["prompt"]], spec["max_tokens"])[0]
        ok = True
    finally:
        write_json_file(spec["done_file"], {"done": True, "ok": ok})
    return {"remote": remote, "local": local, "facts": _facts(llm),
            "fast_path": _fast_path_facts()}


def offload(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnect.vllm.host_stand_ins import install_simple_cpu_offload_host_stand_ins

    stand_ins = install_simple_cpu_offload_host_stand_ins()
    llm = make_llm(_with_connector(spec, "kv_both"))
    n = spec["max_tokens"]
    first = generate(llm, [spec["prompt"]], n)[0]
    handler = get_kv_transfer_group().worker_handler
    backend = handler._backend
    stored = dict(getattr(backend, "copied_blocks", {}))
    llm.reset_prefix_cache()
    reloaded = generate(llm, [spec["prompt"]], n)[0]
    loaded = dict(getattr(backend, "copied_blocks", {}))
    for t in handler.cpu_kv_caches.values():  # the control: what a reload reads is now zero
        t.zero_()
    llm.reset_prefix_cache()
    from_zeroed = generate(llm, [spec["prompt"]], n)[0]
    gpu = {name: [t.data_ptr(), t.untyped_storage().nbytes()]
           for name, t in (handler.gpu_kv_caches or {}).items()}
    storages = sorted({t.untyped_storage().data_ptr()
                       for t in in_process_worker(llm).model_runner.kv_caches})
    return {"stand_ins": stand_ins, "first": first, "reloaded": reloaded,
            "from_zeroed_copy": from_zeroed, "copied_after_first": stored,
            "copied_after_reload": loaded, "offload_regions": gpu,
            "runner_storages": storages, "facts": _facts(llm),
            "connector": type(get_kv_transfer_group()).__name__}


SCENARIOS = {"pd_prefill": pd_prefill, "pd_decode": pd_decode, "offload": offload}
