"""``kvconnect-validate``: do KV blocks move between prefill and decode byte-exact and fast?

Exit codes: 0 every check passed; 1 a check failed or a bandwidth floor was missed;
2 bad arguments or configuration, or a run that cannot fit this machine; 3 the environment
cannot run what was asked now (the message says what is missing); 128 + the signal when
SIGINT (130) or SIGTERM (143) stopped the run (the summary and reports are still written).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence

from kvconnect.errors import KvconnectError, OptionError
from kvconnect.interrupts import InterruptSignals, exit_now

from .arguments import DEFAULT_BLOCKS, build_parser, layout_names
from .config import PREFILL, RunConfig
from .display import Display
from .environment import (
    EnvironmentProblem,
    ResolvedDevice,
    describe,
    resolve_device,
)
from .faults import (
    FaultSpec,
    FaultSpecError,
    check_faults,
    missing_transports,
    specs_from_config,
)
from .multihost.rendezvous import Membership, membership_from_env, parse_hostport
from .multihost.store_auth import TokenError, load_token
from .report import EXIT_USAGE, Report
from .report_files import ReportPathError, check_report_path, same_report_file
from .std_streams import safe_std_streams

log = logging.getLogger("kvconnect.harness")

MAX_WORKERS_PER_ROLE = 64
MAX_BLOCKS = 1_000_000


def _resolve_transports(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """``(transports, modules)``: load each ``--transport-module`` (they register their
    transports), then check ``--transports`` against the registry; without ``--transports``
    every registered transport (:func:`_select_transports` drops those not usable here)."""
    from kvconnect.connectors.registry import load_transport_modules, transport_names

    modules = list(args.transport_module or [])
    try:
        load_transport_modules(modules)
    except KvconnectError as exc:
        raise OptionError(f"--transport-module: {exc}") from None
    known = transport_names()
    if args.transports is None:
        return list(known), modules
    chosen = [_registered_name(t, known) for t in args.transports]
    bad = [t for t, name in zip(args.transports, chosen, strict=True) if name is None]
    if bad:
        raise OptionError(f"--transports: unknown transport(s) {', '.join(bad)}; choose from "
                         f"{', '.join(known)} (a transport of another package needs "
                         "--transport-module MODULE)")
    names = [n for n in chosen if n is not None]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise OptionError(f"--transports: {', '.join(twice)} listed twice (names match "
                         "regardless of case)")
    return names, modules


def _registered_name(typed: str, known: Sequence[str]) -> str | None:
    """The registered transport ``typed`` names: itself when registered so, else the one
    registered name equal to it regardless of case; None when there is none, or several
    (``ValueError`` would hide which: the caller lists the names)."""
    if typed in known:
        return typed
    same = [k for k in known if k.casefold() == typed.casefold()]
    return same[0] if len(same) == 1 else None


def _check_output_path(flag: str, path: str | None) -> None:
    """Fail now, not after the run, when a report cannot be written to ``path``: try what
    the report writer will do (:mod:`.report_files`)."""
    if path is None:
        return
    try:
        check_report_path(flag, path)
    except ReportPathError as exc:
        raise OptionError(str(exc)) from None


def _check_layout(cfg: RunConfig, explicit_blocks: bool = False) -> None:
    """Reject unknown presets (listing the known ones) and configs the preset cannot build;
    with ``--sizes``, grow ``num_blocks`` to hold the largest size (OptionError when
    ``--num-blocks`` was given and is too small)."""
    from kvconnect import layout

    if cfg.layout not in layout.PRESETS:
        raise OptionError(f"--layout {cfg.layout!r} is not a known preset; choose from "
                         + ", ".join(layout_names()))
    try:
        config = layout.preset(cfg.layout, num_blocks=cfg.num_blocks, num_layers=cfg.num_layers)
        if cfg.sweep_sizes:
            per_block = layout.plan_layout(config).bytes_per_block
            need = -(-max(cfg.sweep_sizes) // per_block)
            if explicit_blocks and cfg.num_blocks < need:
                raise OptionError(f"--sizes up to {max(cfg.sweep_sizes)} bytes needs --num-blocks "
                                 f"of at least {need} ({per_block} bytes per block of "
                                 f"{cfg.layout} with {cfg.num_layers} layers); got "
                                 f"{cfg.num_blocks}")
            if need > MAX_BLOCKS:
                raise OptionError(f"--sizes up to {max(cfg.sweep_sizes)} bytes needs {need} "
                                 f"blocks, more than {MAX_BLOCKS}")
            if need > cfg.num_blocks:
                cfg.num_blocks = need
                layout.preset(cfg.layout, num_blocks=need, num_layers=cfg.num_layers)
    except (ValueError, TypeError) as exc:
        raise OptionError(f"--layout {cfg.layout} with --num-layers {cfg.num_layers} and "
                         f"--num-blocks {cfg.num_blocks}: {exc}") from None


def build_config(args: argparse.Namespace) -> tuple[RunConfig, Membership | None]:
    """Turn parsed arguments into a RunConfig (+ multi-host membership). OptionError if bad."""
    if args.prefill > MAX_WORKERS_PER_ROLE or args.decode > MAX_WORKERS_PER_ROLE:
        raise OptionError(f"--prefill and --decode are limited to {MAX_WORKERS_PER_ROLE} each")
    num_blocks = DEFAULT_BLOCKS if args.num_blocks is None else args.num_blocks
    if num_blocks < 4:
        raise OptionError(f"--num-blocks must be at least 4 (a non-contiguous block set needs "
                         f"room), got {num_blocks}")
    if num_blocks > MAX_BLOCKS:
        raise OptionError(f"--num-blocks {num_blocks} is unreasonably large (max {MAX_BLOCKS})")
    transfer = args.transfer_blocks
    if transfer is None:
        transfer = min(24, num_blocks // 2)
    if not 2 <= transfer <= num_blocks - 1:
        raise OptionError(f"--transfer-blocks must be between 2 and --num-blocks - 1 = "
                         f"{num_blocks - 1} (so the set can be non-contiguous), "
                         f"got {transfer}")
    if args.sizes is None and (args.warmup != 5 or args.iters != 20):
        raise OptionError("--warmup and --iters shape the --sizes sweep: give --sizes too")
    _check_output_path("--json", args.json)
    _check_output_path("--junit", args.junit)
    if args.json and args.junit and same_report_file(args.json, args.junit):
        raise OptionError("--json and --junit name the same file")
    membership = _membership(args)
    faults: list[FaultSpec] = list(args.inject or [])
    try:
        check_faults(faults, args.prefill, args.decode, multi_host=membership is not None)
    except FaultSpecError as exc:
        raise OptionError(str(exc)) from None
    transports, modules = _resolve_transports(args)
    if args.transports is not None:
        missing = missing_transports(faults, transports)
        if missing:
            raise OptionError("; ".join(missing))
    cfg = RunConfig(
        num_prefill=args.prefill, num_decode=args.decode, layout=args.layout,
        num_blocks=num_blocks, num_layers=args.num_layers, transfer_blocks=transfer,
        transports=transports, transport_modules=modules, timeout=args.timeout,
        heartbeat_timeout=min(10.0, max(2.0, args.timeout / 2)),
        corrupt=args.corrupt, seed=args.seed, min_gbps=args.min_gbps,
        faults=[f.to_json() for f in faults], sweep_sizes=list(args.sizes or []),
        sweep_warmup=args.warmup, sweep_iters=args.iters, placement=args.placement,
    )
    return cfg, membership


def _membership(args: argparse.Namespace) -> Membership | None:
    m = _membership_of(args)
    if m is None:
        if args.rendezvous_token_file is not None:
            raise OptionError("--rendezvous-token-file is for multi-host runs (--rendezvous, or "
                             "the variables torchrun / srun set)")
        return None
    try:
        token = load_token(args.rendezvous_token_file, os.environ, timeout=args.timeout)
    except TokenError as exc:
        raise OptionError(str(exc)) from None
    return dataclasses.replace(m, token=token)


def _membership_of(args: argparse.Namespace) -> Membership | None:
    given = [flag for flag, v in (("--rendezvous", args.rendezvous), ("--role", args.role),
                                  ("--rank", args.rank)) if v is not None]
    if given and len(given) < 3:
        missing = sorted({"--rendezvous", "--role", "--rank"} - set(given))
        raise OptionError(f"multi-host mode needs --rendezvous, --role and --rank together; "
                         f"missing {', '.join(missing)}")
    world = args.prefill + args.decode
    if args.rendezvous:
        try:
            host, port = parse_hostport(args.rendezvous)
        except ValueError as exc:
            raise OptionError(f"--rendezvous: {exc}") from None
        limit = args.prefill if args.role == PREFILL else args.decode
        if args.rank >= limit:
            raise OptionError(f"--rank {args.rank} is out of range for --role {args.role}: "
                             f"there are {limit} {args.role} workers (ranks 0..{limit - 1})")
        return Membership(host=host, port=port, role=args.role, rank=args.rank,
                          num_prefill=args.prefill, num_decode=args.decode)
    try:
        m = membership_from_env(os.environ, args.prefill, args.decode)
    except ValueError as exc:
        raise OptionError(str(exc)) from None
    if m is not None and m.world_size != world:
        raise OptionError(f"WORLD_SIZE {m.world_size} from the launcher does not match "
                         f"--prefill {args.prefill} + --decode {args.decode} = {world}")
    return m


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: exit code 0 pass, 1 fail, 2 usage, 3 environment, 128 + signal.

    With ``argv`` given (programmatic use, tests) the code is returned. As the console script
    (``argv`` None) the process exits right after flushing its output, skipping the
    interpreter's teardown of torch and friends (seconds on small machines).
    """
    if argv is None:
        exit_now(_main(None))
    return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    with safe_std_streams(), InterruptSignals() as signals:
        return _run(argv, signals)


