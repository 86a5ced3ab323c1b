"""Live progress and the final table: rich on a terminal, plain lines otherwise.

Only the coordinator (or the reporting rank) calls these, from one thread.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .report import FAIL, PASS, SKIP, Check, Report, Transfer

_STYLE = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}


class Display:
    """Progress sink. ``live`` picks rich's live table; otherwise one line per event."""

    def __init__(self, live: bool | None = None, stream: TextIO | None = None,
                 quiet: bool = False) -> None:
        self.stream = stream or sys.stdout
        if live is None:
            live = self.stream.isatty()
        self.quiet = quiet
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

    def _line(self, text: str) -> None:
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
        self._row(worker)["phase"] = phase
        if self._live is None:
            self._line(f"{worker}: {phase}")
        self._refresh()

    def check(self, check: Check) -> None:
        row = self._row(check.worker or "coordinator")
        row[check.status] = str(int(row[check.status]) + 1)
        if check.status == FAIL or self._live is None:
            detail = f": {check.detail}" if check.detail else ""
            self._line(f"{check.status.upper():4} {check.worker}/{check.name}{detail}")
        self._refresh()

    def transfer(self, t: Transfer) -> None:
        ok = "verified" if t.verified else "NOT VERIFIED"
        self._line(f"xfer {t.label}: {t.bytes / 2**20:.1f} MiB in {t.seconds * 1e3:.1f} ms "
                   f"= {t.gbps:.2f} GB/s via {t.backend or t.transport}, {ok}")

    def message(self, text: str) -> None:
        self._line(text)

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
        """Print the checks and transfers tables and the verdict."""
        self.close()
        if self._console is not None:
            self._final_rich(report)
        else:
            self._final_plain(report)

    def _final_plain(self, report: Report) -> None:
        out = self.stream
        print("", file=out)
        print("Checks:", file=out)
        width = max((len(f"{c.worker}/{c.name}") for c in report.checks), default=10)
        for c in _grouped(report.checks):
            name = f"{c.worker}/{c.name}"
            print(f"  {c.status.upper():4}  {name:<{width}}  {c.detail}", file=out)
        if report.transfers:
            print("Transfers:", file=out)
            print(f"  {'pair':<22} {'transport':<9} {'round':>5} {'MiB':>8} {'ms':>9} "
                  f"{'GB/s':>8} {'ref GB/s':>8}  {'verified':<8} via", file=out)
            for t in report.transfers:
                print(f"  {t.pair:<22} {t.transport:<9} {t.round:>5} {t.bytes / 2**20:>8.2f} "
                      f"{t.seconds * 1e3:>9.2f} {t.gbps:>8.3f} {_ref(t):>8}  "
                      f"{str(t.verified).lower():<8} {t.backend}", file=out)
        print(report.summary(), file=out, flush=True)

    def _final_rich(self, report: Report) -> None:
        from rich.markup import escape
        from rich.table import Table

        console = self._console
        checks = Table(title="Checks", expand=False)
        for col in ("status", "check", "detail"):
            checks.add_column(col, overflow="fold")
        for c in _grouped(report.checks):
            style = _STYLE[c.status]
            checks.add_row(f"[{style}]{c.status}[/]", escape(f"{c.worker}/{c.name}"),
                           escape(c.detail))
        console.print(checks)
        if report.transfers:
            tr = Table(title="Transfers", expand=False)
            numeric = ("MiB", "ms", "GB/s", "ref GB/s")
            for col in ("pair", "transport", "round", *numeric, "verified", "via"):
                tr.add_column(col, justify="right" if col in numeric else "left",
                              overflow="fold")
            for t in report.transfers:
                ok = "[green]yes[/]" if t.verified else "[bold red]no[/]"
                tr.add_row(t.pair, t.transport, str(t.round), f"{t.bytes / 2**20:.2f}",
                           f"{t.seconds * 1e3:.2f}", f"{t.gbps:.3f}", _ref(t), ok, t.backend)
            console.print(tr)
        style = "bold green" if report.passed else "bold red"
        console.print(f"[{style}]{escape(report.summary())}[/]", highlight=False)


def _grouped(checks: list[Check]) -> list[Check]:
    """Checks grouped by worker (prefills, decodes, then the rest), in arrival order within."""
    def key(c: Check) -> tuple[int, int, str]:
        for order, role in enumerate(("prefill", "decode")):
            if c.worker.startswith(role) and c.worker[len(role):].isdigit():
                return (order, int(c.worker[len(role):]), "")
        return (2, 0, c.worker)

    return sorted(checks, key=key)


def _ref(t: Transfer) -> str:
    """The same-run reference copy's GB/s, or '-' where none was measured."""
    return "-" if t.reference_gbps is None else f"{t.reference_gbps:.3f}"
