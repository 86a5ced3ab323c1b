"""Loading NIXL and retiring its agents safely.

NIXL's Python bindings come from ``nixl`` (NIXL's meta package, what ``kvconnect[nixl]``
installs: it dispatches to the ``nixl_cu12`` or ``nixl_cu13`` backend matching torch's CUDA,
the one vLLM imports as ``nixl._api``, so a process that runs both uses one NIXL), else
``nixl_cu13`` / ``nixl_cu12`` installed alone (whichever imports).
An agent must be drained before it is destroyed (:func:`drain_agent`): a READ that failed
half-posted can leave operations queued in UCX, and destroying the agent then aborts the
process.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, TypeAlias, TypeVar

import numpy as np

from ..errors import KVConnectorError

logger = logging.getLogger(__name__)

__all__ = ["NIXL_MODULES", "NixlAgent", "NixlHandle", "NixlUnavailableError",
           "NotificationInbox", "Notifications", "create_agent", "drain_agent", "import_nixl",
           "nixl_importable", "nixl_install_problem", "release_logged"]

#: the modules NIXL's Python API comes from, in the order they are tried (the meta package's
#: choice first: the backend vLLM uses in the same process)
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
#: what to install (the ``nixl`` meta package, pulled by ``kvconnect[nixl]``)
_INSTALL = "install kvconnect[nixl] (the nixl package 1.5.1: nixl-cu12 and nixl-cu13)"

#: what NIXL hands back for a registration, a prepared descriptor list or a transfer, and takes
#: back to release it: opaque here
NixlHandle: TypeAlias = object
#: ``get_new_notifs()``: remote agent name (str or bytes) -> the messages received from it
Notifications: TypeAlias = "Mapping[str | bytes, Sequence[bytes]]"
_H = TypeVar("_H")


class NixlAgent(Protocol):
    """The members of NIXL's ``nixl_agent`` (NIXL 1.5, untyped bindings) that kvconnect calls.
    Memory types are ``"DRAM"`` / ``"VRAM"``; descriptor rows ``(address, bytes, device)``."""

    @property
    def backends(self) -> Collection[str]: ...
    def register_memory(self, descs: list[tuple[int, int, int, str]], mem_type: str
                        ) -> NixlHandle: ...
    def deregister_memory(self, dlist: NixlHandle) -> None: ...
    def get_agent_metadata(self) -> bytes: ...
    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...
    def remove_remote_agent(self, agent_name: str | bytes) -> None: ...
    def prep_xfer_dlist(self, agent_name: str, descs: np.ndarray, mem_type: str
                        ) -> NixlHandle: ...
    def release_dlist_handle(self, handle: NixlHandle) -> None: ...
    def make_prepped_xfer(self, operation: str, local: NixlHandle, local_indices: list[int],
                          remote: NixlHandle, remote_indices: list[int], notif: bytes
                          ) -> NixlHandle: ...
    def transfer(self, handle: NixlHandle) -> str: ...
    def check_xfer_state(self, handle: NixlHandle) -> str: ...
    def query_xfer_backend(self, handle: NixlHandle) -> str | bytes: ...
    def release_xfer_handle(self, handle: NixlHandle) -> None: ...
    def get_new_notifs(self) -> Notifications: ...


class NixlUnavailableError(KVConnectorError, ImportError):
    """The NIXL Python bindings are not installed."""


def import_nixl() -> tuple[Callable[..., NixlAgent], Callable[..., object]]:
    """Return ``(nixl_agent, nixl_agent_config)`` from the first of :data:`NIXL_MODULES`
    that imports (the classes: an agent is ``nixl_agent(name, nixl_agent_config(...))``)."""
    errors = []
    for mod in NIXL_MODULES:
        try:
            module = __import__(mod, fromlist=["nixl_agent", "nixl_agent_config"])
            return module.nixl_agent, module.nixl_agent_config
        except (ImportError, ValueError) as exc:  # ValueError: the meta package's detection
            errors.append(f"{mod}: {exc}")
    raise NixlUnavailableError(f"NIXL Python bindings not found; {_INSTALL}. Tried "
                               + "; ".join(errors))


def nixl_install_problem() -> str | None:
    """None when a NIXL Python API can be found, else why not and what to install. Only
    looks for the modules: never imports NIXL (nor loads UCX)."""
    for mod in NIXL_MODULES:
        try:
            if importlib.util.find_spec(mod.split(".")[0]) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return (f"NIXL is not installed (no nixl / nixl_cu13 / nixl_cu12 module); {_INSTALL} or "
            "drop nixl from the transports")


def nixl_importable() -> bool:
    """True when the NIXL Python bindings import (this imports them;
    :func:`nixl_install_problem` only looks for the modules)."""
    try:
        import_nixl()
    except NixlUnavailableError:
        return False
    return True


def create_agent(agent_name: str, backends: Sequence[str], progress_thread: bool,
                 who: str) -> NixlAgent:
    """A NIXL agent named ``agent_name`` with ``backends`` (its own progress thread or not).

    Raises :class:`NixlUnavailableError` without NIXL and :class:`KVConnectorError` (prefixed
    with ``who``) when NIXL fails to create it or a backend's plugin is missing (the agent is
    drained and dropped first). Retire the agent with :func:`drain_agent` before its last
    reference goes.
    """
    nixl_agent, nixl_agent_config = import_nixl()
    try:
        agent = nixl_agent(agent_name, nixl_agent_config(backends=list(backends),
                                                         enable_prog_thread=progress_thread))
    except Exception as exc:
        raise KVConnectorError(f"{who}: creating NIXL agent {agent_name!r} failed: "
                               f"{exc}") from exc
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        drain_agent(agent, who)
        del agent  # destroyed here, not kept alive by the traceback
        raise KVConnectorError(f"{who}: NIXL backends {missing} are not available (plugin "
                               "missing)")
    return agent


class NotificationInbox:
    """Notifications an agent received and nobody took yet, by remote agent name."""

    def __init__(self) -> None:
        self._by_agent: dict[str, list[bytes]] = {}

    def keep(self, new: Notifications) -> int:
        """Add notifications as NIXL returns them (``get_new_notifs``); returns how many."""
        count = 0
        for agent, msgs in new.items():
            key = agent.decode() if isinstance(agent, bytes) else str(agent)
            self._by_agent.setdefault(key, []).extend(bytes(m) for m in msgs)
            count += len(msgs)
        return count

    def take_all(self) -> dict[str, list[bytes]]:
        """Every notification held, by agent name (the inbox is then empty)."""
        out, self._by_agent = self._by_agent, {}
        return out

    def take_one(self, from_agent: str | None = None) -> tuple[str, bytes] | None:
        """The oldest notification (from ``from_agent`` if given) as ``(agent, message)``,
        or None."""
        for agent, msgs in self._by_agent.items():
            if msgs and (from_agent is None or agent == from_agent):
                return agent, msgs.pop(0)
        return None


def release_logged(engine_id: str, what: str, release: Callable[[_H], object],
                   handle: _H) -> bool:
    """``release(handle)``: a failure is logged as ``what`` failed and gives False, so a
    caller releasing several goes on."""
    try:
        release(handle)
    except Exception:  # noqa: BLE001 - keep releasing the others
        logger.warning("%s: %s failed", engine_id, what, exc_info=True)
        return False
    return True


#: progress passes that :func:`drain_agent` makes (each runs UCX progress until it is idle)
DRAIN_PASSES = 3


def drain_agent(agent: NixlAgent, engine_id: str,
                keep_notifs: Callable[[Notifications], int] | None = None) -> None:
    """Run NIXL/UCX progress on ``agent`` until it is idle, so that no UCX operation stays queued.

    Why: when a READ fails half-posted (the peer died or closed its agent while NIXL was posting
    the request), NIXL returns the error without progressing the worker, and the gets it had
    already posted stay queued on UCX's CMA endpoint. Destroying the agent then aborts the
    process (``arbiter.c:36 Assertion `ucs_arbiter_group_is_empty(group)'``, UCX 1.23 /
    NIXL 1.5.1). Progress completes or fails every queued operation (a dead peer's memory
    gives ESRCH), which empties the queue; ``get_new_notifs`` is the NIXL call that runs the
    progress loop. Notifications received meanwhile go to ``keep_notifs``, or are dropped
    when there is none (the agent is being retired).
    """
    for _ in range(DRAIN_PASSES):
        try:
            new = agent.get_new_notifs()
            if keep_notifs is not None and new:
                keep_notifs(new)
        except Exception:  # noqa: BLE001 - draining is best effort; the error is logged
            logger.warning("%s: driving NIXL progress before teardown failed", engine_id,
                           exc_info=True)
            return
        time.sleep(1e-3)
