"""End-to-end runs of the real ``kvconnect-validate`` on the host backend: real worker
processes, real Unix sockets and SCM_RIGHTS, real NIXL/UCX DRAM transfers.

Each run is a subprocess of the console script; its JSON and JUnit reports are parsed and
checked, and after it exits no worker process and no socket directory may remain.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvconnect.harness.coordinator.cleanup import processes_mentioning

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
#: generous: the process imports torch first, which is slow on small CI machines
PROCESS_TIMEOUT = 600

pytestmark = pytest.mark.slow


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    junit: ET.Element
    wall: float
    tmpdir: Path

    def checks(self, status: str | None = None) -> list[dict[str, Any]]:
        return [c for c in self.report["checks"] if status is None or c["status"] == status]

    def check(self, worker: str, name: str) -> dict[str, Any]:
        found = [c for c in self.report["checks"] if c["worker"] == worker and c["name"] == name]
        assert len(found) == 1, (worker, name, self.stdout[-3000:])
        return found[0]


@pytest.fixture(scope="module", autouse=True)
def _short_tmp_root() -> Iterator[None]:
    """Runs get their own TMPDIR under a short /tmp path: under a long one (pytest's) the
    run directory would fall back to /tmp, where a test cannot see what is left behind."""
    global _TMP_ROOT
    _TMP_ROOT = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield
    finally:
        shutil.rmtree(_TMP_ROOT, ignore_errors=True)


_TMP_ROOT: Path | None = None


def _run_tmpdir() -> Path:
    """A fresh, short TMPDIR for one run (its run directory must land there)."""
    assert _TMP_ROOT is not None
    return Path(tempfile.mkdtemp(dir=_TMP_ROOT))


def validate(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    tmpdir = _run_tmpdir()
    out, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    full_env = {**os.environ, "TMPDIR": str(tmpdir), **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        full_env.pop(k, None)
    t0 = time.monotonic()
    proc = subprocess.run([str(VALIDATE), "--device", "host", "--plain", "--json", str(out),
                           "--junit", str(junit), *args], capture_output=True, text=True,
                          env=full_env, timeout=PROCESS_TIMEOUT)
    wall = time.monotonic() - t0
    assert out.exists(), f"no JSON report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return Run(proc.returncode, proc.stdout, proc.stderr, json.loads(out.read_text()),
               ET.parse(junit).getroot(), wall, tmpdir)


def assert_clean_exit(run: Run) -> None:
    """No worker process left, no socket directory left, and the run's own cleanup check."""
    pids = [w["pid"] for w in run.report["workers"]]
    assert pids, run.report["workers"]
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone
        assert b"kvconnect" not in cmdline, f"worker pid {pid} is still running"
    assert len(str(run.tmpdir)) < 60  # short: the run directory was made there
    assert [p.name for p in run.tmpdir.iterdir()] == []
    cleanup = [c for c in run.checks() if c["name"] == "cleanup"]
    assert cleanup and cleanup[0]["status"] == "pass", cleanup


def assert_schema(run: Run) -> None:
    """The JSON fields the issue names, and one JUnit testcase per check."""
    r = run.report
    assert isinstance(r["passed"], bool) and r["exit_code"] == run.code
    for c in r["checks"]:
        assert c["status"] in ("pass", "fail", "skip") and isinstance(c["name"], str)
        assert isinstance(c["detail"], str)
    for t in r["transfers"]:
        assert t["transport"] in ("ipc", "nixl")
        assert t["bytes"] > 0 and t["seconds"] > 0 and isinstance(t["verified"], bool)
        assert t["gbps"] == pytest.approx(t["bytes"] / t["seconds"] / 1e9)
        assert t["reference_gbps"] > 0  # the same-run plain copy of the same bytes
        assert "->" in t["pair"]
    env = r["environment"]
    for key in ("kvconnect", "torch", "nixl", "ucx", "cuda_driver", "gpus", "hostname"):
        assert key in env
    suite = run.junit.find("testsuite")
    assert suite is not None
    cases = suite.findall("testcase")
    assert len(cases) == len(r["checks"])
    assert int(suite.get("failures", "-1")) == len(run.checks("fail"))
    assert int(suite.get("skipped", "-1")) == len(run.checks("skip"))
    assert len(suite.findall("testcase/failure")) == len(run.checks("fail"))


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """``kvconnect-validate --prefill 1 --decode 1`` as ``make validate`` runs it (host)."""
    run = validate(tmp_path_factory.mktemp("default"), "--prefill", "1", "--decode", "1")
    print(f"\n1P1D default run (host backend, ipc + nixl): {run.wall:.1f} s wall for the whole "
          f"process, {run.report['wall_seconds']:.1f} s after start-up")
    return run


def test_1p1d_passes_with_both_transports(default_run: Run) -> None:
    run = default_run
    assert run.code == 0, run.stdout[-4000:]
    assert run.report["passed"] is True
    got = sorted((t["transport"], t["round"]) for t in run.report["transfers"])
    assert got == [("ipc", 1), ("ipc", 2), ("nixl", 1), ("nixl", 2)]
    assert all(t["verified"] and t["pair"] == "prefill0->decode0"
               for t in run.report["transfers"])
    for worker in ("prefill0", "decode0"):
        for name in ("kv_cache/allocate", "kv_cache/warmup", "kv_cache/final",
                     "kv_cache/one_chunk_per_segment", "kv_cache/view_sizes", "allocation/flags",
                     "nixl/deferred_registration", "nixl/register", "sleep_wake/zeroed",
                     "sleep_wake/same_addresses", "nixl/reregister"):
            assert run.check(worker, name)["status"] == "pass"
        rdma = run.check(worker, "rdma/registration")
        if not Path("/sys/class/infiniband").exists():
            assert rdma["status"] == "skip"
    # the single-handle recommit really happened (warm-up left several chunks per segment)
    chunks = run.check("prefill0", "kv_cache/one_chunk_per_segment")["data"]
    assert chunks == {"chunks_before": 24, "chunks_after": 8, "segments": 8}
    assert run.check("prefill0", "offload/round_trip")["status"] == "pass"
    assert run.check("prefill0", "offload/load_elsewhere")["status"] == "pass"


def test_reports_match_the_schema(default_run: Run) -> None:
    assert_schema(default_run)
    workers = {w["name"]: w for w in default_run.report["workers"]}
    assert set(workers) == {"prefill0", "decode0"}
    assert all(w["exit_code"] == 0 and w["boot_id"] for w in workers.values())


def test_default_run_leaves_nothing_behind(default_run: Run) -> None:
    assert_clean_exit(default_run)


def test_2p1d_passes_with_both_transports(tmp_path: Path) -> None:
    run = validate(tmp_path, "--prefill", "2", "--decode", "1")
    assert run.code == 0, run.stdout[-4000:]
    pairs = sorted({(t["pair"], t["transport"], t["round"]) for t in run.report["transfers"]})
    assert pairs == sorted((f"prefill{p}->decode0", tr, r) for p in (0, 1)
                           for tr in ("ipc", "nixl") for r in (1, 2))
    assert all(t["verified"] for t in run.report["transfers"])
    # every NIXL READ names its UCX lane, prefill1's too (it reuses prefill0's selection)
    nixl = {(t["pair"], t["round"]): t["backend"] for t in run.report["transfers"]
            if t["transport"] == "nixl"}
    assert len(set(nixl.values())) == 1, nixl
    assert next(iter(nixl.values())).startswith("UCX ") and "UCX" not in nixl.values()
    assert_schema(run)
    assert_clean_exit(run)


def test_corrupt_fails_naming_the_block_and_slow_transfers_miss_the_floor(
        tmp_path: Path) -> None:
    run = validate(tmp_path, "--corrupt", "--seed", "7", "--min-gbps", "100000")
    assert run.code == 1 and run.report["passed"] is False
    armed = run.check("prefill0", "negative_control/armed")["data"]
    for transport in ("ipc", "nixl"):
        c = run.check("decode0", f"transfer/prefill0->decode0/{transport}/round1")
        assert c["status"] == "fail"
        assert c["data"]["num_mismatches"] == 1
        [m] = c["data"]["mismatches"]
        assert (m["block"], m["region"], m["offset"]) == \
            (armed["block"], armed["region"], armed["offset"])
        assert m["got"] == m["expected"] ^ 0xFF  # the flipped byte arrived as it was sent
    # only that block failed: round 2 (after sleep / wake and a refill) is clean
    assert run.check("decode0", "transfer/prefill0->decode0/ipc/round2")["status"] == "pass"
    unverified = [t for t in run.report["transfers"] if not t["verified"]]
    assert sorted(t["transport"] for t in unverified) == ["ipc", "nixl"]
    floor = [c for c in run.checks("fail") if c["name"].startswith("bandwidth/")]
    assert len(floor) == len(run.report["transfers"])
    assert all(c["data"]["min_gbps"] == 100000 and c["data"]["gbps"] < 100000 for c in floor)
    assert_schema(run)
    assert_clean_exit(run)


def test_a_worker_killed_mid_transfer_is_reported_and_nothing_is_left(tmp_path: Path) -> None:
    run = validate(tmp_path, "--transports", "ipc", "--timeout", "60",
                   "--inject", "kill-decode@transfer")
    assert run.code == 1
    failed = run.check("coordinator", "worker/decode0")
    assert failed["status"] == "fail"
    d = failed["data"]
    assert (d["role"], d["rank"], d["cause"], d["signal"]) == ("decode", 0, "died", "SIGKILL")
    assert d["phase"].startswith("transfer:ipc")
    # the surviving prefill was told to stop, and said so
    stopped = run.check("coordinator", "worker/prefill0")
    assert stopped["status"] == "skip" and stopped["data"]["cause"] == "aborted"
    assert run.report["wall_seconds"] < 60, "the death must be reported within the deadline"
    assert_clean_exit(run)


def test_a_hung_worker_is_reported_within_seconds(tmp_path: Path) -> None:
    run = validate(tmp_path, "--transports", "ipc", "--timeout", "10",  # heartbeat limit 5 s
                   "--inject", "stop-prefill@transfer")
    assert run.code == 1
    d = run.check("coordinator", "worker/prefill0")["data"]
    assert (d["role"], d["rank"], d["cause"], d["phase"]) == \
        ("prefill", 0, "unresponsive", "transfer:round1")
    assert d["process_state"].startswith("T")  # stopped
    assert run.report["wall_seconds"] < 10 + 15
    assert_clean_exit(run)


def _start(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
           preexec_fn: Callable[[], None] | None = None,
           ) -> tuple[subprocess.Popen, Path, Path, Path]:
    """Start ``kvconnect-validate`` (host backend, plain output with every phase (``-v``),
    --json and --junit) with
    its own TMPDIR; returns the process, the tmpdir and both report paths."""
    tmpdir = _run_tmpdir()
    out, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    full_env = {**os.environ, "TMPDIR": str(tmpdir), **(env or {})}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        full_env.pop(k, None)
    proc = subprocess.Popen([str(VALIDATE), "--device", "host", "--plain", "-v", "--json",
                             str(out), "--junit", str(junit), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=full_env,
                            preexec_fn=preexec_fn)
    return proc, tmpdir, out, junit


def _wait_for_line(proc: subprocess.Popen, suffix: str, timeout: float) -> list[str]:
    """Read ``proc``'s output until a line ends with ``suffix`` (a progress line used only to
    time a signal); fails past ``timeout`` seconds."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if line.endswith(suffix):
            return seen
    proc.kill()
    proc.wait()
    raise AssertionError(f"no line ending {suffix!r} within {timeout} s:\n" + "\n".join(seen))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_stops_the_run_as_sigint_does_reports_written_workers_stopped(
        tmp_path: Path, signum: signal.Signals) -> None:
    """What a CI timeout or Kubernetes does (SIGTERM), or a closed terminal (SIGHUP: before
    issue 16 it killed the coordinator with no report), while prefill0 hangs in round 1."""
    proc, tmpdir, out, junit = _start(
        tmp_path, "--transports", "ipc", "--num-layers", "1", "--num-blocks", "8",
        "--timeout", "60", "--inject", "stop-prefill@transfer")
    try:
        _wait_for_line(proc, "prefill0: transfer:round1", timeout=PROCESS_TIMEOUT)
        t0 = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signum  # 143 for SIGTERM, 129 for SIGHUP, as SIGINT gives 130
    report = json.loads(out.read_text())
    assert report["exit_code"] == code and report["passed"] is False
    interrupted = report["interrupted"]
    assert (interrupted["signal"], interrupted["stage"]) == (signum.name, "run")
    assert interrupted["phases"]["prefill0"] == "transfer:round1"
    assert set(interrupted["phases"]) == {"prefill0", "decode0"}
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None and int(suite.get("failures", "0")) >= 1
    run = Run(code, "", "", report, ET.parse(junit).getroot(), took, tmpdir)
    assert_clean_exit(run)  # the stopped worker was killed and reaped, the directory removed
    assert took < 20, f"{signum.name} took {took:.1f} s to stop the run"


def test_a_killed_coordinator_leaves_no_worker_and_no_run_directory(tmp_path: Path) -> None:
    proc, tmpdir, out, _ = _start(
        tmp_path, "--transports", "ipc", "--num-layers", "1", "--num-blocks", "8",
        "--timeout", "60", "--inject", "stop-prefill@transfer")
    try:
        _wait_for_line(proc, "prefill0: transfer:round1", timeout=PROCESS_TIMEOUT)
        assert [p.name for p in tmpdir.iterdir()][0].startswith("kvv-")
        t0 = time.monotonic()
        proc.kill()  # SIGKILL: nothing of the coordinator runs again
        proc.wait(timeout=30)
        # forked workers share the coordinator's command line, which names the report path
        while time.monotonic() - t0 < 10 and (list(tmpdir.iterdir())
                                              or processes_mentioning(str(out))):
            time.sleep(0.05)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert processes_mentioning(str(out)) == []  # the stopped prefill0 too
    assert list(tmpdir.iterdir()) == [], f"left behind after {took:.1f} s"
    print(f"\nrun directory gone {took:.2f} s after SIGKILL of the coordinator")


def _with_fd_limits(soft: int, hard: int) -> Callable[[], None]:
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_fd_limit_is_raised_to_the_hard_limit_or_the_run_refused_with_the_numbers(
        tmp_path: Path) -> None:
    """48 layers = 96 KV segments: each worker needs ~350 fds, more than a soft limit of 256
    (before: 'Too many open files' in the transfers, after the workers had started)."""
    args = ["--transports", "ipc", "--num-layers", "48", "--num-blocks", "8"]
    runs = {}
    for name, (soft, hard) in {"raised": (256, 4096), "refused": (256, 256)}.items():
        (tmp_path / name).mkdir()
        proc, tmpdir, out, _ = _start(tmp_path / name, *args,
                                      preexec_fn=_with_fd_limits(soft, hard))
        runs[name] = (proc, out)
    reports = {}
    for name, (proc, out) in runs.items():
        try:
            text, _ = proc.communicate(timeout=PROCESS_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        reports[name] = (proc.returncode, json.loads(out.read_text()), text)
    code, report, text = reports["raised"]
    assert code == 0, text[-3000:]
    available = report["resources"]["available"]
    assert (available["fd_soft_limit_before"], available["fd_soft_limit"]) == (256, 4096)
    code, report, text = reports["refused"]
    assert code == 3 and report["exit_code"] == 3, text[-3000:]
    [problem] = report["resources"]["problems"]
    assert (problem["resource"], problem["limit"], problem["available"]) == \
        ("fds", "RLIMIT_NOFILE", 256)
    assert problem["needed"] == report["resources"]["needed"]["fds_per_process"] > 256
    assert report["workers"] == []  # refused before any worker started


def test_a_stalled_coordinator_blames_no_worker(tmp_path: Path) -> None:
    """Issue 16 defect 9: SIGSTOP the coordinator past the heartbeat limit, then SIGCONT.
    Before, the first worker it looked at was "stopped responding ... killed it"; now the
    stall is the coordinator's own (``coordinator/stalls``) and the run passes."""
    proc, tmpdir, out, junit = _start(
        tmp_path, "--transports", "ipc", "--num-layers", "1", "--num-blocks", "8",
        "--timeout", "8")  # heartbeat limit: 4 s
    try:
        _wait_for_line(proc, "decode0: allocate", timeout=PROCESS_TIMEOUT)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(7)
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    report = json.loads(out.read_text())
    failed = [(c["worker"], c["name"], c["detail"][:300]) for c in report["checks"]
              if c["status"] == "fail"]
    assert code == 0 and report["passed"], failed
    stalls = [c for c in report["checks"] if c["name"] == "coordinator/stalls"]
    assert stalls and stalls[0]["data"]["max_seconds"] >= 6, stalls
    assert_clean_exit(Run(code, "", "", report, ET.parse(junit).getroot(), 0.0, tmpdir))


def test_a_coordinator_stalled_past_the_workers_wait_is_blamed_not_a_worker(
        tmp_path: Path) -> None:
    """Issue 23 item 9: the coordinator stopped for longer than a worker waits for its
    answer (--timeout 4 + 5 s). Before: ``FAIL worker/prefill0 ... no answer from the
    coordinator`` beside ``PASS coordinator/stalls ... no worker was blamed``. Now the one
    failing check is ``coordinator/stalls``, naming the stall; prefill0's is a skip."""
    proc, tmpdir, out, junit = _start(
        tmp_path, "--transports", "ipc", "--num-layers", "1", "--num-blocks", "8",
        "--timeout", "4")
    try:
        _wait_for_line(proc, "decode0: allocate", timeout=PROCESS_TIMEOUT)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(16)  # prefill0's wait for decode0's hello gives up after 9 s of it
        proc.send_signal(signal.SIGCONT)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    report = json.loads(out.read_text())
    failed = [(c["worker"], c["name"], c["data"]) for c in report["checks"]
              if c["status"] == "fail"]
    assert code == 1 and not report["passed"]
    assert [(w, n) for w, n, _ in failed] == [("coordinator", "coordinator/stalls")], failed
    data = failed[0][2]
    assert data["cause"] == "coordinator_stall" and data["max_seconds"] >= 15
    assert data["wait_limit_seconds"] == 9
    workers = {c["name"]: c for c in report["checks"] if c["name"].startswith("worker/")}
    assert workers["worker/prefill0"]["status"] == "skip"
    assert workers["worker/prefill0"]["data"]["cause"] == "coordinator_stall"
    assert_clean_exit(Run(code, "", "", report, ET.parse(junit).getroot(), 0.0, tmpdir))


def test_more_workers_than_the_cpus_can_carry_are_refused_before_any_starts(
        tmp_path: Path) -> None:
    """Issue 16 defect 9: ``--prefill 64 --decode 64`` on a 2-core machine started 128
    workers, then blamed a running one ("stopped responding ... state R"). The pre-check
    refuses it with the CPUs it needs, before any worker starts."""
    cpus = len(os.sched_getaffinity(0))
    if cpus >= 32:
        pytest.skip(f"{cpus} CPUs carry 128 workers")
    out = tmp_path / "r.json"
    t0 = time.monotonic()
    proc = subprocess.run([str(VALIDATE), "--device", "host", "--prefill", "64", "--decode",
                           "64", "-q", "--json", str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TMPDIR": str(_run_tmpdir())})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    problems = {p["resource"]: p for p in json.loads(out.read_text())["resources"]["problems"]}
    assert problems["cpus"]["needed"] == 32 and problems["cpus"]["impossible"]  # (memory too,
    # when other jobs use this machine's memory)
    assert "128 workers need at least 32 CPUs" in proc.stderr


def test_a_size_sweep_reports_nccl_tests_figures_per_size_in_the_json(tmp_path: Path) -> None:
    """``--sizes``: per pair, transport and size, warm-up then timed fetches; avg/min/max
    latency and GB/s, a closing average per transport, byte-exact at every size, and the
    NIXL READ notifications of the sweep counted too."""
    run = validate(tmp_path, "--num-layers", "1", "--sizes", "64K:256K", "--warmup", "1",
                   "--iters", "3")
    assert run.code == 0, run.stdout[-4000:]
    points = run.report["sweep"]
    per_block = 2 * 32 * 1024  # llama3-8b-like, one layer: K and V pages of 32 KiB
    assert sorted((p["transport"], p["bytes"]) for p in points) == sorted(
        (t, b * per_block) for t in ("ipc", "nixl") for b in (1, 2, 4))
    for p in points:
        assert p["verified"] and (p["warmup"], p["iters"]) == (1, 3)
        assert p["min_seconds"] <= p["avg_seconds"] <= p["max_seconds"]
        assert p["avg_gbps"] == pytest.approx(p["bytes"] / p["avg_seconds"] / 1e9)
        assert p["reference_gbps"] > 0  # the same-run plain copy of the same bytes
    avg = run.report["sweep_average_gbps"]
    assert set(avg) == {"ipc", "nixl"} and avg["ipc"] == pytest.approx(
        sum(p["avg_gbps"] for p in points if p["transport"] == "ipc") / 3)
    assert "# Avg bandwidth ipc:" in run.stdout and "avg(us)" in run.stdout
    notes = run.check("prefill0", "nixl/notifications/round1")
    assert notes["status"] == "pass" and notes["data"]["expected"]["decode0"] == 1 + 3 * 4
