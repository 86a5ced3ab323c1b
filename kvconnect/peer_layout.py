"""One description of a peer's KV layout, and THE rule that says whether two peers match.

Every transport publishes a :class:`PeerLayout` and compares the other side's with
:meth:`PeerLayout.differences` before it moves a block: the NIXL handshake carries one, the
ipc export reply carries one, the validation harness publishes one per prefill, and the CPU
offload connector keeps one to check that the cache under its pool did not change.

A layout is built from committed regions (:meth:`PeerLayout.from_cache`,
:meth:`PeerLayout.from_regions`; :func:`kvconnect.views.committed_regions`) and the
page-sharing rule (:func:`kvconnect.views.page_owners`): each :class:`LayoutRegion` says
which region holds its bytes (``held_by``), so shared pages are described and moved once,
by their holder. It names no address: where the regions lie in the publishing process goes
beside it (the NIXL handshake's region addresses; the ipc reply's mapped tensors, which
``tensor_index`` and ``offset`` point into).

Units are in the names: ``block_len`` and ``block_stride`` are bytes of one *kernel* block,
``sub_blocks`` kernel blocks make one logical block, ``num_blocks`` counts logical blocks,
``block_size`` and ``kernel_block_size`` are tokens, ``offset`` is bytes.

What must match (:meth:`PeerLayout.differences`, the one compatibility rule):

- the config facts both sides know: ``block_size``, ``dtype``, ``layout`` (the page format's
  name) and ``kernel_block_size`` (a fact ``None`` on either side is not compared);
- the layer names, in order;
- the regions, paired by ``layer/part``: none missing on either side, and for each pair the
  same ``block_len``, ``block_stride``, ``sub_blocks`` and holder (the same regions share
  pages on both sides).

What may differ: ``num_blocks`` (a peer with more committed blocks is fine: each transfer
checks its block ids against both sides), the placement (``tensor_index``, ``segment``,
``offset``: another capacity puts the same page elsewhere), the order of the regions and
``kvconnect_version`` (informational; the schema tag, checked on parse, decides whether two
releases can talk). A different ``block_stride`` with the same ``block_len`` means the page
holds something else (other parts or layers, other padding), so it is refused even where a
copy engine could bridge it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

from .bounded_json import JSON, Doc, JSONObject, load_document
from .checks import MAX_BYTES
from .errors import KvconnectError
from .views import PagedRegion, block_span, page_owners

if TYPE_CHECKING:
    from .cache_source import KVCacheSource

__all__ = [
    "MAX_LAYOUT_BYTES", "PEER_LAYOUT_SCHEMA", "WIRE_VERSION", "LayoutFacts", "LayoutRegion",
    "PeerLayout",
    "PeerLayoutError", "kvconnect_version", "layout_facts",
]

#: config facts of a layout (:func:`layout_facts`): ``block_size`` and ``kernel_block_size``
#: (tokens, int), ``dtype`` and ``layout`` (str); ``None`` when unknown
LayoutFacts: TypeAlias = "dict[str, int | str | None]"

#: version of the layout document (bump when a field changes)
WIRE_VERSION = 1
#: schema tag of every layout document; another tag is refused
PEER_LAYOUT_SCHEMA = f"kvconnect.peer_layout/{WIRE_VERSION}"
#: largest layout document accepted as bytes or text
MAX_LAYOUT_BYTES = 16 * 1024 * 1024
#: most regions and layer names one layout may list, longest name, most kernel blocks per block
MAX_REGIONS = 1 << 16
MAX_NAME_CHARS = 1024
MAX_SUB_BLOCKS = 1 << 16
#: most logical blocks, tensors and segments a peer may claim
MAX_BLOCKS = 1 << 40
MAX_INDEX = 1 << 16
#: differences quoting many regions name this many of them
_QUOTED = 4

_HINT_CONFIG = "use the same KV cache config (model, dtype, layout, kernel block size) on both sides"


class PeerLayoutError(KvconnectError, ValueError):
    """A layout document is malformed, too large or of an unknown schema; the message names
    the field. Callers facing a peer turn it into their own error (MetadataError,
    IpcError)."""


def kvconnect_version() -> str:
    """The installed kvconnect version string (``"unknown"`` when it cannot be determined)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvconnect")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def layout_facts(config: object, **facts: int | str | None) -> LayoutFacts:
    """The config facts a layout carries, from a :class:`kvconnect.layout.KVCacheConfig`
    (or vLLM's, or any object with those fields, read with ``getattr``):
    ``block_size`` (tokens, of the first group with one), ``dtype`` (every spec dtype, in
    order, joined by ``","``), ``layout`` (the page format's name) and ``kernel_block_size``
    (tokens). Missing attributes give ``None``; ``config=None`` gives ``{}``. Keywords
    ``facts`` of those names (any other: TypeError) stand over the config's unless ``None``."""
    unknown = set(facts) - {"block_size", "dtype", "layout", "kernel_block_size"}
    if unknown:
        raise TypeError(f"unknown layout facts {sorted(unknown)}")
    given: LayoutFacts = {k: v for k, v in facts.items() if v is not None}
    if config is None:
        return given
    block_size = None
    dtypes: list[str] = []
    for group in getattr(config, "kv_cache_groups", ()) or ():
        spec = getattr(group, "kv_cache_spec", None)
        spec_block_size = getattr(spec, "block_size", None)
        if block_size is None and spec_block_size is not None:
            block_size = int(spec_block_size)
        found = list(getattr(spec, "dtypes", ()) or ())
        spec_dtype = getattr(spec, "dtype", None)
        if spec_dtype is not None:
            found.insert(0, spec_dtype)
        for dt in found:
            name = str(dt).removeprefix("torch.")
            if name not in dtypes:
                dtypes.append(name)
    kbs = getattr(config, "kernel_block_size", None)
    layout = getattr(config, "layout", None)
    return {"block_size": block_size, "dtype": ",".join(dtypes) or None,
            "layout": None if layout is None else str(layout),
            "kernel_block_size": None if kbs is None else int(kbs), **given}


