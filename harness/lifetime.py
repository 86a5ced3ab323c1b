"""How a harness process ends: leave without interpreter teardown (signals become
:class:`kvconnect.interrupts.Interrupted` through :class:`kvconnect.interrupts.InterruptSignals`).

Imported by both the coordinator side (:mod:`.cli`) and worker processes (:mod:`.worker`),
so it imports nothing else from the harness.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


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
