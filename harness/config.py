"""The run configuration every worker receives (JSON), and the names of workers and pairs.

Units: ``num_blocks`` / ``transfer_blocks`` / ``capacity_blocks`` are KV blocks; ``timeout``
and ``heartbeat_timeout`` are seconds; ``min_gbps`` is 1e9 bytes per second.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


def worker_name(role: str, rank: int) -> str:
    """``prefill0``, ``decode3``: the name a worker goes by in keys, checks and messages."""
    return f"{role}{rank}"


def pair_name(prefill_rank: int, decode_rank: int) -> str:
    return f"prefill{prefill_rank}->decode{decode_rank}"


@dataclass
class RunConfig:
    """What to run. Identical on every worker of a run (checked at rendezvous)."""

    num_prefill: int = 1
    num_decode: int = 1
    #: backend: ``host`` or ``cuda``
    device: str = "host"
    num_gpus: int = 0
    layout: str = "llama3-8b-like"
    #: committed blocks of every worker's KV cache (the final size)
    num_blocks: int = 160
    #: layers of the model preset (small by default: a validation run, not a model)
    num_layers: int = 4
    #: blocks moved by each transfer (a random, non-contiguous subset)
    transfer_blocks: int = 24
    #: reserved capacity as a multiple of ``num_blocks`` (reserved >> committed on purpose)
    capacity_factor: int = 4
    #: transport names (kvconnect.connectors.registry); empty: every registered one (the CLI
    #: resolves it before the run)
    transports: list[str] = field(default_factory=list)
    #: modules every process imports before the run; each registers its transports
    #: (``--transport-module``)
    transport_modules: list[str] = field(default_factory=list)
    #: transports asked for but not runnable here, with the reason (reported as skipped)
    skipped_transports: dict[str, str] = field(default_factory=dict)
    timeout: float = 60.0
    heartbeat_timeout: float = 10.0
    corrupt: bool = False
    seed: int = 0
    min_gbps: float | None = None
    #: how workers map to GPUs: ``round-robin`` over all of them, or ``split`` (prefills on
    #: the first half, decodes on the second: every transfer crosses GPUs)
    placement: str = "round-robin"
    #: multi-host runs: this process's own device (set per process, not shared)
    local_device: str = ""
    #: ``--inject`` faults (:class:`~.faults.FaultSpec` as JSON: ``kind``, ``rank``, ``phase``)
    faults: list[dict[str, Any]] = field(default_factory=list)
    #: ``--sizes``: bytes per fetch of the bandwidth sweep (empty: no sweep); ``--warmup``
    #: untimed and ``--iters`` timed fetches per size (:mod:`.sweep`)
    sweep_sizes: list[int] = field(default_factory=list)
    sweep_warmup: int = 5
    sweep_iters: int = 20

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(f"unknown run-config fields {sorted(unknown)}")
        return cls(**obj)

    # -- derived -----------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks * self.capacity_factor

    @property
    def stall_seconds(self) -> float:
        """How long a ``slow-*`` fault stalls a worker: longer than any deadline of the run."""
        return 3.0 * self.timeout

    @property
    def warmup_blocks(self) -> int:
        """The warm-up prefix committed before the final size (as vLLM's warm-up does)."""
        return max(2, self.num_blocks // 2)

    def worker_names(self) -> list[str]:
        return ([worker_name(PREFILL, r) for r in range(self.num_prefill)]
                + [worker_name(DECODE, r) for r in range(self.num_decode)])

    def worker_index(self, role: str, rank: int) -> int:
        """Global index: prefills first, then decodes (GPU round-robin and torchrun RANK)."""
        return rank if role == PREFILL else self.num_prefill + rank

    def device_for(self, role: str, rank: int, local_index: int | None = None) -> str:
        """Device string of a worker: round-robin over the GPUs by ``local_index`` (a
        launcher's LOCAL_RANK) or else the worker's global index; with ``placement`` split
        (and two GPUs or more), prefills round-robin over the first half of the GPUs and
        decodes over the second; ``cpu`` on host. The one GPU placement of the harness."""
        if self.local_device:
            return self.local_device
        if self.device != "cuda":
            return "cpu"
        gpus = max(1, self.num_gpus)
        if self.placement == "split" and local_index is None and gpus >= 2:
            half = gpus // 2
            return (f"cuda:{rank % half}" if role == PREFILL
                    else f"cuda:{half + rank % (gpus - half)}")
        index = self.worker_index(role, rank) if local_index is None else local_index
        return f"cuda:{index % gpus}"

    def block_sets(self, prefill_rank: int, decode_rank: int, round_no: int,
                   ) -> tuple[list[int], list[int]]:
        """``(remote_ids, local_ids)`` for one pair and round: random, non-contiguous, the same
        on both sides (seeded). ``remote_ids[i]`` on prefill lands in ``local_ids[i]`` on
        decode; the orders differ so a block landing in the wrong slot is caught."""
        rng = random.Random(f"{self.seed}/{prefill_rank}/{decode_rank}/{round_no}")
        n, k = self.num_blocks, self.transfer_blocks
        while True:
            remote = sorted(rng.sample(range(n), k))
            if k == 1 or remote[-1] - remote[0] != k - 1:  # at least one gap
                break
        local = rng.sample(range(n), k)
        return remote, local

    def corrupt_target(self) -> tuple[int, int]:
        """``(prefill_rank, block_id)`` whose byte ``--corrupt`` flips: a block of the first
        pair's first transfer, so every transport of that pair must catch it."""
        remote, _ = self.block_sets(0, 0, 1)
        rng = random.Random(f"{self.seed}/corrupt")
        return 0, rng.choice(remote)
