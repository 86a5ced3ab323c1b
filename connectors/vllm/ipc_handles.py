"""NIXL-style transfer handles for the fast path's ipc copies
(:mod:`kvconnect.connectors.vllm.nixl_fast_path`): upstream's NixlConnector keeps them where it
keeps NIXL's (``_recving_transfers``) and polls them through the agent's ``check_xfer_state`` /
``get_xfer_telemetry`` / ``release_xfer_handle``, which :meth:`IpcXferHandles.patch_agent` makes
answer for these handles (negative ints; NIXL's are addresses) and pass every other handle
through. Units: microseconds in telemetry (NIXL's), bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["IpcXferHandles", "IpcXferTelemetry"]


@dataclass(frozen=True)
class IpcXferTelemetry:
    """What upstream's stats read from NIXL's telemetry (``xferDuration`` and
    ``postDuration`` in microseconds, ``totalBytes``, ``descCount``: blocks here)."""

    xferDuration: float  # noqa: N815 - NIXL's names
    postDuration: float  # noqa: N815
    totalBytes: int  # noqa: N815
    descCount: int  # noqa: N815


@dataclass
class _Copy:
    pending: Any  # PendingFetch: done() -> bool, wait(timeout) -> FetchResult
    on_done: Callable[[Any], None]
    on_error: Callable[[BaseException], None]
    state: str = "PROC"
    telemetry: IpcXferTelemetry | None = None


class IpcXferHandles:
    """NIXL-style handles (negative ints) for ipc copies in flight."""

    def __init__(self) -> None:
        self._copies: dict[int, _Copy] = {}
        self._next = -1
        self._lock = threading.Lock()

    def add(self, pending: Any, on_done: Callable[[Any], None],
            on_error: Callable[[BaseException], None]) -> int:
        """A handle for ``pending``; ``on_done(FetchResult)`` / ``on_error(exc)`` run once,
        when :meth:`state` first sees it finish."""
        with self._lock:
            handle, self._next = self._next, self._next - 1
            self._copies[handle] = _Copy(pending, on_done, on_error)
        return handle

    def owns(self, handle: object) -> bool:
        return isinstance(handle, int) and handle in self._copies

    def state(self, handle: int) -> str:
        """``"PROC"`` while copying, then ``"DONE"`` or ``"ERR"`` (NIXL's words)."""
        c = self._copies[handle]
        if c.state != "PROC":
            return c.state
        try:
            if not c.pending.done():
                return "PROC"
            result = c.pending.wait(0.0)
        except Exception as exc:  # the copy failed on the device
            c.state = "ERR"
            c.on_error(exc)
            return c.state
        c.state = "DONE"
        c.telemetry = IpcXferTelemetry(result.seconds * 1e6, 0.0, int(result.bytes),
                                       int(result.blocks))
        c.on_done(result)
        return c.state

    def telemetry(self, handle: int) -> IpcXferTelemetry | None:
        return self._copies[handle].telemetry

    def release(self, handle: int) -> None:
        with self._lock:
            self._copies.pop(handle, None)

    def clear(self) -> None:
        """Forget every copy (at shutdown, once the transport has waited for them): their
        callbacks refer back to the fast path, which is then freed without waiting for a
        garbage collection, and with it the peers' mappings."""
        with self._lock:
            self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)

    def patch_agent(self, agent: Any) -> None:
        """Make ``agent`` (a NIXL agent) answer for these handles, pass the rest through."""
        for name, ours in (("check_xfer_state", self.state),
                           ("get_xfer_telemetry", self.telemetry),
                           ("release_xfer_handle", self.release)):
            original = getattr(agent, name)
            setattr(agent, name, _dispatch(self.owns, ours, original))


def _dispatch(owns: Callable[[object], bool], ours: Callable[..., Any],
              original: Callable[..., Any]) -> Callable[..., Any]:
    def call(handle: Any, *args: Any, **kwargs: Any) -> Any:
        return ours(handle) if owns(handle) else original(handle, *args, **kwargs)
    return call
