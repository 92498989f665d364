"""`status` of a workspace that kept every run it ever had (issue 47), small: one /proc walk per call for every
run, a run launched while the call reads the others, the default window of `dflashops status` (running and
recently ended runs), --all-runs and --json complete. The timed figures at 1,000 runs are
bench/control_plane_scale.py's (bench/results/control-plane.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.agent import common as agent_common
from dflashops.agent import status as agent_status
from dflashops.agent.protocol import parse
from tests.controller.helpers import Env

DAY_S = 86400
LIVE = "import time; time.sleep(60)"


def finished_run(runs: Path, name: str, ended_days_ago: float) -> Path:
    """A run directory as a finished run leaves it; its pgid names a group that is gone."""
    run = runs / name
    run.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    (run / "pgid").write_text(f"{gone.pid}\n")
    (run / "marker").write_text(f"{name}.0123abcd\n")
    (run / "run.json").write_text(json.dumps({"name": name, "target": "local", "launcher": "nohup"}))
    (run / "exit_code").write_text("0\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(5)))
    ended = time.time() - ended_days_ago * DAY_S
    os.utime(run / "exit_code", (ended, ended))
    return run


@pytest.fixture
def live_run(tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """A running run: a process of its own group carrying the run's marker, as the launch wrapper starts it."""
    run = tmp_path / "ws" / "runs" / "live"
    run.mkdir(parents=True)
    marker = "live.feedbeef"
    (run / "marker").write_text(marker + "\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", LIVE], start_new_session=True, env={**os.environ, "DFLASHOPS_RUN_ID": marker}
    )
    (run / "pgid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 20  # until the child's environment is its own (exec done)
    while marker.encode() not in agent_common.read_proc(proc.pid, "environ"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield run, proc
    proc.kill()
    proc.wait()


def test_one_proc_walk_for_every_run(
    tmp_path: Path, live_run: tuple[Path, subprocess.Popen], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = tmp_path / "ws" / "runs"
    for index in range(20):
        finished_run(runs, f"old{index}", ended_days_ago=30)
    walks: list[int] = []
    real_all_pids = agent_common.all_pids

    def counted() -> list[int]:
        walks.append(1)
        return real_all_pids()

    monkeypatch.setattr(agent_common, "all_pids", counted)
    answer = agent_status.verb_status(parse("status", {"workspace": str(tmp_path / "ws")}))
    assert len(walks) == 1  # was one walk per run that kept its pgid file: O(runs x processes)
    by_name = {entry["name"]: entry for entry in answer["runs"]}
    assert len(by_name) == 21
    assert by_name["live"]["state"] == "running" and by_name["live"]["pids"] == [live_run[1].pid]
    assert by_name["old3"]["state"] == "finished" and by_name["old3"]["pids"] == []
    assert by_name["old3"]["ended_at"] < time.time() - 29 * DAY_S and by_name["live"]["ended_at"] is None


def test_a_run_launched_after_the_walk_is_not_lost(tmp_path: Path, live_run: tuple[Path, subprocess.Popen]) -> None:
    """The shared walk is taken before any run is read; a run whose pgid file is newer than the walk (launched
    meanwhile) and shows no process in it is looked up again, not reported lost."""
    run, proc = live_run
    stale = agent_common.ProcessTable()
    stale.groups.pop(proc.pid, None)  # the walk as it was before the launch: no process of the run in it
    stale.marked.pop("live.feedbeef", None)
    # ...and taken when the pgid file was written: the fixture's wait for the child's exec can outlast the
    # table's 1 s of slack on a loaded machine, which made a walk taken now look newer than the launch.
    stale.taken_at = (run / "pgid").stat().st_mtime
    status = agent_status.run_status(str(run), stale)
    assert (status["state"], status["pids"]) == ("running", [proc.pid])


def test_the_window_leaves_out_runs_that_ended_long_ago(
    tmp_path: Path, live_run: tuple[Path, subprocess.Popen]
) -> None:
    runs = tmp_path / "ws" / "runs"
    finished_run(runs, "old", ended_days_ago=30)
    finished_run(runs, "recent", ended_days_ago=0.1)
    straggler = finished_run(runs, "straggler", ended_days_ago=30)
    (straggler / "marker").write_text("live.feedbeef\n")  # its exit code is old, a process of it still lives
    answer = agent_status.verb_status(parse("status", {"workspace": str(tmp_path / "ws"), "ended_within_s": DAY_S}))
    assert sorted(entry["name"] for entry in answer["runs"]) == ["live", "recent", "straggler"]
    assert answer["older_runs"] == 1


def test_dflashops_status_shows_running_and_recent_runs_and_says_what_it_left_out(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = env.workspace / "runs"
    finished_run(runs, "old-a", ended_days_ago=30)
    finished_run(runs, "old-b", ended_days_ago=2)
    finished_run(runs, "fresh", ended_days_ago=0.01)
    code, out, err = env.cli("status", capsys=capsys)
    assert code == 0, err
    assert "fresh" in out and "old-a" not in out and "old-b" not in out
    assert "2 runs that ended more than 24 h ago not shown (--all-runs shows every run" in err
    code, out, err = env.cli("status", "--all-runs", capsys=capsys)
    assert code == 0 and all(name in out for name in ("fresh", "old-a", "old-b")) and "not shown" not in err
    code, out, err = env.cli("status", "--json", capsys=capsys)
    assert code == 0 and sorted(entry["name"] for entry in json.loads(out)["runs"]) == ["fresh", "old-a", "old-b"]
