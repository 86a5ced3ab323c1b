"""Helper for tests/test_soak.py and tests/test_nixl_recovery.py: a prefill process serving
one host-backend ExtensibleKVCache over NIXL, as a long-running server would.

Run as a script it answers JSON-line commands on stdin with ``KVC``-prefixed JSON lines on
stdout; between commands it drives NIXL progress and consumes the notifications readers
send (a server that never reads them would buffer them forever). Commands:

- ``setup`` {spec, engine_id, seed, agent_name?} -> ``metadata`` (JSON text) and ``pid``
- ``resources`` -> this process's :func:`resource_snapshot` plus ``notifications`` served
- ``stall`` {seconds} -> reply, then no NIXL progress for that long, then reply again
- ``exit``

Imported, it provides :func:`resource_snapshot` (used by the decode side too) and
:class:`ServicePeer`, the parent's handle on such a process (every wait has a deadline).
"""

from __future__ import annotations

import importlib.util
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PREFIX = "KVC "


def _peerlib() -> Any:
    spec = importlib.util.spec_from_file_location(
        "_nixl_peer", Path(__file__).with_name("_nixl_peer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def resource_snapshot() -> dict[str, int]:
    """Open fds, mappings and resident memory (KiB) of this process, from /proc/self."""
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"fds": len(os.listdir("/proc/self/fd")), "maps": maps, "rss_kib": rss}


# -- the prefill process --------------------------------------------------------------------

def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    from kvconnect.connectors.nixl import NixlConnectorWorker

    peerlib = _peerlib()
    cache: Any = None
    worker: NixlConnectorWorker | None = None
    served = 0
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    buf = b""
    try:
        _reply({"ok": True, "ready": True, "pid": os.getpid()})
        while True:
            while b"\n" not in buf:  # serve reads and consume notifications meanwhile
                if sel.select(0.001):
                    chunk = os.read(sys.stdin.fileno(), 1 << 16)
                    if not chunk:
                        return 0
                    buf += chunk
                elif worker is not None:
                    worker.progress()
                    served += sum(len(m) for m in worker.get_notifications().values())
            line, buf = buf.split(b"\n", 1)
            cmd = json.loads(line)
            op = cmd.get("op")
            try:
                if op == "setup":
                    cache = peerlib.make_cache(cmd["spec"])
                    peerlib.fill_cache(cache, cmd["seed"])
                    worker = NixlConnectorWorker(cmd["engine_id"], progress_thread=False,
                                                 agent_name=cmd.get("agent_name"))
                    worker.register_kv_cache(cache)
                    _reply({"ok": True, "metadata": worker.metadata_json().decode(),
                            "pid": os.getpid()})
                elif op == "resources":
                    _reply({"ok": True, **resource_snapshot(), "notifications": served,
                            "num_registrations": worker.num_registrations if worker else 0})
                elif op == "stall":
                    _reply({"ok": True})
                    time.sleep(cmd["seconds"])
                    _reply({"ok": True, "stalled": cmd["seconds"]})
                elif op == "exit":
                    _reply({"ok": True})
                    return 0
                else:
                    _reply({"ok": False, "error": f"unknown op {op!r}"})
            except Exception as exc:  # noqa: BLE001 - reported to the test
                _reply({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        if worker is not None:
            worker.close()
        if cache is not None:
            cache.close()


# -- the parent's handle ------------------------------------------------------------------------

class ServicePeer:
    """A prefill child process (this file run as a script). :meth:`close` ends it (asks,
    then kills) and closes every pipe; :meth:`kill` SIGKILLs it and reaps it."""

    def __init__(self, startup_timeout: float = 120.0) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-u", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._buf = b""
        try:
            self.pid = self.recv(startup_timeout)["pid"]
        except BaseException:
            self.close()
            raise

    def send(self, **cmd: Any) -> None:
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(PREFIX.encode()):
                    reply = json.loads(line[len(PREFIX):])
                    if not reply.get("ok"):
                        raise RuntimeError(f"peer failed: {reply.get('error')}\n{self.log()}")
                    return reply
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from the peer within {timeout} s\n{self.log()}")
            if self._sel.select(left):
                chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                if not chunk:
                    raise RuntimeError(f"peer exited with {self.proc.poll()}\n{self.log()}")
                self._buf += chunk

    def call(self, timeout: float = 60.0, **cmd: Any) -> dict[str, Any]:
        self.send(**cmd)
        return self.recv(timeout)

    def log(self) -> str:
        self.stderr.seek(0)
        return "peer stderr (tail):\n" + self.stderr.read().decode(errors="replace")[-3000:]

    def kill(self) -> int:
        """SIGKILL the process and reap it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(op="exit", timeout=20)
                self.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - fall back to killing it
                self.kill()
        self._sel.close()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe after a kill
                pass
        self.stderr.close()


if __name__ == "__main__":
    sys.exit(main())
