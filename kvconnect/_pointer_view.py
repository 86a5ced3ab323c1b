"""Torch uint8 tensors over raw device or host pointers, sized exactly.

The tensor's ``untyped_storage().nbytes()`` equals ``nbytes`` and the tensor keeps
``owner`` alive, so memory cannot be unmapped by garbage collection while a view exists.
"""

from __future__ import annotations

import ctypes

import torch

from .vmm.base import DLPACK_CPU, VmmDriver


class _CudaArrayInterface:
    """Minimal ``__cuda_array_interface__`` (v3) holder; torch keeps it alive with the tensor."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def pointer_view(ptr: int, nbytes: int, driver: VmmDriver, owner: object) -> torch.Tensor:
    """A 1-D uint8 tensor over ``nbytes`` bytes at ``ptr`` on ``driver``'s device.

    ``owner`` is referenced by the tensor (host: through the ctypes buffer; GPU: through the
    ``__cuda_array_interface__`` object), so it outlives every view.
    """
    if nbytes <= 0:
        raise ValueError(f"a view needs a positive byte count, got {nbytes}")
    if driver.dlpack_device_type == DLPACK_CPU:
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf._kvconnect_owner = owner  # type: ignore[attr-defined]
        return torch.frombuffer(buf, dtype=torch.uint8)
    driver.ensure_context()
    return torch.as_tensor(_CudaArrayInterface(ptr, nbytes, owner), device=driver.torch_device)
