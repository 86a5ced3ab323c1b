"""``--sizes``: a bandwidth sweep as nccl-tests and nixlbench measure it (decode side).

After its round-1 transfers from a prefill, a decode measures every transport that moved
that prefill's blocks byte-exact, for every size of the sweep (smallest first): the size is
rounded up to whole KV blocks (a seeded random set of that many blocks, fetched into another
random set of its own), ``--warmup`` untimed fetches, then ``--iters`` timed ones, each one
launch / one NIXL READ of the whole set. Per size it reports the average, fastest and slowest
fetch (:class:`~.report.SweepPoint`) beside a same-run reference (one plain torch copy of the
same bytes between ordinary allocations on the same devices), and checks the destination holds exactly the prefill's
blocks afterwards (its blocks are overwritten with the decode's own pattern before the
warm-up, so a fetch that moved nothing cannot pass).

Every size has a budget of half of ``--timeout`` for its fetches: iterations stop early once
it is spent (the point records how many ran), so a slow transport bounds the sweep instead of
stalling the run. Each fetch tells the coordinator the worker moves on
(:meth:`~.control.Control.progress`).

Units: bytes, seconds; block ids are logical blocks.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from kvconnect.block_ids import merged_block_ids
from kvconnect.peer_layout import PeerLayout

from ..config import DECODE, PREFILL, RunConfig, pair_name, worker_name
from ..report import SweepPoint
from .content import cache_rows, content_key, generate, paired_owners
from .reference_copies import reference_copy_gbps
from .steps import mib

#: blocks regenerated at once when a sweep point is verified (bounds the scratch memory)
_VERIFY_BATCH = 64


def sweep_blocks(cfg: RunConfig, prefill_rank: int, decode_rank: int, blocks: int,
                 ) -> tuple[list[int], list[int]]:
    """``(remote_ids, local_ids)`` of one sweep size: seeded, the same on both sides."""
    rng = random.Random(f"{cfg.seed}/sweep/{prefill_rank}/{decode_rank}/{blocks}")
    remote = sorted(rng.sample(range(cfg.num_blocks), blocks))
    return remote, rng.sample(range(cfg.num_blocks), blocks)


def run_sweep(worker: Any, prefill_rank: int, info: dict[str, Any],
              transports: list[str]) -> None:
    """Measure ``transports`` from prefill ``prefill_rank`` at every ``--sizes`` size;
    ``worker`` is the :class:`~.decode.DecodeWorker`, ``info`` the prefill's round-1 offer."""
    cfg = worker.cfg
    seen: set[int] = set()
    for size in cfg.sweep_sizes:
        blocks = max(1, -(-size // worker.cache.bytes_per_block))  # whole blocks holding size
        if blocks in seen or blocks > cfg.num_blocks:
            continue
        seen.add(blocks)
        reference = reference_copy_gbps(blocks * worker.cache.bytes_per_block,
                                        worker.reference_source(prefill_rank, info),
                                        worker.device)
        for transport in transports:
            _one_size(worker, prefill_rank, info, transport, blocks, reference)


def _one_size(worker: Any, p: int, info: dict[str, Any], transport: str, blocks: int,
              reference: float) -> None:
    ctl, cfg = worker.ctl, worker.cfg
    prefill = worker_name(PREFILL, p)
    pair = pair_name(p, worker.rank)
    remote_ids, local_ids = sweep_blocks(cfg, p, worker.rank, blocks)
    ctl.phase(f"sweep:{transport}:{prefill}:{blocks * worker.cache.bytes_per_block}")
    worker.poison(local_ids)
    receiver = worker.transport(transport)
    budget = time.monotonic() + cfg.timeout / 2

    # converted before the timed fetches (see _Offer.id_arrays in .decode)
    remote, local = merged_block_ids([(remote_ids, local_ids)], ("remote_ids", "local_ids"))

    def fetch() -> Any:
        result = receiver.fetch(prefill, remote, local, timeout=cfg.timeout)
        ctl.progress()
        worker.count_notice(transport, prefill, int(info.get("incarnation", 1)))
        return result

    warm = 0
    while warm < cfg.sweep_warmup and time.monotonic() < budget:
        fetch()
        warm += 1
    times: list[float] = []
    while len(times) < cfg.sweep_iters and (not times or time.monotonic() < budget):
        result = fetch()
        times.append(result.seconds)
    verified = _verify(worker, prefill, info, remote_ids, local_ids)
    point = SweepPoint(pair=pair, transport=transport, bytes=int(result.bytes), blocks=blocks,
                       warmup=warm, iters=len(times), avg_seconds=sum(times) / len(times),
                       min_seconds=min(times), max_seconds=max(times), verified=verified,
                       backend=str(result.backend), reference_gbps=reference)
    ctl.sweep(point)
    if not verified:
        ctl.failed(f"sweep/{pair}/{transport}/{point.bytes}",
                   f"{pair} {transport} sweep at {mib(point.bytes)} ({blocks} blocks): the "
                   "destination blocks differ from the prefill's after the timed fetches",
                   data={"role": DECODE, "rank": worker.rank, "peer": prefill,
                         "bytes": point.bytes, "blocks": blocks})


def _verify(worker: Any, prefill: str, info: dict[str, Any], remote_ids: list[int],
            local_ids: list[int]) -> bool:
    """True when every destination block holds the prefill's bytes of its source block
    (regenerated here from the content key, in batches)."""
    remote = PeerLayout.from_json(info["layout"])  # checked in DecodeWorker.fetch_from
    for lspec, rspec, _ in paired_owners(worker.layout, remote):
        rows = cache_rows(worker.cache, lspec)
        key = content_key(worker.cfg.seed, prefill, rspec)
        for at in range(0, len(remote_ids), _VERIFY_BATCH):
            src = torch.tensor(remote_ids[at:at + _VERIFY_BATCH], dtype=torch.int64,
                               device=rows.device)
            dst = torch.tensor(local_ids[at:at + _VERIFY_BATCH], dtype=torch.int64,
                               device=rows.device)
            if not torch.equal(rows.index_select(0, dst), generate(key, src, lspec.bytes_per_block)):
                return False
    return True
