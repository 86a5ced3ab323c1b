"""``kvconnect-validate``'s command line: its options, in ``--help`` order, with the parsers
that check each value's syntax (:func:`build_parser`). What needs more than one option or the
transport registry is checked by :func:`.cli.build_config`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from kvconnect.checks import (
    MAX_BYTES,
    checked_positive,
    checked_seconds,
    option_type,
    parse_whole_number,
)

from .config import ROLES
from .environment import package_version
from .faults import FAULT_KINDS, PHASES, FaultSpec, FaultSpecError, parse_fault
from .multihost.store_auth import TOKEN_ENV

DEFAULT_LAYOUT = "llama3-8b-like"
DEFAULT_BLOCKS = 160


#: the largest count any option takes (workers, blocks, layers, fetches, a rank)
MAX_COUNT = 1_000_000
#: the largest bandwidth floor --min-gbps takes (GB/s)
MAX_GBPS = 1e6


def _int_at_least(minimum: int, maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type: a whole number in ``[minimum, maximum]`` typed in ASCII digits
    (:func:`kvconnect.checks.parse_whole_number`)."""
    return option_type(lambda text: parse_whole_number("the value", text, minimum=minimum,
                                                       maximum=maximum))


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)
_seed = _int_at_least(0, MAX_BYTES)


#: ``--min-gbps``: a number above 0, at most :data:`MAX_GBPS`, in ASCII digits
_positive_float = option_type(lambda text: checked_positive("the value", text, maximum=MAX_GBPS,
                                                            unit="GB/s: "))
#: ``--timeout``: seconds above 0 and at most a day (:data:`kvconnect.checks.MAX_SECONDS`:
#: every deadline of the run is derived from it), in ASCII digits
_seconds = option_type(lambda text: checked_seconds("the value", text))


