"""Shared by the reliability tests (fuzz, soak, recovery): hypothesis settings, a tally of
the inputs each fuzz target tried, and a record of measured figures.

- ``KVC_FUZZ_SCALE`` (default 1): multiplies every fuzz target's example count. At 1 the
  runs are derandomized (the same inputs every run: CI never flakes on a new random draw);
  any other value draws fresh random inputs (a deeper run: ``KVC_FUZZ_SCALE=20``).
- ``KVC_RELIABILITY_RECORD``: a file to which the tests append one JSON line per fuzz
  target, soak and recovery sweep (``scripts/reliability_tables.py`` sets it and writes
  the tables of docs/reliability.md from it).
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

SCALE = float(os.environ.get("KVC_FUZZ_SCALE", "1"))
_G = 2 * 1024 * 1024


def examples(n: int) -> int:
    """``n`` scaled by ``KVC_FUZZ_SCALE`` (at least 1)."""
    return max(1, round(n * SCALE))


def fuzz_settings(n: int) -> settings:
    """Settings of one fuzz target of ``n`` (scaled) examples."""
    return settings(max_examples=examples(n), deadline=None, derandomize=SCALE == 1,
                    database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                           HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


class Tally:
    """Counts the inputs one fuzz target tried, by outcome (``"accepted"`` or the name of
    the error the module raised)."""

    def __init__(self, target: str, module_error: str, max_examples: int) -> None:
        self.target = target
        self.module_error = module_error
        self.max_examples = max_examples
        self.outcomes: Counter[str] = Counter()
        #: expected errors by message, numbers and quoted values masked
        self.reasons: Counter[str] = Counter()

    @property
    def tried(self) -> int:
        return sum(self.outcomes.values())

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def run(self, body: Callable[[], Any], errors: tuple[type[BaseException], ...]) -> Any:
        """Call ``body``; count ``"accepted"`` or the name of an expected error (re-raised
        for nothing: expected errors are the point). Anything else propagates (the test
        fails and hypothesis shrinks the input)."""
        try:
            value = body()
        except errors as exc:
            self.add(type(exc).__name__)
            self.reasons[_mask(str(exc))] += 1
            return exc
        self.add("accepted")
        return value

    def record(self) -> None:
        """Record this target's counts (see :func:`record`)."""
        record("fuzz", target=self.target, module_error=self.module_error,
               max_examples=self.max_examples, tried=self.tried, scale=SCALE,
               outcomes=dict(sorted(self.outcomes.items())),
               distinct_reasons=len(self.reasons))


def record(kind: str, **fields: Any) -> None:
    """Append ``{"kind": kind, **fields}`` as one JSON line to ``$KVC_RELIABILITY_RECORD``
    (nothing when it is not set)."""
    path = os.environ.get("KVC_RELIABILITY_RECORD")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")


def _mask(message: str) -> str:
    """An error message with numbers and quoted values masked, cut to 60 characters."""
    message = re.sub(r"'[^']*'|\"[^\"]*\"|b'[^']*'", "Q", message)
    return re.sub(r"-?\d+", "N", message)[:60]


def vmm_footprint() -> tuple[int, int]:
    """(mapped memfd chunks, PROT_NONE reservations of 2 MiB or more) in this process."""
    chunks = reserved = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:kvconnect-chunk" in line:
                chunks += 1
            fields = line.split()
            if len(fields) == 5 and fields[1] == "---p":
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                reserved += hi - lo >= _G
    return chunks, reserved


def open_fds() -> set[str]:
    """Names in /proc/self/fd (the fds this process holds)."""
    return set(os.listdir("/proc/self/fd"))


# -- strategies ----------------------------------------------------------------------------

#: values a peer might put where a number, string or list is expected
evil_scalars = st.one_of(
    st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([0, -1, 1, _G, _G - 1, 1 << 31, 1 << 46, 1 << 47, 1 << 62, (1 << 63) - 1,
                     1 << 63, 1 << 64,
                     (1 << 64) + _G, 10 ** 39, -(10 ** 39)]),
    st.booleans(), st.none(), st.floats(allow_nan=True), st.text(max_size=12),
    st.just("x" * 5000),
)
evil_values = st.one_of(
    evil_scalars,
    st.lists(evil_scalars, max_size=4),
    st.dictionaries(st.text(max_size=6), evil_scalars, max_size=3),
    st.integers(1, 120).map(lambda n: json.loads("[" * n + "]" * n)),
)


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys/indexes) to a value inside ``doc``."""
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated(draw: st.DrawFn, base: Any, max_mutations: int = 3) -> Any:
    """``base`` (a JSON value) with 1..max_mutations fields replaced, deleted or added."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, max_mutations))):
        paths = _paths(doc)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add"]))
        if action == "replace":
            parent[key] = draw(evil_values)
        elif action == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=6))] = draw(evil_values)
        else:
            parent.append(draw(evil_values))
    return doc
