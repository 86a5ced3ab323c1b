"""Where kvconnect-validate's output goes (issue 16, defects 1-3): report files through links,
FIFOs and devices, a 300-byte file name refused before the run, and stdout piped to ``head``,
closed or full without losing the report."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvconnect.harness.report import Report

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
#: a quick, real run: one layer, eight blocks, ipc only
SMALL = ["--device", "host", "--transports", "ipc", "--num-layers", "1", "--num-blocks", "8"]


def _report() -> Report:
    r = Report(config={"num_prefill": 1})
    r.add_check("kv_cache/allocate", "pass", "ok", worker="prefill0")
    return r


def test_a_report_through_a_symlink_keeps_the_link_and_replaces_its_target(
        tmp_path: Path) -> None:
    """A report path that is a symlink: the link stays, its target gets the report (before:
    the link was replaced by a regular file)."""
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    _report().write_json(str(link))
    assert link.is_symlink(), "the link was replaced by a regular file"
    assert json.loads(target.read_text())["passed"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]


def test_a_report_to_a_fifo_is_written_through_and_the_fifo_stays(tmp_path: Path) -> None:
    """A named pipe with a reader gets the report through it and stays a FIFO (before: it
    was replaced by a regular file)."""
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        deadline = time.monotonic() + 30
        data = b""
        try:
            while time.monotonic() < deadline:
                try:
                    chunk = os.read(fd, 1 << 16)
                except BlockingIOError:
                    time.sleep(0.01)
                    continue
                if not chunk and data:
                    break
                data += chunk
                if not chunk:
                    time.sleep(0.01)
        finally:
            os.close(fd)
        got.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.1)  # the reader has the FIFO open
    _report().write_json(str(fifo))
    reader.join(timeout=30)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert got and json.loads(got[0])["passed"] is True


def test_a_character_device_is_written_through_not_replaced(tmp_path: Path) -> None:
    """A copy of /dev/null (needs CAP_MKNOD): before the fix it became a regular file."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod needs CAP_MKNOD")
    _report().write_json(str(node))
    _report().write_junit(str(node))
    assert stat.S_ISCHR(os.stat(node).st_mode)
    assert os.stat(node).st_rdev == os.makedev(1, 3)


def test_dev_null_is_accepted_and_written_through() -> None:
    """``--json /dev/null`` passes the pre-check and leaves /dev/null a device (as root,
    before the fix, it would have replaced the system's /dev/null)."""
    from kvconnect.harness.report_files import check_report_path, writes_through

    check_report_path("--json", "/dev/null")
    assert writes_through(os.stat("/dev/null"))
    _report().write_json("/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_unusable_report_paths_exit_2_before_the_run(tmp_path: Path,
                                                     run_validate_cli: Any) -> None:
    """A 300-byte name passed the old pre-check, ran the whole run, then failed to write
    (exit 1). Sockets and block devices cannot take a report; a link loop has no target."""
    import socket

    long_name = tmp_path / ("r" * 300 + ".json")
    sock_path = tmp_path / "s.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock_path))
    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    try:
        for argv, message in (
                (["--json", str(long_name)], "File name too long"),
                (["--junit", str(sock_path)], "is a socket"),
                (["--json", str(loop)], "Too many levels of symbolic links"),
                (["--json", str(tmp_path / "a.json"), "--junit",
                  str(tmp_path / "." / "a.json")], "name the same file")):
            t0 = time.monotonic()
            code, text = run_validate_cli([*SMALL, *argv, "-q"])
            assert code == 2, (argv, text)
            assert message in text, text
            assert time.monotonic() - t0 < 5, "the run went ahead before the path was refused"
    finally:
        listener.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop.json", "s.sock"]


@pytest.fixture
def short_tmp() -> Any:
    """A private TMPDIR short enough for Unix socket paths: other runs' entries in /tmp are
    never taken for this run's leftovers."""
    path = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run_shell(tmp_path: Path, tail: str, tmpdir: str) -> tuple[int, str]:
    """Run the console script under bash followed by ``tail`` (a redirection such as
    ``>&-`` or a pipe such as ``| head -1``): ``(exit code of kvconnect-validate, stderr)``."""
    out = tmp_path / "r.json"
    argv = " ".join([str(VALIDATE), *SMALL, "--plain", "--json", str(out)])
    script = f"{argv} {tail}; echo \"rc=${{PIPESTATUS[0]}}\" >&2"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": tmpdir}, timeout=600)
    rc = int(proc.stderr.strip().splitlines()[-1].removeprefix("rc="))
    return rc, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("tail", ["| head -1", "| true", ">&-", ">/dev/full"],
                         ids=["head-1", "reader-gone", "stdout-closed", "dev-full"])
def test_the_report_is_written_whatever_happens_to_stdout(tmp_path: Path, tail: str,
                                                          short_tmp: str) -> None:
    """Before: a BrokenPipeError traceback and no report (``| head -1``), an AttributeError
    on ``flush`` and a good run reported failed (``>&-``), no report (``>/dev/full``)."""
    rc, err = _run_shell(tmp_path, tail, short_tmp)
    report = json.loads((tmp_path / "r.json").read_text())
    failed = [(c["worker"], c["name"], c["detail"][:300]) for c in report["checks"]
              if c["status"] == "fail"]
    assert report["passed"] is True, (failed, err[-3000:])
    assert rc == 0, err[-3000:]  # the run's own verdict: a lost stdout fails nothing
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    if tail == ">/dev/full":
        assert "stdout: No space left on device" in err
    else:
        assert err.strip().splitlines() == [f"rc={rc}"], err  # quiet: nothing but our echo


@pytest.mark.slow
def test_json_to_dev_stdout_lands_after_the_summary(tmp_path: Path, short_tmp: str) -> None:
    """``--json /dev/stdout > out.txt`` appends the report to our own stdout (the file is
    not replaced: the summary printed before it stays)."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.run([str(VALIDATE), *SMALL, "--json", "/dev/stdout", "-q"],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=600,
                              env={**os.environ, "TMPDIR": short_tmp})
    text = out.read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary, _, doc = text.partition("\n{")
    assert "PASSED" in summary
    assert json.loads("{" + doc)["passed"] is True
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
