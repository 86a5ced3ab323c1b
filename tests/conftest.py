"""Shared test setup: the `gpu` marker skips cleanly where no CUDA VMM device exists; tests
marked `nixl` get NIXL workers only from the `nixl_worker` fixture, and garbage is collected
after each of them, so a NIXL finalizer that crashes is charged to the test that caused it."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest


@functools.lru_cache(maxsize=1)
def cuda_vmm_reason() -> str | None:
    """None when a CUDA device with VMM is usable, else why not."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        return "torch missing"
    if not torch.cuda.is_available():
        return "no CUDA device"
    from kvconnect.vmm import probe_vmm

    probe = probe_vmm("cuda:0")
    return None if probe.driver is not None else probe.reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = cuda_vmm_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``vmm_device`` runs on the host backend and, marked gpu, on CUDA."""
    if "vmm_device" in metafunc.fixturenames:
        metafunc.parametrize("vmm_device", [
            pytest.param("cpu", id="host"),
            pytest.param("cuda:0", id="cuda", marks=pytest.mark.gpu),
        ])


@pytest.fixture(autouse=True)
def _collect_garbage_after_nixl_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each `nixl` test, run the collector: a NIXL agent kept alive by a reference cycle
    (a traceback holding a frame) is destroyed here, inside this test's teardown."""
    yield
    if request.node.get_closest_marker("nixl") is not None:
        gc.collect()


@pytest.fixture
def nixl_worker() -> Iterator[Callable[..., Any]]:
    """Factory of :class:`NixlRegionWorker`s that are closed when the test ends (whatever it
    did with them): ``worker = nixl_worker("decode", progress_thread=False)``."""
    from kvconnect.connectors.nixl.worker import NixlRegionWorker

    made: list[NixlRegionWorker] = []

    def make(*args: Any, **kwargs: Any) -> NixlRegionWorker:
        worker = NixlRegionWorker(*args, **kwargs)
        made.append(worker)
        return worker

    yield make
    for worker in reversed(made):
        worker.close()


@pytest.fixture
def run_validate_cli(capsys: pytest.CaptureFixture[str]) -> Callable[[list[str]], tuple[int, str]]:
    """Run ``kvconnect-validate``'s ``main`` in this process: ``(exit code, stdout + stderr)``
    (argparse's own errors exit through SystemExit)."""
    from kvconnect.harness import cli

    def run(argv: list[str]) -> tuple[int, str]:
        try:
            code = cli.main(argv)
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return code, out.out + out.err

    return run
