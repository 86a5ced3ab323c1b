"""Attributing NIXL READs to UCX lanes from UCX_PROTO_INFO output."""

from __future__ import annotations

from pathlib import Path

from kvconnect.connectors.nixl.ucx_lanes import LaneTracker, parse_read_lanes

_P = "[1795997993.341576] [vm:18832:0]   "
SAMPLE = "\n".join(_P + line for line in [
    "+------------+--------------------+---------------+",
    "| decode0-fc389662ffaf self cfg#0                 |",
    "| active message by ucp_am_send* from host memory |",
    "+------------+--------------------+---------------+",
    "|   Range    |    Description     |    Config     |",
    "+------------+--------------------+---------------+",
    "|          0 | short              | tcp/lo        |",
    "+------------+--------------------+---------------+",
    "+--------+-------------+-------------------------------------------+",
    "| decode0-fc389662ffaf intra-node cfg#1                             |",
    "| remote memory read by ucp_get*(multi) into host memory from host |",
    "+--------+-------------+-------------------------------------------+",
    "| Range  | Description |                  Config                   |",
    "+--------+-------------+-------------------------------------------+",
    "| 0..inf | zero-copy   | cma/memory                                |",
    "+--------+-------------+-------------------------------------------+",
    "+-----------+--------------------+---------------+",
    "| decode0 intra-node cfg#2                        |",
    "| remote memory read by ucp_get* into cuda memory from cuda |",
    "+-----------+--------------------+---------------+",
    "|   Range   |    Description     |    Config     |",
    "+-----------+--------------------+---------------+",
    "|  0..8184  | software emulation | tcp/lo        |",
    "| 8185..inf | software emulation | tcp/lo        |",
    "+-----------+--------------------+---------------+",
])


def test_parse_read_lanes_keeps_only_read_protocols() -> None:
    assert parse_read_lanes(SAMPLE) == [
        "cma/memory zero-copy (host<-host)",
        "tcp/lo software emulation (cuda<-cuda)",
    ]
    assert parse_read_lanes("no tables here\n| just | a | row |") == []


def test_tracker_reads_only_new_output_and_remembers_the_peer(tmp_path: Path,
                                                              monkeypatch) -> None:
    log = tmp_path / "worker.log"
    log.write_text("old output\n")
    monkeypatch.setattr("kvconnect.connectors.nixl.ucx_lanes._stdout_file", lambda: str(log))
    tracker = LaneTracker()
    assert tracker.lanes_after_read("prefill0") == []
    with log.open("a") as f:
        f.write(SAMPLE.split("+-----------+")[0] + "\n")  # the host table only
    assert tracker.lanes_after_read("prefill0") == ["cma/memory zero-copy (host<-host)"]
    # nothing new printed (UCX reuses its selection): the peer's lanes are remembered
    assert tracker.lanes_after_read("prefill0") == ["cma/memory zero-copy (host<-host)"]
    # a new peer whose endpoint shares the configuration: UCX printed nothing, the READ
    # reused the one selection made (before: attributed to no lane at all)
    assert tracker.lanes_after_read("prefill1") == ["cma/memory zero-copy (host<-host)"]


def test_a_reused_selection_among_several_is_named_as_alternatives(tmp_path: Path,
                                                                   monkeypatch) -> None:
    log = tmp_path / "worker.log"
    log.write_text("")
    monkeypatch.setattr("kvconnect.connectors.nixl.ucx_lanes._stdout_file", lambda: str(log))
    tracker = LaneTracker()
    assert tracker.lanes_after_read("prefill0") == []  # no table yet: nothing is known
    with log.open("a") as f:
        f.write(SAMPLE + "\n")  # two READ selections: host (cfg#1) and cuda (cfg#2)
    assert tracker.lanes_after_read("prefill0") == [
        "cma/memory zero-copy (host<-host)", "tcp/lo software emulation (cuda<-cuda)"]
    assert sorted(tracker.selections) == ["intra-node cfg#1 (host<-host)",
                                          "intra-node cfg#2 (cuda<-cuda)"]
    assert tracker.lanes_after_read("prefill1") == [
        "one of: cma/memory zero-copy (host<-host) | tcp/lo software emulation (cuda<-cuda)"]
