"""Who may join a multi-host run: a shared token, proven without ever being sent.

``torch.distributed.TCPStore`` has no authentication and no encryption: whoever reaches its
port can read every key and write or delete any. A multi-host run without a token therefore
trusts the network between its hosts and every process that can connect (see
docs/validate.md, "What the rendezvous trusts").

With a token (``--rendezvous-token-file PATH`` or ``KVCONNECT_RENDEZVOUS_TOKEN``; at least
16 bytes, the same on every process):

1. the reporter (prefill rank 0) writes ``auth/mode`` with a fresh 32-byte nonce ``Nh``;
2. each other member writes ``auth/proof/<name>``: its own fresh nonce ``Nm`` and
   ``HMAC-SHA256(token, "member|<name>|Nh|Nm")``;
3. the reporter checks it and answers ``auth/verdict/<name>``: refused, or accepted with
   ``HMAC(token, "host|<name>|Nh|Nm")`` so the member knows the reporter holds the token too.
   A refused proof is cleared, so the right process may still join under that name before
   the deadline;
4. from then on every value the run reads from the store is sealed with
   ``HMAC(K, key || value)``, ``K = HMAC(token, "session|Nh")``: a value written by anyone
   without the token, or copied from another run (another ``Nh``), is refused.

The token never leaves the process; the store only sees nonces and MACs (which do not reveal
it). What a token does not give: secrecy (values are readable: block digests, layouts, NIXL
metadata, never key material), nor protection against deletion of keys or the flood of a
port (the run then fails at its deadline); heartbeat counters and phase names (display only)
are not sealed. A wrong or missing token ends the process with exit 3 and one line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import stat
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvconnect.errors import KvconnectError

from ..environment import EnvironmentProblem

log = logging.getLogger(__name__)

TOKEN_ENV = "KVCONNECT_RENDEZVOUS_TOKEN"
#: bytes a token must have at least (guessing must not be practical) and at most
MIN_TOKEN_BYTES = 16
MAX_TOKEN_BYTES = 4096
MODE_NONE = "none"
MODE_HMAC = "hmac-sha256"
#: bound on one auth value read from the store (bytes)
_MAX_AUTH_VALUE = 1024


class TokenError(KvconnectError, ValueError):
    """A token that cannot be used (exit code 2): too short, too long, unreadable file."""


class RendezvousRefused(EnvironmentProblem):
    """The token check failed (exit code 3). ``cause``: ``wrong_token`` (refused by the
    reporter), ``token_missing`` (the reporter requires one we lack), ``unauthenticated_host``
    (we hold a token, the reporter runs without), ``host_unproven`` (the reporter's proof is
    wrong), ``members_missing`` (the reporter's deadline passed without every member's
    proof), ``no_answer`` (a member's deadline passed without the reporter's answer)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class TamperedValue(KvconnectError, RuntimeError):
    """A store value whose seal is missing or wrong: not written by a member of this run."""


def load_token(path: str | None, env: Mapping[str, str],
               timeout: float = 10.0) -> bytes | None:
    """The token from ``path`` (trailing newline stripped) or ``$KVCONNECT_RENDEZVOUS_TOKEN``,
    or None; :class:`TokenError` when it cannot be used. ``path`` may be a regular file or
    a pipe (``<(vault read ...)``, a FIFO); a pipe must deliver the whole token and close
    within ``timeout`` seconds (a FIFO nobody writes is refused then, never waited on)."""
    if path is not None:
        where = f"--rendezvous-token-file {path}"
        raw, mode = _read_token_file(path, where, timeout)
        if mode & 0o077 and stat.S_ISREG(mode):
            log.warning("--rendezvous-token-file %s is readable by other users (mode %o): "
                        "chmod 600 it", path, mode & 0o777)
        token = raw.rstrip(b"\r\n")
    elif env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].encode()
        where = TOKEN_ENV
    else:
        return None
    if len(token) < MIN_TOKEN_BYTES:
        raise TokenError(f"{where}: the token has {len(token)} bytes; use at least "
                         f"{MIN_TOKEN_BYTES} random ones (e.g. `openssl rand -hex 16`)")
    if len(token) > MAX_TOKEN_BYTES:
        raise TokenError(f"{where}: the token is longer than {MAX_TOKEN_BYTES} bytes")
    return token


