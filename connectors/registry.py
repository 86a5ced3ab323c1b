"""The registry of transports: one :class:`~.transport.TransportSpec` per name.

The library's own transports (``ipc``, ``nixl``) are added by
:func:`register_builtin_transports` (idempotent), which every function here calls first:
importing a transport module registers nothing. A third-party transport registers its spec
with one :func:`register_transport` call; processes that must know it (the harness's worker
processes) import its module by name (:func:`load_transport_modules`; ``kvconnect-validate
--transport-module``, docs/validate.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from kvconnect.errors import KvconnectError

from .ipc.transport import IPC_TRANSPORT
from .nixl.transport import NIXL_TRANSPORT
from .transport import TransportSpec

__all__ = [
    "BUILTIN_TRANSPORTS",
    "TransportModuleError",
    "UnknownTransportError",
    "get_transport",
    "load_transport_modules",
    "register_builtin_transports",
    "register_transport",
    "transport_names",
]

#: the library's own transports, in the order runs use them
BUILTIN_TRANSPORTS: tuple[TransportSpec, ...] = (IPC_TRANSPORT, NIXL_TRANSPORT)

_REGISTRY: dict[str, TransportSpec] = {}


class UnknownTransportError(KvconnectError, KeyError):
    """A transport name nobody registered."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return (f"unknown transport {self.name!r}; registered: "
                f"{', '.join(transport_names()) or 'none'} (a transport of another package "
                "is registered by importing its module: --transport-module MODULE)")


class TransportModuleError(KvconnectError, ImportError):
    """A transport module that could not be imported (the message says which and why)."""


def register_builtin_transports() -> None:
    """Register ``ipc`` and ``nixl`` unless they already are (safe to call any number of
    times; a spec registered under their name with ``replace=True`` stays)."""
    for spec in BUILTIN_TRANSPORTS:
        _REGISTRY.setdefault(spec.name, spec)


def register_transport(spec: TransportSpec, *, replace: bool = False) -> None:
    """Add ``spec`` under ``spec.name``; ``ValueError`` if the name is not an identifier or
    is taken by another spec (unless ``replace``). The built-in names are always taken."""
    register_builtin_transports()
    if not spec.name or not spec.name.isidentifier():
        raise ValueError(f"a transport name must be an identifier, got {spec.name!r}")
    if _REGISTRY.get(spec.name) == spec:
        return  # the same spec again (its module imported twice)
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"transport {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_transport(name: str) -> TransportSpec:
    """The spec registered under ``name`` (:class:`UnknownTransportError` otherwise)."""
    register_builtin_transports()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTransportError(name) from None


def transport_names() -> tuple[str, ...]:
    """Registered transport names: the built-in ones first, then in registration order."""
    register_builtin_transports()
    return tuple(_REGISTRY)


def load_transport_modules(modules: Sequence[str]) -> None:
    """Import each module of ``modules`` (dotted names, importable from ``sys.path``); a
    transport module registers its spec when imported. Raises
    :class:`TransportModuleError` naming the module when one does not import."""
    register_builtin_transports()
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - foreign code: any failure, named
            raise TransportModuleError(
                f"transport module {module!r} does not import: {type(exc).__name__}: {exc} "
                "(it must be importable in every worker process: installed, or on "
                "PYTHONPATH)") from exc
