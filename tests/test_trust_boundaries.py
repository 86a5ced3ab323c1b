"""Trust boundaries of the local sockets: who may connect (SO_PEERCRED over a private 0700
directory, what the coordinator and the ipc export server check), and that nothing
received is ever unpickled.

Real Unix sockets in a private directory, real SO_PEERCRED, real processes: one of another
uid (``nobody``, through ``os.setuid`` in a forked child; needs root), one of our uid whose
pid was not announced.
"""

from __future__ import annotations

import ast
import os
import pickle
import pwd
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.child import Child, LineReader, LineWriter
from kvconnect.framing import (
    MAGIC,
    IpcError,
    PeerError,
    PeerRefusedError,
    check_peer,
    private_socket_dir,
    recv_json,
    recv_message,
    send_error,
    send_message,
)

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 20.0


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


def admit(conn: socket.socket, *, allowed_pids: set[int] | None, uid: int | None = None
          ) -> dict:
    """The serving side's check: SO_PEERCRED (uid, announced pids); a refused peer is told
    why in an ERROR frame and the connection closed; an admitted one's first message."""
    try:
        check_peer(conn, allowed_pids=allowed_pids, uid=uid)
    except PeerRefusedError as exc:
        send_error(conn, exc)
        conn.close()
        raise
    try:
        msg = recv_json(conn, timeout=10)
        send_message(conn, {"op": "hello-back", "got": msg})
        return msg
    finally:
        conn.close()


# -- who may connect ---------------------------------------------------------------------------

def _say_hi(path: str) -> dict[str, Any]:
    """Connect to ``path``, send a message, read the answer: what happened, as JSON."""
    result: dict[str, Any] = {"pid": os.getpid(), "uid": os.getuid()}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        result["connect_errno"] = exc.errno
        sock.close()
        return result
    try:
        try:
            send_message(sock, {"op": "hi"})
        except BrokenPipeError:
            pass  # refused and closed first: its ERROR frame is still readable
        result["reply"] = recv_json(sock, timeout=10)
    except PeerError as exc:
        result["error_type"], result["error"] = exc.remote_type, exc.remote_message
    except IpcError as exc:
        result["error_type"], result["error"] = type(exc).__name__, str(exc)
    finally:
        sock.close()
    return result


def _start_client(path: str, as_nobody: bool = False) -> tuple[Child, int]:
    """Fork a process (dropping to ``nobody`` first if asked) that runs :func:`_say_hi`
    against ``path`` and writes what happened to a pipe; the process and the read end."""
    r, w = os.pipe()

    def body() -> int:
        if as_nobody:
            nobody = pwd.getpwnam("nobody")
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
        LineWriter(w).send(_say_hi(path))
        return 0

    child = Child.fork(body, log_path=None, own_group=True, close_fds=(r,))
    os.close(w)
    return child, r


def _report(child: Child, r: int) -> dict[str, Any]:
    """What a client of :func:`_start_client` reported (within the deadline); it is reaped."""
    try:
        got = LineReader(r).json(time.monotonic() + DEADLINE_S)
    finally:
        os.close(r)
        code = child.end(DEADLINE_S)
    assert got is not None and code == 0, f"the client reported {got}, exit status {code}"
    return got


def _child_as_nobody(path: str) -> dict[str, Any]:
    return _report(*_start_client(path, as_nobody=True))


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
        admit(conn, allowed_pids=None, uid=0)
    assert f"runs as uid {pwd.getpwnam('nobody').pw_uid}, expected uid 0" in str(err.value)
    report = join()
    assert report.get("error_type") == "PeerRefusedError", report
    assert "expected uid 0" in report["error"] and "reply" not in report


def _run_same_uid_child(srv: socket.socket, path: str,
                        serve: Callable[[socket.socket, int], Any]) -> tuple[Any, dict]:
    """Start a same-uid client of ``path``; ``serve(conn, child_pid)`` handles the accepted
    connection; returns (what serve returned or raised, the client's report)."""
    child, r = _start_client(path)
    try:
        conn, _ = srv.accept()
        try:
            outcome: Any = serve(conn, child.pid)
        except IpcError as exc:
            outcome = exc
    finally:
        report = _report(child, r)
    return outcome, report


def test_same_uid_process_not_announced_is_refused(listener) -> None:
    """A process of our uid whose pid was not announced is refused at accept
    (SO_PEERCRED pid allow-list) and told so; the same process, announced, is served."""
    srv, path = listener
    other = os.getpid()  # the announced peer is some other process (here: us)
    refused, report = _run_same_uid_child(
        srv, path, lambda conn, _: admit(conn, allowed_pids={other}))
    assert isinstance(refused, PeerRefusedError)
    assert f"refused peer pid {report['pid']} (uid {os.getuid()}): not an announced peer" \
        in str(refused)
    assert report["error_type"] == "PeerRefusedError" and "reply" not in report

    # Control: the same child, announced, is served.
    got, report = _run_same_uid_child(srv, path,
                                      lambda conn, child: admit(conn, allowed_pids={child}))
    assert got == {"op": "hi"}
    assert report["reply"] == {"op": "hello-back", "got": {"op": "hi"}}


def test_a_socket_served_by_another_pid_is_refused_before_anything_is_sent() -> None:
    """The connecting side refuses a socket served by a pid other than the announced one,
    before sending anything (what a worker checks of its coordinator)."""
    a, c = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(PeerRefusedError, match=f"refused peer pid {os.getpid()}"):
            check_peer(c, allowed_pids={os.getpid() + 100000})
        a.settimeout(0.2)
        c.close()
        assert a.recv(16) == b""  # nothing was sent to the impostor
    finally:
        a.close()
        c.close()


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
