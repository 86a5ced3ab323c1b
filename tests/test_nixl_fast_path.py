"""The NIXL connector's same-host fast path, below vLLM: the offer exchange and its
decisions (real Unix sockets, real host-backend caches and export server), the handles
upstream's polling sees, the settings and the layout rule. Real engines taking (and
falling back from) the fast path: tests/test_engine_connectors.py."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _fast_path_peers import AGENT, NUM_BLOCKS
from _fast_path_peers import PullWorkerStandIn as _PullWorkerStandIn
from _fast_path_peers import cache as _cache
from _fast_path_peers import read_kw as _read_kw
from _fast_path_peers import upstream_worker_stand_in as _upstream_worker_stand_in
from _nixl_peer import block_view

from kvconnect.connectors.ipc.transport import IpcExportServer, IpcTransport
from kvconnect.connectors.vllm.ipc_handles import IpcXferHandles
from kvconnect.connectors.vllm.ipc_offer import (
    REASONS,
    FastPathDecision,
    IpcOfferServer,
    _decide,
    ensure_offer_dir,
    export_socket_name,
    offer_socket_path,
    request_offer,
)
from kvconnect.connectors.vllm.nixl_fast_path import (
    FastPathSettings,
    NixlIpcFastPath,
    layout_mismatch,
    logical_ids,
)
from kvconnect.framing import IpcError, kernel_boot_id
from kvconnect.kv_cache import ExtensibleKVCache


@pytest.fixture
def directory() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvc-") as d:
        os.chmod(d, 0o700)
        yield d


def _block(cache: ExtensibleKVCache, b: int) -> list[torch.Tensor]:
    """Block ``b`` of every committed region, copied."""
    return [block_view(cache, r, b).clone() for r in cache.committed_regions()]


@pytest.fixture
def exporting(directory: str) -> Iterator[tuple[ExtensibleKVCache, IpcOfferServer]]:
    """A prefill side: a filled cache, its export server and offer server."""
    with _cache(seed=3) as cache:
        holder: list[IpcOfferServer] = []
        export = IpcExportServer(cache, directory, export_socket_name(AGENT),
                                 lambda: holder[0].allowed() if holder else set(), 10.0)
        try:
            holder.append(IpcOfferServer(directory, AGENT, "prefill-0", export, None, 10.0))
            yield cache, holder[0]
        finally:
            if holder:
                holder[0].close()
            export.close()


def test_offer_gives_ipc_and_lets_the_decode_map_and_copy(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    src, server = exporting
    assert os.getpid() not in server.allowed()
    decision = request_offer(directory, AGENT, "prefill-0", 5.0)
    assert decision.route == "ipc" and decision.code is None
    assert decision.offer is not None and decision.offer["pid"] == os.getpid()
    assert os.getpid() in server.allowed() and server.answered == 1
    with _cache(seed=9) as dst, IpcTransport(dst, timeout=10) as ipc:
        ipc.open_peer("prefill-0#0", decision.offer)
        before = _block(dst, 5)
        ipc.start("prefill-0#0", [([2, 3], [5, 6])]).wait()
        assert all(torch.equal(a, b) for a, b in zip(_block(dst, 5), _block(src, 2), strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(before, _block(dst, 5), strict=True))


def test_no_socket_means_no_endpoint(directory: str) -> None:
    d = request_offer(directory, AGENT, "prefill-0", 1.0)
    assert (d.route, d.code) == ("nixl", "no_endpoint")
    assert offer_socket_path(directory, AGENT) in (d.reason or "")


def test_a_socket_left_by_a_dead_engine_is_refused(directory: str) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(offer_socket_path(directory, AGENT))
    stale.close()  # the file stays, nobody listens: ECONNREFUSED
    d = request_offer(directory, AGENT, "prefill-0", 1.0)
    assert (d.route, d.code) == ("nixl", "refused")


@pytest.mark.parametrize("code", ["plain_cache", "not_exportable", "something_new"])
def test_a_prefill_that_cannot_export_says_why(directory: str, code: str) -> None:
    server = IpcOfferServer(directory, AGENT, "prefill-0", None, (code, f"because {code}"),
                            5.0)
    try:
        d = request_offer(directory, AGENT, "prefill-0", 5.0)
    finally:
        server.close()
    want = f"remote_{code}" if f"remote_{code}" in REASONS else "remote_declined"
    assert (d.route, d.code) == ("nixl", want)
    assert f"because {code}" in (d.reason or "")
    assert server.allowed() == set()
    assert not os.path.exists(server.path)


def test_another_agent_or_engine_is_refused(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    _, server = exporting
    d = request_offer(directory, AGENT, "another-engine", 5.0)
    assert (d.route, d.code) == ("nixl", "refused")  # the reply names prefill-0
    assert server.allowed() == set() and server.answered == 1


def test_a_reply_from_another_boot_is_other_host() -> None:
    reply = {"version": 1, "agent": AGENT, "engine_id": "e", "boot_id": "not-" + kernel_boot_id(),
             "ok": True, "offer": {"path": "/x", "pid": 7, "generation": 1}}
    assert _decide(reply, AGENT, "e", 7).code == "other_host"
    reply["boot_id"] = kernel_boot_id()
    assert _decide(reply, AGENT, "e", 7).route == "ipc"
    assert _decide(reply, AGENT, "e", 8).code == "refused"  # offer pid is not the server's
    reply["offer"] = {"path": "/x", "pid": 7, "generation": "1"}
    assert _decide(reply, AGENT, "e", 7).code == "refused"


def test_offer_dir_must_be_private(directory: str) -> None:
    assert ensure_offer_dir(os.path.join(directory, "new")) == os.path.join(directory, "new")
    assert os.stat(os.path.join(directory, "new")).st_mode & 0o777 == 0o700
    open_dir = os.path.join(directory, "open")
    os.mkdir(open_dir, 0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(IpcError, match="mode 0700"):
        ensure_offer_dir(open_dir)


def test_socket_paths_too_long_are_refused_with_the_fix() -> None:
    with pytest.raises(IpcError, match="kvconnect_ipc_dir"):
        offer_socket_path("/tmp/" + "d" * 100, AGENT)


def test_settings_from_extra_config() -> None:
    s = FastPathSettings.from_extra_config(None)
    assert s.enabled and s.directory.endswith(f"kvconnect-nixl-{os.getuid()}")
    assert not FastPathSettings.from_extra_config({"kvconnect_ipc": False}).enabled
    assert FastPathSettings.from_extra_config({"kvconnect_ipc_dir": "/x"}).directory == "/x"
    with pytest.raises(ValueError, match="true or false"):
        FastPathSettings.from_extra_config({"kvconnect_ipc": "no"})


@pytest.mark.parametrize(("enabled", "cache", "code"),
                         [(False, True, "disabled"), (True, False, "local_cache")])
def test_this_side_refuses_before_asking(exporting: tuple[ExtensibleKVCache, IpcOfferServer],
                                         directory: str, enabled: bool, cache: bool,
                                         code: str) -> None:
    src, server = exporting
    fast = NixlIpcFastPath(FastPathSettings(enabled, directory, 5.0), "decode-0",
                           src if cache else None, can_send=False, can_receive=True)
    try:
        d = fast.negotiate("prefill-0", 0, AGENT)
        assert (d.route, d.code) == ("nixl", code)
        assert server.answered == 0  # the prefill was never asked
        peer = fast.facts()["peers"][0]
        assert (peer["engine_id"], peer["route"], peer["code"]) == ("prefill-0", "nixl", code)
    finally:
        fast.close()


def test_negotiation_is_asked_once_per_agent(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    src, server = exporting
    fast = NixlIpcFastPath(FastPathSettings(True, directory, 5.0), "decode-0", src,
                           can_send=False, can_receive=True)
    try:
        assert fast.negotiate("prefill-0", 0, AGENT).route == "ipc"
        assert fast.negotiate("prefill-0", 0, AGENT).route == "ipc"
        assert server.answered == 1
        fast.forget("prefill-0")
        assert fast.facts()["peers"] == []
    finally:
        fast.close()


class _PendingStandIn:
    """A copy in flight as IpcTransport.start returns it; ``fail`` stands in for a device
    error, which the host backend (synchronous copies) cannot produce."""

    def __init__(self, fail: bool = False) -> None:
        self.finished = False
        self.fail = fail

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float) -> Any:
        if self.fail:
            raise RuntimeError("device reported an error")
        return SimpleNamespace(bytes=4096, seconds=0.002, blocks=2)


def test_handles_report_proc_done_err_and_pass_nixl_handles_through() -> None:
    handles = IpcXferHandles()
    seen: list[Any] = []
    ok, bad = _PendingStandIn(), _PendingStandIn(fail=True)
    h_ok = handles.add(ok, seen.append, seen.append)
    h_bad = handles.add(bad, seen.append, seen.append)
    agent = SimpleNamespace(check_xfer_state=lambda h: f"nixl:{h}",
                            get_xfer_telemetry=lambda h: None,
                            release_xfer_handle=lambda h: seen.append(("released", h)))
    handles.patch_agent(agent)
    assert h_ok < 0 and h_bad < 0 and h_ok != h_bad
    assert agent.check_xfer_state(h_ok) == "PROC" and seen == []
    ok.finished = bad.finished = True
    assert agent.check_xfer_state(h_ok) == "DONE"
    assert agent.check_xfer_state(h_ok) == "DONE" and len(seen) == 1  # on_done ran once
    t = agent.get_xfer_telemetry(h_ok)
    assert (t.totalBytes, t.descCount, t.xferDuration) == (4096, 2, pytest.approx(2000.0))
    assert agent.check_xfer_state(h_bad) == "ERR" and isinstance(seen[1], RuntimeError)
    agent.release_xfer_handle(h_ok)
    agent.release_xfer_handle(h_bad)
    assert len(handles) == 0
    assert agent.check_xfer_state(12345) == "nixl:12345"  # NIXL's own handle
    agent.release_xfer_handle(12345)
    assert seen[-1] == ("released", 12345)


@pytest.mark.parametrize(("change", "words"), [
    ({}, None), ({"remote_tp_size": 2}, "tensor parallel"),
    ({"remote_block_size": 16}, "block size"), ({"use_host_buffer": True}, "host staging"),
    ({"_has_mamba": True}, "Mamba"), ({"remote_dcp_size": 2}, "context parallel"),
    ({"remote_physical_blocks_per_logical": 2}, "kernel blocks"),
    ({"enable_permute_local_kv": True}, "post-processing")])
def test_layout_rule(change: dict[str, Any], words: str | None) -> None:
    why = layout_mismatch(_upstream_worker_stand_in(**change), "prefill-0")
    assert (why is None) if words is None else (words in why)


def test_logical_ids_need_whole_blocks() -> None:
    assert logical_ids([7, 3], 1) == [7, 3]
    assert logical_ids([4, 5, 0, 1], 2) == [2, 0]
    assert logical_ids([5, 6], 2) is None and logical_ids([4], 2) is None


def test_decision_json_names_its_reason() -> None:
    d = FastPathDecision.nixl("layout", "block size 16 there, 128 here")
    j = d.to_json()
    assert j["route"] == "nixl" and j["code"] == "layout" and "128 here" in j["reason"]
    assert j["ipc_reads"] == 0 and j["nixl_reads"] == 0


def test_a_read_becomes_one_copy_upstream_polls_and_notifies(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    src, _ = exporting
    from collections import defaultdict

    base = _upstream_worker_stand_in()
    worker = _PullWorkerStandIn(**vars(base), _remote_agents={"prefill-0": {(0, 0): AGENT}},
                                _pending_recv_notifs={}, _recving_transfers=defaultdict(list))
    with _cache(seed=9) as dst:
        fast = NixlIpcFastPath(FastPathSettings(True, directory, 5.0), "decode-0", dst,
                               can_send=False, can_receive=True)
        try:
            fast.transport = IpcTransport(dst, timeout=5.0)
            assert fast.negotiate("prefill-0", 0, AGENT).route == "ipc"
            assert fast.facts()["peers"][0]["plan"] is None  # mapped at the first read
            assert fast._read_by_ipc(worker, _read_kw([6, 7], [1, 2]))
            (handle,) = worker._recving_transfers["req-1"]
            assert worker._pending_recv_notifs["req-1"] == [(AGENT, b"p-req-1:1")]
            assert fast.handles.state(handle) == "DONE"
            for local, remote in ((6, 1), (7, 2)):
                assert all(torch.equal(a, b) for a, b in
                           zip(_block(dst, local), _block(src, remote), strict=True))
            peer = fast.facts()["peers"][0]
            assert (peer["ipc_reads"], peer["ipc_blocks"]) == (1, 2)
            assert peer["ipc_bytes"] == 2 * dst.bytes_per_block
            # the host copies synchronously: all of the read's time is the copy's
            assert peer["ipc_us"] > 0 and peer["ipc_host_us"] == 0
            assert peer["ipc_launch_us"] == 0  # measured on CUDA only
            plan = peer["plan"]
            assert plan["bytes_per_block"] == dst.bytes_per_block
            assert plan["method"] == "host" and plan["device"] == "cpu"
            # a read the copy cannot do (a block id past the cache) goes to NIXL, and so
            # do the peer's later reads
            assert not fast._read_by_ipc(worker, _read_kw([NUM_BLOCKS + 3], [1]))
            peer = fast.facts()["peers"][0]
            assert (peer["route"], peer["code"], peer["nixl_reads"]) == ("nixl", "copy_failed", 1)
            assert not fast._read_by_ipc(worker, _read_kw([3], [1]))
            assert len(worker._recving_transfers["req-1"]) == 1
        finally:
            fast.close()


def test_a_topology_mismatch_sends_the_peer_to_nixl_at_its_first_read(
        exporting: tuple[ExtensibleKVCache, IpcOfferServer], directory: str) -> None:
    src, server = exporting
    worker = _PullWorkerStandIn(**vars(_upstream_worker_stand_in(remote_block_size=16)),
                                _remote_agents={"prefill-0": {(0, 0): AGENT}},
                                _pending_recv_notifs={}, _recving_transfers={})
    with _cache() as dst:
        fast = NixlIpcFastPath(FastPathSettings(True, directory, 5.0), "decode-0", dst,
                               can_send=False, can_receive=True)
        try:
            fast.transport = IpcTransport(dst, timeout=5.0)
            fast.negotiate("prefill-0", 0, AGENT)
            assert not fast._read_by_ipc(worker, _read_kw([1], [1]))
            peer = fast.facts()["peers"][0]
            assert (peer["route"], peer["code"]) == ("nixl", "layout")
            assert "block size 16 there, 128 here" in peer["reason"]
            assert server.export.served == 0  # never mapped
        finally:
            fast.close()
