"""tests/_engine_runs.EngineBatch with stand-in children (plain Python scripts, no vLLM): one
engine's death ends the batch within the grace period instead of at the others' deadlines,
and the error names the one that failed first."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import _engine_runs
import pytest
from _engine_runs import EngineBatch

pytestmark = pytest.mark.timeout(120)

#: the child: ``crash`` writes a crash result and exits, ``die`` exits without a result,
#: ``ok`` writes a result, ``wait`` sleeps (an engine waiting on its peer)
CHILD = textwrap.dedent("""
    import json, sys, time
    scenario, spec_path = sys.argv[1], sys.argv[2]
    spec = json.load(open(spec_path))
    print("child", scenario, flush=True)
    if scenario == "crash":
        json.dump({"crash": "Traceback: boom"}, open(spec["result"], "w"))
    elif scenario == "ok":
        json.dump({"value": spec["value"]}, open(spec["result"], "w"))
    elif scenario == "wait":
        time.sleep(spec["seconds"])
        json.dump({"value": "late"}, open(spec["result"], "w"))
    sys.exit(0 if scenario != "die" else 3)
""")


@pytest.fixture
def batch_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type[EngineBatch]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    monkeypatch.setattr(_engine_runs, "FAILED_PEER_GRACE_S", 1.0)

    class StandInBatch(EngineBatch):
        child = script

    return StandInBatch


@pytest.mark.parametrize("scenario", ["crash", "die"])
def test_a_dead_engine_ends_the_batch_and_is_named_first(
        batch_of: type[EngineBatch], tmp_path: Path, scenario: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    start = time.monotonic()
    with batch_of(tmp_path, timeout=90) as batch:
        waiter = batch.start("a-waiter", "wait", {"seconds": 80}, env)
        batch.start("b-dead", scenario, {}, env)
        with pytest.raises(RuntimeError) as info:
            batch.results()
        assert waiter.proc.poll() is not None  # killed after the grace, not at 80 s
    assert time.monotonic() - start < 40
    text = str(info.value)
    assert text.startswith("2 of 2 engines failed (first: b-dead)")
    assert text.index("b-dead") < text.index("engine a-waiter")
    assert "child " + scenario in text  # the dead one's log tail


def test_engines_that_all_finish_give_their_results(
        batch_of: type[EngineBatch], tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    with batch_of(tmp_path, timeout=60) as batch:
        batch.start("one", "ok", {"value": 1}, env)
        batch.start("two", "wait", {"seconds": 2}, env)
        assert batch.results() == {"one": {"value": 1}, "two": {"value": "late"}}
    assert json.loads((tmp_path / "one.result.json").read_text()) == {"value": 1}
