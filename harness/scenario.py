"""What one worker does: the issue's steps 1-6 for a prefill or a decode worker.

Prefill ``p``: build the extensible KV cache (1 block, warm-up prefix, final size,
single-handle recommit) and check it; register with NIXL after the final commit; fill every
committed block with position-dependent contents; digest the blocks each decode will fetch;
(``--corrupt``: flip one byte afterwards); serve round 1; CPU offload round trip; sleep /
wake (release, recommit zeroed, refill, re-register); serve round 2.

Decode ``d``: the same cache build and registration; fill its blocks with its own "poison"
contents; for each round and each prefill: fetch a random non-contiguous block set over every
transport (re-poisoning the destination first), digest what arrived and compare; between
the rounds, sleep / wake its own cache and re-register.

Each step reports checks through :class:`~.control.Control`; a peer problem raises
:class:`~.control.PeerFailure`, which ends the worker (the coordinator reports it).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any

import torch

from . import environment
from .config import DECODE, PREFILL, RunConfig, pair_name, worker_name
from .content import (
    RegionSpec,
    all_zero,
    cache_rows,
    content_key,
    digest_blocks,
    fill,
    first_difference,
    generate,
    owners,
    region_specs,
)
from .control import Control
from .report import Transfer

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: mismatches quoted in one failed check
MAX_QUOTED = 5


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class _Worker:
    """State and steps shared by both roles. Owns the cache, the NIXL worker and the IPC
    server; :meth:`run` releases all of them on every path."""

    role = ""

    def __init__(self, ctl: Control, rank: int, ipc_dir: str) -> None:
        self.ctl = ctl
        self.cfg: RunConfig = ctl.config
        self.rank = rank
        self.name = worker_name(self.role, rank)
        self.device = self.cfg.device_for(self.role, rank)
        self.ipc_dir = ipc_dir
        self.cache: Any = None
        self.nixl: Any = None
        self.specs: list[RegionSpec] = []
        self.boot_id = environment.boot_id(self.name)

    def run(self) -> None:
        try:
            self.steps()
        finally:
            self.cleanup()

    def steps(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def cleanup(self) -> None:
        if self.nixl is not None:
            try:
                self.nixl.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("%s: closing NIXL failed: %s", self.name, exc)
            self.nixl = None
        if self.cache is not None:
            self.cache.free()
            self.cache = None

    def hello(self) -> dict[str, Any]:
        info = {"pid": os.getpid(), "boot_id": self.boot_id,
                "hostname": environment.hostname(), "device": self.device}
        if self.device.startswith("cuda"):
            info["gpu"] = torch.cuda.get_device_name(torch.device(self.device))
        self.ctl.publish("hello", info)
        return info

    # -- step 1: the extensible KV cache -------------------------------------------------------
    def build_cache(self) -> None:
        from kvconnect.kv_cache import ExtensibleKVCache
        from kvconnect.layout import preset

        ctl, cfg = self.ctl, self.cfg
        ctl.phase("allocate")
        kv_cfg = preset(cfg.layout, num_blocks=cfg.num_blocks, num_layers=cfg.num_layers)
        rdma = False
        if self.device.startswith("cuda"):
            from kvconnect.vmm import get_vmm_driver

            drv = get_vmm_driver(self.device)
            rdma = bool(drv is not None and drv.capabilities().gpudirect_rdma_with_vmm)
        t0 = time.perf_counter()
        self.cache = cache = ExtensibleKVCache(kv_cfg, self.device,
                                               capacity_blocks=cfg.capacity_blocks,
                                               shareable=True, rdma_capable=rdma)
        cache.allocate()
        tensors = cache.tensors
        segments = sum(t.num_segments for t in tensors)
        reserved = sum(t.capacity_bytes for t in tensors)
        ok = cache.num_blocks == 1 and cache.num_physical_chunks == segments
        ctl.check("kv_cache/allocate", "pass" if ok else "fail",
                  f"reserved {_mib(reserved)} for {cache.capacity_blocks} blocks in "
                  f"{len(tensors)} tensors / {segments} segments; committed {cache.num_blocks} "
                  f"block ({cache.num_physical_chunks} chunks of {cache.granule} bytes)",
                  time.perf_counter() - t0)

        ctl.phase("warmup")
        warm = min(cfg.warmup_blocks, cfg.num_blocks)
        cache.ensure_kv_cache_blocks(warm)
        for t in tensors:  # warm-up writes garbage into the committed prefix
            for s in range(t.num_segments):
                t.segment_view(s).fill_(0xA5)
        chunks_warm = cache.num_physical_chunks
        ctl.check("kv_cache/warmup", "pass" if cache.num_blocks == warm else "fail",
                  f"{cache.num_blocks} blocks committed (asked {warm}); {chunks_warm} physical "
                  f"chunks for {segments} segments")

        self.nixl_before_final()
        ctl.phase("final")
        t0 = time.perf_counter()
        cache.ensure_kv_cache_blocks(cfg.num_blocks)
        before = cache.num_physical_chunks
        cache.extend_kv_cache(cfg.num_blocks, single_handle=True)
        after = cache.num_physical_chunks
        final_ok = cache.is_final and cache.num_blocks == cfg.num_blocks
        ctl.check("kv_cache/final", "pass" if final_ok else "fail",
                  f"final size {cache.num_blocks} blocks ({_mib(cache.committed_bytes)} "
                  f"committed of {_mib(reserved)} reserved), is_final={cache.is_final}",
                  time.perf_counter() - t0)
        per_seg = [len([c for c in t.physical_chunks() if c.segment == s])
                   for t in tensors for s in range(t.num_segments)]
        note = "" if before > segments else (
            " (the final size fits the first granule of every segment, so there was nothing "
            "to recommit; a larger --num-blocks exercises it)")
        ctl.check("kv_cache/one_chunk_per_segment",
                  "pass" if all(n == 1 for n in per_seg) else "fail",
                  f"{before} physical chunks before the single-handle recommit, {after} after, "
                  f"for {segments} segments (per segment: {sorted(set(per_seg))}){note}",
                  data={"chunks_before": before, "chunks_after": after, "segments": segments})
        self.check_view_sizes()
        self.specs = region_specs(cache)

    def check_view_sizes(self) -> None:
        """Committed views' storages must be exactly the committed bytes (never capacity)."""
        cache = self.cache
        bad = []
        for ti, t in enumerate(cache.tensors):
            for s in range(t.num_segments):
                n = t.segment_view(s).untyped_storage().nbytes()
                if n != t.committed_bytes[s]:
                    bad.append(f"tensor {ti} segment {s}: storage {n} != committed "
                               f"{t.committed_bytes[s]}")
        regions = cache.committed_regions()
        for r in regions:
            n = cache.region_view(r).untyped_storage().nbytes()
            if n != r.span:
                bad.append(f"region {r.layer_name}/{r.part}: storage {n} != span {r.span}")
        full = max(t.full_view().untyped_storage().nbytes() for t in cache.tensors)
        self.ctl.check("kv_cache/view_sizes", "fail" if bad else "pass",
                       "; ".join(bad[:MAX_QUOTED]) if bad else
                       f"{sum(t.num_segments for t in cache.tensors)} segment views and "
                       f"{len(regions)} region views have storages of exactly their committed "
                       f"bytes (the full views span {_mib(full)} of reservation)")

    # -- step 2: deferred NIXL registration and allocation flags --------------------------------
    def nixl_before_final(self) -> None:
        """Create the NIXL agent and check that it refuses the cache before its final commit."""
        if "nixl" not in self.cfg.transports:
            return
        from kvconnect.connectors.errors import KVConnectorError
        from kvconnect.connectors.nixl import NixlConnectorWorker

        ctl = self.ctl
        ctl.phase("nixl_agent")
        # No NIXL progress thread: NIXL 1.5 spins it without pause (a core per agent). Decode
        # progresses inside read_blocks; prefill runs a paced pump while it serves reads.
        self.nixl = NixlConnectorWorker(self.name, default_timeout=self.cfg.timeout,
                                        progress_thread=False)
        try:
            self.nixl.register_kv_cache(self.cache)
        except KVConnectorError as exc:
            ctl.passed("nixl/deferred_registration",
                       f"registering before the final commit was refused: {exc}")
        else:
            self.nixl.deregister()
            ctl.failed("nixl/deferred_registration",
                       "NixlConnectorWorker registered the KV cache before its final commit "
                       "(it must defer registration until extend_kv_cache)")

    def register(self) -> None:
        ctl, cache = self.ctl, self.cache
        ctl.phase("register")
        tensors = cache.tensors
        granted = [t.granted for t in tensors]
        requested = tensors[0].requested
        shareable = all(g.shareable for g in granted)
        rdma_flag = all(g.rdma_capable for g in granted)
        ctl.passed("allocation/flags",
                   f"requested shareable={requested.shareable} rdma_capable="
                   f"{requested.rdma_capable}; granted on all {cache.num_physical_chunks} "
                   f"chunks: shareable(POSIX fd)={shareable} rdma_capable(GPUDirect)="
                   f"{rdma_flag}")
        if "nixl" not in self.cfg.transports:
            ctl.skipped("nixl/register", "nixl is not among --transports")
            return
        t0 = time.perf_counter()
        self.nixl.register_kv_cache(cache)
        ctl.passed("nixl/register",
                   f"agent {self.nixl.agent_name}: {self.nixl.num_registrations} registrations "
                   f"(one per physical chunk) of {len(self.nixl.regions)} committed regions, "
                   f"memory type {self.nixl.memory_type}, after the final commit",
                   time.perf_counter() - t0)
        devices = environment.rdma_devices()
        if not devices:
            ctl.skipped("rdma/registration",
                        "no RDMA device here (/sys/class/infiniband has no entries): "
                        "registration for GPUDirect RDMA cannot be tried")
        elif self.device.startswith("cuda") and not rdma_flag:
            ctl.failed("rdma/registration",
                       f"RDMA devices {devices} present but the allocations lack "
                       "gpuDirectRDMACapable: ibv_reg_mr would fail (vllm #29569)")
        else:
            ctl.passed("rdma/registration",
                       f"memory registered with NIXL/UCX while RDMA devices {devices} are "
                       f"present (GPUDirect flag granted: {rdma_flag})")

    # -- helpers ----------------------------------------------------------------------------------
    def transport_context(self) -> Any:
        """What this worker's transports are built from (kvconnect.connectors.transport)."""
        from kvconnect.connectors.transport import TransportContext

        pids: set[int] = getattr(self, "decode_pids", set())
        return TransportContext(cache=self.cache, timeout=self.cfg.timeout, name=self.name,
                                directory=self.ipc_dir, allowed_pids=lambda: set(pids),
                                nixl=self.nixl, attribution=self.lane_attribution())

    def lane_attribution(self) -> Any:
        """None here; the decode names the UCX lanes NIXL used (see DecodeWorker)."""
        return None

    def fill_all(self, source: str) -> int:
        """Fill every committed block of every owner region with ``source``'s contents."""
        total = 0
        for spec in owners(self.specs):
            rows = cache_rows(self.cache, spec)
            fill(rows, content_key(self.cfg.seed, source, spec))
            total += rows.shape[0] * rows.shape[1]
        return total

    def digests(self, block_ids: list[int]) -> list[list[str]]:
        """``[block][owner region]`` digests of ``block_ids``."""
        per_region = [digest_blocks(cache_rows(self.cache, s), block_ids)
                      for s in owners(self.specs)]
        if not per_region:
            return []
        return [list(x) for x in zip(*per_region, strict=True)]

    def sleep_wake(self, refill_source: str) -> None:
        """Release physical memory, recommit (zeroed, same addresses), refill, re-register."""
        ctl, cache = self.ctl, self.cache
        ctl.phase("sleep")
        if self.nixl is not None:
            self.nixl.deregister()
        bases = [t.base_ptr for t in cache.tensors]
        t0 = time.perf_counter()
        cache.release_physical()
        released = all(t.is_released and t.num_physical_chunks == 0 for t in cache.tensors)
        ctl.check("sleep_wake/release", "pass" if released else "fail",
                  f"all {len(cache.tensors)} tensors released their physical memory "
                  f"(chunks left: {cache.num_physical_chunks})", time.perf_counter() - t0)
        ctl.phase("wake")
        t0 = time.perf_counter()
        cache.recommit()
        wake_s = time.perf_counter() - t0
        nonzero = [f"tensor {ti} segment {s}" for ti, t in enumerate(cache.tensors)
                   for s in range(t.num_segments) if not all_zero(t.segment_view(s))]
        ctl.check("sleep_wake/zeroed", "fail" if nonzero else "pass",
                  f"non-zero after recommit: {', '.join(nonzero[:MAX_QUOTED])}" if nonzero
                  else f"recommitted {_mib(cache.committed_bytes)} zero-filled in {wake_s:.3f} s",
                  wake_s)
        same = [t.base_ptr for t in cache.tensors] == bases
        segs = sum(t.num_segments for t in cache.tensors)
        ctl.check("sleep_wake/same_addresses",
                  "pass" if same and cache.num_physical_chunks == segs else "fail",
                  f"addresses unchanged: {same}; {cache.num_physical_chunks} chunks for "
                  f"{segs} segments; {cache.num_blocks} blocks")
        self.specs = region_specs(cache)
        self.fill_all(refill_source)
        if self.nixl is not None:
            t0 = time.perf_counter()
            self.nixl.reregister()
            ctl.passed("nixl/reregister",
                       f"deregistered before sleep, registered again after wake: generation "
                       f"{self.nixl.generation}, {self.nixl.num_registrations} registrations",
                       time.perf_counter() - t0)


