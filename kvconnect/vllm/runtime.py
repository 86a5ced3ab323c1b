"""Running vLLM 0.33's connectors on a CPU-only machine (facts in docs/conformance.md).

vLLM on CPU needs ``VLLM_TARGET_DEVICE=cpu``; with no model hub, ``HF_HUB_OFFLINE=1`` and a
local folder holding only a small ``config.json``; an explicit ``kv_cache_layout``; a
``block_size`` multiple of 32 (its CPU attention); a gloo process group; and, because vLLM
imports ``nixl._api`` while ``nixl-cu13`` installs ``nixl_cu13``, the module aliased before
vLLM first asks (its ``nixl_utils`` caches a miss). Nothing here imports vLLM at import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["alias_nixl", "init_single_process_group", "make_vllm_config", "prepare_cpu_runtime",
           "vllm_available", "write_tiny_model"]


def vllm_available() -> str | None:
    """None when vLLM imports here, else why not (a short reason)."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make test-vllm builds .venv-vllm)"
    return None


def alias_nixl() -> bool:
    """Make ``import nixl._api`` find ``nixl_cu13`` (or ``nixl_cu12``). True when a NIXL
    module is importable afterwards."""
    if importlib.util.find_spec("nixl") is not None:
        try:
            importlib.import_module("nixl._api")
            return True
        except ImportError:
            pass
    for name in ("nixl_cu13", "nixl_cu12"):
        if importlib.util.find_spec(name) is None:
            continue
        pkg = importlib.import_module(name)
        sys.modules["nixl"] = pkg
        for sub in ("_api", "_bindings"):
            mod = importlib.import_module(f"{name}.{sub}")
            sys.modules[f"nixl.{sub}"] = mod
            setattr(pkg, sub, mod)
        return True
    return False


def prepare_cpu_runtime() -> None:
    """Environment for vLLM's connectors on CPU: set before vLLM is imported."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    alias_nixl()


def write_tiny_model(directory: str | Path, *, num_layers: int = 2, num_kv_heads: int = 2,
                     head_dim: int = 64, dtype: str = "bfloat16") -> Path:
    """A model folder holding only a small Llama ``config.json`` (no weights, no tokenizer:
    enough for vLLM's config and connectors). Returns the folder."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    heads = 2 * num_kv_heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": heads * head_dim, "intermediate_size": 2 * heads * head_dim,
           "num_attention_heads": heads, "num_key_value_heads": num_kv_heads,
           "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": 512,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": dtype}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def make_vllm_config(model_dir: str | Path, *, layout: str, block_size: int = 32,
                     kv_transfer_config: dict[str, Any] | None = None,
                     dtype: str = "bfloat16", max_model_len: int = 2048) -> Any:
    """vLLM's ``VllmConfig`` for a tiny local model, its KV cache layout set to ``layout``."""
    prepare_cpu_runtime()
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    ktc = None if kv_transfer_config is None else KVTransferConfig(**kv_transfer_config)
    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, block_size=block_size,
                      dtype=dtype, kv_transfer_config=ktc, max_model_len=max_model_len,
                      enforce_eager=True, load_format="dummy")
    config = args.create_engine_config()
    config.cache_config.kv_cache_layout = layout
    return config


def init_single_process_group(init_file: str | Path) -> None:
    """vLLM's distributed state for one process (world size 1, gloo), as its workers have."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"file://{init_file}")
    ps.initialize_model_parallel(1, 1)
