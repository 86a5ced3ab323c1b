"""The decode worker: fetches every prefill's blocks over every transport and checks them.

Per round and prefill its phases are ``wait:<prefill>:roundN`` (the prefill's offers),
``handshake:<prefill>:roundN`` (each transport loads the offer: IPC maps the chunks, NIXL
loads the remote agent) and ``transfer:<transport>:<prefill>:roundN`` (one fetch, then the
digests are compared); at the end of a round ``notification:roundN`` tells the prefills it
finished (with, per transport whose fetches notify their exporter, how many such fetches
it completed from each prefill, and the identity its notices carry).

A prefill that dies is not the end when the run restarts it (``--inject restart-prefill``):
after a failed handshake or fetch the decode asks the run whether the prefill was replaced
(:meth:`~.control.Control.peer_restarted`); if so it checks its own cache was not touched
outside the blocks it was fetching (they are never reported as received), drops what it
held of the dead prefill, waits for the new one's offers and fetches what failed again,
without restarting. Each recovery is a ``recovery/<pair>/roundN`` check.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvconnect.block_ids import merged_block_ids
from kvconnect.peer_layout import PeerLayout, PeerLayoutError

from ..config import DECODE, PREFILL, pair_name, worker_name
from ..control import Control
from ..faults import restarted_workers
from ..report import Transfer
from .content import (
    cache_rows,
    content_key,
    digest_blocks,
    fill,
    first_difference,
    generate,
    owners,
    paired_owners,
    region_label,
)
from .reference_copies import reference_copy_gbps
from .steps import MAX_QUOTED, WorkerSteps, mib, round_wait

log = logging.getLogger(__name__)

#: fetch attempts from one prefill in one round (a first one and recoveries)
MAX_ATTEMPTS = 3


@dataclass
class _Failed:
    """A transport that failed with a peer: in which ``phase``, why, after ``seconds``."""

    phase: str
    message: str
    seconds: float

    @classmethod
    def after(cls, phase: str, what: str, t0: float, exc: Exception) -> _Failed:
        """``what`` failed with ``exc``, ``t0`` (``perf_counter``) being when it started."""
        seconds = time.perf_counter() - t0
        return cls(phase, f"{what} failed after {seconds:.2f} s: {type(exc).__name__}: {exc}",
                   seconds)


@dataclass
class _Offer:
    """What one prefill offers this decode in one round (its ``roundN`` value, ``info``)
    and the blocks an attempt fetches from it: prefill ids ``remote_ids`` into our
    ``local_ids``."""

    prefill: str
    pair: str
    rank: int
    round_no: int
    info: dict[str, Any]
    remote_ids: list[int]
    local_ids: list[int]

    @property
    def incarnation(self) -> int:
        return int(self.info.get("incarnation", 1))

    def check_name(self, transport: str) -> str:
        return f"transfer/{self.pair}/{transport}/round{self.round_no}"

    @functools.cached_property
    def id_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(remote_ids, local_ids)`` as int64 arrays, converted once before every transport's
        timed fetch (converting a list inside ``fetch`` is host work on the timed path: H200,
        4096 ids: ~126 us of a 1 GiB fetch's ~745 us; benchmarks/results/probe-shapes-h200.json)."""
        return merged_block_ids([(self.remote_ids, self.local_ids)], ("remote_ids", "local_ids"))

    @functools.cached_property
    def layout(self) -> PeerLayout:
        """The prefill's published layout, parsed once (checked by each transport's
        ``open_peer`` before any fetch)."""
        return PeerLayout.from_json(self.info["layout"])


