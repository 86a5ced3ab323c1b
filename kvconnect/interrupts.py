"""SIGINT, SIGTERM and SIGHUP, turned into one :class:`Interrupted` where a run may stop.

The one interrupt handler of both command lines (``kvconnect-validate``,
``kvconnect-conformance``); beside :mod:`kvconnect.child`, which gives forked children the
default handlers back. Torch-free; imports only :mod:`kvconnect.child`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

from .child import signal_name

__all__ = ["InterruptSignals", "Interrupted"]


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived: the run stops, reports where it was, and exits
    ``128 + signum``. A KeyboardInterrupt, so code that already stops on Ctrl-C stops (and no
    ``except Exception`` catches it); ``str()`` is the signal's name (``SIGTERM``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


class InterruptSignals:
    """SIGINT, SIGTERM and SIGHUP, turned into :class:`Interrupted` where it is safe.

    While entered (main thread only), the first SIGINT, SIGTERM or SIGHUP is recorded in
    :attr:`signum` and raised as :class:`Interrupted` where the main thread is, if it is
    inside :meth:`interruptible` and :meth:`stop_raising` was not called; elsewhere it is
    only recorded (entering :meth:`interruptible` afterwards raises it at once). Later
    signals are recorded, never raised, so the cleanup the first one started (bounded by its
    own deadlines) runs to the end.

    CI timeouts and Kubernetes send SIGTERM, a terminal sends SIGINT (Ctrl-C) or SIGHUP (it
    closed, an ssh session dropped): all end a run the same way. Outside the main thread
    entering does nothing (Python delivers signals there).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._raised = False
        self._interruptible = 0
        self._stopped = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> InterruptSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        self._raise_if_due()

    def _raise_if_due(self) -> None:
        if (self.signum is not None and not self._raised and self._interruptible
                and not self._stopped):
            self._raised = True
            raise Interrupted(self.signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A section a signal may stop (the run itself): it raises there."""
        self._interruptible += 1
        try:
            self._raise_if_due()
            yield
        finally:
            self._interruptible -= 1

    def stop_raising(self) -> None:
        """From now on a signal is only recorded in :attr:`signum`, never raised: call it
        when cleanup starts (teardown, summaries), which must run to the end."""
        self._stopped = True
