"""1P1D through vLLM's connector API: a prefill and a decode process, vLLM's own handshake.

Each side is its own process (forked from a parent that imported vLLM once) with a VMM-style
cache (:class:`~kvconnect.vllm.cache.VllmKVCache`, capacity many times the committed blocks)
and the connector in both roles vLLM gives it: scheduler and worker. The prefill side fills
its blocks, finishes a request through the scheduler connector (``update_state_after_alloc``,
``request_finished``: vLLM builds the ``kv_transfer_params`` a decode needs, and its
scheduler serves the worker's handshake metadata on NIXL's ZMQ side channel), binds the
scheduler's metadata to its worker and waits for the decode's completion notice. The decode
side schedules a request carrying those parameters (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``), binds the metadata to its worker,
``start_load_kv`` (handshake over the side channel, NIXL READ) and polls ``get_finished``;
then compares every KV byte of the received blocks with what the prefill side held.

Units: blocks are vLLM's logical blocks; seconds for deadlines.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvconnect.child import Child, LineReader, LineWriter, exit_signal_name
from kvconnect.ports import free_tcp_port
from kvconnect.verdicts import FAIL, FAULT, PASS, REFUSED

__all__ = ["run_pd", "transfers_over_nixl"]


def transfers_over_nixl(connector: str) -> bool:
    """True for connectors of vLLM's NIXL kind (what a 1P1D run exercises)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector

    from .case import resolve_connector

    return issubclass(resolve_connector(connector)[2], NixlBaseConnector)


def _digest(cache: Any, block_ids: list[int]) -> tuple[str, int]:
    """sha256 over every KV run of ``block_ids`` (kvconnect's regions, in order)."""
    import ctypes

    h, n = hashlib.sha256(), 0
    regions = cache.committed_regions()
    for b in block_ids:
        for r in regions:
            h.update(ctypes.string_at(r.base_ptr + b * r.block_stride, r.block_len))
            n += r.block_len
    return h.hexdigest(), n


def _side(spec: dict[str, Any], role: str, port: int, workdir: str) -> tuple[Any, Any, Any, Any]:
    """vLLM config, cache, worker connector and scheduler connector of one side."""
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole

    from kvconnect.vllm.cache import VllmKVCache
    from kvconnect.vllm.runtime import init_single_process_group, make_vllm_config

    from .case import kv_cache_config, transfer_config

    ktc, _ = transfer_config(spec["connector"], engine_id=f"{role}-engine-{spec['run']}",
                             kv_role="kv_producer" if role == "prefill" else "kv_consumer")
    vc = make_vllm_config(spec["model"], layout=spec["layout"], block_size=spec["block_size"],
                          kv_transfer_config=ktc)
    kv_cfg = kv_cache_config(vc, spec)
    ctx = set_current_vllm_config(vc)
    ctx.__enter__()
    init_single_process_group(f"{workdir}/dist")
    cache = VllmKVCache(kv_cfg, "cpu", layout=spec["layout"],
                        capacity_blocks=spec["capacity_blocks"])
    cache.allocate()
    cache.extend_kv_cache(spec["num_blocks"])
    cfg = cache.connector_config()
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, cfg)
    sched = KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, cfg)
    return vc, cache, worker, sched


def _request(request_id: str, num_tokens: int, params: dict[str, Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, list(range(num_tokens)),
                   SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}),
                   None)


def _blocks(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(b) for b in ids],))


