"""Shared by the tests/test_fuzz_*.py files: hypothesis settings and a tally of the inputs
each fuzz target tried, by outcome.

- ``KVC_FUZZ_SCALE`` (default 1): multiplies every target's example count. At 1 the runs
  are derandomized (the same inputs every run: CI never flakes on a new random draw);
  any other value draws fresh random inputs (a deeper run: ``KVC_FUZZ_SCALE=20``).
- ``KVC_FUZZ_COUNTS``: a file to which each target appends one JSON line with what it
  tried (``scripts/reliability_tables.py`` sets it and writes docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

SCALE = float(os.environ.get("KVC_FUZZ_SCALE", "1"))


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
        """Append this target's counts to ``$KVC_FUZZ_COUNTS`` (when set)."""
        path = os.environ.get("KVC_FUZZ_COUNTS")
        if not path:
            return
        line = json.dumps({"target": self.target, "module_error": self.module_error,
                           "max_examples": self.max_examples, "tried": self.tried,
                           "scale": SCALE, "outcomes": dict(sorted(self.outcomes.items())),
                           "distinct_reasons": len(self.reasons)})
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def _mask(message: str) -> str:
    """An error message with numbers and quoted values masked, cut to 60 characters."""
    message = re.sub(r"'[^']*'|\"[^\"]*\"|b'[^']*'", "Q", message)
    return re.sub(r"-?\d+", "N", message)[:60]


def open_fds() -> set[str]:
    """Names in /proc/self/fd (the fds this process holds)."""
    return set(os.listdir("/proc/self/fd"))


def map_count() -> int:
    """Lines of /proc/self/maps (mappings this process holds)."""
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return sum(1 for _ in f)
