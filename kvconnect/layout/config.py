"""A KV cache config: blocks, where every layer's pages sit, and the layers' specs.

kvconnect describes memory the way vLLM 0.33 does. A :class:`KVCacheTensor` places a set of
same-shaped layers in a backing buffer: layer ``layers[l]``'s page for block ``b`` starts
at ``offset + l * layer_stride + b * block_stride`` bytes. Layer-outer layouts give each
layer a block-prefix region (``layer_stride >= num_blocks * block_stride``); block-outer
layouts make each block one row of every layer's page (``layer_stride`` = a page,
``block_stride`` = the row). Tensors that place layers at the same bytes alias them
(cache groups overlaying each other, hybrid models).

Two forms of :class:`KVCacheTensor`, one model:

- the *placement* form (vLLM 0.33's own fields, ``layer_stride`` and ``block_stride``
  given): every tensor of the config shares ONE backing buffer of ``size`` bytes;
- the *shorthand* form ``KVCacheTensor(size, layers)`` (the seed's): the tensor is its own
  buffer of ``size`` bytes for the config's ``num_blocks``; its layers alias the buffer
  (hybrid models) or, for the ``packed`` layout, fill each block row in order. The planner
  expands it into placements (one buffer per tensor); nothing else treats it specially.

``layout`` names the page format (:mod:`.formats`): vLLM 0.33's six (``LBHNC`` ...) or the
seed's five (``kv_split_nhd`` ...). Units: bytes unless a name says blocks or tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ..bounded_json import JSON, Doc, JSONObject
from ..checks import MAX_BYTES, checked_int
from .plan import plan_layout
from .specs import KVCacheSpec, LayoutError

__all__ = ["KVCacheConfig", "KVCacheGroupSpec", "KVCacheTensor"]


@dataclass(frozen=True)
class KVCacheTensor:
    """Where ``layers`` live: vLLM 0.33's ``KVCacheTensor(size, layers, layer_stride,
    block_stride, offset, host_resident)``, or the seed's shorthand ``(size, layers)``
    (strides ``None``; see the module docstring)."""

    size: int
    layers: tuple[str, ...]
    layer_stride: int | None = None
    block_stride: int | None = None
    offset: int = 0
    host_resident: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if (self.layer_stride is None) != (self.block_stride is None):
            raise LayoutError(f"KVCacheTensor{self.layers}: give both layer_stride and "
                              f"block_stride (placement form) or neither (shorthand form)")

    @property
    def is_placement(self) -> bool:
        """True for vLLM 0.33's placement form (strides given)."""
        return self.layer_stride is not None

    def to_dict(self) -> JSONObject:
        out: JSONObject = {"size": self.size, "layers": list(self.layers)}
        if self.is_placement:
            out.update(layer_stride=self.layer_stride, block_stride=self.block_stride,
                       offset=self.offset)
        if self.host_resident:
            out["host_resident"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON], where: str = "kv_cache_tensor") -> KVCacheTensor:
        """The tensor :meth:`to_dict` described (``shared_by`` is accepted for ``layers``);
        any malformed field raises LayoutError."""
        t = Doc(d, where, LayoutError)
        t.refuse_unknown({"size", "layers", "shared_by", "layer_stride", "block_stride",
                          "offset", "host_resident"})
        names = t.strings("shared_by" if "shared_by" in d and "layers" not in d else "layers",
                          max_chars=MAX_BYTES)
        return cls(t.integer("size", 1), tuple(names),
                   t.optional_integer("layer_stride", 1), t.optional_integer("block_stride", 1),
                   t.integer("offset", 0, default=0), t.boolean("host_resident", default=False))


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec (and one block table)."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True)
class KVCacheConfig:
    """A KV cache: ``num_blocks`` logical blocks, its tensors and its layer groups.

    ``layout`` is a page format name (:data:`kvconnect.layout.LAYOUTS`);
    ``kernel_block_size`` (tokens, dividing every attention block size) splits each logical
    block into ``block_size // kernel_block_size`` kernel blocks; ``None`` means no split.
    In the placement form ``num_blocks`` may be below the blocks the placement was made
    for (a committed prefix of a larger reservation; :func:`plan_layout` refuses more).
    """

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    layout: str = "kv_split_nhd"
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))

    @property
    def layer_names(self) -> list[str]:
        """Every layer, in group order."""
        return [n for g in self.kv_cache_groups for n in g.layer_names]

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        return {n: g.kv_cache_spec for g in self.kv_cache_groups for n in g.layer_names}

    @property
    def is_placement(self) -> bool:
        """True when the tensors use vLLM 0.33's placement form (one backing buffer)."""
        return bool(self.kv_cache_tensors) and self.kv_cache_tensors[0].is_placement

    @property
    def bytes_per_block(self) -> int:
        """Bytes one logical block takes over all buffers (aliased pages count once)."""
        return plan_layout(self).bytes_per_block

    def with_num_blocks(self, num_blocks: int) -> KVCacheConfig:
        """The same cache laid out for a fresh allocation of ``num_blocks`` blocks (sizes,
        and in layer-outer placements the strides and offsets, scaled)."""
        checked_int("num_blocks", num_blocks)
        if not self.is_placement:
            tensors = tuple(replace(t, size=t.size // self.num_blocks * num_blocks)
                            for t in self.kv_cache_tensors)
            return replace(self, num_blocks=num_blocks, kv_cache_tensors=tensors)
        plan = plan_layout(self)
        alloc = plan.alloc_blocks
        out = []
        for t in self.kv_cache_tensors:
            assert t.layer_stride is not None
            if plan.block_outer:
                out.append(replace(t, size=t.size // alloc * num_blocks))
            else:
                out.append(replace(t, size=t.size // alloc * num_blocks,
                                   layer_stride=t.layer_stride // alloc * num_blocks,
                                   offset=t.offset // alloc * num_blocks))
        return replace(self, num_blocks=num_blocks, kv_cache_tensors=tuple(out))

    def to_dict(self) -> JSONObject:
        """A JSON-serialisable description (for handshakes: compare, never unpickle)."""
        return {
            "num_blocks": self.num_blocks,
            "layout": self.layout,
            "kernel_block_size": self.kernel_block_size,
            "kv_cache_tensors": [t.to_dict() for t in self.kv_cache_tensors],
            "kv_cache_groups": [{"layer_names": list(g.layer_names),
                                 "kv_cache_spec": g.kv_cache_spec.to_dict()}
                                for g in self.kv_cache_groups],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, JSON]) -> KVCacheConfig:
        """The config :meth:`to_dict` described. Every field is checked (types, positive
        ints, known spec kinds and dtypes); anything malformed raises LayoutError. Whether
        the config can be laid out is :func:`plan_layout`'s to say."""
        c = Doc(d, "KV cache config", LayoutError)
        c.refuse_unknown({"num_blocks", "kv_cache_tensors", "kv_cache_groups", "layout",
                          "kernel_block_size"})
        tensors = [KVCacheTensor.from_dict(t, f"kv_cache_tensors[{i}]") for i, t in
                   enumerate(c.array("kv_cache_tensors"))]
        groups = []
        for i, g in enumerate(c.array("kv_cache_groups")):
            group = Doc(g, f"kv_cache_groups[{i}]", LayoutError)
            groups.append(KVCacheGroupSpec(tuple(group.strings("layer_names", max_chars=MAX_BYTES)),
                                           KVCacheSpec.from_dict(group.raw("kv_cache_spec"))))
        return cls(
            num_blocks=c.integer("num_blocks", 1),
            kv_cache_tensors=tuple(tensors),
            kv_cache_groups=tuple(groups),
            layout=c.string("layout", MAX_BYTES, default="kv_split_nhd"),
            kernel_block_size=c.optional_integer("kernel_block_size", 1),
        )
