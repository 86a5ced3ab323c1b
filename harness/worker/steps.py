"""The steps both roles share: build and check the extensible KV cache, register it with
every transport that registers memory (its spec's ``registration``: NIXL), fill and digest
blocks, sleep / wake; and what a worker process must give back.

:class:`WorkerSteps` is the base of :class:`~.prefill.PrefillWorker` and
:class:`~.decode.DecodeWorker` (:mod:`.scenario` picks one). Each step reports checks through
:class:`~.control.Control` and enters its phase there (where ``--inject`` faults fire).

Units: bytes for sizes, blocks for block ids, seconds.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from kvconnect.peer_layout import PeerLayout

from .. import environment
from ..config import RunConfig, worker_name
from ..control import Control
from ..footprint import Footprint
from .content import cache_rows, content_key, digest_blocks, fill, owners

if TYPE_CHECKING:
    from kvconnect.vmm import AllocationOptions

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: mismatches quoted in one failed check
MAX_QUOTED = 5


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class WorkerSteps:
    """State and steps shared by both roles. Owns the cache and the transports' memory
    registrations (the roles add their transport halves); :meth:`run` releases all of them on
    every path and then checks that this process holds no more fds, sockets or KV mappings
    than before it started. ``socket_dir``: a private directory for serving sockets ("" where
    none is needed)."""

    role = ""

    def __init__(self, ctl: Control, rank: int, socket_dir: str) -> None:
        self.ctl = ctl
        self.cfg: RunConfig = ctl.config
        self.rank = rank
        self.name = worker_name(self.role, rank)
        self.device = self.cfg.device_for(self.role, rank)
        self.socket_dir = socket_dir
        self.cache: Any = None
        #: per transport, this worker's MemoryRegistration (transports that register memory)
        self.registrations: dict[str, Any] = {}
        #: the cache's layout (what a prefill publishes, what a decode compares with)
        self.layout: PeerLayout | None = None
        self.boot_id = environment.boot_id(self.name)

    @property
    def built_layout(self) -> PeerLayout:
        """The cache's layout once the cache is built (RuntimeError before: a step out of
        order)."""
        if self.layout is None:
            raise RuntimeError(f"{self.name}: the KV cache's layout is read before the cache "
                               "was built")
        return self.layout

    def run(self) -> None:
        self._start_device_runtime()
        before = Footprint.take()
        try:
            self.steps()
        finally:
            self.cleanup()
            self.check_released(before)

    def _start_device_runtime(self) -> None:
        """Create the CUDA context before the baseline footprint: the driver's fds and threads
        live as long as the process, so they belong to the baseline, not to the run."""
        if self.device.startswith("cuda"):
            dev = torch.device(self.device)
            torch.cuda.set_device(dev)
            torch.zeros(1, device=dev)
            torch.cuda.synchronize(dev)

    def check_released(self, before: Footprint) -> None:
        """The ``resources/released`` check: after releasing everything this process holds
        no fd, socket or KV mapping it did not hold before its first step (a peer's death,
        an abort or a restart included).

        On CUDA only KV mappings count: the CUDA driver and UCX's CUDA transports open device
        fds, pipes and sockets of their own during the run that stay open for the life of the
        process (seen on an H200: ~42 fds, /dev/nvidia*, after every kvconnect resource was
        released); they are reported as ``runtime_fds``, not as leaks. The host backend (and
        CI) checks every fd."""
        after = Footprint.take()
        leaks = after.leaks_since(before)
        runtime: dict[str, Any] = {}
        if self.device.startswith("cuda"):
            runtime = {k: leaks.pop(k) for k in ("fds", "num_fds", "sockets") if k in leaks}
        data = {"before": before.to_json(), "after": after.to_json(), "leaked": leaks,
                "runtime_fds": runtime, "incarnation": self.ctl.incarnation}
        try:
            if leaks:
                self.ctl.failed("resources/released",
                                f"{self.name} still holds what it opened during the run after "
                                f"releasing everything: {leaks}", data=data)
            else:
                self.ctl.passed("resources/released",
                                f"{self.name} released every fd, socket and KV mapping it "
                                f"opened ({len(before.fds)} fds and {before.kv_mappings} KV "
                                "mappings before, none more after)", data=data)
        except OSError as exc:  # the run is ending under us: nobody to tell
            log.warning("%s: cannot report released resources: %s", self.name, exc)

    def steps(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def prepare(self) -> None:
        """The steps every worker starts with: say hello, build the final cache and register
        it with the run's transports; then enter the ``fill`` phase."""
        self.hello()
        self.build_cache()
        self.register()
        self.ctl.phase("fill")

    def close_all(self, owned: dict[str, Any], what: str) -> None:
        """Close and forget every object in ``owned`` (transports, exporters), logging a
        failure and going on with the rest."""
        while owned:
            _, obj = owned.popitem()
            try:
                obj.close()
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                log.warning("%s: closing %s failed: %s", self.name, what, exc)

    def cleanup(self) -> None:
        self.close_all(self.registrations, "a memory registration")
        if self.cache is not None:
            self.cache.close(force=True)  # cleanup: never mask the run's own error
            self.cache = None

    def hello(self) -> None:
        info = {"pid": os.getpid(), "boot_id": self.boot_id,
                "hostname": environment.hostname(), "device": self.device}
        if self.device.startswith("cuda"):
            info["gpu"] = torch.cuda.get_device_name(torch.device(self.device))
        self.ctl.publish("hello", info)

    # -- step 1: the extensible KV cache -------------------------------------------------------
    def build_cache(self) -> None:
        """Allocate the cache, warm a prefix up, then commit the final size (every memory
        registration of the run's transports must refuse the cache until then) and check the
        views."""
        segments = self._allocate_cache()
        self._warm_up(segments)
        self.registrations_before_final()
        self._commit_final(segments)
        self.check_view_sizes()
        self.layout = PeerLayout.from_cache(self.cache)

    def _allocation_options(self) -> AllocationOptions:
        """Shareable always (the ipc transport exports fds); GPUDirect-RDMA capable where the
        device supports it with VMM."""
        from kvconnect.vmm import AllocationOptions, get_vmm_driver

        rdma = False
        if self.device.startswith("cuda"):
            drv = get_vmm_driver(self.device)
            rdma = bool(drv is not None and drv.capabilities().gpudirect_rdma_with_vmm)
        return AllocationOptions(shareable=True, rdma_capable=rdma)

    def _allocate_cache(self) -> int:
        """Reserve the cache and commit one block; returns the number of segments."""
        from kvconnect.kv_cache import ExtensibleKVCache
        from kvconnect.layout import preset

        ctl, cfg = self.ctl, self.cfg
        ctl.phase("allocate")
        kv_cfg = preset(cfg.layout, num_blocks=cfg.num_blocks, num_layers=cfg.num_layers)
        options = self._allocation_options()
        t0 = time.perf_counter()
        self.cache = cache = ExtensibleKVCache(kv_cfg, self.device,
                                               capacity_blocks=cfg.capacity_blocks,
                                               options=options)
        cache.allocate()
        tensors = cache.tensors
        segments = sum(t.num_segments for t in tensors)
        ok = cache.num_blocks == 1 and cache.num_physical_chunks == segments
        ctl.check("kv_cache/allocate", "pass" if ok else "fail",
                  f"reserved {mib(self._reserved_bytes())} for {cache.capacity_blocks} blocks "
                  f"in {len(tensors)} tensors / {segments} segments; committed "
                  f"{cache.num_blocks} block ({cache.num_physical_chunks} chunks of "
                  f"{cache.granule} bytes)", time.perf_counter() - t0)
        return segments

    def _reserved_bytes(self) -> int:
        return sum(t.capacity_bytes for t in self.cache.tensors)

    def _warm_up(self, segments: int) -> None:
        """Commit the warm-up prefix and write garbage into it (the final commit and the
        transfers must not depend on the memory being clean)."""
        ctl, cache = self.ctl, self.cache
        ctl.phase("warmup")
        warm = min(self.cfg.warmup_blocks, self.cfg.num_blocks)
        cache.ensure_kv_cache_blocks(warm)
        for t in cache.tensors:
            for s in range(t.num_segments):
                t.segment_view(s).fill_(0xA5)
        ctl.check("kv_cache/warmup", "pass" if cache.num_blocks == warm else "fail",
                  f"{cache.num_blocks} blocks committed (asked {warm}); "
                  f"{cache.num_physical_chunks} physical chunks for {segments} segments")

    def _commit_final(self, segments: int) -> None:
        """Commit the final size as one physical chunk per segment."""
        ctl, cache, num_blocks = self.ctl, self.cache, self.cfg.num_blocks
        ctl.phase("final")
        t0 = time.perf_counter()
        cache.ensure_kv_cache_blocks(num_blocks)
        before = cache.num_physical_chunks
        cache.extend_kv_cache(num_blocks, single_handle=True)
        after = cache.num_physical_chunks
        final_ok = cache.is_final and cache.num_blocks == num_blocks
        ctl.check("kv_cache/final", "pass" if final_ok else "fail",
                  f"final size {cache.num_blocks} blocks ({mib(cache.committed_bytes)} "
                  f"committed of {mib(self._reserved_bytes())} reserved), "
                  f"is_final={cache.is_final}", time.perf_counter() - t0)
        per_seg = [len([c for c in t.physical_chunks() if c.segment == s])
                   for t in cache.tensors for s in range(t.num_segments)]
        note = "" if before > segments else (
            " (the final size fits the first granule of every segment, so there was nothing "
            "to recommit; a larger --num-blocks exercises it)")
        ctl.check("kv_cache/one_chunk_per_segment",
                  "pass" if all(n == 1 for n in per_seg) else "fail",
                  f"{before} physical chunks before the single-handle recommit, {after} after, "
                  f"for {segments} segments (per segment: {sorted(set(per_seg))}){note}",
                  data={"chunks_before": before, "chunks_after": after, "segments": segments})

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
                       f"bytes (the full views span {mib(full)} of reservation)")

    # -- step 2: deferred registration and allocation flags ------------------------------------
    def registrations_before_final(self) -> None:
        """Build the memory registration of every transport that has one (its spec's
        ``registration``) and check that it refuses the cache before its final commit."""
        from kvconnect.connectors.registry import get_transport
        from kvconnect.errors import KvconnectError

        ctl = self.ctl
        for name in self.cfg.transports:
            build = get_transport(name).registration
            if build is None:
                continue
            ctl.phase(f"attach:{name}")
            registration = self.registrations[name] = build(self.transport_context())
            try:
                registration.register()
            except KvconnectError as exc:
                ctl.passed(f"{name}/deferred_registration",
                           f"registering before the final commit was refused: {exc}")
            else:
                registration.deregister()
                ctl.failed(f"{name}/deferred_registration",
                           f"the {name} registration accepted the KV cache before its final "
                           "commit (it must defer registration until extend_kv_cache)")

    def register(self) -> None:
        ctl, cache = self.ctl, self.cache
        ctl.phase("register")
        tensors = cache.tensors
        granted = [t.granted for t in tensors]
        requested = cache.options
        shareable = all(g.shareable for g in granted)
        rdma_flag = all(g.rdma_capable for g in granted)
        ctl.passed("allocation/flags",
                   f"requested shareable={requested.shareable} rdma_capable="
                   f"{requested.rdma_capable}; granted on all {cache.num_physical_chunks} "
                   f"chunks: shareable(POSIX fd)={shareable} rdma_capable(GPUDirect)="
                   f"{rdma_flag}")
        for name, registration in self.registrations.items():
            t0 = time.perf_counter()
            summary = registration.register()
            ctl.passed(f"{name}/register", summary, time.perf_counter() - t0)
        if self.registrations:
            self.check_rdma_registration(rdma_flag)

    def check_rdma_registration(self, rdma_flag: bool) -> None:
        """The ``rdma/registration`` check, after the registrations: with RDMA devices
        present, the allocations must carry the GPUDirect flag."""
        ctl = self.ctl
        names = ", ".join(self.registrations)
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
                       f"memory registered with {names} while RDMA devices {devices} are "
                       f"present (GPUDirect flag granted: {rdma_flag})")

    # -- helpers ----------------------------------------------------------------------------------
    def transport_context(self) -> Any:
        """What this worker's transports are built from (kvconnect.connectors.transport)."""
        from kvconnect.connectors.transport import TransportContext

        pids: set[int] = getattr(self, "decode_pids", set())
        # a replacement must not reuse its predecessor's socket names (the dead process
        # cannot remove them)
        name = self.name if self.ctl.incarnation == 1 else f"{self.name}.{self.ctl.incarnation}"
        return TransportContext(cache=self.cache, timeout=self.cfg.timeout, name=name,
                                directory=self.socket_dir, allowed_pids=lambda: set(pids))

    def fill_all(self, source: str) -> int:
        """Fill every committed block of every owner region with ``source``'s contents."""
        total = 0
        for spec in owners(self.built_layout):
            rows = cache_rows(self.cache, spec)
            fill(rows, content_key(self.cfg.seed, source, spec))
            total += rows.shape[0] * rows.shape[1]
        return total

    def digests(self, block_ids: list[int]) -> list[list[str]]:
        """``[block][owner region]`` digests of ``block_ids``."""
        per_region = [digest_blocks(cache_rows(self.cache, s), block_ids)
                      for s in owners(self.built_layout)]
        if not per_region:
            return []
        return [list(x) for x in zip(*per_region, strict=True)]

    def sleep_wake(self, refill_source: str) -> None:
        """Release physical memory, recommit (zeroed, same addresses), refill, re-register."""
        ctl, cache = self.ctl, self.cache
        ctl.phase("sleep")
        for registration in self.registrations.values():
            registration.deregister()
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
                   for s in range(t.num_segments) if t.segment_view(s).any()]
        ctl.check("sleep_wake/zeroed", "fail" if nonzero else "pass",
                  f"non-zero after recommit: {', '.join(nonzero[:MAX_QUOTED])}" if nonzero
                  else f"recommitted {mib(cache.committed_bytes)} zero-filled in {wake_s:.3f} s",
                  wake_s)
        same = [t.base_ptr for t in cache.tensors] == bases
        segs = sum(t.num_segments for t in cache.tensors)
        ctl.check("sleep_wake/same_addresses",
                  "pass" if same and cache.num_physical_chunks == segs else "fail",
                  f"addresses unchanged: {same}; {cache.num_physical_chunks} chunks for "
                  f"{segs} segments; {cache.num_blocks} blocks")
        self.layout = PeerLayout.from_cache(cache)
        self.fill_all(refill_source)
        for name, registration in self.registrations.items():
            t0 = time.perf_counter()
            summary = registration.reregister()
            ctl.passed(f"{name}/reregister",
                       f"deregistered before sleep, after wake {summary}",
                       time.perf_counter() - t0)


def round_wait(cfg: RunConfig) -> float:
    """Deadline (seconds) for a peer's whole round: each of its steps has its own deadline of
    ``--timeout``, so a stuck step is reported by the peer itself first."""
    own = cfg.timeout * (len(cfg.transports) * max(cfg.num_prefill, cfg.num_decode) + 3)
    # a sweep size takes at most half of --timeout plus one fetch, per transport and prefill
    sweep = 1.5 * cfg.timeout * len(cfg.sweep_sizes) * len(cfg.transports) * cfg.num_prefill
    return own + sweep


def same_blocks(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    """Positions whose block bytes are equal in every region of two snapshots."""
    if not a:
        return []
    equal = torch.ones(a[0].shape[0], dtype=torch.bool, device=a[0].device)
    for x, y in zip(a, b, strict=True):
        equal &= (x == y).all(dim=1)
    return [int(i) for i in torch.nonzero(equal).flatten().tolist()]
