"""How harness processes end: SIGINT / SIGTERM become one Interrupted where it is safe."""

from __future__ import annotations

import os
import signal

import pytest

from kvconnect.interrupts import Interrupted, InterruptSignals


def _signal_self(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs at the next bytecode boundaries
        pass


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_raises_only_where_the_run_may_stop(signum: int) -> None:
    before = signal.getsignal(signum)
    with InterruptSignals() as signals:
        _signal_self(signum)  # outside interruptible(): recorded, not raised
        assert signals.signum == signum
        with pytest.raises(Interrupted) as info, signals.interruptible():
            pass  # entering raises what arrived before
        assert info.value.signum == signum and isinstance(info.value, KeyboardInterrupt)
        with signals.interruptible():
            _signal_self(signal.SIGTERM)  # a second signal never raises
    assert signal.getsignal(signum) is before


def test_after_stop_raising_a_signal_is_only_kept() -> None:
    with InterruptSignals() as signals, signals.interruptible():
        signals.stop_raising()  # cleanup started
        _signal_self(signal.SIGTERM)
        finished = True
        assert finished and signals.signum == signal.SIGTERM
