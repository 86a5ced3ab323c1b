"""What a CPU offload save or load returns, and the error for keys not in the pool."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from kvconnect.polling import poll_until

from ..errors import KVConnectorError, KVTransferError, shown_items

__all__ = ["PEER_NAME", "OffloadHandle", "OffloadKeyError"]

#: the peer name offload errors carry
PEER_NAME = "cpu-offload"


class OffloadKeyError(KVConnectorError):
    """``load`` asked for keys that are not in the CPU pool (never saved, or evicted)."""

    def __init__(self, missing: Sequence[Hashable]) -> None:
        self.missing = list(missing)
        super().__init__(
            f"{len(self.missing)} key(s) not in the CPU offload pool (never saved or evicted): "
            f"{shown_items(self.missing, 'keys')}; check contains(key) before load()"
        )


@dataclass
class OffloadHandle:
    """One save or load. ``slots[i]`` is the pool slot of ``keys[i]`` / ``block_ids[i]``.

    ``evicted`` lists the keys a save pushed out of the pool to make room (oldest first).
    ``nbytes`` is the payload moved (blocks x bytes per block). On the host backend a handle
    is done when returned.
    """

    op: str
    block_ids: tuple[int, ...]
    keys: tuple[Hashable, ...]
    slots: tuple[int, ...]
    nbytes: int
    evicted: tuple[Hashable, ...] = ()
    _event: Any = None

    def done(self) -> bool:
        """True once the copies have finished (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; with ``timeout_s``, raise :class:`KVTransferError` past it."""
        if self._event is None:
            return
        if timeout_s is None:
            try:
                self._event.synchronize()
            except RuntimeError as exc:
                raise KVTransferError(PEER_NAME, self.block_ids, exc) from exc
            return
        poll_until(self.done, max(0.0, timeout_s), max_pause=1e-2,
                   on_timeout=lambda _s: KVTransferError(
                       PEER_NAME, self.block_ids,
                       f"{self.op} of {len(self.block_ids)} blocks not done after "
                       f"{timeout_s} s"))
