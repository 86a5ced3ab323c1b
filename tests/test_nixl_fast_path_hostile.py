"""The fast path's offer exchange against hostile or broken peers and settings (issue 23):
slow and many clients, a prefill that does not answer in time and is asked again later,
durations no socket can hold, settings of the wrong type, inexact integers in the protocol,
and an offer directory whose parents another user could change. Real Unix sockets, real
host-backend caches and export servers (the ordinary cases: tests/test_nixl_fast_path.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
from _fast_path_peers import AGENT, PullWorkerStandIn, read_kw, upstream_worker_stand_in
from _fast_path_peers import cache as _cache

import kvconnect.connectors.vllm.nixl_fast_path as fast_path_module
from kvconnect.connectors.ipc.transport import IpcExportServer, IpcTransport
from kvconnect.connectors.vllm.ipc_offer import (
    MAX_OFFER_CLIENTS,
    IpcOfferServer,
    _decide,
    ensure_offer_dir,
    export_socket_name,
    offer_socket_path,
    request_offer,
)
from kvconnect.connectors.vllm.nixl_fast_path import FastPathSettings, NixlIpcFastPath, retry_delay
from kvconnect.framing import MAGIC, IpcError, connect_unix, kernel_boot_id, recv_json, send_message
from kvconnect.kv_cache import ExtensibleKVCache
from kvconnect.vllm.plugin_settings import PluginConfigError


@pytest.fixture
def directory() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvc-") as d:
        os.chmod(d, 0o700)
        yield d


def _serve(directory: str, cache: ExtensibleKVCache, timeout: float = 10.0
           ) -> tuple[IpcExportServer, IpcOfferServer]:
    """A prefill side: ``cache``'s export server and its offer server (caller closes both)."""
    holder: list[IpcOfferServer] = []
    export = IpcExportServer(cache, directory, export_socket_name(AGENT),
                             lambda: holder[0].allowed() if holder else set(), timeout)
    try:
        holder.append(IpcOfferServer(directory, AGENT, "prefill-0", export, None, timeout))
    except BaseException:
        export.close()
        raise
    return export, holder[0]


@pytest.fixture
def exporting(directory: str) -> Iterator[tuple[ExtensibleKVCache, IpcOfferServer]]:
    with _cache(seed=3) as cache:
        export, offer = _serve(directory, cache)
        try:
            yield cache, offer
        finally:
            offer.close()
            export.close()