def _read_token_file(path: str, where: str, timeout: float) -> tuple[bytes, int]:
    """``(at most MAX_TOKEN_BYTES + 2 bytes of the file, its mode)``; never blocks past
    ``timeout`` (the file is opened and read non-blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise TokenError(f"{where}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):
            raise TokenError(f"{where}: is not a regular file or a pipe; give a file "
                             "holding the token (mode 0600)")
        raw = b""
        deadline = time.monotonic() + timeout
        wrote = not stat.S_ISFIFO(mode)  # a FIFO reads as empty until its writer came
        while len(raw) <= MAX_TOKEN_BYTES + 1:
            try:
                chunk = os.read(fd, MAX_TOKEN_BYTES + 2 - len(raw))
            except BlockingIOError:
                chunk = None
            except OSError as exc:
                raise TokenError(f"{where}: {exc.strerror or exc}") from None
            if chunk:
                raw += chunk
                wrote = True
                continue
            if chunk == b"" and wrote:
                break  # end of file
            left = deadline - time.monotonic()
            if left <= 0:
                raise TokenError(f"{where}: a pipe that delivered "
                                 f"{'no' if not raw else 'no end to its'} token within "
                                 f"{timeout:g} s (a FIFO nobody writes?)")
            select.select([fd], [], [], min(left, 0.05))
        return raw, mode
    finally:
        os.close(fd)


def _mac(key: bytes, *parts: str) -> str:
    return hmac.new(key, "|".join(parts).encode(), hashlib.sha256).hexdigest()


class Sealer:
    """Seals store values under the session key (:meth:`seal`) and checks them
    (:meth:`open`); without a token both pass values through unchanged."""

    def __init__(self, session_key: bytes | None = None) -> None:
        self._key = session_key

    @property
    def active(self) -> bool:
        return self._key is not None

    def seal(self, key: str, text: str) -> str:
        if self._key is None:
            return text
        return f"{_mac(self._key, key, text)}:{text}"

    def open(self, key: str, raw: bytes | str) -> str:
        text = raw.decode() if isinstance(raw, bytes) else raw
        if self._key is None:
            return text
        mac, sep, value = text.partition(":")
        if not sep or not hmac.compare_digest(mac, _mac(self._key, key, value)):
            raise TamperedValue(f"the store value of {key!r} is not sealed with this run's "
                                "token: written by a process outside the run, or by another run")
        return value


def _read(store: Any, key: str) -> str | None:
    """``key``'s value (text) when set, else None."""
    if not store.check([key]):
        return None
    raw = store.get(key)
    if len(raw) > _MAX_AUTH_VALUE:
        return ""  # nothing of ours is that long: treated as malformed
    return raw.decode(errors="replace")


