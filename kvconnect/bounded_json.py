"""JSON from another process, decoded with bounded nesting and bounded integers.

``json.loads`` recurses once per nesting level (about 1000 levels raise ``RecursionError``)
and refuses integers over 4300 digits with ``ValueError`` (after quadratic work). Peers get
neither: :func:`loads` measures the bracket depth on the raw text before parsing (in time
linear in the text, whatever it holds), rejects long digit runs while parsing, refuses
strings that are not valid Unicode (a lone surrogate such as ``"\\ud800"``, which no UTF-8
text can hold), and raises only :class:`BoundedJSONError` (a ``ValueError``) for anything
malformed, which callers turn into their own error type.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeAlias

from .errors import KvconnectError

__all__ = ["DEFAULT_MAX_DEPTH", "DEFAULT_MAX_INT_DIGITS", "JSON", "BoundedJSONError",
           "JSONObject", "loads"]

#: a decoded JSON value (object, array, string, number, bool or null): what crosses a process
#: boundary, read field by field and checked by whoever reads it. An alias of ``Any`` that says
#: so; :data:`JSONObject` is a JSON object.
JSON: TypeAlias = Any
JSONObject: TypeAlias = "dict[str, JSON]"

#: deepest nesting of arrays/objects accepted by default (wire messages use fewer than 8)
DEFAULT_MAX_DEPTH = 64
#: most digits of one integer accepted by default (2**128 has 39)
DEFAULT_MAX_INT_DIGITS = 40

_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
#: up to this many brackets the depth scan is a Python loop; above, numpy
_PYTHON_SCAN_LIMIT = 1 << 16
#: a \uD800-\uDFFF escape (or an escaped backslash followed by such text: the decoded
#: strings decide) or a surrogate in the text itself: then the decoded strings are checked
_SURROGATE_HINT = re.compile(r"\\u[dD][89abcdefABCDEF]|[\ud800-\udfff]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BoundedJSONError(KvconnectError, ValueError):
    """Not JSON (or not valid Unicode), nested too deeply, or an integer with too many
    digits."""


def nesting_depth(text: str, max_depth: int = DEFAULT_MAX_DEPTH) -> int:
    """Nesting depth of ``[``/``{`` outside strings; raises :class:`BoundedJSONError` past
    ``max_depth`` or on unbalanced brackets. An unterminated string runs to the end of the
    text; a backslash escapes a quote or backslash after it wherever it stands (outside a
    string it is invalid JSON, which the parser refuses there: the depth up to that point is
    exact).

    Linear in the text whatever a peer sends (16 MiB in well under a second), by C-speed
    passes that never backtrack: escaped backslashes dropped (``str.replace`` pairs them from
    the left, as JSON does), then escaped quotes; every quote left opens or closes a string,
    so splitting on quotes and keeping the even pieces drops the strings; a regular
    expression of one character class drops everything but brackets. The running depth is
    then a prefix sum (a Python loop for short inputs, numpy's ``cumsum`` beyond
    :data:`_PYTHON_SCAN_LIMIT` brackets: 16 MiB of brackets take about 0.3 s). Issue 23: a
    regular expression for strings rescanned to the end from every quote of an unterminated
    string of escaped quotes, and took 28 s for 64 KB."""
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    brackets = _NOT_BRACKET.sub("", "".join(unescaped.split('"')[::2]))
    if len(brackets) <= _PYTHON_SCAN_LIMIT:
        depth = deepest = 0
        for ch in brackets:
            depth += 1 if ch in "[{" else -1
            if depth < 0:
                break
            if depth > deepest:
                deepest = depth
                if deepest > max_depth:
                    break
        final, lowest = depth, min(depth, 0)
    else:
        import numpy as np  # a declared dependency; only loaded for large messages

        step = np.zeros(256, dtype=np.int8)  # +1 opens, -1 closes, indexed by byte
        step[[ord("["), ord("{")]] = 1
        step[[ord("]"), ord("}")]] = -1
        steps = step[np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)]
        running = np.cumsum(steps, dtype=np.int64)
        deepest, lowest, final = int(running.max()), int(running.min()), int(running[-1])
    if deepest > max_depth:
        raise BoundedJSONError(f"JSON nested deeper than {max_depth} levels")
    if lowest < 0 or final != 0:
        raise BoundedJSONError("JSON brackets are unbalanced")
    return deepest


def loads(data: str | bytes | bytearray, *, max_depth: int = DEFAULT_MAX_DEPTH,
          max_int_digits: int = DEFAULT_MAX_INT_DIGITS) -> JSON:
    """Decode one JSON document (``bytes`` must be UTF-8) within the bounds.

    Raises :class:`BoundedJSONError` for invalid UTF-8 or JSON, nesting deeper than
    ``max_depth`` and integers longer than ``max_int_digits`` digits; nothing else.
    """
    if isinstance(data, (bytes, bytearray)):
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BoundedJSONError(f"not UTF-8: {exc}") from None
    elif isinstance(data, str):
        text = data
    else:
        raise BoundedJSONError(f"expected str or bytes, got {type(data).__name__}")
    nesting_depth(text, max_depth)

    def parse_int(digits: str) -> int:
        if len(digits) - digits.startswith("-") > max_int_digits:
            raise BoundedJSONError(f"JSON integer of {len(digits)} characters exceeds the "
                                   f"{max_int_digits}-digit limit")
        return int(digits)

    try:
        value = json.loads(text, parse_int=parse_int)
    except BoundedJSONError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise BoundedJSONError(f"invalid JSON: {exc}") from None
    if _SURROGATE_HINT.search(text):
        _refuse_lone_surrogates(value)
    return value


def _refuse_lone_surrogates(value: JSON) -> None:
    """Raise :class:`BoundedJSONError` when a string (or key) of the decoded ``value`` holds
    a surrogate code point: an escape json.loads could not pair (``"\\ud800"``), which
    would later fail to encode as UTF-8 (``UnicodeEncodeError``) wherever it went."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            found = _SURROGATE.search(v)
            if found:
                raise BoundedJSONError(
                    f"JSON string holds the lone surrogate \\u{ord(found.group()):04x} (not "
                    "valid Unicode: a \\ud800-\\udbff escape must be followed by a "
                    "\\udc00-\\udfff one)")
        elif isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
