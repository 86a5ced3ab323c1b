"""``vllm.vllm_flash_attn`` for a vLLM carried to a GPU machine without its flash-attention
extensions (scripts/gpu_vllm_setup.sh installs this file as that package's ``__init__.py``).

vLLM 0.33's own ``vllm/vllm_flash_attn/__init__.py`` raises ImportError unless the compiled
FA2 / FA3 extensions (``_vllm_fa2_C``, ``_vllm_fa3_C``: 308 + 173 MB) are present, and every
model imports it on a CUDA platform (``fa_utils``), before any attention backend is chosen.
They are too large to carry, so this module stands in: it reports both versions unavailable,
with the reason, so vLLM selects another backend (the engines here ask for ``TRITON_ATTN``),
and each kernel entry point raises if anything calls it. No computation is faked.

Nothing of kvconnect imports this; a vLLM installed the ordinary way keeps its own module.
"""

from __future__ import annotations

from typing import Any, NoReturn

FA2_AVAILABLE = False
FA3_AVAILABLE = False
REASON = ("vLLM's flash-attention extensions were not carried to this machine "
          "(scripts/vllm_flash_attn_absent.py); use attention_backend=TRITON_ATTN")

__all__ = ["compile_flash_attn_varlen_func_from_specs", "fa_version_unsupported_reason",
           "flash_attn_varlen_func", "get_scheduler_metadata", "is_fa_version_supported"]


def _absent(name: str) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(f"vllm.vllm_flash_attn.{name} called, but {REASON}")

    kernel.__name__ = name
    return kernel


flash_attn_varlen_func = _absent("flash_attn_varlen_func")
get_scheduler_metadata = _absent("get_scheduler_metadata")
compile_flash_attn_varlen_func_from_specs = _absent("compile_flash_attn_varlen_func_from_specs")


def is_fa_version_supported(fa_version: int, device: Any = None) -> bool:
    """Never: neither FA2 nor FA3 is present."""
    return False


def fa_version_unsupported_reason(fa_version: int, device: Any = None) -> str:
    return REASON
