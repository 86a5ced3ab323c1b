"""One verb for "release what you own": ``close()``, idempotent, and ``with`` everywhere
(:class:`ClosesOnExit`: ``with`` closes on the way out).

:class:`Closeable` gives a class that owns memory with views over it the shared surface:
``close(force=False)`` (the class implements it, refusing with :class:`LiveViewsError`
while views are referenced unless ``force``), ``with`` blocks that close with ``force=True``
(raising on the way out would hide the exception leaving the block).
"""

from __future__ import annotations

from typing import TypeVar

from .errors import KvconnectError

__all__ = ["Closeable", "ClosesOnExit", "LiveViewsError"]

C = TypeVar("C", bound="ClosesOnExit")


class LiveViewsError(KvconnectError, RuntimeError):
    """``close()`` refused: ``live_views`` views of the memory are still referenced."""

    def __init__(self, owner: str, live_views: int, which: str) -> None:
        super().__init__(
            f"close() refused: {live_views} view(s) of this {owner} are still referenced "
            f"({which} results, or tensors derived from them); drop them first, or "
            "close(force=True) to release the memory now and keep the addresses reserved "
            "until the views are gone")
        self.live_views = live_views


class ClosesOnExit:
    """Mixin: ``with`` on top of the subclass's ``close()``, called on the way out."""

    def close(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Closeable(ClosesOnExit):
    """Mixin: ``with`` on top of the subclass's ``close(*, force)``."""

    def close(self, *, force: bool = False) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def __exit__(self, *exc: object) -> None:
        """Leaving the block releases unconditionally (``close(force=True)``)."""
        self.close(force=True)
