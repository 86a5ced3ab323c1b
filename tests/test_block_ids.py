"""kvconnect.block_ids: the one accepted block-id input type and its one conversion."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import kvconnect
from kvconnect.block_ids import BlockIdsError, as_block_ids
from kvconnect.errors import KvconnectError


@pytest.mark.parametrize("ids", [
    [3, 0, 7], (3, 0, 7), range(3, 4), iter([3, 0, 7]), (i for i in (3, 0, 7)),
    np.array([3, 0, 7], dtype=np.uint16), np.array([3, 0, 7], dtype=np.int32),
    torch.tensor([3, 0, 7]), torch.tensor([3, 0, 7], dtype=torch.int32),
    [np.int64(3), np.int32(0), 7],
], ids=["list", "tuple", "range", "iterator", "generator", "uint16", "int32", "tensor",
        "tensor-int32", "numpy-scalars"])
def test_every_accepted_kind_becomes_1d_int64(ids: object) -> None:
    out = as_block_ids(ids)  # type: ignore[arg-type]
    assert out.dtype == np.int64 and out.ndim == 1
    assert out.tolist() in ([3, 0, 7], [3])


def test_an_int64_array_passes_unchanged_and_empty_input_is_empty() -> None:
    ids = np.array([5, 1], dtype=np.int64)
    assert as_block_ids(ids) is ids  # converting again below the edge costs nothing
    for empty in ([], (), np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.int64)):
        assert as_block_ids(empty).tolist() == []
    long = list(range(1000))
    assert as_block_ids(long).tolist() == long


@pytest.mark.parametrize(("bad", "message"), [
    ([1, -2], "local_ids must be non-negative, got -2"),
    (list(range(100)) + [-1], "non-negative, got -1"),
    (np.array([-3, 1]), "non-negative, got -3"),
    (torch.tensor([0, -1]), "non-negative, got -1"),
    ([1.0, 2], "must hold ints, got float 1.0"),
    (["1"], "must hold ints, got str"),
    ([True, 2], "got a bool"),
    ([*range(2, 100), False], "got a bool"),
    (np.array([1.5]), "1-D integer array, got float64"),
    (np.zeros((2, 2), dtype=np.int64), r"1-D integer array, got int64 of shape \(2, 2\)"),
    (np.array([True]), "1-D integer array, got bool"),
    (torch.tensor([1.5]), "1-D integer tensor, got torch.float32"),
    (torch.tensor([True]), "1-D integer tensor, got torch.bool"),
    (torch.zeros(2, 2, dtype=torch.int64), r"1-D integer tensor, .* shape \(2, 2\)"),
], ids=["negative", "negative-long", "negative-array", "negative-tensor", "float", "str",
        "bool", "bool-long", "float-array", "2-d-array", "bool-array", "float-tensor",
        "bool-tensor", "2-d-tensor"])
def test_rejects_name_the_argument_with_the_error_class(bad: object, message: str) -> None:
    with pytest.raises(BlockIdsError, match=message) as info:
        as_block_ids(bad, "local_ids")  # type: ignore[arg-type]
    assert "local_ids" in str(info.value)
    # one class, which ``except TypeError`` / ``except ValueError`` callers still catch
    assert isinstance(info.value, (KvconnectError, TypeError, ValueError))
    assert issubclass(BlockIdsError, TypeError) and issubclass(BlockIdsError, ValueError)


def test_negative_ids_are_left_to_a_range_check_when_asked() -> None:
    assert as_block_ids([-1, 2], allow_negative=True).tolist() == [-1, 2]


def test_public_names_and_torch_free_import() -> None:
    assert kvconnect.as_block_ids is as_block_ids
    assert {"BlockIds", "BlockIdsError", "as_block_ids"} <= set(kvconnect.__all__)
    code = ("import sys, kvconnect.block_ids as b; assert 'torch' not in sys.modules; "
            "print(b.as_block_ids([2, 1]).tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[2, 1]"


def test_merged_block_ids_concatenates_requests_and_names_a_mismatch() -> None:
    from kvconnect.block_ids import merged_block_ids

    src, dst = merged_block_ids([([1, 2], np.array([5, 6])), (torch.tensor([3]), (7,))])
    assert (src.tolist(), dst.tolist()) == ([1, 2, 3], [5, 6, 7])
    one = np.array([4], dtype=np.int64)
    assert merged_block_ids([(one, one)])[0] is one  # one request: no copy
    assert [a.tolist() for a in merged_block_ids([])] == [[], []]
    with pytest.raises(ValueError, match="request 1: 2 remote ids but 1 local ids"):
        merged_block_ids([([1], [2]), ([1, 2], [3])], ("remote_ids", "local_ids"))
    with pytest.raises(BlockIdsError, match="local_ids must be non-negative"):
        merged_block_ids([([1], [-2])], ("remote_ids", "local_ids"))
