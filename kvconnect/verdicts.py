"""The check vocabulary of both command lines (torch-free): one :class:`Check`, written as
rows of ``kvconnect-validate``'s report (:meth:`Check.to_json`) and as a conformance case's
``{name: {"status": ..., evidence...}}`` (:meth:`Check.to_entry`, :func:`check_entry`), with
the same statuses (:data:`REFUSED`: kvconnect declined a layout, not a fault). A conformance
case's own status is its checks' verdict or how it ended without one (:data:`CASE_STATUSES`,
:func:`engine_end`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["CASE_STATUSES", "CHECK_STATUSES", "ENDED_EARLY", "ERROR", "FAIL", "FAULT",
           "INCONCLUSIVE", "PASS", "REFUSED", "SKIP", "TIMEOUT", "UNSUPPORTED", "Check",
           "check_entry", "engine_end"]

PASS = "pass"
FAIL = "fail"
SKIP = "skip"
REFUSED = "refused"
CHECK_STATUSES = (PASS, FAIL, SKIP, REFUSED)
#: how a conformance case ended without its checks' verdict: out of time, killed by a
#: signal, or gone without a result
TIMEOUT, FAULT, ERROR = "timeout", "fault", "error"
ENDED_EARLY = (TIMEOUT, FAULT, ERROR)
#: an engine row that saw no KV move (the connector's own errors as evidence); one where
#: vLLM's own connector cannot start either
INCONCLUSIVE, UNSUPPORTED = "inconclusive", "unsupported"
CASE_STATUSES = (PASS, FAIL, REFUSED, INCONCLUSIVE, UNSUPPORTED, *ENDED_EARLY)


@dataclass
class Check:
    """One verdict. ``worker`` is who produced it (``prefill0``, ``decode1``, ``coordinator``).

    ``detail`` is for people; ``data`` holds the same facts for programs (JSON values, e.g.
    ``{"block": 17, "offset": 4093}``): tests and tools read ``data``, never ``detail``.
    """

    name: str
    status: str
    detail: str = ""
    worker: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in CHECK_STATUSES:
            raise ValueError(f"check status must be one of {CHECK_STATUSES}, got "
                             f"{self.status!r}")

    def to_json(self) -> dict[str, Any]:
        """``{name, status, detail, worker, seconds, data}``, as reports write it."""
        return asdict(self)

    def to_entry(self) -> dict[str, Any]:
        """``{"status", **data}``: the check as a conformance case's ``checks`` hold it (keyed
        by name; ``detail``, ``worker`` and ``seconds`` are the validation report's)."""
        return {"status": self.status, **self.data}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Check:
        data = obj.get("data") or {}
        if not isinstance(data, dict):
            raise ValueError(f"check data must be a JSON object, got {type(data).__name__}")
        return cls(name=str(obj["name"]), status=str(obj["status"]),
                   detail=str(obj.get("detail", "")), worker=str(obj.get("worker", "")),
                   seconds=float(obj.get("seconds", 0.0)), data=dict(data))


def check_entry(status: str, **data: Any) -> dict[str, Any]:
    """A conformance check entry: the :class:`Check` of ``status`` (one of
    :data:`CHECK_STATUSES`, else ValueError) and ``data``, as :meth:`Check.to_entry` writes it."""
    return Check("", status, data=data).to_entry()


def engine_end(signal: str | None, evidence: str, stage: str) -> dict[str, Any]:
    """How a conformance case ended whose engine left no result, as its JSON holds it
    (``status``, ``evidence``, ``stage``, ``signal``): ``signal`` ``"timeout"`` (the deadline
    passed) -> :data:`TIMEOUT`, another signal's name -> :data:`FAULT`, None (the engine
    raised or exited) -> :data:`FAIL`."""
    status = TIMEOUT if signal == "timeout" else FAULT if signal else FAIL
    return {"status": status, "evidence": evidence, "stage": stage,
            "signal": None if status == TIMEOUT else signal}
