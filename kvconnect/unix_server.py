"""A Unix-socket server that serves each client in its own thread, a bounded number at once
(torch-free): the ipc export server and the fast path's offer server are built on it.

One thread accepts; each accepted connection is handed to ``handle(conn)`` in a thread of
its own, so a client that connects and stalls (or drips its request a byte at a time) holds
only its own thread, never the clients behind it. At most ``max_clients`` connections are
served at once: the acceptor stops accepting while every slot is taken, and further clients
wait in the listen backlog (Linux answers a connect to a full backlog with EAGAIN, which
:func:`kvconnect.framing.connect_unix` retries until its deadline). ``handle`` bounds its own
reads (a timeout per message); the server closes the connection when it returns or raises.
:meth:`UnixServer.close` stops accepting, shuts every open connection down so that blocked
reads return, waits briefly for the client threads and removes the socket. Units: seconds.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from .framing import listen_unix

__all__ = ["UnixServer"]

log = logging.getLogger(__name__)

#: how often (seconds) the acceptor looks at whether it should stop
_POLL_S = 0.2


class UnixServer:
    """Serves the Unix socket ``path`` (created mode 0600, see
    :func:`~kvconnect.framing.listen_unix`): ``handle(conn)`` runs once per connection in a
    thread named ``name``, at most ``max_clients`` at once. An exception ``handle`` lets out is
    logged and the connection closed (``handle`` reports its own failures); the server goes
    on. :attr:`active_clients` counts connections being served now, :attr:`accepted` all of
    them."""

    def __init__(self, path: str, handle: Callable[[socket.socket], None], *,
                 max_clients: int, name: str, backlog: int = socket.SOMAXCONN) -> None:
        if max_clients < 1:
            raise ValueError(f"max_clients must be at least 1, got {max_clients}")
        self.path = path
        self.name = name
        self.max_clients = max_clients
        self.accepted = 0
        self._handle = handle
        self._open = True
        self._state = threading.Lock()  # the client set
        self._slots = threading.BoundedSemaphore(max_clients)
        self._clients: dict[threading.Thread, socket.socket] = {}
        self._sock = listen_unix(path, backlog, accept_timeout=_POLL_S)
        self._thread = threading.Thread(target=self._accept_loop, name=name, daemon=True)
        self._thread.start()

    @property
    def active_clients(self) -> int:
        """Connections being served now."""
        with self._state:
            return len(self._clients)

    @property
    def serving(self) -> bool:
        """True until :meth:`close`."""
        return self._open

    def _accept_loop(self) -> None:
        while self._open:
            if not self._slots.acquire(timeout=_POLL_S):
                continue  # every slot busy: connections wait in the backlog
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:  # closed under us: close() was called
                self._slots.release()
                return
            thread = threading.Thread(target=self._client, args=(conn,), daemon=True,
                                      name=f"{self.name}-client")
            with self._state:
                self._clients[thread] = conn
                self.accepted += 1
            try:
                thread.start()
            except BaseException:  # no thread (resources): the connection is ours to close
                with self._state:
                    self._clients.pop(thread, None)
                conn.close()
                self._slots.release()
                raise

    def _client(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._handle(conn)
        except Exception:  # handle() reports its own failures; this one slipped through
            log.exception("%s: a client's handler failed", self.name)
        finally:
            with self._state:
                self._clients.pop(threading.current_thread(), None)
            self._slots.release()

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, shut every client's connection down, wait at most ``timeout``
        seconds for their threads, remove the socket. Idempotent."""
        if not self._open:
            return
        self._open = False
        try:
            self._sock.close()
        finally:
            self._thread.join(timeout=timeout)
            with self._state:
                clients = list(self._clients.items())
            for _, conn in clients:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for thread, _ in clients:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            # the owner usually holds this server and ``handle`` is its bound method: drop it,
            # so that the owner (and what it serves: a KV cache) is freed by reference counting
            # once released, not at some later garbage collection
            self._handle = _closed
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _closed(conn: socket.socket) -> None:
    """The handler of a closed server (no connection reaches it)."""
