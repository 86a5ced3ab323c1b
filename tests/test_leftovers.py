"""kvconnect.leftovers: what a child leaves running is found, ended and named (real
processes: a daemon that left the child's session, a process that left its group)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvconnect.child import Child
from kvconnect.leftovers import become_subreaper, children, end_leftovers, is_subreaper

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def subreaper() -> Iterator[None]:
    was = is_subreaper()
    assert become_subreaper(True) and is_subreaper()
    try:
        yield
    finally:
        if not was:
            become_subreaper(False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _daemonize(w: int) -> int:
    """The body of a forked child: fork, setsid, fork a daemon that sends its pid down ``w``
    and sleeps a minute; the intermediate leaves at once."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            time.sleep(60)
        os._exit(0)
    os.waitpid(pid, 0)
    return 0


def test_a_daemon_in_a_session_of_its_own_is_adopted_found_and_ended(subreaper: None) -> None:
    unrelated = subprocess.Popen(["sleep", "30"])  # a child of ours from before: not touched
    try:
        before = set(children())
        r, w = os.pipe()
        child = Child.fork(lambda: _daemonize(w), log_path=None, own_group=True, close_fds=(r,))
        os.close(w)
        daemon = int(os.read(r, 32))
        os.close(r)
        assert child.end(10.0) == 0
        assert _alive(daemon)  # the group kill missed it: another session, another group
        left = end_leftovers(child.pid, led_session=False, ours_before=before)
        assert [(p["pid"], p["found_by"]) for p in left] == [(daemon, "adopted orphan")]
        assert not _alive(daemon) and unrelated.poll() is None
        assert daemon not in children()  # reaped
    finally:
        unrelated.kill()
        unrelated.wait()


_LEAVES_ITS_GROUP = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setpgid(0, 0)
    print(os.getpid(), flush=True)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""


def test_a_process_that_left_the_group_but_not_the_session_is_found(subreaper: None,
                                                                    tmp_path) -> None:
    log = tmp_path / "log"
    before = set(children())
    child = Child.spawn([sys.executable, "-c", _LEAVES_ITS_GROUP], log_path=str(log),
                        own_group=True)  # a session of its own
    deadline = time.monotonic() + 30
    while not log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    member = int(log.read_text().split()[0])
    child.end()  # its group killed: the member is not in it
    assert _alive(member)
    left = end_leftovers(child.pid, led_session=True, ours_before=before)
    assert [(p["pid"], p["found_by"]) for p in left] == [(member, "session")]
    deadline = time.monotonic() + 10
    while _alive(member) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(member)


def test_a_child_that_leaves_nothing_leaves_nothing(subreaper: None) -> None:
    before = set(children())
    child = Child.fork(lambda: 0, log_path=None, own_group=True)
    assert child.end(10.0) == 0
    assert end_leftovers(child.pid, led_session=False, ours_before=before) == []
