"""The nixl transport's diagnosis of a slow lane: UCX protocol tables as UCX 1.23 printed them
on the H200 (benchmarks/results/ucx-cuda-ipc-h200.md) -> the harness's lane names -> advice."""

from __future__ import annotations

from kvconnect.connectors.nixl.transport import slow_gpu_lane_advice
from kvconnect.connectors.nixl.ucx_lanes import parse_read_lanes

_TABLE = """
[1796154369.720648] [vm:997  :0]   | remote memory read by ucp_get*(multi) into {into} from {src} |
[1796154369.720648] [vm:997  :0]   +--------+--------------------+----------------------------------+
[1796154369.720648] [vm:997  :0]   | Range  |    Description     |              Config              |
[1796154369.720648] [vm:997  :0]   +--------+--------------------+----------------------------------+
[1796154369.720648] [vm:997  :0]   | 0..inf | {desc} | {cfg} |
[1796154369.720648] [vm:997  :0]   +--------+--------------------+----------------------------------+
"""


def _lanes(into: str, src: str, desc: str, cfg: str) -> list[str]:
    return parse_read_lanes(_TABLE.format(into=into, src=src, desc=desc, cfg=cfg))


def test_gpu_memory_over_tcp_emulation_gets_the_measured_advice() -> None:
    lanes = _lanes("cuda/GPU0", "cuda", "software emulation", "tcp/lo")
    assert lanes == ["tcp/lo software emulation (cuda/GPU0<-cuda)"]  # UCX 1.23 title form
    advice = slow_gpu_lane_advice(lanes)
    assert "VMM memory" in advice and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in advice
    assert "ipc transport" in advice


def test_fast_or_host_lanes_get_no_advice() -> None:
    assert slow_gpu_lane_advice(_lanes("cuda/GPU0", "cuda/dev[1]", "zero-copy",
                                       "cuda_ipc/cuda")) == ""
    assert slow_gpu_lane_advice(_lanes("host", "host", "zero-copy", "cma/memory")) == ""
    assert slow_gpu_lane_advice([]) == ""
