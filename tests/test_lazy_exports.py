"""kvconnect.lazy_exports: a package's public names load on first use, from one table
(kvconnect, kvconnect.vmm, kvconnect.vllm and kvconnect.connectors.vllm use it)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "kvc_lazy_demo"


@pytest.fixture()
def demo(tmp_path: Path) -> Iterator[object]:
    """A package whose ``Thing`` lives in ``.things`` and ``Other`` in a module that imports a
    top-level module that does not exist."""
    root = tmp_path / PACKAGE
    root.mkdir()
    (root / "__init__.py").write_text(
        "from kvconnect.lazy_exports import lazy_exports\n"
        "__getattr__, __dir__ = lazy_exports(__name__, {'Thing': '.things', "
        "'Other': f'{__name__}.other'}, needs=('kvc_absent_dep', 'the demo extra'))\n")
    (root / "things.py").write_text("class Thing:\n    pass\n")
    (root / "other.py").write_text("import kvc_absent_dep.sub\nOther = 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import kvc_lazy_demo

        yield kvc_lazy_demo
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] == PACKAGE]:
            del sys.modules[name]


def test_a_name_loads_on_first_use_and_stays(demo: object) -> None:
    assert f"{PACKAGE}.things" not in sys.modules
    thing = demo.Thing  # type: ignore[attr-defined]
    assert thing is sys.modules[f"{PACKAGE}.things"].Thing
    assert vars(demo)["Thing"] is thing  # kept: the next lookup is an ordinary attribute
    assert {"Thing", "Other"} <= set(dir(demo))


def test_unknown_names_and_missing_dependencies_are_named(demo: object) -> None:
    with pytest.raises(AttributeError, match=f"{PACKAGE}' has no attribute 'Nope'"):
        demo.Nope  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError, match=f"{PACKAGE}.Other needs the demo extra") as info:
        demo.Other  # type: ignore[attr-defined]  # noqa: B018
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
    assert "Other" not in vars(demo)
