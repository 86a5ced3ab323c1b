"""What users install (issue 23, item 11): ``kvconnect[nixl]`` and ``kvconnect[vllm]`` bring the
``nixl`` package, whose ``nixl._api`` vLLM imports in every engine process (``nixl-cu13``
alone installs ``nixl_cu13`` only: a multi-process engine then fails with "NIXL is not
available"); docs/vllm-plugin.md's install line installs it; and this environment, built
with the ``nixl`` extra by ``make venv``, imports ``nixl._api`` without any alias, the same
module kvconnect's own NIXL code uses. A multi-process engine over it:
tests/test_engine_pd_multiprocess.py (``make test-engine``)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="pyproject.toml is read with tomllib (Python 3.11)")

ROOT = Path(__file__).resolve().parents[1]
#: the distribution that provides ``nixl._api`` (NIXL's meta package)
NIXL_PACKAGE = "nixl==1.5.1"


def _extras() -> dict[str, list[str]]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


@pytest.mark.parametrize("extra", ["nixl", "vllm"])
def test_the_extras_install_what_vllm_imports(extra: str) -> None:
    assert NIXL_PACKAGE in _extras()[extra]


def test_the_documented_install_line_installs_nixl() -> None:
    text = (ROOT / "docs" / "vllm-plugin.md").read_text()
    block = text.split("## Turning it on", 1)[1].split("```", 2)[1]
    (line,) = [ln for ln in block.splitlines() if ln.startswith("pip install")]
    m = re.fullmatch(r"pip install '?kvconnect\[([a-z,]+)\]'?(\s+#.*)?", line.strip())
    assert m is not None, line
    assert any(NIXL_PACKAGE in _extras()[e] for e in m[1].split(",")), line


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None,
                    reason="NIXL is not installed here (make venv installs kvconnect[nixl])")
def test_nixl_api_imports_as_installed_and_kvconnect_uses_it() -> None:
    """In a fresh interpreter, nothing aliased: ``import nixl._api`` works, and kvconnect's
    own NIXL code takes the very module vLLM would."""
    code = ("import sys, nixl._api\n"
            "from kvconnect.connectors.nixl.agent import import_nixl\n"
            "agent, _ = import_nixl()\n"
            "print(sys.modules['nixl._api'].__name__, agent.__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    api, agent_module = out.stdout.split()
    assert api.startswith("nixl_cu") and api.endswith("._api")
    assert agent_module == api
