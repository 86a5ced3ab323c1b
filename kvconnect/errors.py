"""The root of every error kvconnect raises.

Every exception class the package defines (library, ``kvconnect.connectors``,
``kvconnect.harness``, ``kvconnect.vllm``) derives from :class:`KvconnectError`, so a caller
can tell "kvconnect refused or failed" from a bug elsewhere with one ``except``. Each class
also keeps the standard base it always had (``ValueError``, ``RuntimeError``, ``OSError``,
``ImportError``, ``KeyError``), so ``except ValueError`` callers keep working.

tests/test_error_root.py walks every module and checks it.
"""

from __future__ import annotations

__all__ = ["KvconnectError", "OptionError"]


class KvconnectError(Exception):
    """Base of every exception kvconnect defines (the message says what was wrong and what to
    do). Catch it to handle "our" errors without swallowing foreign ones."""


class OptionError(KvconnectError, ValueError):
    """A bad command-line option or configuration value (both CLIs exit 2 on it); the message
    names the option, its rule and what to give instead."""
