"""kvconnect-validate's argument handling, exit codes 2 and 3, multi-host membership parsing and
the block-set choice. In-process (no workers are started), so fast."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconnect.errors import OptionError
from kvconnect.harness import arguments, cli
from kvconnect.harness.config import RunConfig
from kvconnect.harness.multihost.rendezvous import membership_from_env, parse_hostport

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "0"], "must be a whole number from 1 to 1000000"),
    (["--decode", "x"], "must be a whole number from 1 to 1000000"),
    (["--transports", "ipc,rdma"], "unknown transport(s) rdma"),
    (["--transports", "ipc,ipc"], "listed twice"),
    (["--transports", ","], "needs at least one transport name"),
    (["--num-blocks", "3"], "--num-blocks must be at least 4"),
    (["--num-blocks", "8", "--transfer-blocks", "8"], "--transfer-blocks must be between 2"),
    (["--timeout", "0"], "must be seconds: a number above 0 and at most 86400"),
    (["--min-gbps", "-1"], "must be GB/s: a number above 0"),
    (["--device", "tpu"], "invalid choice"),
    (["--layout", "no-such-model"], "not a known preset"),
    (["--layout", "jamba-hybrid-like", "--num-layers", "1"], "needs at least 2 layers"),
    (["--json", "/nonexistent-dir/x.json"], "does not exist"),
    (["--json", "/proc/nope.json"], "cannot create a file in /proc"),  # even as root
    (["--junit", "/sys/nope.xml"], "cannot create a file in /sys"),
    (["--json", "/tmp/same.out", "--junit", "/tmp/same.out"], "name the same file"),
    (["--role", "decode"], "needs --rendezvous, --role and --rank together"),
    (["--rendezvous", "localhost", "--role", "prefill", "--rank", "0"], "expected HOST:PORT"),
    (["--rendezvous", "h:70000", "--role", "prefill", "--rank", "0"],
     "the port must be a whole number from 1 to 65535"),
    (["--rendezvous", "h:1234", "--role", "decode", "--rank", "1"], "out of range"),
])
def test_bad_arguments_exit_2_with_a_message(argv: list[str], message: str,
                                             run_validate_cli: Any) -> None:
    code, text = run_validate_cli(argv)
    assert code == 2
    assert message in text


@pytest.mark.parametrize("argv", [
    ["--prefill", "\u0662"], ["--decode", "\uff12"], ["--num-blocks", "+8"],
    ["--seed", str(2 ** 70)], ["--num-layers", "\xa02"], ["--sizes", "\u0661M"],
    ["--sizes", "1M:\u0664M"], ["--timeout", "1e300"], ["--timeout", "inf"],
    ["--timeout", "nan"], ["--timeout", "86401"], ["--timeout", "\u0665"],
    ["--min-gbps", "\u0662"], ["--min-gbps", "inf"], ["--inject", "kill-decode\u0661@transfer"],
    ["--rendezvous", "h:\u0668\u0660", "--role", "prefill", "--rank", "0"],
    ["--warmup", "1_0_", "--sizes", "1M"], ["--iters", "10000001", "--sizes", "1M"],
])
def test_numbers_are_ascii_digits_within_bounds(argv: list[str], run_validate_cli: Any) -> None:
    """Issue 23: ``--prefill \u0662`` ran 2 prefills, ``--sizes \u0661M`` ran a sweep, and
    ``--timeout 1e300`` ran and failed after 65 s ("timestamp out of range"): int() and
    float() take non-ASCII digits and no bound. Each is now exit 2 before any worker."""
    code, text = run_validate_cli(argv)
    assert code == 2, text
    assert "ASCII digits" in text or "expected a size" in text or "expected FAULT@PHASE" in text


def test_numbers_at_their_bounds_are_taken() -> None:
    args = arguments.build_parser().parse_args(
        ["--timeout", "86400", "--seed", str(2 ** 63 - 1), "--prefill", "1_0",
         "--min-gbps", "2.5", "--sizes", " 1M"])
    assert (args.timeout, args.seed, args.prefill, args.min_gbps, args.sizes) == (
        86400.0, 2 ** 63 - 1, 10, 2.5, [1 << 20])


def test_launcher_variables_are_ascii_digits() -> None:
    env = {"RANK": "\u0660", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    with pytest.raises(ValueError, match=r"RANK \(or SLURM_PROCID\) must be .*ASCII digits"):
        membership_from_env(env, 2, 1)
    env = {**env, "RANK": "0", "MASTER_PORT": "\uff12\uff19\uff15\uff10\uff10"}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        membership_from_env(env, 2, 1)


@pytest.fixture
def fast_ipc_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transport registered as ``FastIpc`` (the ipc spec under another name), as a
    ``--transport-module`` would; removed from the registry after the test."""
    from kvconnect.connectors import registry

    registry.register_builtin_transports()
    spec = dataclasses.replace(registry.get_transport("ipc"), name="FastIpc")
    monkeypatch.setitem(registry._REGISTRY, "FastIpc", spec)


