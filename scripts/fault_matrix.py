#!/usr/bin/env python3
"""Run every ``--inject FAULT@PHASE`` of ``kvconnect-validate`` and tabulate time-to-report.

For each registered fault kind x fault phase (``kvconnect.harness.faults``) this runs

    kvconnect-validate --device host --prefill 1 --decode 1 --num-layers 1 --num-blocks 8 \\
        --timeout T --inject FAULT@PHASE --json REPORT

in a fresh, private TMPDIR, and checks from the JSON report and /proc what the issue asks:
the exit code (1, or 0 for a fault the run must recover from), the fault reported naming the
worker's side, rank and phase (``faults[].reported_by``) within the deadline, the run's own
``cleanup`` check passed, and afterwards no process of the run and nothing in its TMPDIR.
A combination that cannot happen is listed as n/a with the registry's reason.

The table goes into ``docs/reliability.md`` between ``<!-- fault-matrix:begin -->`` and
``<!-- fault-matrix:end -->`` (the file is created with just that section when missing), with
the machine, versions and command. Exit 0 when every combination behaved, 1 otherwise.

    python scripts/fault_matrix.py                 # all, --timeout 10, writes the doc
    python scripts/fault_matrix.py --only kill-    # a subset, printed, doc untouched
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- fault-matrix:begin -->"
END = "<!-- fault-matrix:end -->"
#: the small configuration every combination runs with (seconds matter, bytes do not)
RUN_ARGS = ["--device", "host", "--prefill", "1", "--decode", "1", "--num-layers", "1",
            "--num-blocks", "8", "--plain", "-q"]
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                 "SLURM_NTASKS")


def validate_command() -> str:
    """The ``kvconnect-validate`` next to this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).with_name("kvconnect-validate")
    if beside.exists():
        return str(beside)
    found = shutil.which("kvconnect-validate")
    if found is None:
        raise SystemExit("kvconnect-validate not found: run from the project's venv")
    return found


def matrix(only: str = "") -> list[tuple[str, str, str | None]]:
    """``(fault, phase, why_not_applicable)`` for every registered combination."""
    from kvconnect.harness.faults import FAULT_KINDS, PHASES

    out = []
    for name, kind in FAULT_KINDS.items():
        for phase in PHASES:
            spec = f"{name}@{phase}"
            if only and only not in spec:
                continue
            out.append((name, phase, kind.not_applicable.get(phase)))
    return out


def run_case(fault: str, phase: str, timeout: float) -> dict[str, Any]:
    """Run one combination; the row: what happened and whether it is what should."""
    from kvconnect.harness.coordinator.cleanup import processes_mentioning
    from kvconnect.harness.faults import EXPECT_RECOVERY, FAULT_KINDS

    spec = f"{fault}@{phase}"
    expect_code = 0 if FAULT_KINDS[fault].expect == EXPECT_RECOVERY else 1
    tmp = Path(tempfile.mkdtemp(prefix="kvfm-", dir="/tmp"))  # short: socket paths
    runtmp = tmp / "t"
    runtmp.mkdir()
    report_path = tmp / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["TMPDIR"] = str(runtmp)
    cmd = [validate_command(), *RUN_ARGS, "--timeout", f"{timeout:g}", "--inject", spec,
           "--json", str(report_path)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout * 8 + 120)
        code: int | None = proc.returncode
        tail = (proc.stdout + proc.stderr)[-2000:]
    except subprocess.TimeoutExpired as exc:
        code, tail = None, f"did not exit within {exc.timeout:g} s"
    wall = time.monotonic() - t0
    problems: list[str] = []
    row: dict[str, Any] = {"fault": fault, "phase": phase, "spec": spec, "exit_code": code,
                           "expected_exit_code": expect_code, "wall_seconds": round(wall, 2)}
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError):
        report = None
        problems.append("no JSON report")
    if code != expect_code:
        problems.append(f"exit {code}, expected {expect_code}")
    if report is not None:
        [record] = report.get("faults") or [{}]
        row["outcome"] = record.get("outcome")
        row["fired_in_phase"] = record.get("fired_in_phase")
        row["reported_by"] = record.get("reported_by")
        row["time_to_report_seconds"] = record.get("time_to_report_seconds")
        row["restart"] = record.get("restart")
        row["recovery"] = [c["data"] for c in report["checks"]
                           if c["name"].startswith("recovery/")]
        if record.get("outcome") not in ("reported", "recovered"):
            problems.append(f"fault outcome {record.get('outcome')}")
        cleanup = [c for c in report["checks"] if c["name"] == "cleanup"]
        row["cleanup"] = cleanup[0]["status"] if cleanup else None
        if row["cleanup"] != "pass":
            problems.append(f"cleanup check: {cleanup[0]['detail'] if cleanup else 'missing'}")
        pids = [w["pid"] for w in report.get("workers", [])]
        alive = [p for p in pids if p in processes_mentioning(str(report_path))]
        if alive:
            problems.append(f"processes left: {alive}")
    left = sorted(p.name for p in runtmp.iterdir())
    if left:
        problems.append(f"left in TMPDIR: {left}")
    row["problems"] = problems
    row["ok"] = not problems
    if problems:
        row["output_tail"] = tail
    shutil.rmtree(tmp, ignore_errors=True)
    return row


def _cell_reported(row: dict[str, Any]) -> str:
    if row.get("restart"):
        r = row["restart"]
        rec = row.get("recovery") or []
        how = (f"; decode recovered after {rec[0]['waited_seconds']:.2f} s"
               if rec and rec[0].get("failed") else
               "; decode re-handshook next round" if rec else "")
        return f"restarted (incarnation {r.get('incarnation')}) in `{r.get('phase')}`{how}"
    got = row.get("reported_by")
    if not got:
        return "—"
    return f"{got['role']} {got['rank']} in `{got['phase']}` ({got.get('cause') or got['check']})"


