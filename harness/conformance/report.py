"""Conformance results as a Markdown table (what docs/conformance.md holds).

Rows are connector x layout; columns the checks (pass / fail / skip), the case's status,
and the evidence: bytes registered vs committed, bytes registered outside committed
memory, the error, or the signal and the step it struck in. Units: MiB where marked.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvconnect.verdicts import ENDED_EARLY, FAIL, INCONCLUSIVE, PASS, SKIP

__all__ = ["CHECK_COLUMNS", "ENGINE_COLUMNS", "engine_evidence", "evidence",
           "render_engine_markdown", "render_markdown", "render_pd_markdown", "summary_counts"]

#: engine-mode table columns (a row has either ``reload`` or ``transfer``)
ENGINE_COLUMNS = ("starts", "tokens", "moves_kv", "sleep_wake")

#: table columns, in order (a case has either transfer or offload_round_trip)
CHECK_COLUMNS = ("register", "committed_only", "block_geometry", "moves_blocks", "sleep_wake")

_MIB = 1024 * 1024


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / _MIB:g}"


def _short(connector: str) -> str:
    return connector.rsplit(":", 1)[-1]


def evidence(r: dict[str, Any]) -> str:
    """One line: what went wrong (or the bytes registered when nothing did)."""
    checks = r.get("checks", {})
    parts = []
    co = checks.get("committed_only")
    if co:
        parts.append(f"registered {_mib(co.get('registered_bytes'))} MiB / committed "
                     f"{_mib(co.get('committed_bytes'))} MiB"
                     + (f", {_mib(co['registered_outside_bytes'])} MiB outside"
                        if co.get("registered_outside_bytes") else ""))
        if co.get("regions_outside"):
            parts.append(f"{co['regions_outside']}/{co['regions']} regions outside")
    geo = checks.get("block_geometry", {})
    if geo.get("status") == FAIL and geo.get("uncovered_kv_bytes_per_block"):
        parts.append(f"{geo['uncovered_kv_bytes_per_block']} KV bytes/block not covered")
    for name in ("transfer", "offload_round_trip"):
        c = checks.get(name, {})
        if c.get("error"):
            parts.append(f"{name}: {c['error'][:90]}")
        elif c.get("mismatched_bytes") or c.get("unreadable_bytes"):
            parts.append(f"{name}: {c.get('mismatched_bytes', 0)} bytes differ, "
                         f"{c.get('unreadable_bytes', 0)} outside committed")
    reg = checks.get("register", {})
    if reg.get("error"):
        parts.append(reg["error"][:160])
    if r.get("status") in ENDED_EARLY:
        parts.append(str(r.get("evidence", r["status"]))[:160])
    if co and co.get("views_reaching_uncommitted"):
        parts.append(f"holds {co['views_reaching_uncommitted']} views reaching uncommitted "
                     f"memory")
    left = checks.get("leftovers", {})
    if left.get("status") == FAIL:
        parts.append(str(left.get("error", "left processes running"))[:160])
    if r.get("stray_output"):
        parts.append(f"wrote {r['stray_output']['bytes']} bytes that are not the kit's to its "
                     f"channel (kept out)")
    if r.get("unchecked"):
        parts.append("not checked: " + ", ".join(r["unchecked"]))
    return "; ".join(parts).replace("|", "/") or "-"


def _cell(r: dict[str, Any], col: str) -> str:
    checks = r.get("checks", {})
    if col == "moves_blocks":
        c = (checks.get("transfer") or checks.get("offload_round_trip")
             or checks.get("moves_blocks"))
    else:
        c = checks.get(col)
    if c is None:
        return "—"
    return str(c.get("status", "?"))


def summary_counts(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """connector -> {status: cases}."""
    out: dict[str, dict[str, int]] = {}
    for r in results:
        d = out.setdefault(_short(r["connector"]), {})
        d[r["status"]] = d.get(r["status"], 0) + 1
    return out


def _section(title: str | None, preamble: str, header: Sequence[str],
             rows: Iterable[Sequence[str]], intro: Sequence[str] = ()) -> str:
    """A Markdown section: ``## title`` (none when None), ``preamble``, ``intro`` lines and
    a table of ``rows`` under ``header``."""
    lines = [] if title is None else [f"## {title}", ""]
    if preamble:
        lines += [preamble.rstrip(), ""]
    lines += [*intro, "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def render_markdown(results: Sequence[dict[str, Any]], *, title: str,
                    preamble: str = "") -> str:
    """A Markdown section: ``title``, ``preamble``, a per-connector summary and the table."""
    summary = [f"- **{name}**: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
               for name, counts in summary_counts(results).items()]
    return _section(title, preamble, ["connector", "layout", "status", *CHECK_COLUMNS,
                                      "evidence"],
                    ([_short(r["connector"]), r["layout"], f"**{r['status']}**",
                      *(_cell(r, c) for c in CHECK_COLUMNS), evidence(r)] for r in results),
                    intro=[*summary, ""])


def render_pd_markdown(results: Sequence[dict[str, Any]], *, title: str, preamble: str = ""
                       ) -> str:
    """1P1D results (:func:`kvconnect.harness.conformance.pd.run_pd`) as a Markdown section."""
    def cells(r: dict[str, Any]) -> list[str]:
        errs = r.get("load_error_blocks")
        return [_short(r["connector"]), r["layout"], f"**{r['status']}**",
                str(r.get("received", "—")), str(r.get("byte_exact", "—")),
                "—" if errs is None else f"{len(errs)} of {len(r.get('local_ids', []))}",
                str(r.get("prefill_saw_completion", "—")), str(r.get("seconds", "—")),
                str(r.get("evidence", "-")).replace("|", "/")[:160]]

    return _section(title, preamble, ["connector", "layout", "status", "received", "byte-exact",
                                      "blocks with load errors (vLLM)",
                                      "prefill saw completion", "seconds", "evidence"],
                    map(cells, results))


def engine_evidence(r: dict[str, Any]) -> str:
    """One line for an engine-mode row: what went wrong, or what moved over which cache."""
    checks = r.get("checks", {})
    parts = []
    if r.get("evidence"):
        parts.append(str(r["evidence"])[:320])
    moved = checks.get("transfer") or checks.get("reload") or {}
    if r.get("status") == INCONCLUSIVE:  # the evidence already says why
        moved = {}
    if moved.get("status") == PASS and "control_zeroed_bytes" in moved:
        parts.append(f"consumer's tokens equal the reference; zeroing "
                     f"{moved['control_zeroed_bytes']} bytes of the producer's KV changed the "
                     f"control prompt's tokens (the consumer read it)")
    elif moved.get("status") == PASS:
        parts.append(f"{moved.get('num_cached_tokens')} prompt tokens from the connector, "
                     f"greedy tokens equal the reference")
    elif moved.get("status") in (FAIL, SKIP):
        parts.append(str(moved.get("reason") or f"tokens {moved.get('tokens')} vs reference "
                                                  f"{moved.get('reference')}")[:200])
    ext = r.get("extent") or {}
    if ext.get("reserved_bytes") and r.get("cache") == "extensible":
        parts.append(f"reserved {ext['reserved_bytes'] / 2**30:.1f} GiB, committed "
                     f"{ext['committed_bytes'] / 2**30:.2f} GiB ({ext.get('handle_type')})")
    sw = checks.get("sleep_wake", {})
    if sw.get("status") == SKIP and r.get("mode") == "reload":
        parts.append(f"sleep/wake not checked: {sw.get('reason')}")
    return "; ".join(parts).replace("|", "/") or "-"


def _engine_cell(r: dict[str, Any], col: str) -> str:
    checks = r.get("checks", {})
    c = (checks.get("transfer") or checks.get("reload")) if col == "moves_kv" else checks.get(col)
    return "—" if c is None else str(c.get("status", "?"))


def render_engine_markdown(results: Sequence[dict[str, Any]], *, title: str | None,
                           preamble: str = "") -> str:
    """Engine-mode rows (:func:`kvconnect.harness.conformance.engine.run_engine_conformance`)
    as a Markdown section: connector x cache (no heading when ``title`` is None)."""
    return _section(title or None, preamble,
                    ["connector", "cache", "mode", "status", *ENGINE_COLUMNS, "seconds",
                     "evidence"],
                    ([_short(r["connector"]), r["cache"], r.get("mode", "?"),
                      f"**{r['status']}**", *(_engine_cell(r, c) for c in ENGINE_COLUMNS),
                      str(r.get("seconds", "—")), engine_evidence(r)] for r in results))