class PrefillWorker(_Worker):
    """Produces blocks: fills, digests, serves them over IPC and NIXL, round 1 and 2."""

    role = PREFILL

    def __init__(self, ctl: Control, rank: int, ipc_dir: str) -> None:
        super().__init__(ctl, rank, ipc_dir)
        #: the serving halves of the transports (kvconnect.connectors.transport), by name
        self.exporters: dict[str, Any] = {}
        self.decode_pids: set[int] = set()

    def cleanup(self) -> None:
        while self.exporters:
            _, exporter = self.exporters.popitem()
            try:
                exporter.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("%s: closing an exporter failed: %s", self.name, exc)
        super().cleanup()

    def start_exporters(self) -> None:
        """Start each transport's serving half; same-host-only transports serve the decodes
        that said hello from this host."""
        from kvconnect.connectors.transport import get_transport

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
            self.exporters[name] = spec.exporter(self.transport_context())

    def steps(self) -> None:
        ctl, cfg = self.ctl, self.cfg
        self.hello()
        self.build_cache()
        self.register()
        ctl.phase("fill")
        t0 = time.perf_counter()
        nbytes = self.fill_all(self.name)
        ctl.passed("content/fill", f"{cfg.num_blocks} blocks x {len(owners(self.specs))} "
                                   f"regions ({_mib(nbytes)}) filled with position-dependent "
                                   "contents", time.perf_counter() - t0)
        self.start_exporters()
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
        ctl, cfg = self.ctl, self.cfg
        ctl.phase(f"digest:round{round_no}")
        digests = {}
        for d in range(cfg.num_decode):
            remote, _ = cfg.block_sets(self.rank, d, round_no)
            digests[worker_name(DECODE, d)] = self.digests(remote)
        if round_no == 1 and cfg.corrupt:
            self.corrupt()
        info = {
            "pid": os.getpid(), "boot_id": self.boot_id, "hostname": environment.hostname(),
            "regions": [s.to_json() for s in self.specs], "digests": digests,
            "exports": {name: e.describe() for name, e in self.exporters.items()},
        }
        ctl.publish(f"round{round_no}", info)
        ctl.phase(f"serve:round{round_no}")
        with _ProgressPump(self.nixl):
            for d in range(cfg.num_decode):
                ctl.wait(worker_name(DECODE, d), f"round{round_no}/done",
                         timeout=_round_wait(cfg))
        if self.nixl is not None:
            notes = self.nixl.get_notifications()
            count = sum(len(v) for v in notes.values())
            ctl.passed(f"nixl/notifications/round{round_no}",
                       f"{count} READ completion notifications from {len(notes)} agents")

    def corrupt(self) -> None:
        """Negative control: flip one byte of one transferred block, after digesting."""
        rank, block = self.cfg.corrupt_target()
        if rank != self.rank:
            return
        rng = random.Random(f"{self.cfg.seed}/corrupt-byte")
        spec = rng.choice(owners(self.specs))
        offset = rng.randrange(spec.block_len)
        rows = cache_rows(self.cache, spec)
        rows[block, offset] ^= 0xFF
        self.ctl.passed("negative_control/armed",
                        f"--corrupt: flipped byte {offset} of block {block} {spec.label} after "
                        "digesting; the transfers of this block must fail",
                        data={"block": block, "region": spec.label, "offset": offset})

    def offload_round_trip(self) -> None:
        """CPU offload: save, clobber, load back (and into other blocks), compare bytes."""
        from kvconnect.connectors.cpu_offload import CPUOffloadConnector

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
            for spec in owners(self.specs):
                cache_rows(self.cache, spec).index_fill_(0, idx, 0)
            clobbered = self.snapshot(ids)
            conn.wait(conn.load(ids), timeout_s=cfg.timeout)
            after = self.snapshot(ids)
            conn.wait(conn.load(elsewhere, keys=ids), timeout_s=cfg.timeout)
            moved = self.snapshot(elsewhere)
            seconds = time.perf_counter() - t0
            pool = conn.pool_bytes
        finally:
            conn.free()
        unchanged = _same_blocks(before, clobbered)
        if unchanged:
            ctl.failed("offload/clobber", f"blocks {[ids[i] for i in unchanged][:MAX_QUOTED]} "
                                          "unchanged by the clobber: the round trip would "
                                          "prove nothing")
        bad = [ids[i] for i in range(k) if i not in set(_same_blocks(before, after))]
        ctl.check("offload/round_trip", "fail" if bad else "pass",
                  f"blocks {bad[:MAX_QUOTED]} differ after save, clobber, load" if bad else
                  f"{k} blocks saved to a {_mib(pool)} CPU pool, clobbered, loaded back "
                  "byte-exact", seconds)
        bad = [elsewhere[i] for i in range(k) if i not in set(_same_blocks(before, moved))]
        ctl.check("offload/load_elsewhere", "fail" if bad else "pass",
                  f"blocks {bad[:MAX_QUOTED]} differ when loaded into other block ids" if bad
                  else f"the same {k} blocks loaded into {k} other block ids byte-exact")

    def snapshot(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Copies of ``block_ids``' bytes, one ``(len(ids), block_len)`` tensor per region."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.device)
        return [cache_rows(self.cache, s).index_select(0, idx) for s in owners(self.specs)]


def _same_blocks(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """Positions whose block bytes are equal in every region of two snapshots."""
    if not a:
        return []
    equal = torch.ones(a[0].shape[0], dtype=torch.bool, device=a[0].device)
    for x, y in zip(a, b, strict=True):
        equal &= (x == y).all(dim=1)
    return [int(i) for i in torch.nonzero(equal).flatten().tolist()]


class DecodeWorker(_Worker):
    """Consumes blocks: fetches each prefill's blocks over every transport and checks them."""

    role = DECODE

    def __init__(self, ctl: Control, rank: int, ipc_dir: str) -> None:
        super().__init__(ctl, rank, ipc_dir)
        self.lanes: Any = None
        #: the receiving halves of the transports (kvconnect.connectors.transport), by name
        self.transports: dict[str, Any] = {}

    def cleanup(self) -> None:
        while self.transports:
            _, transport = self.transports.popitem()
            try:
                transport.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("%s: closing a transport failed: %s", self.name, exc)
        super().cleanup()

    def lane_attribution(self) -> Any:
        if self.lanes is None:
            from .ucx_lanes import LaneTracker

            self.lanes = LaneTracker()
        return self.lanes.lanes_after_read

    def transport(self, name: str) -> Any:
        """This worker's receiving half of transport ``name``, built on first use."""
        if name not in self.transports:
            from kvconnect.connectors.transport import get_transport

            self.transports[name] = get_transport(name).receiver(self.transport_context())
        return self.transports[name]

    def steps(self) -> None:
        ctl, cfg = self.ctl, self.cfg
        self.hello()
        self.build_cache()
        self.register()
        ctl.phase("fill")
        self.fill_all(self.name)
        for round_no in (1, 2):
            if round_no == 2:
                self.sleep_wake(self.name)
                for transport in self.transports.values():
                    transport.invalidate()  # our memory was released and recommitted
            for p in range(cfg.num_prefill):
                self.fetch_from(p, round_no)
            ctl.publish(f"round{round_no}/done", True)

    def fetch_from(self, p: int, round_no: int) -> None:
        ctl, cfg = self.ctl, self.cfg
        prefill = worker_name(PREFILL, p)
        pair = pair_name(p, self.rank)
        ctl.phase(f"wait:{prefill}:round{round_no}")
        info = ctl.wait(prefill, f"round{round_no}", timeout=_round_wait(cfg))
        remote_specs = [RegionSpec.from_json(s) for s in info["regions"]]
        diffs = _layout_differences(self.specs, remote_specs)
        if diffs:
            ctl.failed(f"compat/{pair}", f"{prefill}'s KV layout differs: "
                                         + "; ".join(diffs[:MAX_QUOTED]))
            return
        remote_ids, local_ids = cfg.block_sets(p, self.rank, round_no)
        expected = info["digests"][self.name]
        from kvconnect.connectors.transport import get_transport

        from .transports import reference_copy_gbps

        reference: dict[int, float] = {}  # bytes -> GB/s of the same-run reference copy
        for transport in cfg.transports:
            name = f"transfer/{pair}/{transport}/round{round_no}"
            spec = get_transport(transport)
            if spec.same_host_only and info.get("boot_id") != self.boot_id:
                ctl.skipped(name, f"{prefill} runs on another host (boot id "
                                  f"{info.get('boot_id')} != {self.boot_id}): {transport} "
                                  "needs one kernel")
                continue
            offer = info.get("exports", {}).get(transport)
            if offer is None:
                ctl.skipped(name, f"{prefill} offers no {transport} export")
                continue
            ctl.phase(f"transfer:{transport}:{prefill}:round{round_no}")
            self.poison(local_ids)
            t0 = time.perf_counter()
            try:
                receiver = self.transport(transport)
                receiver.open_peer(prefill, offer)
                result = receiver.fetch(prefill, remote_ids, local_ids, timeout=cfg.timeout)
            except Exception as exc:  # noqa: BLE001 - one failed transport, keep the others
                ctl.failed(name, f"{pair} {transport} round {round_no}: transfer of "
                                 f"{len(local_ids)} blocks failed after "
                                 f"{time.perf_counter() - t0:.2f} s: {type(exc).__name__}: {exc}")
                continue
            mismatches = self.verify(prefill, remote_specs, remote_ids, local_ids, expected)
            src = self.reference_source(p, info)
            if result.bytes not in reference:
                reference[result.bytes] = reference_copy_gbps(result.bytes, src, self.device)
            t = Transfer.measured(pair, transport, result.bytes, result.seconds,
                                  verified=not mismatches, backend=result.backend,
                                  round=round_no, blocks=len(local_ids),
                                  reference_gbps=reference[result.bytes])
            ctl.transfer(t)
            head = (f"{pair} {transport} round {round_no}: {len(local_ids)} blocks "
                    f"{_mib(result.bytes)} in {result.seconds * 1e3:.1f} ms = {t.gbps:.2f} GB/s "
                    f"via {result.backend} (setup {result.setup_seconds * 1e3:.1f} ms, "
                    f"{result.note}; reference: one plain torch copy {src}->{self.device} of "
                    f"the same bytes {t.reference_gbps:.2f} GB/s, same run)")
            if mismatches:
                ctl.failed(name, f"{head}: {len(mismatches)} block regions differ: "
                                 + "; ".join(_mismatch_text(m) for m in mismatches[:MAX_QUOTED]),
                           result.seconds, data={"mismatches": mismatches[:MAX_QUOTED],
                                                 "num_mismatches": len(mismatches)})
            else:
                ctl.passed(name, f"{head}: every block byte-exact", result.seconds)

    def reference_source(self, p: int, info: dict[str, Any]) -> str:
        """Device of the reference copy's source: the prefill's device on this host, else
        this worker's own (a peer on another host has no local reference)."""
        if info.get("boot_id") == self.boot_id:
            return self.cfg.device_for(PREFILL, p)
        return self.device

    def poison(self, local_ids: list[int]) -> None:
        """Overwrite the destination blocks with our own contents (a no-op transfer fails)."""
        for spec in owners(self.specs):
            fill(cache_rows(self.cache, spec), content_key(self.cfg.seed, self.name, spec),
                 local_ids)

    def verify(self, prefill: str, remote_specs: list[RegionSpec], remote_ids: list[int],
               local_ids: list[int], expected: list[list[str]]) -> list[dict[str, Any]]:
        """Compare arrived blocks with the prefill's digests; one record per mismatch:
        ``block`` (prefill's id), ``decode_block``, ``region`` and the first differing byte
        ``offset`` with its ``expected`` and ``got`` values (None where the bytes equal the
        expected pattern but not the prefill's digest)."""
        out = []
        pairs = zip(owners(self.specs), owners(remote_specs), strict=True)
        for j, (lspec, rspec) in enumerate(pairs):
            rows = cache_rows(self.cache, lspec)
            got = digest_blocks(rows, local_ids)
            for i, (r, loc) in enumerate(zip(remote_ids, local_ids, strict=True)):
                if got[i] == expected[i][j]:
                    continue
                want = generate(content_key(self.cfg.seed, prefill, rspec),
                                torch.tensor([r], dtype=torch.int64, device=rows.device),
                                lspec.block_len)[0]
                diff = first_difference(rows[loc], want)
                offset, exp, got_byte = diff if diff else (None, None, None)
                out.append({"block": r, "decode_block": loc, "region": rspec.label,
                            "offset": offset, "expected": exp, "got": got_byte})
        return out


def _mismatch_text(m: dict[str, Any]) -> str:
    """One :meth:`DecodeWorker.verify` record in words."""
    where = (f"first differing byte at offset {m['offset']} (expected 0x{m['expected']:02x}, "
             f"got 0x{m['got']:02x})" if m["offset"] is not None else
             "bytes equal the expected pattern but not the prefill's digest "
             "(the prefill's memory changed after digesting)")
    return f"block {m['block']} (decode block {m['decode_block']}) {m['region']}: {where}"


class _ProgressPump:
    """Drives a NIXL worker's progress every millisecond from a thread while the owner's
    thread is blocked waiting (so peers' READs of our memory complete), and only then: the
    worker is never used by two threads at once."""

    def __init__(self, nixl: Any, period_s: float = 0.001) -> None:
        self.nixl = nixl
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def __enter__(self) -> _ProgressPump:
        if self.nixl is not None:
            self._thread = threading.Thread(target=self._run, name="kvv-nixl-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                self.nixl.progress()
        except BaseException as exc:  # noqa: BLE001 - surfaced by __exit__
            self.error = exc

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.error is not None and exc[0] is None:
            raise RuntimeError(f"NIXL progress failed while serving: {self.error}")


def _round_wait(cfg: RunConfig) -> float:
    """Deadline (seconds) for a peer's whole round: each of its steps has its own deadline of
    ``--timeout``, so a stuck step is reported by the peer itself first."""
    return cfg.timeout * (len(cfg.transports) * max(cfg.num_prefill, cfg.num_decode) + 3)


def _layout_differences(local: list[RegionSpec], remote: list[RegionSpec]) -> list[str]:
    if len(local) != len(remote):
        return [f"{len(remote)} regions != our {len(local)}"]
    return [f"region {a.index}: {b.signature} != ours {a.signature}"
            for a, b in zip(local, remote, strict=True) if a.signature != b.signature
            or a.num_blocks != b.num_blocks or a.covered_by != b.covered_by]


def run_worker(ctl: Control, role: str, rank: int, ipc_dir: str) -> None:
    """Run ``role`` ``rank``'s scenario (raises on a fatal problem)."""
    cls = PrefillWorker if role == PREFILL else DecodeWorker
    cls(ctl, rank, ipc_dir).run()