def _per_fault(rows: list[dict[str, Any]]) -> list[str]:
    """One summary line per fault kind: time to report over its phases."""
    out = []
    for fault in dict.fromkeys(r["fault"] for r in rows):
        ran = [r for r in rows if r["fault"] == fault and not r.get("na")]
        times = [r["time_to_report_seconds"] for r in ran
                 if r.get("time_to_report_seconds") is not None]
        span = f"{min(times):.2f}-{max(times):.2f} s" if times else "-"
        out.append(f"| {fault} | {span} | {sum(1 for r in ran if r.get('ok'))} of {len(ran)} |")
    return out


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown section (without the markers)."""
    ok = sum(1 for r in rows if r.get("ok"))
    na = sum(1 for r in rows if r.get("na"))
    ran = len(rows) - na
    times = [r["time_to_report_seconds"] for r in rows
             if r.get("time_to_report_seconds") is not None]
    lines = [
        "## Fault matrix (generated)",
        "",
        f"Generated by `scripts/fault_matrix.py` on {meta['date']}: {meta['machine']}; "
        f"{meta['versions']}. Each combination is one run of",
        "",
        f"    {meta['command']}",
        "",
        f"**{ok} of {ran} combinations behaved** (exit code, fault reported naming side, rank "
        f"and phase within --timeout + 2 s or recovered, `cleanup` check passed, no process "
        f"or temp entry left); {na} do not apply."
        + (f" Time to report: {min(times):.2f}-{max(times):.2f} s." if times else ""),
        "",
        "| fault | time to report (min-max over phases) | runs that behaved |",
        "| --- | --- | --- |",
        *_per_fault(rows),
        "",
        "Time to report: from the moment the fault fired in the worker to the failing check "
        "that names it reaching the coordinator (same host, one monotonic clock); for "
        "`restart-prefill`, to the standby taking over. Wall: the whole command, including "
        "start-up (~2 s here).",
        "",
        "| fault | phase | exit | reported as (side rank phase, cause) | time to report | wall "
        "| result |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.get("na"):
            lines.append(f"| {r['fault']} | {r['phase']} | n/a | {r['why']} | | | n/a |")
            continue
        ttr = r.get("time_to_report_seconds")
        verdict = "ok" if r.get("ok") else "**FAIL**: " + "; ".join(r["problems"])
        lines.append(f"| {r['fault']} | {r['phase']} | {r['exit_code']} | {_cell_reported(r)} "
                     f"| {'' if ttr is None else f'{ttr:.2f} s'} | {r['wall_seconds']:.1f} s "
                     f"| {verdict} |")
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str) -> str:
    """``text`` with what lies between the markers replaced by ``section`` (markers kept);
    the markers and section are appended when ``text`` has none."""
    block = f"{BEGIN}\n{section}{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        return text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    return text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"


def write_doc(section: str, path: Path = DOC) -> None:
    text = path.read_text() if path.exists() else "# Reliability\n"
    path.write_text(replace_section(text, section))


def _meta(timeout: float) -> dict[str, Any]:
    import kvconnect

    try:
        import torch

        torch_v = torch.__version__
    except ImportError:  # pragma: no cover
        torch_v = "none"
    try:
        from importlib.metadata import version

        nixl_v = version("nixl-cu13")
    except Exception:  # noqa: BLE001 - not installed
        nixl_v = "not installed"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.machine()}, "
                   f"Linux {platform.release()}, load {load:.1f} at start",
        "versions": f"kvconnect {getattr(kvconnect, '__version__', '?')}, torch {torch_v}, "
                    f"nixl-cu13 {nixl_v}, Python {platform.python_version()}",
        "command": "kvconnect-validate " + " ".join(RUN_ARGS) + f" --timeout {timeout:g} "
                   "--inject FAULT@PHASE --json report.json",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="--timeout of each run (default 10, as the issue's bar)")
    ap.add_argument("--only", default="", help="run only combinations containing this text "
                                               "(the doc is then left alone)")
    ap.add_argument("--doc", type=Path, default=DOC, help="where the table goes")
    ap.add_argument("--json", type=Path, help="also write every row as JSON")
    ap.add_argument("--no-write", action="store_true", help="print the table only")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="do not run: write the table of a run saved with --json")
    args = ap.parse_args(argv)
    if args.render is not None:
        saved = json.loads(args.render.read_text())
        write_doc(render(saved["rows"], saved["meta"]), args.doc)
        print(f"wrote the table of {args.render} into {args.doc}")
        return 0 if all(r.get("ok") or r.get("na") for r in saved["rows"]) else 1
    meta = _meta(args.timeout)
    rows: list[dict[str, Any]] = []
    for fault, phase, why in matrix(args.only):
        if why:
            rows.append({"fault": fault, "phase": phase, "na": True, "why": why})
            print(f"{fault}@{phase}: n/a ({why})", flush=True)
            continue
        row = run_case(fault, phase, args.timeout)
        rows.append(row)
        ttr = row.get("time_to_report_seconds")
        print(f"{row['spec']}: exit {row['exit_code']}, {row.get('outcome')}, "
              f"{_cell_reported(row)}, report {ttr} s, wall {row['wall_seconds']} s: "
              f"{'ok' if row['ok'] else 'FAIL ' + '; '.join(row['problems'])}", flush=True)
    section = render(rows, meta)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.only or args.no_write:
        print(section)
    else:
        write_doc(section, args.doc)
        print(f"wrote the table into {args.doc}")
    return 0 if all(r.get("ok") or r.get("na") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
