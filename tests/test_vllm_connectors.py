"""vLLM 0.33's connectors vs kvconnect's patched ones, through the conformance kit.

Every case runs in its own process with real NIXL agents on CPU (DRAM) and the host VMM
backend (uncommitted memory faults). VMM caches reserve 8x the committed blocks; the
control run reserves exactly the committed blocks (a plain allocation's geometry).
"""

from __future__ import annotations

import pytest

from kvconnect.vllm.runtime import prepare_cpu_runtime

prepare_cpu_runtime()
pytest.importorskip("vllm", reason="vLLM 0.33 is not installed (make test-vllm)")

from kvconnect.harness.conformance import STOCK_AND_PATCHED, run_conformance  # noqa: E402
from kvconnect.layout import VLLM_LAYOUTS  # noqa: E402

pytestmark = pytest.mark.vllm

PATCHED_MODULE = "kvconnect.connectors.vllm"
STOCK = {"NixlConnector": f"{PATCHED_MODULE}:KvconnectNixlConnector",
         "SimpleCPUOffloadConnector": f"{PATCHED_MODULE}:KvconnectSimpleCPUOffloadConnector",
         "OffloadingConnector": f"{PATCHED_MODULE}:KvconnectOffloadingConnector"}


def _by_case(results: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["connector"], r["layout"]): r for r in results}


@pytest.fixture(scope="module")
def vmm() -> dict[tuple[str, str], dict]:
    return _by_case(run_conformance(STOCK_AND_PATCHED, VLLM_LAYOUTS, timeout=120,
                                    num_blocks=128, capacity_blocks=1024))


@pytest.fixture(scope="module")
def plain() -> dict[tuple[str, str], dict]:
    # 256 blocks: every layout's segments are then whole 2 MiB granules, so the reservation
    # holds exactly the committed blocks (capacity is rounded up to granules otherwise)
    return _by_case(run_conformance(STOCK_AND_PATCHED, VLLM_LAYOUTS, timeout=120,
                                    num_blocks=256, capacity_blocks=256))


def test_stock_connectors_break_as_measured(vmm) -> None:
    nixl = vmm[("NixlConnector", "LBHNC")]
    co = nixl["checks"]["committed_only"]
    assert co["status"] == "fail" and co["registered_bytes"] == 8 * co["committed_bytes"]
    assert nixl["checks"]["transfer"]["status"] == "fail"
    assert vmm[("NixlConnector", "BLHNC")]["checks"]["committed_only"]["status"] == "fail"
    simple = vmm[("SimpleCPUOffloadConnector", "LBHNC")]
    assert (simple["status"], simple["signal"]) == ("fault", "SIGSEGV")
    assert simple["checks"]["committed_only"]["regions_outside"] > 0


@pytest.mark.parametrize("stock", sorted(STOCK))
def test_patched_pass_every_layout_where_stock_fails(vmm, stock: str) -> None:
    for layout in VLLM_LAYOUTS:
        ours = vmm[(STOCK[stock], layout)]
        # LHBNC too: head planes lie capacity apart; upstream places them num_blocks apart,
        # ours where the view puts them (kvconnect/vllm/head_planes.py)
        assert ours["status"] == "pass", ours
        assert all(c["status"] == "pass" for c in ours["checks"].values()), ours
    failing = [lay for lay in VLLM_LAYOUTS if vmm[(stock, lay)]["status"] != "pass"]
    assert failing, f"stock {stock} passed every layout: the kit cannot tell"


@pytest.mark.parametrize("stock", sorted(STOCK))
def test_patched_register_byte_identically_on_plain_allocations(plain, stock: str) -> None:
    for layout in VLLM_LAYOUTS:
        if stock == "OffloadingConnector" and layout == "LHBNC":
            continue  # upstream's bug, fixed in ours: the control test below
        theirs, ours = plain[(stock, layout)], plain[(STOCK[stock], layout)]
        assert ours["capacity_blocks"] == ours["num_blocks"] == 256
        assert ours["registration"] == theirs["registration"], (layout, ours, theirs)
        assert ours["status"] == theirs["status"], (layout, ours, theirs)


def test_lhbnc_head_planes_are_the_views_and_committed_only(vmm) -> None:
    """Every head plane of every layer is its own region at the view's plane address (the
    planes are 1024 blocks apart over the reservation), and NIXL registers each plane's
    committed run, not the storage spanning the uncommitted gap between planes."""
    for name in STOCK.values():
        ours = vmm[(name, "LHBNC")]
        regions = sorted(r[0] for r in ours["registration"]["regions"])
        plane = 1024 * 8192  # capacity blocks x one head's page
        assert regions == [0, plane, 2 * plane, 3 * plane], (name, regions)
    nixl = vmm[(STOCK["NixlConnector"], "LHBNC")]["registration"]["ranges"]
    assert nixl == [[i * 1024 * 8192, 128 * 8192] for i in range(4)], nixl


def test_offloading_lhbnc_control_shows_upstreams_bug_and_our_fix(plain) -> None:
    """On a plain allocation stock OffloadingConnector mistakes LHBNC for a packed layout
    and moves only the first head of the first layer; ours moves every head plane."""
    theirs = plain[("OffloadingConnector", "LHBNC")]
    ours = plain[(STOCK["OffloadingConnector"], "LHBNC")]
    assert theirs["status"] == "fail" and len(theirs["registration"]["regions"]) == 1
    assert theirs["checks"]["offload_round_trip"]["mismatched_bytes"] > 0
    assert ours["status"] == "pass", ours
    assert len(ours["registration"]["regions"]) == 4  # 2 layers x 2 head planes


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC"])
def test_one_prefill_one_decode_through_vllms_connector_api(layout: str) -> None:
    """Scheduler and worker roles in two processes, vLLM's handshake and metadata, real
    NIXL on CPU: the patched connector moves the blocks byte-exact, stock does not."""
    from kvconnect.harness.conformance.pd import run_pd

    ours = run_pd("kvconnect.connectors.vllm:KvconnectNixlConnector", layout, timeout=60)
    assert ours["status"] == "pass", ours
    assert ours["byte_exact"] and ours["received"] and ours["prefill_saw_completion"]
    assert ours["load_error_blocks"] == [] and ours["bytes"] == 8 * 2 * 16384
    if layout == "LBHNC":
        theirs = run_pd("NixlConnector", layout, timeout=60)
        assert theirs["status"] == "fail" and theirs["load_error_blocks"], theirs
