"""What a run needs from this machine, and whether the machine has it: checked before any
worker starts, so an impossible run is refused in a second with the numbers instead of being
killed by the OOM killer minutes later (``--num-layers 1000`` on a 24 GiB machine) or failing
with "Too many open files" (``--num-layers 5000``).

Per worker process, from the layout plan (units: bytes, counts):

- **memory**: the KV cache at its final size (every segment rounded up to the commit granule;
  warm-up chunks are released before the final allocation, so this is the peak), plus a
  working set of :data:`WORKING_TRANSFERS` transfers (``transfer_blocks`` blocks each: the
  CPU offload pool and the four snapshots of the offloaded blocks on prefill; the reference
  copy's source and target, the gather and the poison on decode; with ``--sizes`` also the
  reference copy of the largest size), plus a process baseline
  (small for workers forked from the coordinator, larger for fresh interpreters). On CUDA the
  KV cache and working set live in device memory: reported per GPU, not compared (the
  coordinator does not initialise CUDA to ask); host memory then needs the baseline and the
  offload pool.
- **fds**: on the host backend every physical chunk is a memfd: up to one per segment per
  commit step (first block, warm-up, final size). While decode maps a peer's chunks it holds
  two fds per peer segment (received + imported) beside its own one per segment; prefill
  holds one extra per segment while exporting. On CUDA only exported / imported handles are
  fds. Plus :data:`BASE_FDS`. A transport that sends all of a worker's chunks in one
  message (``sends_chunk_fds``: ipc) is limited to ``kvconnect.framing.MAX_FDS`` of them.
- **memory mappings** (``vm.max_map_count``): about :data:`MAPS_PER_SEGMENT` per segment
  (own chunks, the reservation's unmapped tail, a peer's chunk and tail) beyond
  :data:`BASE_MAPS` for the interpreter, torch and UCX.

- **CPUs**: every worker must get CPU time often enough that its heartbeat thread beats within
  the heartbeat limit and its steps finish within ``--timeout``: at most
  :data:`MAX_WORKERS_PER_CPU` workers per CPU this process may use (its affinity mask, and
  the CPU cgroup's quota). ``--prefill 16 --decode 16`` on 2 CPUs failed its deadlines (a
  prefill's CPU-offload round trip took over 60 s); 4 + 4 passed there under a load
  average of 29.

Against: MemAvailable (and the memory cgroup's limit less its usage, when lower), the
RLIMIT_NOFILE soft limit (raised to the hard limit first when short; workers inherit it) and
``vm.max_map_count``. Exit code 2 when the run could not fit this machine however idle
(memory over MemTotal or the cgroup limit, fds over the kernel's ``fs.nr_open``, more workers
than the CPUs can carry): change the arguments. Exit code 3 when the machine lacks it now or as configured (MemAvailable, the fd
hard limit, ``vm.max_map_count``): free memory or raise the limit.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvconnect.checks import round_up
from kvconnect.framing import MAX_FDS

from .config import RunConfig

MIB = 1024 * 1024
GIB = 1024 * MIB
#: copies of one transfer's bytes a worker holds at its peak (see the module docstring)
WORKING_TRANSFERS = 5
#: private memory of a worker forked from the coordinator, beyond its KV cache (bytes)
FORKED_BASELINE = 64 * MIB
#: private memory of a worker started as a fresh interpreter (imports torch again; bytes)
FRESH_BASELINE = 768 * MIB
#: CUDA commit granule assumed when sizing (the coordinator does not initialise CUDA)
CUDA_GRANULE = 2 * MIB
#: fds of a worker beyond its KV chunks: interpreter, log, sockets, UCX
BASE_FDS = 64
#: memory mappings of a worker beyond its KV cache: interpreter, torch, UCX
BASE_MAPS = 1200
MAPS_PER_SEGMENT = 4
#: most worker processes per usable CPU (see the module docstring)
MAX_WORKERS_PER_CPU = 4
#: commit steps a worker's cache takes before its final single-handle commit
_COMMIT_STEPS = 3


@dataclass(frozen=True)
class WorkerNeeds:
    """What one worker process needs (bytes, counts)."""

    segments: int
    kv_cache_bytes: int
    working_bytes: int
    baseline_bytes: int
    fds: int
    mappings: int
    #: True when the KV cache and working set are device (GPU) memory, not host memory
    on_device: bool = False

    @property
    def host_bytes(self) -> int:
        """Host memory this worker needs."""
        if self.on_device:
            return self.baseline_bytes + self.working_bytes // WORKING_TRANSFERS
        return self.kv_cache_bytes + self.working_bytes + self.baseline_bytes

    @property
    def device_bytes(self) -> int:
        """Device memory this worker needs (0 on the host backend)."""
        return self.kv_cache_bytes + self.working_bytes if self.on_device else 0


@dataclass(frozen=True)
class MachineLimits:
    """What this machine offers now (bytes, counts; None where unknown)."""

    mem_available_bytes: int | None
    mem_total_bytes: int | None
    cgroup_limit_bytes: int | None
    cgroup_available_bytes: int | None
    fd_soft_limit: int
    fd_hard_limit: int
    fd_kernel_max: int | None
    max_map_count: int | None
    #: CPUs this process may use: its affinity mask, capped by the CPU cgroup's quota
    cpus: int | None = None

    @property
    def memory_bytes(self) -> int | None:
        """Memory a run may use now: MemAvailable, or the cgroup's room when lower."""
        known = [v for v in (self.mem_available_bytes, self.cgroup_available_bytes)
                 if v is not None]
        return min(known) if known else None

    @property
    def memory_ceiling_bytes(self) -> int | None:
        """Memory a run could use on this machine when idle: MemTotal or the cgroup limit."""
        known = [v for v in (self.mem_total_bytes, self.cgroup_limit_bytes) if v is not None]
        return min(known) if known else None


