"""The private directory of one run: its Unix sockets and worker logs.

Under ``$TMPDIR``, unless that is too long for Unix socket paths; then under ``/tmp``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

#: a Unix socket path must fit sockaddr_un.sun_path (108 bytes with the NUL)
_MAX_BASE = 80 - 16
PREFIX = "kvv-"


def run_dir_base() -> str:
    """Where run directories go: ``$TMPDIR`` or, when that is too long, ``/tmp``."""
    base = tempfile.gettempdir()
    if len(base) > _MAX_BASE:
        log.warning("TMPDIR %s is too long for Unix socket paths; using /tmp", base)
        base = "/tmp"
    return base


@contextlib.contextmanager
def run_dir() -> Iterator[str]:
    """A fresh private (0700) directory for this run's sockets and logs, removed on exit."""
    path = tempfile.mkdtemp(prefix=PREFIX, dir=run_dir_base())
    try:
        os.chmod(path, 0o700)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
