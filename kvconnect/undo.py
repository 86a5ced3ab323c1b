"""UndoStack: roll back the steps of a multi-step operation that failed part-way.

Push an undo callback after each step succeeds; leaving the ``with`` block through an
exception runs the callbacks newest first, leaving it normally forgets them::

    with UndoStack() as undo:
        h = driver.create(size)
        undo.push(driver.release, h)
        driver.map(va, size, h)
        undo.push(driver.unmap, va, size)
        driver.set_access(va, size)      # fails -> unmap, then release

A failing undo callback is logged and the next one still runs; the caller sees the original
exception, never one raised while undoing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ParamSpec

P = ParamSpec("P")

logger = logging.getLogger(__name__)

__all__ = ["UndoStack"]


class UndoStack:
    """Callbacks that undo the steps done so far; run in reverse on error, dropped on success."""

    def __init__(self) -> None:
        self._steps: list[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = []

    def push(self, undo: Callable[P, object], /, *args: P.args, **kwargs: P.kwargs) -> None:
        """Register ``undo(*args, **kwargs)`` to run if a later step fails."""
        self._steps.append((undo, args, kwargs))

    def __len__(self) -> int:
        return len(self._steps)

    def __enter__(self) -> UndoStack:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        """Success: forget every callback. An exception: run them newest first, then forget
        them. Never raises: an undo that fails is logged with its traceback and the remaining
        ones still run."""
        if exc_type is None:
            self._steps.clear()
        while self._steps:
            undo, args, kwargs = self._steps.pop()
            try:
                undo(*args, **kwargs)
            except Exception:
                logger.exception("rollback step %s failed; continuing with the rest",
                                 getattr(undo, "__qualname__", undo))
