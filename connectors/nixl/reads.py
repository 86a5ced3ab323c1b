"""One NIXL READ of prepared descriptor rows: posted, waited for under a deadline, its
transfer handle released on every path.

A handle NIXL refuses to release (still in flight after a timeout) is kept, and released
again when the worker closes (:meth:`Reads.release_stuck`).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvconnect.polling import poll_until

from ..errors import KVTransferError
from .agent import NixlAgent, NixlHandle, NotificationInbox, drain_agent, release_logged

logger = logging.getLogger(__name__)


def _settled(state: str) -> str | None:
    """A NIXL transfer state once it is final (``"DONE"``, ``"ERR"``, ...), None while
    ``"PROC"``."""
    return None if state == "PROC" else state


class Reads:
    """The READs of the worker named ``engine_id``, whose agent offers ``backends`` and
    keeps notifications in ``inbox``."""

    def __init__(self, engine_id: str, backends: tuple[str, ...],
                 inbox: NotificationInbox) -> None:
        self.engine_id = engine_id
        self.backends = backends
        self.inbox = inbox
        #: transfer handles whose release failed, retried by release_stuck
        self.stuck: list[NixlHandle] = []

    def read(self, agent: NixlAgent, peer: str, block_list: list[int],
             local: tuple[NixlHandle, np.ndarray], remote: tuple[NixlHandle, np.ndarray],
             notif: bytes, timeout: float) -> tuple[float, str]:
        """Post one READ of rows ``local[1]`` of prepared list ``local[0]`` from rows
        ``remote[1]`` of the peer's ``remote[0]`` and wait up to ``timeout`` seconds; returns
        ``(seconds, backend)``. Any failure raises KVTransferError (the agent is drained
        then: operations of the failed request may still be queued in UCX); the transfer
        handle is released on every path."""
        handle = None
        failed = True
        deadline = time.monotonic() + timeout
        try:
            handle = agent.make_prepped_xfer("READ", local[0], local[1].tolist(), remote[0],
                                             remote[1].tolist(), notif)
            backend = self._query_backend(agent, handle)
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            if state == "PROC":
                state = poll_until(
                    lambda: _settled(agent.check_xfer_state(handle)),
                    max(0.0, deadline - time.monotonic()), first_pause=2e-5, max_pause=1e-3,
                    on_timeout=lambda _s: KVTransferError(
                        peer, block_list, f"timed out after {timeout:.3g} s (state PROC)"))
            seconds = time.perf_counter() - t0
            if state != "DONE":
                raise KVTransferError(peer, block_list, f"NIXL transfer state {state!r}")
            failed = False
        except KVTransferError:
            raise
        except Exception as exc:
            raise KVTransferError(peer, block_list, exc) from exc
        finally:
            if failed:  # operations of the failed request may still be queued in UCX
                drain_agent(agent, self.engine_id, self.inbox.keep)
            if handle is not None:
                self._release(agent, handle)
        return seconds, backend

    def _query_backend(self, agent: NixlAgent, handle: NixlHandle) -> str:
        try:
            name = agent.query_xfer_backend(handle)
        except Exception:  # noqa: BLE001 - attribution only
            logger.debug("query_xfer_backend failed", exc_info=True)
            return self.backends[0] if self.backends else "unknown"
        return name.decode() if isinstance(name, bytes) else str(name)

    def _release(self, agent: NixlAgent, handle: NixlHandle) -> None:
        # it fails e.g. while still in flight after a timeout
        if not release_logged(self.engine_id, "releasing a transfer handle (retried at close)",
                              agent.release_xfer_handle, handle):
            self.stuck.append(handle)

    def release_stuck(self, agent: NixlAgent) -> None:
        """Release the handles whose release failed earlier (after draining the agent)."""
        for handle in self.stuck:
            release_logged(self.engine_id, "releasing a transfer handle at close",
                           agent.release_xfer_handle, handle)
        self.stuck = []
