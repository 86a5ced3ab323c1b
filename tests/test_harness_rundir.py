"""A run's private directory: owner record, removal on exit, and the sweep of directories
left by killed runs (only this uid's, only when the owner is gone)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from kvconnect.harness import rundir
from kvconnect.harness.rundir import OWNER_FILE, Owner, run_dir, sweep_stale


def _dead_pid() -> int:
    """The pid of a process that ran and was reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _plant(base: Path, name: str, owner: dict | str | None) -> Path:
    d = base / name
    d.mkdir(mode=0o700)
    (d / "coord.sock.log").write_text("left over")
    if owner is not None:
        (d / OWNER_FILE).write_text(owner if isinstance(owner, str) else json.dumps(owner))
    return d


def test_sweep_removes_only_this_uids_directories_whose_owner_is_gone(tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    me = Owner.this_process()
    dead = {"pid": _dead_pid(), "start_ticks": me.start_ticks, "boot_id": me.boot_id}
    stale = _plant(base, "kvv-dead", dead)
    reused = _plant(base, "kvv-reused", {**asdict(me), "start_ticks": me.start_ticks + 1})
    old_boot = _plant(base, "kvv-oldboot", {**asdict(me), "boot_id": "another-boot"})
    live = _plant(base, "kvv-live", asdict(me))
    unowned = _plant(base, "kvv-norecord", None)
    malformed = _plant(base, "kvv-malformed", "{not json")
    other_name = _plant(base, "other-dead", dead)
    elsewhere = _plant(tmp_path, "target", dead)
    (base / "kvv-link").symlink_to(elsewhere)
    removed = sweep_stale(str(base))
    assert sorted(removed) == sorted(str(p) for p in (stale, reused, old_boot))
    for kept in (live, unowned, malformed, other_name, elsewhere, base / "kvv-link"):
        assert kept.exists()


@pytest.mark.skipif(os.getuid() != 0, reason="making another user's directory needs root")
def test_sweep_never_touches_another_users_directory(tmp_path: Path) -> None:
    me = Owner.this_process()
    theirs = _plant(tmp_path, "kvv-theirs", {"pid": _dead_pid(), "start_ticks": 1,
                                             "boot_id": me.boot_id})
    os.chown(theirs, 65534, 65534)
    assert sweep_stale(str(tmp_path)) == []
    assert theirs.exists()


@pytest.fixture
def short_base() -> Iterator[Path]:
    """A TMPDIR short enough for socket paths (pytest's, under xdist, is not: run_dir would
    fall back to /tmp)."""
    base = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_run_dir_records_its_owner_sweeps_and_removes_itself(
        short_base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = short_base
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    assert rundir.run_dir_base() == str(base)
    stale = _plant(base, "kvv-stale", {"pid": _dead_pid(), "start_ticks": 1,
                                       "boot_id": Owner.this_process().boot_id})
    with run_dir() as path:
        assert not stale.exists()
        assert Owner.read(path) == Owner.this_process()
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o700)
        assert len(rundir.janitor_fds()) == 1
    assert list(base.iterdir()) == [] and rundir.janitor_fds() == []
