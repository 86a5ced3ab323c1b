"""What the parts of :class:`~.event_loop.Coordinator` (:class:`~.startup.WorkerStartup`,
:class:`~.restarts.Restarts`) may use of it: its state, declared once here, and the hooks it
defines (each part calls them, the coordinator implements them)."""

from __future__ import annotations

import socket
from typing import Any

from ..control import CoordinatorMessage
from .worker_records import LocalWorker


class CoordinatorPart:
    """The coordinator's state and hooks, as a part of it sees them (a mixin base: a part
    never runs without the coordinator, which sets every attribute and overrides every
    hook)."""

    cfg: Any
    dir: str
    listener: socket.socket | None
    workers: list[LocalWorker]
    store: dict[str, Any]
    waiters: list[Any]
    peer_queries: list[Any]
    restartable: set[str]
    aborted: str | None
    report: Any
    watch: Any
    display: Any

    def _running(self, w: LocalWorker) -> None:
        raise NotImplementedError

    def _reply(self, w: LocalWorker, msg: CoordinatorMessage) -> None:
        raise NotImplementedError

    def _add_check(self, name: str, status: str, detail: str = "",
                   data: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError

    def _fail_worker(self, w: LocalWorker, message: str, *, state: str, cause: str,
                     kill: bool = False, tail: bool = True,
                     data: dict[str, Any] | None = None) -> None:
        raise NotImplementedError
