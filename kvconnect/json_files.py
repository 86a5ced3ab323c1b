"""JSON files that processes of one tool hand each other (an engine's result, a phase's
"done" marker): written whole or not at all, waited for under a deadline."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["wait_for_json_file", "write_json_file"]

#: seconds between two looks for a file being waited for
POLL_S = 0.1


def write_json_file(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file renamed over it, so a
    reader sees either nothing or the whole document."""
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(obj))
    os.replace(tmp, path)


def wait_for_json_file(path: str | Path, deadline: float) -> Any:
    """The JSON document at ``path`` once it exists (written by :func:`write_json_file`);
    ``TimeoutError`` naming it when ``time.monotonic()`` passes ``deadline`` first."""
    while time.monotonic() < deadline:
        if Path(path).exists():
            return json.loads(Path(path).read_text())
        time.sleep(POLL_S)
    raise TimeoutError(f"{path} did not appear in time")
