"""Checks shared by every layer: integers and rounding, numbers and durations typed by a
user, and whether a directory takes new files (torch-free, imports nothing of kvconnect).

Every size, offset and count that reaches a driver call or comes from a peer passes
:func:`checked_int` first, so that nothing is truncated silently at the ctypes boundary
(``ctypes.c_size_t`` keeps the low 64 bits of ``1 << 70``) and nothing of the wrong type
(``True``, ``1.5``, ``"8"``) is taken as a number.

Numbers a user types (command lines, environment variables, JSON settings) pass
:func:`parse_whole_number`, :func:`checked_positive` or :func:`checked_seconds`: ASCII
digits only (Python's ``int``
and ``float`` also take Arabic-Indic and full-width digits, ``+``, surrounding Unicode
spaces, ``inf`` and ``nan``), and an upper bound, so that a value no later call can hold
(``settimeout(inf)``, a deadline of 1e300 s) is refused where it is parsed, naming the
setting and the accepted form.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["MAX_BYTES", "MAX_SECONDS", "check_can_create_file", "checked_int",
           "checked_positive", "checked_seconds", "option_type", "parse_whole_number",
           "round_up"]

#: largest size or offset in bytes that round-trips through every platform call we make:
#: ``ssize_t``/``off_t`` (mmap lengths and offsets, cuMemAddressReserve sizes) on 64-bit Linux
MAX_BYTES = sys.maxsize
#: longest duration any kvconnect timeout takes, in seconds (one day): far above any wait a
#: run or a transfer needs, far below what sockets, clocks and datetimes can hold
MAX_SECONDS = 86400.0

#: a whole number as users type it: ASCII digits, underscores only between digits
_WHOLE = re.compile(r"-?[0-9]+(?:_[0-9]+)*")
#: a decimal number as users type it: ASCII digits, optional fraction and exponent
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE = " \t\r\n"
_T = TypeVar("_T")


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


def parse_whole_number(what: str, text: str, *, minimum: int = 1,
                       maximum: int = MAX_BYTES) -> int:
    """``text`` as an int in ``[minimum, maximum]``: ASCII digits with an optional leading
    ``-``, underscores only between digits (``8_589_934_592``), surrounding ASCII spaces
    ignored. Raises ``ValueError`` naming ``what``, the text, the accepted form and range
    (callers turn it into their own error)."""
    form = (f"{what} must be a whole number from {minimum} to {maximum} (ASCII digits, "
            f"underscores only between digits)")
    if not isinstance(text, str):
        raise ValueError(f"{form}, got {type(text).__name__} {text!r:.60}")
    digits = text.strip(_ASCII_SPACE)
    if _WHOLE.fullmatch(digits) is None:
        raise ValueError(f"{form}, got {text!r:.60}")
    digits = digits.replace("_", "")
    # more digits than either bound has: out of range, decided without a huge int()
    if len(digits.lstrip("-").lstrip("0")) > max(len(str(abs(minimum))), len(str(maximum))):
        raise ValueError(f"{form}, got {text!r:.60}")
    value = int(digits)
    if not minimum <= value <= maximum:
        raise ValueError(f"{form}, got {value}")
    return value


def checked_positive(what: str, value: object, *, maximum: float, unit: str = "") -> float:
    """``value`` as a number above 0 and at most ``maximum``: an ``int`` (not a ``bool``), a
    ``float``, or text of ASCII digits (``10``, ``2.5``, ``1e3``; surrounding ASCII spaces
    ignored). Raises ``ValueError`` naming ``what`` (and ``unit``, e.g. ``"seconds: "``),
    the value and the accepted form (``inf``, ``nan``, non-ASCII digits and values past
    ``maximum`` are refused)."""
    form = (f"{what} must be {unit}a number above 0 and at most {maximum:g} (ASCII digits, "
            f"e.g. 10 or 2.5)")
    if isinstance(value, str):
        text = value.strip(_ASCII_SPACE)
        if len(text) > 64 or _DECIMAL.fullmatch(text) is None:
            raise ValueError(f"{form}, got {value!r:.60}")
        number = float(text)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            raise ValueError(f"{form}, got {value!r:.60}") from None
    else:
        raise ValueError(f"{form}, got {type(value).__name__} {value!r:.60}")
    if not math.isfinite(number) or not 0 < number <= maximum:
        raise ValueError(f"{form}, got {value!r:.60}")
    return number


def checked_seconds(what: str, value: object, *, maximum: float = MAX_SECONDS) -> float:
    """``value`` as a duration in seconds, above 0 and at most ``maximum`` (default
    :data:`MAX_SECONDS`), by the rules of :func:`checked_positive`."""
    return checked_positive(what, value, maximum=maximum, unit="seconds: ")


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


def option_type(parse: Callable[..., _T], *args: Any, **kwargs: Any) -> Callable[[str], _T]:
    """An argparse ``type`` (both CLIs) from a checker called as ``parse(text, *args,
    **kwargs)``: its ``ValueError`` (:class:`~kvconnect.errors.OptionError` included)
    becomes argparse's usage error (exit 2), with the checker's message."""
    def parse_arg(text: str) -> _T:
        try:
            return parse(text, *args, **kwargs)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse_arg.__name__ = getattr(parse, "__name__", "value").removeprefix("parse_")
    return parse_arg
