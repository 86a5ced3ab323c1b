#!/usr/bin/env python3
"""Rendezvous cost of a local run: the coordinator's own key/value table vs a local TCPStore.

The same workload goes through the two real :class:`~kvconnect.harness.control.Control`
implementations a worker can use, with real worker processes:

  coordinator  ``SocketControl`` -> the local run's ``Coordinator``
               (harness/coordinator/event_loop.py: the key/value table, waits answered when
               the key is set, heartbeats, the blame and abort machinery), over its Unix socket
  tcpstore     ``StoreControl`` -> a ``torch.distributed.TCPStore`` on 127.0.0.1 hosted by
               a process of its own (what multi-host runs use: polling waits that watch the
               owner's heartbeat counter and the ``abort`` key)
  tcpstore_raw_wait  the same store with TCPStore's own blocking ``wait`` and nothing else
               (the mechanism's floor: no heartbeat watch, no abort, no blame)

Workload, ``--rounds`` rounds for each ``PxD`` shape: every prefill publishes ``roundR`` (a
JSON string of ``--value-bytes``; a real round-1 offer is a few KB of exports and digests);
every decode waits for every prefill's ``roundR`` and then publishes ``ackR``; every prefill
waits for every decode's ``ackR``. That is the all-to-all pattern of a real run's offers and
handshakes. Each process times its rounds; the figures are the median and the maximum
seconds per round over all processes and rounds (the first round excluded: connections
warm up), the slowest process's total over its rounds (``exchange_seconds``) and the wall
time from starting the workers to reaping them (``wall_seconds``: start-up and teardown
included). Also: microseconds per ``set`` / ``get`` / ``check`` on a local TCPStore.

    python benchmarks/bench_rendezvous.py --shapes 1x1 16x16 --rounds 20 \\
        --json benchmarks/results/rendezvous-local-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvconnect.child import Child

HERE = Path(__file__).resolve().parent


def _workload(ctl: Any, role: str, rank: int, shape: tuple[int, int], rounds: int,
              value: str) -> list[float]:
    """This worker's side of the exchange; seconds per round."""
    num_prefill, num_decode = shape
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        if role == "prefill":
            ctl.publish(f"round{r}", value)
            for d in range(num_decode):
                ctl.wait(f"decode{d}", f"ack{r}", timeout=60)
        else:
            for p in range(num_prefill):
                ctl.wait(f"prefill{p}", f"round{r}", timeout=60)
            ctl.publish(f"ack{r}", r)
        times.append(time.perf_counter() - t0)
    return times


def _save(out_dir: str, name: str, times: list[float]) -> None:
    Path(out_dir, f"{name}.json").write_text(json.dumps(times))


def _coordinator_run(shape: tuple[int, int], rounds: int, value: str, out_dir: str) -> float:
    """The workload through the real Coordinator (its spawn step replaced by forks of this
    process running the workload with ``SocketControl``); wall seconds."""
    from kvconnect.harness.config import RunConfig
    from kvconnect.harness.control import SocketControl
    from kvconnect.harness.coordinator import event_loop, startup
    from kvconnect.harness.display import Display
    from kvconnect.harness.report import Report
    from kvconnect.interrupts import InterruptSignals

    def start(method: str, args: list[str], log_path: str, listener: Any) -> Child:
        path, role, rank = args[1], args[3], int(args[5])

        def body() -> int:
            if listener is not None:
                os.close(listener.detach())
            ctl = SocketControl.connect(path, role, rank, {}, timeout=60)
            try:
                _save(out_dir, ctl.name, _workload(ctl, role, rank, shape, rounds, value))
                ctl.finish()
            finally:
                ctl.close()
            return 0

        return Child.fork(body, log_path=log_path, own_group=False)

    startup.start_worker = start  # the benchmark's workers instead of the harness's
    os.environ["KVCONNECT_VALIDATE_LAUNCH"] = "subprocess"  # no preload of NIXL and torch work
    cfg = RunConfig(num_prefill=shape[0], num_decode=shape[1], timeout=120.0,
                    heartbeat_timeout=60.0)
    report = Report()
    t0 = time.perf_counter()
    event_loop.Coordinator(cfg, report, Display(live=False, quiet=True),
                           InterruptSignals()).run()
    wall = time.perf_counter() - t0
    failed = [c.detail for c in report.checks if c.status == "fail"]
    if failed:
        raise RuntimeError(f"coordinator run failed: {failed[:2]}")
    return wall


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _RawStore:
    """The floor of the TCPStore itself: ``set``, and a wait that is TCPStore's own blocking
    ``wait`` then ``get`` (no heartbeat watch, no abort key, no blame: what ``StoreControl``
    adds by polling)."""

    def __init__(self, name: str, store: Any) -> None:
        self.name, self.store = name, store

    def publish(self, key: str, value: Any) -> None:
        self.store.set(f"{self.name}/{key}", json.dumps(value))

    def wait(self, owner: str, key: str, timeout: float) -> Any:
        from datetime import timedelta

        self.store.wait([f"{owner}/{key}"], timedelta(seconds=timeout))
        return json.loads(self.store.get(f"{owner}/{key}"))

    def close(self) -> None:
        pass


