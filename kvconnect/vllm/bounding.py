"""vLLM views and config bounded to the committed blocks: what a connector may see.

vLLM 0.33's connectors take geometry from storages (``untyped_storage().nbytes()``, the
storage's first byte) and from the config's tensors (``layer_stride``, ``offset`` relative
to that storage). Over an extensible reservation both describe reserved capacity.
:func:`bound_for_connector` gives the same views narrowed to ``num_blocks`` blocks, each
over a storage of exactly the committed bytes around it (the merged committed extents:
on a plain allocation one storage per buffer, exactly what vLLM allocated), and a config
whose tensors place the layers in those storages. On a plain allocation the config is
unchanged and the views keep their addresses, shapes and strides: connectors register
byte-identically. Units: bytes; blocks are vLLM's logical blocks.

``LHBNC`` puts each head of a layer in its own run (a "head plane"), ``num_blocks`` blocks
long; over a reservation the planes are ``capacity`` blocks apart, which no vLLM config
can say (vLLM's connectors place them ``num_blocks * block_stride`` apart). With
``head_planes=True`` (kvconnect's patched connectors) the bounded config places them as
vLLM expects for that many blocks, so upstream derives the right number of regions, and
:attr:`BoundedKVCaches.head_planes` gives where each plane really starts (from the view:
``data_ptr + h * stride(1)``), for the connector to put them there
(:mod:`kvconnect.vllm.head_planes`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvconnect.layout import LayoutError, LayoutPlan, plan_layout
from kvconnect.layout.foreign import VllmKVCacheConfigLike, config_from_vllm, replace_vllm_config
from kvconnect.views import narrow_kv_caches_to_num_blocks

__all__ = ["BoundedKVCaches", "bound_for_connector", "view_head_planes"]


def view_head_planes(view: torch.Tensor) -> tuple[int, ...]:
    """Addresses of the head planes of an LHBNC layer view ``[B, H, N, C]``: plane ``h``
    starts at ``data_ptr + h * stride(1)`` (bytes)."""
    e = view.element_size()
    return tuple(view.data_ptr() + h * view.stride(1) * e for h in range(view.shape[1]))


@dataclass(frozen=True)
class BoundedKVCaches:
    """Views and vLLM config bounded to ``num_blocks`` committed blocks.

    ``kv_caches``: the narrowed views; ``kv_cache_config``: vLLM's config whose tensors
    place the layers in those views' storages; ``registered``: ``(address, nbytes)`` of
    every distinct storage (what a connector registering storages registers);
    ``head_planes``: for LHBNC whose planes are not where the config says (a reservation),
    layer -> the address of each head plane, and ``plane_bytes``, the committed bytes of
    one plane (empty / 0 otherwise).
    """

    kv_caches: dict[str, torch.Tensor]
    kv_cache_config: VllmKVCacheConfigLike
    num_blocks: int
    registered: tuple[tuple[int, int], ...]
    head_planes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    plane_bytes: int = 0

    def committed_ranges(self) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of the memory a connector may register: every storage, or,
        where head planes lie apart, each plane's committed run instead of its storage."""
        planes = [(a, self.plane_bytes) for bases in self.head_planes.values() for a in bases]
        inside = {st for st in self.registered
                  if any(st[0] <= a < st[0] + st[1] for a, _ in planes)}
        return sorted(set(planes) | (set(self.registered) - inside))


def _one_tensor_each(views: dict[str, torch.Tensor | list[torch.Tensor]]
                     ) -> dict[str, torch.Tensor]:
    """vLLM's views: one tensor per layer (a list, kvconnect's Mamba states, is not vLLM's)."""
    out: dict[str, torch.Tensor] = {}
    for name, v in views.items():
        if not isinstance(v, torch.Tensor):
            raise LayoutError(f"layer {name!r}: a list of {len(v)} tensors; vLLM's KV cache "
                              f"views are one tensor per layer")
        out[name] = v
    return out


def _layer_start(plan: LayoutPlan, name: str, view: torch.Tensor) -> int:
    g = plan.layers[name].views[0]
    return view.data_ptr() - g.offset_bytes


