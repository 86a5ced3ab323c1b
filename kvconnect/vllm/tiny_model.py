"""A tiny Llama for real vLLM engines on any machine (no hub): a folder vLLM loads as is.

vLLM's ``load_format="dummy"`` fills weights with U(-1e-3, 1e-3): the greedy output then
depends on the last prompt token only, so "same tokens with and without X" proves nothing
about the KV cache (vllm-engine-cpu.md). :func:`write_tiny_llama` writes seeded weights
of ordinary scale (N(0, 1/sqrt(fan_in)), norms 1) into ``model.safetensors`` next to the
``config.json``; loaded through vLLM's own safetensors path (``load_format="safetensors"``),
the output depends on every prompt token, so a token comparison can fail: changing only the
first prompt token changes the output (:func:`first_token_changed` builds that prompt), and a decode engine fed another seed's KV produces other tokens.

Shapes: 2 layers, hidden 256, 4 heads of 64, 2 KV heads, vocab 1024, 2048 positions
(bfloat16): a 3.3 MiB weights file. Units: tokens; bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["TINY_LLAMA", "engine_kwargs", "first_token_changed", "save_safetensors",
           "write_tiny_llama"]

#: the model's shape (HF Llama config fields)
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
    "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "num_hidden_layers": 2, "vocab_size": 1024,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "rope_theta": 10000.0, "bos_token_id": 1,
    "eos_token_id": 2,
}


def _weights(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def dense(out: int, fan_in: int) -> torch.Tensor:
        w = torch.randn(out, fan_in, generator=gen) / math.sqrt(fan_in)
        return w.to(torch.bfloat16)

    w: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=gen
                                                 ).to(torch.bfloat16),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": dense(cfg["vocab_size"], h),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": dense(nh * hd, h),
            p + "self_attn.k_proj.weight": dense(nkv * hd, h),
            p + "self_attn.v_proj.weight": dense(nkv * hd, h),
            p + "self_attn.o_proj.weight": dense(h, nh * hd),
            p + "mlp.gate_proj.weight": dense(inter, h),
            p + "mlp.up_proj.weight": dense(inter, h),
            p + "mlp.down_proj.weight": dense(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        })
    return w


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


def engine_kwargs(model_dir: str | Path, *, seeded: bool = True, **overrides: Any
                  ) -> dict[str, Any]:
    """``vllm.LLM(**engine_kwargs(dir))`` for the tiny model: no tokenizer (prompts are token
    ids), eager mode, 512-token context, seed 0; weights from the folder (``seeded``) or
    vLLM's dummy ones. ``overrides`` win."""
    kw: dict[str, Any] = {"model": str(model_dir), "skip_tokenizer_init": True,
                          "enforce_eager": True, "max_model_len": 512, "seed": 0,
                          "load_format": "safetensors" if seeded else "dummy",
                          "dtype": "bfloat16"}
    kw.update(overrides)
    return kw


def first_token_changed(prompt: list[int], vocab_size: int = TINY_LLAMA["vocab_size"]
                        ) -> list[int]:
    """``prompt`` with only its first token replaced: the negative control's prompt (an
    engine whose output depends on the whole prompt answers it differently)."""
    if not prompt:
        raise ValueError("the negative control needs a non-empty prompt")
    return [(prompt[0] + vocab_size // 2) % vocab_size, *prompt[1:]]