def _prefill(spec: dict[str, Any], workdir: str, send: Any) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import RequestStatus

    from .case import fill_committed

    rng = random.Random(spec["seed"])
    _, cache, worker, sched = _side(spec, "prefill", spec["prefill_port"], workdir)
    send({"stage": "prefill register"})
    worker.register_kv_caches(cache.kv_caches())
    sched.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    fill_committed(cache, rng)
    ids = sorted(rng.sample(range(spec["num_blocks"]), spec["transfer_blocks"]))
    tokens = spec["transfer_blocks"] * spec["block_size"]
    req = _request("prefill-req", tokens, {"do_remote_decode": True})
    sched.update_state_after_alloc(req, _blocks(ids), 0)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = tokens
    _, params = sched.request_finished(req, ids)
    digest, nbytes = _digest(cache, ids)
    # the worker learns the request it sends before the decode may read it: published first,
    # a decode on a loaded machine read and notified a worker that did not know
    # "prefill-req" yet ("unrecognized request"), and the run failed
    worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
    worker.start_load_kv(None)
    send({"params": params, "digest": digest, "bytes": nbytes, "remote_ids": ids})
    deadline = time.monotonic() + spec["timeout"]
    while time.monotonic() < deadline:
        sending, _ = worker.get_finished(set())
        if sending and "prefill-req" in sending:
            send({"done_sending": True})
            break
        time.sleep(0.01)
    else:
        send({"done_sending": False})
    time.sleep(0.2)
    worker.shutdown()
    sched.shutdown()


def _decode(spec: dict[str, Any], p: dict[str, Any], workdir: str, send: Any) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    rng = random.Random(spec["seed"] + 1)
    _, cache, worker, sched = _side(spec, "decode", spec["decode_port"], workdir)
    send({"stage": "decode register"})
    worker.register_kv_caches(cache.kv_caches())
    sched.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    local = rng.sample(range(spec["num_blocks"]), spec["transfer_blocks"])
    params = dict(p["params"], do_remote_prefill=True, do_remote_decode=False)
    req = _request("decode-req", spec["transfer_blocks"] * spec["block_size"], params)
    count, is_async = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, _blocks(local), count)
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    send({"stage": "decode start_load_kv"})
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    deadline = time.monotonic() + spec["timeout"]
    done = False
    while time.monotonic() < deadline and not done:
        # each step gets the scheduler's next metadata, as an engine's steps do (it asks for
        # nothing new): binding the first one again re-read the request in every step, and
        # a second READ's notice reached a prefill that had already let it go ("unrecognized
        # request"), or a prefill already gone (NIXL_ERR_REMOTE_DISCONNECT)
        worker.bind_connector_metadata(sched.build_connector_meta(SchedulerOutput.make_empty()))
        worker.start_load_kv(None)  # drives handshakes that finished in the background
        _, recving = worker.get_finished(set())
        done = bool(recving and "decode-req" in recving)
        time.sleep(0.01)
    errors = sorted(worker.get_block_ids_with_load_errors()) if done else []
    digest, nbytes = _digest(cache, local)
    ok = done and not errors and digest == p["digest"]
    send({"result": {"status": PASS if ok else FAIL, "received": done,
                     "load_error_blocks": errors[:8], "bytes": nbytes,
                     "byte_exact": digest == p["digest"], "matched_tokens": count,
                     "async": is_async, "local_ids": local, "remote_ids": p["remote_ids"]}})
    worker.shutdown()
    sched.shutdown()


class _Side:
    """One side's process (forked, its own process group), its JSON lines and the stage it
    last reported; :meth:`end` kills its group and reaps it."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any) -> None:
        self.name, self.stage = name, f"{name} start"
        rfd, wfd = os.pipe()
        fd, self.log_path = tempfile.mkstemp(prefix="kvconnect-pd-", suffix=".log")
        os.close(fd)

        def body() -> int:
            out = LineWriter(wfd)
            return out.run(lambda: target(*args, out.send), limit=1500)

        try:
            self.child = Child.fork(body, log_path=self.log_path, own_group=True,
                                    close_fds=(rfd,))
        except BaseException:
            os.close(rfd)
            os.unlink(self.log_path)
            raise
        finally:
            os.close(wfd)
        self.reader = LineReader(rfd)

    def until(self, key: str, deadline: float) -> dict[str, Any] | None:
        """The next message carrying ``key`` (or ``error``); stages on the way are noted.
        None when the pipe closed or ``deadline`` passed first."""
        while True:
            msg = self.reader.json(deadline)
            if msg is None or key in msg or "error" in msg:
                return msg
            self.stage = msg.get("stage", self.stage)

    def end(self) -> str | None:
        """Give the side 5 s to exit, kill its group, reap it; the signal that ended it
        (None for an exit)."""
        try:
            return exit_signal_name(self.child.end(5.0))
        finally:
            os.close(self.reader.fd)

    def log_errors(self) -> list[str]:
        """The log's last error lines; the log is removed."""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = [x for x in f.read().splitlines()
                         if "ERROR" in x or "rror" in x or "Traceback" in x]
        finally:
            os.unlink(self.log_path)
        return lines[-6:]


