"""The same-host fast path's offer exchange: how a decode worker learns whether a prefill
worker's KV cache can be read through kvconnect's ``ipc`` transport (no vLLM needed).

After vLLM's NIXL handshake the decode knows the prefill worker's NIXL agent name (a UUID).
The prefill worker listens on a Unix socket named after it (:func:`offer_socket_path`) in a
directory both sides agree on (``kvconnect_ipc_dir``; default :func:`default_offer_dir`,
0700 and ours). One JSON request and one JSON reply, no fds, no pickle::

    decode  -> {"op": "ipc_offer", "version": 1, "agent", "engine_id", "pid", "boot_id"}
    prefill -> {"version": 1, "ok": true, "agent", "engine_id", "boot_id",
                "offer": {"path", "pid", "generation"}}          # IpcExportServer.describe()
            or {"version": 1, "ok": false, "code": ..., "reason": ...}

A reachable socket already means one kernel (Unix sockets do not cross hosts); the boot id
is compared as well. ``ok`` adds the decode's pid to those the prefill's
:class:`~kvconnect.connectors.ipc.transport.IpcExportServer` serves. Anything else ends in a
:class:`FastPathDecision` for NIXL with a :data:`REASONS` code and a sentence saying why.
Units: seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvconnect.framing import (
    IpcError,
    check_peer,
    connect_unix,
    kernel_boot_id,
    listen_unix,
    recv_json,
    send_message,
)

logger = logging.getLogger(__name__)

__all__ = ["OFFER_VERSION", "REASONS", "FastPathDecision", "IpcOfferServer",
           "default_offer_dir", "ensure_offer_dir", "export_socket_name", "offer_socket_path",
           "request_offer"]

#: the offer exchange's JSON layout; bump when a field changes meaning
OFFER_VERSION = 1
#: why a peer's blocks go through NIXL (``FastPathDecision.code``)
REASONS = {
    "disabled": "kvconnect_ipc is false in this engine's kv_connector_extra_config",
    "local_cache": "this engine's KV cache is not the plugin's extensible cache",
    "no_endpoint": "no offer socket for the prefill worker here (another host or /tmp, or "
                   "it is not kvconnect's connector with the fast path on)",
    "refused": "the prefill worker's offer socket refused or failed the exchange",
    "remote_plain_cache": "the prefill engine's KV cache is vLLM's own allocation",
    "remote_not_exportable": "the prefill engine's KV cache has no exportable handles",
    "remote_declined": "the prefill worker declined for another reason",
    "other_host": "the prefill worker runs under another boot id",
    "layout": "the two caches' layouts or parallelism do not pair up",
    "ipc_error": "mapping the prefill worker's memory failed",
    "copy_failed": "an ipc copy from this peer failed; later reads use NIXL",
}
#: longest Unix socket path (sun_path holds 108 bytes with its NUL)
_MAX_SOCKET_PATH = 107
#: the hashed agent name in socket names (hex characters)
_NAME_CHARS = 20


def default_offer_dir() -> str:
    """Where offer and export sockets live unless ``kvconnect_ipc_dir`` says otherwise."""
    return os.path.join(tempfile.gettempdir(), f"kvconnect-nixl-{os.getuid()}")


def ensure_offer_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing; raise :class:`IpcError` unless it is a
    directory owned by us that no one else can enter."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IpcError(f"{path} must be a directory owned by uid {os.getuid()} with mode "
                       f"0700 (it is uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); "
                       f"remove it or set kvconnect_ipc_dir to another directory")
    return path


def _agent_key(agent: str) -> str:
    return hashlib.sha256(agent.encode()).hexdigest()[:_NAME_CHARS]


def offer_socket_path(directory: str, agent: str) -> str:
    """The offer socket of the NIXL agent ``agent``; :class:`IpcError` when too long."""
    path = os.path.join(directory, f"{_agent_key(agent)}.sock")
    if len(path.encode()) > _MAX_SOCKET_PATH:
        raise IpcError(f"socket path {path!r} is longer than {_MAX_SOCKET_PATH} bytes: set "
                       f"kvconnect_ipc_dir to a shorter directory")
    return path


def export_socket_name(agent: str) -> str:
    """The ``name`` of the agent's IpcExportServer (its socket is ``<dir>/<name>.sock``)."""
    return f"{_agent_key(agent)}-x"


@dataclass
class FastPathDecision:
    """How blocks from one peer move: ``route`` ``"ipc"`` (with the export ``offer``) or
    ``"nixl"`` (with a :data:`REASONS` ``code`` and a ``reason`` sentence)."""

    route: str
    code: str | None = None
    reason: str | None = None
    offer: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {
        "ipc_reads": 0, "ipc_blocks": 0, "ipc_bytes": 0, "nixl_reads": 0})

    @classmethod
    def nixl(cls, code: str, detail: str = "") -> FastPathDecision:
        base = REASONS[code]
        return cls("nixl", code, f"{base}: {detail}" if detail else base)

    def to_json(self) -> dict[str, Any]:
        return {"route": self.route, "code": self.code, "reason": self.reason,
                **self.counts}