@pytest.mark.parametrize(("typed", "want"), [
    ("FastIpc", ["FastIpc"]), ("fastipc", ["FastIpc"]), ("FASTIPC,IPC", ["FastIpc", "ipc"]),
    ("ipc,FastIpc", ["ipc", "FastIpc"])])
def test_transports_are_matched_as_registered(fast_ipc_registered: None, typed: str,
                                              want: list[str]) -> None:
    """Issue 23: the CLI lowercased what was typed, so a transport registered as FastIpc
    could never be chosen ("unknown transport(s) fastipc; choose from ipc, nixl, FastIpc")."""
    args = arguments.build_parser().parse_args(["--transports", typed, "--device", "host"])
    cfg, _ = cli.build_config(args)
    assert cfg.transports == want


@pytest.mark.parametrize(("typed", "message"), [("fastipc,FastIpc", "FastIpc listed twice"),
                                                ("ipc,IPC", "ipc listed twice"),
                                                ("FastIpcs", "unknown transport(s) FastIpcs")])
def test_transports_named_twice_or_unknown_are_refused(fast_ipc_registered: None, typed: str,
                                                       message: str) -> None:
    args = arguments.build_parser().parse_args(["--transports", typed, "--device", "host"])
    with pytest.raises(OptionError, match=re.escape(message)):
        cli.build_config(args)


