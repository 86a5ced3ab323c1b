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
:class:`FastPathDecision` for NIXL with a :data:`REASONS` code and a sentence saying why
(``transient`` when the prefill did not answer in time: it may only be busy). Both sides
read the other's fields by exact type (``version`` is the int 1, not ``true`` or ``1.0``;
``generation`` an int from 1 to 2**63-1). The prefill serves each connection in its own
thread, at most :data:`MAX_OFFER_CLIENTS` at once (:class:`~kvconnect.unix_server.UnixServer`),
and reads a request of at most :data:`MAX_REQUEST_BYTES` within its timeout. Units: seconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import stat
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

from kvconnect.bounded_json import version_mismatch
from kvconnect.checks import checked_seconds
from kvconnect.framing import (
    IpcError,
    PeerTimeoutError,
    check_peer,
    connect_unix,
    kernel_boot_id,
    recv_json,
    send_message,
)
from kvconnect.unix_server import UnixServer

logger = logging.getLogger(__name__)

__all__ = ["MAX_OFFER_CLIENTS", "MAX_REQUEST_BYTES", "REASONS", "WIRE_VERSION",
           "FastPathDecision", "IpcOfferServer", "default_offer_dir", "ensure_offer_dir",
           "export_socket_name", "offer_socket_path", "request_offer"]

#: the offer exchange's JSON layout; bump when a field changes meaning
WIRE_VERSION = 1
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
#: connections an offer server serves at once (more wait in the listen backlog)
MAX_OFFER_CLIENTS = 32
#: largest offer request or reply read (bytes of JSON; a real one is about 200)
MAX_REQUEST_BYTES = 64 * 1024
#: largest generation an offer may carry
_MAX_GENERATION = (1 << 63) - 1
#: longest Unix socket path (sun_path holds 108 bytes with its NUL)
_MAX_SOCKET_PATH = 107
#: symbolic links followed on the way to the offer directory before giving up (a loop)
_MAX_LINKS = 40
#: the hashed agent name in socket names (hex characters)
_NAME_CHARS = 20


def default_offer_dir() -> str:
    """Where offer and export sockets live unless ``kvconnect_ipc_dir`` says otherwise."""
    return os.path.join(tempfile.gettempdir(), f"kvconnect-nixl-{os.getuid()}")


def ensure_offer_dir(path: str) -> str:
    """Create ``path`` (mode 0700) if missing and return it; raise :class:`IpcError` unless
    it is a directory owned by us that no one else can enter, and no other user can change
    the way to it: every directory above it (symbolic links followed, each checked before
    what is found in it is trusted) must be owned by us or root and writable by no one
    else, or sticky as ``/tmp`` is (there others cannot rename or remove our entries).
    Otherwise another user could swap the checked directory for a link to one of theirs
    between this check and the bind of our sockets."""
    path = os.path.abspath(path)
    why = _unsafe_way_to(path)
    if why is not None:
        raise IpcError(f"{path}: {why}, so another user could replace the directory of our "
                       f"sockets; set kvconnect_ipc_dir to a directory whose parents only "
                       f"you or root can change (the default under /tmp is)")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise IpcError(f"cannot create the offer directory {path}: {exc.strerror or exc}; "
                       f"set kvconnect_ipc_dir to a directory you can create") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise IpcError(f"{path} must be a directory owned by uid {os.getuid()} with mode "
                       f"0700 (it is uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}); "
                       f"remove it or set kvconnect_ipc_dir to another directory")
    return path