def authenticate_reporter(store: Any, prefix: str, token: bytes | None,
                          members: Sequence[str], where: str, timeout: float) -> Sealer:
    """The reporter's side: announce the mode and, with a token, accept each of ``members``
    once it proves the token (refusing wrong proofs) within ``timeout`` seconds."""
    if token is None:
        store.set(prefix + "auth/mode", MODE_NONE)
        return Sealer()
    nonce = secrets.token_hex(32)
    store.set(prefix + "auth/mode", f"{MODE_HMAC}:{nonce}")
    waiting = set(members)
    refused: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    pause = 0.02
    while waiting:
        for name in sorted(waiting):
            key = prefix + f"auth/proof/{name}"
            text = _read(store, key)
            if not text:  # none yet, or a refused one cleared
                continue
            try:
                proof = json.loads(text)
                member_nonce, mac = str(proof["nonce"]), str(proof["mac"])
            except (ValueError, TypeError, KeyError):
                member_nonce, mac = "", ""
            ok = bool(member_nonce) and hmac.compare_digest(
                mac, _mac(token, "member", name, nonce, member_nonce))
            verdict: dict[str, Any] = {"ok": ok, "nonce": member_nonce}
            if ok:
                verdict["mac"] = _mac(token, "host", name, nonce, member_nonce)
                waiting.discard(name)
            else:
                refused[name] = refused.get(name, 0) + 1
                # cleared (only if unchanged: a new proof may have just replaced it) so the
                # right process may still come
                store.compare_set(key, text, "")
                log.info("rendezvous: refused a proof for %s (wrong token)", name)
            store.set(prefix + f"auth/verdict/{name}", json.dumps(verdict))
        if not waiting:
            break
        if time.monotonic() > deadline:
            tried = "; ".join(f"{n}: {k} attempt(s) refused for a wrong token"
                              for n, k in sorted(refused.items()))
            raise RendezvousRefused(
                f"rendezvous at {where}: {', '.join(sorted(waiting))} did not prove the "
                f"rendezvous token within --timeout {timeout:g} s"
                + (f" ({tried})" if tried else ""), "members_missing")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.2)
    return Sealer(bytes.fromhex(_mac(token, "session", nonce)))


def authenticate_member(store: Any, prefix: str, token: bytes | None, name: str,
                        where: str, timeout: float) -> Sealer:
    """A member's side: learn the reporter's mode, prove the token, check the reporter's
    proof; :class:`RendezvousRefused` (one line) when that fails, within ``timeout``."""
    deadline = time.monotonic() + timeout
    mode = _wait_for(store, prefix + "auth/mode", deadline, where,
                     "authentication mode from prefill0")
    if mode == MODE_NONE:
        if token is not None:
            raise RendezvousRefused(
                f"rendezvous at {where}: prefill0 runs without a rendezvous token but this "
                "process was given one: refusing to join an unauthenticated run",
                "unauthenticated_host")
        return Sealer()
    kind, _, nonce = mode.partition(":")
    if kind != MODE_HMAC or not nonce:
        raise RendezvousRefused(f"rendezvous at {where}: unknown authentication mode "
                                f"{mode[:40]!r}", "host_unproven")
    if token is None:
        raise RendezvousRefused(
            f"rendezvous at {where}: prefill0 requires the rendezvous token "
            f"(--rendezvous-token-file or {TOKEN_ENV}); this process has none", "token_missing")
    mine = secrets.token_hex(32)
    store.set(prefix + f"auth/proof/{name}",
              json.dumps({"nonce": mine, "mac": _mac(token, "member", name, nonce, mine)}))
    while True:
        text = _wait_for(store, prefix + f"auth/verdict/{name}", deadline, where,
                         "prefill0's answer to our token proof")
        try:
            verdict = json.loads(text)
        except ValueError:
            verdict = {}
        if isinstance(verdict, dict) and verdict.get("nonce") == mine:
            break
        if time.monotonic() > deadline:  # only answers to an earlier attempt under our name
            raise RendezvousRefused(f"rendezvous at {where}: no answer from prefill0 to our "
                                    "token proof within --timeout", "no_answer")
        time.sleep(0.05)
    if not verdict.get("ok"):
        raise RendezvousRefused(f"rendezvous at {where}: prefill0 refused {name}: this "
                                "process's rendezvous token does not match", "wrong_token")
    if not hmac.compare_digest(str(verdict.get("mac", "")),
                               _mac(token, "host", name, nonce, mine)):
        raise RendezvousRefused(f"rendezvous at {where}: the process answering as prefill0 "
                                "did not prove the token: refusing to trust it",
                                "host_unproven")
    return Sealer(bytes.fromhex(_mac(token, "session", nonce)))


def _wait_for(store: Any, key: str, deadline: float, where: str, what: str) -> str:
    pause = 0.02
    while True:
        text = _read(store, key)
        if text is not None:
            return text
        if time.monotonic() > deadline:
            raise RendezvousRefused(f"rendezvous at {where}: no {what} within --timeout "
                                    "(is prefill0 a kvconnect-validate of this version?)",
                                    "no_answer")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.2)
