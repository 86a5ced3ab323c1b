"""P/D with real vLLM engines: time-to-first-token and KV transfer time per request, for the
ipc fast path, NIXL, and stock NixlConnector on the plugin's cache and on vLLM's own.

Every engine is its own process (an in-process engine core, as the engine tests run them) on
one device; prefill engines are producers, decode engines consumers. Routes:

- ``ipc``: ``KvconnectNixlConnector``, plugin on both sides: the same-host fast path.
- ``nixl``: the same connector, the fast path off at the prefill (``kvconnect_ipc: false``):
  a NIXL READ out of an extensible cache, as across hosts.
- ``stock-plugin``: vLLM's ``NixlConnector`` on both sides, plugin on (a capacity of 8x the
  KV cache, one stock NIXL can partition).
- ``stock-plain``: vLLM's ``NixlConnector``, plugin off: vLLM's own cache.

``ipc`` and ``nixl`` share one decode engine. For each prompt length, each route serves the
same prompt ``--repeats`` times (the decode's prefix cache reset before each, so every
request moves the whole prompt); each decode engine then answers the prompt locally (the
single-engine reference); a prefill engine with other weights (``control``, over ipc) must
give other tokens. Per request: the decode's wall time, vLLM's own time-to-first-token
(``vllm:time_to_first_token_seconds``) and KV transfer time, bytes and count
(``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``: vLLM's NIXL stats, fed by
the fast path's telemetry for ipc reads); the fast path's facts (route, reads). Beside them,
in the same run: a plain device-to-device copy of the same bytes (CUDA events, median of 5).

The model has Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128, bf16: 128 KiB of KV
per token) with a tiny hidden size (kvconnect.vllm.tiny_model). Units: seconds, bytes,
tokens. Writes ``--json`` and ``--markdown``; exits 1 when a route's tokens differ from the
reference, the control does not differ, or an engine failed (the reason is in the JSON)::

    python benchmarks/bench_vllm_pd.py --prompt-tokens 1024 8192 32768 --json pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROUTES = ("ipc", "nixl", "stock-plugin", "stock-plain")
KVCONNECT = ("KvconnectNixlConnector", "kvconnect.connectors.vllm")
STOCK = ("NixlConnector", None)
GEOMETRY = {"num_hidden_layers": 32, "num_attention_heads": 8, "num_key_value_heads": 8,
            "head_dim": 128}
POLL_S = 0.05


# -- the engine side ---------------------------------------------------------------------------
def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _metrics(llm: Any) -> dict[str, float]:
    """Sums and counts of vLLM's histograms we read (every label set added up)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in ("vllm:time_to_first_token_seconds", "vllm:nixl_xfer_time_seconds",
                      "vllm:nixl_bytes_transferred", "vllm:nixl_post_time_seconds"):
            out[m.name + ":sum"] = out.get(m.name + ":sum", 0.0) + float(m.sum)
            out[m.name + ":count"] = out.get(m.name + ":count", 0.0) + float(m.count)
    return out


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> dict[str, float]:
    return {"sum": after.get(name + ":sum", 0.0) - before.get(name + ":sum", 0.0),
            "count": after.get(name + ":count", 0.0) - before.get(name + ":count", 0.0)}


def _fast_path() -> dict[str, Any] | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    facts = getattr(get_kv_transfer_group(), "kvconnect_fast_path_facts", None)
    return facts() if facts is not None else None


def _copy_reference(nbytes: int, src_device: str = "cuda:0", repeats: int = 5
                    ) -> dict[str, Any]:
    """A plain copy of ``nbytes`` from ``src_device`` into this engine's device (cuda:0):
    device-to-device, or a peer copy across GPUs (torch, CUDA events). ``seconds``: the
    median of ``repeats`` warm copies; ``cold_seconds``: the first copy into fresh buffers
    (pages the device has not touched yet, like a fetch's newly prefilled blocks)."""
    import torch

    def timed(dst: Any, src: Any) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    cold = timed(dst, src)
    times = [timed(dst, src) for _ in range(repeats)]
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "seconds": sorted(times)[len(times) // 2], "all": times,
            "cold_seconds": cold}