def run_pd(connector: str, layout: str, *, num_blocks: int = 128, capacity_blocks: int = 1024,
           transfer_blocks: int = 8, num_layers: int = 2, timeout: float = 90.0,
           seed: int = 0) -> dict[str, Any]:
    """One 1P1D transfer through vLLM's connector API; JSON result (``status`` pass / fail /
    fault / timeout, evidence)."""
    from .case import CASE_DEFAULTS
    from .runner import warm_up

    warm_up()
    spec = {**CASE_DEFAULTS, "connector": connector, "layout": layout, "num_blocks": num_blocks,
            "capacity_blocks": capacity_blocks, "transfer_blocks": transfer_blocks,
            "num_layers": num_layers, "timeout": timeout, "seed": seed,
            "prefill_port": free_tcp_port(), "decode_port": free_tcp_port(),
            "run": f"{os.getpid()}-{random.randrange(1 << 30):08x}"}
    out: dict[str, Any] = {"connector": connector, "layout": layout, "num_blocks": num_blocks,
                           "capacity_blocks": capacity_blocks}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvconnect-pd-") as tmp:
        from kvconnect.vllm.runtime import write_tiny_model

        # one model folder: vLLM's NIXL compatibility hash covers the model path
        spec["model"] = str(write_tiny_model(f"{tmp}/model", num_layers=num_layers))
        os.makedirs(f"{tmp}/p")
        os.makedirs(f"{tmp}/d")
        sides = [_Side("prefill", _prefill, spec, f"{tmp}/p")]
        try:
            _transfer(spec, sides, out, t0 + timeout + 30, f"{tmp}/d")
        finally:
            _end_sides(sides, out)
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def _transfer(spec: dict[str, Any], sides: list[_Side], out: dict[str, Any], deadline: float,
              decode_dir: str) -> None:
    """The prefill's parameters, then a decode side fetching with them (appended to
    ``sides``); its result, or why there is none, into ``out``."""
    prefill = sides[0]
    p = prefill.until("params", deadline)
    if p is None or "error" in p:
        err = (p or {}).get("error", "prefill gave no parameters")
        # kvconnect's bounding declining a layout, before registering: not a fault
        out.update(status=REFUSED if "LayoutError" in err else FAIL,
                   stage=prefill.stage, evidence=err.strip().splitlines()[-1][:400])
        return
    decode = _Side("decode", _decode, spec, p, decode_dir)
    sides.append(decode)
    d = decode.until("result", deadline)
    sent = prefill.until("done_sending", min(deadline, time.monotonic() + 10))
    if d is None or "error" in d:
        out.update(status=FAIL, stage=decode.stage,
                   evidence=(d or {}).get("error", "decode gave no result")[-600:])
    else:
        out.update(d["result"])
        out["prefill_saw_completion"] = bool(sent and sent.get("done_sending"))


def _end_sides(sides: list[_Side], out: dict[str, Any]) -> None:
    """End every side (on every path); a side that died by a signal other than our SIGKILL
    makes the result a ``fault``; a result that did not pass quotes the logs' errors."""
    sigs = {side.name: side.end() for side in sides}
    for name, sig in sigs.items():
        if sig and sig != "SIGKILL":
            out.update(status=FAULT, signal=sig, side=name, evidence=f"{name} died by {sig}")
    for side in sides:
        errors = side.log_errors()
        if out.get("status") != PASS:
            out[f"{side.name}_log_errors"] = errors