@dataclass(frozen=True)
class LayoutRegion:
    """One committed region of a peer's layout (no address).

    Logical block ``b`` is ``sub_blocks`` kernel blocks of ``block_len`` bytes, ``block_stride``
    bytes apart: kernel blocks ``b * sub_blocks .. (b + 1) * sub_blocks - 1``. ``held_by`` is
    the index (in :attr:`PeerLayout.regions`) of the region whose blocks hold this one's
    bytes, ``-1`` when it holds its own (:func:`kvconnect.views.page_owners`).
    ``tensor_index`` / ``segment`` say which of the publisher's KV tensors and segments hold
    it and ``offset`` the bytes from the start of that tensor's reservation to block 0
    (``None`` when the regions were given without tensors: then addresses travel apart).
    """

    layer_name: str
    #: "k" / "v", "kv", "kv.<head>", "latent", "state" or "packed" (views.committed_regions)
    part: str
    block_len: int
    block_stride: int
    sub_blocks: int = 1
    held_by: int = -1
    tensor_index: int = 0
    segment: int = 0
    offset: int | None = None

    @property
    def key(self) -> str:
        """``"layer/part"``: pairs regions across peers and names them in messages."""
        return f"{self.layer_name}/{self.part}"

    @property
    def holds_own(self) -> bool:
        """True when no other region holds this one's bytes."""
        return self.held_by < 0

    @property
    def bytes_per_block(self) -> int:
        """Bytes of this region in one logical block: ``sub_blocks * block_len``."""
        return self.sub_blocks * self.block_len

    @property
    def logical_stride(self) -> int:
        """Bytes between logical blocks: ``sub_blocks * block_stride``."""
        return self.sub_blocks * self.block_stride

    def span(self, num_blocks: int) -> int:
        """Bytes from block 0's first byte to the last byte of ``num_blocks`` logical blocks."""
        return block_span(num_blocks * self.sub_blocks, self.block_stride, self.block_len)

    def to_json(self) -> JSONObject:
        """The region as a JSON object (the field names of :meth:`PeerLayout.to_json`)."""
        return {"layer": self.layer_name, "part": self.part, "block_len": self.block_len,
                "block_stride": self.block_stride, "sub_blocks": self.sub_blocks,
                "held_by": self.held_by, "tensor_index": self.tensor_index,
                "segment": self.segment, "offset": self.offset}


