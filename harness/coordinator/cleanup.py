"""After a local run: did everything it started or opened go away? The ``cleanup`` check.

What the coordinator checks, once every worker was reaped and the run directory removed
(each item is recorded in the report's ``cleanup`` section, whatever the verdict):

- ``processes``: no process of the run is left: every worker pid (replaced ones and unused
  standbys included) is gone, and the coordinator has no child left but those it had before
  (it is a child subreaper during the run, so a worker's own children would land there);
- ``run_dir``: the run's private directory (sockets, logs) was removed;
- ``temp_dirs``: no new ``kvv-*`` / ``kvconnect-*`` entry of this user in the temporary
  directory, unless a live process of another run owns it;
- ``fds``: the coordinator holds no fd it did not hold before the run (sockets included);
- ``kv_mappings``: the coordinator maps no KV memory;
- ``workers``: each worker that lived to the end released its fds, sockets and KV mappings
  (their ``resources/released`` checks); a killed worker's were released by the kernel;
- ``device_memory``: on CUDA, no worker pid still holds device memory (``nvidia-smi``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvconnect.leftovers import children
from kvconnect.verdicts import FAIL, PASS, Check

from ..footprint import Footprint
from ..report import Report
from ..rundir import Owner, process_start_ticks, run_dir_base

#: prefixes of what the toolkit creates in the temporary directory
TEMP_PREFIXES = ("kvv-", "kvconnect-", ".kvconnect-")
#: toolkit entries a validation run never leaves behind by accident: worker logs kept on
#: purpose (KVCONNECT_KEEP_WORKER_LOGS) and the conformance kit's directories (a kit running
#: beside this run, e.g. another test suite's, is not this run's leak)
NOT_THIS_RUN = ("kvconnect-validate-logs-", "kvconnect-conformance-", "kvconnect-pd-",
                "kvconnect-engine-conformance-")
#: seconds nvidia-smi gets to answer
_SMI_TIMEOUT_S = 20.0


def processes_mentioning(text: str) -> list[int]:
    """Pids of this host whose command line contains ``text`` (a run's forked workers share
    their coordinator's command line, so a run's report path names all of them)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@dataclass
class Baseline:
    """What the coordinator held before the run (see :func:`take_baseline`)."""

    #: fds (with their targets) and KV mappings
    footprint: Footprint
    children: dict[int, str]
    temp_entries: set[str]
    temp_base: str = ""


def take_baseline() -> Baseline:
    base = run_dir_base()
    try:
        entries = set(os.listdir(base))
    except OSError:
        entries = set()
    return Baseline(Footprint.take(), children(), entries, base)


@dataclass
class ProcessRecord:
    """A process the run started: a worker (any incarnation) or a standby."""

    name: str
    pid: int
    start_ticks: int | None


