"""The prefill worker: builds its KV cache, fills every block with position-dependent
contents and serves them to every decode, round 1 and (after an offload round trip and
sleep / wake) round 2.

Per round its phases are ``digest:roundN``, ``handshake:roundN`` (starts the transports'
serving halves once, publishes the offers, waits until every decode loaded them),
``transfer:roundN`` (decodes read; the memory registrations' progress is pumped) and
``notification:roundN`` (each decode's fetches over a transport that notifies its exporter,
NIXL's READs, must have notified us).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import torch

from .. import environment
from ..config import DECODE, PREFILL, worker_name
from ..control import Control
from .content import cache_rows, owners, region_label
from .steps import MAX_QUOTED, WorkerSteps, mib, round_wait, same_blocks

log = logging.getLogger(__name__)


class PrefillWorker(WorkerSteps):
    """Produces blocks: fills, digests, serves them over every transport, round 1 and 2."""

    role = PREFILL

    def __init__(self, ctl: Control, rank: int, socket_dir: str) -> None:
        super().__init__(ctl, rank, socket_dir)
        #: the serving halves of the transports (kvconnect.connectors.transport), by name
        self.exporters: dict[str, Any] = {}
        self.decode_pids: set[int] = set()

    def cleanup(self) -> None:
        self.close_all(self.exporters, "an exporter")
        super().cleanup()

    def start_exporters(self) -> None:
        """Start each transport's serving half; same-host-only transports serve the decodes
        that said hello from this host."""
        from kvconnect.connectors.registry import get_transport

        cfg = self.cfg
        for name in cfg.transports:
            spec = get_transport(name)
            if spec.exporter is None:
                continue
            if spec.same_host_only and not self.decode_pids:
                for d in range(cfg.num_decode):
                    info = self.ctl.wait(worker_name(DECODE, d), "hello")
                    if info.get("boot_id") == self.boot_id:
                        self.decode_pids.add(int(info["pid"]))
            self.exporters[name] = spec.exporter(self.transport_context(),
                                                 self.registrations.get(name))

    def steps(self) -> None:
        ctl, cfg = self.ctl, self.cfg
        self.prepare()
        t0 = time.perf_counter()
        nbytes = self.fill_all(self.name)
        ctl.passed("content/fill", f"{cfg.num_blocks} blocks x {len(owners(self.built_layout))} "
                                   f"regions ({mib(nbytes)}) filled with position-dependent "
                                   "contents", time.perf_counter() - t0)
        for round_no in (1, 2):
            if round_no == 2:
                self.offload_round_trip()
                paused = []
                try:
                    for exporter in self.exporters.values():
                        exporter.pause()
                        paused.append(exporter)
                    self.sleep_wake(self.name)
                finally:
                    for exporter in paused:
                        exporter.resume()
            self.serve(round_no)

    def serve(self, round_no: int) -> None:
        """One round: digest, publish the offers and wait until every decode loaded them
        (handshake), let the decodes read (transfer), check their READ completion
        notifications (notification)."""
        ctl, cfg = self.ctl, self.cfg
        ctl.phase(f"digest:round{round_no}")
        digests = {}
        for d in range(cfg.num_decode):
            remote, _ = cfg.block_sets(self.rank, d, round_no)
            digests[worker_name(DECODE, d)] = self.digests(remote)
        if round_no == 1 and cfg.corrupt:
            self.corrupt()
        ctl.phase(f"handshake:round{round_no}")
        if round_no == 1:
            self.start_exporters()
        info = {
            "pid": os.getpid(), "boot_id": self.boot_id, "hostname": environment.hostname(),
            "incarnation": ctl.incarnation,
            "layout": self.built_layout.to_json(), "digests": digests,
            "exports": {name: e.describe() for name, e in self.exporters.items()},
        }
        ctl.publish(f"round{round_no}", info)
        for d in range(cfg.num_decode):  # each decode loaded the offers (or could not)
            ctl.wait(worker_name(DECODE, d), f"handshake/{self.name}/round{round_no}",
                     timeout=round_wait(cfg))
        ctl.phase(f"transfer:round{round_no}")
        done = {}
        with _ProgressPump(list(self.registrations.values())):
            for d in range(cfg.num_decode):
                decode = worker_name(DECODE, d)
                done[decode] = ctl.wait(decode, f"round{round_no}/done",
                                        timeout=round_wait(cfg))
        ctl.phase(f"notification:round{round_no}")
        self.check_notifications(round_no, done)

    def check_notifications(self, round_no: int, done: dict[str, Any]) -> None:
        """The ``<transport>/notifications/roundN`` check of every transport whose fetches
        notify their exporter (:meth:`check_notices`)."""
        from kvconnect.connectors.registry import get_transport

        for name, registration in self.registrations.items():
            if get_transport(name).notifies_exporter:
                self.check_notices(name, registration, round_no, done)

    def check_notices(self, transport: str, registration: Any, round_no: int,
                      done: dict[str, Any]) -> None:
        """Every fetch over ``transport`` a decode completed from this incarnation notified
        us: wait (at most the heartbeat timeout after the decode said it was done) until each
        decode's count arrived. Lost ones fail the check, naming the decode and how many are
        missing."""
        ctl, cfg = self.ctl, self.cfg
        expected, senders = _expected_notices(transport, self.name, ctl.incarnation, done)
        received = dict.fromkeys(expected, 0)
        dropped = 0
        t0 = time.monotonic()
        deadline = t0 + cfg.heartbeat_timeout
        pause = 1e-3
        while True:
            notes = registration.take_notices()
            if ctl.effects.drop_notifications:  # an injected fault: lost on the way
                dropped += sum(notes.values())
                notes = {}
            for sender, count in notes.items():
                decode = senders.get(sender)
                if decode is not None:
                    received[decode] += count
            if all(received[d] >= n for d, n in expected.items()) \
                    or time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        waited = time.monotonic() - t0
        missing = {d: n - received[d] for d, n in expected.items() if received[d] < n}
        data = {"role": PREFILL, "rank": self.rank, "phase": ctl.current_phase,
                "expected": expected, "received": received, "missing": missing,
                "dropped": dropped, "waited_seconds": round(waited, 3)}
        name = f"{transport}/notifications/round{round_no}"
        if missing:
            ctl.failed(name, f"{self.name} round {round_no}: {transport} completion "
                             f"notifications missing {waited:.1f} s after the decodes finished "
                             "reading: " + ", ".join(f"{n} of {expected[d]} from {d}"
                                                     for d, n in missing.items()),
                       waited, data=data)
        else:
            ctl.passed(name, f"{sum(received.values())} {transport} completion notifications, "
                             f"one per fetch of {len(expected)} decodes", waited, data=data)

    def corrupt(self) -> None:
        """Negative control: flip one byte of one transferred block, after digesting."""
        rank, block = self.cfg.corrupt_target()
        if rank != self.rank:
            return
        rng = random.Random(f"{self.cfg.seed}/corrupt-byte")
        spec = rng.choice(owners(self.built_layout))
        offset = rng.randrange(spec.block_len)
        rows = cache_rows(self.cache, spec)
        rows[block, offset] ^= 0xFF
        label = region_label(spec)
        self.ctl.passed("negative_control/armed",
                        f"--corrupt: flipped byte {offset} of block {block} {label} after "
                        "digesting; the transfers of this block must fail",
                        data={"block": block, "region": label, "offset": offset})

    def offload_round_trip(self) -> None:
        """CPU offload: save, clobber, load back (and into other blocks), compare bytes."""
        from kvconnect.connectors.offload.connector import CPUOffloadConnector

        ctl, cfg = self.ctl, self.cfg
        ctl.phase("offload")
        rng = random.Random(f"{cfg.seed}/{self.name}/offload")
        k = min(cfg.transfer_blocks, cfg.num_blocks // 2)
        picked = rng.sample(range(cfg.num_blocks), 2 * k)
        ids, elsewhere = sorted(picked[:k]), picked[k:]
        before = self.snapshot(ids)
        t0 = time.perf_counter()
        conn = CPUOffloadConnector(self.cache, num_cpu_blocks=k)
        try:
            conn.wait(conn.save(ids), timeout_s=cfg.timeout)
            idx = torch.tensor(ids, dtype=torch.int64, device=self.cache.device)
            for spec in owners(self.built_layout):
                cache_rows(self.cache, spec).index_fill_(0, idx, 0)
            clobbered = self.snapshot(ids)
            conn.wait(conn.load(ids), timeout_s=cfg.timeout)
            after = self.snapshot(ids)
            conn.wait(conn.load(elsewhere, keys=ids), timeout_s=cfg.timeout)
            moved = self.snapshot(elsewhere)
            seconds = time.perf_counter() - t0
            pool = conn.pool_bytes
        finally:
            conn.close()
        unchanged = same_blocks(before, clobbered)
        if unchanged:
            ctl.failed("offload/clobber", f"blocks {[ids[i] for i in unchanged][:MAX_QUOTED]} "
                                          "unchanged by the clobber: the round trip would "
                                          "prove nothing")
        bad = [ids[i] for i in range(k) if i not in set(same_blocks(before, after))]
        ctl.check("offload/round_trip", "fail" if bad else "pass",
                  f"blocks {bad[:MAX_QUOTED]} differ after save, clobber, load" if bad else
                  f"{k} blocks saved to a {mib(pool)} CPU pool, clobbered, loaded back "
                  "byte-exact", seconds)
        bad = [elsewhere[i] for i in range(k) if i not in set(same_blocks(before, moved))]
        ctl.check("offload/load_elsewhere", "fail" if bad else "pass",
                  f"blocks {bad[:MAX_QUOTED]} differ when loaded into other block ids" if bad
                  else f"the same {k} blocks loaded into {k} other block ids byte-exact")

    def snapshot(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of ``block_ids``' bytes, one ``(len(ids), block_len)`` tensor per region."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)
        return [cache_rows(self.cache, s).index_select(0, idx) for s in owners(self.built_layout)]


def _expected_notices(transport: str, prefill: str, incarnation: int,
                      done: dict[str, Any]) -> tuple[dict[str, int], dict[str, str]]:
    """From each decode's ``roundN/done`` value: how many notices over ``transport`` it
    expects us (``prefill``, this ``incarnation``) to have received, and the identity its
    notices carry -> the decode."""
    expected: dict[str, int] = {}
    senders: dict[str, str] = {}
    for decode, value in done.items():
        if not isinstance(value, dict):
            continue
        notice = ((value.get("notices") or {}).get(transport) or {}).get(prefill)
        if isinstance(notice, dict) and notice.get("incarnation") == incarnation:
            expected[decode] = int(notice.get("count", 0))
            senders[str((value.get("identities") or {}).get(transport))] = decode
    return expected, senders


class _ProgressPump:
    """Drives memory registrations' progress every millisecond from a thread while the
    owner's thread is blocked waiting (so peers' reads of our memory complete), and only
    then: a registration is never used by two threads at once."""

    def __init__(self, registrations: list[Any], period_s: float = 0.001) -> None:
        self.registrations = registrations
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> _ProgressPump:
        if self.registrations:
            self._thread = threading.Thread(target=self._run, name="kvv-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                for registration in self.registrations:
                    registration.progress()
        except BaseException as exc:  # noqa: BLE001 - surfaced by __exit__
            self.error = exc

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"progress of a memory registration failed while serving: "
                               f"{self.error}")