class _Drippers:
    """``n`` clients that connect to ``path`` and send a frame header one byte every
    ``every`` seconds (never a whole request) until stopped; all closed by :meth:`stop`."""

    def __init__(self, path: str, n: int, every: float = 0.3) -> None:
        self.socks = [connect_unix(path, 5.0) for _ in range(n)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drip, args=(every,), daemon=True)
        self._thread.start()

    def _drip(self, every: float) -> None:
        header = MAGIC + b"\x01"
        for i in range(len(header)):
            for s in self.socks:
                try:
                    s.send(header[i:i + 1])
                except OSError:
                    pass
            if self._stop.wait(every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for s in self.socks:
            s.close()


# -- item 3: one connection at a time --------------------------------------------------------
def test_slow_clients_do_not_delay_a_decode(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    """Three clients drip bytes at the offer socket (the server waits up to 10 s for each
    whole request); a decode asking with a 3 s timeout still gets the offer. Before: the
    server read one connection at a time, so the decode timed out behind the first dripper
    and fell back to NIXL (``refused``)."""
    _, server = exporting
    drippers = _Drippers(server.path, 3)
    try:
        deadline = time.monotonic() + 5
        while server.active_clients < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        d = request_offer(directory, AGENT, "prefill-0", 3.0)
        assert (d.route, d.code) == ("ipc", None), d.reason
        assert server.answered == 1
    finally:
        drippers.stop()


def test_connections_are_bounded_and_a_decode_is_served_after(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    """More idle connections than the server serves at once: it serves at most
    MAX_OFFER_CLIENTS (the rest wait in the backlog); once they go, a decode is served."""
    _, server = exporting
    idle = [connect_unix(server.path, 5.0) for _ in range(MAX_OFFER_CLIENTS + 8)]
    try:
        deadline = time.monotonic() + 5
        seen = 0
        while time.monotonic() < deadline and seen < MAX_OFFER_CLIENTS:
            seen = max(seen, server.active_clients)
            time.sleep(0.01)
        time.sleep(0.3)
        assert seen == server.active_clients == MAX_OFFER_CLIENTS
    finally:
        for s in idle:
            s.close()
    d = request_offer(directory, AGENT, "prefill-0", 5.0)
    assert d.route == "ipc", d.reason
    # each idle one ends as a closed peer, in its own server thread: the decode can be served
    # (a slot freed) before the last of them has counted (fresh-clone CI once saw 28 of 32)
    deadline = time.monotonic() + 5
    while server.failed < MAX_OFFER_CLIENTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.failed >= MAX_OFFER_CLIENTS


def test_a_prefill_that_did_not_answer_in_time_is_asked_again_with_backoff(
        directory: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill that accepts nothing (its backlog holds the connection) makes the decode
    fall back to NIXL, marked transient; a read after the backoff asks again in the
    background (the read itself goes through NIXL), and once the prefill answers, later
    reads use ipc. Before: the fallback was cached for good."""
    monkeypatch.setattr(fast_path_module, "RETRY_FIRST_S", 0.3)
    path = offer_socket_path(directory, AGENT)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.bind(path)
    stalled.listen(8)  # never accepted: connects succeed, no reply comes
    worker = PullWorkerStandIn(**vars(upstream_worker_stand_in()),
                                _remote_agents={"prefill-0": {(0, 0): AGENT}},
                                _pending_recv_notifs={}, _recving_transfers=defaultdict(list))
    with _cache(seed=3) as src, _cache(seed=9) as dst:
        fast = NixlIpcFastPath(FastPathSettings(True, directory, 0.5), "decode-0", dst,
                               can_send=False, can_receive=True)
        servers: tuple[IpcExportServer, IpcOfferServer] | None = None
        try:
            fast.transport = IpcTransport(dst, timeout=5.0)
            d = fast.negotiate("prefill-0", 0, AGENT)
            assert (d.route, d.code, d.transient) == ("nixl", "refused", True)
            peer = fast.facts()["peers"][0]
            assert peer["transient"] is True and peer["offer_attempts"] == 1
            assert not fast._read_by_ipc(worker, read_kw([6], [1]))  # before the backoff
            assert not fast._retries
            stalled.close()
            os.unlink(path)
            servers = _serve(directory, src)
            time.sleep(0.35)
            assert not fast._read_by_ipc(worker, read_kw([6], [1]))  # NIXL; asks again
            fast._retries[("prefill-0", 0)].join(timeout=10)
            peer = fast.facts()["peers"][0]
            assert (peer["route"], peer["offer_attempts"]) == ("ipc", 2)
            assert peer["nixl_reads"] == 2  # the counts carried over
            assert fast._read_by_ipc(worker, read_kw([6], [1]))
            assert fast.facts()["peers"][0]["ipc_reads"] == 0  # copied, not yet polled
        finally:
            fast.close()
            stalled.close()
            if servers is not None:
                servers[1].close()
                servers[0].close()


def test_the_backoff_doubles_up_to_a_bound() -> None:
    delays = [retry_delay(n) for n in range(1, 12)]
    assert delays[0] == fast_path_module.RETRY_FIRST_S
    assert all(b == min(2 * a, fast_path_module.RETRY_MAX_S)
               for a, b in zip(delays, delays[1:], strict=False))
    assert retry_delay(10 ** 6) == fast_path_module.RETRY_MAX_S


# -- items 4 and 5: durations and settings ------------------------------------------------------
@pytest.mark.parametrize("value", ["inf", float("inf"), float("nan"), 1e300, "1e300", 86401,
                                   "abc", [1], None, True, "٢", "", 0, -1])
def test_a_bad_timeout_names_the_key(value: Any) -> None:
    """Before: "inf" and 1e300 were accepted (the offer thread then died of OverflowError on
    its first connection), "abc" gave a bare ValueError, [1] and null a TypeError."""
    with pytest.raises(PluginConfigError, match="kvconnect_ipc_timeout.*seconds"):
        FastPathSettings.from_extra_config({"kvconnect_ipc_timeout": value})


@pytest.mark.parametrize("value", [5, 0.25, "2.5", 86400])
def test_a_good_timeout_is_taken(value: Any) -> None:
    assert FastPathSettings.from_extra_config({"kvconnect_ipc_timeout": value}).timeout == \
        float(value)


@pytest.mark.parametrize("extra", [[1], "x", 5, True])
def test_extra_config_that_is_not_an_object_is_refused(extra: Any) -> None:
    """Before: AttributeError ('list' object has no attribute 'get')."""
    with pytest.raises(PluginConfigError, match="kv_connector_extra_config must be a JSON"):
        FastPathSettings.from_extra_config(extra)


@pytest.mark.parametrize("value", [5, ["a"], "", "relative/dir", None, "/a\0b", "/x\ud800"])
def test_an_offer_dir_that_is_not_an_absolute_path_is_refused(value: Any) -> None:
    """Before: 5 and ["a"] became the relative directories '5' and "['a']"."""
    with pytest.raises(PluginConfigError, match="kvconnect_ipc_dir must be an absolute path"):
        FastPathSettings.from_extra_config({"kvconnect_ipc_dir": value})


def test_the_offer_timeout_is_checked_by_its_users(directory: str) -> None:
    """Before: IpcOfferServer took inf (its thread died at the first connection) and
    request_offer raised OverflowError, although it says it never raises for a peer."""
    with pytest.raises(ValueError, match="seconds"):
        IpcOfferServer(directory, AGENT, "prefill-0", None, ("plain_cache", "x"),
                       float("inf"))
    assert not os.path.exists(offer_socket_path(directory, AGENT))
    with pytest.raises(ValueError, match="seconds"):
        request_offer(directory, AGENT, "prefill-0", float("inf"))
    with pytest.raises(ValueError, match="seconds"):
        request_offer(directory, AGENT, "prefill-0", 1e300)


# -- item 6: exact integers in the protocol ------------------------------------------------------
def _reply(**changes: Any) -> dict[str, Any]:
    reply = {"version": 1, "agent": AGENT, "engine_id": "e", "boot_id": kernel_boot_id(),
             "ok": True, "offer": {"path": "/x", "pid": 7, "generation": 1}}
    for key, value in changes.items():
        if key in ("path", "pid", "generation"):
            reply["offer"][key] = value  # type: ignore[index]
        else:
            reply[key] = value
    return reply


@pytest.mark.parametrize("changes", [
    {"version": True}, {"version": 1.0}, {"generation": True}, {"generation": -5},
    {"generation": 0}, {"generation": 2 ** 70}, {"generation": 1.0}, {"generation": "1"},
    {"pid": 7.0}, {"ok": 1}, {"path": 5}])
def test_a_decode_reads_the_offer_by_exact_type(changes: dict[str, Any]) -> None:
    """Before: version true / 1.0 and generation true / -5 / 2**70 were accepted."""
    assert _decide(_reply(), AGENT, "e", 7).route == "ipc"
    d = _decide(_reply(**changes), AGENT, "e", 7)
    assert (d.route, d.code) == ("nixl", "refused") or (d.code == "remote_declined"
                                                        and changes == {"ok": 1})


@pytest.mark.parametrize("version", [True, 1.0, "1", None])
def test_a_prefill_reads_the_request_by_exact_type(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], version: Any) -> None:
    """Before: a request with version true or 1.0 was given the offer."""
    _, server = exporting
    with connect_unix(server.path, 5.0) as s:
        send_message(s, {"op": "ipc_offer", "version": version, "agent": AGENT,
                         "engine_id": "prefill-0", "pid": os.getpid()})
        reply = recv_json(s, 5.0)
    assert reply["ok"] is False and reply["code"] == "declined"
    assert os.getpid() not in server.allowed()


# -- item 8: the offer directory's parents -------------------------------------------------------
@pytest.fixture
def parent() -> Iterator[str]:
    """A directory under /tmp for the test to give modes and owners to (removed after)."""
    d = tempfile.mkdtemp(prefix="kvc-parent-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_parent_others_can_write_is_refused(parent: str) -> None:
    """Before: only the last component was checked, so a directory in a parent others can
    write (not sticky) was accepted, and could be swapped for a link before the bind."""
    os.chmod(parent, 0o777)
    with pytest.raises(IpcError, match=rf"{parent} is writable by its group or others"):
        ensure_offer_dir(os.path.join(parent, "kv"))
    assert not os.path.exists(os.path.join(parent, "kv"))  # refused before creating it


def test_a_sticky_parent_as_tmp_is_fine(parent: str) -> None:
    os.chmod(parent, 0o1777)
    path = os.path.join(parent, "kv")
    assert ensure_offer_dir(path) == path
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700


def test_a_link_on_the_way_is_followed_and_its_target_checked(parent: str) -> None:
    """A symbolic link whose own directory is safe, pointing into a directory others can
    write: the walk follows it and refuses the target."""
    unsafe = os.path.join(parent, "unsafe")
    os.mkdir(unsafe)
    os.chmod(unsafe, 0o777)
    safe = os.path.join(parent, "safe")
    os.mkdir(safe, 0o755)
    os.symlink(unsafe, os.path.join(safe, "link"))
    with pytest.raises(IpcError, match=rf"{unsafe} is writable"):
        ensure_offer_dir(os.path.join(safe, "link", "kv"))
    os.chmod(unsafe, 0o755)
    assert ensure_offer_dir(os.path.join(safe, "link", "kv")).endswith("link/kv")


@pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another uid needs root")
def test_a_parent_owned_by_another_user_is_refused(parent: str) -> None:
    """Its owner can rename anything in it, sticky or not."""
    nobody = pwd.getpwnam("nobody").pw_uid
    theirs = os.path.join(parent, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, nobody, -1)
    with pytest.raises(IpcError, match=f"owned by uid {nobody}"):
        ensure_offer_dir(os.path.join(theirs, "kv"))
