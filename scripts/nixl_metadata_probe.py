"""How NIXL's ``add_remote_agent`` takes corrupted agent metadata: counts, in child processes.

A peer's handshake carries NIXL's agent metadata blob (its agent name, its UCX worker
address and registered memory), which kvconnect passes to ``add_remote_agent`` as it is:
kvconnect validates the JSON around it, not NIXL's serialisation inside. This probe takes a
real blob (an agent with four registered buffers), changes 1-6 random bytes and maybe cuts
it, and loads each result into a fresh-ish agent in a child process, counting outcomes: a
Python exception (refused), loaded (accepted), or the process killed by a signal (crash).
A crashed child is replaced and the count goes on.

    .venv/bin/python scripts/nixl_metadata_probe.py --inputs 4000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

PREFIX = "KVC "


def child(seed: int, start: int, count: int) -> int:
    """Load corruptions ``start .. start+count-1`` of the seeded sequence; one line each."""
    import numpy as np

    from kvconnect.connectors.nixl.agent import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    cfg = nixl_agent_config(backends=["UCX"], enable_prog_thread=False)
    loader, source = nixl_agent("probe-loader", cfg), nixl_agent("probe-source-agent", cfg)
    bufs = [np.zeros(1 << 18, dtype=np.uint8) for _ in range(4)]
    for buf in bufs:
        source.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    blob = bytes(source.get_agent_metadata())
    for i in range(start, start + count):
        rng = random.Random(f"{seed}:{i}")
        data = bytearray(blob)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.5:
            data = data[:rng.randint(1, len(data))]
        sys.stdout.write(f"{PREFIX}{json.dumps({'trying': i})}\n")
        sys.stdout.flush()
        try:
            name = loader.add_remote_agent(bytes(data))
        except Exception as exc:  # noqa: BLE001 - what NIXL raises is the datum
            outcome = type(exc).__name__
        else:
            outcome = "loaded"
            loader.remove_remote_agent(name)
        sys.stdout.write(f"{PREFIX}{json.dumps({'done': i, 'outcome': outcome})}\n")
        sys.stdout.flush()
    os._exit(0)  # the agents are not torn down: only add_remote_agent is under test


def probe(inputs: int, seed: int = 0, per_child: int = 500,
          deadline_s: float = 600.0) -> dict[str, Any]:
    """Try ``inputs`` corrupted blobs; returns counts by outcome and the crashing inputs."""
    outcomes: dict[str, int] = {}
    crashes: list[dict[str, Any]] = []
    next_i, t0 = 0, time.monotonic()
    while next_i < inputs:
        if time.monotonic() - t0 > deadline_s:
            raise TimeoutError(f"probe past its {deadline_s} s deadline at input {next_i}")
        count = min(per_child, inputs - next_i)
        proc = subprocess.Popen([sys.executable, __file__, "--child", str(seed), str(next_i),
                                 str(count)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buf, trying = b"", None
        try:
            while True:
                if not sel.select(max(1.0, deadline_s - (time.monotonic() - t0))):
                    raise TimeoutError("probe child stopped answering")
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.startswith(PREFIX.encode()):
                        continue
                    msg = json.loads(line[len(PREFIX):])
                    if "trying" in msg:
                        trying = msg["trying"]
                    else:
                        outcomes[msg["outcome"]] = outcomes.get(msg["outcome"], 0) + 1
                        trying, next_i = None, msg["done"] + 1
        finally:
            sel.close()
            proc.stdout.close()
            status = proc.wait(timeout=60)
        if status < 0 and trying is not None:  # killed by a signal while loading `trying`
            name = signal.Signals(-status).name
            outcomes[name] = outcomes.get(name, 0) + 1
            crashes.append({"input": trying, "signal": name})
            next_i = trying + 1
        elif status != 0:
            raise RuntimeError(f"probe child exited with {status} outside add_remote_agent")
    return {"inputs": inputs, "seed": seed, "outcomes": dict(sorted(outcomes.items())),
            "crashes": crashes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(int(argv[1]), int(argv[2]), int(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the counts here")
    args = p.parse_args(argv)
    result = probe(args.inputs, args.seed)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
