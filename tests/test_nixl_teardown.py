"""Closing (or collecting) a NIXL worker after a failed transfer never aborts the process.

Each failure sequence runs in its own child process (tests/_nixl_teardown_child.py) against
real prefill processes: the child must exit 0 after close and ``gc.collect()``. Before the fix,
a READ posted while UCX was learning that the peer died left operations queued on UCX's CMA
endpoint and the agent's destructor aborted the process (``arbiter.c:36 Assertion
`ucs_arbiter_group_is_empty(group)'``, exit 134).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnect.connectors.nixl.agent import nixl_importable

#: slow: each scenario is a child process against real prefill processes (6-30 s each)
pytestmark = [pytest.mark.skipif(not nixl_importable(), reason="NIXL Python bindings not installed"),
              pytest.mark.nixl, pytest.mark.slow]

CHILD = Path(__file__).with_name("_nixl_teardown_child.py")
#: what each scenario's READs must have raised: the failure really happened
EXPECTED_FAILURE = {
    "peer_killed_mid_read": "KVTransferError",
    "collected_without_close": "KVTransferError",
    "peer_closed_agent": "KVTransferError",
    "read_timeout": "KVTransferError",
    "notification_lost": "TimeoutError",
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scenario", sorted(EXPECTED_FAILURE))
def test_teardown_after_failure_exits_cleanly(scenario: str) -> None:
    proc = subprocess.run([sys.executable, "-u", str(CHILD), "decode", scenario],
                          capture_output=True, timeout=120,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout.decode(errors="replace")
    tail = (out + proc.stderr.decode(errors="replace"))[-3000:]
    assert proc.returncode == 0, f"{scenario}: exit {proc.returncode}\n{tail}"
    (line,) = [ln for ln in out.splitlines() if ln.startswith("KVC ")]
    report = json.loads(line[4:])
    assert report["scenario"] == scenario and report["teardown"] == "done"
    assert EXPECTED_FAILURE[scenario] in report["outcomes"], report
    if scenario != "read_timeout":  # every other sequence first reads successfully
        assert report["outcomes"][0] == "ok", report