def _fetch_probe(blocks: int, peer_engine: str, repeats: int = 10) -> dict[str, Any]:
    """In the decode engine's process while it is idle: fetches of ``blocks`` random blocks
    from ``peer_engine`` through the fast path's own transport (mapping and plan as the
    engine's reads use them), each timed as the fast path times a read (``seconds``, with
    ``host_seconds`` / ``launch_seconds``); ``gated``: the same behind a 1 ms device sleep,
    so the copy's events cover the device's work only, not the host's issuing; ``kernel``:
    ``repeats`` copies back to back between two events (device time per copy). Medians;
    ``first``: the first fetch's ``seconds``. Then the prefix cache is reset (the probe
    wrote into free blocks)."""
    import numpy as np
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    fast = get_kv_transfer_group().kvconnect_fast_path
    (peer,) = [f"{p['engine_id']}#{p['remote_rank']}" for p in fast.facts()["peers"]
               if p["engine_id"] == peer_engine and p.get("plan")]
    transport = fast.transport
    plan = transport.plan_for(peer)
    rng = np.random.default_rng(blocks)

    def ids() -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.sort(rng.choice(plan.src_blocks, blocks, replace=False)),
                 rng.choice(plan.dst_blocks, blocks, replace=False))]

    def fetch(gate: bool) -> Any:
        torch.cuda.synchronize()
        if gate:
            torch.cuda._sleep(2_000_000)  # about 1 ms of device time before the copy
        return transport.start(peer, ids()).wait(30.0)

    def med(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    out: dict[str, Any] = {"blocks": blocks, "peer": peer, "plan": plan.describe()}
    for name, gate in (("open", False), ("gated", True)):
        results = [fetch(gate) for _ in range(repeats + 1)]
        out[name] = {"first": results[0].seconds,
                     "seconds": med([r.seconds for r in results[1:]]),
                     "host_seconds": med([r.host_seconds for r in results[1:]]),
                     "launch_seconds": med([r.launch_seconds for r in results[1:]])}
    batches = [ids()[0] for _ in range(repeats)]
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(2_000_000)
    start.record()
    for src, dst in batches:
        plan.copy(src, dst, validate=False)
    end.record()
    end.synchronize()
    out["kernel"] = {"seconds": start.elapsed_time(end) / 1e3 / repeats}
    return out


def engine_main(spec_path: str) -> int:
    """The engine process: build the engine, then answer command files until ``stop``."""
    spec = json.loads(Path(spec_path).read_text())
    box = Path(spec["box"])
    from kvconnect.vllm.runtime import prepare_runtime

    prepare_runtime(spec["device"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvconnect.vllm.tiny_model import engine_kwargs

    ktc: dict[str, Any] = {"kv_connector": spec["connector"], "kv_role": spec["role"],
                           "engine_id": spec["name"],
                           "kv_connector_extra_config": spec["extra_config"]}
    if spec["connector_module"]:
        ktc["kv_connector_module_path"] = spec["connector_module"]
    t0 = time.monotonic()
    try:
        llm = LLM(**engine_kwargs(spec["model"], device=spec["device"],
                                  kv_transfer_config=KVTransferConfig(**ktc),
                                  disable_log_stats=False, **spec["engine"]))
    except Exception as exc:
        _write(box / "ready.json", {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        return 1
    facts = (llm.collective_rpc("kvconnect_kv_cache_facts")
             if os.environ.get("KVCONNECT_EXTENSIBLE_KV") == "1" else None)
    _write(box / "ready.json", {"ok": True, "startup_s": time.monotonic() - t0, "facts": facts})
    n = 0
    while True:
        cmd_path = box / f"cmd-{n}.json"
        if not cmd_path.exists():
            time.sleep(POLL_S)
            continue
        cmd = json.loads(cmd_path.read_text())
        if cmd["op"] == "stop":
            return 0
        try:
            out = _serve(llm, SamplingParams, cmd)
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        _write(box / f"out-{n}.json", out)
        n += 1


def _serve(llm: Any, sampling: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    if cmd["op"] == "copy_reference":
        return _copy_reference(cmd["bytes"], cmd.get("src_device", "cuda:0"))
    if cmd["op"] == "fetch_probe":
        try:
            return _fetch_probe(cmd["blocks"], cmd["peer"])
        finally:
            llm.reset_prefix_cache()
    extra = {"kv_transfer_params": cmd["params"]} if cmd.get("params") else None
    if cmd["op"] == "prefill":
        extra = {"kv_transfer_params": {"do_remote_decode": True}}
    sp = sampling(max_tokens=cmd["max_tokens"], temperature=0, ignore_eos=True, extra_args=extra)
    llm.reset_prefix_cache()  # every request moves (or computes) the whole prompt
    before = _metrics(llm)
    t0 = time.perf_counter()
    (o,) = llm.generate([{"prompt_token_ids": cmd["prompt"]}], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = _metrics(llm)
    return {"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
            "num_cached_tokens": o.num_cached_tokens, "kv_transfer_params": o.kv_transfer_params,
            "wall_s": wall,
            "ttft": _delta(after, before, "vllm:time_to_first_token_seconds"),
            "xfer": _delta(after, before, "vllm:nixl_xfer_time_seconds"),
            "xfer_bytes": _delta(after, before, "vllm:nixl_bytes_transferred"),
            "post": _delta(after, before, "vllm:nixl_post_time_seconds"),
            "fast_path": _fast_path()}


# -- the coordinator -----------------------------------------------------------------------------
class Engine:
    """One engine process and its command box (files; each wait has a deadline)."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], work: Path) -> None:
        from kvconnect.child import Child

        self.name, self.box, self.n = name, work / name, 0
        self.box.mkdir()
        spec_path = self.box / "spec.json"
        spec_path.write_text(json.dumps({**spec, "name": name, "box": str(self.box)}))
        self.log = self.box / "engine.log"
        self.child = Child.spawn([sys.executable, str(HERE), "--engine", str(spec_path)],
                                 log_path=str(self.log), own_group=True, env=env)
        self.ready: dict[str, Any] | None = None

    def wait_ready(self, deadline: float) -> dict[str, Any]:
        self.ready = self._wait(self.box / "ready.json", deadline)
        return self.ready

    def call(self, cmd: dict[str, Any], deadline: float) -> dict[str, Any]:
        _write(self.box / f"cmd-{self.n}.json", cmd)
        out = self._wait(self.box / f"out-{self.n}.json", deadline)
        self.n += 1
        return out

    def _wait(self, path: Path, deadline: float) -> dict[str, Any]:
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            if self.child.exited():
                return {"ok": False, "error": f"engine {self.name} exited; log tail: "
                                              f"{self.tail()}"}
            time.sleep(POLL_S)
        return {"ok": False, "error": f"engine {self.name}: no answer in time; log tail: "
                                      f"{self.tail()}"}

    def tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        try:
            _write(self.box / f"cmd-{self.n}.json", {"op": "stop"})
        finally:
            self.child.end(wait_s=10, term_grace_s=2)


def _engines(args: argparse.Namespace, models: dict[str, str], work: Path
             ) -> dict[str, Engine]:
    """Start every engine the routes need (at once: start-up overlaps)."""
    from kvconnect.ports import free_tcp_port

    ports: set[int] = set()
    max_len = max(args.prompt_tokens) + args.max_tokens + 64
    engine = {"max_model_len": max_len, "kv_cache_memory_bytes": args.kv_cache_bytes,
              "block_size": args.block_size}
    kv_capacity = str(args.capacity_bytes)
    stock_capacity = str(8 * args.kv_cache_bytes)
    plan: dict[str, tuple[tuple[str, str | None], str, str, bool, dict[str, Any], str]] = {}
    if {"ipc", "nixl"} & set(args.routes):
        plan["decode-kvconnect"] = (KVCONNECT, "kv_consumer", "seed0", True, {}, kv_capacity)
        plan["prefill-ipc"] = (KVCONNECT, "kv_producer", "seed0", True, {}, kv_capacity)
        plan["prefill-control"] = (KVCONNECT, "kv_producer", "seed1", True, {}, kv_capacity)
    if "nixl" in args.routes:
        plan["prefill-nixl"] = (KVCONNECT, "kv_producer", "seed0", True,
                                {"kvconnect_ipc": False}, kv_capacity)
    for route, plugin, cap in (("stock-plugin", True, stock_capacity),
                               ("stock-plain", False, "")):
        if route in args.routes:
            plan[f"decode-{route}"] = (STOCK, "kv_consumer", "seed0", plugin, {}, cap)
            plan[f"prefill-{route}"] = (STOCK, "kv_producer", "seed0", plugin, {}, cap)
    started = {}
    for name, (conn, role, model, plugin, extra, cap) in plan.items():
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KVCONNECT_KV_", "VLLM_NIXL_", "KVCONNECT_EXTENSIBLE"))}
        env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                    "VLLM_TARGET_DEVICE": args.device.split(":")[0],
                    "KVCONNECT_EXTENSIBLE_KV": "1" if plugin else "0",
                    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_tcp_port(exclude=ports)),
                    "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "INFO",
                    "VLLM_CPU_KVCACHE_SPACE": str(max(1, args.kv_cache_bytes >> 30))})
        if plugin and cap:
            env["KVCONNECT_KV_CAPACITY_BYTES"] = cap
        gpus = _visible_devices(args, role)
        if gpus:  # its own GPU first (vLLM's cuda:0), the other one visible too (peer access)
            env["CUDA_VISIBLE_DEVICES"] = gpus
        spec = {"model": models[model], "device": args.device, "connector": conn[0],
                "connector_module": conn[1], "role": role, "engine": engine,
                "extra_config": {"enforce_handshake_compat": False, **extra}}
        started[name] = Engine(name, spec, env, work)
    return started


def _visible_devices(args: argparse.Namespace, role: str) -> str:
    """``CUDA_VISIBLE_DEVICES`` of an engine when prefills and decodes sit on different GPUs
    (``--prefill-gpu`` / ``--decode-gpu``), else empty (the machine's default)."""
    if args.prefill_gpu == args.decode_gpu:
        return "" if args.prefill_gpu == 0 else str(args.prefill_gpu)
    own, other = ((args.prefill_gpu, args.decode_gpu) if role == "kv_producer"
                  else (args.decode_gpu, args.prefill_gpu))
    return f"{own},{other}"


def _route_engines(route: str) -> tuple[str, str]:
    if route in ("ipc", "nixl"):
        return f"prefill-{route}", "decode-kvconnect"
    return f"prefill-{route}", f"decode-{route}"


def _request(engines: dict[str, Engine], prefill: str, decode: str, prompt: list[int],
             max_tokens: int, deadline: float) -> dict[str, Any]:
    p = engines[prefill].call({"op": "prefill", "prompt": prompt, "max_tokens": 1}, deadline)
    if "error" in p:
        return {"error": f"prefill: {p['error']}"}
    d = engines[decode].call({"op": "decode", "prompt": prompt, "max_tokens": max_tokens,
                              "params": p["kv_transfer_params"]}, deadline)
    if "error" not in d:
        d["prefill_wall_s"] = p["wall_s"]
    return d


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvconnect.vllm.tiny_model import write_tiny_llama

    deadline = time.monotonic() + args.timeout
    out: dict[str, Any] = {"routes": list(args.routes), "prompt_tokens": list(args.prompt_tokens),
                           "prefill_gpu": args.prefill_gpu, "decode_gpu": args.decode_gpu,
                           "repeats": args.repeats, "max_tokens": args.max_tokens,
                           "geometry": GEOMETRY, "device": args.device, "sizes": {},
                           "engines": {}, "failures": []}
    with tempfile.TemporaryDirectory(prefix="kvc-pd-") as tmp:
        work = Path(tmp)
        max_pos = max(args.prompt_tokens) + args.max_tokens + 128
        geometry = {**GEOMETRY, "num_hidden_layers": args.layers}
        out["geometry"] = geometry
        models = {s: str(write_tiny_llama(work / s, seed=int(s[-1]), **geometry,
                                          max_position_embeddings=max_pos))
                  for s in ("seed0", "seed1")}
        engines = _engines(args, models, work)
        try:
            for name, e in engines.items():
                r = e.wait_ready(deadline)
                out["engines"][name] = {k: r.get(k) for k in ("ok", "startup_s", "error")}
                if r.get("facts"):
                    (f,) = r["facts"]
                    out["engines"][name].update(bytes_per_block=f["bytes_per_block"],
                                                handles_per_segment=f["handles_per_segment"],
                                                kv_connector=f["kv_connector"])
                print(f"engine {name}: {out['engines'][name]}", flush=True)
            dead: dict[str, str] = {}
            for n in args.prompt_tokens:
                out["sizes"][str(n)] = _one_size(args, engines, n, deadline, out["failures"],
                                                 dead)
                if args.json:  # what is done so far survives a later stop
                    _write(Path(args.json), out)
        finally:
            for e in engines.values():
                e.stop()
            if args.logs:
                _keep_logs(engines, Path(args.logs))
    return out


def _keep_logs(engines: dict[str, Engine], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name, e in engines.items():
        try:
            (dest / f"{name}.log").write_text(e.log.read_text(errors="replace"))
        except OSError:
            pass


def _one_size(args: argparse.Namespace, engines: dict[str, Engine], n: int, deadline: float,
              failures: list[str], dead: dict[str, str]) -> dict[str, Any]:
    """Every route at one prompt length. A route whose request failed (an engine died, or
    did not answer within ``--request-timeout``) is not asked again (``dead``: route ->
    why), so one broken route cannot use up the others' time."""
    prompt = random.Random(n).choices(range(3, 1000), k=n)
    size: dict[str, Any] = {"routes": {}}
    refs: dict[str, list[int]] = {}

    def until() -> float:
        return min(deadline, time.monotonic() + args.request_timeout)

    for route in args.routes:
        prefill, decode = _route_engines(route)
        if route in dead:
            size["routes"][route] = {"error": f"not run: {dead[route]}"}
            continue
        if not (engines[prefill].ready or {}).get("ok") or not (
                engines[decode].ready or {}).get("ok"):
            size["routes"][route] = {"error": "an engine did not start: " + str(
                (engines[prefill].ready or {}).get("error") or
                (engines[decode].ready or {}).get("error"))}
            continue
        runs = []
        for _ in range(args.repeats):
            runs.append(_request(engines, prefill, decode, prompt, args.max_tokens, until()))
            if "error" in runs[-1]:
                dead[route] = f"an earlier request failed ({runs[-1]['error'][:160]})"
                break
        if decode not in refs and route not in dead:
            local = engines[decode].call({"op": "decode", "prompt": prompt,
                                          "max_tokens": args.max_tokens}, until())
            refs[decode] = local.get("tokens", [])
            size.setdefault("local", {})[decode] = local
        equal = [r.get("tokens") == refs.get(decode) and r.get("finish_reason") == "length"
                 for r in runs]
        size["routes"][route] = {"runs": runs, "tokens_equal_local": equal}
        print(f"{n} tokens, {route}: equal {equal}, " + ", ".join(
            f"ttft {r['ttft']['sum']:.4f} s xfer {r['xfer']['sum']:.5f} s "
            f"({r['xfer']['count']:.0f}) wall {r['wall_s']:.3f} s" if "ttft" in r
            else f"error {r.get('error')}" for r in runs), flush=True)
        if not all(equal) and route in ("ipc", "nixl"):
            failures.append(f"{n} tokens, {route}: decode tokens differ from the local answer")
    if "ipc" in args.routes and (engines["prefill-control"].ready or {}).get("ok"):
        ctl = _request(engines, "prefill-control", "decode-kvconnect", prompt, args.max_tokens,
                       until())
        differs = ctl.get("tokens") != refs.get("decode-kvconnect")
        size["control"] = {"run": ctl, "differs": differs}
        if not differs:
            failures.append(f"{n} tokens: the control (other prefill weights) gave the same "
                            "tokens: the comparison proves nothing")
    nbytes = _kv_bytes(size)
    if nbytes and "decode-kvconnect" in engines and args.device.startswith("cuda"):
        cross = args.prefill_gpu != args.decode_gpu  # the prefill's GPU is cuda:1 there
        size["copy_reference"] = engines["decode-kvconnect"].call(
            {"op": "copy_reference", "bytes": nbytes,
             "src_device": "cuda:1" if cross else "cuda:0"}, until())
        size["copy_reference"]["kind"] = "peer" if cross else "d2d"
        ipc_runs = size["routes"].get("ipc", {}).get("runs", [])
        per_block = _bytes_per_block(ipc_runs)
        if args.fetch_probe and per_block:
            size["fetch_probe"] = engines["decode-kvconnect"].call(
                {"op": "fetch_probe", "blocks": nbytes // per_block, "peer": "prefill-ipc"},
                until())
            print(f"{n} tokens, fetch probe: {json.dumps(size['fetch_probe'])[:600]}",
                  flush=True)
    return size


def _bytes_per_block(runs: list[dict[str, Any]]) -> int:
    """Bytes per block of the ipc route's plan (from the decode's fast-path facts)."""
    for r in runs:
        for p in (r.get("fast_path") or {}).get("peers", []):
            if p.get("engine_id") == "prefill-ipc" and p.get("plan"):
                return int(p["plan"]["bytes_per_block"])
    return 0


def _kv_bytes(size: dict[str, Any]) -> int:
    """Bytes one request's KV read moved (from the ipc route's stats, else NIXL's)."""
    for route in ("ipc", "nixl", "stock-plain", "stock-plugin"):
        for r in size["routes"].get(route, {}).get("runs", []):
            b = r.get("xfer_bytes", {}).get("sum", 0)
            if b:
                return int(b)
    return 0


def markdown(out: dict[str, Any]) -> str:
    lines = [f"P/D on {out['device']}: {len(out['routes'])} routes, Llama-3-8B KV geometry, "
             f"{out['max_tokens']} generated tokens, {out['repeats']} requests each", "",
             "| prompt | route | tokens = single engine | TTFT s | KV transfer s | MiB | "
             "vs plain copy | wall s |", "| ---: | --- | --- | --- | --- | ---: | --- | --- |"]
    for n, size in out["sizes"].items():
        copy = size.get("copy_reference", {}).get("seconds")
        for route, r in size["routes"].items():
            if "error" in r:
                lines.append(f"| {n} | {route} | error: {r['error'][:120]} | | | | | |")
                continue
            runs = [x for x in r["runs"] if "ttft" in x]
            ttft = ", ".join(f"{x['ttft']['sum']:.4f}" for x in runs)
            xfer = ", ".join(f"{x['xfer']['sum']:.5f}" for x in runs)
            mib = max((x["xfer_bytes"]["sum"] for x in runs), default=0) / 2**20
            ratio = ", ".join(f"{x['xfer']['sum'] / copy:.2f}x" for x in runs
                              if copy and x["xfer"]["sum"]) or "n/a"
            wall = ", ".join(f"{x['wall_s']:.3f}" for x in runs)
            errors = [x.get("error") for x in r["runs"] if "error" in x]
            eq = str(r["tokens_equal_local"]) + (f" ({errors[0][:80]})" if errors else "")
            lines.append(f"| {n} | {route} | {eq} | {ttft} | {xfer} | {mib:.0f} | {ratio} | "
                         f"{wall} |")
        if copy:
            lines.append(f"| {n} | plain d2d copy | | | {copy:.5f} | "
                         f"{size['copy_reference']['bytes'] / 2**20:.0f} | 1.00x | |")
        if "control" in size:
            lines.append(f"| {n} | control (other weights, ipc) | differs: "
                         f"{size['control']['differs']} | | | | | |")
    if out["failures"]:
        lines += ["", "FAILURES: " + "; ".join(out["failures"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the engine process's spec file
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=GEOMETRY["num_hidden_layers"],
                    help="model layers (Llama-3-8B: 32; fewer for a dry run on CPU)")
    ap.add_argument("--prefill-gpu", type=int, default=0,
                    help="the prefill engines' GPU (with --decode-gpu: across GPUs)")
    ap.add_argument("--decode-gpu", type=int, default=0, help="the decode engines' GPU")
    ap.add_argument("--kv-cache-bytes", type=int, default=6 << 30,
                    help="each engine's KV cache (bytes; a 32k prompt needs 4 GiB here)")
    ap.add_argument("--capacity-bytes", type=int, default=64 << 30,
                    help="KVCONNECT_KV_CAPACITY_BYTES of the kvconnect engines")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds for everything")
    ap.add_argument("--request-timeout", type=float, default=90.0,
                    help="seconds one engine call may take (a route that fails is not asked "
                         "again)")
    ap.add_argument("--fetch-probe", action="store_true",
                    help="after each length, time the fast path's fetch inside the idle decode "
                         "engine (open, behind a device sleep, kernel alone)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--logs", help="copy every engine's log into this folder")
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args.engine)
    if args.repeats < 1 or min(args.prompt_tokens) < 1:
        ap.error("--repeats and --prompt-tokens must be positive")
    out = run(args)
    text = markdown(out)
    print(text)
    if args.json:
        _write(Path(args.json), out)
    if args.markdown:
        Path(args.markdown).write_text(text)
    bad = out["failures"] or any("error" in r for s in out["sizes"].values()
                                 for route, r in s["routes"].items() if route in ("ipc", "nixl"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