class DecodeWorker(WorkerSteps):
    """Consumes blocks: fetches each prefill's blocks over every transport and checks them."""

    role = DECODE

    def __init__(self, ctl: Control, rank: int, socket_dir: str) -> None:
        super().__init__(ctl, rank, socket_dir)
        #: the receiving halves of the transports (kvconnect.connectors.transport), by name
        self.transports: dict[str, Any] = {}
        #: per prefill, the incarnation whose offers this decode used last
        self.incarnations: dict[str, int] = {}
        #: this round's fetches that notify their prefill: transport -> prefill ->
        #: incarnation and count
        self.notices: dict[str, dict[str, dict[str, int]]] = {}
        #: per prefill, its latest round-1 offer and the transports whose round-1 transfer
        #: arrived byte-exact (what ``--sizes`` measures)
        self.offers: dict[str, dict[str, Any]] = {}
        self.verified: dict[str, list[str]] = {}
        #: guard the cache around fetches only where a prefill may be restarted (digesting
        #: every other block costs time on large caches)
        self.guard_cache = bool(restarted_workers(self.cfg.faults))

    def cleanup(self) -> None:
        self.close_all(self.transports, "a transport")
        super().cleanup()

    def transport(self, name: str) -> Any:
        """This worker's receiving half of transport ``name``, built on first use."""
        if name not in self.transports:
            from kvconnect.connectors.registry import get_transport

            self.transports[name] = get_transport(name).receiver(
                self.transport_context(), self.registrations.get(name))
        return self.transports[name]

    def steps(self) -> None:
        ctl, cfg = self.ctl, self.cfg
        self.prepare()
        self.fill_all(self.name)
        for round_no in (1, 2):
            if round_no == 2:
                self.sleep_wake(self.name)
                for transport in self.transports.values():
                    transport.invalidate()  # our memory was released and recommitted
            self.notices = {}
            for p in range(cfg.num_prefill):
                self.fetch_from(p, round_no)
            if round_no == 1 and cfg.sweep_sizes:
                self.sweep_all()
            ctl.phase(f"notification:round{round_no}")
            ctl.publish(f"round{round_no}/done", {
                "identities": {t: r.identity for t, r in self.registrations.items()},
                "notices": self.notices})

    def sweep_all(self) -> None:
        """``--sizes``: the bandwidth sweep from every prefill over every transport that
        moved its blocks byte-exact in round 1 (:mod:`.sweep`)."""
        from .sweep import run_sweep

        for p in range(self.cfg.num_prefill):
            prefill = worker_name(PREFILL, p)
            if self.verified.get(prefill):
                run_sweep(self, p, self.offers[prefill], self.verified[prefill])

    def count_notice(self, transport: str, prefill: str, incarnation: int) -> None:
        """One more completed fetch from ``prefill`` (incarnation ``incarnation``) over
        ``transport``: counted when that transport notifies its exporter of each fetch."""
        from kvconnect.connectors.registry import get_transport

        if not get_transport(transport).notifies_exporter:
            return
        notices = self.notices.setdefault(transport, {})
        notice = notices.get(prefill)
        if notice is None or notice["incarnation"] != incarnation:
            notice = notices[prefill] = {"incarnation": incarnation, "count": 0}
        notice["count"] += 1

    # -- one prefill, one round --------------------------------------------------------------
    def fetch_from(self, p: int, round_no: int) -> None:
        ctl, cfg = self.ctl, self.cfg
        prefill = worker_name(PREFILL, p)
        pair = pair_name(p, self.rank)
        ctl.phase(f"wait:{prefill}:round{round_no}")
        info = ctl.wait(prefill, f"round{round_no}", timeout=round_wait(cfg))
        self.note_incarnation(prefill, pair, round_no, info)
        diffs = _layout_differences(self.built_layout, info.get("layout"))
        if diffs:
            ctl.failed(f"compat/{pair}", f"{prefill}'s KV layout differs: "
                                         + "; ".join(diffs[:MAX_QUOTED]))
            ctl.publish(f"handshake/{prefill}/round{round_no}", {"opened": []})
            return
        offer = _Offer(prefill, pair, p, round_no, info, *cfg.block_sets(p, self.rank, round_no))
        pending = list(cfg.transports)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            guard = self.others_digests(offer.local_ids) if self.guard_cache else None
            failed = self.attempt(offer, pending, attempt)
            if not failed or not self.recovered(offer, failed, guard, attempt):
                return
            pending = list(failed)

    def recovered(self, offer: _Offer, failed: dict[str, _Failed],
                  guard: list[list[str]] | None, attempt: int) -> bool:
        """After a failed attempt: True when the prefill was replaced (``offer`` then holds
        the new incarnation's offer: fetch again); else the failures are reported, False."""
        ctl, cfg = self.ctl, self.cfg
        prefill, round_no, old = offer.prefill, offer.round_no, offer.incarnation
        t0 = time.monotonic()
        ctl.phase(f"peer-check:{prefill}:round{round_no}")  # did it die and come back?
        new = (ctl.peer_restarted(prefill, old, timeout=cfg.heartbeat_timeout)
               if attempt < MAX_ATTEMPTS else None)
        if new is None:  # the prefill is alive: these are failures of their own
            for transport, f in failed.items():
                ctl.failed(offer.check_name(transport),
                           f"{offer.pair} {transport} round {round_no}: {f.message}", f.seconds,
                           data={"role": DECODE, "rank": self.rank, "phase": f.phase,
                                 "peer": prefill, "peer_incarnation": old, "attempt": attempt,
                                 "blocks_not_received": len(offer.local_ids)})
            return False
        ctl.phase(f"recover:{prefill}:round{round_no}")
        intact = self.intact(guard, offer.local_ids)
        for transport in failed:
            self.transport(transport).invalidate(prefill)  # the dead prefill's mappings
        offer.info = ctl.wait(prefill, f"round{round_no}", timeout=round_wait(cfg))
        self.incarnations[prefill] = int(offer.info.get("incarnation", new))
        self.record_recovery(offer.pair, prefill, round_no, old, offer.info, failed,
                             offer.local_ids, intact, time.monotonic() - t0)
        return True

    def note_incarnation(self, prefill: str, pair: str, round_no: int,
                         info: dict[str, Any]) -> None:
        """A prefill replaced since this decode last used it (between rounds): drop what we
        held of the old one; the handshake loads the new one's offers."""
        new = int(info.get("incarnation", 1))
        old = self.incarnations.get(prefill)
        self.incarnations[prefill] = new
        if old is None or old == new:
            return
        for transport in self.transports.values():
            transport.invalidate(prefill)
        self.record_recovery(pair, prefill, round_no, old, info, {}, [], None, 0.0)

    def attempt(self, offer: _Offer, transports: list[str], attempt: int
                ) -> dict[str, _Failed]:
        """Handshake with the prefill and fetch ``offer``'s blocks over ``transports``;
        every outcome but a failure with the peer (skips, verified or mismatching
        transfers) is reported now. Returns the transports that failed with the peer."""
        failed: dict[str, _Failed] = {}
        opened = self.handshake(offer, transports, failed)
        reference: dict[int, float] = {}  # bytes -> GB/s of the same-run reference copy
        for transport in opened:
            self.fetch_over(offer, transport, attempt, failed, reference)
        return failed

    def handshake(self, offer: _Offer, transports: list[str],
                  failed: dict[str, _Failed]) -> list[str]:
        """Load the prefill's offer into each transport that can use it (the others are
        skipped, or go into ``failed``) and tell the prefill which did; those transports."""
        from kvconnect.connectors.registry import get_transport

        ctl, info, prefill = self.ctl, offer.info, offer.prefill
        opened: list[str] = []
        ctl.phase(f"handshake:{prefill}:round{offer.round_no}")
        for transport in transports:
            name = offer.check_name(transport)
            if get_transport(transport).same_host_only and info.get("boot_id") != self.boot_id:
                ctl.skipped(name, f"{prefill} runs on another host (boot id "
                                  f"{info.get('boot_id')} != {self.boot_id}): {transport} "
                                  "needs one kernel")
                continue
            export = info.get("exports", {}).get(transport)
            if export is None:
                ctl.skipped(name, f"{prefill} offers no {transport} export")
                continue
            t0 = time.perf_counter()
            try:
                self.transport(transport).open_peer(prefill, export)
            except Exception as exc:  # noqa: BLE001 - one failed transport, keep the others
                failed[transport] = _Failed.after(ctl.current_phase,
                                                  f"handshake with {prefill}", t0, exc)
                continue
            opened.append(transport)
        # the prefill starts its transfer phase once every decode got this far
        ctl.publish(f"handshake/{prefill}/round{offer.round_no}",
                    {"incarnation": offer.incarnation, "opened": opened,
                     "failed": sorted(failed)})
        return opened

    def fetch_over(self, offer: _Offer, transport: str, attempt: int,
                   failed: dict[str, _Failed], reference: dict[int, float]) -> None:
        """One fetch of ``offer``'s blocks over ``transport``, verified against the
        prefill's digests and reported; a failure with the peer goes into ``failed``.
        ``reference``: bytes -> GB/s of the same-run reference copy (filled on first use)."""
        ctl = self.ctl
        ctl.phase(f"transfer:{transport}:{offer.prefill}:round{offer.round_no}")
        self.poison(offer.local_ids)
        remote, local = offer.id_arrays
        t0 = time.perf_counter()
        try:
            result = self.transport(transport).fetch(offer.prefill, remote, local,
                                                     timeout=self.cfg.timeout)
        except Exception as exc:  # noqa: BLE001 - one failed transport, keep the others
            failed[transport] = _Failed.after(
                ctl.current_phase, f"transfer of {len(offer.local_ids)} blocks", t0, exc)
            return
        self.count_notice(transport, offer.prefill, offer.incarnation)
        mismatches = self.verify(offer.prefill, offer.layout, offer.remote_ids,
                                 offer.local_ids, offer.info["digests"][self.name])
        src = self.reference_source(offer.rank, offer.info)
        if result.bytes not in reference:
            reference[result.bytes] = reference_copy_gbps(result.bytes, src, self.device)
        t = Transfer.measured(offer.pair, transport, result.bytes, result.seconds,
                              verified=not mismatches, backend=result.backend,
                              round=offer.round_no, blocks=len(offer.local_ids),
                              reference_gbps=reference[result.bytes])
        ctl.transfer(t)
        self.report_fetch(offer, transport, attempt, result, t, src, mismatches)

    def report_fetch(self, offer: _Offer, transport: str, attempt: int, result: Any,
                     t: Transfer, src: str, mismatches: list[dict[str, Any]]) -> None:
        """The ``transfer/<pair>/<transport>/roundN`` check of one fetch: byte-exact, or
        which block regions differ."""
        head = (f"{offer.pair} {transport} round {offer.round_no}: {len(offer.local_ids)} "
                f"blocks {mib(result.bytes)} in {result.seconds * 1e3:.1f} ms = "
                f"{t.gbps:.2f} GB/s via {result.backend} (setup "
                f"{result.setup_seconds * 1e3:.1f} ms, {result.note}; reference: one plain "
                f"torch copy {src}->{self.device} of the same bytes {t.reference_gbps:.2f} "
                "GB/s, same run)")
        where = {"peer_incarnation": offer.incarnation, "attempt": attempt}
        name = offer.check_name(transport)
        if mismatches:
            self.ctl.failed(name, f"{head}: {len(mismatches)} block regions differ: "
                            + "; ".join(_mismatch_text(m) for m in mismatches[:MAX_QUOTED]),
                            result.seconds, data={"mismatches": mismatches[:MAX_QUOTED],
                                                  "num_mismatches": len(mismatches), **where})
            return
        self.ctl.passed(name, f"{head}: every block byte-exact", result.seconds, data=where)
        if offer.round_no == 1:
            self.offers[offer.prefill] = offer.info
            self.verified.setdefault(offer.prefill, []).append(transport)

    # -- recovery ------------------------------------------------------------------------------
    def others_digests(self, local_ids: list[int]) -> list[list[str]]:
        """Digests of every block a fetch into ``local_ids`` must not touch."""
        dest = set(local_ids)
        others = [b for b in range(self.cfg.num_blocks) if b not in dest]
        return [digest_blocks(cache_rows(self.cache, s), others) for s in owners(self.built_layout)]

    def intact(self, guard: list[list[str]] | None,
               local_ids: list[int]) -> dict[str, Any] | None:
        """Compare :meth:`others_digests` now with ``guard``: ``checked`` blocks and the
        ``changed`` ones (None without a guard)."""
        if guard is None:
            return None
        now = self.others_digests(local_ids)
        dest = set(local_ids)
        others = [b for b in range(self.cfg.num_blocks) if b not in dest]
        changed = sorted({others[i] for before, after in zip(guard, now, strict=True)
                          for i, (x, y) in enumerate(zip(before, after, strict=True))
                          if x != y})
        return {"checked": len(others), "changed": changed[:MAX_QUOTED],
                "num_changed": len(changed)}

    def record_recovery(self, pair: str, prefill: str, round_no: int, old: int,
                        info: dict[str, Any], failed: dict[str, _Failed],
                        local_ids: list[int], intact: dict[str, Any] | None,
                        waited: float) -> None:
        """The ``recovery/<pair>/roundN`` check: which incarnation replaced which, what had
        failed, the blocks not received, and whether the rest of our cache stayed intact."""
        new = int(info.get("incarnation", 1))
        ok = intact is None or intact["num_changed"] == 0
        data = {"role": DECODE, "rank": self.rank, "peer": prefill, "round": round_no,
                "old_incarnation": old, "new_incarnation": new,
                "failed": {t: {"phase": f.phase, "cause": f.message} for t, f in failed.items()},
                "blocks_not_received": sorted(local_ids) if failed else [],
                "cache_intact": ok, "cache_guard": intact,
                "waited_seconds": round(waited, 3)}
        if not failed:
            text = (f"{prefill} was replaced between rounds (incarnation {old} -> {new}): "
                    f"its round {round_no} offers are loaded afresh")
        else:
            text = (f"{prefill} (incarnation {old}) died during "
                    + ", ".join(f"{t} ({f.phase})" for t, f in failed.items())
                    + f"; incarnation {new} answered after {waited:.2f} s: handshake and "
                    f"fetch again; the {len(local_ids)} blocks being fetched were not "
                    "reported as received")
            text += ("; the other blocks of our cache are unchanged" if ok else
                     f"; OUR CACHE CHANGED outside the fetched blocks: {intact}")
        self.ctl.check(f"recovery/{pair}/round{round_no}", "pass" if ok else "fail", text,
                       waited, data=data)

    # -- helpers -----------------------------------------------------------------------------
    def reference_source(self, p: int, info: dict[str, Any]) -> str:
        """Device of the reference copy's source: the prefill's device on this host, else
        this worker's own (a peer on another host has no local reference)."""
        if info.get("boot_id") == self.boot_id:
            return self.cfg.device_for(PREFILL, p)
        return self.device

    def poison(self, local_ids: list[int]) -> None:
        """Overwrite the destination blocks with our own contents (a no-op transfer fails)."""
        for spec in owners(self.built_layout):
            fill(cache_rows(self.cache, spec), content_key(self.cfg.seed, self.name, spec),
                 local_ids)

    def verify(self, prefill: str, remote_layout: PeerLayout, remote_ids: list[int],
               local_ids: list[int], expected: list[list[str]]) -> list[dict[str, Any]]:
        """Compare arrived blocks with the prefill's digests; one record per mismatch:
        ``block`` (prefill's id), ``decode_block``, ``region`` and the first differing byte
        ``offset`` with its ``expected`` and ``got`` values (None where the bytes equal the
        expected pattern but not the prefill's digest)."""
        out = []
        for lspec, rspec, j in paired_owners(self.built_layout, remote_layout):
            rows = cache_rows(self.cache, lspec)
            got = digest_blocks(rows, local_ids)
            for i, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
                if got[i] == expected[i][j]:
                    continue
                want = generate(content_key(self.cfg.seed, prefill, rspec),
                                torch.tensor([r], dtype=torch.int64, device=rows.device),
                                lspec.bytes_per_block)[0]
                diff = first_difference(rows[loc], want)
                offset, exp, got_byte = diff if diff else (None, None, None)
                out.append({"block": r, "decode_block": loc, "region": region_label(rspec),
                            "offset": offset, "expected": exp, "got": got_byte})
        return out


def _mismatch_text(m: dict[str, Any]) -> str:
    """One :meth:`DecodeWorker.verify` record in words."""
    where = (f"first differing byte at offset {m['offset']} (expected 0x{m['expected']:02x}, "
             f"got 0x{m['got']:02x})" if m["offset"] is not None else
             "bytes equal the expected pattern but not the prefill's digest "
             "(the prefill's memory changed after digesting)")
    return f"block {m['block']} (decode block {m['decode_block']}) {m['region']}: {where}"


def _layout_differences(local: PeerLayout, published: Any) -> list[str]:
    """What a decode cannot read of a prefill's published layout: its
    :meth:`PeerLayout.differences` from ours, or why it cannot be read."""
    try:
        remote = PeerLayout.from_json(published)
    except PeerLayoutError as exc:
        return [f"its layout cannot be read: {exc}"]
    return local.differences(remote)
