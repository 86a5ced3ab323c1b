"""Memory, fds and mappings a run needs, against what the machine has, before any worker
starts (exit 2: cannot fit this machine, 3: does not fit now or as configured)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvconnect.framing import MAX_FDS
from kvconnect.harness import cli
from kvconnect.harness.config import RunConfig
from kvconnect.harness.resources import (
    GIB,
    MIB,
    MachineLimits,
    _cgroup_memory,
    estimate_worker_needs,
    judge,
    machine_limits,
)

#: a 24 GiB machine with 20 GiB free, an fd limit of 1024 (hard 4096), default map count
MACHINE = MachineLimits(mem_available_bytes=20 * GIB, mem_total_bytes=24 * GIB,
                        cgroup_limit_bytes=None, cgroup_available_bytes=None,
                        fd_soft_limit=1024, fd_hard_limit=4096, fd_kernel_max=1 << 20,
                        max_map_count=65530)


def test_the_estimate_follows_the_layout() -> None:
    small = estimate_worker_needs(RunConfig(num_layers=4), forked=True)
    big = estimate_worker_needs(RunConfig(num_layers=64), forked=True)
    # llama-like: 2 segments (K, V) per layer, 160 blocks x 32 KiB = 5 MiB -> 6 MiB granules
    assert (small.segments, big.segments) == (8, 128)
    assert small.kv_cache_bytes == 8 * 6 * MIB and big.kv_cache_bytes == 128 * 6 * MIB
    assert big.working_bytes == 5 * 24 * 64 * 2 * 32 * 1024  # 5 transfers of 24 blocks
    assert big.fds > 3 * 128 and big.mappings > big.segments
    assert estimate_worker_needs(RunConfig(num_layers=4), forked=False).baseline_bytes > \
        small.baseline_bytes


def test_judge_picks_exit_2_when_it_cannot_fit_and_3_when_it_does_not_fit_now() -> None:
    needs = estimate_worker_needs(RunConfig(num_layers=64), forked=True)  # ~1.3 GiB each
    assert judge(2, needs, MACHINE).exit_code == 0
    v = judge(20, needs, MACHINE)  # ~26 GiB: more than MemTotal
    assert v.exit_code == 2 and [p["limit"] for p in v.problems] == ["MemTotal"]
    v = judge(16, needs, MACHINE)  # ~21 GiB: fits an idle machine, not this one now
    assert v.exit_code == 3 and [p["limit"] for p in v.problems] == ["MemAvailable"]
    assert v.problems[0]["needed"] == 16 * needs.host_bytes
    v = judge(2, needs, replace(MACHINE, fd_soft_limit=256))
    assert v.exit_code == 3 and v.problems[0]["limit"] == "RLIMIT_NOFILE"
    v = judge(2, needs, replace(MACHINE, fd_kernel_max=300))
    assert v.exit_code == 2 and v.problems[0]["limit"] == "fs.nr_open"
    v = judge(2, needs, replace(MACHINE, max_map_count=1000))
    assert v.exit_code == 3 and v.problems[0]["limit"] == "vm.max_map_count"
    many = estimate_worker_needs(RunConfig(num_layers=4100, num_blocks=4), forked=True)
    assert many.segments > MAX_FDS
    v = judge(1, many, replace(MACHINE, mem_available_bytes=None, mem_total_bytes=None,
                               fd_soft_limit=1 << 20), chunk_fds=["ipc"])
    assert v.exit_code == 2 and [p["resource"] for p in v.problems] == ["chunk_fds"]
    assert judge(1, many, replace(MACHINE, mem_available_bytes=None, mem_total_bytes=None,
                                  fd_soft_limit=1 << 20)).exit_code == 0  # nixl only
    cgroup = replace(MACHINE, cgroup_limit_bytes=2 * GIB, cgroup_available_bytes=GIB)
    v = judge(2, needs, cgroup)
    assert v.exit_code == 2 and v.problems[0]["limit"] == "memory cgroup limit"
    assert json.loads(json.dumps(v.to_json()))["problems"][0]["available"] == 2 * GIB


def test_more_workers_than_the_cpus_carry_exit_2_with_what_they_need() -> None:
    from kvconnect.harness.resources import MAX_WORKERS_PER_CPU

    needs = estimate_worker_needs(RunConfig(num_layers=1, num_blocks=8), forked=True)
    two = replace(MACHINE, cpus=2, mem_available_bytes=None, mem_total_bytes=None)
    assert judge(2 * MAX_WORKERS_PER_CPU, needs, two).exit_code == 0
    v = judge(128, needs, two)
    assert v.exit_code == 2 and [p["resource"] for p in v.problems] == ["cpus"]
    assert (v.problems[0]["needed"], v.problems[0]["available"]) == (
        128 // MAX_WORKERS_PER_CPU, 2)


def test_the_cpu_quota_of_the_cgroup_caps_the_cpus(tmp_path: Path) -> None:
    from kvconnect.harness.resources import usable_cpus

    (tmp_path / "cpu.max").write_text("150000 100000\n")  # v2: 1.5 CPUs
    (tmp_path / "cgroup").write_text("0::/\n")
    assert usable_cpus(str(tmp_path), str(tmp_path / "cgroup")) == min(
        2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(str(tmp_path), str(tmp_path / "cgroup")) == len(
        os.sched_getaffinity(0))


def test_this_machine_is_read() -> None:
    limits = machine_limits()
    assert limits.mem_total_bytes and limits.mem_available_bytes
    assert 0 < limits.mem_available_bytes <= limits.mem_total_bytes
    assert 0 < limits.fd_soft_limit <= limits.fd_hard_limit


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_memory_cgroup_limit_is_read(tmp_path: Path, version: str) -> None:
    """Read from files laid out as the kernel's cgroup filesystems lay them out."""
    proc = tmp_path / "cgroup"
    if version == "v2":
        d = tmp_path / "kubepods" / "pod1"
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{4 * GIB}\n")
        (d / "memory.current").write_text(f"{3 * GIB}\n")
        (d / "memory.stat").write_text(f"anon 1\nfile {GIB}\n")
        proc.write_text("0::/kubepods/pod1\n")
    else:
        d = tmp_path / "memory" / "job"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
        (d / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
        (d / "memory.stat").write_text(f"cache 5\ntotal_cache {GIB}\n")
        proc.write_text("4:memory:/job\n1:cpu:/\n")
    assert _cgroup_memory(str(tmp_path), str(proc)) == (4 * GIB, 2 * GIB)
    (d / ("memory.max" if version == "v2" else "memory.limit_in_bytes")).write_text(
        "max\n" if version == "v2" else "9223372036854771712\n")
    assert _cgroup_memory(str(tmp_path), str(proc)) == (None, None)


def test_a_run_too_big_for_the_machine_is_refused_before_any_worker_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--num-layers 1000 on host ran a 24 GiB machine out of memory (issue 8)."""
    ceiling = machine_limits().mem_total_bytes
    needs = estimate_worker_needs(RunConfig(num_layers=1000), forked=True)
    if 2 * needs.host_bytes <= (ceiling or 0):
        pytest.skip(f"this machine has {ceiling} bytes: 1000 layers fit")
    out = tmp_path / "r.json"
    code = cli.main(["--device", "host", "--num-layers", "1000", "-q", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 2 and report["exit_code"] == 2
    [problem] = report["resources"]["problems"]
    assert problem["resource"] == "memory" and problem["impossible"] is True
    assert problem["needed"] == report["resources"]["needed"]["host_bytes"] > ceiling
    assert report["workers"] == [] and report["transfers"] == []
    assert len([line for line in capsys.readouterr().err.splitlines() if line]) == 1
