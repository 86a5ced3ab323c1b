"""Live progress and the final summary: rich on a terminal, plain lines otherwise.

What is printed (issue 16: a plain 1P1D printed ~130 lines, every check twice):

- by default, a **live view** (on a terminal: rich's table of workers, phases and counts; in
  plain mode: a line per failure as it happens, per note, per sweep size and per worker
  that finishes), then the **summary**: failures first with their details, the skipped
  checks (one line per kind), the transfers, the ``--sizes`` sweep, and the verdict;
- with ``verbose`` (``-v``): everything, as it happens (every phase, check and transfer)
  and every check in the summary;
- with ``quiet`` (``-q``): the summary only.

Only the coordinator (or the reporting rank) calls these, from one thread.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from kvconnect.verdicts import FAIL, PASS, SKIP, Check

from .report import Report, SweepPoint, Transfer, sweep_averages

_STYLE = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}


class Display:
    """Progress sink. ``live`` picks rich's live table; otherwise one line per event."""

    def __init__(self, live: bool | None = None, stream: TextIO | None = None,
                 quiet: bool = False, verbose: bool = False) -> None:
        self.stream = stream or sys.stdout
        if live is None:
            live = self.stream.isatty()
        self.quiet = quiet
        self.verbose = verbose and not quiet
        self._t0 = time.monotonic()
        self._rows: dict[str, dict[str, str]] = {}
        self._live = None
        self._started = False
        self._console = None
        if live and not quiet:
            try:
                from rich.console import Console
                from rich.live import Live

                self._console = Console(file=self.stream)
                self._live = Live(self._table(), console=self._console, refresh_per_second=8,
                                  transient=True)
            except ImportError:  # rich is a dependency; degrade anyway
                self._live = None

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Start the live view (a thread): call it only after worker processes are forked."""
        if self._live is not None and not self._started:
            self._started = True
            self._live.start()

    def __enter__(self) -> Display:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    # -- events -------------------------------------------------------------------
    def _elapsed(self) -> str:
        return f"{time.monotonic() - self._t0:6.2f}s"

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(f"[{self._elapsed()}] {text}", file=self.stream, flush=True)

    def _row(self, worker: str) -> dict[str, str]:
        return self._rows.setdefault(worker, {"phase": "starting", "pid": "", "device": "",
                                              "pass": "0", "fail": "0", "skip": "0"})

    def worker(self, worker: str, pid: int | str = "", device: str = "") -> None:
        row = self._row(worker)
        row["pid"], row["device"] = str(pid), device
        self._refresh()

    def phase(self, worker: str, phase: str) -> None:
        row = self._row(worker)
        row["phase"] = phase
        if self._live is None and (self.verbose or phase == "done"):
            tally = (f" ({row['pass']} passed, {row['fail']} failed, {row['skip']} skipped)"
                     if phase == "done" and not self.verbose else "")
            self.message(f"{worker}: {phase}{tally}")
        self._refresh()

    def check(self, check: Check) -> None:
        row = self._row(check.worker or "coordinator")
        row[check.status] = str(int(row[check.status]) + 1)
        if check.status == FAIL or (self._live is None and self.verbose):
            detail = f": {check.detail}" if check.detail else ""
            self.message(f"{check.status.upper():4} {check.worker}/{check.name}{detail}")
        self._refresh()

    def transfer(self, t: Transfer) -> None:
        if not self.verbose and t.verified:
            return
        ok = "verified" if t.verified else "NOT VERIFIED"
        self.message(f"xfer {t.label}: {t.bytes / 2**20:.1f} MiB in {t.seconds * 1e3:.1f} ms "
                     f"= {t.gbps:.2f} GB/s via {t.backend or t.transport}, {ok}")

    def sweep(self, p: SweepPoint) -> None:
        if self._live is None:
            self.message(f"sweep {p.pair} {p.transport} {p.bytes:>12} B: avg "
                         f"{p.avg_seconds * 1e6:.1f} us = {p.avg_gbps:.3f} GB/s (peak "
                         f"{p.peak_gbps:.3f}), {p.iters} iters"
                         + ("" if p.verified else ", NOT VERIFIED"))

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._table())

    def _table(self):  # -> rich.table.Table
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=f"kvconnect-validate  {self._elapsed()}", expand=False)
        for col in ("worker", "pid", "device", "phase", "pass", "fail", "skip"):
            table.add_column(col)
        for name, row in self._rows.items():
            fail = row["fail"]
            table.add_row(escape(name), row["pid"], row["device"], escape(row["phase"]),
                          row["pass"], f"[bold red]{fail}[/]" if fail != "0" else fail,
                          row["skip"])
        return table

    # -- final ------------------------------------------------------------------------
    def final(self, report: Report) -> None:
        """Print the summary (see the module docstring) and the verdict."""
        self.close()
        lines = summary_lines(report, verbose=self.verbose)
        if self._console is not None:
            from rich.markup import escape

            for style, text in lines:
                self._console.print(f"[{style}]{escape(text)}[/]" if style else escape(text),
                                    highlight=False, soft_wrap=True)
        else:
            for _, text in lines:
                print(text, file=self.stream)
            self.stream.flush()


def summary_lines(report: Report, verbose: bool = False) -> list[tuple[str, str]]:
    """The summary as ``(rich style, text)`` lines: failures first, then the skipped checks
    (every check with ``verbose``), transfers, the sweep and the verdict."""
    out: list[tuple[str, str]] = []
    failed = [c for c in report.checks if c.status == FAIL]
    if failed:
        out.append((_STYLE[FAIL], f"Failures ({len(failed)}):"))
        for c in _grouped(failed):
            out.append((_STYLE[FAIL], f"  FAIL  {c.worker}/{c.name}  {c.detail}"))
    if verbose:
        out.append(("", "Checks:"))
        width = max((len(f"{c.worker}/{c.name}") for c in report.checks), default=10)
        for c in _grouped([c for c in report.checks if c.status != FAIL]):
            out.append((_STYLE[c.status],
                        f"  {c.status.upper():4}  {c.worker + '/' + c.name:<{width}}  "
                        f"{c.detail}"))
    else:
        for name, (workers, detail) in _skips(report.checks).items():
            out.append((_STYLE[SKIP], f"  SKIP  {name} ({', '.join(workers)}): {detail}"))
    if report.transfers:
        out.append(("", "Transfers:"))
        out.append(("", f"  {'pair':<22} {'transport':<9} {'round':>5} {'MiB':>8} {'ms':>9} "
                        f"{'GB/s':>8} {'ref GB/s':>8}  {'verified':<8} via"))
        for t in report.transfers:
            out.append(("" if t.verified else _STYLE[FAIL],
                        f"  {t.pair:<22} {t.transport:<9} {t.round:>5} "
                        f"{t.bytes / 2**20:>8.2f} {t.seconds * 1e3:>9.2f} {t.gbps:>8.3f} "
                        f"{_ref(t):>8}  {str(t.verified).lower():<8} {t.backend}"))
    out.extend(sweep_lines(report.sweep))
    if not verbose:
        counts = report.counts()
        out.append(("", f"Checks: {counts[PASS]} passed, {counts[FAIL]} failed, "
                        f"{counts[SKIP]} skipped "
                        "(-v lists every check)"))
    out.append(("bold green" if report.passed else "bold red", report.summary()))
    return out


def sweep_lines(points: list[SweepPoint]) -> list[tuple[str, str]]:
    """The ``--sizes`` table in nccl-tests' shape, and one closing average line per
    transport."""
    if not points:
        return []
    out = [("", "Sweep (per fetch: warm-up untimed, then timed iterations):"),
           ("", f"#  {'pair':<20} {'transport':<9} {'size(B)':>12} {'blocks':>7} "
                f"{'iters':>5} {'avg(us)':>11} {'min(us)':>11} {'max(us)':>11} "
                f"{'avg GB/s':>9} {'peak GB/s':>9} {'ref GB/s':>9}  verified")]
    for p in sorted(points, key=lambda p: (p.pair, p.transport, p.bytes)):
        out.append(("" if p.verified else _STYLE[FAIL],
                    f"   {p.pair:<20} {p.transport:<9} {p.bytes:>12} {p.blocks:>7} "
                    f"{p.iters:>5} {p.avg_seconds * 1e6:>11.1f} {p.min_seconds * 1e6:>11.1f} "
                    f"{p.max_seconds * 1e6:>11.1f} {p.avg_gbps:>9.3f} {p.peak_gbps:>9.3f} "
                    f"{_ref(p):>9}  {str(p.verified).lower()}"))
    for transport, gbps in sweep_averages(points).items():
        sizes = len({p.bytes for p in points if p.transport == transport})
        out.append(("bold", f"# Avg bandwidth {transport}: {gbps:.3f} GB/s (mean of the "
                            f"per-size averages over {sizes} sizes)"))
    return out


def _skips(checks: list[Check]) -> dict[str, tuple[list[str], str]]:
    """Skipped checks by name: the workers that skipped it and the first one's reason."""
    out: dict[str, tuple[list[str], str]] = {}
    for c in checks:
        if c.status == SKIP:
            workers, _ = out.setdefault(c.name, ([], c.detail))
            workers.append(c.worker)
    return out


def _grouped(checks: list[Check]) -> list[Check]:
    """Checks grouped by worker (prefills, decodes, then the rest), in arrival order within."""
    def key(c: Check) -> tuple[int, int, str]:
        for order, role in enumerate(("prefill", "decode")):
            if c.worker.startswith(role) and c.worker[len(role):].isdigit():
                return (order, int(c.worker[len(role):]), "")
        return (2, 0, c.worker)

    return sorted(checks, key=key)


def _ref(t: Transfer | SweepPoint) -> str:
    """The same-run reference copy's GB/s, or '-' where none was measured."""
    return "-" if t.reference_gbps is None else f"{t.reference_gbps:.3f}"
