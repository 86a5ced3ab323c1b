"""Authenticated sessions over a connected Unix socket: only the announced peer may talk,
and every message it sends is taken once, in order, unchanged (torch-free).

Both ends first check the other with SO_PEERCRED (:func:`kvconnect.framing.check_peer`):
its uid (default: ours) and its pid (the acceptor: an allow-list of announced peers; the
connector: the one pid it was told serves the socket). Then a challenge-response derives a
fresh key for this connection::

    acceptor  -> connector  {"op": "challenge", "protocol": PROTOCOL, "nonce": N_a}
    connector -> acceptor   {"op": "hello", "protocol": PROTOCOL, "nonce": N_c,
                             "proof": HMAC(k, "connector")}
    acceptor  -> connector  {"op": "ready", "proof": HMAC(k, "acceptor")}

    k = HMAC-SHA256(token, PROTOCOL | N_a | N_c)      (nonces: 32 random bytes, hex)

From then on every MESSAGE and ERROR frame is sealed with ``k`` (:class:`~kvconnect.framing.FrameSeal`:
a sequence number per direction and an HMAC over it and the JSON). What each part stops:

- another uid, or a same-uid process whose pid was not announced: refused by SO_PEERCRED
  before anything is read from it (the acceptor tells it why in an ERROR frame);
- a process that holds an announced pid but not the session ``token`` (a recycled pid, a
  process of the same user started by someone else): its proof does not verify. With the
  default empty token this check is void and SO_PEERCRED is the only identity check;
- a frame recorded on one connection and replayed on another: the key differs (new nonces);
- a frame replayed, reordered, dropped or sent back on the same connection: the sequence
  number or the direction label does not match;
- a changed byte, or an unsealed frame injected into the stream: the MAC does not verify.

Nothing here is encrypted: the socket is local and its directory private (0700); sealing
authenticates, it does not hide. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

from .framing import (
    MAX_FDS,
    FrameSeal,
    IpcError,
    PeerCredentials,
    PeerError,
    PeerRefusedError,
    check_peer,
    recv_json,
    recv_message,
    send_error,
    send_message,
)

__all__ = [
    "DEFAULT_HANDSHAKE_TIMEOUT_S", "PROTOCOL", "PeerSession", "accept_session",
    "connect_session", "new_session_token",
]

#: protocol tag both ends must agree on; another tag is refused
PROTOCOL = "kvconnect.session/1"
#: seconds the whole handshake may take, by default
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
_NONCE_BYTES = 32
_HEX64 = re.compile(r"[0-9a-f]{64}")
_TO_CONNECTOR, _TO_ACCEPTOR = b"acceptor->connector", b"connector->acceptor"


def new_session_token() -> bytes:
    """32 random bytes to share among the processes of one run (through a channel that is
    already trusted, e.g. the launcher's environment or the coordinator's socket)."""
    return secrets.token_bytes(32)


def _check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)):
        raise TypeError(f"a session token is bytes, got {type(token).__name__}")
    if token and len(token) < 16:
        raise ValueError(f"a session token needs at least 16 bytes (or none), got {len(token)}")
    return bytes(token)


def _key(token: bytes, acceptor_nonce: bytes, connector_nonce: bytes) -> bytes:
    return hmac.new(token, PROTOCOL.encode() + acceptor_nonce + connector_nonce,
                    hashlib.sha256).digest()


def _proof(key: bytes, who: bytes) -> str:
    return hmac.new(key, b"proof:" + who, hashlib.sha256).hexdigest()


def _field(msg: dict[str, Any], op: str, name: str) -> str:
    """A 64-hex-digit field of handshake message ``op``, or PeerRefusedError."""
    value = msg.get(name)
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise PeerRefusedError(f"session handshake: {op!r} needs {name} as 64 hex digits")
    return value


def _expect(msg: dict[str, Any], op: str) -> None:
    if msg.get("op") != op:
        raise PeerRefusedError(f"session handshake: expected {op!r}, got {msg.get('op')!r:.40}")
    if op != "ready" and msg.get("protocol") != PROTOCOL:
        raise PeerRefusedError(f"peer speaks session protocol {msg.get('protocol')!r:.60}, "
                               f"this side {PROTOCOL!r}")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise IpcError("timed out in the session handshake")
    return left


def _recv_from_acceptor(sock: socket.socket, deadline: float) -> dict[str, Any]:
    """A handshake message from the acceptor; its refusal becomes PeerRefusedError here."""
    try:
        msg = recv_json(sock, _left(deadline))
    except PeerError as exc:
        if exc.remote_type == PeerRefusedError.__name__:
            raise PeerRefusedError(f"the acceptor refused us: {exc.remote_message}") from None
        raise
    return msg


class PeerSession:
    """One authenticated connection (from :func:`accept_session` / :func:`connect_session`).

    Owns its socket: :meth:`close` closes it (idempotent; also on ``with`` exit). ``peer``
    are the other end's credentials as the kernel reported them. Every message is sealed;
    after any :class:`IpcError` from :meth:`recv` the stream is out of step: close it.
    """

    def __init__(self, sock: socket.socket, peer: PeerCredentials, seal: FrameSeal) -> None:
        self.sock = sock
        self.peer = peer
        self._seal = seal

    @property
    def messages_sent(self) -> int:
        """Sealed frames sent so far (messages and errors)."""
        return self._seal.send_seq

    @property
    def messages_received(self) -> int:
        """Sealed frames received and verified so far."""
        return self._seal.recv_seq

    def send(self, payload: dict, fds: Sequence[int] = ()) -> None:
        """:func:`~kvconnect.framing.send_message`, sealed."""
        send_message(self.sock, payload, fds, seal=self._seal)

    def recv(self, timeout: float | None = None,
             max_fds: int = MAX_FDS) -> tuple[dict, list[int]]:
        """:func:`~kvconnect.framing.recv_message`, refusing anything not sealed by the peer
        with the next sequence number."""
        return recv_message(self.sock, timeout, max_fds, seal=self._seal)

    def recv_json(self, timeout: float | None = None) -> dict:
        """One message that carries no fds (:func:`~kvconnect.framing.recv_json`, sealed)."""
        return recv_json(self.sock, timeout, seal=self._seal)

    def send_error(self, error: BaseException | str) -> bool:
        """Tell the peer this side failed (sealed); best effort, never raises."""
        return send_error(self.sock, error, seal=self._seal)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def accept_session(sock: socket.socket, *,
                   allowed_pids: Collection[int] | Callable[[], Collection[int]] | None,
                   uid: int | None = None, token: bytes = b"",
                   timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> PeerSession:
    """The acceptor's side (the end that ``accept``\\ ed ``sock``).

    ``allowed_pids``: the announced peers (a collection, or a callable returning one at
    accept time); ``None`` lets any pid of ``uid`` in (only SO_PEERCRED's uid check).
    ``token``: the run's shared secret (empty: none). Takes ownership of ``sock``: on
    failure it is closed, after the peer was told why in an ERROR frame. Raises
    :class:`~kvconnect.framing.PeerRefusedError` for a peer that may not talk to us,
    :class:`~kvconnect.framing.IpcError` for a malformed or late handshake.
    """
    deadline = time.monotonic() + float(timeout)
    try:
        token = _check_token(token)
        pids = allowed_pids() if callable(allowed_pids) else allowed_pids
        try:
            creds = check_peer(sock, allowed_pids=pids, uid=uid)
            nonce = secrets.token_bytes(_NONCE_BYTES)
            send_message(sock, {"op": "challenge", "protocol": PROTOCOL, "nonce": nonce.hex()})
            hello = recv_json(sock, _left(deadline))
            _expect(hello, "hello")
            peer_nonce = bytes.fromhex(_field(hello, "hello", "nonce"))
            key = _key(token, nonce, peer_nonce)
            if not hmac.compare_digest(_field(hello, "hello", "proof"),
                                       _proof(key, b"connector")):
                raise PeerRefusedError(f"refused peer pid {creds.pid}: its session proof does "
                                       "not verify (another session token, or a hello "
                                       "replayed from another connection)")
        except PeerRefusedError as exc:
            send_error(sock, exc)
            raise
        send_message(sock, {"op": "ready", "proof": _proof(key, b"acceptor")})
        return PeerSession(sock, creds, FrameSeal(key, _TO_CONNECTOR, _TO_ACCEPTOR))
    except BaseException:
        sock.close()
        raise


def connect_session(sock: socket.socket, *, expected_pid: int | None, uid: int | None = None,
                    token: bytes = b"",
                    timeout: float = DEFAULT_HANDSHAKE_TIMEOUT_S) -> PeerSession:
    """The connector's side (``sock`` is connected to the acceptor).

    ``expected_pid``: the pid announced as serving the socket (``None``: any pid of
    ``uid``). Takes ownership of ``sock`` (closed on failure). Raises
    :class:`~kvconnect.framing.PeerRefusedError` when the acceptor is not who we expect, or
    refused us (its reason is in the message), :class:`~kvconnect.framing.IpcError` for a
    malformed or late handshake.
    """
    deadline = time.monotonic() + float(timeout)
    try:
        token = _check_token(token)
        pids = None if expected_pid is None else (int(expected_pid),)
        creds = check_peer(sock, allowed_pids=pids, uid=uid)
        challenge = _recv_from_acceptor(sock, deadline)
        _expect(challenge, "challenge")
        peer_nonce = bytes.fromhex(_field(challenge, "challenge", "nonce"))
        nonce = secrets.token_bytes(_NONCE_BYTES)
        key = _key(token, peer_nonce, nonce)
        send_message(sock, {"op": "hello", "protocol": PROTOCOL, "nonce": nonce.hex(),
                            "proof": _proof(key, b"connector")})
        ready = _recv_from_acceptor(sock, deadline)
        _expect(ready, "ready")
        if not hmac.compare_digest(_field(ready, "ready", "proof"), _proof(key, b"acceptor")):
            raise PeerRefusedError(f"the acceptor pid {creds.pid} failed its session proof "
                                   "(another session token)")
        return PeerSession(sock, creds, FrameSeal(key, _TO_ACCEPTOR, _TO_CONNECTOR))
    except BaseException:
        sock.close()
        raise
