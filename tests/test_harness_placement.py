"""Where the harness puts its workers on GPUs (``--placement``): computed, so it is checked
here without a GPU; the two-GPU runs themselves are scripts/nightly-gpu.sh's cross-GPU rows."""

from __future__ import annotations

import pytest

from kvconnect.harness.arguments import build_parser
from kvconnect.harness.config import DECODE, PREFILL, RunConfig


def _devices(cfg: RunConfig) -> dict[str, list[str]]:
    return {role: [cfg.device_for(role, r) for r in range(n)]
            for role, n in ((PREFILL, cfg.num_prefill), (DECODE, cfg.num_decode))}


@pytest.mark.parametrize(("gpus", "placement", "prefills", "decodes"), [
    (2, "round-robin", ["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"]),
    (2, "split", ["cuda:0", "cuda:0"], ["cuda:1", "cuda:1"]),
    (4, "split", ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]),
    (3, "split", ["cuda:0", "cuda:0"], ["cuda:1", "cuda:2"]),
    (1, "split", ["cuda:0", "cuda:0"], ["cuda:0", "cuda:0"]),  # one GPU runs all
])
def test_split_puts_prefills_and_decodes_on_different_gpus(
        gpus: int, placement: str, prefills: list[str], decodes: list[str]) -> None:
    cfg = RunConfig(num_prefill=2, num_decode=2, device="cuda", num_gpus=gpus,
                    placement=placement)
    assert _devices(cfg) == {PREFILL: prefills, DECODE: decodes}


def test_a_launcher_local_rank_wins_and_host_runs_stay_on_cpu() -> None:
    cfg = RunConfig(device="cuda", num_gpus=2, placement="split")
    assert cfg.device_for(PREFILL, 0, local_index=1) == "cuda:1"
    assert RunConfig(device="host", placement="split").device_for(DECODE, 0) == "cpu"


def test_placement_is_parsed_and_checked() -> None:
    parser = build_parser()
    assert parser.parse_args([]).placement == "round-robin"
    assert parser.parse_args(["--placement", "split"]).placement == "split"
    with pytest.raises(SystemExit):
        parser.parse_args(["--placement", "diagonal"])
