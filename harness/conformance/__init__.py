"""The conformance kit: does a vLLM connector see only committed memory? (needs vLLM)

For each vLLM 0.33 layout it builds a VMM-style cache (capacity many times the committed
blocks; the host backend on CPU, where touching uncommitted memory faults), hands it to the
connector through vLLM's own factory and ``register_kv_caches``, each case in its own
process, and reports in JSON: registrations outside committed memory, wrong block length or
stride, faults (the signal and the step), a byte-exact transfer (NIXL: a second real agent)
or offload round trip, and behaviour across sleep / wake.

Any ``KVConnectorBase_V1`` subclass can be checked: one of no kind the kit knows is checked
by what it registers and holds, and what could not be checked is reported in words. The
engine mode (:func:`run_engine_conformance`, :mod:`.engine`) runs a connector inside real
vLLM engines over kvconnect's extensible cache and vLLM's plain one.

Entry points: ``kvconnect-conformance module:Class [--engine]`` (:mod:`.cli`), the pytest
plugin ``pytest --kvconnect-connector module:Class [--kvconnect-engine]`` (:mod:`.plugin`),
:func:`run_conformance` and :func:`run_engine_conformance`. Runs on vLLM 0.32 and 0.33
(:mod:`.compat`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvconnect.layout.formats import VLLM_LAYOUTS

__all__ = ["STOCK_AND_PATCHED", "VLLM_LAYOUTS", "run_conformance", "run_engine_conformance"]

#: the connectors docs/conformance.md compares: vLLM 0.33's and kvconnect's patched ones
STOCK_AND_PATCHED = (
    "NixlConnector", "kvconnect.connectors.vllm:KvconnectNixlConnector",
    "SimpleCPUOffloadConnector", "kvconnect.connectors.vllm:KvconnectSimpleCPUOffloadConnector",
    "OffloadingConnector", "kvconnect.connectors.vllm:KvconnectOffloadingConnector",
)


def run_conformance(connectors: Sequence[str], layouts: Iterable[str] = VLLM_LAYOUTS, *,
                    timeout: float | None = None,
                    on_result: Callable[[dict[str, Any]], None] | None = None,
                    start_method: str = "fork", **geometry: Any) -> list[dict[str, Any]]:
    """One case per (connector, layout), each in its own process; their JSON results.
    ``connectors``: ``"module:Class"`` or names vLLM registers; ``geometry`` overrides
    :data:`~kvconnect.harness.conformance.case.CASE_DEFAULTS` (``num_blocks``,
    ``capacity_blocks``, ``num_layers``, ``device`` ("cpu" or "cuda:N"), ...);
    ``start_method``: "fork" (default) or "spawn" (see :mod:`.runner`)."""
    from .runner import DEFAULT_TIMEOUT, run_cases

    specs = [{"connector": c, "layout": lay, **geometry}
             for c in connectors for lay in layouts]
    return run_cases(specs, timeout=DEFAULT_TIMEOUT if timeout is None else timeout,
                     on_result=on_result, start_method=start_method)


def run_engine_conformance(connectors: Sequence[str], **kwargs: Any) -> dict[str, Any]:
    """Engine mode: see :func:`kvconnect.harness.conformance.engine.run_engine_conformance`."""
    from .engine import run_engine_conformance as run

    return run(connectors, **kwargs)
