"""LHBNC head planes where the views put them, for vLLM's connectors (needs vLLM).

``LHBNC`` stores each head of a layer as its own run of blocks (a head plane). vLLM's
connectors derive where plane ``h`` starts from the block count, inline in their
``register_kv_caches``: NIXL's segmented registration puts region ``h`` at
``data_ptr + h * num_blocks * block_stride`` (``nixl/base_worker.py``), SimpleCPUOffload
views ``num_blocks``-block chunks of the storage (``simple_kv_offload/worker.py``), and
OffloadingConnector views each layer as ``(num_blocks, page)`` rows at the head page's
stride, which it takes for a packed layout (``offloading/worker.py``: it then moves only
the first head of the first layer, on plain allocations too). Over a reservation the
planes are ``capacity`` blocks apart: the view knows (``stride(1)``), ``num_blocks`` does
not.

Upstream offers no method narrower than its whole ``register_kv_caches``, so each context
manager below lets upstream's method run unchanged and corrects what it derived at the
first overridable point after the derivation and before anything uses it (checked in vLLM
0.32 and 0.33):

- NIXL: ``_set_region_layers`` (called after the region bases are set, before memory is
  registered, descriptors are built and the handshake metadata is made): each head plane's
  region base becomes the view's; and the agent's ``get_reg_descs`` during registration:
  each range becomes the committed runs inside it (a storage spanning several planes holds
  uncommitted gaps that must not be registered);
- SimpleCPUOffload: ``_init_cpu_mode`` / ``_init_disk_mode`` (called with the regions
  before the copy engine and host buffers are built): each plane's region is the view's;
- OffloadingConnector: ``_init_worker`` (called with the canonical tensors): one canonical
  tensor per head plane, each of the head page, instead of the mis-detected packed one.

On layouts other than LHBNC nothing changes; on plain LHBNC allocations NIXL and
SimpleCPUOffload get exactly upstream's addresses (the planes are ``num_blocks`` apart
there), OffloadingConnector gets the planes its own derivation misses. Units: bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .bounding import BoundedKVCaches, view_head_planes

__all__ = ["nixl_head_planes", "offloading_head_planes", "simple_offload_head_planes",
           "split_to_committed", "view_head_planes"]


def split_to_committed(ranges: list[tuple], committed: list[tuple[int, int]]) -> list[tuple]:
    """Registration ranges ``(address, nbytes, *rest)`` cut to the parts that lie in the
    ``committed`` runs (a range covering none is dropped, one inside a run is unchanged)."""
    out: list[tuple] = []
    for start, n, *rest in ranges:
        pieces = [(max(start, a), min(start + n, a + m)) for a, m in committed
                  if a < start + n and start < a + m]
        out.extend((lo, hi - lo, *rest) for lo, hi in pieces if hi > lo)
    return out


def _bytes_at(view: torch.Tensor, address: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes (int8) of ``view``'s storage from ``address`` on."""
    raw = torch.empty(0, dtype=torch.int8, device=view.device).set_(view.untyped_storage())
    start = address - view.untyped_storage().data_ptr()
    return raw[start: start + nbytes]


@contextlib.contextmanager
def _instance_patch(obj: Any, name: str, wrapper: Any) -> Iterator[None]:
    """``obj.name`` replaced by ``wrapper(original)`` for the block (instance attribute)."""
    original = getattr(obj, name)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        if name in vars(obj):
            delattr(obj, name)


