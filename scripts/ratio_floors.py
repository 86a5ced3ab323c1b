#!/usr/bin/env python3
"""Ratio floors for the nightly GPU run: every floor is a ratio to a same-run reference.

Reads ``kvconnect-validate`` JSON reports (each transfer carries ``reference_gbps``: a plain
torch copy of the same bytes between the same devices, same run), ``bench_transfer`` /
``bench_offload`` JSON and ``bench_vllm_pd`` JSON (real engines: NIXL's time-to-first-token
over the ipc fast path's, and a plain copy's time over the fast path's KV transfer time),
applies the floors and writes one JUnit XML and one JSON summary.
Exit 0 when every floor holds and nothing moved wrong bytes, 1 otherwise, 2 on bad input.
Never compares absolute GB/s.

    python scripts/ratio_floors.py --junit floors.xml --json floors.json \\
        --validate out/validate-*.json --transfer out/bench_transfer.json \\
        --offload out/bench_offload.json --floor validate:ipc=0.5 --floor transfer:ipc/kernel=0.7
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from typing import Any

MIB = 1024 * 1024
#: default floors: (source, name) -> lowest ratio to the same-run reference. Regression
#: floors below what a healthy 1 x H200 run measured, not the goals (0.85 / 0.9), which the
#: summary reports separately. transfer / offload: benchmarks/results/transfer-h200-graphs.md
#: (ipc/kernel 0.79-0.88 from 512 MiB; offload 0.86-0.96 from 128 MiB); validate stays low
#: for 2P2D, where pairs share the GPU (nightly-h200.md: 0.25..1.10); push: not yet measured.
DEFAULT_FLOORS = {
    ("validate", "ipc"): 0.15,
    ("transfer", "ipc/kernel"): 0.6,
    ("transfer", "ipc/kernel/push"): 0.35,
    ("offload", "save"): 0.75,
    ("offload", "load"): 0.75,
    # real engines, 1P1D on one H200: NIXL's TTFT / the fast path's (same run, same prompt);
    # measured 4.7x at 8k tokens (gpu-facts.md, 2026-12-02, decode wall times)
    ("pd", "ttft-nixl/ipc"): 1.5,
}
#: per source, transfers smaller than this (MiB) are reported but not held to a floor: launch
#: and synchronization latency dominate them, and one-shot harness transfers are noisy
DEFAULT_MIN_MIB = {"validate": 256, "transfer": 512, "offload": 128, "pd": 128}
#: the issue's goals, reported (never failing): ratio at or above which a row meets its goal,
#: per source (rows with a floor) or per (source, name)
GOALS: dict[Any, float] = {"validate": 0.85, "transfer": 0.85, "offload": 0.85,
                           # the fast path's KV transfer within 1.3x a plain copy's time
                           ("pd", "xfer-copy/ipc"): round(1 / 1.3, 3)}


def _floor_arg(text: str) -> tuple[tuple[str, str], float]:
    try:
        key, value = text.split("=", 1)
        source, name = key.split(":", 1)
        return (source, name), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--floor wants SOURCE:NAME=RATIO (e.g. validate:ipc=0.5), got {text!r}") from None


def check(args: argparse.Namespace) -> list[dict[str, Any]]:
    floors = dict(DEFAULT_FLOORS)
    floors.update(dict(args.floor or []))
    min_mib = dict(DEFAULT_MIN_MIB)
    if args.min_mib is not None:
        min_mib = dict.fromkeys(min_mib, args.min_mib)
    cases: list[dict[str, Any]] = []

    def case(source: str, name: str, ratio: float | None, nbytes: int, ok_bytes: bool,
             detail: str) -> None:
        floor = floors.get((source, name.split(" ", 1)[0]))
        min_bytes = min_mib.get(source, 0) * MIB
        status = "pass"
        why = ""
        if not ok_bytes:
            status, why = "fail", "moved wrong bytes"
        elif floor is not None and ratio is not None and nbytes >= min_bytes and ratio < floor:
            status, why = "fail", f"ratio {ratio:.3f} < floor {floor}"
        elif floor is None or nbytes < min_bytes:
            status = "info"
        goal = GOALS.get((source, name.split(" ", 1)[0]),
                         GOALS.get(source) if floor is not None else None)
        cases.append({"source": source, "name": name, "ratio": ratio, "floor": floor,
                      "bytes": nbytes, "status": status, "why": why, "detail": detail,
                      "goal_met": None if ratio is None or goal is None else ratio >= goal})

    for path in args.validate or []:
        with open(path) as f:
            report = json.load(f)
        for t in report.get("transfers", []):
            ref = t.get("reference_gbps")
            ratio = t["gbps"] / ref if ref else None
            case("validate", f"{t['transport']} {path} {t['pair']} round{t.get('round', 1)}",
                 ratio, int(t["bytes"]), bool(t.get("verified")),
                 f"{t['gbps']:.1f} GB/s vs reference {ref} GB/s via {t.get('backend', '')}")
    for path in args.transfer or []:
        with open(path) as f:
            report = json.load(f)
        for r in report.get("results", []):
            ref = r["references_gbps"][r["reference"]]
            case("transfer", f"{r['transport']} {r['pair']} {r['block_bytes'] // 1024}KiB "
                             f"{r['request_bytes'] // MIB}MiB", r["ratio"], int(r["request_bytes"]),
                 r.get("verified") is not False,
                 f"{r['gbps']:.1f} GB/s vs {r['reference']} {ref:.1f} GB/s")
    for path in args.offload or []:
        with open(path) as f:
            report = json.load(f)
        for r in report.get("results", []):
            for op, ref in (("save", "reference_to_cpu"), ("load", "reference_from_cpu")):
                case("offload", f"{op} {r['path']} {r['slots']} {r['batch_blocks']}blocks",
                     r[f"{op}_vs_reference"], int(r["payload_bytes"]), bool(r["correct"]),
                     f"{r[op]['median_gbps']:.1f} GB/s vs {r[ref]['median_gbps']:.1f} GB/s")
    for path in args.pd or []:
        with open(path) as f:
            _pd_cases(json.load(f), path, case)
    return cases


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def _steady(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A route's requests after its first, where there are several: the first pays one-time
    set-up (the fast path maps the prefill's cache: a 1k prompt's TTFT 1.37 s, then 0.13 s on
    the H200; NIXL handshakes)."""
    done = [x for x in runs if "ttft" in x]
    return done[1:] if len(done) > 1 else done


