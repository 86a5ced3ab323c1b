"""What one layer stores per block: the KV cache specs (mirroring vLLM's) and dtype helpers.

A spec says how many bytes one logical block of a layer takes (``page_size_bytes``) and
what the bytes mean (K and V per token and head, one latent vector, Mamba states). Where
the bytes sit is the job of :mod:`.config` (placements) and :mod:`.formats` (page formats).

Units: ``block_size`` is tokens per logical block; sizes are bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..bounded_json import JSON, Doc, JSONObject, json_int, json_list, json_str
from ..checks import MAX_BYTES
from ..errors import KvconnectError

__all__ = [
    "AttentionSpec", "FullAttentionSpec", "KVCacheSpec", "LayoutError", "MLAAttentionSpec",
    "MambaSpec", "SlidingWindowSpec", "dtype_from_name", "dtype_name", "itemsize",
]


class LayoutError(KvconnectError, ValueError):
    """A config that cannot be laid out (or does not match the tensors); says why."""


# -- dtypes -------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (for JSON)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Inverse of :func:`dtype_name`; accepts a dtype as is."""
    if isinstance(name, torch.dtype):
        return name
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


def itemsize(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


# -- specs --------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV format of one layer. ``block_size`` is tokens per logical block."""

    block_size: int

    @property
    def page_size_bytes(self) -> int:
        """Bytes one logical block of this layer occupies (padding included)."""
        raise NotImplementedError

    def to_dict(self) -> JSONObject:
        out: JSONObject = {"kind": type(self).__name__}
        for f in self.__dataclass_fields__:
            v = getattr(self, f)
            if isinstance(v, torch.dtype):
                v = dtype_name(v)
            elif f == "dtypes":
                v = [dtype_name(d) for d in v]
            elif f == "shapes":
                v = [list(s) for s in v]
            out[f] = v
        return out

    @staticmethod
    def from_dict(d: Mapping[str, JSON]) -> KVCacheSpec:
        """The spec :meth:`to_dict` described; any malformed field raises LayoutError."""
        kinds = {c.__name__: c for c in (FullAttentionSpec, SlidingWindowSpec,
                                         MLAAttentionSpec, MambaSpec)}
        kind = Doc(d, "a KV cache spec", LayoutError).raw("kind", None)
        if not isinstance(kind, str) or kind not in kinds:
            raise LayoutError(f"unknown KV cache spec kind {kind!r:.60}; expected one of "
                              f"{list(kinds)}")
        spec = Doc(d, kind, LayoutError)
        spec.refuse_unknown({"kind"} | {f.name for f in fields(kinds[kind])})
        args: dict[str, Any] = {}
        for name in (n for n in d if n != "kind"):
            if name == "dtype":
                args[name] = _dtype(spec.at(name), d[name])
            elif name == "dtypes":
                args[name] = tuple(_dtype(f"{spec.at(name)}[{i}]", x)
                                   for i, x in enumerate(spec.array(name)))
            elif name == "shapes":
                rows = [json_list(f"{spec.at(name)}[{i}]", x, LayoutError)
                        for i, x in enumerate(spec.array(name))]
                args[name] = tuple(tuple(json_int(f"{spec.at(name)}[{i}]", v, LayoutError, 1)
                                         for v in row) for i, row in enumerate(rows))
            else:  # sizes and counts; page_size_padded may be null
                args[name] = spec.optional_integer(name, 1) if name == "page_size_padded" \
                    else spec.integer(name, 1)
        try:
            return kinds[kind](**args)
        except TypeError as exc:  # a required field is missing
            raise LayoutError(f"{kind}: {exc}") from None


def layout_int(what: str, value: object, minimum: int = 1) -> int:
    """``value`` if it is an int ``>= minimum`` (:func:`kvconnect.checks.checked_int`), else
    :class:`LayoutError` naming ``what`` (config fields, sizes and counts of a layout)."""
    return json_int(what, value, LayoutError, minimum)


def _padded(real: int, padded: int | None, what: str) -> int:
    """A page of ``real`` bytes (``what``) padded to ``padded`` (``page_size_padded``)."""
    if padded is not None and padded < real:
        raise LayoutError(f"page_size_padded {padded} is below {what}")
    return real if padded is None else padded


def _dtype(what: str, value: object) -> torch.dtype:
    """A dtype field (name or torch.dtype) of a spec dict, or LayoutError."""
    name = value if isinstance(value, torch.dtype) else json_str(what, value, LayoutError,
                                                                 MAX_BYTES)
    try:
        return dtype_from_name(name)
    except ValueError as exc:
        raise LayoutError(f"{what}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged attention: per token ``num_kv_heads`` heads of ``head_size`` elements of
    ``dtype``. ``page_size_padded`` (bytes) pads the page, as hybrid models do."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    page_size_padded: int | None = None

    #: K and V (2) or one latent vector (1) per token and head
    kv_factor = 2

    @property
    def content_bytes(self) -> int:
        """Bytes per (head, token): K and V (or the latent vector). vLLM 0.33's ``C``."""
        return self.kv_factor * self.head_size * itemsize(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one logical block without padding."""
        return self.block_size * self.num_kv_heads * self.content_bytes

    @property
    def page_size_bytes(self) -> int:
        real = self.real_page_size_bytes
        return _padded(real, self.page_size_padded, f"the real page size {real} bytes")


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention: every token keeps its K and V."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention (same page format; ``sliding_window`` tokens matter)."""

    sliding_window: int


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(AttentionSpec):
    """Multi-head latent attention: one latent vector per token (``head_size`` =
    ``kv_lora_rank + qk_rope_head_dim``), ``num_kv_heads`` = 1, no K/V split."""

    num_kv_heads: int = 1
    kv_factor = 1

    @classmethod
    def latent(cls, *, block_size: int, kv_lora_rank: int, qk_rope_head_dim: int,
               dtype: torch.dtype) -> MLAAttentionSpec:
        return cls(block_size=block_size, head_size=kv_lora_rank + qk_rope_head_dim, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Mamba state: per logical block, one tensor per entry of ``shapes`` / ``dtypes``,
    stored one after the other from the page start. ``page_size_padded`` pads the page."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    page_size_padded: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shapes", tuple(tuple(int(v) for v in s) for s in self.shapes))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        if len(self.shapes) != len(self.dtypes) or not self.shapes:
            raise LayoutError(f"MambaSpec needs one dtype per state shape, got {len(self.shapes)} "
                              f"shapes and {len(self.dtypes)} dtypes")

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Bytes of each state tensor for one block."""
        return tuple(math.prod(s) * itemsize(d)
                     for s, d in zip(self.shapes, self.dtypes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        real = sum(self.state_bytes)
        return _padded(real, self.page_size_padded, f"the {real} bytes of the Mamba states")
