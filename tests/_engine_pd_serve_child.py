"""One engine of a 1P1D pair in vLLM's default multi-process mode, as ``vllm serve`` runs it
(front end, engine core and worker in separate processes): ``python _engine_pd_serve_child.py
ROLE SPEC`` (started by tests/test_engine_pd_multiprocess.py through tests/_engine_runs.py).

Unlike tests/_engine_child.py this process never aliases a NIXL module: vLLM's NIXL
connector imports ``nixl._api`` in the worker process, where only what is installed counts
(the ``nixl`` package of ``kvconnect[nixl]``). The front end records where ``nixl`` comes
from; the worker's facts (its KV cache and its connector's fast path) come back through
``llm.collective_rpc("kvconnect_kv_cache_facts")``.

Every engine first waits until all are built (``ready_file``, then each of ``ready_files``):
a prefill holding a request for a remote decode runs vLLM's busy loop (its worker and NIXL's
progress thread take most of two cores, measured), which on a 2-core machine starved the
engines still starting past the deadline (fresh-clone CI).

- ``prefill``: prefills the prompt (``do_remote_decode``), writes the request's
  ``kv_transfer_params`` to ``params_out`` and serves its KV until ``done_file`` appears.
- ``decode``: waits until every prefill in ``prefills`` has published its request, then
  decodes the prompt from each (a prefix-cache reset before each: every read moves the whole
  prompt), then locally (the reference).

Units: tokens are token ids.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from _engine_runs import exit_engine_child

from kvconnect.json_files import wait_for_json_file, write_json_file


def _nixl_found() -> dict[str, Any]:
    """Where ``import nixl`` would come from here, before vLLM runs (nothing aliased)."""
    spec = importlib.util.find_spec("nixl")
    return {"preloaded": "nixl" in sys.modules,
            "origin": None if spec is None else spec.origin}


def _llm(spec: dict[str, Any], role: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvconnect.vllm.tiny_model import engine_kwargs

    ktc = KVTransferConfig(kv_connector="KvconnectNixlConnector",
                           kv_connector_module_path="kvconnect.connectors.vllm", kv_role=role,
                           engine_id=spec["engine_id"],
                           kv_connector_extra_config=spec["extra_config"])
    return LLM(**engine_kwargs(spec["model"], kv_transfer_config=ktc,
                               device=os.environ.get("KVCONNECT_ENGINE_DEVICE", "cpu")))


def _generate(llm: Any, prompt: list[int], max_tokens: int,
              transfer: dict[str, Any] | None = None) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                            extra_args={"kv_transfer_params": transfer} if transfer else None)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return {"tokens": list(out.outputs[0].token_ids),
            "finish_reason": out.outputs[0].finish_reason,
            "num_cached_tokens": out.num_cached_tokens,
            "kv_transfer_params": out.kv_transfer_params}


def _built(llm: Any, spec: dict[str, Any], deadline: float) -> Any:
    """``llm`` once every engine of the pair is built (the start barrier)."""
    write_json_file(spec["ready_file"], {"engine_id": spec["engine_id"]})
    for path in spec["ready_files"]:
        wait_for_json_file(path, deadline)
    return llm


def prefill(spec: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + spec["timeout"]
    found = _nixl_found()
    llm = _built(_llm(spec, "kv_producer"), spec, deadline)
    out = _generate(llm, spec["prompt"], 1, {"do_remote_decode": True})
    write_json_file(spec["params_out"], {"kv_transfer_params": out["kv_transfer_params"]})
    wait_for_json_file(spec["done_file"], deadline)
    return {"nixl": found, "front_end_pid": os.getpid(), "output": out,
            "facts": llm.collective_rpc("kvconnect_kv_cache_facts")}


def decode(spec: dict[str, Any]) -> dict[str, Any]:
    deadline = time.monotonic() + spec["timeout"]
    found = _nixl_found()
    llm = _built(_llm(spec, "kv_consumer"), spec, deadline)
    remote: dict[str, Any] = {}
    try:
        # every prefill up before the first read: on a 2-core machine an engine still starting
        # (UCX's start took 42 s there once) starves the others, and vLLM's NIXL handshake gives
        # a peer 5 s to answer; a read that missed it finished with "error" (fresh-clone CI)
        transfers = {name: wait_for_json_file(params_file, deadline)["kv_transfer_params"]
                     for name, params_file in spec["prefills"].items()}
        for name, params in transfers.items():
            llm.reset_prefix_cache()
            remote[name] = _generate(llm, spec["prompt"], spec["max_tokens"], params)
        llm.reset_prefix_cache()
        local = _generate(llm, spec["prompt"], spec["max_tokens"])
    finally:
        write_json_file(spec["done_file"], {"done": True})
    return {"nixl": found, "front_end_pid": os.getpid(), "remote": remote, "local": local,
            "facts": llm.collective_rpc("kvconnect_kv_cache_facts")}


def main() -> int:
    from kvconnect.vllm.runtime import request_amx_permission

    role, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    request_amx_permission()  # before UCX starts its threads (docs/vllm-plugin.md)
    try:
        result = {"prefill": prefill, "decode": decode}[role](spec)
    except BaseException:
        write_json_file(spec["result"], {"crash": traceback.format_exc()[-4000:]})
        return 1
    write_json_file(spec["result"], result)
    return 0


if __name__ == "__main__":
    exit_engine_child(main())  # the result file is written
