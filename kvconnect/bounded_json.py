"""JSON from another process, decoded with bounded nesting and bounded integers.

``json.loads`` recurses once per nesting level (about 1000 levels raise ``RecursionError``)
and refuses integers over 4300 digits with ``ValueError`` (after quadratic work). Peers get
neither: :func:`loads` measures the bracket depth on the raw text before parsing (in time
linear in the text, whatever it holds), rejects long digit runs while parsing, refuses
strings that are not valid Unicode (a lone surrogate such as ``"\\ud800"``, which no UTF-8
text can hold), and raises only :class:`BoundedJSONError` (a ``ValueError``) for anything
malformed, which callers turn into their own error type.

Schema modules read decoded objects through :class:`Doc` (:func:`load_document` parses to
one), raising their own error class; each protocol declares one ``WIRE_VERSION: int`` and
checks a peer's with :func:`version_mismatch` (:meth:`Doc.check_version` raises).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import EllipsisType
from typing import Any, TypeAlias

from .checks import MAX_BYTES, checked_int
from .errors import KvconnectError

__all__ = ["DEFAULT_MAX_DEPTH", "DEFAULT_MAX_INT_DIGITS", "JSON", "BoundedJSONError",
           "Doc", "JSONObject", "json_int", "json_list", "json_str", "load_document", "loads",
           "version_mismatch"]

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


# -- checked reads of decoded documents ------------------------------------------------------
#: longest string field accepted by default
DEFAULT_MAX_CHARS = 4096


def json_int(what: str, value: JSON, error: type[Exception], minimum: int = 0,
             maximum: int = MAX_BYTES) -> int:
    """``value`` if it is an int (never a bool) in ``[minimum, maximum]``, else ``error``
    naming ``what`` (the messages of :func:`kvconnect.checks.checked_int`)."""
    try:
        return checked_int(what, value, minimum=minimum, maximum=maximum)
    except ValueError as exc:
        raise error(str(exc)) from None


def json_str(what: str, value: JSON, error: type[Exception], max_chars: int = DEFAULT_MAX_CHARS,
             min_chars: int = 0) -> str:
    """``value`` if it is a string of ``min_chars..max_chars`` characters, else ``error``
    naming ``what`` (a string that may not be empty is called a name)."""
    kind = "a name" if min_chars else "a string"
    if not isinstance(value, str):
        raise error(f"{what} must be {kind}, got {type(value).__name__}")
    if not min_chars <= len(value) <= max_chars:
        bounds = f"{min_chars}..{max_chars}" if min_chars else f"at most {max_chars}"
        raise error(f"{what} must be {kind} of {bounds} characters, got {len(value)}")
    return value


def json_list(what: str, value: JSON, error: type[Exception], max_items: int = MAX_BYTES
              ) -> list[JSON]:
    """``value`` (a list, or a tuple from an in-process dict) as a list of at most
    ``max_items`` items, else ``error`` naming ``what``."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{what} must be a list, got {type(value).__name__}")
    if len(value) > max_items:
        raise error(f"{what} must be a list of at most {max_items} items, got {len(value)}")
    return value if isinstance(value, list) else list(value)


