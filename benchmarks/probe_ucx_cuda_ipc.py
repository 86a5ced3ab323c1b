"""Probe: which UCX lane stock NIXL uses between two processes of one node, and what changes it.

For each *variant* (memory kind x operation x UCX environment x NIXL UCX backend parameters)
two fresh processes are started: a *target* that owns ``--mib`` of memory (``cudamalloc``:
``torch.empty`` on the GPU; ``vmm``: a kvconnect ExtensibleTensor, cuMemCreate with POSIX-fd
handles; ``dram``: host memory) filled with a position-dependent pattern and registered with a
NIXL agent, and an *initiator* with the same kind of memory that READs the target's buffer
(or WRITEs its own into it) through NIXL, timed, and checks the bytes (READ: the initiator's
copy; WRITE: the target checks its buffer). Both run with ``UCX_PROTO_INFO=y``; the UCX
protocol tables they print name the lane that carried the data. The reference is a plain
copy of the same bytes in the initiator (device-to-device, or host), same run.

    python benchmarks/probe_ucx_cuda_ipc.py --device cuda:0 --json probe.json --logs logs/

Each variant is one JSON row: GB/s, ratio to the reference, bytes verified, the lanes UCX
printed, and the lines of interest from a ``UCX_LOG_LEVEL=debug`` run where asked.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any

import torch

from kvconnect.units import gbps

MIB = 1024 * 1024
TAG = "KVC-PROBE "
#: how many bytes of each process log the JSON keeps (the rest stays in --logs)
LOG_TAIL = 4000
#: "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1]" (UCX 1.23), or
#: "... into host memory from host"
_TABLE_TITLE = re.compile(r"remote memory (read|write) by ucp_(get|put)\S*(?:\s+(?:into|from)\s+"
                          r"(\S+)(?:\s+memory)?\s+(?:from|to)\s+([^\s|]+))?")
_DEBUG_KEEP = re.compile(r"cuda.ipc|nvlink|get.zcopy|cuda_ipc|rma_bw|VMM|fabric", re.I)

#: name -> (memory, operation, extra environment, NIXL UCX backend parameters)
GPU_VARIANTS: dict[str, tuple[str, str, dict[str, str], dict[str, str]]] = {
    "cudamalloc-read-default": ("cudamalloc", "READ", {}, {}),
    "cudamalloc-read-env-get-zcopy": ("cudamalloc", "READ",
                                      {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, {}),
    "cudamalloc-read-engine-config": ("cudamalloc", "READ", {},
                                      {"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=y"}),
    "cudamalloc-read-errmode-none": ("cudamalloc", "READ", {},
                                     {"ucx_error_handling_mode": "none"}),
    "cudamalloc-write-default": ("cudamalloc", "WRITE", {}, {}),
    "vmm-read-default": ("vmm", "READ", {}, {}),
    "vmm-read-env-get-zcopy": ("vmm", "READ", {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}, {}),
    "vmm-write-default": ("vmm", "WRITE", {}, {}),
}
HOST_VARIANTS: dict[str, tuple[str, str, dict[str, str], dict[str, str]]] = {
    "dram-read-default": ("dram", "READ", {}, {}),
    "dram-read-errmode-none": ("dram", "READ", {}, {"ucx_error_handling_mode": "none"}),
    "dram-write-default": ("dram", "WRITE", {}, {}),
}


# -- both processes ----------------------------------------------------------------------------
def _agent(name: str, params: dict[str, str]) -> Any:
    from kvconnect.connectors.nixl.agent import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    agent = nixl_agent(name, nixl_agent_config(backends=[], enable_prog_thread=True))
    agent.create_backend("UCX", dict(params))
    return agent


def _memory(kind: str, nbytes: int, device: str) -> tuple[torch.Tensor, Any]:
    """``(uint8 view, owner)`` of ``nbytes`` of ``kind`` memory."""
    if kind == "dram":
        return torch.zeros(nbytes, dtype=torch.uint8), None
    if kind == "cudamalloc":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device), None
    from kvconnect.tensor import ExtensibleTensor
    from kvconnect.vmm import AllocationOptions

    owner = ExtensibleTensor(2 * nbytes, device, options=AllocationOptions(shareable=True))
    owner.commit(nbytes, single_handle=True)  # one handle, as a kvconnect KV segment
    return owner.committed_view(0, nbytes), owner


def _pattern(view: torch.Tensor, seed: int) -> torch.Tensor:
    words = torch.arange(view.numel() // 8, dtype=torch.int64, device=view.device)
    return (words * 2654435761 + seed).view(torch.uint8)


def _mem_type(kind: str) -> str:
    return "DRAM" if kind == "dram" else "VRAM"


def _descs(agent: Any, view: torch.Tensor, kind: str) -> Any:
    dev = 0 if view.device.type == "cpu" else (view.device.index or 0)
    return agent.get_xfer_descs([(view.data_ptr(), view.numel(), dev)], _mem_type(kind))


def _register(agent: Any, view: torch.Tensor, kind: str) -> Any:
    dev = 0 if view.device.type == "cpu" else (view.device.index or 0)
    return agent.register_memory([(view.data_ptr(), view.numel(), dev, "")], _mem_type(kind))


def _say(obj: dict[str, Any]) -> None:
    print(TAG + json.dumps(obj), flush=True)


def target(args: argparse.Namespace) -> int:
    """Own, fill and register the buffer; print the metadata; on ``check SEED`` say whether
    the buffer holds that seed's pattern; exit when stdin closes."""
    nbytes = args.mib * MIB
    view, owner = _memory(args.memory, nbytes, args.device)
    view.copy_(_pattern(view, 1))
    agent = _agent(args.name, json.loads(args.params))
    reg = _register(agent, view, args.memory)
    meta = base64.b64encode(agent.get_agent_metadata()).decode()
    dev = 0 if view.device.type == "cpu" else (view.device.index or 0)
    _say({"metadata": meta, "addr": view.data_ptr(), "len": nbytes, "dev": dev})
    for line in sys.stdin:
        if line.startswith("check"):
            seed = int(line.split()[1])
            if view.device.type == "cuda":
                torch.cuda.synchronize(view.device)
            _say({"check": bool(torch.equal(view, _pattern(view, seed)))})
    agent.deregister_memory(reg)
    del agent, owner
    return 0


