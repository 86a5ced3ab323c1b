"""A tiny Llama for real vLLM engines on any machine (no hub): a folder vLLM loads as is.

vLLM's ``load_format="dummy"`` fills weights with U(-1e-3, 1e-3): the greedy output then
depends on the last prompt token only, so "same tokens with and without X" proves nothing
about the KV cache (vllm-engine-cpu.md). Random weights of ordinary scale are not enough
either: with N(0, 1/sqrt(fan_in)) weights and a 200-token prompt, changing the first token
left the greedy tokens unchanged on an H200 (gpu-facts.md, 2026-12-02), and the longer the
prompt, the smaller any one position's share of softmax attention.

:func:`write_tiny_llama` therefore writes weights *built* so that the output depends on the
first position's KV at any prompt length, and on the rest of the context too, while staying
insensitive to rounding (``model.safetensors`` next to ``config.json``, loaded through vLLM's
own safetensors path):

- every embedding has the same component along hidden dimension 0 (the *shared direction*)
  plus a random, token-specific part; no layer writes along that direction;
- layer 0 attends uniformly (query weights 0) and adds the mean of the values seen so far:
  at position 0 that mean is one value (large), at position t about ``1/sqrt(t+1)`` of it.
  After the next RMSNorm the shared direction is therefore *smaller* at position 0 than
  anywhere else: the first position is marked, whatever its token;
- every later layer's query and key read only that direction, on the head's lowest rotary
  frequency (``rope_theta`` 1e9: unrotated at any length), with opposite signs: each query
  attends to the position with the smallest shared component, position 0, and copies its
  value (the first token's identity) into every position.

Changing only the first prompt token (:func:`first_token_changed`) then changes the tokens at
every length tried (16 to 8192 positions, bf16 and fp32 alike, and unchanged by 1% noise
added to the KV), zeroed KV changes them too (attention moves to the zeroed positions), and
an engine fed another seed's KV produces other tokens. The mark needs a prompt whose tokens
vary: one token repeated gives every position the same mean, and the first is not marked
(its control then gives the same tokens). Units: tokens; bytes.

Shapes: 2 layers, hidden 256, 4 heads of 64, 2 KV heads, vocab 1024, 2048 positions
(bfloat16): a 3.3 MiB weights file. ``overrides`` give other shapes (e.g. Llama-3-8B's KV
geometry: 32 layers, 8 KV heads of 128).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["CUDA_ENGINE", "ENGINE_KWARGS_ENV", "TINY_LLAMA", "engine_kwargs", "first_token_changed", "save_safetensors",
           "write_tiny_llama"]

#: the model's shape (HF Llama config fields)
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "rope_theta": 1e9, "bos_token_id": 1,
    "eos_token_id": 2,
}

#: the shared direction's size in the embeddings (RMS units) and the token-specific part's
SHARED, TOKEN_SPECIFIC = 1.0, 2.0
#: gains of layer 0's mean (the mark) and, split over the later layers, of their copies
MARK_GAIN, COPY_GAIN = 2.0, 0.25
#: the later layers' query / key size along the shared direction (softmax sharpness)
SINK_SHARPNESS = 12.0


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """The construction of the module docstring; random parts from ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layers = cfg["num_hidden_layers"]
    later = max(1, layers - 1)
    off_shared = torch.eye(h)
    off_shared[0, 0] = 0.0  # projects the shared direction (hidden dim 0) out

    def dense(out: int, fan_in: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) * (gain / math.sqrt(fan_in))

    embed = torch.randn(vocab, h, generator=gen) * TOKEN_SPECIFIC
    embed[:, 0] = SHARED * math.sqrt(h)
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed,
                                  "model.norm.weight": torch.ones(h),
                                  "lm_head.weight": dense(vocab, h)}
    sink = hd // 2 - 1  # the lowest rotary frequency of a head (neox layout)
    out_scale = math.sqrt(h) / math.sqrt(hd)
    mlp = 1.0 / later  # a little mixing: more of it over many layers turns chaotic
    for i in range(layers):
        p = f"model.layers.{i}."
        q = torch.zeros(nh * hd, h)
        k = dense(nkv * hd, h) @ off_shared
        if i > 0:  # read the mark: attend to the first position
            k = torch.zeros(nkv * hd, h)
            q[sink::hd, 0] = SINK_SHARPNESS
            k[sink::hd, 0] = -SINK_SHARPNESS
        gain = MARK_GAIN if i == 0 else COPY_GAIN / math.sqrt(later)
        w.update({
            p + "self_attn.q_proj.weight": q,
            p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": dense(nkv * hd, h) @ off_shared,
            p + "self_attn.o_proj.weight": off_shared @ dense(h, nh * hd, gain * out_scale),
            p + "mlp.gate_proj.weight": dense(inter, h, mlp) @ off_shared,
            p + "mlp.up_proj.weight": dense(inter, h, mlp) @ off_shared,
            p + "mlp.down_proj.weight": off_shared @ dense(h, inter, mlp),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        })
    return {name: t.to(torch.bfloat16) for name, t in w.items()}