@dataclasses.dataclass
class _Invocation:
    """One command's state from its parsed configuration to its exit code."""

    args: argparse.Namespace
    cfg: RunConfig
    membership: Membership | None
    signals: InterruptSignals
    report: Report
    display: Display
    started: float
    device: ResolvedDevice | None = None
    stage: str = "preflight"


def _run(argv: Sequence[str] | None, signals: InterruptSignals) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 with a message on bad syntax
    logging.basicConfig(level=logging.DEBUG if args.verbose > 1 else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg, membership = build_config(args)
    except OptionError as exc:
        return _usage_error(parser, exc)
    started = time.monotonic()
    display = Display(live=False if (args.plain or args.quiet) else None, quiet=args.quiet,
                      verbose=args.verbose > 0)
    run = _Invocation(args, cfg, membership, signals, Report(config=cfg.to_json()), display,
                      started)
    try:
        with signals.interruptible():
            try:
                _check_layout(cfg, explicit_blocks=args.num_blocks is not None)
            except OptionError as exc:
                return _usage_error(parser, exc)
            if _preflight(run):
                run.stage = "run"
                _run_workers(run)
    except KeyboardInterrupt as exc:
        run.report.interrupt(getattr(exc, "signum", signal.SIGINT), run.stage, {})
    except Exception as exc:  # noqa: BLE001 - a harness bug still gets a report
        log.exception("kvconnect-validate failed")
        run.report.add_check("run", "fail", f"the harness itself failed: "
                                            f"{type(exc).__name__}: {exc}\n"
                                            f"{traceback.format_exc(limit=6)}")
    return _finish(run.report, args, display, started, signals, run.device)


def _preflight(run: _Invocation) -> bool:
    """Sweep stale run folders, resolve the device and transports, check the resources;
    False (with the report's error set) when the run cannot start."""
    cfg, report = run.cfg, run.report
    report.config = cfg.to_json()
    _sweep_stale_run_dirs(report)
    try:
        run.device = device = resolve_device(run.args.device)
        cfg.device, cfg.num_gpus = device.kind, device.num_gpus
        _select_transports(cfg, explicit=run.args.transports is not None)
        report.config = cfg.to_json()
        if device.note:
            run.display.message(device.note)
    except EnvironmentProblem as exc:
        _cannot_run(report, exc)
        return False
    for name, reason in cfg.skipped_transports.items():
        report.add_check(f"transport/{name}", "skip", reason)
    return _resources_suffice(cfg, run.membership, report)


def _run_workers(run: _Invocation) -> None:
    """All workers on this host (forked or spawned), or this process as one member of a
    multi-host run; then the bandwidth floor."""
    cfg, report, display = run.cfg, run.report, run.display
    try:
        if run.membership is None:
            from .coordinator.event_loop import run_local

            run_local(cfg, report, display, run.signals)  # live display starts after fork
        else:
            from .multihost.rendezvous import run_member

            display.start()
            run_member(cfg, run.membership, report, display)
    except EnvironmentProblem as exc:  # the rendezvous store is out of reach
        _cannot_run(report, exc)
    finally:
        display.close()
    report.apply_bandwidth_floor(cfg.min_gbps)


def _cannot_run(report: Report, exc: EnvironmentProblem) -> None:
    """The environment cannot run this (exit 3): record it and say so on stderr."""
    report.environment_error = str(exc)
    print(f"kvconnect-validate: cannot run: {exc}", file=sys.stderr)


def _sweep_stale_run_dirs(report: Report) -> None:
    """Remove run directories left by killed runs of this user, and say so (the run
    directory's own janitor died with them: :mod:`.rundir`)."""
    from .rundir import run_dir_base, sweep_stale

    report.stale_run_dirs = sweep_stale(run_dir_base())
    for path in report.stale_run_dirs:
        print(f"kvconnect-validate: removed {path}, a leftover run folder of a run that was "
              "killed (its owner process is gone)", file=sys.stderr)


def _resources_suffice(cfg: RunConfig, membership: Membership | None, report: Report) -> bool:
    """Check the memory, fds and mappings the run needs before any worker starts; on a
    shortfall set the report's usage (exit 2) or environment (exit 3) error and say so."""
    from .coordinator.launch import launch_method
    from .resources import check_resources

    if membership is None:
        verdict = check_resources(cfg, cfg.num_prefill + cfg.num_decode,
                                  forked=launch_method(cfg) == "fork")
    else:  # one worker: this process
        verdict = check_resources(cfg, 1, forked=True)
    report.resources = verdict.to_json()
    if verdict.exit_code == 0:
        report.add_check("resources", "pass", verdict.message(),
                         data={"needed_host_bytes": verdict.needed_host_bytes})
        return True
    report.add_check("resources", "fail", verdict.message(), data={
        "problems": verdict.to_json()["problems"]})
    if verdict.exit_code == EXIT_USAGE:
        report.usage_error = verdict.message()
    else:
        report.environment_error = verdict.message()
    print(f"kvconnect-validate: cannot run: {verdict.message()}", file=sys.stderr)
    return False


def _usage_error(parser: argparse.ArgumentParser, exc: OptionError) -> int:
    parser.print_usage(sys.stderr)
    print(f"kvconnect-validate: error: {exc}", file=sys.stderr)
    return EXIT_USAGE


def _select_transports(cfg: RunConfig, explicit: bool) -> None:
    """Drop the transports whose spec says they cannot run here (``requires()``): exit 3
    if one was asked for explicitly, else skip it with the reason. An empty
    ``cfg.transports`` means every registered transport."""
    from kvconnect.connectors.registry import get_transport, transport_names

    if not cfg.transports:
        cfg.transports = list(transport_names())
    for name in list(cfg.transports):
        reason = get_transport(name).requires()
        if reason is None:
            continue
        if explicit:
            raise EnvironmentProblem(f"--transports {name} was asked for but {reason}")
        cfg.transports.remove(name)
        cfg.skipped_transports[name] = reason
    if not cfg.transports:
        raise EnvironmentProblem("no transport can run here: "
                                 + "; ".join(cfg.skipped_transports.values()))
    missing = missing_transports(specs_from_config(cfg.faults), cfg.transports)
    if missing:
        skipped = "; ".join(f"{n}: {r}" for n, r in cfg.skipped_transports.items())
        raise EnvironmentProblem("; ".join(missing) + (f" ({skipped})" if skipped else ""))


def _finish(report: Report, args: argparse.Namespace, display: Display, started: float,
            signals: InterruptSignals, device: ResolvedDevice | None) -> int:
    """Describe the environment, print the tables, write --json / --junit; the exit code.
    Runs outside :meth:`InterruptSignals.interruptible`: a signal arriving now is recorded
    in the report, and cuts nothing short."""
    signals.stop_raising()
    # after the workers exist: describe() loads UCX, which fork must not pass on
    report.environment = describe(device, with_gpus=device is not None and device.kind == "cuda")
    if signals.signum is not None:
        report.interrupt(signals.signum, "teardown", {})  # no-op when already recorded
    report.wall_seconds = time.monotonic() - started
    display.final(report)
    for flag, path, write in (("--json", args.json, report.write_json),
                              ("--junit", args.junit, report.write_junit)):
        if path:
            try:
                write(path)
            except OSError as exc:
                print(f"kvconnect-validate: cannot write {flag} {path}: {exc}", file=sys.stderr)
                return max(report.exit_code, 1)
    return report.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
