"""One interface for every way a worker pulls KV blocks from a peer, and a registry of them.

A :class:`Transport` lives on the receiving side (decode) and moves logical blocks of a
peer's KV cache into its own:

- :meth:`~Transport.open_peer` ``(peer, offer)``: connect to a peer from what the peer's
  :class:`Exporter` published (JSON-able), or reuse a cached connection when nothing
  changed; returns the seconds of set-up paid by this call (0.0 when cached);
- :meth:`~Transport.fetch` ``(peer, remote_ids, local_ids)``: copy blocks, block until they
  are in place, and say what carried them (:class:`FetchResult`);
- :meth:`~Transport.invalidate` ``(peer=None)``: forget cached state (mappings, plans) of
  one peer or all, after this worker's or the peer's sleep / wake;
- :meth:`~Transport.close`: release everything (idempotent).

The serving side (prefill) runs the matching :class:`Exporter`: ``describe()`` is what it
publishes for decodes, ``pause()`` / ``resume()`` bracket its sleep / wake, ``close()``.

Transports are chosen by name through :func:`get_transport`; each registered
:class:`TransportSpec` says how to build both halves from a :class:`TransportContext` and
whether the transport only works between processes of one host. Adding a transport means
registering one spec, nowhere else. The library's own (``ipc``, ``nixl``) register when
their modules load, which ``kvconnect.connectors`` does on import: this module imports none
of them (imports point from the transports to the registry, never back).

Units: bytes, seconds, logical blocks for block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvconnect.bounded_json import JSON, JSONObject

if TYPE_CHECKING:
    from kvconnect.cache_source import KVCacheSource

    from .nixl.worker import NixlRegionWorker

__all__ = [
    "Exporter",
    "FetchResult",
    "Transport",
    "TransportContext",
    "TransportSpec",
    "UnknownTransportError",
    "get_transport",
    "register_transport",
    "transport_names",
]


@dataclass(frozen=True)
class FetchResult:
    """One fetch: ``bytes`` moved in ``seconds`` (the copy or READ only, not set-up),
    ``backend``: what carried it (``kernel:cuda:0``, ``UCX cuda_ipc``, ...);
    ``setup_seconds``: set-up paid inside this fetch (0.0 when the peer was cached);
    ``blocks``: logical blocks moved; ``note``: details for a human (never parsed)."""

    bytes: int
    seconds: float
    backend: str
    setup_seconds: float = 0.0
    blocks: int = 0
    note: str = ""

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@runtime_checkable
class Transport(Protocol):
    """The receiving half of a transport (see the module docstring)."""

    name: str

    def open_peer(self, peer: str, offer: Mapping[str, JSON]) -> float: ...

    def fetch(self, peer: str, remote_ids: Sequence[int], local_ids: Sequence[int], *,
              timeout: float | None = None) -> FetchResult: ...

    def invalidate(self, peer: str | None = None) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Exporter(Protocol):
    """The serving half: what a peer needs to fetch from this worker."""

    def describe(self) -> JSONObject: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class TransportContext:
    """What a transport half may be built from. ``cache``: this worker's
    ExtensibleKVCache; ``timeout``: seconds for any one wait; ``name``: this worker's name
    (socket names, agent names); ``directory``: a private 0700 directory for sockets;
    ``allowed_pids``: the peers that may connect (serving side); ``nixl``: this worker's
    registered NixlRegionWorker, for transports that read through NIXL; ``options``:
    per-transport keywords (e.g. ``{"ipc": {"direction": "pull"}}``)."""

    cache: KVCacheSource
    timeout: float = 60.0
    name: str = "worker"
    directory: str = ""
    allowed_pids: Callable[[], set[int]] = field(default=lambda: set())
    nixl: NixlRegionWorker | None = None
    attribution: Callable[[str], list[str]] | None = None
    options: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class TransportSpec:
    """A registered transport: ``receiver(ctx)`` builds the :class:`Transport`,
    ``exporter(ctx)`` the serving half (``None`` when serving needs nothing beyond what
    the worker already publishes); ``same_host_only``: needs both processes on one kernel;
    ``requires``: a check returning None when usable here, else why not."""

    name: str
    receiver: Callable[[TransportContext], Transport]
    exporter: Callable[[TransportContext], Exporter] | None = None
    same_host_only: bool = False
    requires: Callable[[], str | None] = lambda: None
    description: str = ""


class UnknownTransportError(KeyError):
    """A transport name nobody registered."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name

    def __str__(self) -> str:
        return (f"unknown transport {self.name!r}; registered: "
                f"{', '.join(transport_names()) or 'none'}")


_REGISTRY: dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec, *, replace: bool = False) -> None:
    """Add ``spec`` under ``spec.name``; ``ValueError`` if taken (unless ``replace``)."""
    if not spec.name or not spec.name.isidentifier():
        raise ValueError(f"a transport name must be an identifier, got {spec.name!r}")
    if spec.name in _REGISTRY and not replace:
        raise ValueError(f"transport {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_transport(name: str) -> TransportSpec:
    """The spec registered under ``name`` (:class:`UnknownTransportError` otherwise)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownTransportError(name) from None


def transport_names() -> tuple[str, ...]:
    """Registered transport names, in registration order."""
    return tuple(_REGISTRY)
