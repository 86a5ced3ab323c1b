"""The rendezvous token (multi-host runs): members prove they know a shared secret with
HMACs over fresh nonces, never sending it; every store value the run reads is sealed.

In-process against a real ``torch.distributed.TCPStore`` (what this process writes is
recorded to show the token never reaches the store), then real ``kvconnect-validate``
processes meeting on loopback: matching tokens pass, a wrong or missing one is refused with
exit 3 and one line.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvconnect.harness import cli
from kvconnect.harness.multihost.store_auth import (
    RendezvousRefused,
    TamperedValue,
    authenticate_member,
    authenticate_reporter,
)

VALIDATE = Path(sys.executable).with_name("kvconnect-validate")
TOKEN = b"correct-horse-battery-staple-0042"
PREFIX = "kvconnect-validate/"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Recording:
    """A real TCPStore client; remembers every value this process wrote through it."""

    def __init__(self, store: Any, written: list[bytes]) -> None:
        self._store = store
        self.written = written

    def set(self, key: str, value: str | bytes) -> None:
        self.written.append(value.encode() if isinstance(value, str) else value)
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture
def stores() -> Any:
    """A TCPStore server and a factory of recording clients."""
    from torch.distributed import TCPStore

    port = _free_port()
    timeout = datetime.timedelta(seconds=30)
    server = TCPStore("127.0.0.1", port, world_size=None, is_master=True, timeout=timeout,
                      wait_for_workers=False)
    written: list[bytes] = []

    def client() -> _Recording:
        return _Recording(TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                                   timeout=timeout, wait_for_workers=False), written)

    yield client, written
    del server


def _both(client: Any, host_token: bytes | None, member_token: bytes | None,
          timeout: float = 10.0) -> tuple[Any, Any]:
    """Run the reporter's and decode0's sides concurrently; each returns a Sealer or the
    exception it raised."""
    out: dict[str, Any] = {}

    def host() -> None:
        try:
            out["host"] = authenticate_reporter(client(), PREFIX, host_token, ["decode0"],
                                                "test", timeout)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["host"] = exc

    thread = threading.Thread(target=host)
    thread.start()
    try:
        out["member"] = authenticate_member(client(), PREFIX, member_token, "decode0", "test",
                                            timeout)
    except Exception as exc:  # noqa: BLE001
        out["member"] = exc
    thread.join(timeout + 10)
    return out["host"], out["member"]


def test_members_prove_the_token_and_values_are_sealed_without_sending_it(stores) -> None:
    client, written = stores
    host, member = _both(client, TOKEN, TOKEN)
    assert host.active and member.active
    sealed = member.seal(PREFIX + "kv/decode0/hello", json.dumps({"pid": 1}))
    assert json.loads(host.open(PREFIX + "kv/decode0/hello", sealed)) == {"pid": 1}
    with pytest.raises(TamperedValue):  # a changed value
        host.open(PREFIX + "kv/decode0/hello", sealed.replace('"pid": 1', '"pid": 2'))
    with pytest.raises(TamperedValue):  # moved to another key
        host.open(PREFIX + "kv/decode0/round1", sealed)
    with pytest.raises(TamperedValue):  # written by someone without the token
        host.open(PREFIX + "kv/x", json.dumps({"pid": 1}))
    assert written and not any(TOKEN in w or TOKEN.hex().encode() in w for w in written)
    # another run (fresh nonces, a fresh store as prefill0 hosts one) cannot replay this
    # run's values
    for key in ("auth/mode", "auth/proof/decode0", "auth/verdict/decode0"):
        client().delete_key(PREFIX + key)
    host2, member2 = _both(client, TOKEN, TOKEN)
    assert host2.active and member2.active
    with pytest.raises(TamperedValue):
        host2.open(PREFIX + "kv/decode0/hello", sealed)


def test_a_wrong_missing_or_unexpected_token_is_refused(stores) -> None:
    client, _ = stores
    host, member = _both(client, TOKEN, b"wrong-horse-battery-staple-0042", timeout=2.0)
    assert isinstance(member, RendezvousRefused) and member.cause == "wrong_token"
    assert isinstance(host, RendezvousRefused) and host.cause == "members_missing"
    assert "1 attempt(s) refused for a wrong token" in str(host)
    for key in ("auth/mode", "auth/proof/decode0", "auth/verdict/decode0"):  # a clean store
        client().delete_key(PREFIX + key)
    host, member = _both(client, TOKEN, None, timeout=2.0)
    assert isinstance(member, RendezvousRefused) and member.cause == "token_missing"
    client().delete_key(PREFIX + "auth/mode")
    host, member = _both(client, None, TOKEN, timeout=2.0)
    assert isinstance(member, RendezvousRefused) and member.cause == "unauthenticated_host"
    assert not host.active  # the reporter itself runs without


@pytest.mark.parametrize("argv, message", [
    (["--rendezvous-token-file", "/nonexistent/token"], "for multi-host runs"),
    (["--rendezvous", "h:1234", "--role", "decode", "--rank", "0",
      "--rendezvous-token-file", "/nonexistent/token"], "No such file"),
])
def test_bad_token_arguments_exit_2(argv: list[str], message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_short_token_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCONNECT_RENDEZVOUS_TOKEN", "short")
    assert cli.main(["--rendezvous", "h:1234", "--role", "decode", "--rank", "0"]) == 2
    assert "use at least 16 random" in capsys.readouterr().err


def test_a_token_fifo_nobody_writes_is_refused_within_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before issue 16 this hung past --timeout (a blocking open of the FIFO)."""
    fifo = tmp_path / "token.fifo"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert cli.main(["--rendezvous", "h:1234", "--role", "decode", "--rank", "0",
                     "--timeout", "1", "--rendezvous-token-file", str(fifo)]) == 2
    assert time.monotonic() - t0 < 10
    assert "a pipe that delivered no token within 1 s" in capsys.readouterr().err


