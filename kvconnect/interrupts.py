"""How both command lines (``kvconnect-validate``, ``kvconnect-conformance``) end: SIGINT,
SIGTERM and SIGHUP become one :class:`Interrupted` where a run may stop (forked children get
the default handlers back: :mod:`kvconnect.child`); :func:`exit_now` skips teardown."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from .child import signal_name

__all__ = ["InterruptSignals", "Interrupted", "exit_now"]


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


def exit_now(code: int) -> NoReturn:
    """Flush logging and stdio, then leave without interpreter teardown (seconds saved on
    torch's atexit work). Only for process entry points whose resources are all released
    already."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: closed when the process started
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
