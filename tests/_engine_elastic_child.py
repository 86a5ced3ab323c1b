"""Elastic KV capacity scenarios in real vLLM engines: ``python _engine_elastic_child.py
SCENARIO SPEC`` (started by tests/test_engine_elastic.py through :class:`ElasticBatch`).

- ``elastic``: one engine runs a fixed request script (waves of requests added to
  vLLM's ``LLMEngine`` and stepped); with ``"elastic": true`` it starts at ``N`` blocks and
  grows to ``2N`` between ``generate`` calls, to ``4N`` while requests run, shrinks back to
  ``N`` while requests hold the tail, and checks the refusals; without, it runs the same
  requests at a fixed ``4N`` blocks (the reference).
- ``policy``: a workload that preempts at ``N`` blocks; preemptions from vLLM's own
  metrics, the elastic policy's facts, and (``idle_wait``) what an idle period did.
- ``pd_prefill`` / ``pd_decode``: 1P1D with kvconnect's NIXL connector; prefills grow
  between their requests, the decode grows while it receives.

``IgnoringResizeNixlConnector`` is a test double: it reports a resize to its peers but
keeps the old registration (what a connector that ignores resizes amounts to).
Results are JSON (``result`` in the spec). Units: blocks, bytes, seconds; tokens are ids.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kvconnect.vllm.runtime import prepare_cpu_runtime

prepare_cpu_runtime()

from _engine_child import (  # noqa: E402 - the runtime first
    error_chain,
    range_memory,
    status_bytes,
)
from _engine_runs import exit_engine_child  # noqa: E402

from kvconnect.connectors.vllm.patched_nixl import KvconnectNixlConnector  # noqa: E402
from kvconnect.json_files import write_json_file  # noqa: E402


class IgnoringResizeNixlConnector(KvconnectNixlConnector):
    """Test double of a connector that does not follow a resize. ``MODE``
    ``"keep_registration"``: it takes the new block count (descriptors, handshake payload)
    but registers no new memory; ``"ignore"``: it does nothing and reports success (its
    peers still learn the engine's new KV version from the engine core)."""

    MODE = "keep_registration"

    def kvconnect_resize_kv_caches(self, num_blocks: int, chunks: list[tuple[int, int]]
                                   ) -> dict[str, Any]:
        assert self.kvconnect_resize is not None
        if self.MODE == "ignore":
            return {"ignored": True}
        kept = sorted(self.kvconnect_resize.registered)
        return self.kvconnect_resize.resize(num_blocks, kept)


# -- engines ---------------------------------------------------------------------------------
def make_llm(spec: dict[str, Any], **extra: Any) -> Any:
    from vllm import LLM

    from kvconnect.vllm.tiny_model import engine_kwargs

    return LLM(**engine_kwargs(spec["model"], **spec.get("engine", {}), **extra))


def params(max_tokens: int, transfer: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          extra_args={"kv_transfer_params": transfer} if transfer else None)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(max_tokens),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class Stepper:
    """Requests added to ``llm.llm_engine`` and stepped by hand (every loop under the
    spec's deadline); finished outputs by request id."""

    def __init__(self, llm: Any, deadline: float) -> None:
        self.engine = llm.llm_engine
        self.deadline = deadline
        self.done: dict[str, dict[str, Any]] = {}
        self.added: set[str] = set()

    def add(self, name: str, prompt: list[int], max_tokens: int,
            transfer: dict[str, Any] | None = None) -> None:
        self.added.add(name)
        self.engine.add_request(name, {"prompt_token_ids": prompt}, params(max_tokens, transfer))

    def step(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError(f"the engine did not finish its requests in time: "
                               f"{len(self.done)} finished, still waiting for "
                               f"{sorted(self.added - set(self.done))[:20]}; "
                               f"connector facts: {_connector_facts_text()}")
        for o in self.engine.step():
            if o.finished:
                self.done[o.request_id] = {"tokens": list(o.outputs[0].token_ids),
                                           "finish_reason": o.outputs[0].finish_reason,
                                           "kv_transfer_params": o.kv_transfer_params}

    def run(self) -> None:
        """Step until every request finished."""
        while self.engine.has_unfinished_requests():
            self.step()


def connector_facts() -> dict[str, Any]:
    """The engine's KV connector (a kvconnect NIXL one): its name, NIXL and fast-path facts."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    c = get_kv_transfer_group()
    return {"nixl": c.kvconnect_nixl_facts(), "fast_path": c.kvconnect_fast_path_facts(),
            "name": type(c).__name__}


def _connector_facts_text() -> str:
    """:func:`connector_facts` as JSON text for an error message (never raises)."""
    try:
        return json.dumps(connector_facts())[:3000]
    except Exception as exc:  # noqa: BLE001 - a diagnostic, never the error itself
        return f"unavailable ({type(exc).__name__}: {exc})"


def worker_facts(llm: Any) -> dict[str, Any]:
    (facts,) = llm.collective_rpc("kvconnect_kv_cache_facts")
    return facts


def memory(facts: dict[str, Any]) -> dict[str, int]:
    """The worker's RSS and the reservation's mapped / resident bytes (smaps)."""
    pid = facts["pid"]
    per = facts["reserved_bytes"] // len(facts["reservation_bases"])
    ranges = [range_memory(pid, b, per) for b in facts["reservation_bases"]]
    return {"rss": status_bytes(pid, "VmRSS"),
            "mapped": sum(r["mapped_bytes"] for r in ranges),
            "resident": sum(r["rss_bytes"] for r in ranges)}


def refusal(fn: Any) -> dict[str, Any] | None:
    """The KVCacheResizeError ``fn()`` raises, as JSON (None if it did not raise)."""
    from kvconnect.vllm import KVCacheResizeError

    try:
        fn()
    except KVCacheResizeError as exc:
        return {"code": exc.code, "message": str(exc)}
    return None


# -- scenarios -------------------------------------------------------------------------------
def scenario_elastic(spec: dict[str, Any]) -> dict[str, Any]:
    """The request script; the elastic engine resizes around it (see the module docstring).
    ``waves``: name -> [prompt index, ...]; ``prompts``: the prompts."""
    from kvconnect.vllm import elastic_facts, kv_cache_resize_status, resize_kv_cache

    elastic = bool(spec["elastic"])
    n = int(spec["blocks"])
    llm = make_llm(spec, num_gpu_blocks_override=n if elastic else 4 * n)
    deadline = time.monotonic() + spec["timeout"]
    prompts, waves, mt = spec["prompts"], spec["waves"], spec["max_tokens"]
    out: dict[str, Any] = {"facts": {}, "core": {}, "resizes": {}, "refusals": {}}

    def wave(name: str, steps: Stepper, max_tokens: int = mt) -> None:
        for i in waves[name]:
            steps.add(f"{name}-{i}", prompts[i], max_tokens)

    def snap(tag: str) -> None:
        if elastic:
            out["facts"][tag] = worker_facts(llm)
            out["core"][tag] = elastic_facts(llm)
            out.setdefault("memory", {})[tag] = memory(out["facts"][tag])

    snap("start")
    # between generate calls: N -> 2N
    out["b0"] = generate(llm, [prompts[i] for i in waves["b0"]], mt)
    if elastic:
        out["resizes"]["between"] = resize_kv_cache(llm, 2 * n)
    llm.reset_prefix_cache()
    out["b1"] = generate(llm, [prompts[i] for i in waves["b1"]], mt)
    snap("after_b1")
    llm.reset_prefix_cache()
    # while requests run: 2N -> 4N, then more requests than 2N blocks hold
    steps = Stepper(llm, deadline)
    wave("w1", steps, spec["long_tokens"])
    for _ in range(2):
        steps.step()
    if elastic:
        out["unfinished_at_grow"] = steps.engine.has_unfinished_requests()
        out["resizes"]["during"] = resize_kv_cache(llm, 4 * n)
    wave("w2", steps, spec["long_tokens"])  # still running at the snapshot below
    for _ in range(4):
        steps.step()
    snap("during_w2")
    steps.run()
    llm.reset_prefix_cache()
    # shrink back to N while requests hold the tail
    wave("w3", steps, spec["longest_tokens"])  # holds its tail well past the shrink's start
    for _ in range(3):
        steps.step()
    if elastic:
        snap("before_shrink")
        started = resize_kv_cache(llm, n, timeout=spec["timeout"] / 2, wait=False)
        out["resizes"]["shrink_started"] = started
        out["refusals"]["pending"] = refusal(lambda: resize_kv_cache(llm, 3 * n))
        polls = []
        while steps.engine.has_unfinished_requests():
            steps.step()
            polls.append(kv_cache_resize_status(llm, started["op"]))
            if polls[-1]["state"] != "pending" and "at_shrink" not in out["memory"]:
                out["memory"]["at_shrink"] = memory(worker_facts(llm))
        final = polls[-1] if polls else started
        while final["state"] == "pending" and time.monotonic() < deadline:
            time.sleep(0.05)
            final = kv_cache_resize_status(llm, started["op"])
        out["resizes"]["shrink"] = final
        out["shrink_polls"] = [{k: p.get(k) for k in ("state", "busy_blocks")} for p in polls]
        snap("after_shrink")
    steps.run()
    # a shrink whose tail stays busy past its timeout is cancelled, the size unchanged
    llm.reset_prefix_cache()
    if elastic:
        out["resizes"]["regrow"] = resize_kv_cache(llm, 4 * n)
    wave("w4", steps, spec["longest_tokens"])
    for _ in range(3):
        steps.step()
    if elastic:  # the core steps on while the front end waits: the timeout must be short
        out["refusals"]["busy_timeout"] = refusal(lambda: resize_kv_cache(llm, n, timeout=0.05))
        out["unfinished_at_timeout"] = steps.engine.has_unfinished_requests()
        snap("after_timeout")
    steps.run()
    out["requests"] = steps.done
    if elastic:
        f = worker_facts(llm)
        out["refusals"]["beyond_capacity"] = refusal(
            lambda: resize_kv_cache(llm, f["capacity_blocks"] + 1))
        avail = _mem_available()
        out["mem_available"] = avail
        out["refusals"]["beyond_device"] = refusal(lambda: resize_kv_cache(
            llm, min(f["capacity_blocks"], 2 * avail // f["bytes_per_block"])))
        out["refusals"]["too_small"] = refusal(lambda: resize_kv_cache(llm, 1))
        llm.collective_rpc("kvconnect_release_kv_cache")
        out["refusals"]["released"] = refusal(lambda: resize_kv_cache(llm, 2 * n))
        llm.collective_rpc("kvconnect_recommit_kv_cache")
        llm.reset_prefix_cache()
        snap("end")
        out["after_refusals"] = generate(llm, [prompts[i] for i in waves["b0"]], mt)
    return out


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def _preemptions(llm: Any) -> int:
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            return int(getattr(m, "value", 0))
    raise KeyError("vllm:num_preemptions is not among vLLM's metrics")


def scenario_policy(spec: dict[str, Any]) -> dict[str, Any]:
    """A workload that preempts at ``blocks``; with the policy on (environment), none."""
    from kvconnect.vllm import elastic_facts

    llm = make_llm(spec, num_gpu_blocks_override=int(spec["blocks"]), disable_log_stats=False)
    outs = generate(llm, spec["prompts"], spec["max_tokens"])
    out: dict[str, Any] = {"tokens": outs, "preemptions": _preemptions(llm)}
    if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1":
        out["core"] = elastic_facts(llm)
        out["facts"] = worker_facts(llm)
        if spec.get("idle_wait"):
            deadline = time.monotonic() + spec["idle_wait"]
            while time.monotonic() < deadline and elastic_facts(llm)["num_blocks"] > spec[
                    "blocks"]:
                time.sleep(0.2)
            out["core_after_idle"] = elastic_facts(llm)
            out["facts_after_idle"] = worker_facts(llm)
    return out


def scenario_offload(spec: dict[str, Any]) -> dict[str, Any]:
    """kvconnect's SimpleCPUOffload (CPU stand-ins for CUDA streams) across a grow and a
    shrink: prompts whose blocks lie past the old size are stored and reloaded; a control
    whose CPU copy was zeroed before the reload."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvconnect.vllm import resize_kv_cache
    from kvconnect.vllm.host_stand_ins import install_simple_cpu_offload_host_stand_ins

    install_simple_cpu_offload_host_stand_ins()
    n = int(spec["blocks"])
    ktc = KVTransferConfig(kv_connector="KvconnectSimpleCPUOffloadConnector",
                           kv_connector_module_path="kvconnect.connectors.vllm", kv_role="kv_both",
                           kv_connector_extra_config={"cpu_bytes_to_use": 256 << 20})
    llm = make_llm(spec, num_gpu_blocks_override=n, kv_transfer_config=ktc)
    handler = get_kv_transfer_group().worker_handler
    mt, prompts = spec["max_tokens"], spec["prompts"]
    out: dict[str, Any] = {"grow": resize_kv_cache(llm, 4 * n)}
    out["regions_after_grow"] = {k: list(v.shape) for k, v in handler.gpu_kv_caches.items()}

    def run() -> list[dict[str, Any]]:
        llm.reset_prefix_cache()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(mt),
                            use_tqdm=False)
        return [{"tokens": list(o.outputs[0].token_ids),
                 "num_cached_tokens": o.num_cached_tokens} for o in outs]

    out["first"] = run()
    out["stored"] = dict(handler._backend.copied_blocks)
    out["reloaded"] = run()
    out["loaded"] = dict(handler._backend.copied_blocks)
    out["shrink"] = resize_kv_cache(llm, n, timeout=60)
    out["regions_after_shrink"] = {k: list(v.shape) for k, v in handler.gpu_kv_caches.items()}
    out["after_shrink"] = run()
    for t in handler.cpu_kv_caches.values():  # the control: what a reload reads is zero now
        t.zero_()
    out["from_zeroed_copy"] = run()
    out["facts"] = worker_facts(llm)
    return out


SCENARIOS = {"elastic": scenario_elastic, "policy": scenario_policy,
             "offload": scenario_offload}


def main() -> int:
    name, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    if name.startswith("pd_"):
        import _engine_elastic_pd as pd

        run = pd.SCENARIOS[name]
    else:
        run = SCENARIOS[name]
    try:
        result = run(spec)
    except BaseException as exc:
        write_json_file(spec["result"], {"crash": traceback.format_exc()[-4000:],
                                         "error": error_chain(exc)})
        return 1
    write_json_file(spec["result"], result)
    return 0


if __name__ == "__main__":
    exit_engine_child(main())