def _pd_cases(report: dict[str, Any], path: str, case: Any) -> None:
    """bench_vllm_pd: per prompt length, NIXL's TTFT over ipc's (floor) and a plain copy's
    time over ipc's KV transfer time (the goal), each over the steady requests; wrong tokens
    fail either."""
    for n, size in report.get("sizes", {}).items():
        routes = size.get("routes", {})
        ipc, nixl = routes.get("ipc", {}), routes.get("nixl", {})
        runs = {r: _steady(routes.get(r, {}).get("runs", [])) for r in ("ipc", "nixl")}
        ok = all(ipc.get("tokens_equal_local") or [False]) and all(
            nixl.get("tokens_equal_local") or [True])
        nbytes = int(max((x["xfer_bytes"]["sum"] for x in runs["ipc"]), default=0))
        t_ipc = _median([x["ttft"]["sum"] for x in runs["ipc"]])
        t_nixl = _median([x["ttft"]["sum"] for x in runs["nixl"]])
        if t_ipc and t_nixl:
            case("pd", f"ttft-nixl/ipc {n}tok {path}", t_nixl / t_ipc, nbytes, ok,
                 f"TTFT ipc {t_ipc:.4f} s, NIXL {t_nixl:.4f} s")
        copy = size.get("copy_reference", {}).get("seconds")
        x_ipc = _median([x["xfer"]["sum"] for x in runs["ipc"] if x["xfer"]["count"]])
        if copy and x_ipc:
            case("pd", f"xfer-copy/ipc {n}tok {path}", copy / x_ipc, nbytes, ok,
                 f"KV transfer ipc {x_ipc:.5f} s, plain copy {copy:.5f} s")


def write_junit(cases: list[dict[str, Any]], path: str) -> None:
    suite = ET.Element("testsuite", name="ratio-floors", tests=str(len(cases)),
                       failures=str(sum(c["status"] == "fail" for c in cases)))
    for c in cases:
        tc = ET.SubElement(suite, "testcase", classname=f"floors.{c['source']}", name=c["name"])
        if c["status"] == "fail":
            ET.SubElement(tc, "failure", message=c["why"]).text = c["detail"]
        else:
            ET.SubElement(tc, "system-out").text = (
                f"ratio {c['ratio']} (floor {c['floor']}): {c['detail']}")
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--validate", nargs="*", help="kvconnect-validate JSON reports")
    ap.add_argument("--transfer", nargs="*", help="bench_transfer JSON")
    ap.add_argument("--offload", nargs="*", help="bench_offload JSON")
    ap.add_argument("--pd", nargs="*", help="bench_vllm_pd JSON")
    ap.add_argument("--floor", type=_floor_arg, action="append",
                    help="SOURCE:NAME=RATIO, overriding the defaults")
    ap.add_argument("--min-mib", type=int, default=None,
                    help=f"one size floor for every source (default {DEFAULT_MIN_MIB})")
    ap.add_argument("--junit", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    try:
        cases = check(args)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        print(f"ratio_floors: cannot read the reports: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    if args.junit:
        write_junit(cases, args.junit)
    failed = [c for c in cases if c["status"] == "fail"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"floors": {f"{k[0]}:{k[1]}": v for k, v in DEFAULT_FLOORS.items()},
                       "min_mib": DEFAULT_MIN_MIB if args.min_mib is None else args.min_mib,
                       "goals": {":".join(k) if isinstance(k, tuple) else k: v
                                 for k, v in GOALS.items()}, "cases": cases,
                       "failed": len(failed)}, f, indent=1)
    held = sum(c["status"] == "pass" for c in cases)
    print(f"ratio floors: {held} held, {len(failed)} failed, "
          f"{sum(c['status'] == 'info' for c in cases)} reported without a floor")
    for c in failed:
        print(f"  FAIL {c['source']} {c['name']}: {c['why']} ({c['detail']})")
    for key, goal in GOALS.items():
        source, name = key if isinstance(key, tuple) else (key, None)
        rows = [c for c in cases if c["source"] == source and c["goal_met"] is not None
                and (name is None or c["name"].split(" ", 1)[0] == name)]
        if rows:
            met = sum(bool(c["goal_met"]) for c in rows)
            print(f"  goal {':'.join(filter(None, (source, name)))} >= {goal}: met by {met} of "
                  f"{len(rows)} rows "
                  f"(ratios {min(c['ratio'] for c in rows):.2f}..{max(c['ratio'] for c in rows):.2f})")
    if not cases:
        print("ratio_floors: no transfers in the reports", file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