@contextlib.contextmanager
def nixl_head_planes(worker: Any, bounded: BoundedKVCaches) -> Iterator[None]:
    """Around ``NixlConnectorWorker.register_kv_caches(bounded.kv_caches)``: head-plane
    regions at the views' planes, registration cut to committed runs."""
    if not bounded.head_planes:
        yield
        return
    seg = bounded.plane_bytes  # upstream's spacing: num_blocks * block_stride

    def fix_bases(original: Any) -> Any:
        def set_region_layers(region_layers: Any) -> Any:
            bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
            for i, name in enumerate(worker.region_names):
                planes = bounded.head_planes.get(name)
                if planes is None:
                    continue
                h, rest = divmod(bases[i] - planes[0], seg)
                if rest or not 0 <= h < len(planes):
                    raise RuntimeError(f"NIXL region {i} of {name!r} at {bases[i]:#x} is not "
                                       f"where upstream's segmented path puts a head plane")
                bases[i] = planes[h]
            return original(region_layers)
        return set_region_layers

    committed = bounded.committed_ranges()

    def committed_only(original: Any) -> Any:
        def get_reg_descs(descs: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(descs, list) and descs and isinstance(descs[0], tuple):
                descs = split_to_committed(descs, committed)
            return original(descs, *args, **kwargs)
        return get_reg_descs

    with _instance_patch(worker, "_set_region_layers", fix_bases), \
            _instance_patch(worker.nixl_wrapper, "get_reg_descs", committed_only):
        yield


@contextlib.contextmanager
def simple_offload_head_planes(handler: Any, bounded: BoundedKVCaches) -> Iterator[None]:
    """Around ``SimpleCPUOffloadWorker.register_kv_caches(bounded.kv_caches)``: each head
    plane's ``[num_blocks, block_bytes]`` region at the view's plane."""
    if not bounded.head_planes:
        yield
        return

    def place(regions: dict[str, torch.Tensor]) -> None:
        for name, planes in bounded.head_planes.items():
            view = bounded.kv_caches[name]
            for h, addr in enumerate(planes):
                key = f"{name}.{h}"
                if key not in regions:
                    raise RuntimeError(f"SimpleCPUOffload named no region {key!r} (it has "
                                       f"{sorted(regions)[:4]}...): vLLM changed its naming")
                rows = regions[key]
                regions[key] = _bytes_at(view, addr, rows.numel()).view(rows.shape)

    def placing(original: Any) -> Any:
        def init_mode(regions: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            place(regions)  # the same dict upstream keeps as gpu_kv_caches
            return original(regions, *args, **kwargs)
        return init_mode

    with _instance_patch(handler, "_init_cpu_mode", placing), \
            _instance_patch(handler, "_init_disk_mode", placing):
        yield


def _plane_canonical(kv_caches: dict[str, torch.Tensor], cfg: Any, group_ids: list[int]
                     ) -> Any:
    """OffloadingConnector's canonical caches with one ``(num_blocks, head page)`` tensor
    per head plane of every LHBNC layer of the offloaded groups ``group_ids``."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    tensors: list[Any] = []
    refs_by_layer: dict[str, list[Any]] = {}
    for name, view in kv_caches.items():
        e = view.element_size()
        page = view.stride(0) * e  # one head's page: the plane's block stride
        refs_by_layer[name] = []
        for addr in view_head_planes(view):
            plane = _bytes_at(view, addr, cfg.num_blocks * page).view(cfg.num_blocks, page)
            tensors.append(CanonicalKVCacheTensor(tensor=plane, page_size_bytes=page))
            refs_by_layer[name].append(CanonicalKVCacheRef(tensor_idx=len(tensors) - 1,
                                                           page_size_bytes=page))
    groups = [[r for n in cfg.kv_cache_groups[g].layer_names for r in refs_by_layer[n]]
              for g in group_ids]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=groups)


@contextlib.contextmanager
def offloading_head_planes(worker: Any, kv_caches: dict[str, torch.Tensor], cfg: Any
                           ) -> Iterator[None]:
    """Around ``OffloadingConnectorWorker.register_kv_caches(kv_caches)`` for LHBNC (``cfg``
    its config): the canonical tensors are the head planes of every layer."""
    if getattr(cfg, "kv_cache_layout", None) != "LHBNC":
        yield
        return

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )

    def planes(original: Any) -> Any:
        def init_worker(canonical: Any) -> Any:
            groups = list(get_offloading_group_ids(cfg))
            return original(_plane_canonical(kv_caches, cfg, groups))
        return init_worker

    with _instance_patch(worker, "_init_worker", planes):
        yield