@dataclass
class ResourceVerdict:
    """Needs against limits. ``exit_code`` 0 (fits), 2 (cannot fit this machine), 3 (does
    not fit now or as configured); ``problems`` one record per shortfall."""

    workers: int
    per_worker: WorkerNeeds
    limits: MachineLimits
    problems: list[dict[str, Any]] = field(default_factory=list)
    fd_soft_limit_before: int | None = None

    @property
    def exit_code(self) -> int:
        if not self.problems:
            return 0
        return 2 if any(p["impossible"] for p in self.problems) else 3

    @property
    def needed_host_bytes(self) -> int:
        return self.workers * self.per_worker.host_bytes

    def message(self) -> str:
        """One line naming every shortfall with its numbers, or what was checked."""
        if not self.problems:
            return (f"{self.workers} workers need {_gib(self.needed_host_bytes)} of memory "
                    f"({_gib(self.limits.memory_bytes)} available), {self.per_worker.fds} fds "
                    f"and {self.per_worker.mappings} memory mappings each (limits "
                    f"{self.limits.fd_soft_limit} and {self.limits.max_map_count})")
        return "; ".join(p["text"] for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        w = self.per_worker
        return {
            "workers": self.workers,
            "per_worker": {**asdict(w), "host_bytes": w.host_bytes,
                           "device_bytes": w.device_bytes},
            "needed": {"host_bytes": self.needed_host_bytes,
                       "fds_per_process": w.fds, "mappings_per_process": w.mappings},
            "available": {**asdict(self.limits), "memory_bytes": self.limits.memory_bytes,
                          "memory_ceiling_bytes": self.limits.memory_ceiling_bytes,
                          "fd_soft_limit_before": self.fd_soft_limit_before},
            "problems": [{k: v for k, v in p.items() if k != "text"} for p in self.problems],
            "exit_code": self.exit_code,
        }


def estimate_worker_needs(cfg: RunConfig, *, forked: bool) -> WorkerNeeds:
    """What one worker of ``cfg`` needs (see the module docstring). ``forked``: the worker is
    forked from an interpreter that already imported torch (or is that process itself)."""
    from kvconnect.layout import plan_layout, preset

    plan = plan_layout(preset(cfg.layout, num_blocks=cfg.num_blocks,
                              num_layers=cfg.num_layers))
    on_device = cfg.device == "cuda"
    granule = CUDA_GRANULE if on_device else _host_granule()
    warm = min(cfg.warmup_blocks, cfg.num_blocks)
    segments = kv_bytes = chunk_fds = 0
    for t in plan.tensors:
        per_block = t.segment_bytes_per_block
        sizes = [round_up(b * per_block, granule) for b in (1, warm, cfg.num_blocks)]
        steps = 1 + sum(1 for a, b in zip(sizes, sizes[1:], strict=False) if b > a)
        segments += t.num_segments
        kv_bytes += t.num_segments * sizes[-1]
        chunk_fds += t.num_segments * min(steps, _COMMIT_STEPS)
    transfer = cfg.transfer_blocks * plan.bytes_per_block
    if on_device:
        fds = BASE_FDS + 2 * segments  # exported / imported handles only
    else:  # own chunks at their peak, or own + a peer's received and imported while mapping
        fds = BASE_FDS + max(chunk_fds, 3 * segments)
    # --sizes: the same-run reference copy of the largest size (source and target)
    sweep = 2 * max(cfg.sweep_sizes) if cfg.sweep_sizes else 0
    return WorkerNeeds(segments=segments, kv_cache_bytes=kv_bytes,
                       working_bytes=WORKING_TRANSFERS * transfer + sweep,
                       baseline_bytes=FORKED_BASELINE if forked else FRESH_BASELINE,
                       fds=fds, mappings=BASE_MAPS + MAPS_PER_SEGMENT * segments,
                       on_device=on_device)


def machine_limits() -> MachineLimits:
    """What this machine offers now (reads /proc, the memory cgroup and RLIMIT_NOFILE)."""
    meminfo = _meminfo()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit, room = _cgroup_memory()
    return MachineLimits(
        mem_available_bytes=meminfo.get("MemAvailable"), mem_total_bytes=meminfo.get("MemTotal"),
        cgroup_limit_bytes=limit, cgroup_available_bytes=room,
        fd_soft_limit=_finite(soft), fd_hard_limit=_finite(hard),
        fd_kernel_max=_read_int("/proc/sys/fs/nr_open"),
        max_map_count=_read_int("/proc/sys/vm/max_map_count"), cpus=usable_cpus())


def judge(workers: int, needs: WorkerNeeds, limits: MachineLimits, *,
          chunk_fds: Sequence[str] = ()) -> ResourceVerdict:
    """Compare ``workers`` processes of ``needs`` with ``limits`` (no side effects);
    ``chunk_fds``: the run's transports that send all of a worker's chunk fds in one message
    (``TransportSpec.sends_chunk_fds``)."""
    verdict = ResourceVerdict(workers, needs, limits)
    host = verdict.needed_host_bytes
    what = (f"{workers} workers x {_gib(needs.host_bytes)} (KV cache "
            f"{_gib(needs.kv_cache_bytes)} in {needs.segments} segments + working set "
            f"{_gib(needs.working_bytes)} + process {_gib(needs.baseline_bytes)})")
    ceiling, available = limits.memory_ceiling_bytes, limits.memory_bytes
    if ceiling is not None and host > ceiling:
        verdict.problems.append(_problem(
            "memory", host, ceiling, "MemTotal" if ceiling == limits.mem_total_bytes
            else "memory cgroup limit", True,
            f"the run needs {_gib(host)} of memory, {what}, more than this machine has "
            f"({_gib(ceiling)}): lower --num-layers, --num-blocks, --transfer-blocks or the "
            "worker counts"))
    elif available is not None and host > available:
        verdict.problems.append(_problem(
            "memory", host, available, "MemAvailable" if available ==
            limits.mem_available_bytes else "memory cgroup room", False,
            f"the run needs {_gib(host)} of memory, {what}, but only {_gib(available)} is "
            "available now: free memory or lower the sizes"))
    if limits.fd_kernel_max is not None and needs.fds > limits.fd_kernel_max:
        verdict.problems.append(_problem(
            "fds", needs.fds, limits.fd_kernel_max, "fs.nr_open", True,
            f"each worker needs {needs.fds} open files ({needs.segments} KV segments), more "
            f"than the kernel allows one process (fs.nr_open {limits.fd_kernel_max}): lower "
            "--num-layers"))
    elif needs.fds > limits.fd_soft_limit:
        verdict.problems.append(_problem(
            "fds", needs.fds, limits.fd_soft_limit, "RLIMIT_NOFILE", False,
            f"each worker needs {needs.fds} open files ({needs.segments} KV segments) but the "
            f"limit is {limits.fd_soft_limit} (hard limit {limits.fd_hard_limit}): raise it "
            f"(ulimit -n {needs.fds}) or lower --num-layers"))
    if chunk_fds and needs.segments > MAX_FDS:
        names = ", ".join(chunk_fds)
        verdict.problems.append(_problem(
            "chunk_fds", needs.segments, MAX_FDS, "kvconnect.framing.MAX_FDS", True,
            f"the {names} transport sends a worker's {needs.segments} KV chunks in one "
            f"message, more than the {MAX_FDS} fds a message may carry: lower --num-layers "
            f"or drop {names} from --transports"))
    if limits.cpus is not None and workers > MAX_WORKERS_PER_CPU * limits.cpus:
        need = -(-workers // MAX_WORKERS_PER_CPU)
        verdict.problems.append(_problem(
            "cpus", need, limits.cpus, "CPU affinity / cgroup quota", True,
            f"{workers} workers need at least {need} CPUs (at most {MAX_WORKERS_PER_CPU} "
            f"workers per CPU: each must beat its heartbeat and finish its steps within "
            f"--timeout) but this process may use {limits.cpus}: lower --prefill / --decode "
            "or run on a larger machine"))
    if limits.max_map_count is not None and needs.mappings > limits.max_map_count:
        verdict.problems.append(_problem(
            "mappings", needs.mappings, limits.max_map_count, "vm.max_map_count", False,
            f"each worker needs about {needs.mappings} memory mappings but vm.max_map_count is "
            f"{limits.max_map_count}: raise it (sysctl vm.max_map_count) or lower "
            "--num-layers"))
    return verdict


def check_resources(cfg: RunConfig, workers: int, *, forked: bool) -> ResourceVerdict:
    """Estimate ``workers`` workers of ``cfg`` on this machine; when they need more fds than
    the soft limit allows, raise it to the hard limit first: workers inherit it."""
    needs = estimate_worker_needs(cfg, forked=forked)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = None
    if needs.fds > _finite(soft) and soft != hard:
        target = hard if hard != resource.RLIM_INFINITY else max(needs.fds, soft)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            before = _finite(soft)
        except (ValueError, OSError):
            pass
    from kvconnect.connectors.registry import get_transport

    verdict = judge(workers, needs, machine_limits(),
                    chunk_fds=[t for t in cfg.transports if get_transport(t).sends_chunk_fds])
    verdict.fd_soft_limit_before = before
    return verdict


# -- reading the machine --------------------------------------------------------------------
def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_memory(root: str = "/sys/fs/cgroup",
                   self_cgroup: str = "/proc/self/cgroup") -> tuple[int | None, int | None]:
    """``(limit, room)`` of this process's memory cgroup in bytes: the limit, and the limit
    less the usage that cannot be reclaimed (usage less the page cache); ``(None, None)``
    without a limit. cgroup v2 (``memory.max``) or v1 (``memory.limit_in_bytes``)."""
    candidates = []
    for controllers, rel in _cgroups(self_cgroup):
        if controllers == "":  # v2
            candidates.append((os.path.join(root, rel), "memory.max", "memory.current", "file"))
        elif "memory" in controllers.split(","):  # v1
            for base in (os.path.join(root, "memory", rel), os.path.join(root, "memory")):
                candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                   "total_cache"))
    for directory, limit_file, usage_file, cache_key in candidates:
        limit = _read_int(os.path.join(directory, limit_file))
        usage = _read_int(os.path.join(directory, usage_file))
        if limit is None or usage is None or limit >= 1 << 62:
            continue
        cache = _stat_value(os.path.join(directory, "memory.stat"), cache_key)
        return limit, max(0, limit - (usage - min(cache, usage)))
    return None, None


