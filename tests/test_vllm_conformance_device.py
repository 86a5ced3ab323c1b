"""The conformance kit's device plumbing (CPU here; the CUDA half runs on the GPU machine).

No vLLM needed except where a test says so (``vllm`` marker): extension shims, device
parsing, the CUDA runtime's environment, torch-view data checks over a real VMM
reservation (host backend; CUDA too where the ``gpu`` marker runs), the DMA wait's deadline
and thread-death detection, and one case started by each start method.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from kvconnect.harness.conformance.case import DeviceBytes, _read_runs
from kvconnect.harness.conformance.probes import dma_copy
from kvconnect.harness.conformance.runner import case_device
from kvconnect.tensor import ExtensibleTensor
from kvconnect.vllm.runtime import is_cuda_device, prepare_cuda_runtime
from kvconnect.vllm.shims import MissingExtensionShim, install_extension_shims, is_shim


def test_shims_stand_only_for_absent_extensions() -> None:
    missing, present = "kvconnect_test_absent._C_ext", "kvconnect_test_present._C_ext"
    try:
        got = install_extension_shims([missing, present], present=lambda n: n == present)
        assert got == [missing]
        assert is_shim(sys.modules[missing]) and isinstance(sys.modules[missing],
                                                            MissingExtensionShim)
        assert present not in sys.modules
        assert install_extension_shims([missing], present=lambda n: False) == []  # once
    finally:
        sys.modules.pop(missing, None)


def test_device_names() -> None:
    assert not is_cuda_device("cpu")
    assert is_cuda_device("cuda") and is_cuda_device("cuda:1")
    with pytest.raises(ValueError, match="cuda"):
        is_cuda_device("xpu:0")
    assert case_device([{"device": "cuda:0"}, {"device": "cuda:0"}]) == "cuda:0"
    assert case_device([{}]) == "cpu"
    with pytest.raises(ValueError, match="share a device"):
        case_device([{"device": "cpu"}, {"device": "cuda:0"}])


def test_cuda_runtime_selects_cuda_platform_without_initialising_cuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")  # as make test-vllm leaves it
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    before = set(sys.modules)
    try:
        shims = prepare_cuda_runtime()
        import os

        assert os.environ["VLLM_TARGET_DEVICE"] == "cuda"
        assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
        for name in shims:
            assert is_shim(sys.modules[name])
    finally:
        for name in set(sys.modules) - before:
            if is_shim(sys.modules[name]):
                del sys.modules[name]


@pytest.fixture
def reservation(vmm_device: str):
    granule = ExtensibleTensor.commit_granule(vmm_device)
    t = ExtensibleTensor(4 * granule, vmm_device, num_segments=2)
    t.commit(granule)
    yield t
    t.close(force=True)


def test_device_bytes_reads_and_fills_committed_memory(reservation) -> None:
    t = reservation
    mem = DeviceBytes(t)
    a = t.segment_base(1) + 100
    mem.fill(a, 64, 0xAB)
    assert mem.read(a, 64) == b"\xab" * 64
    assert mem.read(a + 64, 8) == bytes(8)  # fresh commits are zeroed
    with pytest.raises(ValueError, match="committed"):
        mem.read(t.segment_base(0) + t.granule - 8, 16)  # crosses into uncommitted VA


def test_read_runs_never_touches_uncommitted_memory(reservation) -> None:
    t = reservation
    mem = DeviceBytes(t)
    extents = [(t.segment_base(s), t.granule) for s in range(t.num_segments)]
    mem.fill(extents[0][0], 4, 7)
    unreadable = [0]
    # the second run lies past segment 0's commit: reading it would fault (host backend)
    got = _read_runs(extents, unreadable, mem)([(extents[0][0], 4),
                                                (extents[0][0] + t.granule, 32)])
    assert got == b"\x07" * 4 + bytes(32) and unreadable == [32]


class DmaBackendStandIn:
    """Stands in for vLLM's ``DmaCopyBackend`` (cuMemcpyBatchAsync needs CUDA): records
    the event a launch would, after ``delay`` s, from its thread; or dies first."""

    def __init__(self, delay: float = 0.0, die: bool = False) -> None:
        self.delay, self.die, self.launched = delay, die, []
        self._thread: threading.Thread | None = None

    def launch_copy(self, src, dst, is_store, event_idx, events_list, wait_event=None):
        self.launched.append((list(src), list(dst), is_store))

        class Event:
            synchronized = False

            def synchronize(self) -> None:
                Event.synchronized = True

        def run() -> None:
            time.sleep(self.delay)
            if not self.die:
                events_list.append((event_idx, Event()))

        self._event = Event
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()


def test_dma_copy_waits_for_the_event_then_synchronises() -> None:
    b = DmaBackendStandIn(delay=0.05)
    dma_copy(b, [3, 5], [0, 1], True, timeout=5)
    assert b.launched == [([3, 5], [0, 1], True)] and b._event.synchronized


def test_dma_copy_reports_a_dead_copy_thread_at_once() -> None:
    b = DmaBackendStandIn(die=True)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="thread died"):
        dma_copy(b, [1], [0], False, timeout=30)
    assert time.monotonic() - t0 < 5


def test_dma_copy_has_a_deadline() -> None:
    b = DmaBackendStandIn(delay=10)
    with pytest.raises(TimeoutError):
        dma_copy(b, [1], [0], False, timeout=0.2)


@pytest.mark.vllm
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_case_runs_by_either_start_method(start_method: str) -> None:
    from kvconnect.vllm.runtime import prepare_cpu_runtime

    prepare_cpu_runtime()
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")
    from kvconnect.harness.conformance import run_conformance

    (r,) = run_conformance(["kvconnect.connectors.vllm:KvconnectSimpleCPUOffloadConnector"],
                           ["LBHNC"], timeout=120, start_method=start_method, device="cpu")
    assert r["status"] == "pass", r
    assert r["device"] == "cpu" and r["checks"]["offload_round_trip"]["moved_bytes"] > 0


@pytest.mark.vllm
def test_cuda_probes_keep_upstream_copy_engine() -> None:
    from kvconnect.vllm.runtime import prepare_cpu_runtime

    prepare_cpu_runtime()
    pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")
    import vllm.v1.simple_kv_offload.worker as worker

    from kvconnect.connectors.vllm.patched_offload import KvconnectSimpleCPUOffloadConnector
    from kvconnect.harness.conformance.probes import SimpleCPUOffloadProbe, probe_for

    probe = probe_for(KvconnectSimpleCPUOffloadConnector, "cuda:0")
    assert isinstance(probe, SimpleCPUOffloadProbe) and probe.device.type == "cuda"
    upstream = worker.DmaCopyBackend
    probe.install()  # on CUDA: no stand-ins
    assert worker.DmaCopyBackend is upstream
