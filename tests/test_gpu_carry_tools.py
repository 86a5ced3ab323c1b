"""The tools that pack vLLM and NIXL for a GPU machine without a registry
(scripts/pack_vllm_for_gpu.sh): the fatbin pruner, NIXL's UCX closure, and the ratio floors
over real-engine P/D results."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import prune_fatbin  # noqa: E402
import ratio_floors  # noqa: E402

PTX, CUBIN = 1, 2


def _entry(kind: int, arch: int, payload: bytes) -> bytes:
    header = bytearray(64)
    struct.pack_into("<HHIQ", header, 0, kind, 0x0101, len(header), len(payload))
    struct.pack_into("<I", header, prune_fatbin.ENTRY_ARCH_OFFSET, arch)
    return bytes(header) + payload


def _fatbin(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return prune_fatbin.FATBIN_HEADER.pack(prune_fatbin.FATBIN_MAGIC, 1, 16, len(body)) + body


def _elf(section: bytes) -> bytes:
    """A minimal ELF64 file: the null section, ``.nv_fatbin`` holding ``section``, and the
    section-name table."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    data_off = 64
    names_off = data_off + len(section)
    shoff = names_off + len(names)
    shoff += -shoff % 8
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 0, 0,
                                 64, 3, 2)

    def shdr(name: int, offset: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, 1, 0, 0, offset, size, 0, 0, 1, 0)

    out = header + section + names
    out += bytes(shoff - len(out))
    return out + bytes(64) + shdr(1, data_off, len(section)) + shdr(11, names_off, len(names))


def test_prune_keeps_one_architecture_and_the_ptx_without_its_cubin() -> None:
    pay = {name: bytes([i + 1]) * 256 for i, name in enumerate(
        ("a_cubin80", "a_cubin90", "a_ptx80", "b_cubin80", "b_ptx80"))}
    data = bytearray(_elf(
        _fatbin(_entry(CUBIN, 80, pay["a_cubin80"]), _entry(CUBIN, 90, pay["a_cubin90"]),
                _entry(PTX, 80, pay["a_ptx80"]))
        + bytes(8)  # padding between fatbins
        + _fatbin(_entry(CUBIN, 80, pay["b_cubin80"]), _entry(PTX, 80, pay["b_ptx80"]))))
    size = len(data)
    summary = prune_fatbin.prune(data, 90)
    assert len(data) == size  # the layout is unchanged
    assert summary["fatbins"] == 2
    for name, kept in (("a_cubin80", False), ("a_cubin90", True), ("a_ptx80", False),
                       ("b_cubin80", False), ("b_ptx80", True)):
        assert (pay[name] in data) == kept, name
    assert summary["kept_bytes"] == {"cubin_90": 256, "ptx_80": 256}
    assert summary["zeroed_bytes"] == {"cubin_80": 512, "ptx_80": 256}


def test_prune_refuses_what_it_does_not_understand(tmp_path: Path) -> None:
    broken = bytearray(_elf(_fatbin(_entry(CUBIN, 90, b"x" * 64))))
    struct.pack_into("<Q", broken, 64 + 8, 10_000)  # the fatbin claims more than it holds
    with pytest.raises((prune_fatbin.FatbinError, struct.error)):
        prune_fatbin.prune(broken, 90)
    with pytest.raises(prune_fatbin.FatbinError, match="no sm_90 cubin"):
        prune_fatbin.prune(bytearray(_elf(_fatbin(_entry(CUBIN, 80, b"x" * 64)))), 90)
    src = tmp_path / "lib.so"
    src.write_bytes(b"not an elf")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "prune_fatbin.py"), str(src),
                           str(tmp_path / "out.so"), "--sm", "90"], capture_output=True, text=True)
    assert proc.returncode == 2 and "not a 64-bit" in proc.stderr
    assert not (tmp_path / "out.so").exists()


@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None or shutil.which("readelf")
                    is None, reason="needs nixl-cu13 installed and readelf")
def test_nixl_closure_is_the_ucx_backend_and_what_it_loads() -> None:
    import nixl_closure

    spec = importlib.util.find_spec("nixl_cu13")
    assert spec is not None and spec.origin is not None
    site = Path(spec.origin).parent.parent
    files = {str(f) for f in nixl_closure.closure(site)}
    assert ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so" in files
    assert ".nixl_cu13.mesonpy.libs/libnixl.so" in files
    assert any(f.startswith("nixl_cu13/_bindings") for f in files)
    assert any("libucp" in f for f in files) and any(f.startswith("nixl_cu13-") for f in files)
    assert not any("nixl_ep" in f or "libplugin_GDS" in f or "perftest" in f for f in files)
    assert all((site / f).is_file() for f in files)


def _pd_report(ttft_ipc: float, ttft_nixl: float, equal: bool) -> dict[str, object]:
    def run(ttft: float, xfer: float) -> dict[str, object]:
        return {"ttft": {"sum": ttft, "count": 1}, "xfer": {"sum": xfer, "count": 1},
                "xfer_bytes": {"sum": 256 << 20, "count": 1}}
    return {"sizes": {"2048": {
        "routes": {"ipc": {"runs": [run(ttft_ipc, 0.0002)] * 2, "tokens_equal_local": [equal] * 2},
                   "nixl": {"runs": [run(ttft_nixl, 0.5)] * 2, "tokens_equal_local": [True] * 2}},
        "copy_reference": {"bytes": 256 << 20, "seconds": 0.00013}}}}


@pytest.mark.parametrize(("ttft_ipc", "ttft_nixl", "equal", "rc", "failing"), [
    (0.05, 0.5, True, 0, []),                      # 10x: the floor holds
    (0.5, 0.6, True, 1, ["ttft-nixl/ipc"]),        # 1.2x: under the 1.5x floor
    (0.05, 0.5, False, 1, ["ttft-nixl/ipc", "xfer-copy/ipc"]),  # wrong tokens fail both
])
def test_ratio_floors_over_engine_pd_results(tmp_path: Path, ttft_ipc: float, ttft_nixl: float,
                                             equal: bool, rc: int, failing: list[str]) -> None:
    report = tmp_path / "pd.json"
    report.write_text(json.dumps(_pd_report(ttft_ipc, ttft_nixl, equal)))
    out = tmp_path / "floors.json"
    assert ratio_floors.main(["--pd", str(report), "--json", str(out)]) == rc
    cases = json.loads(out.read_text())["cases"]
    assert sorted(c["name"].split()[0] for c in cases) == ["ttft-nixl/ipc", "xfer-copy/ipc"]
    assert sorted(c["name"].split()[0] for c in cases if c["status"] == "fail") == failing
    xfer = next(c for c in cases if c["name"].startswith("xfer"))
    assert xfer["ratio"] == pytest.approx(0.00013 / 0.0002)
    assert xfer["goal_met"] is False  # 0.65 < 1 / 1.3
