"""kvconnect without vLLM: nothing needs it, and what needs it says so (runs everywhere)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvconnect.vllm.runtime import vllm_available

#: slow: each test starts fresh interpreters that import kvconnect (and torch) from scratch
pytestmark = pytest.mark.slow


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_importing_kvconnect_never_imports_vllm() -> None:
    out = _python("import sys, json, kvconnect, kvconnect.vllm, kvconnect.connectors.vllm, "
                  "kvconnect.views, "
                  "kvconnect.layout, kvconnect.harness.conformance.plugin; "
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')))")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


@pytest.mark.skipif(vllm_available() is None, reason="vLLM is installed here")
def test_without_vllm_the_vllm_parts_say_what_to_install() -> None:
    out = _python("import kvconnect.connectors.vllm as v; v.KvconnectNixlConnector")
    assert out.returncode != 0 and "kvconnect[vllm]" in out.stderr
    cli = subprocess.run([sys.executable, "-m", "kvconnect.harness.conformance.cli",
                          "NixlConnector"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 3 and "not installed" in cli.stderr  # environment, as validate


def test_the_patched_connectors_old_path_says_where_they_moved() -> None:
    """``kvconnect.vllm`` as kv_connector_module_path (before issue 24): vLLM's getattr fails
    with the new path in the message, whether vLLM is installed or not."""
    import kvconnect.vllm as v

    with pytest.raises(AttributeError, match="kvconnect.connectors.vllm"):
        _ = v.KvconnectNixlConnector
    assert "KvconnectNixlConnector" not in v.__all__
    with pytest.raises(AttributeError, match="has no attribute"):
        _ = v.NoSuchThing
