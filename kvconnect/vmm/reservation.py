"""Reservation: one range of virtual address space, freed exactly once.

Freed by :meth:`Reservation.release`, or when the last reference to the object goes (a
``weakref.finalize``). Views over the range hold a reference, so an owner that must let go
while views are still referenced can drop its own reference instead: the addresses then stay
reserved (touching them faults) until the last view is gone, and no later allocation can be
mapped where a stale view points.
"""

from __future__ import annotations

import logging
import weakref

from ..checks import checked_int
from .base import VmmDriver, VmmError

logger = logging.getLogger(__name__)

__all__ = ["Reservation"]

#: driver statuses saying the context (or the driver) is gone, as at the very end of a
#: process: the VA went with it, there is nothing left to free or to report
CONTEXT_GONE = frozenset({"CUDA_ERROR_DEINITIALIZED", "CUDA_ERROR_CONTEXT_IS_DESTROYED",
                          "hipErrorDeinitialized", "hipErrorContextIsDestroyed"})


def _free_at_collection(driver: VmmDriver, va: int, size: int) -> None:
    try:
        driver.free_reserved(va, size)
    except Exception as exc:  # a finalizer must not raise; say what leaked
        if isinstance(exc, VmmError) and exc.code in CONTEXT_GONE:
            logger.debug("reservation of %d bytes at %#x on %s: the driver context is gone "
                         "(%s); the process returns the VA", size, va, driver, exc.code)
            return
        logger.exception("could not free the reservation of %d bytes at %#x on %s", size, va,
                         driver)


class Reservation:
    """``size`` bytes of VA reserved on ``driver`` (cuMemAddressReserve / mmap PROT_NONE),
    aligned to ``alignment`` bytes (0: the driver's granularity). ``va`` is the base."""

    def __init__(self, driver: VmmDriver, size: int, alignment: int = 0) -> None:
        self.size = checked_int("reservation size in bytes", size)
        checked_int("reservation alignment in bytes", alignment, minimum=0)
        self.driver = driver
        driver.ensure_context()
        self.va = driver.reserve(size, alignment)
        self._finalizer = weakref.finalize(self, _free_at_collection, driver, self.va, size)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    def release(self) -> None:
        """Free the range now (idempotent). Everything mapped in it must be unmapped."""
        if self._finalizer.detach() is not None:
            self.driver.free_reserved(self.va, self.size)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Reservation {self.size} bytes at {self.va:#x} on {self.driver}, {state}>"
