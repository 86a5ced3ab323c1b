"""``kvconnect-conformance``: run the conformance kit on connectors, print / write results.

    kvconnect-conformance mypkg.connector:MyConnector             # every vLLM layout
    kvconnect-conformance NixlConnector kvconnect.vllm:KvconnectNixlConnector \\
        --layouts LBHNC,BLHNC --json out.json --markdown out.md

A connector is ``module:Class`` (loaded as vLLM loads ``kv_connector_module_path``) or a
name vLLM registers. Exit status 0 when every case passes, 1 when any does not, 2 on bad
usage. Needs vLLM 0.33 (``make test-vllm`` builds a CPU environment).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any

from kvconnect.checks import checked_int
from kvconnect.layout.formats import VLLM_LAYOUTS

from .runner import START_METHODS

__all__ = ["main", "run_metadata"]


def _layouts(text: str) -> list[str]:
    out = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in VLLM_LAYOUTS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown layouts {bad}; choose from {VLLM_LAYOUTS}")
    return out


def _device(text: str) -> str:
    from kvconnect.vllm.runtime import is_cuda_device

    try:
        is_cuda_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _positive(text: str) -> int:
    try:
        return checked_int("the value", int(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
            "vllm": version("vllm"), "nixl": version("nixl-cu13") or version("nixl"),
            "kvconnect": version("kvconnect")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvconnect-conformance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("connectors", nargs="*", metavar="CONNECTOR",
                   help="module:Class or a vLLM connector name")
    p.add_argument("--stock-and-patched", action="store_true",
                   help="add vLLM 0.33's NIXL / SimpleCPUOffload / Offloading connectors and "
                        "kvconnect's patched ones")
    p.add_argument("--layouts", type=_layouts, default=list(VLLM_LAYOUTS),
                   help="comma-separated vLLM layouts (default: all six)")
    p.add_argument("--num-blocks", type=_positive, default=128, help="committed blocks")
    p.add_argument("--capacity-blocks", type=_positive, default=1024,
                   help="reserved blocks (default 1024: 8x committed)")
    p.add_argument("--num-layers", type=_positive, default=2)
    p.add_argument("--device", type=_device, default="cpu",
                   help="cpu (host VMM backend) or cuda:N (CUDA VMM; vLLM's CUDA platform)")
    p.add_argument("--start-method", choices=START_METHODS, default="fork",
                   help="fork the warmed-up parent per case (default) or spawn a fresh "
                        "interpreter per case (slower: vLLM imported each time)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per case")
    p.add_argument("--pd", action="store_true",
                   help="also run a 1P1D transfer through vLLM's connector API (scheduler and "
                        "worker roles, vLLM's handshake) for NIXL-kind connectors")
    p.add_argument("--json", metavar="PATH", help="write {meta, results, pd} as JSON")
    p.add_argument("--jsonl", metavar="PATH",
                   help="append each case's result as one JSON line as soon as it is known "
                        "(kept when the run is cut short)")
    p.add_argument("--markdown", metavar="PATH", help="write the results table as Markdown")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from kvconnect.vllm.runtime import vllm_available

    reason = vllm_available()
    if reason:
        print(f"kvconnect-conformance: {reason}", file=sys.stderr)
        return 2
    from . import STOCK_AND_PATCHED, run_conformance
    from .report import evidence, render_markdown

    connectors = list(args.connectors) + (list(STOCK_AND_PATCHED) if args.stock_and_patched
                                          else [])
    if not connectors:
        print("kvconnect-conformance: name at least one connector (module:Class), or pass "
              "--stock-and-patched", file=sys.stderr)
        return 2
    if args.capacity_blocks < args.num_blocks:
        print("kvconnect-conformance: --capacity-blocks must be >= --num-blocks",
              file=sys.stderr)
        return 2

    def show(r: dict[str, Any]) -> None:
        print(f"{r['connector'].rsplit(':', 1)[-1]:<36} {r['layout']:<6} {r['status']:<8} "
              f"{evidence(r)}", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")

    results = run_conformance(connectors, args.layouts, timeout=args.timeout, on_result=show,
                              num_blocks=args.num_blocks, capacity_blocks=args.capacity_blocks,
                              num_layers=args.num_layers, device=args.device,
                              start_method=args.start_method)
    pd: list[dict[str, Any]] = []
    if args.pd:
        from .pd import run_pd, transfers_over_nixl

        for c in (c for c in connectors if transfers_over_nixl(c)):
            for layout in args.layouts:
                r = run_pd(c, layout, num_blocks=args.num_blocks,
                           capacity_blocks=args.capacity_blocks, num_layers=args.num_layers,
                           timeout=args.timeout)
                print(f"1P1D {c.rsplit(':', 1)[-1]:<31} {layout:<6} {r['status']:<8} "
                      f"{r.get('evidence', '')}", flush=True)
                pd.append(r)
    meta = run_metadata(argv)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "pd": pd}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(results, title="Conformance results",
                                    preamble=f"`{meta['command']}`"))
    return 0 if all(r["status"] == "pass" for r in results + pd) else 1


if __name__ == "__main__":
    sys.exit(main())