@dataclass(frozen=True)
class PeerLayout:
    """A peer's KV layout: its regions, its committed logical block count and the config
    facts both sides must share (module docstring: what must match, what may differ).

    ``block_size`` / ``kernel_block_size`` in tokens, ``dtype`` a dtype name (several joined
    by ``","`` for Mamba states), ``layout`` the page format's name; ``None`` when unknown.
    ``layer_names``: every layer whose KV the regions hold (a packed region holds all).
    """

    regions: tuple[LayoutRegion, ...]
    num_blocks: int
    block_size: int | None = None
    dtype: str | None = None
    layout: str | None = None
    kernel_block_size: int | None = None
    layer_names: tuple[str, ...] = ()
    kvconnect_version: str = field(default_factory=kvconnect_version)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regions", tuple(self.regions))
        object.__setattr__(self, "layer_names", tuple(self.layer_names))

    # -- building ------------------------------------------------------------------------
    @classmethod
    def from_regions(cls, regions: Sequence[PagedRegion], num_blocks: int | None = None, *,
                     tensor_bases: Sequence[int] | None = None, config: object = None,
                     **facts: int | str | None) -> PeerLayout:
        """The layout of committed ``regions`` (:class:`kvconnect.views.CommittedRegion`, or
        any :class:`~kvconnect.views.PagedRegion`) of a cache with ``num_blocks`` logical
        blocks (default: the greatest common divisor of the regions' block counts).

        A region of ``k * num_blocks`` blocks has ``sub_blocks = k``. ``tensor_bases[i]``:
        the first byte of KV tensor ``i`` (gives each region's ``offset``). Facts come from
        ``config`` (:func:`layout_facts`), then from the keywords ``block_size``, ``dtype``,
        ``layout``, ``kernel_block_size``. Raises :class:`PeerLayoutError` (a ValueError)
        for no regions, overlapping blocks or a block count not a multiple of ``num_blocks``,
        and ``ValueError`` for regions that share bytes without one holding the other.
        """
        info = layout_facts(config, **facts)
        regions = list(regions)
        if not regions:
            raise PeerLayoutError("the cache reports no committed regions")
        counts = [int(r.num_blocks) for r in regions]
        n = math.gcd(*counts) if num_blocks is None else int(num_blocks)
        if n <= 0:
            raise PeerLayoutError(f"num_blocks must be positive, got {n}")
        out: list[LayoutRegion] = []
        layers: dict[str, None] = {}  # an ordered set
        for r, owner, count in zip(regions, page_owners(regions), counts, strict=True):
            _check_geometry(r, count, n)
            for name in getattr(r, "layers", ()) or (r.layer_name,):
                layers.setdefault(str(name))
            tensor_index = int(getattr(r, "tensor_index", 0))
            out.append(LayoutRegion(
                str(r.layer_name), str(r.part), int(r.block_len), int(r.block_stride),
                count // n, -1 if owner == len(out) else owner, tensor_index,
                int(getattr(r, "segment", 0)),
                None if tensor_bases is None else int(r.base_ptr) - tensor_bases[tensor_index]))
        return cls(tuple(out), n, block_size=_int_fact(info, "block_size"),
                   dtype=_str_fact(info, "dtype"), layout=_str_fact(info, "layout"),
                   kernel_block_size=_int_fact(info, "kernel_block_size"),
                   layer_names=tuple(layers))

    @classmethod
    def from_cache(cls, cache: KVCacheSource, regions: Sequence[PagedRegion] | None = None
                   ) -> PeerLayout:
        """The layout of an :class:`~kvconnect.kv_cache.ExtensibleKVCache`'s committed
        regions (``regions``: ``cache.committed_regions()`` already taken, to keep their
        order), offsets from its tensors' bases, facts from its config."""
        regions = cache.committed_regions() if regions is None else regions
        return cls.from_regions(regions, int(cache.num_blocks),
                                tensor_bases=[t.base_ptr for t in cache.tensors],
                                config=cache.config)

    # -- reading -------------------------------------------------------------------------
    def holders(self) -> Iterator[tuple[int, LayoutRegion, tuple[str, ...]]]:
        """``(index, region, members)`` of each region that holds its own bytes, in order;
        ``members``: the ``layer/part`` of every region it holds, its own included, in
        region order (as :func:`kvconnect.views.page_holders`). Moving the holders' blocks moves every region's bytes once."""
        members: dict[int, list[str]] = {}
        for i, r in enumerate(self.regions):
            members.setdefault(i if r.holds_own else r.held_by, []).append(r.key)
        for i, names in members.items():
            yield i, self.regions[i], tuple(names)

    def region(self, key: str) -> LayoutRegion:
        """The region named ``key`` (``"layer/part"``); ``KeyError`` when there is none."""
        for r in self.regions:
            if r.key == key:
                return r
        raise KeyError(f"no region {key!r} in this layout")

    def kernel_blocks(self, region: LayoutRegion) -> int:
        """Committed kernel blocks of ``region``: ``num_blocks * sub_blocks``."""
        return self.num_blocks * region.sub_blocks

    def paged_region(self, index: int, base_ptr: int, device: str) -> PagedRegion:
        """Region ``index`` placed at ``base_ptr`` on ``device`` (the publisher's address,
        from beside the layout), in kernel blocks: what descriptors and the page-sharing rule
        read."""
        r = self.regions[index]
        return PagedRegion(r.layer_name, r.part, int(base_ptr), r.block_len, r.block_stride,
                           self.kernel_blocks(r), device)

    # -- the rule ------------------------------------------------------------------------
    def differences(self, remote: PeerLayout) -> list[str]:
        """What does not match between this (local) layout and ``remote``, one readable
        sentence each (region, field, local and remote values, what to change); ``[]`` when
        blocks can move between them. See the module docstring for the rule."""
        diffs: list[str] = []
        for name, unit in (("block_size", " (tokens)"), ("dtype", ""), ("layout", ""),
                           ("kernel_block_size", " (tokens)")):
            mine, theirs = getattr(self, name), getattr(remote, name)
            if mine is not None and theirs is not None and mine != theirs:
                diffs.append(f"{name}{unit}: local {mine} != remote {theirs}: {_HINT_CONFIG}")
        if self.layer_names != remote.layer_names:
            what = ("number of layers", len(self.layer_names), len(remote.layer_names)) \
                if len(self.layer_names) != len(remote.layer_names) else \
                ("layer names", _short(self.layer_names), _short(remote.layer_names))
            diffs.append(f"{what[0]}: local {what[1]} != remote {what[2]}: both sides must "
                         "run the same model")
        ours = {r.key: r for r in self.regions}
        theirs = {r.key: r for r in remote.regions}
        missing = [k for k in ours if k not in theirs]
        extra = [k for k in theirs if k not in ours]
        if missing:
            diffs.append(f"regions missing on remote: {_short(missing)}: {_HINT_CONFIG}")
        if extra:
            diffs.append(f"regions only on remote: {_short(extra)}: {_HINT_CONFIG}")
        grouped: dict[tuple[str, object, object], list[str]] = {}
        for key, mine in ours.items():
            other = theirs.get(key)
            if other is None:
                continue
            for name, a, b in _region_facts(self, mine, remote, other):
                if a != b:
                    grouped.setdefault((name, a, b), []).append(key)
        for (name, a, b), keys in grouped.items():
            where = f"region {keys[0]}" if len(keys) == 1 else \
                f"{len(keys)} regions ({_short(keys, _QUOTED)})"
            hint = ("the layers share pages differently" if name.startswith("holder")
                    else "the KV page differs")
            diffs.append(f"{name} of {where}: local {a} != remote {b}: {hint}; {_HINT_CONFIG}")
        return diffs

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self) -> JSONObject:
        """The layout as a JSON object (embed it in a message, or ``json.dumps`` it)."""
        return {"schema": PEER_LAYOUT_SCHEMA, "num_blocks": self.num_blocks,
                "block_size": self.block_size, "dtype": self.dtype, "layout": self.layout,
                "kernel_block_size": self.kernel_block_size,
                "kvconnect_version": self.kvconnect_version, "layers": list(self.layer_names),
                "regions": [r.to_json() for r in self.regions]}

    @classmethod
    def from_json(cls, doc: JSON, *, where: str = "layout", max_bytes: int = MAX_LAYOUT_BYTES,
                  error: type[Exception] = PeerLayoutError) -> PeerLayout:
        """A peer's layout from :meth:`to_json`'s object, or from its JSON bytes or text
        (parsed with bounded nesting and integers, at most ``max_bytes``). Every field is
        type- and range-checked; anything off raises ``error`` (:class:`PeerLayoutError`, or
        the caller's own) naming the field as ``<where>.<field>``, never TypeError / KeyError."""
        d = load_document(doc, max_bytes, where, error) \
            if isinstance(doc, (bytes, bytearray, str)) else Doc(doc, where, error)
        d.check_version("schema", PEER_LAYOUT_SCHEMA, "layout schema")
        num_blocks = d.integer("num_blocks", 1, MAX_BLOCKS)
        items = d.children("regions", MAX_REGIONS)
        regions = tuple(_region_from_json(x, len(items)) for x in items)
        layers = tuple(d.strings("layers", MAX_REGIONS, MAX_NAME_CHARS, min_chars=1))
        _check_regions(d, regions, num_blocks)
        return cls(regions, num_blocks, block_size=d.optional_integer("block_size", 1, MAX_BLOCKS),
                   dtype=d.optional_string("dtype", MAX_NAME_CHARS),
                   layout=d.optional_string("layout", MAX_NAME_CHARS),
                   kernel_block_size=d.optional_integer("kernel_block_size", 1, MAX_BLOCKS),
                   layer_names=layers,
                   kvconnect_version=d.optional_string("kvconnect_version", MAX_NAME_CHARS)
                   or "unknown")


