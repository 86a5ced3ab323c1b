"""Probe: what limits the block-copy kernel on one GPU (kernel time only, CUDA events).

Plain cudaMalloc regions shaped like a Llama-3-8B-like cache (64 regions of ``--block-kib``
per block), ``--request-mib`` per copy. Variants: block id patterns (random: sorted source,
shuffled destination as in a transfer; sorted: both sorted; contiguous: ids 0..k-1 on both
sides) x cache hints (default, streaming). Kernel time is the median of ``--iters`` runs of
``--batch`` back-to-back launches between two events (host launch overhead hidden), against
a contiguous d2d torch copy of the same bytes timed the same way.

    python benchmarks/probe_copy_kernel.py --json probe.json
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from transfer_timing import events_ms as _events_ms  # benchmarks/ is sys.path[0]

from kvconnect.connectors.copy._triton_block_copy import launch_block_copy
from kvconnect.connectors.copy.block_copy import BlockCopyPlan, BlockRegion

MIB = 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-kib", type=int, default=32)
    ap.add_argument("--request-mib", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--regions", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    dev = torch.device("cuda:0")
    blen = args.block_kib * 1024
    rng = np.random.default_rng(0)
    rows = []
    for mib in args.request_mib:
        k = max(1, mib * MIB // (args.regions * blen))
        nb = 2 * k
        src_t = [torch.randint(0, 1 << 30, (nb * blen // 8,), dtype=torch.int64, device=dev)
                 for _ in range(args.regions)]
        dst_t = [torch.zeros_like(x) for x in src_t]
        plan = BlockCopyPlan([BlockRegion(x.view(torch.uint8), blen, blen, nb) for x in src_t],
                             [BlockRegion(x.view(torch.uint8), blen, blen, nb) for x in dst_t],
                             device=dev, method="kernel")
        nbytes = k * args.regions * blen
        a = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(3)
        b = torch.empty_like(a)
        ref_ms = _events_ms(lambda a=a, b=b: b.copy_(a), args.batch, args.iters)
        perm = rng.permutation(nb)
        patterns = {"random": (np.sort(perm[:k]), rng.permutation(nb)[:k]),
                    "sorted": (np.sort(perm[:k]), np.sort(rng.permutation(nb)[:k])),
                    "contiguous": (np.arange(k), np.arange(k))}
        for name, (s, d) in patterns.items():
            anchor, table, ids, opts = plan.kernel_arguments(s, d, dev)
            for streaming in (False, True):
                ms = _events_ms(lambda an=anchor, t=table, o=opts, st=streaming, i=ids:
                                launch_block_copy(an, t, i, **o, streaming=st),
                                args.batch, args.iters)
                row = {"request_bytes": nbytes, "ids": name, "streaming": streaming,
                       "kernel_gbps": nbytes / ms / 1e6, "d2d_gbps": nbytes / ref_ms / 1e6,
                       "ratio": ref_ms / ms}
                rows.append(row)
                print(f"{mib:5d} MiB {name:10s} streaming={int(streaming)} "
                      f"{row['kernel_gbps']:7.1f} GB/s vs d2d {row['d2d_gbps']:7.1f} "
                      f"ratio {row['ratio']:.2f}", flush=True)
        del src_t, dst_t, a, b, plan
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