class IpcOfferServer:
    """Answers offer requests for one NIXL agent (prefill side), one thread.

    ``export`` is the agent's IpcExportServer, or None with ``refusal`` = ``(code, reason)``
    saying why this worker cannot export (its code is one of :data:`REASONS` without the
    ``remote_`` prefix). Peers must run as our uid. :attr:`allowed_pids` is what the export
    server's ``allowed`` returns; :attr:`answered` counts replies. :meth:`close` stops and
    removes the socket."""

    def __init__(self, directory: str, agent: str, engine_id: str, export: Any,
                 refusal: tuple[str, str] | None, timeout: float) -> None:
        if export is None and refusal is None:
            raise ValueError("IpcOfferServer needs an export server or a refusal")
        self.path = offer_socket_path(directory, agent)
        self.agent = agent
        self.engine_id = engine_id
        self.export = export
        self.refusal = refusal
        self.timeout = float(timeout)
        self.allowed_pids: set[int] = set()
        self.answered = 0
        self._open = True
        self._sock = listen_unix(self.path, 16, accept_timeout=0.2)
        self._thread = threading.Thread(target=self._serve, name="kvc-ipc-offer", daemon=True)
        self._thread.start()

    def allowed(self) -> set[int]:
        """Pids that asked for and were given the offer (the export server's ``allowed``)."""
        return set(self.allowed_pids)

    def _serve(self) -> None:
        while self._open:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(self.timeout)
                    pid = check_peer(conn).pid
                    reply = self._reply(recv_json(conn, self.timeout), pid)
                    self.answered += 1  # before sending: a peer that has the reply sees it
                    send_message(conn, reply)
                except (IpcError, OSError, ValueError) as exc:
                    logger.warning("kvconnect ipc offer %s: %s", self.path, exc)

    def _reply(self, request: dict[str, Any], pid: int) -> dict[str, Any]:
        head = {"version": OFFER_VERSION, "agent": self.agent, "engine_id": self.engine_id,
                "boot_id": kernel_boot_id()}
        if request.get("op") != "ipc_offer" or request.get("version") != OFFER_VERSION:
            return {**head, "ok": False, "code": "declined",
                    "reason": f"unsupported request {request.get('op')!r} version "
                              f"{request.get('version')!r} (want ipc_offer {OFFER_VERSION})"}
        if request.get("agent") != self.agent or request.get("engine_id") != self.engine_id:
            return {**head, "ok": False, "code": "declined",
                    "reason": f"this socket serves agent {self.agent} of engine "
                              f"{self.engine_id!r}, not {request.get('agent')!r} of "
                              f"{request.get('engine_id')!r}"}
        if self.export is None:
            code, reason = self.refusal  # type: ignore[misc]
            return {**head, "ok": False, "code": code, "reason": reason}
        self.allowed_pids.add(pid)
        return {**head, "ok": True, "offer": self.export.describe()}

    def close(self) -> None:
        """Stop answering and remove the socket (idempotent)."""
        if not self._open:
            return
        self._open = False
        self._sock.close()
        self._thread.join(timeout=2)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _declined(reply: dict[str, Any]) -> FastPathDecision:
    code = reply.get("code")
    reason = str(reply.get("reason", ""))[:500]
    key = f"remote_{code}"
    return FastPathDecision.nixl(key if key in REASONS else "remote_declined", reason)


def request_offer(directory: str, agent: str, engine_id: str, timeout: float,
                  connect: Callable[[str, float], socket.socket] = connect_unix
                  ) -> FastPathDecision:
    """Ask the prefill worker whose NIXL agent is ``agent`` (engine ``engine_id``) for its
    ipc offer: an ``"ipc"`` decision with the offer, or a ``"nixl"`` one saying why not.
    Never raises for what a peer does or lacks."""
    try:
        path = offer_socket_path(directory, agent)
    except IpcError as exc:
        return FastPathDecision.nixl("refused", str(exc))
    try:
        sock = connect(path, timeout)
    except (FileNotFoundError, NotADirectoryError):
        return FastPathDecision.nixl("no_endpoint", path)
    except (OSError, IpcError) as exc:
        return FastPathDecision.nixl("refused", f"{path}: {exc}")
    with sock:
        try:
            creds = check_peer(sock)
            send_message(sock, {"op": "ipc_offer", "version": OFFER_VERSION, "agent": agent,
                                "engine_id": engine_id, "pid": os.getpid(),
                                "boot_id": kernel_boot_id()})
            reply = recv_json(sock, timeout)
        except (OSError, IpcError, ValueError) as exc:
            return FastPathDecision.nixl("refused", f"{path}: {exc}")
    return _decide(reply, agent, engine_id, creds.pid)


def _decide(reply: dict[str, Any], agent: str, engine_id: str, server_pid: int
            ) -> FastPathDecision:
    if reply.get("version") != OFFER_VERSION:
        return FastPathDecision.nixl("refused", f"offer version {reply.get('version')!r}, "
                                                f"want {OFFER_VERSION}")
    if reply.get("agent") != agent or reply.get("engine_id") != engine_id:
        return FastPathDecision.nixl(
            "refused", f"the socket answers for agent {reply.get('agent')!r} of engine "
                       f"{reply.get('engine_id')!r}, not {agent} of {engine_id!r}")
    if reply.get("boot_id") != kernel_boot_id():
        return FastPathDecision.nixl("other_host", f"boot id {reply.get('boot_id')!r} "
                                                   f"!= ours {kernel_boot_id()!r}")
    if reply.get("ok") is not True:
        return _declined(reply)
    offer = reply.get("offer")
    if not isinstance(offer, dict) or offer.get("pid") != server_pid \
            or not isinstance(offer.get("path"), str) \
            or not isinstance(offer.get("generation"), int):
        return FastPathDecision.nixl("refused", f"malformed offer {offer!r:.200}")
    return FastPathDecision("ipc", offer={"path": offer["path"], "pid": server_pid,
                                          "generation": offer["generation"]})
