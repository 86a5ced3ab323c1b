"""Sharing ExtensibleTensors between processes on one host: export their chunks as fds,
map a peer's chunks with the peer's layout (:class:`PeerMapping`).

The wire format (frames, fds in batches, error frames, bounds) lives in the torch-free
:mod:`kvconnect.framing`; import its names from there.

Export message (one JSON object plus one fd per chunk, same order)::

    {"op": "chunks",
     "tensors": [{"capacity_bytes": int, "segment_capacity": int}, ...],
     "chunks":  [{"tensor": int, "segment": int, "offset": int, "size": int}, ...]}

:func:`export_message` builds it, :func:`import_message` validates every field (a peer's
malformed record raises :class:`IpcError`, never ``KeyError``/``TypeError``/``VmmError``) and
maps it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .bounded_json import JSON, JSONObject, json_int, json_list
from .checks import checked_int
from .errors import KvconnectError
from .framing import IpcError
from .lifetime import ClosesOnExit
from .mapped_memory import MappedMemory
from .undo import UndoStack
from .vmm import AllocationOptions, Reservation, VmmDriver, VmmError

if TYPE_CHECKING:
    from .tensor import ExtensibleTensor

__all__ = ["PeerMapping", "export_message", "import_message"]

#: most tensors one export message may describe
MAX_EXPORTED_TENSORS = 1 << 16


def _peer_chunk(index: int, rec: JSON, capacity_bytes: int, segment_capacity: int,
                granularity: int) -> tuple[int, int]:
    """``(start, size)`` in reservation bytes of a peer's chunk record, or IpcError."""
    if not isinstance(rec, dict):
        raise IpcError(f"chunk record {index} is a {type(rec).__name__}, not an object")
    missing = {"segment", "offset", "size"} - rec.keys()
    if missing:
        raise IpcError(f"chunk record {index} lacks {sorted(missing)}")
    what = f"peer's chunk {index}"
    seg = json_int(f"{what} segment", rec["segment"], IpcError, 0,
                   capacity_bytes // segment_capacity - 1)
    off = json_int(f"{what} offset", rec["offset"], IpcError, 0, segment_capacity - 1)
    size = json_int(f"{what} size", rec["size"], IpcError, 1, segment_capacity - off)
    if off % granularity or size % granularity:
        raise IpcError(f"chunk record {index} (offset {off}, size {size}) is not aligned to the "
                       f"{granularity}-byte granularity")
    return seg * segment_capacity + off, size


class PeerMapping(ClosesOnExit):
    """A peer's exported chunks mapped into a local reservation with the peer's layout.

    Byte ``x`` of the peer's reservation appears at ``base_ptr + x``, so a peer address
    ``a`` translates to ``base_ptr + (a - peer_base_ptr)``. Owns its reservation and
    imported handles; :meth:`close` releases them (idempotent), as does garbage collection
    and interpreter exit (a finalizer, ordered before the reservation's). Views from
    :meth:`view` hold the reservation: after :meth:`close` the addresses stay reserved until
    the last view is gone, so a stale view faults instead of reaching a later mapping.
    """

    def __init__(self, driver: VmmDriver, capacity_bytes: int, segment_capacity: int,
                 access_devices: Sequence[int] = ()) -> None:
        self.driver = driver
        self.access_devices = tuple(checked_int("access device", d, minimum=0, maximum=1 << 16)
                                    for d in access_devices)
        self.capacity_bytes = checked_int("capacity_bytes", capacity_bytes)
        self.segment_capacity = checked_int("segment_capacity", segment_capacity,
                                            maximum=capacity_bytes)
        reservation = Reservation(driver, capacity_bytes)
        self.base_ptr = reservation.va
        # Created after the reservation's, this finalizer runs first at interpreter exit
        # (newest first): chunks are unmapped before the VA is freed (issue 27: CUDA refuses
        # the other order). The one list of chunks holds every segment's.
        self._state = MappedMemory(driver, reservation, [[]])
        self._finalizer = weakref.finalize(self, MappedMemory.close, self._state)

    @classmethod
    def import_chunks(
        cls,
        driver: VmmDriver,
        capacity_bytes: int,
        segment_capacity: int,
        chunks: Sequence[JSON],
        fds: Sequence[int],
        access_devices: Sequence[int] = (),
    ) -> PeerMapping:
        """Map chunks described as ``{"segment", "offset", "size"}`` (one fd each, same order).

        Every value may come from a peer: each is checked (an int in range, chunks inside
        their segment and the reservation, aligned, not overlapping) before anything is
        reserved, and any violation, or an fd that cannot be imported as the size its record
        claims, raises :class:`IpcError`. ``access_devices`` are peer GPUs that also get
        access (e.g. the exporter's device, so copies driven from either side work). On any
        failure nothing stays mapped. The fds remain owned by the caller.
        """
        capacity_bytes = json_int("peer's capacity_bytes", capacity_bytes, IpcError, 1)
        segment_capacity = json_int("peer's segment_capacity", segment_capacity, IpcError, 1,
                                    capacity_bytes)
        if capacity_bytes % segment_capacity:
            raise IpcError(f"bad peer geometry: capacity {capacity_bytes} bytes is not a "
                           f"whole number of {segment_capacity}-byte segments")
        chunks = json_list("chunk records", chunks, IpcError)
        if len(chunks) != len(fds):
            raise IpcError(f"{len(chunks)} chunk records but {len(fds)} fds")
        granularity = driver.granularity(AllocationOptions(shareable=True))
        if capacity_bytes % granularity or segment_capacity % granularity:
            raise IpcError(f"bad peer geometry: capacity {capacity_bytes} and segment "
                           f"{segment_capacity} bytes must be multiples of {granularity}")
        spans = [_peer_chunk(i, rec, capacity_bytes, segment_capacity, granularity)
                 for i, rec in enumerate(chunks)]
        ordered = sorted(spans)
        for (a, a_size), (b, _) in zip(ordered, ordered[1:], strict=False):
            if a + a_size > b:
                raise IpcError(f"peer chunks overlap: [{a}, {a + a_size}) and one at {b}")
        try:
            mapping = cls(driver, capacity_bytes, segment_capacity, access_devices)
        except (VmmError, OSError, ValueError) as exc:
            raise IpcError(f"cannot reserve the peer's capacity of {capacity_bytes} bytes "
                           f"here: {exc}") from exc
        with UndoStack() as undo:
            undo.push(mapping.close)
            for i, ((start, size), fd) in enumerate(zip(spans, fds, strict=True)):
                mapping._map(i, start, size, fd)
        return mapping

    def _map(self, index: int, offset: int, size: int, fd: int) -> None:
        try:
            handle = self.driver.import_fd(fd, size)
        except (KvconnectError, ValueError, OSError) as exc:  # VmmError among ours
            raise IpcError(f"chunk {index}: the peer's fd cannot be imported as {size} bytes: "
                           f"{exc}") from exc
        va = self.base_ptr + offset
        self._state.chunks[0].append(self._state.map(va, size, handle, self.access_devices))

    @property
    def live_views(self) -> int:
        """Views from :meth:`view` (and tensors derived from them) still referenced."""
        return len(self._state.views)

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """uint8 tensor of ``nbytes`` at reservation offset ``offset``; must lie in imported
        chunks that follow each other without a gap (one chunk, or a segment grown by
        several: the addresses are contiguous, copies read through them)."""
        state = self._state
        if state.closed:
            raise RuntimeError("PeerMapping used after close()")
        checked_int("view offset in bytes", offset, minimum=0, maximum=self.capacity_bytes)
        checked_int("view size in bytes", nbytes, maximum=self.capacity_bytes)
        addr = self.base_ptr + offset
        reach = addr
        for c in sorted(state.chunks[0], key=lambda c: c.va):
            if c.va <= reach < c.va + c.size:
                reach = c.va + c.size
                if addr + nbytes <= reach:
                    return state.view(self, addr, nbytes)
        raise ValueError(f"range [{offset}, {offset + nbytes}) is not inside one imported chunk "
                         f"or a run of adjacent ones")

    def close(self) -> None:
        """Unmap and release the imported chunks and free the reservation (idempotent); the
        reservation outlives this call while views are referenced (they then fault)."""
        self._finalizer()


# -- the export message ----------------------------------------------------------------------
def export_message(tensors: Sequence[ExtensibleTensor]) -> tuple[JSONObject, list[int]]:
    """The export message for ``tensors`` (ExtensibleTensors created shareable) and its fds,
    one per chunk in record order. The caller owns the fds (close them after sending); on
    failure none stays open."""
    records: list[dict[str, int]] = []
    fds: list[int] = []
    with UndoStack() as undo:
        for ti, t in enumerate(tensors):
            for ch in t.export_handles():
                undo.push(os.close, ch.fd)
                fds.append(ch.fd)
                records.append({"tensor": ti, "segment": ch.segment, "offset": ch.offset,
                                "size": ch.size})
    info = [{"capacity_bytes": t.capacity_bytes, "segment_capacity": t.segment_capacity}
            for t in tensors]
    return {"op": "chunks", "tensors": info, "chunks": records}, fds


def import_message(driver: VmmDriver, message: JSON, fds: Sequence[int],
                   access_devices: Sequence[int] = ()) -> list[PeerMapping]:
    """Map every tensor of a peer's export message (one :class:`PeerMapping` each, in the
    peer's tensor order). Every field is validated; anything malformed raises
    :class:`IpcError` and nothing stays mapped. The fds remain owned by the caller; the
    returned mappings are the caller's to close."""
    if not isinstance(message, dict) or message.get("op") != "chunks":
        raise IpcError("malformed export message: expected an object with op 'chunks'")
    tensors, chunks = message.get("tensors"), message.get("chunks")
    if not isinstance(tensors, list) or not isinstance(chunks, list):
        raise IpcError("malformed export message: 'tensors' and 'chunks' must be lists")
    json_list("export message tensors", tensors, IpcError, MAX_EXPORTED_TENSORS)
    if len(chunks) != len(fds):
        raise IpcError(f"export message has {len(chunks)} chunk records but {len(fds)} fds")
    if chunks and not tensors:
        raise IpcError(f"export message has {len(chunks)} chunk records but no tensors")
    per_tensor: list[tuple[list[JSON], list[int]]] = [([], []) for _ in tensors]
    for i, (rec, fd) in enumerate(zip(chunks, fds, strict=True)):
        if not isinstance(rec, dict) or "tensor" not in rec:
            raise IpcError(f"chunk record {i} is not an object with a 'tensor' field")
        ti = json_int(f"peer's chunk {i} tensor index", rec["tensor"], IpcError, 0,
                      len(tensors) - 1)
        per_tensor[ti][0].append(rec)
        per_tensor[ti][1].append(fd)
    mappings: list[PeerMapping] = []
    with UndoStack() as undo:
        for ti, (info, (recs, tfds)) in enumerate(zip(tensors, per_tensor, strict=True)):
            if not isinstance(info, dict) or not {"capacity_bytes", "segment_capacity"} <= \
                    info.keys():
                raise IpcError(f"tensor {ti} must be an object with capacity_bytes and "
                               "segment_capacity")
            m = PeerMapping.import_chunks(driver, info["capacity_bytes"],
                                          info["segment_capacity"], recs, tfds, access_devices)
            undo.push(m.close)
            mappings.append(m)
    return mappings
