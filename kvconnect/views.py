"""Committed-extent helpers: the only KV geometry a connector should ever see.

(Seeded with the region type; the helpers are being written.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommittedRegion:
    """One registration region of one layer, inside committed memory.

    Units: bytes unless named ``*_blocks``. Block ``b`` of this region starts at
    ``base_ptr + b * block_stride`` and is ``block_len`` bytes long.
    """

    layer_name: str
    #: "k" / "v" (K/V split), "kv" (blocks-first), "latent" (MLA), "state" (Mamba, states summed),
    #: "packed" (one block_stride row holding every layer's page)
    part: str
    base_ptr: int
    block_len: int
    block_stride: int
    num_blocks: int
    device: str
    #: index into the cache's ExtensibleTensor list, and the segment inside it
    tensor_index: int = 0
    segment: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes this region owns: ``num_blocks * block_len``."""
        return self.num_blocks * self.block_len

    @property
    def span(self) -> int:
        """Bytes from the first block's start to the last block's end."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.block_len

    def block_address(self, block_id: int) -> int:
        """Address of block ``block_id`` (must be below ``num_blocks``)."""
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(
                f"block {block_id} outside the {self.num_blocks} committed blocks of "
                f"{self.layer_name}/{self.part}"
            )
        return self.base_ptr + block_id * self.block_stride
