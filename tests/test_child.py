"""kvconnect.child: the one way the harness and the conformance kit run a child process.

Real processes, real pipes: a child's lines arrive within a deadline, a death by signal is
named, and ending a child in its own process group takes what it left running with it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvconnect.child import Child, LineReader, LineWriter, exit_signal_name, exit_text, log_tail


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_exit_statuses_in_words() -> None:
    assert exit_text(None) == "still running" and exit_text(0) == "exit code 0"
    assert exit_text(3) == "exit code 3" and exit_text(-9) == "killed by SIGKILL"
    assert exit_signal_name(-11) == "SIGSEGV" and exit_signal_name(1) is None
    assert exit_signal_name(-99) == "signal 99"


def test_a_forked_child_sends_json_lines_and_its_exit_code(tmp_path: Path) -> None:
    rfd, wfd = os.pipe()

    def body() -> int:
        out = LineWriter(wfd, b"tag ")
        out.send({"stage": "one"})
        os.write(1, b"to the log\n")  # fd 1 (pytest replaces sys.stdout)
        return 3

    with Child.fork(body, log_path=str(tmp_path / "log"), own_group=True,
                    close_fds=(rfd,)) as child:
        os.close(wfd)
        reader = LineReader(rfd)
        assert reader.next_line(time.monotonic() + 30) == b'tag {"stage": "one"}'
        assert reader.next_line(time.monotonic() + 30) is None and reader.eof
        os.close(rfd)
        assert child.end(10.0) == 3
    assert log_tail(str(tmp_path / "log"), lines=1) == "to the log"


def test_an_exception_in_the_child_is_sent_as_an_error_line(tmp_path: Path) -> None:
    rfd, wfd = os.pipe()

    def body() -> int:
        return LineWriter(wfd).run(lambda: 1 / 0)

    child = Child.fork(body, log_path=str(tmp_path / "log"), own_group=False,
                       close_fds=(rfd,))
    os.close(wfd)
    try:
        msg = LineReader(rfd).json(time.monotonic() + 30)
    finally:
        os.close(rfd)
        code = child.end(10.0)
    assert code == 1 and "ZeroDivisionError" in msg["error"]


def test_a_death_by_signal_is_named(tmp_path: Path) -> None:
    def body() -> int:
        faulthandler.disable()  # pytest's handler would print to the terminal, not the log
        os.kill(os.getpid(), signal.SIGSEGV)
        return 0

    code = Child.fork(body, log_path=str(tmp_path / "log"), own_group=True).end(10.0)
    assert exit_signal_name(code) == "SIGSEGV" and exit_text(code) == "killed by SIGSEGV"


def test_the_reader_keeps_its_deadline_with_a_silent_child(tmp_path: Path) -> None:
    rfd, wfd = os.pipe()
    child = Child.fork(lambda: time.sleep(60) or 0, log_path=None, own_group=True,
                       close_fds=(rfd,))
    try:
        t0 = time.monotonic()
        assert LineReader(rfd).next_line(t0 + 0.3) is None
        assert 0.25 < time.monotonic() - t0 < 5
    finally:
        os.close(rfd)
        os.close(wfd)
        code = child.end()
    assert code == -signal.SIGKILL


def test_ending_a_child_kills_what_it_left_in_its_group(tmp_path: Path) -> None:
    """The child starts a grandchild and exits; end() still kills the grandchild (the group
    is signalled while its leader is an unreaped zombie)."""
    rfd, wfd = os.pipe()

    def body() -> int:
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        LineWriter(wfd).send({"pid": grandchild.pid})
        return 0

    child = Child.fork(body, log_path=None, own_group=True, close_fds=(rfd,))
    os.close(wfd)
    try:
        grandchild = LineReader(rfd).json(time.monotonic() + 30)["pid"]
    finally:
        os.close(rfd)
    assert child.wait_exit(30) and _alive(grandchild)
    assert child.end() == 0
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_spawned_child_in_its_own_session_gets_sigterm_first(tmp_path: Path) -> None:
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    log = tmp_path / "log"
    child = Child.spawn([sys.executable, "-c", script], log_path=str(log), own_group=True)
    deadline = time.monotonic() + 30
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not child.wait_exit(0.1)
    assert child.end(term_grace_s=10.0) == 7
    assert os.getpgid(0) != child.pid  # never our own group
    child.kill()  # reaped: nothing is signalled any more
    assert child.end() == 7


def test_wait_times_out_like_popen() -> None:
    child = Child.fork(lambda: time.sleep(60) or 0, log_path=None, own_group=False)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.1)
        assert child.poll() is None
    finally:
        child.kill()
        assert child.wait(10) == -signal.SIGKILL


def test_an_endless_line_goes_to_the_overflow_handler() -> None:
    rfd, wfd = os.pipe()
    seen: list[int] = []
    try:
        reader = LineReader(rfd, max_line=1000, on_overflow=lambda b: seen.append(len(b)) or b"")
        os.write(wfd, b"x" * 5000)
        assert reader.next_line(time.monotonic() + 0.2) is None and seen == [5000]
        os.write(wfd, b"tail\nnext\n")
        deadline = time.monotonic() + 10
        assert reader.next_line(deadline) == b"tail" and reader.next_line(deadline) == b"next"
        default = LineReader(rfd, max_line=10)
        os.write(wfd, b"y" * 100)
        os.close(wfd)
        wfd = -1
        assert default.next_line(deadline) is None and default.dropped_bytes == 100
        assert default.eof and default.rest() == b""
    finally:
        os.close(rfd)
        if wfd >= 0:
            os.close(wfd)
