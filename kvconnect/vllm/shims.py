"""Shims that let vLLM 0.33's Python sources import on CUDA without its compiled extension.

Used only by the conformance kit (``kvconnect-conformance --device cuda:N``) when vLLM was
carried as Python sources, without its ``.so`` files (its wheel pins torch 2.14 and weighs
336 MB; the GPU image has torch 2.11). What is shimmed, and why it is enough for the
connectors the kit exercises there (SimpleCPUOffload, Offloading):

- ``vllm._C_stable_libtorch``: ``vllm/platforms/cuda.py`` imports it unguarded at module
  level to register custom ops. :class:`MissingExtensionShim` puts an empty module in its
  place. Every other use of vLLM's ops is guarded (``hasattr(torch.ops._C, ...)``) or is a
  kernel the kit never calls: SimpleCPUOffload copies with ``cuMemcpyBatchAsync`` through
  ``cuda.bindings`` (no vLLM extension), and the kit replaces OffloadingConnector's CUDA
  worker (``torch.ops._C_cache_ops.swap_blocks_batch``) with row copies of the canonical
  tensors it is built from (:class:`~kvconnect.harness.conformance.probes.OffloadingProbe`).

Nothing here runs unless asked: :func:`install_extension_shims` is called by
:func:`kvconnect.vllm.runtime.prepare_cuda_runtime`, before vLLM is imported.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["CUDA_IMPORT_TIME_EXTENSIONS", "MissingExtensionShim", "install_extension_shims",
           "is_shim"]

log = logging.getLogger(__name__)

#: compiled modules vLLM 0.33 imports without a guard on its CUDA platform's import path
CUDA_IMPORT_TIME_EXTENSIONS: tuple[str, ...] = ("vllm._C_stable_libtorch",)


class MissingExtensionShim(types.ModuleType):
    """An empty module standing for one of vLLM's compiled extensions that is absent here.
    It registers no ops: any code that needs the real ops fails where it calls them."""

    __kvconnect_shim__ = True


def is_shim(module: object) -> bool:
    """True when ``module`` is one of these shims."""
    return bool(getattr(module, "__kvconnect_shim__", False))


def _present(name: str) -> bool:
    """Whether module ``pkg.mod`` exists as a file, without importing ``pkg``."""
    pkg, _, mod = name.rpartition(".")
    try:
        spec = importlib.util.find_spec(pkg or name)
    except (ImportError, ValueError):
        return False
    if spec is None or not pkg:
        return spec is not None
    suffixes = (*importlib.machinery.EXTENSION_SUFFIXES, ".py")
    return any(Path(d, mod + suf).exists() for d in spec.submodule_search_locations or ()
               for suf in suffixes)


def install_extension_shims(names: Iterable[str] = CUDA_IMPORT_TIME_EXTENSIONS, *,
                            present: Callable[[str], bool] = _present) -> list[str]:
    """Put a :class:`MissingExtensionShim` in ``sys.modules`` for every name in ``names``
    that cannot be found (``present(name)`` false) and is not imported yet. Returns the
    names shimmed (empty when vLLM's extensions are installed). Warns through logging."""
    shimmed = []
    for name in names:
        if name in sys.modules or present(name):
            continue
        sys.modules[name] = MissingExtensionShim(name, "kvconnect shim: compiled extension "
                                                       "absent (vLLM carried as sources)")
        shimmed.append(name)
    if shimmed:
        log.warning("vLLM's compiled extensions are absent; empty shims stand for %s "
                    "(kvconnect conformance kit only)", ", ".join(shimmed))
    return shimmed