def usable_cpus(root: str = "/sys/fs/cgroup",
                self_cgroup: str = "/proc/self/cgroup") -> int:
    """CPUs this process may use: its affinity mask, capped by its CPU cgroup's quota
    (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), rounded up."""
    cpus = len(os.sched_getaffinity(0))
    for controllers, rel in _cgroups(self_cgroup):
        quota = period = None
        if controllers == "":  # v2: "max 100000" or "200000 100000"
            try:
                with open(os.path.join(root, rel, "cpu.max"), encoding="ascii") as f:
                    fields = f.read().split()
            except OSError:
                continue
            if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
                quota, period = int(fields[0]), int(fields[1])
        elif "cpu" in controllers.split(","):
            base = os.path.join(root, "cpu", rel)
            if not os.path.isdir(base):
                base = os.path.join(root, "cpu")
            quota = _read_int(os.path.join(base, "cpu.cfs_quota_us"))  # -1: none
            period = _read_int(os.path.join(base, "cpu.cfs_period_us"))
        if quota and period:
            cpus = min(cpus, max(1, -(-quota // period)))
    return cpus


def _cgroups(self_cgroup: str) -> list[tuple[str, str]]:
    """``(controllers, path below the cgroup root)`` per line of ``self_cgroup``
    (``/proc/self/cgroup``; v2's line has no controllers); empty when it cannot be read."""
    try:
        with open(self_cgroup, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    return [(controllers, path.lstrip("/")) for _, controllers, path in
            (line.split(":", 2) if line.count(":") >= 2 else ("", "", "") for line in lines)]


def _stat_value(path: str, key: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _host_granule() -> int:
    from kvconnect.tensor import ExtensibleTensor
    from kvconnect.vmm import AllocationOptions

    return ExtensibleTensor.commit_granule("cpu", AllocationOptions(shareable=True))


def _finite(limit: int) -> int:
    return (1 << 62) if limit == resource.RLIM_INFINITY else int(limit)


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GIB:.2f} GiB"


def _problem(resource_name: str, needed: int, available: int, limit: str, impossible: bool,
             text: str) -> dict[str, Any]:
    return {"resource": resource_name, "needed": needed, "available": available,
            "limit": limit, "impossible": impossible, "text": text}
