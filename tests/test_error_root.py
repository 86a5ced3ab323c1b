"""One error root: every exception class kvconnect defines derives from KvconnectError.

The test imports every module of ``kvconnect``, ``kvconnect.connectors`` and
``kvconnect.harness`` (``kvconnect.vllm`` included) and inspects the classes each defines.
Modules that cannot import here because an optional dependency is missing (vLLM, triton) are read
as source instead: they may define no exception class at all.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kvconnect
import kvconnect.connectors
import kvconnect.harness
from kvconnect import KvconnectError

#: exception classes that must not be KvconnectErrors, and why
ALLOWED = {
    # signals, not errors: KeyboardInterrupt subclasses so that they pass every
    # `except Exception` (and `except KvconnectError`) on their way to the top
    "kvconnect.interrupts.Interrupted":
        "a SIGINT/SIGTERM/SIGHUP; must not be caught by except Exception",
}
#: optional dependencies a module may import at module level (vLLM; triton for the CUDA copy
#: kernel)
OPTIONAL = {"vllm", "triton"}


def _walk() -> tuple[list[object], list[tuple[str, Path]]]:
    """Every importable module, and (name, path) of those whose optional dependency is
    missing here."""
    modules, unimportable = [], []
    for package in (kvconnect, kvconnect.connectors, kvconnect.harness):
        modules.append(package)
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            try:
                modules.append(importlib.import_module(info.name))
            except ModuleNotFoundError as exc:
                if exc.name is None or exc.name.split(".")[0] not in OPTIONAL:
                    raise
                spec = importlib.util.find_spec(info.name)
                unimportable.append((info.name, Path(spec.origin)))
    return modules, unimportable


MODULES, UNIMPORTABLE = _walk()


def _defined_exceptions() -> dict[str, type]:
    found = {}
    for mod in MODULES:
        for name, obj in vars(mod).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) \
                    and obj.__module__ == mod.__name__:
                found[f"{mod.__name__}.{name}"] = obj
    return found


def test_walk_sees_every_layer() -> None:
    names = {m.__name__ for m in MODULES}
    for expected in ("kvconnect.framing", "kvconnect.vmm.base", "kvconnect.layout.specs",
                     "kvconnect.connectors.errors", "kvconnect.connectors.nixl.agent",
                     "kvconnect.harness.control", "kvconnect.harness.conformance.plugin"):
        assert expected in names


def test_every_exception_is_a_kvconnect_error() -> None:
    found = _defined_exceptions()
    assert len(found) >= 25, sorted(found)  # the walk found the package's errors
    outside = sorted(n for n, cls in found.items()
                     if not issubclass(cls, KvconnectError) and n not in ALLOWED)
    assert outside == [], f"not derived from KvconnectError: {outside}"
    stale = sorted(set(ALLOWED) - set(found))
    assert stale == [], f"allow-listed but no longer defined: {stale}"
    for name in ALLOWED:
        assert not issubclass(found[name], Exception), name  # signals stay BaseExceptions


@pytest.mark.parametrize(("name", "mixin"), [
    ("kvconnect.framing.IpcError", RuntimeError),
    ("kvconnect.bounded_json.BoundedJSONError", ValueError),
    ("kvconnect.layout.specs.LayoutError", ValueError),
    ("kvconnect.vmm._driver_api.DriverLibraryError", OSError),
    ("kvconnect.connectors.nixl.agent.NixlUnavailableError", ImportError),
    ("kvconnect.connectors.nixl.handshake.MetadataError", ValueError),
    ("kvconnect.connectors.registry.UnknownTransportError", KeyError),
    ("kvconnect.errors.OptionError", ValueError),
])
def test_standard_bases_are_kept(name: str, mixin: type) -> None:
    """``except ValueError`` (and the like) callers keep working."""
    cls = _defined_exceptions()[name]
    assert issubclass(cls, KvconnectError) and issubclass(cls, mixin)


def test_unimportable_modules_define_no_exceptions() -> None:
    """What this machine cannot import (no vLLM here) is checked from its source: it may
    define no exception class (one would escape the walk above)."""
    for name, path in UNIMPORTABLE:
        tree = ast.parse(path.read_text(), str(path))
        classes = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
                   and any(ast.unparse(b).endswith(("Error", "Exception", "Interrupt"))
                           for b in n.bases)]
        assert classes == [], f"{name} defines exception classes {classes}: root them in " \
                              "KvconnectError and test them where vLLM is installed"