def check_cleanup(report: Report, before: Baseline, processes: Sequence[ProcessRecord],
                  run_dir: str, device: str) -> Check:
    """Add the ``cleanup`` check (and the report's ``cleanup`` section); see the module
    docstring for what is checked."""
    problems: list[str] = []
    found: dict[str, Any] = {}

    left = [f"{p.name} (pid {p.pid})" for p in processes
            if p.start_ticks is not None and process_start_ticks(p.pid) == p.start_ticks]
    extra_children = {pid: what for pid, what in children().items()
                      if pid not in before.children}
    found["processes"] = {"checked": [p.pid for p in processes], "left": left,
                          "children_left": [f"pid {pid}: {what}"
                                            for pid, what in sorted(extra_children.items())]}
    if left:
        problems.append("processes still present: " + ", ".join(left))
    if extra_children:
        problems.append("the coordinator still has children: "
                        + ", ".join(found["processes"]["children_left"]))

    removed = not (run_dir and os.path.exists(run_dir))
    found["run_dir"] = {"path": run_dir, "removed": removed}
    if not removed:
        problems.append(f"run directory {run_dir} still exists")

    temp_left = _new_temp_entries(before)
    found["temp_dirs"] = {"base": before.temp_base, "left": temp_left}
    if temp_left:
        problems.append(f"left in {before.temp_base}: {temp_left[:8]}")

    was, now = before.footprint, Footprint.take()
    leaked = sorted(set(now.fds) - set(was.fds))
    found["fds"] = {"before": len(was.fds), "leaked": [now.fds[fd] for fd in leaked][:8]}
    if leaked:
        problems.append(f"fds left open: {found['fds']['leaked']}")

    found["kv_mappings"] = {"before": was.kv_mappings, "after": now.kv_mappings}
    if now.kv_mappings > was.kv_mappings:
        problems.append(f"the coordinator maps {now.kv_mappings - was.kv_mappings} KV chunks")

    found["workers"] = _worker_releases(report, processes)
    bad = {w: v for w, v in found["workers"].items() if v == "leaked"}
    if bad:
        problems.append(f"workers kept resources after releasing everything: {sorted(bad)} "
                        "(see their resources/released checks)")

    found["device_memory"] = _device_memory(device, [p.pid for p in processes])
    if found["device_memory"].get("left"):
        problems.append(f"processes still hold device memory: {found['device_memory']['left']}")

    report.cleanup = found
    ok_text = (f"{len(processes)} worker processes gone and reaped, no child left, run "
               f"directory removed, no temp entry, fd or KV mapping left; workers: "
               + ", ".join(f"{w} {v}" for w, v in sorted(found["workers"].items())))
    return report.add_check("cleanup", FAIL if problems else PASS,
                            "; ".join(problems) if problems else ok_text, data=found)


def _new_temp_entries(before: Baseline) -> list[str]:
    """Toolkit entries of this uid that appeared in the temp base during the run and are
    still there, except run directories a live process (another run) owns."""
    try:
        now = set(os.listdir(before.temp_base))
    except OSError:
        return []
    uid = os.getuid()
    out = []
    for name in sorted(now - before.temp_entries):
        if not name.startswith(TEMP_PREFIXES) or name.startswith(NOT_THIS_RUN):
            continue
        path = os.path.join(before.temp_base, name)
        try:
            if os.lstat(path).st_uid != uid:
                continue
        except OSError:
            continue  # gone meanwhile
        owner = Owner.read(path) if os.path.isdir(path) else None
        if owner is not None and owner.pid != os.getpid() and owner.alive():
            continue  # another run's directory, in use
        out.append(path)
    return out


def _worker_releases(report: Report, processes: Sequence[ProcessRecord]) -> dict[str, str]:
    """Per worker process: ``released``, ``leaked`` (its resources/released check failed),
    or ``ended without a report`` (killed: the kernel released what it held)."""
    verdicts: dict[str, str] = {}
    for c in report.checks:
        if c.name == "resources/released":
            incarnation = c.data.get("incarnation", 1)
            name = c.worker if incarnation == 1 else f"{c.worker}.{incarnation}"
            verdicts[name] = "released" if c.status == PASS else "leaked"
    names = {p.name for p in processes}
    return {n: verdicts.get(n, "ended without a report (the kernel released its resources)")
            for n in sorted(names)}


def _device_memory(device: str, pids: list[int]) -> dict[str, Any]:
    """On CUDA: the run's pids nvidia-smi still lists with device memory."""
    if device != "cuda":
        return {"checked": False, "why": "host backend: KV memory is memfd mappings, checked "
                                         "per worker and gone with its process"}
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"checked": False, "why": "nvidia-smi not found"}
    try:
        out = subprocess.run([smi, "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"checked": False, "why": f"nvidia-smi failed: {exc}"}
    if out.returncode != 0:
        return {"checked": False, "why": f"nvidia-smi exited {out.returncode}"}
    ours = set(pids)
    left = []
    for line in out.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if parts and parts[0].isdigit() and int(parts[0]) in ours:
            left.append({"pid": int(parts[0]), "used_mib": parts[1] if len(parts) > 1 else ""})
    return {"checked": True, "method": "nvidia-smi --query-compute-apps", "left": left}
