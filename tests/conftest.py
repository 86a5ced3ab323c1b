"""Shared test setup: the `gpu` marker skips cleanly where no CUDA VMM device exists."""

from __future__ import annotations

import functools

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
