"""Exceptions shared by the kvconnect connectors (NIXL, CPU offload).

All connector failures derive from :class:`KVConnectorError` so callers can catch one type.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvconnect.errors import KvconnectError

__all__ = ["IncompatiblePeerError", "KVConnectorError", "KVTransferError"]


def shown_items(items: Sequence[object], noun: str, limit: int = 16) -> str:
    """``[a, b, ...]`` for a message: the first ``limit`` items (``repr``), then how many
    ``noun`` there are in all when some were left out."""
    head = ", ".join(repr(x) for x in items[:limit])
    return f"[{head}, ... ({len(items)} {noun})]" if len(items) > limit else f"[{head}]"


class KVConnectorError(KvconnectError, RuntimeError):
    """Base class of every error raised by a kvconnect connector."""


class KVTransferError(KVConnectorError):
    """A KV block transfer failed.

    Attributes:
        peer: name (engine id / agent name) of the remote side, or "" when not applicable.
        block_ids: the block ids of the failed transfer (local ids unless the message says otherwise).
        cause: human-readable cause (NIXL state "ERR", an exception text, a timeout, ...).
    """

    def __init__(self, peer: str, block_ids: Iterable[int], cause: str | BaseException) -> None:
        self.peer = str(peer)
        self.block_ids = [int(b) for b in block_ids]
        if isinstance(cause, BaseException):
            cause_text = f"{type(cause).__name__}: {cause}"
        else:
            cause_text = str(cause)
        self.cause = cause_text
        super().__init__(
            f"KV transfer with peer {self.peer!r} failed for blocks "
            f"{shown_items(self.block_ids, 'blocks')}: {self.cause}"
        )

    def __reduce__(self):  # keep the exception picklable inside one process (e.g. pytest)
        return (type(self), (self.peer, self.block_ids, self.cause))


class IncompatiblePeerError(KVConnectorError):
    """The remote peer's KV layout does not match ours; no transfer was attempted.

    Attributes:
        differences: readable differences, e.g.
            "block_len of layer model.layers.0/k: local 4096 != remote 8192".
    """

    def __init__(self, differences: Sequence[str], peer: str = "") -> None:
        self.differences = [str(d) for d in differences]
        self.peer = str(peer)
        who = f" {self.peer!r}" if self.peer else ""
        shown = self.differences[:20]
        more = len(self.differences) - len(shown)
        text = "; ".join(shown) + (f"; ... and {more} more" if more > 0 else "")
        super().__init__(f"peer{who} has an incompatible KV layout: {text}")

    def __reduce__(self):
        return (type(self), (self.differences, self.peer))