def write_tiny_llama(directory: str | Path, *, seed: int | None = 0,
                     **overrides: Any) -> Path:
    """Write the tiny Llama into ``directory`` (created): ``config.json`` and, unless
    ``seed`` is None (config only, for ``load_format="dummy"``), seeded
    ``model.safetensors``. ``overrides`` change config fields (e.g. ``num_hidden_layers``).
    Returns the folder. Needs torch."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_LLAMA, **overrides}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    if seed is not None:
        save_safetensors(_weights(cfg, seed), d / "model.safetensors",
                         {"format": "pt", "kvconnect_seed": str(seed)})
    return d


_SAFETENSORS_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


def save_safetensors(tensors: dict[str, Any], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` in the safetensors format (an 8-byte little-endian header length, a
    JSON header of dtype / shape / byte offsets, the raw bytes), without the safetensors
    package (machines that run vLLM from its sources may lack it)."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata or {}}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[str(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


#: on a GPU several engines share the device: a 1 GiB KV cache each, as
#: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) gives on CPU, and a small share of the memory
CUDA_ENGINE: dict[str, Any] = {"kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.15}
#: engine arguments (a JSON object) a machine's vLLM needs on CUDA, e.g. Triton attention
#: where vLLM's flash attention was not carried (scripts/gpu_vllm_setup.sh writes it)
ENGINE_KWARGS_ENV = "KVCONNECT_ENGINE_KWARGS"


def engine_kwargs(model_dir: str | Path, *, seeded: bool = True, device: str = "cpu",
                  **overrides: Any) -> dict[str, Any]:
    """``vllm.LLM(**engine_kwargs(dir))`` for the tiny model: no tokenizer (prompts are token
    ids), eager mode, 512-token context, seed 0; weights from the folder (``seeded``) or
    vLLM's dummy ones. On ``device="cuda"`` also :data:`CUDA_ENGINE` and the JSON object
    in ``$KVCONNECT_ENGINE_KWARGS`` (an ``attention_backend`` name becomes vLLM's enum).
    ``overrides`` win. Raises ValueError for a variable that is not a JSON object."""
    kw: dict[str, Any] = {"model": str(model_dir), "skip_tokenizer_init": True,
                          "enforce_eager": True, "max_model_len": 512, "seed": 0,
                          "load_format": "safetensors" if seeded else "dummy",
                          "dtype": "bfloat16"}
    if device.split(":", 1)[0] == "cuda":
        kw.update(CUDA_ENGINE)
        kw.update(_engine_kwargs_from_env())
    kw.update(overrides)
    return kw


def _engine_kwargs_from_env() -> dict[str, Any]:
    raw = os.environ.get(ENGINE_KWARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENGINE_KWARGS_ENV} must be a JSON object of vLLM engine "
                         f"arguments, e.g. '{{\"attention_backend\": \"TRITON_ATTN\"}}': {exc}"
                         ) from None
    if not isinstance(extra, dict):
        raise ValueError(f"{ENGINE_KWARGS_ENV} must be a JSON object of vLLM engine "
                         f"arguments, got {type(extra).__name__}")
    if isinstance(extra.get("attention_backend"), str):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        extra["attention_backend"] = AttentionBackendEnum[extra["attention_backend"]]
    return extra


def first_token_changed(prompt: list[int], vocab_size: int = TINY_LLAMA["vocab_size"]
                        ) -> list[int]:
    """``prompt`` with only its first token replaced: the negative control's prompt (an
    engine whose output depends on the whole prompt answers it differently)."""
    if not prompt:
        raise ValueError("the negative control needs a non-empty prompt")
    return [(prompt[0] + vocab_size // 2) % vocab_size, *prompt[1:]]