class Doc:
    """A checked view of one decoded JSON object (or any mapping): each accessor reads one
    field, checks its type and bounds and returns it. An absent field raises unless a
    ``default`` is given (the ``optional_*`` accessors also take ``null`` as absent); anything
    off raises ``error`` (the reader's own class) naming ``<where>.<field>``."""

    __slots__ = ("error", "value", "where")

    def __init__(self, value: JSON, where: str, error: type[Exception] = BoundedJSONError
                 ) -> None:
        if not isinstance(value, Mapping):
            raise error(f"{where} must be an object, got {type(value).__name__}")
        self.value: Mapping[str, JSON] = value
        self.where = where
        self.error = error

    def at(self, key: str) -> str:
        """``<where>.<key>``: how messages name a field."""
        return f"{self.where}.{key}"

    def raw(self, key: str, default: JSON = ...) -> JSON:
        """The field as decoded, unchecked; ``default`` when absent."""
        if key in self.value:
            return self.value[key]
        if default is ...:
            raise self.error(f"{self.where}: missing field {key!r}")
        return default

    def integer(self, key: str, minimum: int = 0, maximum: int = MAX_BYTES,
                default: int | EllipsisType = ...) -> int:
        """An int field in ``[minimum, maximum]`` (a bool is not an int)."""
        if key not in self.value and not isinstance(default, EllipsisType):
            return default
        return json_int(self.at(key), self.raw(key), self.error, minimum, maximum)

    def optional_integer(self, key: str, minimum: int = 0, maximum: int = MAX_BYTES
                         ) -> int | None:
        """An int field in ``[minimum, maximum]``, or ``None`` when absent or null."""
        value = self.value.get(key)
        return None if value is None else json_int(self.at(key), value, self.error, minimum,
                                                   maximum)

    def string(self, key: str, max_chars: int = DEFAULT_MAX_CHARS, min_chars: int = 0,
               default: str | EllipsisType = ...) -> str:
        """A string field of ``min_chars..max_chars`` characters."""
        if key not in self.value and not isinstance(default, EllipsisType):
            return default
        return json_str(self.at(key), self.raw(key), self.error, max_chars, min_chars)

    def optional_string(self, key: str, max_chars: int = DEFAULT_MAX_CHARS) -> str | None:
        """A string field of at most ``max_chars`` characters, or ``None`` when absent or
        null."""
        value = self.value.get(key)
        return None if value is None else json_str(self.at(key), value, self.error, max_chars)

    def boolean(self, key: str, default: bool | EllipsisType = ...) -> bool:
        """A ``true`` / ``false`` field."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{self.at(key)} must be true or false, got {value!r:.60}")
        return value

    def array(self, key: str, max_items: int = MAX_BYTES) -> list[JSON]:
        """A list field of at most ``max_items`` items (unchecked: see :meth:`children`,
        :meth:`strings`)."""
        return json_list(self.at(key), self.raw(key), self.error, max_items)

    def children(self, key: str, max_items: int) -> list[Doc]:
        """A list field of objects, each a :class:`Doc` named ``<where>.<key>[i]``."""
        return [Doc(x, f"{self.at(key)}[{i}]", self.error)
                for i, x in enumerate(self.array(key, max_items))]

    def strings(self, key: str, max_items: int = MAX_BYTES, max_chars: int = DEFAULT_MAX_CHARS,
                min_chars: int = 0) -> list[str]:
        """A list field of strings of ``min_chars..max_chars`` characters."""
        return [json_str(f"{self.at(key)}[{i}]", x, self.error, max_chars, min_chars)
                for i, x in enumerate(self.array(key, max_items))]

    def refuse_unknown(self, known: set[str]) -> None:
        """Refuse fields outside ``known`` (naming the first four)."""
        unknown = sorted(map(str, set(self.value) - known))
        if unknown:
            raise self.error(f"{self.where} has unknown fields {unknown[:4]}")

    def check_version(self, key: str, expected: int | str, what: str) -> None:
        """The field ``key`` must be exactly ``expected`` (:func:`version_mismatch`), else
        ``error`` saying which version each side speaks."""
        mismatch = version_mismatch(self.value.get(key), expected, what)
        if mismatch:
            raise self.error(f"{self.where}: {mismatch}")


def version_mismatch(got: JSON, expected: int | str, what: str) -> str | None:
    """``None`` when a peer's ``got`` is exactly ``expected`` (a protocol's ``WIRE_VERSION``
    or schema tag: an int never matches a bool, a float or a string), else a sentence naming
    ``what`` and the version each side speaks."""
    if type(got) is type(expected) and got == expected:
        return None
    return f"unknown {what} {got!r:.80} (this side reads {expected!r}: upgrade the older side)"


def load_document(data: JSON, max_bytes: int, where: str,
                  error: type[Exception] = BoundedJSONError) -> Doc:
    """``data`` (JSON bytes or text of at most ``max_bytes`` bytes, parsed by :func:`loads`)
    as a :class:`Doc`; anything else (another type, too large, not JSON, not an object)
    raises ``error`` naming ``where``."""
    if not isinstance(data, (bytes, bytearray, str)):
        raise error(f"{where} must be JSON bytes or text, got {type(data).__name__}")
    # surrogatepass: a lone surrogate is counted here and refused by loads
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > max_bytes:
        raise error(f"{where} is {size} bytes, above the {max_bytes}-byte limit")
    try:
        value = loads(data)
    except BoundedJSONError as exc:
        raise error(f"{where} is not valid JSON: {exc}") from None
    return Doc(value, where, error)
