"""Physical memory mapped into a reserved range, and what its owner must release.

:class:`MappedMemory` is the state an owner of mapped memory (an
:class:`~kvconnect.tensor.ExtensibleTensor`, a :class:`~kvconnect.ipc.PeerMapping`) hands to
its finalizer: the chunks mapped, the views handed out over them, the reservation. Closing
unmaps the chunks and frees the reservation, unless a view still holds it (it then goes with
the last view, so a stale view faults instead of reaching a later mapping).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._pointer_view import ViewAnchor, pointer_view
from .undo import UndoStack
from .vmm import PhysicalHandle, Reservation, VmmDriver


@dataclass
class MappedChunk:
    """One physical allocation mapped at ``va`` (bytes)."""

    va: int
    size: int
    handle: PhysicalHandle


@dataclass
class MappedMemory:
    """The chunks mapped into ``reservation`` (one list per segment, in mapping order) and
    the anchors of the views still referenced (each also holds the reservation)."""

    driver: VmmDriver
    reservation: Reservation | None
    chunks: list[list[MappedChunk]]
    views: weakref.WeakSet[ViewAnchor] = field(default_factory=weakref.WeakSet)
    closed: bool = False

    def map(self, va: int, size: int, handle: PhysicalHandle,
            access_devices: Sequence[int] | None = None) -> MappedChunk:
        """Map ``handle`` at ``va`` with read/write access (and for ``access_devices``). On
        failure nothing stays mapped and the handle is released. The caller files the chunk."""
        with UndoStack() as undo:
            undo.push(self.driver.release, handle)
            self.driver.map(va, size, handle)
            undo.push(self.driver.unmap, va, size)
            self.driver.set_access(va, size, access_devices)
        return MappedChunk(va, size, handle)

    def view(self, owner: object, ptr: int, nbytes: int) -> torch.Tensor:
        """A tracked view: it keeps ``owner`` and the reservation alive, and counts in
        :attr:`views` while it (or a tensor derived from it) is referenced."""
        return pointer_view(ptr, nbytes, self.driver, (owner, self.reservation), self.views)

    def unmap_all(self) -> None:
        """Synchronize, then unmap and release every chunk (the reservation stays)."""
        if any(self.chunks):
            self.driver.synchronize()
        for seg in self.chunks:
            while seg:
                m = seg.pop()
                self.driver.unmap_and_release(m.va, m.size, m.handle)

    def close(self) -> None:
        """Unmap and release every chunk; free the reservation now unless a view still
        holds it (then it goes with the last view). Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self.unmap_all()
        finally:
            reservation, self.reservation = self.reservation, None
            if reservation is not None and not self.views:
                reservation.release()
