"""The small shared helpers: checked_int/round_up, the parsers of typed numbers and durations,
UndoStack, poll_until."""

from __future__ import annotations

import logging
import time

import pytest

from kvconnect.checks import (
    MAX_BYTES,
    MAX_SECONDS,
    checked_int,
    checked_seconds,
    parse_whole_number,
    round_up,
)
from kvconnect.polling import poll_until
from kvconnect.undo import UndoStack


@pytest.mark.parametrize(("value", "kw", "error"), [
    (0, {}, "must be positive"),
    (-5, {"minimum": 0}, "must be >= 0"),
    (1 << 70, {}, "exceeds the platform's limit"),
    (MAX_BYTES + 1, {}, "exceeds the platform's limit"),
    (11, {"maximum": 10}, "exceeds 10"),
    (True, {}, "must be an int, got bool"),
    (2.0, {}, "must be an int, got float"),
    ("8", {}, "must be an int, got str"),
    (None, {}, "must be an int, got NoneType"),
])
def test_checked_int_refuses_with_one_exception_type(value, kw, error) -> None:
    with pytest.raises(ValueError, match=error):
        checked_int("size", value, **kw)


def test_checked_int_and_round_up_accept() -> None:
    assert checked_int("size", MAX_BYTES) == MAX_BYTES
    assert checked_int("offset", 0, minimum=0) == 0
    assert [round_up(v, 4) for v in (0, 1, 4, 5)] == [0, 4, 4, 8]
    with pytest.raises(ValueError, match="positive"):
        round_up(3, 0)


@pytest.mark.parametrize("text", ["\u0662", "\uff15", "+5", "_1_", "1__0", "1_", "\xa05",
                                  "5\u2003", "0x5", "5.0", "", "-", str(2 ** 70), "1" * 5000])
def test_whole_numbers_are_ascii_digits_within_bounds(text: str) -> None:
    """int() takes every one of these but the last two (or takes them slowly)."""
    with pytest.raises(ValueError, match="--x must be a whole number from 1 to"):
        parse_whole_number("--x", text)


def test_whole_numbers_accepted() -> None:
    assert parse_whole_number("n", " 8_589_934_592\n") == 8 << 30
    assert parse_whole_number("n", "-3", minimum=-5, maximum=5) == -3
    assert parse_whole_number("n", "007", maximum=10) == 7
    with pytest.raises(ValueError, match="from 1 to 10"):
        parse_whole_number("n", "11", maximum=10)


@pytest.mark.parametrize("value", ["inf", "nan", float("inf"), float("nan"), "1e300",
                                   MAX_SECONDS * 2, 10 ** 400, 0, -1, "0", "\u0662", "1_0",
                                   True, None, [1], "", " ", "5s"])
def test_seconds_are_finite_positive_and_bounded(value: object) -> None:
    with pytest.raises(ValueError, match="timeout must be seconds: a number above 0"):
        checked_seconds("timeout", value)


@pytest.mark.parametrize(("value", "want"), [(5, 5.0), (0.25, 0.25), (" 2.5 ", 2.5),
                                             ("1e3", 1000.0), (".5", 0.5),
                                             (MAX_SECONDS, MAX_SECONDS)])
def test_seconds_accepted(value: object, want: float) -> None:
    assert checked_seconds("timeout", value) == want


def test_undo_stack_runs_in_reverse_on_error_and_forgets_on_success(
        caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []
    with UndoStack() as undo:
        undo.push(done.append, "a")
        undo.push(done.append, "b")
        assert len(undo) == 2
    assert done == [] and len(undo) == 0

    def broken() -> None:
        raise OSError("undo failed")

    with pytest.raises(KeyError, match="step 3"), caplog.at_level(logging.ERROR):
        with UndoStack() as undo:
            undo.push(done.append, "first")
            undo.push(broken)
            undo.push(done.append, "last")
            raise KeyError("step 3")
    assert done == ["last", "first"]  # newest first; a failing undo does not stop the rest
    assert [r.levelno for r in caplog.records] == [logging.ERROR]
    with pytest.raises(KeyboardInterrupt), UndoStack() as undo:  # BaseException too
        undo.push(done.append, "interrupted")
        raise KeyboardInterrupt
    assert done[-1] == "interrupted"


def test_poll_until_backs_off_and_honours_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvconnect.polling as polling

    calls: list[int] = []
    pauses: list[float] = []
    real_sleep = time.sleep

    def ready_on_sixth() -> str | None:
        calls.append(1)
        return "done" if len(calls) == 6 else None

    monkeypatch.setattr(polling.time, "sleep", lambda s: pauses.append(s))
    assert poll_until(ready_on_sixth, 5.0, on_timeout=TimeoutError, first_pause=1e-3,
                      max_pause=4e-3) == "done"
    assert pauses == pytest.approx([1e-3, 2e-3, 4e-3, 4e-3, 4e-3])  # doubling, capped
    monkeypatch.setattr(polling.time, "sleep", real_sleep)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        poll_until(lambda: 0, 0.2, on_timeout=lambda s: TimeoutError(s), max_pause=0.05)
    took = time.monotonic() - t0
    assert 0.2 <= err.value.args[0] and took < 1.0
    for bad in (float("inf"), -1, float("nan"), None):
        with pytest.raises(ValueError, match="timeout"):
            poll_until(lambda: 1, bad, on_timeout=TimeoutError)  # type: ignore[arg-type]


def test_framing_and_helpers_load_without_torch() -> None:
    """The wire format, the shared helpers and the driver layer import no torch (harness
    processes that only exchange messages need not load it)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvconnect.framing, kvconnect.checks, kvconnect.undo, kvconnect.polling\n"
            "import kvconnect.bounded_json, kvconnect.lifetime, kvconnect.vmm\n"
            "from kvconnect import IpcError, PeerError, AllocationOptions, UndoStack\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_free_tcp_ports_lie_below_the_ephemeral_range_and_skip_the_excluded() -> None:
    import socket

    from kvconnect.ports import SPAN, ephemeral_port_range, free_tcp_port

    top = ephemeral_port_range()[0]
    taken: set[int] = set()
    ports = [free_tcp_port(exclude=taken) for _ in range(20)]
    assert len(set(ports)) == 20 and taken == set(ports)
    assert all(max(1024, top - SPAN) <= p < top for p in ports)
    with socket.socket() as s:  # a port someone listens on is never handed out
        s.bind(("127.0.0.1", ports[0]))
        s.listen()
        assert ports[0] not in {free_tcp_port(exclude=set(ports[1:])) for _ in range(30)}
