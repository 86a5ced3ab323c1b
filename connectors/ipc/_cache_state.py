"""CacheState: whether a KV cache's commit state is still what a copy plan was built against,
checked cheaply enough for every fetch.

A plan built over a cache's committed memory depends on its *token*: the logical block count
and every tensor's committed bytes and physical chunk count. Reading it costs a lock and a sum
per tensor (tens of microseconds for a 32-tensor cache), so a fetch reads the *versions*
instead: the block count and every tensor's ``state_version``, which moves on every call that
may change the mapped state. Only when a version moved is the token read again: a sleep / wake
cycle moves the versions and brings the same token back, and the plan still fits.
"""

from __future__ import annotations

from kvconnect.cache_source import KVCacheSource

__all__ = ["CacheState"]


class CacheState:
    """``cache``'s commit state now (taken at construction), to check later with
    :meth:`unchanged`."""

    def __init__(self, cache: KVCacheSource) -> None:
        self.cache = cache
        self.versions = self._versions()  # before the token: a change in between is seen
        self.token = self._token()

    def _versions(self) -> object:
        return (self.cache.num_blocks, tuple(t.state_version for t in self.cache.tensors))

    def _token(self) -> object:
        return (int(self.cache.num_blocks),
                tuple((t.committed_bytes, t.num_physical_chunks) for t in self.cache.tensors))

    def unchanged(self) -> bool:
        """True while the token is what it was at construction (one int per tensor read while
        no version moved)."""
        versions = self._versions()
        if versions == self.versions:
            return True
        if self._token() != self.token:
            return False
        self.versions = versions
        return True