def _tcpstore_raw_run(shape: tuple[int, int], rounds: int, value: str, out_dir: str) -> float:
    return _tcpstore_run(shape, rounds, value, out_dir, raw=True)


def _tcpstore_run(shape: tuple[int, int], rounds: int, value: str, out_dir: str,
                  raw: bool = False) -> float:
    """The workload through ``StoreControl`` (``raw``: :class:`_RawStore`) over a local
    TCPStore; wall seconds."""
    from kvconnect.harness.config import RunConfig
    from kvconnect.harness.display import Display
    from kvconnect.harness.multihost.rendezvous import Membership, StoreControl, open_store

    cfg = RunConfig(num_prefill=shape[0], num_decode=shape[1], timeout=120.0,
                    heartbeat_timeout=60.0)
    port = _free_port()
    host = Membership("127.0.0.1", port, "prefill", 0, shape[0], shape[1])

    def serve() -> int:  # the store's host: a process of its own, as on a real run
        store = open_store(host, 30.0, master=True)
        time.sleep(3600)
        return 0 if store else 1

    server = Child.fork(serve, log_path=os.path.join(out_dir, "store.log"), own_group=True)
    children = []
    t0 = time.perf_counter()
    for role, count in (("prefill", shape[0]), ("decode", shape[1])):
        for rank in range(count):
            m = Membership("127.0.0.1", port, role, rank, shape[0], shape[1])

            def body(m: Membership = m) -> int:
                store = open_store(m, 30.0, master=False)
                ctl = _RawStore(m.name, store) if raw else StoreControl(
                    m.name, cfg, store, lambda m=m: open_store(m, 30.0, master=False),
                    Display(live=False, quiet=True))
                try:
                    _save(out_dir, m.name, _workload(ctl, m.role, m.rank, shape, rounds,
                                                     value))
                finally:
                    ctl.close()
                return 0

            children.append(Child.fork(body, log_path=os.path.join(out_dir, f"{m.name}.log"),
                                       own_group=True))
    codes = [c.end(300.0) for c in children]
    wall = time.perf_counter() - t0
    server.end()
    if any(codes):
        raise RuntimeError(f"tcpstore workers exited {codes}")
    return wall


def _op_costs(n: int, value: str) -> dict[str, Any]:
    """Microseconds per set and per get of a present key on a local TCPStore (one client)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = _free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    t0 = time.perf_counter()
    for i in range(n):
        client.set(f"k{i}", value)
    t1 = time.perf_counter()
    for i in range(n):
        client.get(f"k{i}")
    t2 = time.perf_counter()
    for i in range(n):
        client.check([f"k{i}"])
    t3 = time.perf_counter()
    del client, server
    return {"ops": n, "set_us": round((t1 - t0) / n * 1e6, 1),
            "get_us": round((t2 - t1) / n * 1e6, 1),
            "check_us": round((t3 - t2) / n * 1e6, 1)}


def _summary(out_dir: str, wall: float) -> dict[str, Any]:
    per_round, exchange = [], 0.0
    for path in Path(out_dir).glob("*[0-9].json"):
        times = json.loads(path.read_text())
        per_round.extend(times[1:])  # round 0: connections warm up
        exchange = max(exchange, sum(times))
    return {"wall_seconds": round(wall, 3), "exchange_seconds": round(exchange, 3),
            "round_median_ms": round(statistics.median(per_round) * 1e3, 2),
            "round_max_ms": round(max(per_round) * 1e3, 2), "samples": len(per_round)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1x1", "16x16"], help="PxD shapes")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--value-bytes", type=int, default=4096)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    value = "x" * args.value_bytes
    import torch.distributed  # noqa: F401 - once, before forking (not per process)

    results: dict[str, Any] = {"shapes": {}}
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split("x"))
        row = {}
        for name, run in (("coordinator", _coordinator_run), ("tcpstore", _tcpstore_run),
                          ("tcpstore_raw_wait", _tcpstore_raw_run)):
            with tempfile.TemporaryDirectory(prefix="kvv-bench-rdv-") as out_dir:
                row[name] = _summary(out_dir, run(shape, args.rounds, value, out_dir))
            print(f"{text} {name}: {row[name]}", flush=True)
        results["shapes"][text] = row
    results["tcpstore_ops"] = _op_costs(2000, value)
    print(f"tcpstore ops: {results['tcpstore_ops']}")
    import torch

    results["machine"] = {"host": platform.node(), "cpus": os.cpu_count(),
                          "kernel": platform.release(), "python": platform.python_version(),
                          "torch": torch.__version__}
    results["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    results["rounds"], results["value_bytes"] = args.rounds, args.value_bytes
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
