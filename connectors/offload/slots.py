"""LRU slots of a fixed-size pool, keyed by any hashable key.

:class:`LruSlots` hands out slots ``0..num_slots-1``: free slots lowest first (so a fresh
pool fills in order and batches form runs of consecutive slots), then the least recently
used keys' slots. It only does the bookkeeping; moving bytes is the caller's job. A batch is
*reserved* (slots chosen, evictions listed, nothing changed yet) and then either
*committed* or *abandoned*, so a failed copy leaves the pool as it was before the batch,
minus the evicted keys, whose slots may already have been overwritten.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvconnect.checks import checked_int

__all__ = ["LruSlots", "SlotReservation"]


@dataclass(frozen=True)
class SlotReservation:
    """Slots chosen for one batch: ``slots[i]`` for ``keys[i]``; ``evicted`` keys (oldest
    first) gave up their slots; ``new`` keys were not in the pool before."""

    keys: tuple[Hashable, ...]
    slots: tuple[int, ...]
    evicted: tuple[Hashable, ...]
    new: tuple[Hashable, ...]


class LruSlots:
    """Slot bookkeeping for ``num_slots`` slots (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = checked_int("num_slots", num_slots)
        self._lru: OrderedDict[Hashable, int] = OrderedDict()
        self._free: list[int] = list(range(num_slots))  # a heap (sorted = valid)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, key: Hashable) -> int | None:
        return self._lru.get(key)

    def keys(self) -> list[Hashable]:
        """Keys, least recently used first (the eviction order)."""
        return list(self._lru)

    def lookup(self, keys: Sequence[Hashable]) -> tuple[list[int], list[Hashable]]:
        """``(slots of the present keys, missing keys)``; changes nothing."""
        missing = [k for k in keys if k not in self._lru]
        return [self._lru[k] for k in keys if k in self._lru], missing

    def reserve(self, keys: Sequence[Hashable]) -> SlotReservation:
        """Choose slots for ``keys`` (distinct): present keys keep theirs, new keys take free
        slots, then slots of the least recently used keys outside the batch, which are
        forgotten now. ``ValueError`` when the batch is larger than the pool."""
        if len(keys) > self.num_slots:
            raise ValueError(f"cannot save {len(keys)} blocks into a CPU pool of "
                             f"{self.num_slots} slots: split the batch or grow the pool")
        new = [k for k in keys if k not in self._lru]
        evicted: list[Hashable] = []
        shortfall = len(new) - len(self._free)
        if shortfall > 0:
            batch = set(keys)
            for k in self._lru:
                if len(evicted) == shortfall:
                    break
                if k not in batch:
                    evicted.append(k)
            for k in evicted:
                heapq.heappush(self._free, self._lru.pop(k))
        chosen = {k: heapq.heappop(self._free) for k in new}
        slots = tuple(chosen[k] if k in chosen else self._lru[k] for k in keys)
        return SlotReservation(tuple(keys), slots, tuple(evicted), tuple(new))

    def commit(self, r: SlotReservation) -> None:
        """Record the batch's keys in their slots, most recently used."""
        for k, s in zip(r.keys, r.slots, strict=True):
            self._lru[k] = s
            self._lru.move_to_end(k)

    def abandon(self, r: SlotReservation) -> None:
        """The batch's copy failed: its keys (new or overwritten) leave the pool."""
        for k, s in zip(r.keys, r.slots, strict=True):
            self._lru.pop(k, None)
            heapq.heappush(self._free, s)

    def touch(self, keys: Iterable[Hashable]) -> None:
        """Mark present keys most recently used."""
        for k in keys:
            self._lru.move_to_end(k)

    def discard(self, keys: Iterable[Hashable]) -> list[Hashable]:
        """Forget ``keys`` and free their slots; returns the keys that were present."""
        gone = []
        for k in keys:
            slot = self._lru.pop(k, None)
            if slot is not None:
                heapq.heappush(self._free, slot)
                gone.append(k)
        return gone

    def clear(self) -> None:
        self._lru.clear()
        self._free = list(range(self.num_slots))