def _bounded_tensors(plan: LayoutPlan, cfg: Any, views: dict[str, torch.Tensor],
                     num_blocks: int, head_planes: dict[str, tuple[int, ...]] | None
                     ) -> list[Any]:
    """vLLM tensors placing every layer in its bounded storage. Where head planes lie
    apart: raises LayoutError, or, given ``head_planes`` (a dict to fill), records each
    layer's plane addresses there and places the planes as vLLM expects."""
    from vllm.v1.kv_cache_interface import KVCacheTensor

    out = []
    for t in cfg.kv_cache_tensors:
        names = [n for n in t.layers if n in views]
        if not names:
            continue
        storages = {views[n].untyped_storage().data_ptr() for n in names}
        first = views[names[0]].untyped_storage()
        if plan.block_outer:  # one storage of rows from row 0: the placement holds as is
            out.append(dataclasses.replace(t, size=first.nbytes()))
            continue
        starts = [_layer_start(plan, n, views[n]) for n in names]
        planes = plan.layers[names[0]].segments[1] - plan.layers[names[0]].segments[0] + 1
        committed_stride = planes * num_blocks * t.block_stride
        contiguous = len(storages) == 1 and all(
            s - starts[0] == j * t.layer_stride for j, s in enumerate(starts))
        if contiguous and (len(names) == 1 or t.layer_stride == committed_stride):
            out.append(dataclasses.replace(t, size=first.nbytes(),
                                           offset=starts[0] - first.data_ptr()))
            continue
        for n, s in zip(names, starts, strict=True):
            st = views[n].untyped_storage()
            if planes > 1 and st.nbytes() != committed_stride:
                if head_planes is None:
                    raise LayoutError(
                        f"layer {n!r}: layout {plan.config.layout} puts its {planes} head "
                        f"planes {plan.tensors[0].bytes_per_block // plan.tensors[0].num_segments}"
                        f" x capacity bytes apart; vLLM connectors assume they lie num_blocks "
                        f"blocks apart, so no bounded config describes them (kvconnect's "
                        f"patched connectors place them from the views: head_planes=True)")
                head_planes[n] = view_head_planes(views[n])
            out.append(KVCacheTensor(size=st.nbytes(), layers=[n],
                                     layer_stride=committed_stride,
                                     block_stride=t.block_stride, offset=s - st.data_ptr()))
    return out


def bound_for_connector(kv_caches: dict[str, torch.Tensor],
                        kv_cache_config: VllmKVCacheConfigLike,
                        num_blocks: int | None = None, *, layout: object = None,
                        kernel_block_size: int | None = None,
                        head_planes: bool = False) -> BoundedKVCaches:
    """``kv_caches`` and vLLM's ``kv_cache_config`` bounded to ``num_blocks`` blocks
    (default: the config's ``num_blocks``). ``layout`` defaults to the config's
    ``kv_cache_layout``. Raises :class:`~kvconnect.layout.LayoutError` when the views do not
    follow the config, or, unless ``head_planes``, when no bounded config can describe the
    layout to vLLM's connectors (``LHBNC`` with capacity above the committed blocks): with
    ``head_planes`` the result's ``head_planes`` says where those planes are."""
    ours = config_from_vllm(kv_cache_config, layout, kernel_block_size)
    n = int(kv_cache_config.num_blocks if num_blocks is None else num_blocks)
    plan = plan_layout(ours)
    views = _one_tensor_each(narrow_kv_caches_to_num_blocks(kv_caches, n, plan))
    planes: dict[str, tuple[int, ...]] | None = {} if head_planes else None
    tensors = _bounded_tensors(plan, kv_cache_config, views, n, planes)
    config = replace_vllm_config(kv_cache_config, kv_cache_tensors=tensors, num_blocks=n,
                                 kv_cache_layout=ours.layout)
    seen: dict[int, int] = {}
    for v in views.values():
        st = v.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes())
    plane_bytes = 0
    if planes:
        v = views[next(iter(planes))]
        plane_bytes = n * v.stride(0) * v.element_size()
    return BoundedKVCaches(views, config, n, tuple(sorted(seen.items())), planes or {},
                           plane_bytes)
