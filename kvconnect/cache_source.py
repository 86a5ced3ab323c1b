"""KVCacheSource: what a connector reads from an extensible KV cache (a typing Protocol).

Connectors (the NIXL worker, the CPU offload connector, the ipc transport) take their geometry
only from the *committed* extent. This protocol names every member they read, and nothing
else, so their signatures say what they take:

- ``committed_regions()``: the registration regions (:class:`~kvconnect.views.CommittedRegion`),
  re-derived after every wake;
- ``num_blocks`` (committed logical blocks), ``capacity_blocks`` (reserved logical blocks),
  ``config`` (the :class:`~kvconnect.layout.KVCacheConfig` the cache was planned from: the
  layout facts of its :class:`~kvconnect.peer_layout.PeerLayout`), ``device``;
- ``is_final`` (registration is legal only after the final commit) and ``is_released``
  (asleep: physical memory released, addresses kept);
- ``tensors``: the :class:`~kvconnect.tensor.ExtensibleTensor` of each KV tensor
  (``CommittedRegion.tensor_index``): their bases give a layout's offsets, their
  ``committed_view`` bounded views, their ``physical_chunks`` what NIXL registers, their
  ``export_handles`` what the ipc transport sends, and their committed bytes and chunk counts
  tell a connector that the commit state changed (a sleep / wake cycle brings the same back);
  their ``state_version`` moves on every such call, a check cheap enough for every transfer.

:class:`~kvconnect.kv_cache.ExtensibleKVCache` and :class:`kvconnect.vllm.VllmKVCache` satisfy
it. It is ``runtime_checkable``: ``isinstance(x, KVCacheSource)`` checks that the members
exist, not their types. Units: bytes unless a name says blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .layout import KVCacheConfig
from .tensor import ExtensibleTensor
from .views import CommittedRegion

__all__ = ["KVCacheSource"]


@runtime_checkable
class KVCacheSource(Protocol):
    """The members of a KV cache that connectors read (module docstring)."""

    @property
    def config(self) -> KVCacheConfig:
        """The config the cache was planned from (layout facts; its ``num_blocks`` is the
        planned count, not the committed one)."""
        ...

    @property
    def num_blocks(self) -> int:
        """Logical blocks committed now."""
        ...

    @property
    def capacity_blocks(self) -> int:
        """Logical blocks the reservation holds."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the KV memory lives."""
        ...

    @property
    def is_final(self) -> bool:
        """True once the final size is committed (connectors may register from then on)."""
        ...

    @property
    def is_released(self) -> bool:
        """True while asleep (physical memory released; touching it faults)."""
        ...

    @property
    def tensors(self) -> Sequence[ExtensibleTensor]:
        """One ExtensibleTensor per KV tensor, in ``CommittedRegion.tensor_index`` order."""
        ...

    def committed_regions(self) -> list[CommittedRegion]:
        """Registration regions of the committed blocks, each inside committed memory."""
        ...
