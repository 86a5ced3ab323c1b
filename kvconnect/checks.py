"""Checks shared by every layer: integers and rounding, and whether a directory takes new
files (torch-free, imports nothing of kvconnect).

Every size, offset and count that reaches a driver call or comes from a peer passes
:func:`checked_int` first, so that nothing is truncated silently at the ctypes boundary
(``ctypes.c_size_t`` keeps the low 64 bits of ``1 << 70``) and nothing of the wrong type
(``True``, ``1.5``, ``"8"``) is taken as a number.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["MAX_BYTES", "check_can_create_file", "checked_int", "round_up"]

#: largest size or offset in bytes that round-trips through every platform call we make:
#: ``ssize_t``/``off_t`` (mmap lengths and offsets, cuMemAddressReserve sizes) on 64-bit Linux
MAX_BYTES = sys.maxsize


def checked_int(what: str, value: object, *, minimum: int = 1, maximum: int = MAX_BYTES) -> int:
    """``value`` if it is an ``int`` (not a ``bool``) in ``[minimum, maximum]``.

    The one validator for sizes, offsets and counts; raises ``ValueError`` naming ``what``,
    the value and the allowed range (callers that face a peer turn it into their own error).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an int, got {type(value).__name__} {value!r:.60}")
    if value < minimum:
        word = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{what} must be {word}, got {value}")
    if value > maximum:
        limit = "the platform's limit 2**63-1" if maximum == MAX_BYTES else str(maximum)
        raise ValueError(f"{what} = {value} exceeds {limit}")
    return value


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (which must be positive)."""
    checked_int("round_up multiple", multiple)
    return -(-value // multiple) * multiple


def check_can_create_file(directory: str) -> None:
    """Create and remove a temporary file in ``directory``: what writing a file there the
    safe way (a temporary file beside it, renamed into place) needs. Raises the ``OSError``
    when it cannot (callers word it as their own error before any work starts)."""
    fd, probe = tempfile.mkstemp(prefix=".kvconnect-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)
