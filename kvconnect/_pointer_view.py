"""Torch uint8 tensors over raw device or host pointers, sized exactly and tracked.

The tensor's ``untyped_storage().nbytes()`` equals ``nbytes``. Every view's storage holds one
:class:`ViewAnchor`, which keeps ``owner`` alive (so memory cannot be unmapped by garbage
collection while a view exists) and sits in the owner's :class:`weakref.WeakSet`: the set
holds exactly the anchors of views (and tensors derived from them) still referenced, which
is how an owner knows it must not release memory under them.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

from .checks import checked_int
from .vmm.base import VmmDriver


class ViewAnchor:
    """Referenced by one view's storage; keeps ``owner`` alive and is weakly tracked."""

    __slots__ = ("owner", "__weakref__")

    def __init__(self, owner: object) -> None:
        self.owner = owner


class _CudaArrayInterface:
    """Minimal ``__cuda_array_interface__`` (v3) holder; torch keeps it alive with the tensor
    (and it keeps ``keep`` alive). The one such holder in kvconnect."""

    def __init__(self, ptr: int, nbytes: int, keep: object) -> None:
        self._keep = keep
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def bytes_tensor(ptr: int, nbytes: int, device: torch.device, keep: object) -> torch.Tensor:
    """A 1-D uint8 tensor over ``nbytes`` bytes at ``ptr`` on ``device`` (``cpu`` or
    ``cuda``), whose storage is exactly those bytes and references ``keep``. Nothing is read
    or checked: the caller vouches for the range (and, on CUDA, for the current context)."""
    if device.type == "cpu":
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf._kvconnect_keep = keep  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)
    if device.type == "cuda":
        return torch.as_tensor(_CudaArrayInterface(ptr, nbytes, keep), device=device)
    raise ValueError(f"cannot view raw bytes on device type {device.type!r}")


def pointer_view(ptr: int, nbytes: int, driver: VmmDriver, owner: object,
                 views: weakref.WeakSet[ViewAnchor] | None = None) -> torch.Tensor:
    """A 1-D uint8 tensor over ``nbytes`` bytes at ``ptr`` on ``driver``'s device.

    ``owner`` is referenced by the tensor's storage (host: through the ctypes buffer; GPU:
    through the ``__cuda_array_interface__`` object), so it outlives every view; ``views``,
    if given, gets the view's anchor (it leaves the set when the last tensor sharing the
    storage is gone).
    """
    checked_int("view size in bytes", nbytes)
    checked_int("view address", ptr, maximum=(1 << 64) - 1)
    anchor = ViewAnchor(owner)
    driver.ensure_context()  # a no-op on the host
    view = bytes_tensor(ptr, nbytes, torch.device(driver.torch_device), anchor)
    if views is not None:
        views.add(anchor)
    return view
