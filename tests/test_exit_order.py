"""Interpreter exit with caches, views and peer mappings alive: every mapping is unmapped and
every handle released before its VA is freed, and nothing is logged at ERROR level.

A decode engine on the H200 logged ``cuMemAddressFree failed: CUDA_ERROR_INVALID_VALUE`` at
exit (issue 27): its fast path keeps peer mappings (:class:`kvconnect.ipc.PeerMapping`) for
the engine's lifetime, and at exit ``weakref.finalize`` runs the pending finalizers newest
first, so a reservation's own finalizer (created before anything was mapped in it) freed the
VA while the peer's chunks were still mapped. CUDA refuses that (test below, on a GPU); the
host backend models the refusal, so the CPU tests see the same order.

Each case is a child process (its own interpreter exit), its stderr read whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import gc, json, logging, sys
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    import torch
    from kvconnect import ExtensibleTensor
    from kvconnect.ipc import export_message, import_message
    from kvconnect.vmm import AllocationOptions, probe_vmm
    device, case = sys.argv[1], sys.argv[2]
    driver = probe_vmm(device).driver
    gran = driver.granularity(AllocationOptions(shareable=True))
    t = ExtensibleTensor(8 * gran, driver, num_segments=2,
                         options=AllocationOptions(shareable=True))
    t.commit(2 * gran)
    t.segment_view(1)[:16].fill_(7)
    message, fds = export_message([t])
    (peer,) = import_message(driver, message, fds)
    view = peer.view(4 * gran, 16)  # the peer's segment 1 (segment capacity 4 granules)
    ok = bool((view == 7).all())
    keep = [t, peer, view]
    if case == "views_dropped":
        del view, keep
        gc.collect()
    elif case == "closed":
        del view, keep
        peer.close(); t.close()
    print(json.dumps({"read_ok": ok, "case": case}), flush=True)
""")

CASES = ["alive", "views_dropped", "closed"]


def _run(device: str, case: str) -> tuple[dict[str, object], str]:
    proc = subprocess.run([sys.executable, "-c", CHILD, device, case], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines()
            if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line
            or "could not free" in line]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
def test_exit_with_peer_mappings_logs_no_error(device: str, case: str) -> None:
    out, stderr = _run(device, case)
    assert out["read_ok"]
    assert _errors(stderr) == [], stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_refuses_to_free_a_reservation_with_a_chunk_mapped() -> None:
    """The cause of issue 27, established on the device: ``cuMemAddressFree`` of a range that
    still has a chunk mapped fails (the host backend models this refusal)."""
    from kvconnect.vmm import AllocationOptions, VmmError, probe_vmm

    driver = probe_vmm("cuda:0").driver
    gran = driver.granularity(AllocationOptions())
    va = driver.reserve(4 * gran)
    handle = driver.create(gran)
    driver.map(va, gran, handle)
    try:
        with pytest.raises(VmmError) as err:
            driver.free_reserved(va, 4 * gran)
        assert "cuMemAddressFree" in str(err.value)
    finally:
        driver.unmap(va, gran)
        driver.release(handle)
    driver.free_reserved(va, 4 * gran)  # once nothing is mapped, it is freed


def test_host_backend_refuses_to_free_a_reservation_with_a_chunk_mapped() -> None:
    from kvconnect.vmm import VmmError
    from kvconnect.vmm.host import HostVmmDriver

    driver = HostVmmDriver()
    gran = driver.granularity()
    va = driver.reserve(4 * gran)
    handle = driver.create(gran)
    driver.map(va + gran, gran, handle)
    try:
        with pytest.raises(VmmError, match="still mapped"):
            driver.free_reserved(va, 4 * gran)
    finally:
        driver.unmap(va + gran, gran)
        driver.release(handle)
    driver.free_reserved(va, 4 * gran)