# -- helpers ---------------------------------------------------------------------------------
def _int_fact(facts: LayoutFacts, key: str) -> int | None:
    value = facts.get(key)
    return None if value is None else int(value)


def _str_fact(facts: LayoutFacts, key: str) -> str | None:
    value = facts.get(key)
    return None if value is None else str(value)


def _short(items: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _region_facts(layout: PeerLayout, r: LayoutRegion, remote: PeerLayout, o: LayoutRegion
                  ) -> list[tuple[str, object, object]]:
    """``(field, local value, remote value)`` of what must match between paired regions."""
    def holder(lay: PeerLayout, x: LayoutRegion) -> str:
        return "itself" if x.holds_own else lay.regions[x.held_by].key

    return [("block_len (bytes per kernel block)", r.block_len, o.block_len),
            ("block_stride (bytes between kernel blocks)", r.block_stride, o.block_stride),
            ("sub_blocks (kernel blocks per block)", r.sub_blocks, o.sub_blocks),
            ("holder (region whose pages hold its bytes)", holder(layout, r),
             holder(remote, o))]


def _check_geometry(r: PagedRegion, count: int, num_blocks: int) -> None:
    """A region's blocks must be disjoint and its block count a multiple of the cache's."""
    if r.block_len <= 0 or r.block_stride < r.block_len:
        raise PeerLayoutError(f"region {r.layer_name}/{r.part}: block_len {r.block_len} and "
                              f"block_stride {r.block_stride} bytes do not describe disjoint "
                              "blocks")
    if count <= 0 or count % num_blocks:
        raise PeerLayoutError(f"region {r.layer_name}/{r.part} has {count} committed blocks, "
                              f"not a multiple of the cache's {num_blocks} logical blocks")


def _check_regions(d: Doc, regions: Sequence[LayoutRegion], num_blocks: int) -> None:
    """What a parsed layout must satisfy beyond its fields' types and ranges."""
    seen: set[str] = set()
    for i, r in enumerate(regions):
        at = f"{d.where}.regions[{i}]"
        if r.key in seen:
            raise d.error(f"{at}: lists layer/part {r.key!r} twice")
        seen.add(r.key)
        if r.block_stride < r.block_len:
            raise d.error(f"{at}.block_stride {r.block_stride} is below block_len "
                          f"{r.block_len}: its blocks would overlap")
        if r.span(num_blocks) > MAX_BYTES:
            raise d.error(f"{at}: {num_blocks} blocks span more than 2**63-1 bytes")
        if r.held_by == i or (r.held_by >= 0 and not regions[r.held_by].holds_own):
            raise d.error(f"{at}.held_by {r.held_by} does not name a region that "
                          "holds its own bytes")


def _region_from_json(d: Doc, count: int) -> LayoutRegion:
    return LayoutRegion(
        layer_name=d.string("layer", MAX_NAME_CHARS, 1), part=d.string("part", MAX_NAME_CHARS, 1),
        block_len=d.integer("block_len", 1, MAX_BYTES),
        block_stride=d.integer("block_stride", 1, MAX_BYTES),
        sub_blocks=d.integer("sub_blocks", 1, MAX_SUB_BLOCKS),
        held_by=d.integer("held_by", -1, count - 1),
        tensor_index=d.integer("tensor_index", 0, MAX_INDEX),
        segment=d.integer("segment", 0, MAX_INDEX),
        offset=d.optional_integer("offset", 0, MAX_BYTES))