def _wait_done(agent: Any, handle: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = agent.check_xfer_state(handle)
        if state == "DONE":
            return
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"NIXL transfer not done after {timeout} s")


def initiator(args: argparse.Namespace) -> int:
    """READ the target's buffer (or WRITE ours into it), timed; print one result."""
    info = json.loads(args.offer)
    nbytes = int(info["len"])
    view, owner = _memory(args.memory, nbytes, args.device)
    agent = _agent(args.name, json.loads(args.params))
    reg = _register(agent, view, args.memory)
    remote = agent.add_remote_agent(base64.b64decode(info["metadata"]))
    remote_descs = agent.get_xfer_descs([(int(info["addr"]), nbytes, int(info["dev"]))],
                                        _mem_type(args.memory))
    if args.op == "WRITE":
        view.copy_(_pattern(view, 2))
    sync = (lambda: torch.cuda.synchronize(view.device)) if view.device.type == "cuda" \
        else (lambda: None)
    sync()
    handle = agent.initialize_xfer(args.op, _descs(agent, view, args.memory), remote_descs,
                                   remote)
    times = []
    t_first = time.perf_counter()
    for i in range(1 + args.iters):
        t0 = time.perf_counter()
        if agent.transfer(handle) == "ERR":
            raise RuntimeError("NIXL refused to post the transfer")
        _wait_done(agent, handle, args.timeout)
        times.append(time.perf_counter() - t0)
        if i == 0 and times[0] > 0.05:  # a slow lane: two more are enough
            args.iters = min(args.iters, 2)
        if i >= args.iters:
            break
    total = time.perf_counter() - t_first
    sync()
    verified = bool(torch.equal(view, _pattern(view, 1))) if args.op == "READ" else None
    ref = _reference(view)
    timed = sorted(times[1:]) or times
    sec = timed[len(timed) // 2]
    _say({"seconds": sec, "first_seconds": times[0], "total_seconds": total,
          "iters": len(times) - 1, "gbps": gbps(nbytes, sec), "reference_gbps": ref,
          "verified": verified, "bytes": nbytes})
    agent.release_xfer_handle(handle)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    del agent, owner
    return 0


def _reference(view: torch.Tensor) -> float:
    """GB/s of one plain copy of the same bytes between ordinary buffers of this device."""
    a = torch.empty_like(view).fill_(3)
    b = torch.empty_like(view)
    times = []
    for i in range(6):
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        t0 = time.perf_counter()
        b.copy_(a)
        if a.device.type == "cuda":
            torch.cuda.synchronize(a.device)
        if i:
            times.append(time.perf_counter() - t0)
    times.sort()
    return gbps(view.numel(), times[len(times) // 2])


# -- the orchestrator --------------------------------------------------------------------------
def _lanes(text: str) -> list[str]:
    """``"<op> <into>-><from>: <config> <description>"`` for every protocol table row."""
    out: list[str] = []
    state, title = 0, ""
    for raw in text.splitlines():
        cut = min((i for i in (raw.find("|"), raw.find("+")) if i >= 0), default=-1)
        if cut < 0:
            continue
        line = raw[cut:].strip()
        m = _TABLE_TITLE.search(line)
        if m:
            state, title = 1, f"{m.group(1)} {m.group(3) or '?'}<-{m.group(4) or '?'}"
            continue
        if state == 1 and "Range" in line and "Config" in line:
            state = 2
        elif state == 2 and line.startswith("+"):
            state = 3
        elif state == 3:
            if line.startswith("+"):
                state = 0
                continue
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 3 and cells[2]:
                lane = f"{title}: {cells[2]} {cells[1]}"
                if lane not in out:
                    out.append(lane)
    return out


def _read_tag(proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The next TAG line of ``proc``'s stdout (other lines are UCX's and stay in its log)."""
    import select

    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode(errors="replace")
            proc.log.append(text)  # type: ignore[attr-defined]
            if text.startswith(TAG):
                proc.pending = buf  # type: ignore[attr-defined]
                return json.loads(text[len(TAG):])
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        chunk = os.read(fd, 1 << 16) if ready else b""
        if not chunk:
            raise RuntimeError(f"no {TAG.strip()} line within {timeout} s (exit {proc.poll()})")
        buf += chunk


def _spawn(args: argparse.Namespace, role: str, name: str, memory: str, op: str,
           params: dict[str, str], env: dict[str, str], offer: str = "") -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--name", name,
           "--memory", memory, "--op", op, "--params", json.dumps(params), "--mib",
           str(args.mib), "--device", args.device, "--iters", str(args.iters),
           "--timeout", str(args.timeout), "--offer", offer]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    proc.log = []  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen) -> str:
    """Close stdin, wait (bounded), return everything it printed."""
    try:
        rest, _ = proc.communicate(timeout=60)  # closes stdin: the target exits
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate(timeout=10)
    pending = getattr(proc, "pending", b"")
    tail = (pending + (rest or b"")).decode(errors="replace")
    return "\n".join(proc.log) + "\n" + tail  # type: ignore[attr-defined]


def run_variant(args: argparse.Namespace, name: str, memory: str, op: str,
                extra_env: dict[str, str], params: dict[str, str], debug: bool = False
                ) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # torch.empty must be plain cudaMalloc memory
    env.update({"UCX_PROTO_INFO": "y", **extra_env})
    if debug:
        env["UCX_LOG_LEVEL"] = "debug"
    row: dict[str, Any] = {"variant": name, "memory": memory, "op": op, "env": extra_env,
                           "backend_params": params, "mib": args.mib}
    tgt = _spawn(args, "target", f"{name}-target", memory, op, params, env)
    ini = None
    try:
        offer = _read_tag(tgt, args.timeout)
        ini = _spawn(args, "initiator", f"{name}-initiator", memory, op, params, env,
                     json.dumps(offer))
        row.update(_read_tag(ini, args.timeout + 120))
        row["ratio"] = row["gbps"] / row["reference_gbps"]
        if op == "WRITE":
            assert tgt.stdin is not None
            tgt.stdin.write(b"check 2\n")
            tgt.stdin.flush()
            row["verified"] = _read_tag(tgt, args.timeout)["check"]
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a finding, recorded
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        logs = {"target": _finish(tgt), "initiator": _finish(ini) if ini else ""}
    row["lanes"] = {side: _lanes(text) for side, text in logs.items()}
    if debug:
        row["debug_lines"] = sorted({ln.strip()[-240:] for text in logs.values()
                                     for ln in text.splitlines() if _DEBUG_KEEP.search(ln)
                                     and "debug" in ln.lower()})[:60]
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
        for side, text in logs.items():
            with open(os.path.join(args.logs, f"{name}-{side}.log"), "w") as f:
                f.write(text)
    row["initiator_log_tail"] = logs["initiator"][-LOG_TAIL:] if "error" in row else ""
    return row


def _print(row: dict[str, Any]) -> None:
    if "error" in row:
        print(f"{row['variant']:34s} ERROR {row['error']}", flush=True)
        return
    lanes = "; ".join(row["lanes"]["initiator"]) or "-"
    print(f"{row['variant']:34s} {row['gbps']:9.2f} GB/s ratio {row['ratio']:.4f} vs "
          f"{row['reference_gbps']:.0f} verified={row['verified']} lanes: {lanes}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["orchestrate", "target", "initiator"],
                    default="orchestrate", help=argparse.SUPPRESS)
    ap.add_argument("--name", default="", help=argparse.SUPPRESS)
    ap.add_argument("--memory", default="", help=argparse.SUPPRESS)
    ap.add_argument("--op", default="READ", help=argparse.SUPPRESS)
    ap.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--offer", default="", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mib", type=int, default=256, help="bytes per transfer, MiB")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--variants", nargs="*", default=None,
                    help="names to run (default: every variant for the device)")
    ap.add_argument("--debug-variant", default="",
                    help="run this variant once more at 1 MiB with UCX_LOG_LEVEL=debug")
    ap.add_argument("--json", default="")
    ap.add_argument("--logs", default="", help="folder for every process's full log")
    args = ap.parse_args(argv)
    if args.role == "target":
        return target(args)
    if args.role == "initiator":
        return initiator(args)
    table = HOST_VARIANTS if args.device == "cpu" else GPU_VARIANTS
    names = args.variants if args.variants is not None else list(table)
    rows: list[dict[str, Any]] = []
    report = {"schema": "kvconnect-probe-ucx/1",
              "command": shlex.join([sys.executable, *sys.argv]), "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "rows": rows}

    def save() -> None:  # after every variant: a run stopped at its limit keeps the rest
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    for name in names:
        rows.append(run_variant(args, name, *table[name]))
        _print(rows[-1])
        save()
    if args.debug_variant:
        small = argparse.Namespace(**{**vars(args), "mib": 1, "iters": 1})
        rows.append(run_variant(small, args.debug_variant + "-debug", *table[args.debug_variant],
                                debug=True))
        print("debug lines:", *rows[-1].get("debug_lines", []), sep="\n  ")
        save()
    return 0 if all("error" not in r and r.get("verified") is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
