"""Run the reliability tests and write their measured tables into docs/reliability.md.

    .venv/bin/python scripts/reliability_tables.py           # run serially, write JSON + doc
    .venv/bin/python scripts/reliability_tables.py --render  # re-render the doc from the JSON
    KVC_FUZZ_SCALE=20 .venv/bin/python scripts/reliability_tables.py \\
        --json /tmp/deep.json --no-doc                       # a deeper fuzz run, kept aside

The tests append what they measured (fuzz inputs tried by outcome, soak start/end figures,
recovery sweep outcomes) to ``$KVC_RELIABILITY_RECORD`` (tests/_reliability.py); pytest's
JUnit XML gives each test's outcome and time; each test's docstring says what it shows.
All of it goes to one JSON file (default benchmarks/results/reliability-host.json, with the
machine, versions, command and date), from which the sections of docs/reliability.md between
``<!-- BEGIN generated:NAME -->`` and ``<!-- END generated:NAME -->`` are rewritten. Nothing
in those sections is written by hand. The fault x phase matrix is not produced here.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "reliability-host.json"
TEST_FILES = {
    "trust": ["tests/test_trust_boundaries.py"],
    "fuzz": ["tests/test_fuzz_frames.py", "tests/test_fuzz_peer_input.py",
             "tests/test_fuzz_config_cli.py", "tests/test_peer_layout.py",
             "tests/test_bounded_json_hostile.py"],
    "soak": ["tests/test_soak.py"],
    "recovery": ["tests/test_nixl_recovery.py"],
    "hostile": ["tests/test_ipc_hostile.py", "tests/test_harness_output.py",
                "tests/test_nixl_fast_path_hostile.py"],
}
RUN_TIMEOUT_S = 1200
#: corrupted NIXL agent-metadata blobs tried by scripts/nixl_metadata_probe.py
NIXL_PROBE_INPUTS = 3000


# -- collecting -------------------------------------------------------------------------------

def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("torch", "numpy", "hypothesis", "pytest", "nixl-cu13", "kvconnect"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def _machine() -> dict[str, Any]:
    return {"node": platform.node(), "kernel": platform.release(),
            "cpus": os.cpu_count(), "uid": os.getuid()}


def _docstrings() -> dict[str, str]:
    """``file::test_name`` -> the first paragraph of the test's docstring, on one line."""
    out = {}
    for files in TEST_FILES.values():
        for rel in files:
            tree = ast.parse((ROOT / rel).read_text())
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                    doc = ast.get_docstring(node) or ""
                    out[f"{rel}::{node.name}"] = " ".join(doc.split("\n\n")[0].split())
    return out