def test_a_token_from_a_pipe_and_not_from_a_directory(tmp_path: Path) -> None:
    """``<(vault read ...)`` hands a pipe: read to its end; a directory is refused."""
    from kvconnect.harness.multihost.store_auth import TokenError, load_token

    r, w = os.pipe()
    os.write(w, TOKEN + b"\n")
    os.close(w)
    try:
        assert load_token(f"/proc/self/fd/{r}", {}, timeout=5) == TOKEN
    finally:
        os.close(r)
    with pytest.raises(TokenError, match="not a regular file or a pipe"):
        load_token(str(tmp_path), {}, timeout=5)


# -- real processes -----------------------------------------------------------------------------
def _launch(tmp_path: Path, name: str, args: list[str], env: dict[str, str],
            ) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{name}.json"
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                         "KVCONNECT_RENDEZVOUS_TOKEN")}
    proc = subprocess.Popen([str(VALIDATE), "--device", "host", "--plain", "--json", str(out),
                             *args], env={**base, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, out


def _finish(proc: subprocess.Popen, out: Path) -> tuple[int, str, dict[str, Any], float]:
    t0 = time.monotonic()
    try:
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, err, report, time.monotonic() - t0


@pytest.fixture
def short_tmp() -> Any:
    """A TMPDIR short enough for Unix socket paths (removed afterwards, whatever happened)."""
    path = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_processes_with_the_token_run_and_one_with_a_wrong_token_is_refused(
        tmp_path: Path, short_tmp: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(TOKEN + b"\n")
    token_file.chmod(0o600)
    common = ["--prefill", "1", "--decode", "1", "--num-layers", "1", "--num-blocks", "8",
              "--transports", "ipc"]
    # 1. the same token, from a file and from the environment: the run passes
    port = _free_port()
    rdv = ["--rendezvous", f"127.0.0.1:{port}", "--timeout", "30"]
    (tmp_path / "ok").mkdir()
    p = _launch(tmp_path / "ok", "prefill", [*common, *rdv, "--role", "prefill", "--rank", "0",
                                             "--rendezvous-token-file", str(token_file)],
                {"TMPDIR": str(short_tmp)})
    d = _launch(tmp_path / "ok", "decode", [*common, *rdv, "--role", "decode", "--rank", "0"],
                {"KVCONNECT_RENDEZVOUS_TOKEN": TOKEN.decode()})
    pcode, perr, prep, _ = _finish(*p)
    dcode, derr, drep, _ = _finish(*d)
    failed = [(c["worker"], c["name"], c["detail"][:300]) for rep in (prep, drep)
              for c in rep.get("checks", []) if c["status"] == "fail"]
    assert (pcode, dcode) == (0, 0), (failed, perr[-2000:] + derr[-2000:])
    for rep in (prep, drep):
        [auth] = [c for c in rep["checks"] if c["name"] == "rendezvous"]
        assert auth["status"] == "pass" and auth["data"]["token"] is True
        assert TOKEN.decode() not in json.dumps(rep)
    # 2. a decode with a wrong token: refused at once, exit 3, one line; the prefill gives
    # up at its deadline with exit 3 and one line
    port = _free_port()
    rdv = ["--rendezvous", f"127.0.0.1:{port}", "--timeout", "5"]
    (tmp_path / "bad").mkdir()
    p = _launch(tmp_path / "bad", "prefill", [*common, *rdv, "--role", "prefill", "--rank",
                                              "0", "--rendezvous-token-file", str(token_file)],
                {"TMPDIR": str(short_tmp)})
    d = _launch(tmp_path / "bad", "decode", [*common, *rdv, "--role", "decode", "--rank", "0"],
                {"KVCONNECT_RENDEZVOUS_TOKEN": "wrong-horse-battery-staple-0042"})
    dcode, derr, drep, dwall = _finish(*d)
    pcode, perr, prep, _ = _finish(*p)
    assert dcode == 3 and drep["exit_code"] == 3, derr
    lines = [line for line in derr.splitlines() if line.strip()]
    assert len(lines) == 1 and "token does not match" in lines[0], derr
    [auth] = [c for c in drep["checks"] if c["name"] == "rendezvous"]
    assert auth["data"]["cause"] == "wrong_token"
    assert pcode == 3, perr
    lines = [line for line in perr.splitlines() if line.strip()]
    assert len(lines) == 1 and "did not prove the rendezvous token" in lines[0], perr
    assert list(short_tmp.iterdir()) == []