def test_world_size_from_the_launcher_must_match(monkeypatch: pytest.MonkeyPatch,
                                                 run_validate_cli: Any) -> None:
    for k, v in {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    code, text = run_validate_cli(["--prefill", "1", "--decode", "1"])
    assert code == 2 and "WORLD_SIZE 3" in text


def test_console_script_exits_2_on_bad_arguments() -> None:
    proc = subprocess.run([str(VALIDATE), "--prefill", "1", "--transports", "carrier-pigeon"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "unknown transport(s) carrier-pigeon" in proc.stderr


@pytest.fixture
def nixl_missing() -> Iterator[Callable[[str], None]]:
    """Make the registered nixl spec say it cannot run here, with the given reason (the
    real spec is put back afterwards)."""
    from kvconnect.connectors.registry import get_transport, register_transport

    real = get_transport("nixl")

    def missing(reason: str) -> None:
        register_transport(dataclasses.replace(real, requires=lambda: reason), replace=True)

    try:
        yield missing
    finally:
        register_transport(real, replace=True)


def test_missing_nixl_asked_for_explicitly_exits_3(nixl_missing: Callable[[str], None],
                                                   run_validate_cli: Any,
                                                   tmp_path: Path) -> None:
    nixl_missing("NIXL is not installed (test)")
    out = tmp_path / "r.json"
    junit = tmp_path / "r.xml"
    code, text = run_validate_cli(["--transports", "nixl", "--device", "host", "--json",
                                   str(out), "--junit", str(junit), "-q"])
    assert code == 3
    assert "--transports nixl was asked for but NIXL is not installed (test)" in text
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["exit_code"] == 3
    assert "NIXL is not installed" in report["environment_error"]
    assert "<error" in junit.read_text()


def test_default_transports_skip_missing_nixl_with_the_reason(
        nixl_missing: Callable[[str], None]) -> None:
    cfg = RunConfig()
    cli._select_transports(cfg, explicit=False)  # the real environment: NIXL is installed
    assert cfg.transports == ["ipc", "nixl"]
    cfg = RunConfig()
    nixl_missing("no NIXL here")
    cli._select_transports(cfg, explicit=False)
    assert cfg.transports == ["ipc"] and cfg.skipped_transports == {"nixl": "no NIXL here"}


def test_device_cuda_without_a_gpu_exits_3(run_validate_cli: Any) -> None:
    from kvconnect.harness.environment import _probe_cuda

    if _probe_cuda()[0]:
        pytest.skip("a CUDA GPU with VMM is present")
    code, text = run_validate_cli(["--device", "cuda", "-q"])
    assert code == 3
    assert "--device cuda was asked for but" in text


def test_parse_hostport() -> None:
    assert parse_hostport("127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_hostport("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_hostport(":80")


def test_membership_from_torchrun_and_srun_variables() -> None:
    assert membership_from_env({}, 2, 1) is None
    assert membership_from_env({"RANK": "0", "WORLD_SIZE": "3"}, 2, 1) is None  # no master
    env = {"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "node0", "MASTER_PORT": "29500",
           "LOCAL_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    m = membership_from_env(env, 2, 1)
    assert m is not None
    assert (m.role, m.rank, m.host, m.port, m.local_rank) == ("decode", 0, "node0", 29500, 1)
    assert m.use_agent_store and not m.hosts_store
    srun = {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "MASTER_ADDR": "n", "MASTER_PORT": "1"}
    m = membership_from_env(srun, 2, 1)
    assert m is not None and (m.role, m.rank, m.use_agent_store) == ("prefill", 1, False)
    with pytest.raises(ValueError, match="does not match"):
        membership_from_env({**srun, "SLURM_NTASKS": "4"}, 2, 1)
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        membership_from_env({**srun, "SLURM_PROCID": "3"}, 2, 1)


def test_block_sets_are_random_non_contiguous_and_agreed() -> None:
    cfg = RunConfig(num_blocks=40, transfer_blocks=12, seed=3)
    seen = set()
    for p in range(2):
        for d in range(2):
            for r in (1, 2):
                remote, local = cfg.block_sets(p, d, r)
                assert (remote, local) == cfg.block_sets(p, d, r)  # both sides agree
                assert len(set(remote)) == len(set(local)) == 12
                assert all(0 <= b < 40 for b in remote + local)
                assert remote[-1] - remote[0] != 11  # at least one gap
                assert local != sorted(local) or local != remote
                seen.add(tuple(remote))
    assert len(seen) > 1
    assert RunConfig(num_blocks=40, transfer_blocks=12, seed=4).block_sets(0, 0, 1) != \
        cfg.block_sets(0, 0, 1)
    rank, block = cfg.corrupt_target()
    assert rank == 0 and block in cfg.block_sets(0, 0, 1)[0]


def test_gpu_round_robin_assignment() -> None:
    cfg = RunConfig(num_prefill=3, num_decode=2, device="cuda", num_gpus=2)
    got = [cfg.device_for("prefill", r) for r in range(3)] + \
          [cfg.device_for("decode", r) for r in range(2)]
    assert got == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    assert RunConfig(device="host").device_for("decode", 5) == "cpu"


def test_run_config_json_round_trip_rejects_unknown_fields() -> None:
    cfg = RunConfig(num_prefill=2, corrupt=True, transports=["ipc"])
    assert RunConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    with pytest.raises(ValueError, match="unknown run-config fields"):
        RunConfig.from_json({**cfg.to_json(), "evil": 1})


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
              "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert "RANK" not in os.environ


def test_the_output_path_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    cli._check_output_path("--json", str(tmp_path / "r.json"))
    assert list(tmp_path.iterdir()) == []


def test_sizes_parse_as_nccl_tests_ranges_or_lists() -> None:
    import argparse

    M = 1 << 20
    assert arguments._sizes("1M:8M") == [M, 2 * M, 4 * M, 8 * M]
    assert arguments._sizes("1M:1G:4") == [M, 4 * M, 16 * M, 64 * M, 256 * M, 1024 * M]
    assert arguments._sizes("4K,1M,64M,1M") == [4096, M, 64 * M]
    assert arguments._sizes("1MiB:3MB") == [M, 2 * M]
    assert arguments._sizes("4096") == [4096]
    for bad in ("", "0", "1X", "8M:1M", "1M:2M:1", "1M:2M:3:4", "2T", ",,"):
        with pytest.raises(argparse.ArgumentTypeError):
            arguments._sizes(bad)


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "1M:1G", "--num-blocks", "160"], "needs --num-blocks of at least 4096"),
    (["--iters", "3"], "give --sizes too"),
    (["--sizes", "1M", "--iters", "0"], "must be a whole number from 1 to"),
])
def test_bad_sweep_arguments_exit_2(argv: list[str], message: str,
                                    run_validate_cli: Any) -> None:
    code, text = run_validate_cli(["--device", "host", *argv])
    assert code == 2 and message in text, text


def test_version_and_the_layout_list_come_from_one_place(run_validate_cli: Any) -> None:
    """Issue 16: --layout in --help listed no names, docs/validate.md 5, the error 11."""
    from importlib.metadata import version

    from kvconnect.layout import PRESETS

    code, text = run_validate_cli(["--version"])
    assert code == 0 and text.strip() == f"kvconnect-validate {version('kvconnect')}"
    names = sorted(PRESETS)
    assert arguments.layout_names() == names
    code, text = run_validate_cli(["--help"])
    flat = " ".join(text.split()).replace("- ", "-")  # argparse wraps at hyphens
    assert code == 0 and ", ".join(names) in flat
    code, text = run_validate_cli(["--layout", "nope"])
    assert code == 2 and text.strip().endswith("choose from " + ", ".join(names))
    docs = (Path(__file__).parent.parent / "docs" / "validate.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--layout PRESET`"))
    assert [x.strip("` ") for x in row.split("|")[2].split(":", 1)[1].split(",")] == names


def test_a_leftover_run_folder_is_removed_and_the_user_told(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_validate_cli: Any) -> None:
    from kvconnect.framing import kernel_boot_id
    from kvconnect.harness import rundir

    base = tmp_path / "t"
    base.mkdir()
    left = base / "kvv-leftover"
    left.mkdir()
    (left / rundir.OWNER_FILE).write_text(json.dumps(
        {"pid": 999_999_999, "start_ticks": 1, "boot_id": kernel_boot_id()}))
    monkeypatch.setattr(rundir, "run_dir_base", lambda: str(base))
    out = tmp_path / "r.json"
    code, text = run_validate_cli(["--device", "host", "--transports", "ipc", "--num-layers",
                                   "1", "--num-blocks", "8", "-q", "--json", str(out),
                                   "--prefill", "64"])  # refused by the pre-check: quick
    assert code == 2
    assert f"removed {left}, a leftover run folder of a run that was killed" in text
    assert json.loads(out.read_text())["stale_run_dirs"] == [str(left)]
    assert not left.exists()