def _unsafe_way_to(path: str) -> str | None:
    """Why a user other than us and root could change what the parents of the absolute
    ``path`` resolve to, or None. Walks from ``/`` one name at a time, following symbolic
    links by hand, and checks each directory before looking up a name in it."""
    uid = os.getuid()
    todo = [c for c in path.split("/") if c][:-1]  # the parents; the last is checked apart
    current, links = "/", 0
    while True:
        st = os.stat(current)  # a real directory: every link on the way was resolved
        if st.st_uid not in (0, uid):
            return f"{current} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{current} is writable by its group or others (mode "
                    f"{oct(st.st_mode & 0o7777)}) and not sticky")
        if not todo:
            return None
        name = todo.pop(0)
        if name == ".":
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        step = os.path.join(current, name)
        try:
            st = os.lstat(step)
        except OSError as exc:
            return f"{step} cannot be looked up ({exc.strerror or exc})"
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return f"more than {_MAX_LINKS} symbolic links on the way ({step})"
            target = os.readlink(step)
            if target.startswith("/"):
                current = "/"
            todo[:0] = [c for c in target.split("/") if c]
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"{step} is not a directory"
        current = step


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
    ``"nixl"`` (with a :data:`REASONS` ``code`` and a ``reason`` sentence). ``transient``:
    the prefill did not answer in time (busy, not refusing), so the decode may ask again
    (at ``retry_at``, a ``time.monotonic()`` instant it sets); ``offer_attempts`` counts the
    requests made for this peer."""

    route: str
    code: str | None = None
    reason: str | None = None
    offer: dict[str, Any] | None = None
    counts: dict[str, int] = field(default_factory=lambda: {
        "ipc_reads": 0, "ipc_blocks": 0, "ipc_bytes": 0, "ipc_us": 0, "ipc_host_us": 0,
        "ipc_launch_us": 0, "nixl_reads": 0})
    transient: bool = False
    retry_at: float | None = None
    offer_attempts: int = 1

    @classmethod
    def nixl(cls, code: str, detail: str = "", transient: bool = False) -> FastPathDecision:
        base = REASONS[code]
        return cls("nixl", code, f"{base}: {detail}" if detail else base, transient=transient)

    def to_json(self) -> dict[str, Any]:
        return {"route": self.route, "code": self.code, "reason": self.reason,
                "transient": self.transient, "offer_attempts": self.offer_attempts,
                **self.counts}


class IpcOfferServer:
    """Answers offer requests for one NIXL agent (prefill side): each connection in its own
    thread, at most :data:`MAX_OFFER_CLIENTS` at once, each request read within ``timeout``
    seconds (a client that stalls or drips its bytes holds only its own thread, for at most
    that long).

    ``export`` is the agent's IpcExportServer, or None with ``refusal`` = ``(code, reason)``
    saying why this worker cannot export (its code is one of :data:`REASONS` without the
    ``remote_`` prefix). Peers must run as our uid. :attr:`allowed_pids` is what the export
    server's ``allowed`` returns; :attr:`answered` counts replies, :attr:`failed` requests
    that ended in an error. :meth:`close` stops and removes the socket. ``timeout`` above 0
    and at most :data:`~kvconnect.checks.MAX_SECONDS` (ValueError otherwise)."""

    def __init__(self, directory: str, agent: str, engine_id: str, export: Any,
                 refusal: tuple[str, str] | None, timeout: float) -> None:
        if export is None and refusal is None:
            raise ValueError("IpcOfferServer needs an export server or a refusal")
        self.timeout = checked_seconds("IpcOfferServer timeout", timeout)
        self.path = offer_socket_path(directory, agent)
        self.agent = agent
        self.engine_id = engine_id
        self.export = export
        self.refusal = refusal
        self.allowed_pids: set[int] = set()
        self.answered = 0
        self.failed = 0
        self._state = threading.Lock()  # allowed_pids and the counters
        self._server = UnixServer(self.path, self._client, max_clients=MAX_OFFER_CLIENTS,
                                  name="kvc-ipc-offer")

    @property
    def active_clients(self) -> int:
        """Connections being served now."""
        return self._server.active_clients

    def allowed(self) -> set[int]:
        """Pids that asked for and were given the offer (the export server's ``allowed``)."""
        with self._state:
            return set(self.allowed_pids)

    def _client(self, conn: socket.socket) -> None:
        """One connection, in its own thread (:class:`~kvconnect.unix_server.UnixServer`)."""
        try:
            conn.settimeout(self.timeout)
            pid = check_peer(conn).pid
            request = recv_json(conn, self.timeout, max_bytes=MAX_REQUEST_BYTES)
            reply = self._reply(request, pid)
            with self._state:
                self.answered += 1  # before sending: a peer that has the reply sees it
            send_message(conn, reply)
        except (IpcError, OSError, ValueError) as exc:
            with self._state:
                self.failed += 1
            if self._server.serving:
                logger.warning("kvconnect ipc offer %s: %s", self.path, exc)

    def _reply(self, request: dict[str, Any], pid: int) -> dict[str, Any]:
        head = {"version": WIRE_VERSION, "agent": self.agent, "engine_id": self.engine_id,
                "boot_id": kernel_boot_id()}
        unsupported = version_mismatch(request.get("version"), WIRE_VERSION, "ipc_offer version") \
            if request.get("op") == "ipc_offer" else \
            f"unsupported request {request.get('op')!r:.60} (want ipc_offer)"
        if unsupported:
            return {**head, "ok": False, "code": "declined", "reason": unsupported}
        if request.get("agent") != self.agent or request.get("engine_id") != self.engine_id:
            return {**head, "ok": False, "code": "declined",
                    "reason": f"this socket serves agent {self.agent} of engine "
                              f"{self.engine_id!r}, not {request.get('agent')!r:.80} of "
                              f"{request.get('engine_id')!r:.80}"}
        if self.export is None:
            code, reason = self.refusal  # type: ignore[misc]
            return {**head, "ok": False, "code": code, "reason": reason}
        with self._state:
            self.allowed_pids.add(pid)
        return {**head, "ok": True, "offer": self.export.describe()}

    def close(self) -> None:
        """Stop answering, end open connections and remove the socket (idempotent)."""
        self._server.close()


def _is_int_in(value: object, lo: int, hi: int) -> bool:
    """``value`` is an int (not a bool) in ``[lo, hi]``."""
    return type(value) is int and lo <= value <= hi


def request_offer(directory: str, agent: str, engine_id: str, timeout: float
                  ) -> FastPathDecision:
    """Ask the prefill worker whose NIXL agent is ``agent`` (engine ``engine_id``) for its
    ipc offer: an ``"ipc"`` decision with the offer, or a ``"nixl"`` one saying why not
    (``transient`` when it did not answer within ``timeout`` seconds). Never raises for what
    a peer does or lacks; a ``timeout`` that is not above 0 and at most
    :data:`~kvconnect.checks.MAX_SECONDS` is the caller's error (ValueError)."""
    timeout = checked_seconds("request_offer timeout", timeout)
    try:
        path = offer_socket_path(directory, agent)
    except IpcError as exc:
        return FastPathDecision.nixl("refused", str(exc))
    try:
        with connect_unix(path, timeout) as sock:
            creds = check_peer(sock)
            send_message(sock, {"op": "ipc_offer", "version": WIRE_VERSION, "agent": agent,
                                "engine_id": engine_id, "pid": os.getpid(),
                                "boot_id": kernel_boot_id()})
            reply = recv_json(sock, timeout, max_bytes=MAX_REQUEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):  # from the connect: nothing listens there
        return FastPathDecision.nixl("no_endpoint", path)
    except (PeerTimeoutError, TimeoutError) as exc:
        return FastPathDecision.nixl("refused", f"{path}: {exc}", transient=True)
    except (OSError, IpcError, ValueError) as exc:
        return FastPathDecision.nixl("refused", f"{path}: {exc}")
    return _decide(reply, agent, engine_id, creds.pid)


def _decide(reply: dict[str, Any], agent: str, engine_id: str, server_pid: int
            ) -> FastPathDecision:
    mismatch = version_mismatch(reply.get("version"), WIRE_VERSION, "offer version")
    if mismatch:
        return FastPathDecision.nixl("refused", mismatch)
    if reply.get("agent") != agent or reply.get("engine_id") != engine_id:
        return FastPathDecision.nixl(
            "refused", f"the socket answers for agent {reply.get('agent')!r:.80} of engine "
                       f"{reply.get('engine_id')!r:.80}, not {agent} of {engine_id!r}")
    if reply.get("boot_id") != kernel_boot_id():
        return FastPathDecision.nixl("other_host", f"boot id {reply.get('boot_id')!r:.80} "
                                                   f"!= ours {kernel_boot_id()!r}")
    if reply.get("ok") is not True:  # declined: its code as one of ours, else remote_declined
        code, reason = reply.get("code"), reply.get("reason", "")
        reason = reason[:500] if isinstance(reason, str) else repr(reason)[:200]
        key = f"remote_{code}" if isinstance(code, str) else ""
        return FastPathDecision.nixl(key if key in REASONS else "remote_declined", reason)
    offer = reply.get("offer")
    if not isinstance(offer, dict) or not _is_int_in(offer.get("pid"), server_pid, server_pid) \
            or not isinstance(offer.get("path"), str) \
            or not _is_int_in(offer.get("generation"), 1, _MAX_GENERATION):
        return FastPathDecision.nixl("refused", f"malformed offer {offer!r:.200}")
    return FastPathDecision("ipc", offer={"path": offer["path"], "pid": server_pid,
                                          "generation": offer["generation"]})