def _junit(path: Path) -> list[dict[str, Any]]:
    """Each testcase of a JUnit XML file pytest wrote: file, name, outcome, seconds."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        module = case.get("classname", "")
        cases.append({"file": module.replace(".", "/") + ".py", "name": case.get("name", ""),
                      "outcome": outcome, "seconds": float(case.get("time", 0.0))})
    return cases


def run_tests() -> dict[str, Any]:
    """Run every reliability test file serially; returns the collected results."""
    files = [f for group in TEST_FILES.values() for f in group]
    with tempfile.TemporaryDirectory(prefix="kvc-reliability-") as tmp:
        record, junit = Path(tmp) / "record.jsonl", Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
               "-q", f"--junitxml={junit}", *files]
        env = dict(os.environ, KVC_RELIABILITY_RECORD=str(record))
        t0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=RUN_TIMEOUT_S,
                              capture_output=True, text=True)
        wall = time.monotonic() - t0
        tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
        if not junit.exists():
            raise SystemExit(f"pytest wrote no report (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in record.read_text().splitlines()] \
            if record.exists() else []
        return {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["KVC_RELIABILITY_RECORD=...", *cmd[1:]]).replace(str(junit),
                                                                                 "..."),
            "fuzz_scale": os.environ.get("KVC_FUZZ_SCALE", "1"),
            "machine": _machine(), "versions": _versions(),
            "pytest_exit": proc.returncode, "pytest_summary": tail[0] if tail else "",
            "wall_seconds": round(wall, 1),
            "tests": _junit(junit), "records": records, "docstrings": _docstrings(),
        }


def _probe_module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "nixl_metadata_probe", Path(__file__).with_name("nixl_metadata_probe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- rendering --------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _base_name(name: str) -> str:
    return name.split("[", 1)[0]


def _test_rows(data: dict[str, Any], group: str) -> list[list[Any]]:
    rows = []
    for case in data["tests"]:
        if case["file"] not in TEST_FILES[group]:
            continue
        doc = data["docstrings"].get(f"{case['file']}::{_base_name(case['name'])}", "")
        rows.append([f"`{case['name']}`", doc or "-", case["outcome"], f"{case['seconds']:.2f}"])
    return rows


def _arrow(start: Any, end: Any) -> str:
    return f"{start} → {end}"


def render_sections(data: dict[str, Any]) -> dict[str, str]:
    records = data["records"]
    ran = (f"Measured {data['date']} on {data['machine']['node']} "
           f"({data['machine']['cpus']} CPUs, Linux {data['machine']['kernel']}, uid "
           f"{data['machine']['uid']}); Python {data['versions']['python']}, torch "
           f"{data['versions']['torch']}, nixl-cu13 {data['versions']['nixl-cu13']}, "
           f"hypothesis {data['versions']['hypothesis']}. Command: `{data['command']}` "
           f"({data['pytest_summary']}, {data['wall_seconds']} s wall, serial).")
    out = {"run": ran}

    out["trust"] = _table(["Test", "What it shows", "Result", "s"], _test_rows(data, "trust"))

    fuzz = [r for r in records if r["kind"] == "fuzz"]
    fuzz_rows = []
    for r in fuzz:
        refused = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items() if k != "accepted")
        fuzz_rows.append([r["target"], r["module_error"], r["tried"],
                          r["outcomes"].get("accepted", 0), refused or "-",
                          r["distinct_reasons"]])
    scale = data["fuzz_scale"]
    out["fuzz"] = (
        f"Inputs per target: hypothesis `max_examples` x `KVC_FUZZ_SCALE` = {scale} "
        f"({'derandomized: the same inputs every run' if scale in ('1', '1.0') else 'random'}"
        "); the counts are the test bodies that ran, by outcome.\n\n"
        + _table(["Target", "Module error", "Inputs tried", "Accepted",
                  "Refused (by error type)", "Distinct refusal messages"], fuzz_rows)
        + "\n\n" + _table(["Test", "What it shows", "Result", "s"], _test_rows(data, "fuzz")))

    soak_rows = []
    for r in (r for r in records if r["kind"] == "soak"):
        s, e = r["start"], r["end"]
        nixl = []
        if "registrations" in s:
            nixl.append(f"registrations {_arrow(s['registrations'], e['registrations'])}")
        if "agent_metadata_bytes" in s:
            nixl.append(f"agent metadata {_arrow(s['agent_metadata_bytes'], e['agent_metadata_bytes'])} B")
        if "peer" in s:
            p, q = s["peer"], e["peer"]
            nixl.append(f"peer: fds {_arrow(p['fds'], q['fds'])}, maps "
                        f"{_arrow(p['maps'], q['maps'])}, RSS {_arrow(p['rss_kib'], q['rss_kib'])}"
                        f" KiB, notifications {_arrow(p['notifications'], q['notifications'])}")
        if "chunks" in s:
            nixl.append(f"mapped chunks {_arrow(s['chunks'], e['chunks'])}")
        soak_rows.append([r["soak"], r["cycles"], r["per_second"], _arrow(s["fds"], e["fds"]),
                          _arrow(s["maps"], e["maps"]),
                          f"{_arrow(s['rss_kib'], e['rss_kib'])} "
                          f"({e['rss_kib'] - s['rss_kib']:+d})", "; ".join(nixl) or "-"])
    slack = next((r["rss_slack_kib"] for r in records if r["kind"] == "soak"), None)
    out["soak"] = (
        f"Start: after a 20-cycle warm-up; end: after the last cycle. Fds, maps and NIXL "
        f"state must be equal; RSS may grow by at most {slack} KiB (tests/test_soak.py says "
        "why).\n\n"
        + _table(["Soak", "Cycles", "Cycles/s", "Open fds", "Mappings", "RSS KiB (Δ)",
                  "Other"], soak_rows)
        + "\n\n" + _table(["Test", "What it shows", "Result", "s"], _test_rows(data, "soak")))

    sweeps = [r for r in records if r["kind"] == "recovery"]
    sweep_text = "".join(
        f"\n\nKill sweep: {r['sweep']}; kill delays {r['delays_s']} s gave {r['outcomes']} "
        "(each `done` byte-exact, each `failed` naming every block)." for r in sweeps)
    out["recovery"] = _table(["Test", "What it shows", "Result", "s"],
                             _test_rows(data, "recovery")) + sweep_text

    scans = [r for r in records if r["kind"] == "json_scan"]
    if scans:
        out["json-scan"] = "\n\n".join(_json_scan_table(r) for r in scans)

    if any(c["file"] in TEST_FILES["hostile"] for c in data["tests"]):
        out["hostile"] = _table(["Test", "What it shows", "Result", "s"],
                                _test_rows(data, "hostile"))

    nixl = data.get("nixl_metadata_probe")
    if nixl:
        crashed = sum(v for k, v in nixl["outcomes"].items() if k.startswith("SIG"))
        which = ", ".join(f"{c['input']} ({c['signal']})" for c in nixl["crashes"]) or "none"
        out["nixl-probe"] = (
            f"{nixl['inputs']} corrupted agent-metadata blobs (seed {nixl['seed']}; 1-6 bytes "
            f"changed, half of them also cut) loaded with `add_remote_agent` in child "
            f"processes: {crashed} killed the process; inputs that crashed: "
            f"{which}."
            "\n\n" + _table(["Outcome", "Inputs"], [[k, v] for k, v in
                                                     nixl["outcomes"].items()]))

    per_file: dict[str, float] = {}
    for case in data["tests"]:
        per_file[case["file"]] = per_file.get(case["file"], 0.0) + case["seconds"]
    out["time"] = _table(["Test file", "Tests", "Seconds (serial)"],
                         [[f"`{f}`", sum(c["file"] == f for c in data["tests"]), f"{s:.1f}"]
                          for f, s in per_file.items()]
                         + [["all", len(data["tests"]), f"{sum(per_file.values()):.1f}"]])
    return out


def _json_scan_table(r: dict[str, Any]) -> str:
    """The depth scan's time against the input's size (tests/test_bounded_json_hostile.py),
    with the figures measured before the fix."""
    rows, prev = [], None
    for row in r["rows"]:
        grew = "-" if prev is None else (
            f"{row['chars'] / prev['chars']:.0f}x / "
            f"{row['seconds'] / max(prev['seconds'], 1e-9):.1f}x")
        rows.append([f"{row['chars']:,}", f"{row['seconds'] * 1e3:.2f}", grew,
                     "yes" if row.get("checked") else "-"])
        prev = row
    before = "; ".join(f"{b['chars']:,} characters took {b['seconds']:g} s"
                       for b in r.get("before_fix", []))
    return (f"Input: {r['shape']} (`bounded_json.loads`: the depth scan, then the parse). "
            f"Time: the least CPU time of the scanning thread over several runs. A checked "
            f"step may take at most {r['max_time_growth']:g}x the time for "
            f"{r['growth']}x the input; beyond {r.get('checked_up_to', 0):,} characters the "
            f"text outgrows the CPU's caches and each byte costs more: recorded only. Before "
            f"the fix (wall time): {before or 'not recorded'}: quadratic.\n\n"
            + _table(["Characters", "CPU ms", "Input / time growth", "Checked"], rows))


def write_doc(sections: dict[str, str], doc: Path = DOC) -> None:
    text = doc.read_text()
    for name, body in sections.items():
        pattern = re.compile(rf"(<!-- BEGIN generated:{name} [^>]*-->\n).*?(<!-- END generated:"
                             rf"{name} -->)", re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"{doc}: no generated section {name!r}")
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), text)
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="results file")
    p.add_argument("--render", action="store_true", help="only re-render the doc from --json")
    p.add_argument("--no-doc", action="store_true", help="run and write --json only")
    p.add_argument("--nixl-probe", type=int, default=NIXL_PROBE_INPUTS, metavar="N",
                   help=f"corrupted NIXL metadata blobs to try (default {NIXL_PROBE_INPUTS}; "
                        "0 skips the probe)")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(args.json.read_text())
    else:
        data = run_tests()
        if args.nixl_probe:
            data["nixl_metadata_probe"] = _probe_module().probe(args.nixl_probe)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {args.json}: {data['pytest_summary']} in {data['wall_seconds']} s")
    if not args.no_doc:
        write_doc(render_sections(data))
        print(f"wrote the generated sections of {DOC.relative_to(ROOT)}")
    return 0 if data["pytest_exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
