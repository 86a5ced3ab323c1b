"""Type-check kvconnect/, connectors/ and harness/ with mypy as the one package ``kvconnect``.

``connectors/`` and ``harness/`` install as ``kvconnect.connectors`` and ``kvconnect.harness``
(setuptools ``package-dir``), a mapping mypy cannot read, and the editable install's import
hook is invisible to it. So this builds ``build/typecheck/kvconnect/``: a directory of
symbolic links to every entry of ``kvconnect/`` plus ``connectors`` -> ``connectors/`` and
``harness`` -> ``harness/``, and runs ``mypy -p kvconnect`` over it (settings in
pyproject.toml's ``[tool.mypy]``, whose ``mypy_path`` names that directory). Messages name
files as ``kvconnect/connectors/...`` and ``kvconnect/harness/...``. Extra arguments go to
mypy. Exit status: mypy's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def build_tree() -> None:
    """(Re)build the link tree; a link per top-level entry, so new modules need no rebuild
    below the top level."""
    package = TREE / "kvconnect"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for entry in (ROOT / "kvconnect").iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, package / entry.name)
    for sub in ("connectors", "harness"):
        os.symlink(ROOT / sub, package / sub)


def main(argv: list[str]) -> int:
    build_tree()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
           "-p", "kvconnect", *argv]
    return subprocess.call(cmd, cwd=TREE)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
