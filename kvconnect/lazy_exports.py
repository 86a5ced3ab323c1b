"""A package's public names, loaded on first use: the module-level ``__getattr__`` and
``__dir__`` built from one table (public name -> the module defining it), so that importing
the package imports none of them (torch, vLLM, a backend's library) until one is used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str], *,
                 needs: tuple[str, str] | None = None
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package named ``package`` (its ``__name__``).
    ``exports`` maps each public name to the module that defines it (a relative one, ``.x``,
    is inside ``package``); a name once loaded stays in the package's namespace. Any other
    name raises AttributeError. ``needs``: ``(top-level module, how to install it)``: when
    that module is missing, loading a name raises ImportError saying what to install."""
    namespace = vars(sys.modules[package])

    def load(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        try:
            value = getattr(importlib.import_module(module, package), name)
        except ModuleNotFoundError as exc:
            if needs is None or str(exc.name).split(".")[0] != needs[0]:
                raise
            raise ImportError(f"{package}.{name} needs {needs[1]}") from exc
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return load, names
