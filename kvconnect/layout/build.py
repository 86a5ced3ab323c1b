"""Torch views over raw buffers, as the plan says; and a plain (non-extensible) allocation.

Units: bytes; ``num_blocks`` is logical blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import KVCacheConfig
from .geometry import LayoutPlan, ViewGeometry
from .plan import plan_layout
from .specs import LayoutError, layout_int

__all__ = ["allocate_kv_caches", "build_kv_caches", "typed_view"]


def typed_view(storage: torch.UntypedStorage, start_bytes: int, geom: ViewGeometry,
               num_blocks: int, segment_stride: int, device: torch.device) -> torch.Tensor:
    """``geom``'s tensor for ``num_blocks`` blocks, ``start_bytes`` into ``storage``."""
    e = geom.itemsize
    if start_bytes % e:
        raise LayoutError(f"view start {start_bytes} bytes into its storage is not aligned to {e}")
    out = torch.empty(0, dtype=geom.dtype, device=device)
    return out.set_(storage, start_bytes // e, geom.shape_for(num_blocks),
                    geom.strides_for(segment_stride))


def build_kv_caches(plan: LayoutPlan | KVCacheConfig, raw_tensors: Sequence[torch.Tensor],
                    num_blocks: int) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """Per-layer tensors in the model's shape over ``raw_tensors`` (1-D uint8 tensors, one
    per planned buffer, each holding ``num_blocks`` blocks per segment: segment ``s``
    starts at byte ``s * raw.numel() // num_segments``). Mamba layers get a list of states.
    """
    if isinstance(plan, KVCacheConfig):
        plan = plan_layout(plan)
    if len(raw_tensors) != len(plan.tensors):
        raise LayoutError(f"{len(raw_tensors)} raw tensors for {len(plan.tensors)} planned KV "
                          f"tensors")
    seg_strides = []
    for tp, raw in zip(plan.tensors, raw_tensors, strict=True):
        if raw.dtype not in (torch.uint8, torch.int8) or raw.dim() != 1:
            raise LayoutError("raw KV tensors must be 1-D uint8 (or int8)")
        nbytes = raw.numel()
        if nbytes % tp.num_segments or nbytes // tp.num_segments < (
                num_blocks * tp.segment_bytes_per_block):
            raise LayoutError(f"raw tensor {tp.index} holds {nbytes} bytes, too few for "
                              f"{num_blocks} blocks of {tp.bytes_per_block} bytes in "
                              f"{tp.num_segments} segment(s)")
        seg_strides.append(nbytes // tp.num_segments)
    out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
    for name, lp in plan.layers.items():
        raw, ss = raw_tensors[lp.tensor_index], seg_strides[lp.tensor_index]
        base = raw.data_ptr() - raw.untyped_storage().data_ptr()
        views = [typed_view(raw.untyped_storage(), base + g.start_bytes(ss), g, num_blocks, ss,
                            raw.device) for g in lp.views]
        out[name] = views if lp.is_list else views[0]
    return out


def allocate_kv_caches(config: KVCacheConfig, device: str | torch.device = "cpu",
                       num_blocks: int | None = None
                       ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor | list[torch.Tensor]]]:
    """An ordinary (non-extensible) zeroed allocation of ``config``: ``(raw, kv_caches)``.

    The fallback where VMM is unavailable, and the reference geometry the extensible cache
    must match when committed == capacity. ``num_blocks`` defaults to the config's.
    """
    plan = plan_layout(config)
    n = config.num_blocks if num_blocks is None else layout_int("num_blocks", num_blocks)
    raw = [torch.zeros(n * tp.bytes_per_block, dtype=torch.uint8, device=device)
           for tp in plan.tensors]
    return raw, build_kv_caches(plan, raw, n)
