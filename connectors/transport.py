"""One interface for every way a worker pulls KV blocks from a peer: the halves, the spec that
builds them, and the one result type every transfer returns.

A :class:`Transport` lives on the receiving side (decode) and moves logical blocks of a
peer's KV cache into its own:

- :meth:`~Transport.open_peer` ``(peer, offer)``: connect to a peer from what the peer's
  :class:`Exporter` published (JSON-able), or reuse a cached connection when nothing
  changed; returns the seconds of set-up paid by this call (0.0 when cached);
- :meth:`~Transport.fetch` ``(peer, remote_ids, local_ids)``: copy blocks, block until they
  are in place, and say what carried them (:class:`FetchResult`); the ids are a sequence of
  ints or a 1-D integer numpy array (callers that time fetches pass arrays, converted once:
  a Python list's conversion is host work on the timed path);
- :meth:`~Transport.invalidate` ``(peer=None)``: forget cached state (mappings, plans) of
  one peer or all, after this worker's or the peer's sleep / wake;
- :meth:`~Transport.close`: release everything (idempotent).

The serving side (prefill) runs the matching :class:`Exporter`: ``describe()`` is what it
publishes for decodes, ``pause()`` / ``resume()`` bracket its sleep / wake, ``close()``.

A transport that must register a worker's memory before peers can read it (NIXL) also
builds a :class:`MemoryRegistration` per worker, which that worker's half uses.

A :class:`TransportSpec` holds everything the library and the harness need to know about a
transport: how to build its halves (and its registration) from a generic
:class:`TransportContext`, whether it works only between processes of one host, whether each
completed fetch notifies the serving side, what it needs installed. Adding a transport means
writing its module and registering one spec (:mod:`.registry`), nowhere else.

Units: bytes, seconds, logical blocks for block ids; GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvconnect.block_ids import BlockIds
from kvconnect.bounded_json import JSON, JSONObject

if TYPE_CHECKING:
    from kvconnect.cache_source import KVCacheSource


from kvconnect.units import gbps

__all__ = [
    "Exporter",
    "FetchResult",
    "MemoryRegistration",
    "Transport",
    "TransportContext",
    "TransportSpec",
]


@dataclass(frozen=True)
class FetchResult:
    """One transfer (a transport's fetch, a NIXL READ): ``bytes`` moved in ``seconds`` (the
    copy or READ only, not set-up); ``backend``: what carried it (``kernel:cuda:0``,
    ``UCX``, ...); ``setup_seconds``: set-up paid inside this fetch (0.0 when the peer was
    cached); ``blocks``: logical blocks moved; ``note``: details for a human (never parsed);
    ``descriptors``: transfer descriptors it used (blocks x regions; 0 where not counted);
    ``host_seconds``: host time preparing the copy (ids converted and checked) and
    ``launch_seconds``: host time issuing it (ids uploaded, kernel or graph launched), both
    0.0 where not measured; where ``seconds`` is timed on the device (the ipc transport on
    CUDA) they are part of it only as far as the device waited for them."""

    bytes: int
    seconds: float
    backend: str
    setup_seconds: float = 0.0
    blocks: int = 0
    note: str = ""
    descriptors: int = 0
    host_seconds: float = 0.0
    launch_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Throughput in GB/s by :func:`kvconnect.units.gbps` (0.0 at zero seconds)."""
        return gbps(self.bytes, self.seconds)


@runtime_checkable
class Transport(Protocol):
    """The receiving half of a transport (see the module docstring)."""

    name: str

    def open_peer(self, peer: str, offer: Mapping[str, JSON]) -> float: ...

    def fetch(self, peer: str, remote_ids: BlockIds, local_ids: BlockIds, *,
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


@runtime_checkable
class MemoryRegistration(Protocol):
    """One worker's registration of its KV memory with a transport (NIXL: an agent and one
    registration per physical chunk), shared by the worker's half. Lifecycle:
    built before the cache's final commit; :meth:`register` after it (it must refuse, with
    a :class:`~kvconnect.errors.KvconnectError`, a cache that is not final yet); :meth:`deregister`
    before the cache releases its physical memory, :meth:`reregister` after it recommits;
    :meth:`close` at the end (idempotent). A serving worker calls :meth:`progress` while
    peers read (from one thread at a time) and collects completion notices with
    :meth:`take_notices`; ``identity`` is the name those notices carry for this worker."""

    identity: str

    def register(self) -> str: ...

    def deregister(self) -> None: ...

    def reregister(self) -> str: ...

    def progress(self) -> None: ...

    def take_notices(self) -> dict[str, int]: ...

    def close(self) -> None: ...


@dataclass
class TransportContext:
    """What any transport half is built from (nothing transport-specific). ``cache``: this
    worker's ExtensibleKVCache; ``timeout``: seconds for any one wait; ``name``: this
    worker's name (socket names, agent names); ``directory``: a private 0700 directory for
    sockets (set where the spec says ``needs_directory``); ``allowed_pids``: the peers that
    may connect (serving side); ``options``: per-transport keywords for its builders (e.g.
    ``{"ipc": {"direction": "pull"}}``)."""

    cache: KVCacheSource
    timeout: float = 60.0
    name: str = "worker"
    directory: str = ""
    allowed_pids: Callable[[], set[int]] = field(default=lambda: set())
    options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def options_for(self, transport: str) -> dict[str, Any]:
        """The keywords given for ``transport`` (empty when none)."""
        return dict(self.options.get(transport, {}))


def _usable() -> str | None:
    return None


@dataclass(frozen=True)
class TransportSpec:
    """Everything known about one transport.

    - ``receiver(ctx, registration)`` builds the :class:`Transport`; ``exporter(ctx,
      registration)`` the serving half (``None``: serving needs nothing beyond what the
      worker already publishes). ``registration`` is what ``registration(ctx)`` built for
      this worker, or None for a transport without one;
    - ``registration(ctx)``: the worker's :class:`MemoryRegistration` (None: the transport
      registers nothing);
    - ``same_host_only``: needs both processes on one kernel;
    - ``completion_notice``: how each completed fetch notifies the serving worker, in words
      ("" when it does not; :attr:`notifies_exporter`);
    - ``needs_directory``: the serving half needs ``ctx.directory``;
    - ``sends_chunk_fds``: the serving half sends every physical chunk's fd in one message
      (at most :data:`kvconnect.framing.MAX_FDS` chunks per worker);
    - ``requires()``: None when usable here, else why not and what to install. It must not
      import native libraries (the harness forks its workers after calling it);
    - ``environment``: variables the transport wants in worker processes (defaults: a value
      already set wins);
    - ``description``: one line for humans.
    """

    name: str
    receiver: Callable[[TransportContext, Any], Transport]
    exporter: Callable[[TransportContext, Any], Exporter] | None = None
    registration: Callable[[TransportContext], MemoryRegistration] | None = None
    same_host_only: bool = False
    completion_notice: str = ""
    needs_directory: bool = False
    sends_chunk_fds: bool = False
    requires: Callable[[], str | None] = _usable
    environment: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    @property
    def notifies_exporter(self) -> bool:
        """True when each completed fetch notifies the serving worker (which counts them
        through its registration's :meth:`~MemoryRegistration.take_notices`)."""
        return bool(self.completion_notice)