def _transports(text: str) -> list[str]:
    """Syntax only, names kept as typed: they are matched against the registry (as
    registered, or by case when that is unambiguous) once every ``--transport-module`` is
    loaded (:func:`.cli.build_config`)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("needs at least one transport name")
    if len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"transport listed twice in {text!r}")
    return items

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"([0-9]{1,16})\s*([KMGT]?)(?:I?B)?", re.ASCII)
#: most sizes one sweep may list, and the largest size (bytes)
MAX_SWEEP_SIZES = 64
MAX_SWEEP_BYTES = 1 << 40


def _size(text: str) -> int:
    m = _SIZE.fullmatch(text.strip(" \t").upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 4096, 512K, 1M or 1G "
                                         f"(K = 1024), got {text!r}")
    value = int(m[1]) * _UNITS[m[2]]
    if not 0 < value <= MAX_SWEEP_BYTES:
        raise argparse.ArgumentTypeError(f"size {text!r} must be between 1 byte and 1T")
    return value


def _sizes(text: str) -> list[int]:
    """``MIN:MAX[:FACTOR]`` (MIN, MIN*FACTOR, ... up to MAX; FACTOR 2 by default, as
    nccl-tests' ``-b -e -f``) or a comma-separated list; bytes, K/M/G/T = 1024^n."""
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise argparse.ArgumentTypeError(f"expected MIN:MAX or MIN:MAX:FACTOR, got {text!r}")
        lo, hi = _size(parts[0]), _size(parts[1])
        factor = _int_at_least(2)(parts[2]) if len(parts) == 3 else 2
        if hi < lo:
            raise argparse.ArgumentTypeError(f"--sizes {text}: MAX is below MIN")
        sizes = [lo]
        while sizes[-1] * factor <= hi and len(sizes) <= MAX_SWEEP_SIZES:
            sizes.append(sizes[-1] * factor)
    else:
        sizes = [_size(t) for t in text.split(",") if t.strip()]
    if not sizes or len(sizes) > MAX_SWEEP_SIZES:
        raise argparse.ArgumentTypeError(f"--sizes needs 1 to {MAX_SWEEP_SIZES} sizes, got "
                                         f"{len(sizes)} from {text!r}")
    return sorted(set(sizes))


class _LayoutHelp(argparse.Action):
    """``--layout``: its help lists the presets of the registry, read only when the help
    is printed (the registry imports torch)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.pop("help", None)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    @property
    def help(self) -> str:
        return f"KV cache layout preset (default {DEFAULT_LAYOUT}): {', '.join(layout_names())}"

    @help.setter
    def help(self, value: object) -> None:
        pass

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


def layout_names() -> list[str]:
    """The layout presets ``--layout`` takes: the registry's names
    (:data:`kvconnect.layout.PRESETS`), the one list for --help, the error and the docs."""
    from kvconnect import layout

    return sorted(layout.PRESETS)


def _fault(text: str) -> FaultSpec:
    try:
        return parse_fault(text)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The command line (argument order is the order of ``--help``)."""
    p = argparse.ArgumentParser(
        prog="kvconnect-validate",
        description="Start N prefill and M decode workers, move KV blocks between every "
                    "prefill/decode pair over each transport, and check they arrive byte-exact "
                    "and fast. Exit 0 passed, 1 failed, 2 bad arguments, 3 environment lacking, "
                    "130/143 stopped by SIGINT/SIGTERM.",
    )
    _add_run_arguments(p)
    _add_sweep_arguments(p)
    p.add_argument("--inject", type=_fault, action="append", default=None,
                   metavar="FAULT@PHASE",
                   help="inject a fault (repeatable): the run must report it (exit 1) naming "
                        "the worker, its rank and phase within --timeout, or recover from it "
                        f"(restart-prefill: exit 0). Faults: {', '.join(FAULT_KINDS)} "
                        "(append a rank: kill-decode1); phases: " + ", ".join(PHASES))
    _add_multi_host_arguments(p)
    p.add_argument("--plain", action="store_true",
                   help="plain progress lines even on a terminal")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress, only the summary")
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="everything: every phase, check and transfer as it happens and "
                        "every check in the summary; -vv adds debug logging")
    return p


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Workers, device, cache shape, transports, reports, limits and seed."""
    p.add_argument("--prefill", type=_positive_int, default=1, metavar="N",
                   help="prefill workers (default 1)")
    p.add_argument("--decode", type=_positive_int, default=1, metavar="M",
                   help="decode workers (default 1)")
    p.add_argument("--device", choices=("auto", "cuda", "host", "cpu"), default="auto",
                   help="auto: CUDA when a GPU with VMM works, else host memory (default auto)")
    p.add_argument("--placement", choices=("round-robin", "split"), default="round-robin",
                   help="GPUs of the workers: round-robin over all (default), or split: "
                        "prefills on the first half, decodes on the second (every transfer "
                        "crosses GPUs; needs two GPUs, one GPU runs all)")
    p.add_argument("--version", action="version",
                   version=f"%(prog)s {package_version('kvconnect') or 'unknown (not installed)'}")
    p.add_argument("--layout", default=DEFAULT_LAYOUT, metavar="PRESET", action=_LayoutHelp)
    p.add_argument("--num-blocks", type=_positive_int, default=None, metavar="K",
                   help=f"committed KV blocks per worker (default {DEFAULT_BLOCKS}; with "
                        "--sizes, enough for the largest size)")
    p.add_argument("--num-layers", type=_positive_int, default=4, metavar="L",
                   help="layers of the model preset (default 4)")
    p.add_argument("--transfer-blocks", type=_positive_int, default=None, metavar="B",
                   help="blocks per transfer, a random non-contiguous subset "
                        "(default: half of --num-blocks, at most 24)")
    p.add_argument("--transports", type=_transports, default=None, metavar="LIST",
                   help="comma-separated transport names: ipc,nixl and any a "
                        "--transport-module registers (default: every registered one; those "
                        "that cannot run here are skipped with the reason)")
    p.add_argument("--transport-module", action="append", default=None, metavar="MODULE",
                   help="import MODULE (a dotted name importable in every worker: installed "
                        "or on PYTHONPATH) in the coordinator and every worker before the "
                        "run; it registers its transports (repeatable; docs/validate.md)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--junit", metavar="PATH", help="write JUnit XML, one testcase per check")
    p.add_argument("--min-gbps", type=_positive_float, default=None, metavar="X",
                   help="fail any transfer slower than X GB/s (1e9 bytes/s)")
    p.add_argument("--timeout", type=_seconds, default=60.0, metavar="S",
                   help="deadline in seconds for every wait: start-up, each peer, each "
                        "transfer (default 60)")
    p.add_argument("--corrupt", action="store_true",
                   help="negative control: flip one byte on prefill after digesting; the run "
                        "must fail naming that block")
    p.add_argument("--seed", type=_seed, default=0, metavar="S",
                   help="seed of the block contents and block choice (default 0)")


def _add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    sweep = p.add_argument_group(
        "bandwidth sweep", "nccl-tests / nixlbench style: after round 1, per pair, transport "
        "and size, warm-up fetches then timed ones; average, min and max latency and GB/s, "
        "and a closing average-bandwidth line (also in --json: sweep, sweep_average_gbps)")
    sweep.add_argument("--sizes", type=_sizes, default=None, metavar="MIN:MAX[:F]|LIST",
                       help="bytes per fetch: 1M:1G doubles from 1 MiB to 1 GiB, 1M:1G:4 "
                            "quadruples, or a list 4K,1M,64M (K/M/G = 1024^n; each rounded "
                            "up to whole KV blocks)")
    sweep.add_argument("--warmup", type=_non_negative_int, default=5, metavar="N",
                       help="untimed fetches per size (default 5)")
    sweep.add_argument("--iters", type=_positive_int, default=20, metavar="N",
                       help="timed fetches per size (default 20; fewer when a size's "
                            "budget, half of --timeout, runs out)")


def _add_multi_host_arguments(p: argparse.ArgumentParser) -> None:
    mh = p.add_argument_group(
        "multi-host", "one process per worker, rendezvous through torch.distributed.TCPStore "
        "(also taken from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun or srun set)")
    mh.add_argument("--rendezvous", metavar="HOST:PORT",
                    help="TCPStore address; prefill rank 0 hosts it")
    mh.add_argument("--role", choices=ROLES, help="this process's role")
    mh.add_argument("--rank", type=_non_negative_int, metavar="R",
                    help="this process's rank within its role")
    mh.add_argument("--rendezvous-token-file", metavar="PATH",
                    help="a file holding a shared secret (>= 16 bytes) every process of the "
                         f"run must prove it knows (HMAC over nonces; never sent); or set "
                         f"{TOKEN_ENV}. A process with a wrong token is refused (exit 3)")
