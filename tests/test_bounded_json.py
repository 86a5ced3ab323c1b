"""Bounded JSON decoding of what peers send: kvconnect.bounded_json (loads, and the checked
reader Doc / load_document every schema module reads through), and the two decoders built on
it (kvconnect.framing.recv_message is tested in test_ipc.py; HandshakeMetadata here)."""

from __future__ import annotations

import json
import time
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconnect.bounded_json import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_INT_DIGITS,
    BoundedJSONError,
    Doc,
    load_document,
    loads,
    nesting_depth,
    version_mismatch,
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


# -- Doc and load_document: the one checked reader -------------------------------------------
class _SchemaError(ValueError):
    """Stands for a schema module's own error class."""


_SAMPLE = {"n": 7, "neg": -3, "flag": True, "s": "abc", "empty": "", "null": None,
           "items": [1, 2, 3], "names": ["a", "b"], "obj": {"x": 1},
           "kids": [{"x": 1}, {"x": 2}]}


def _doc() -> Doc:
    return Doc(json.loads(json.dumps(_SAMPLE)), "doc", _SchemaError)


def test_doc_reads_well_typed_fields() -> None:
    d = _doc()
    assert d.integer("n", 1, 7) == 7
    assert d.integer("neg", -3, 0) == -3
    assert d.integer("absent", default=9) == 9
    assert d.optional_integer("null") is None and d.optional_integer("absent") is None
    assert d.optional_integer("n") == 7
    assert d.string("s", max_chars=3) == "abc"
    assert d.string("empty") == "" and d.string("absent", default="x") == "x"
    assert d.optional_string("null") is None and d.optional_string("s") == "abc"
    assert d.boolean("flag") is True and d.boolean("absent", default=False) is False
    assert d.array("items", 3) == [1, 2, 3]
    assert d.strings("names", 2, min_chars=1) == ["a", "b"]
    assert [(k.where, k.integer("x")) for k in d.children("kids", 2)] == \
        [("doc.kids[0]", 1), ("doc.kids[1]", 2)]
    assert d.raw("null") is None and d.raw("absent", None) is None
    d.refuse_unknown(set(_SAMPLE))
    # an in-process mapping with tuples (a config dict) reads as JSON does
    assert Doc(MappingProxyType({"a": (1, 2)}), "m").array("a") == [1, 2]


def _field_error(read) -> str:
    """The message of the error class the Doc was built with (nothing else may escape)."""
    with pytest.raises(_SchemaError) as err:
        read(_doc())
    assert type(err.value) is _SchemaError
    return str(err.value)


@pytest.mark.parametrize(("read", "field"), [
    (lambda d: d.integer("missing"), "doc: missing field 'missing'"),
    (lambda d: d.integer("flag"), "doc.flag"),          # a bool is not an int
    (lambda d: d.integer("s"), "doc.s"),
    (lambda d: d.integer("null"), "doc.null"),          # null is not absent for integer()
    (lambda d: d.integer("n", maximum=6), "doc.n"),
    (lambda d: d.integer("neg"), "doc.neg"),            # minimum 0 by default
    (lambda d: d.optional_integer("flag"), "doc.flag"),
    (lambda d: d.string("n"), "doc.n"),
    (lambda d: d.string("s", max_chars=2), "doc.s"),
    (lambda d: d.string("empty", min_chars=1), "doc.empty"),
    (lambda d: d.string("null", default="x"), "doc.null"),
    (lambda d: d.optional_string("items"), "doc.items"),
    (lambda d: d.boolean("n"), "doc.n"),                # 1 is not true
    (lambda d: d.boolean("missing"), "doc: missing field 'missing'"),
    (lambda d: d.array("obj", 9), "doc.obj"),
    (lambda d: d.array("items", 2), "doc.items"),
    (lambda d: d.strings("items", 9), "doc.items[0]"),
    (lambda d: d.strings("names", 9, max_chars=0), "doc.names[0]"),
    (lambda d: d.children("items", 9), "doc.items[0]"),
    (lambda d: d.children("kids", 1), "doc.kids"),
    (lambda d: d.refuse_unknown(set(_SAMPLE) - {"flag"}), "doc has unknown fields ['flag']"),
])
def test_doc_refuses_wrong_fields_naming_them(read, field: str) -> None:
    message = _field_error(read)
    assert message == field or message.startswith(field + " "), message


@pytest.mark.parametrize("value", [None, [], "x", 3, True])
def test_doc_of_a_non_object_raises_the_callers_error(value) -> None:
    name = type(value).__name__
    with pytest.raises(_SchemaError, match=f"^where must be an object, got {name}$"):
        Doc(value, "where", _SchemaError)
    with pytest.raises(BoundedJSONError):  # the default error class
        Doc(value, "where")


@pytest.mark.parametrize(("got", "expected"), [
    (2, 3), (True, 1), (1.0, 1), ("1", 1), (1, "kvconnect.x/1"), (None, 1),
    ("kvconnect.x/0", "kvconnect.x/1"),
])
def test_check_version_takes_only_the_exact_value(got, expected) -> None:
    Doc({"v": expected}, "doc", _SchemaError).check_version("v", expected, "wire version")
    assert version_mismatch(expected, expected, "wire version") is None
    assert version_mismatch(got, expected, "wire version").startswith("unknown wire version ")
    doc = {} if got is None else {"v": got}
    with pytest.raises(_SchemaError, match=r"^doc: unknown wire version"):
        Doc(doc, "doc", _SchemaError).check_version("v", expected, "wire version")


def test_load_document_bounds_and_types() -> None:
    text = json.dumps(_SAMPLE)
    for data in (text, text.encode(), bytearray(text.encode())):
        d = load_document(data, len(text), "peer", _SchemaError)
        assert d.where == "peer" and d.value == _SAMPLE
    size = len(text.encode())
    accented = '{"a": "' + "\u00e9" * 10 + '"}'  # 19 characters, 29 bytes: bytes count
    assert load_document(accented, 29, "peer", _SchemaError).string("a") == "\u00e9" * 10
    refused = [(text, size - 1), (accented, 28),
               ({"a": 1}, 100), (None, 100), ("[1]", 100), ("{", 100), (b"\xff{}", 100),
               ("[" * 100 + "]" * 100, 1000), ('{"a": "\\ud800"}', 100)]
    for data, max_bytes in refused:
        with pytest.raises(_SchemaError, match="^peer "):
            load_document(data, max_bytes, "peer", _SchemaError)
