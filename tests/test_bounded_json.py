"""Bounded JSON decoding of what peers send: kvconnect.bounded_json, and the two decoders
built on it (kvconnect.framing.recv_message is tested in test_ipc.py; HandshakeMetadata here)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.bounded_json import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_INT_DIGITS,
    BoundedJSONError,
    loads,
    nesting_depth,
)
from kvconnect.connectors.nixl.handshake import HandshakeMetadata, MetadataError

json_docs = st.recursive(
    st.none() | st.booleans() | st.integers(-(10 ** 30), 10 ** 30)
    | st.floats(allow_nan=False) | st.text(),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(), kids, max_size=5),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(doc=json_docs)
def test_valid_documents_decode_as_json_does(doc) -> None:
    text = json.dumps(doc)
    assert loads(text) == json.loads(text)
    assert loads(text.encode()) == json.loads(text)


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(
    st.binary(max_size=200), st.text(max_size=200),
    st.integers(1, 5000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 5000).map(lambda n: '{"k":' * n + "1" + "}" * n),
    st.integers(1, 9000).map(lambda n: "-" + "1" * n),
    st.integers(1, 5000).map(lambda n: '"' + "\\" * n + '"'),
))
def test_anything_else_decodes_as_json_does_or_raises_bounded_json_error(data) -> None:
    """Whatever arrives: the value json.loads gives, or BoundedJSONError (and nothing else)
    where json.loads refuses it too or it is over a bound (depth, integer digits)."""
    expected, json_refuses = _unbounded_json(data)
    try:
        got = loads(data)
    except BoundedJSONError:
        assert json_refuses or _over_bounds(data, expected), data[:80]
    else:
        assert not json_refuses, data[:80]
        assert json.dumps(got) == json.dumps(expected)  # dumps: NaN equals NaN


def _unbounded_json(data: str | bytes) -> tuple[object, bool]:
    """``(value, False)`` as plain json.loads decodes ``data`` (bytes as UTF-8), or
    ``(None, True)`` where it refuses it."""
    try:
        return json.loads(data.decode("utf-8") if isinstance(data, bytes) else data), False
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None, True


def _over_bounds(data: str | bytes, value: object) -> bool:
    """A JSON document json.loads accepted nests deeper than 64 levels, holds an integer
    of more than 40 digits or a string with a lone surrogate (not valid Unicode)."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    if nesting_depth(text, max_depth=1 << 30) > DEFAULT_MAX_DEPTH:
        return True
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v)
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, int) and len(str(abs(v))) > DEFAULT_MAX_INT_DIGITS:
            return True
        elif isinstance(v, str) and any(0xD800 <= ord(c) <= 0xDFFF for c in v):
            return True
    return False


def test_bounds() -> None:
    assert nesting_depth('[{"a": "[[[["}, [[]]]') == 3
    assert loads("[" * 64 + "]" * 64) is not None
    with pytest.raises(BoundedJSONError, match="deeper than 64"):
        loads("[" * 65 + "]" * 65)
    with pytest.raises(BoundedJSONError, match="deeper than 3"):
        loads('{"a": {"b": {"c": {}}}}', max_depth=3)
    assert loads("-" + "9" * 40) == -int("9" * 40)
    with pytest.raises(BoundedJSONError, match="digit limit"):
        loads("9" * 41)
    with pytest.raises(BoundedJSONError, match="deeper than 64"):
        loads("[" * 100_000)  # would recurse 100000 deep in json.loads
    for text in ("[" * 10, "][", "[}", '{"a": [1, 2}'):
        with pytest.raises(BoundedJSONError, match="unbalanced|invalid JSON"):
            loads(text)


def test_large_inputs_stay_cheap() -> None:
    """16 MiB of brackets (the message limit) is measured in well under a few seconds."""
    deep = "[" * (8 << 20) + "]" * (8 << 20)
    t0 = time.monotonic()
    with pytest.raises(BoundedJSONError, match="deeper"):
        loads(deep)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("doc", [
    "[" * 1000 + "]" * 1000,
    '{"schema": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"generation": ' + "7" * 5000 + "}",
    b"\xff\xfe{}",
    '{"schema": "x"' + "}" * 3,
])
def test_handshake_metadata_raises_only_metadata_error(doc) -> None:
    with pytest.raises(MetadataError):
        HandshakeMetadata.from_json(doc)
