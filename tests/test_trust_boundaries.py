"""Trust boundaries of the IPC socket: who may connect, and that a message is taken only
from the announced peer, only once, unchanged (kvconnect.session over kvconnect.framing).

Real Unix sockets in a private directory, real SO_PEERCRED, real processes: one of another
uid (``nobody``, through ``os.setuid`` in a forked child; needs root), one of our uid whose
pid was not announced. Replays and forgeries are made from the bytes a real session put on
the wire, recorded by a relay between the two ends.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import pwd
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.framing import (
    MAGIC,
    IpcError,
    PeerError,
    PeerRefusedError,
    private_socket_dir,
    recv_message,
    send_message,
)
from kvconnect.session import (
    PROTOCOL,
    PeerSession,
    accept_session,
    connect_session,
    new_session_token,
)

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 20.0
TOKEN = b"t" * 32


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening Unix socket in a fresh 0700 directory (both removed afterwards)."""
    with private_socket_dir("kvc-trust-") as d:
        path = os.path.join(d, "s.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            srv.bind(path)
            os.chmod(path, 0o600)
            srv.listen(4)
            srv.settimeout(DEADLINE_S)
            yield srv, path
        finally:
            srv.close()


def in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` in a thread; the returned callable joins it (with a deadline) and returns
    its result or raises its exception."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the joiner
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join() -> Any:
        t.join(DEADLINE_S)
        assert not t.is_alive(), "thread did not finish within its deadline"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return join


def session_pair(token_a: bytes = TOKEN, token_c: bytes = TOKEN
                 ) -> tuple[PeerSession, PeerSession]:
    """(acceptor, connector) sessions over a socketpair in this process."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    join = in_thread(lambda: accept_session(a, allowed_pids={os.getpid()}, token=token_a))
    conn = connect_session(c, expected_pid=os.getpid(), token=token_c)
    return join(), conn


# -- a session works, and owns its socket ----------------------------------------------------------

def test_session_carries_messages_and_fds(listener) -> None:
    """An accepted session carries sealed messages with fds both ways and an error
    frame; both ends count what they sent and verified; no fd is left open."""
    srv, path = listener
    before = open_fds()
    cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cli.connect(path)

    def serve() -> PeerSession:
        conn, _ = srv.accept()
        return accept_session(conn, allowed_pids=lambda: {os.getpid()}, token=TOKEN)

    join = in_thread(serve)
    with connect_session(cli, expected_pid=os.getpid(), token=TOKEN) as c, join() as a:
        assert a.peer.pid == c.peer.pid == os.getpid() and a.peer.uid == os.getuid()
        r, w = os.pipe()
        try:
            c.send({"op": "x", "n": 1}, [w])
            msg, fds = a.recv(timeout=5)
            assert msg == {"op": "x", "n": 1} and len(fds) == 1
            os.write(fds[0], b"!")
            assert os.read(r, 1) == b"!"
            os.close(fds[0])
        finally:
            os.close(r)
            os.close(w)
        a.send({"op": "y"})
        assert c.recv_json(timeout=5) == {"op": "y"}
        assert a.send_error(RuntimeError("boom"))
        with pytest.raises(PeerError) as err:
            c.recv_json(timeout=5)
        assert (err.value.remote_type, err.value.remote_message) == ("RuntimeError", "boom")
        assert (a.messages_sent, a.messages_received) == (2, 1)
        assert (c.messages_sent, c.messages_received) == (1, 2)
    assert open_fds() == before


# -- who may connect ---------------------------------------------------------------------------

def _child_as_nobody(path: str) -> dict[str, Any]:
    """Fork a child that drops to ``nobody`` and runs connect_session against ``path``;
    returns what it reported (JSON over a pipe)."""
    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of ours; report and _exit
        result: dict[str, Any] = {}
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            result["uid"] = os.getuid()
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
            except OSError as exc:
                sock.close()
                result["connect_errno"] = exc.errno
            else:
                try:
                    connect_session(sock, expected_pid=None, uid=0, token=TOKEN, timeout=10)
                    result["session"] = "established"
                except IpcError as exc:
                    result["error_type"] = type(exc).__name__
                    result["error"] = str(exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            result["child_error"] = repr(exc)
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], DEADLINE_S)
        assert ready, "the nobody child did not report within its deadline"
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as nobody")
def test_another_uid_is_refused(listener) -> None:
    """A process running as ``nobody`` cannot reach the socket in its 0700 directory; with
    the directory and socket opened to everyone on purpose, SO_PEERCRED refuses it."""
    srv, path = listener
    # 1. The private directory keeps it out: connect() fails with EACCES.
    got = _child_as_nobody(path)
    assert got.get("uid") == pwd.getpwnam("nobody").pw_uid
    assert got.get("connect_errno") == 13, got  # EACCES
    srv.settimeout(0.2)
    with pytest.raises(TimeoutError):
        srv.accept()  # nothing got through
    # 2. Filesystem opened: the connection is made, and refused by uid.
    os.chmod(os.path.dirname(path), 0o711)
    os.chmod(path, 0o777)
    srv.settimeout(DEADLINE_S)
    join = in_thread(lambda: _child_as_nobody(path))
    conn, _ = srv.accept()
    with pytest.raises(PeerRefusedError) as err:
        accept_session(conn, allowed_pids=None, token=TOKEN)
    assert f"runs as uid {pwd.getpwnam('nobody').pw_uid}, expected uid 0" in str(err.value)
    assert conn.fileno() == -1  # the session took the socket and closed it
    report = join()
    assert report.get("error_type") == "PeerRefusedError", report
    assert "the acceptor refused us" in report["error"] and "session" not in report


_SAME_UID_CHILD = r"""
import json, socket, sys
from kvconnect.framing import IpcError
from kvconnect.session import connect_session
path, server_pid, token = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
out = {"pid": __import__("os").getpid()}
try:
    s = connect_session(sock, expected_pid=server_pid, token=token, timeout=10)
    s.send({"op": "hi"})
    out["session"] = "established"
    out["reply"] = s.recv_json(timeout=10)
    s.close()
except IpcError as exc:
    out["error_type"], out["error"] = type(exc).__name__, str(exc)
print("KVC " + json.dumps(out), flush=True)
"""


def _run_same_uid_child(srv: socket.socket, path: str, token: bytes,
                        serve: Callable[[socket.socket, int], Any]) -> tuple[Any, dict]:
    """Start a same-uid child that connects to ``path``; ``serve(conn, child_pid)`` handles
    the accepted connection; returns (what serve returned or raised, the child's report)."""
    proc = subprocess.Popen([sys.executable, "-c", _SAME_UID_CHILD, path, str(os.getpid()),
                             token.hex()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT)
    try:
        conn, _ = srv.accept()
        try:
            outcome: Any = serve(conn, proc.pid)
        except IpcError as exc:
            outcome = exc
        out, errs = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE_S)
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("KVC ")]
    assert lines, f"child reported nothing; stderr: {errs.decode()[-2000:]}"
    return outcome, json.loads(lines[-1][4:])


def test_same_uid_process_not_announced_is_refused(listener) -> None:
    """A process of our uid whose pid was not announced is refused at accept
    (SO_PEERCRED pid allow-list) and told so; the same process, announced, gets its
    session."""
    srv, path = listener
    other = os.getpid()  # the announced peer is some other process (here: us)
    refused, report = _run_same_uid_child(
        srv, path, TOKEN, lambda conn, _: accept_session(conn, allowed_pids={other},
                                                         token=TOKEN))
    assert isinstance(refused, PeerRefusedError)
    assert f"refused peer pid {report['pid']} (uid {os.getuid()}): not an announced peer" \
        in str(refused)
    assert report["error_type"] == "PeerRefusedError" and "session" not in report

    # Control: the same child, announced, gets its session and a sealed reply.
    def serve(conn: socket.socket, child: int) -> dict:
        with accept_session(conn, allowed_pids=lambda: {child}, token=TOKEN) as s:
            msg = s.recv_json(timeout=10)
            s.send({"op": "hello-back", "got": msg})
            return msg

    got, report = _run_same_uid_child(srv, path, TOKEN, serve)
    assert got == {"op": "hi"}
    assert report["session"] == "established"
    assert report["reply"] == {"op": "hello-back", "got": {"op": "hi"}}


def test_announced_pid_without_the_token_is_refused(listener) -> None:
    """A process holding an announced pid (e.g. a recycled one) but not the run's token is
    refused: its session proof does not verify, and it is told so."""
    srv, path = listener
    refused, report = _run_same_uid_child(
        srv, path, new_session_token(),
        lambda conn, child: accept_session(conn, allowed_pids={child}, token=TOKEN))
    assert isinstance(refused, PeerRefusedError) and "proof does not verify" in str(refused)
    assert report["error_type"] == "PeerRefusedError"
    assert "the acceptor refused us" in report["error"]


def test_connector_refuses_a_socket_served_by_another_pid() -> None:
    """A connector refuses a socket served by a pid other than the announced one, before
    sending anything."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(PeerRefusedError, match=f"refused peer pid {os.getpid()}"):
            connect_session(c, expected_pid=os.getpid() + 100000, token=TOKEN)
        assert c.fileno() == -1
        a.settimeout(0.2)
        assert a.recv(16) == b""  # nothing was sent to the impostor
    finally:
        a.close()


def test_an_acceptor_without_the_token_is_refused() -> None:
    """An acceptor that does not hold the run's token is refused by the connector (and
    refuses it)."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    join = in_thread(lambda: accept_session(a, allowed_pids={os.getpid()},
                                            token=b"x" * 32))
    with pytest.raises(PeerRefusedError, match="proof does not verify"):
        connect_session(c, expected_pid=os.getpid(), token=TOKEN)
    # the acceptor refused the connector's proof first and said so
    with pytest.raises(PeerRefusedError, match="proof does not verify"):
        join()


@pytest.mark.parametrize(("challenge", "error"), [
    ({"op": "challenge", "protocol": "kvconnect.session/0", "nonce": "0" * 64},
     "peer speaks session protocol 'kvconnect.session/0'"),
    ({"op": "challenge", "protocol": PROTOCOL, "nonce": "zz"}, "nonce as 64 hex digits"),
    ({"op": "chunks", "protocol": PROTOCOL}, "expected 'challenge'"),
])
def test_handshake_of_another_version_is_refused(challenge: dict, error: str) -> None:
    """A handshake of another protocol version, a malformed nonce or an unexpected
    message is refused."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        send_message(a, challenge)
        with pytest.raises(PeerRefusedError, match=error):
            connect_session(c, expected_pid=os.getpid(), token=TOKEN, timeout=5)
    finally:
        a.close()


def test_handshake_has_a_deadline() -> None:
    """A handshake the peer never answers ends at its deadline with IpcError."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        t0 = time.monotonic()
        with pytest.raises(IpcError, match="timed out"):
            connect_session(c, expected_pid=os.getpid(), token=TOKEN, timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        a.close()


# -- forged and replayed messages ----------------------------------------------------------------

class Relay:
    """Two sessions with this relay on the wire between them: every byte either end sends
    arrives here first (recorded), and goes on only when the test delivers it."""

    def __init__(self) -> None:
        self.acceptor_app, self.acceptor_wire = socket.socketpair(socket.AF_UNIX,
                                                                  socket.SOCK_STREAM)
        self.connector_app, self.connector_wire = socket.socketpair(socket.AF_UNIX,
                                                                    socket.SOCK_STREAM)
        self.hello = b""  # the connector's handshake reply, as it went over the wire
        stop = threading.Event()
        pump = threading.Thread(target=self._pump_handshake, args=(stop,), daemon=True)
        pump.start()
        try:
            join = in_thread(lambda: accept_session(self.acceptor_app,
                                                    allowed_pids={os.getpid()}, token=TOKEN))
            self.connector = connect_session(self.connector_app, expected_pid=os.getpid(),
                                             token=TOKEN)
            self.acceptor = join()
        finally:
            stop.set()
            pump.join(DEADLINE_S)

    def _pump_handshake(self, stop: threading.Event) -> None:
        wires = {self.acceptor_wire: self.connector_wire,
                 self.connector_wire: self.acceptor_wire}
        while not stop.is_set():
            ready, _, _ = select.select(list(wires), [], [], 0.01)
            for src in ready:
                data = src.recv(65536)
                if src is self.connector_wire:
                    self.hello += data
                wires[src].sendall(data)

    def take(self, wire: socket.socket) -> bytes:
        """Every byte waiting on ``wire`` (what one end sent), not delivered."""
        wire.settimeout(2)
        data = wire.recv(65536)
        wire.setblocking(False)
        try:
            while more := wire.recv(65536):
                data += more
        except BlockingIOError:
            pass
        return data

    def close(self) -> None:
        for s in (self.acceptor, self.connector):
            s.close()
        self.acceptor_wire.close()
        self.connector_wire.close()


@pytest.fixture
def relay() -> Iterator[Relay]:
    r = Relay()
    try:
        yield r
    finally:
        r.close()


def test_a_sealed_message_is_taken_once(relay: Relay) -> None:
    """A sealed message recorded on the wire and delivered again is refused as replayed."""
    relay.connector.send({"op": "transfer", "blocks": [1, 2]})
    wire = relay.take(relay.connector_wire)
    assert wire.startswith(MAGIC)
    relay.acceptor_wire.sendall(wire)
    assert relay.acceptor.recv_json(timeout=5) == {"op": "transfer", "blocks": [1, 2]}
    relay.acceptor_wire.sendall(wire)  # the same bytes again
    with pytest.raises(IpcError, match="refused frame number 0, expected 1: replayed"):
        relay.acceptor.recv_json(timeout=5)


def test_a_dropped_message_is_noticed(relay: Relay) -> None:
    """A message dropped on the wire is noticed: the next one is refused as out of
    order."""
    relay.connector.send({"op": "first"})
    relay.take(relay.connector_wire)  # never delivered
    relay.connector.send({"op": "second"})
    relay.acceptor_wire.sendall(relay.take(relay.connector_wire))
    with pytest.raises(IpcError, match="frame number 1, expected 0: out of order"):
        relay.acceptor.recv_json(timeout=5)


def test_a_tampered_message_is_refused(relay: Relay) -> None:
    """One changed byte in a sealed message (a block id) makes its seal fail."""
    relay.connector.send({"op": "transfer", "blocks": [1, 2]})
    wire = bytearray(relay.take(relay.connector_wire))
    at = wire.index(b"[1,2]")
    wire[at + 1] = ord("7")  # blocks [7, 2]
    relay.acceptor_wire.sendall(bytes(wire))
    with pytest.raises(IpcError, match="seal does not verify"):
        relay.acceptor.recv_json(timeout=5)


def test_a_message_sent_back_to_its_sender_is_refused(relay: Relay) -> None:
    """A sealed message reflected back to its sender does not verify (direction labels)."""
    relay.acceptor.send({"op": "ready-to-send"})
    wire = relay.take(relay.acceptor_wire)
    relay.acceptor_wire.sendall(wire)  # reflected to the acceptor itself
    with pytest.raises(IpcError, match="seal does not verify"):
        relay.acceptor.recv_json(timeout=5)


def test_unsealed_frames_are_refused_inside_a_session(relay: Relay) -> None:
    """A well-formed but unsealed message injected into a session is refused."""
    send_message(relay.acceptor_wire, {"op": "forged"})  # well-formed, but not sealed
    with pytest.raises(IpcError, match="unsealed frame inside an authenticated session"):
        relay.acceptor.recv_json(timeout=5)


def test_unsealed_error_frames_are_refused_inside_a_session(relay: Relay) -> None:
    """An unsealed ERROR frame injected into a session is refused, not taken as the
    peer's failure."""
    from kvconnect.framing import send_error

    send_error(relay.acceptor_wire, RuntimeError("forged failure"))
    with pytest.raises(IpcError, match="unsealed frame") as err:
        relay.acceptor.recv_json(timeout=5)
    assert not isinstance(err.value, PeerError)


def test_messages_of_another_connection_are_refused() -> None:
    """A message recorded on one connection does not verify on another, and a recorded
    handshake reply replayed to a new challenge is refused."""
    first = Relay()
    second = Relay()
    try:
        first.connector.send({"op": "transfer", "blocks": [3]})
        # recorded on the first connection, replayed into the second at the same position
        second.acceptor_wire.sendall(first.take(first.connector_wire))
        with pytest.raises(IpcError, match="seal does not verify"):
            second.acceptor.recv_json(timeout=5)
        # a whole recorded handshake reply, replayed to a fresh acceptor's new challenge
        a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        join = in_thread(lambda: accept_session(a, allowed_pids={os.getpid()}, token=TOKEN))
        try:
            recv_message(c, timeout=5)  # the new challenge (ignored by the replayer)
            c.sendall(first.hello)
            with pytest.raises(PeerRefusedError, match="proof does not verify"):
                join()
            with pytest.raises(PeerError, match="proof does not verify"):
                recv_message(c, timeout=5)  # the acceptor said why
        finally:
            c.close()
    finally:
        first.close()
        second.close()


# -- nothing is unpickled ---------------------------------------------------------------------

class _Tripwire:
    """Unpickling this creates a file: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_payload_is_rejected_as_not_json(tmp_path: Path) -> None:
    """A frame and a handshake document carrying a pickle are rejected as not JSON, and
    the pickle's payload never runs (a tripwire file stays absent)."""
    from kvconnect.connectors.nixl.handshake import HandshakeMetadata, MetadataError

    trip = tmp_path / "unpickled"
    payload = pickle.dumps({"op": "chunks", "x": _Tripwire(str(trip))})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        import struct

        a.sendall(struct.pack(">4sBBHII", MAGIC, 1, 0, 0, len(payload), 0) + payload)
        with pytest.raises(IpcError, match="invalid JSON"):
            recv_message(b, timeout=5)
    finally:
        a.close()
        b.close()
    with pytest.raises(MetadataError, match="not valid JSON"):
        HandshakeMetadata.from_json(payload)
    assert not trip.exists()
    pickle.loads(payload)  # the tripwire works: unpickling would have created the file
    assert trip.exists()


#: modules whose loaders execute code from the bytes they read
_UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill",
                       "cloudpickle", "jsonpickle", "joblib", "copyreg"}
#: calls that unpickle what they are given (torch.load, numpy.load with pickles, torch's
#: *_object collectives, multiprocessing connections and queues)
_UNPICKLING_CALLS = {"load", "loads", "broadcast_object_list", "all_gather_object",
                     "gather_object", "scatter_object_list", "recv_object_list",
                     "recv_object", "eval", "exec"}
_UNPICKLING_OWNERS = {"torch", "np", "numpy", "dist", "pickle", "marshal", "yaml"}


def _unpickling_sites(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names
                      if a.name.split(".")[0] in _UNPICKLING_MODULES | {"multiprocessing"}]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _UNPICKLING_MODULES | {"multiprocessing"}:
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Name) and fn.id in {"eval", "exec", "__import__"}:
                if fn.id != "__import__":
                    found.append(f"{fn.id}()")
            elif isinstance(fn, ast.Attribute) and fn.attr in _UNPICKLING_CALLS:
                owner = fn.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name in _UNPICKLING_OWNERS or fn.attr.endswith("_object_list") or \
                        fn.attr.endswith("_object"):
                    found.append(f"{name}.{fn.attr}()")
    return found


def test_no_module_can_unpickle_what_it_receives() -> None:
    """kvconnect/, connectors/ and harness/ never import an unpickler or call one (pickle,
    marshal, shelve, torch.load, numpy.load, torch's *_object collectives, multiprocessing
    pipes and queues, eval/exec)."""
    files = sorted(p for d in ("kvconnect", "connectors", "harness")
                   for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 20
    hits = {str(p.relative_to(ROOT)): sites for p in files
            if (sites := _unpickling_sites(ast.parse(p.read_text(), str(p))))}
    assert hits == {}
    # the scanner finds what it looks for
    probe = ast.parse("import pickle\nfrom multiprocessing import Queue\nx = torch.load(f)\n"
                      "np.load(f, allow_pickle=True)\ndist.broadcast_object_list(o)\n"
                      "eval(s)\n")
    assert sorted(_unpickling_sites(probe)) == sorted([
        "import pickle", "from multiprocessing import ...", "torch.load()", "np.load()",
        "dist.broadcast_object_list()", "eval()"])
