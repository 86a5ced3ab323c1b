"""pytest plugin: ``pytest --kvconnect-connector module:Class`` adds one test per layout.

Registered through the ``pytest11`` entry point, so it loads in every pytest session where
kvconnect is installed; without the option it adds nothing and imports nothing heavy.
Each added test runs one conformance case in its own process and fails with the case's
JSON when any check fails (or the case faults / times out). Options:
``--kvconnect-connector`` (repeatable), ``--kvconnect-layouts LBHNC,BLHNC``,
``--kvconnect-capacity-blocks``, ``--kvconnect-num-blocks`` and ``--kvconnect-device``
(``cpu``, the host VMM backend, or ``cuda:N``: then each case runs in a fresh
interpreter, since the pytest process may have initialised CUDA).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

__all__ = ["ConformanceItem", "pytest_addoption", "pytest_collection_modifyitems",
           "pytest_configure"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconnect", "kvconnect conformance kit (vLLM connectors)")
    group.addoption("--kvconnect-connector", action="append", default=[],
                    metavar="MODULE:CLASS",
                    help="run the conformance kit on this vLLM connector (repeatable)")
    group.addoption("--kvconnect-layouts", default="", metavar="L1,L2",
                    help="vLLM layouts to test (default: all six)")
    group.addoption("--kvconnect-num-blocks", type=int, default=128)
    group.addoption("--kvconnect-capacity-blocks", type=int, default=1024)
    group.addoption("--kvconnect-device", default="cpu", metavar="DEVICE",
                    help="where the cases' KV caches live: cpu (host VMM) or cuda:N")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM 0.33 (kvconnect conformance cases)")


class ConformanceItem(pytest.Item):
    """One (connector, layout) case."""

    def __init__(self, *, spec: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.add_marker(pytest.mark.vllm)

    def runtest(self) -> None:
        from kvconnect.vllm.conformance.runner import run_cases
        from kvconnect.vllm.runtime import is_cuda_device

        # a pytest process may have initialised CUDA (fixtures, gpu markers): never fork it
        method = "spawn" if is_cuda_device(self.spec["device"]) else "fork"
        (result,) = run_cases([self.spec], start_method=method)
        self.user_properties.append(("kvconnect_conformance", json.dumps(result)))
        if result["status"] != "pass":
            raise ConformanceFailure(result)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
                     ) -> str:
        if isinstance(excinfo.value, ConformanceFailure):
            return json.dumps(excinfo.value.result, indent=1)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return "kvconnect-conformance", 0, self.name


class ConformanceFailure(Exception):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result["status"])
        self.result = result


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    connectors = config.getoption("--kvconnect-connector")
    if not connectors:
        return
    from kvconnect.layout.formats import VLLM_LAYOUTS

    text = config.getoption("--kvconnect-layouts")
    layouts = [x.strip() for x in text.split(",") if x.strip()] or list(VLLM_LAYOUTS)
    for c in connectors:
        for lay in layouts:
            spec = {"connector": c, "layout": lay,
                    "num_blocks": config.getoption("--kvconnect-num-blocks"),
                    "capacity_blocks": config.getoption("--kvconnect-capacity-blocks"),
                    "device": config.getoption("--kvconnect-device")}
            items.append(ConformanceItem.from_parent(session, name=f"conformance[{c}-{lay}]",
                                                     spec=spec))
