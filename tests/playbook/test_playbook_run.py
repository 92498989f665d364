"""Playbooks for real on the local target: C1's workload in real tmux sessions, a real lineage file."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.playbook.conftest import PLAYBOOKS

Write = Callable[[str, str], Path]


def state_of(env: Env, name: str) -> str:
    return env.agent("status", {"workspace": str(env.workspace), "name": name})["runs"][0]["state"]


def lineage(env: Env) -> dict[str, str | None]:
    with sqlite3.connect(env.db) as db:
        return dict(db.execute("SELECT name, parent FROM runs").fetchall())


def test_restart_cycle_for_real(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = env.cli(
        "deploy",
        "local",
        "--profile",
        "work",
        "--name",
        "exp-flex5",
        "--wait",
        r"step 2\b",
        "--timeout",
        "30",
        capsys=capsys,
    )
    assert code == 0, err
    # No --set: `run` defaults to the most recently started running run on the target.
    done = env.run_cli(
        "play",
        str(PLAYBOOKS / "restart-cycle.yaml"),
        "--target",
        "local",
        "--json",
        "--set",
        "note=lr 6e-4",
        "--set",
        "grace=10",
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # sync is "ok" unless someone edited trainer/ since the deploy above (shared working trees do)
    assert [(s["kind"], s["status"]) for s in report["steps"] if s["kind"] != "sync"] == [
        ("stop", "changed"),
        ("clear-cache", "ok"),
        ("deploy", "changed"),
        ("wait", "ok"),
    ]
    assert report["steps"][1]["kind"] == "sync" and report["steps"][1]["status"] in ("ok", "changed")
    assert report["completed"] and report["variables"]["run"] == "exp-flex5"
    assert all(s["seconds"] >= 0 for s in report["steps"])
    assert "stopped exp-flex5 by SIGTERM, exit code 143" in report["steps"][0]["detail"]
    # the per-step report on stderr: status words, kinds and durations
    assert "changed   [1] stop: stop the old run cleanly" in done.stderr
    assert "ok        [5] wait:" in done.stderr and " changed, " in done.stderr
    assert lineage(env) == {"exp-flex5": None, "exp-flex6": "exp-flex5"}
    child = json.loads((env.runs / "exp-flex6" / "run.json").read_text())
    assert child["note"] == "lr 6e-4" and child["parent"] == "exp-flex5"
    assert state_of(env, "exp-flex5") == "stopped" and state_of(env, "exp-flex6") == "running"
    steps = [json.loads(line)["step"] for line in (env.runs / "exp-flex6" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) >= 10
    assert (env.runs / "exp-flex5" / "checkpoints").is_dir()  # SIGTERM first: the old run checkpointed


def test_check_lists_commands_and_runs_nothing(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "work", "--name", "base1", capsys=capsys)
    assert code == 0, err
    before_runs = sorted(p.name for p in env.runs.iterdir())
    before_releases = sorted(p.name for p in (env.workspace / "releases").iterdir())
    pgid = (env.runs / "base1" / "pgid").read_text()
    code, out, err = env.cli(
        "play", str(PLAYBOOKS / "restart-cycle.yaml"), "--check", "--set", "run=base1", capsys=capsys
    )
    assert code == 0, err
    assert "# [1] stop: stop the old run cleanly" in out
    assert " stop --json-args " in out and '"name": "base1"' in out
    assert " clear-cache --json-args " in out and " launch --json-stdin" in out and "base2" in out
    # the launch request reads as JSON, one key per line under its command (issue 46 item 11), not one long line
    request = out[out.index("< request JSON: ") + len("< request JSON: ") : out.index("\n# [5]")]
    assert json.loads(request)["name"] == "base2" and request.count("\n") > 20
    assert '\n    "name": "base2",\n' in out
    # what the playbook says it does is what its plan does: the target's caches cleared, a fresh relaunch
    text = (PLAYBOOKS / "restart-cycle.yaml").read_text()
    assert "# [3] clear-cache: clear the target's compile caches" in out and "compile caches of local" in err
    assert "clear the target's compile caches" in text and "THIS code's" not in text
    assert "relaunch FRESH" in text and "# [4] deploy: relaunch fresh" in out and "--resume" not in request
    assert "# [5] wait:" in out and " tail --json-args " in out and "step >= 10" in out
    assert "planned" in err
    # nothing ran: same runs, same releases, the run still running in the same process group, no new lineage row
    assert sorted(p.name for p in env.runs.iterdir()) == before_runs
    assert sorted(p.name for p in (env.workspace / "releases").iterdir()) == before_releases
    assert state_of(env, "base1") == "running" and (env.runs / "base1" / "pgid").read_text() == pgid
    assert not (env.runs / "base1" / "stop.json").exists()
    assert lineage(env) == {"base1": None}


def test_failure_policies(env: Env, write: Write, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        "crash.yaml",
        """\
vars:
  policy: continue
steps:
  - deploy: {profile: work, name: crashy, extra_args: [--crash-at, "4"]}
    register: d
  - name: wait past the crash
    wait: {run: "{{d.name}}", metric: "step >= 50", timeout: 30, poll: 0.1}
    on_failure: continue
  - name: runs after a tolerated failure
    exec: {argv: ["{{python}}", "-c", "print('after')"]}
  - name: assert fails and stops
    assert: {run: "{{d.name}}", that: "state == 'finished'"}
  - exec: {argv: ["{{python}}", "-c", "print('never')"]}
""".replace("{{python}}", __import__("sys").executable),
    )
    code, out, err = env.cli("play", str(path), "--json", capsys=capsys)
    report = json.loads(out)
    statuses = [(s["kind"], s["status"]) for s in report["steps"]]
    assert statuses == [
        ("deploy", "changed"),
        ("wait", "failed"),
        ("exec", "changed"),
        ("assert", "failed"),
        ("exec", "skipped"),
    ]
    assert "failure pattern" in report["steps"][1]["detail"] or "crashed" in report["steps"][1]["detail"]
    assert "exit code 0: after" in report["steps"][2]["detail"]
    assert "state == 'finished'" in report["steps"][3]["detail"] and "state='crashed'" in report["steps"][3]["detail"]
    assert code == 7 and not report["completed"]
    assert "error: playbook stopped: assert failed" in err


@pytest.mark.parametrize("profile", ["work", "plain"])  # plain: no `check:`, revived unchecked as a supervisor does
def test_restart_with_resume_recovers(env: Env, write: Write, capsys: pytest.CaptureFixture[str], profile: str) -> None:
    from tests.controller.test_ctl_reliability import add_profile
    from tests.controller.test_ctl_restart_unchecked import PLAIN

    add_profile(env, "plain", PLAIN)
    path = write(
        "resume.yaml",
        """\
steps:
  - deploy: {profile: PROFILE, name: long1}
    register: d
  - wait: {run: "{{d.name}}", log: 'step 3\\b', timeout: 30}
  - name: only a resumed run says this
    wait: {run: "{{d.name}}", log: "resumed from", timeout: 1.5, poll: 0.1}
    on_failure: restart-with-resume
  - name: later steps follow the child
    assert: {run: "{{d.name}}", that: "state == 'running'"}
""".replace("PROFILE", profile),
    )
    code, out, err = env.cli("play", str(path), "--json", capsys=capsys)
    report = json.loads(out)
    assert code == 0, err
    rows = [(s["index"], s["kind"], s["status"]) for s in report["steps"]]
    assert rows == [
        ("1", "deploy", "changed"),
        ("2", "wait", "ok"),
        ("3", "wait", "failed"),
        ("3r", "restart", "recovered"),
        ("3'", "wait", "ok"),
        ("4", "assert", "ok"),
    ]
    assert "as long2 from" in report["steps"][3]["detail"] and "checkpoints/step_" in report["steps"][3]["detail"]
    assert lineage(env) == {"long1": None, "long2": "long1"}
    assert state_of(env, "long1") == "stopped" and state_of(env, "long2") == "running"


def test_sweep_collects_one_table(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    grid = '[{tag: fast, args: [--interval, "0.01"]}, {tag: slow, args: [--interval, "0.03"]}]'
    code, out, err = env.cli(
        "play",
        str(PLAYBOOKS / "sweep.yaml"),
        "--check",
        "--set",
        "profile=work",
        "--set",
        f"grid={grid}",
        capsys=capsys,
    )
    assert code == 0, err
    assert out.count(" launch --json-stdin") == 2 and '"name": "sweep-slow"' in out  # stop of a planned run
    assert not env.runs.exists() and not env.db.exists()  # the check launched nothing
    code, out, err = env.cli(
        "play",
        str(PLAYBOOKS / "sweep.yaml"),
        "--set",
        "profile=work",
        "--set",
        "steps=5",
        "--set",
        "grace=5",
        "--set",
        f"grid={grid}",
        capsys=capsys,
    )
    assert code == 0, err
    lines = [line for line in out.splitlines() if "sweep-" in line]
    assert len(lines) == 2 and "sweep-fast" in lines[0] and "sweep-slow" in lines[1]
    assert "throughput" in out and "block_tok_s" in out
    assert "launch fast" in err and "launch slow" in err
    for name in ("sweep-fast", "sweep-slow"):
        assert state_of(env, name) == "stopped"
    argv = json.loads((env.runs / "sweep-slow" / "run.json").read_text())["argv"]
    assert argv.count("--interval") == 1 and argv[argv.index("--interval") + 1] == "0.03"  # replaced, not appended


def test_a_restart_step_of_a_job_nothing_can_check(env: Env, write: Write, capsys: pytest.CaptureFixture[str]) -> None:
    """A `restart:` step whose old run is alive and whose job has no `check:` fails as `restart` does, leaving the
    run going; `unchecked: true` restarts it (test_restart_with_resume_recovers: a recovery revives unchecked)."""
    from tests.controller.test_ctl_reliability import add_profile
    from tests.controller.test_ctl_restart_unchecked import PLAIN

    add_profile(env, "plain", PLAIN)
    steps = """\
steps:
  - deploy: {profile: plain, name: pl1, launcher: nohup}
  - wait: {run: pl1, log: 'step 3\\b', timeout: 30}
  - restart: {run: pl1, resume: true%s}
"""
    code, out, err = env.cli("play", str(write("refused.yaml", steps % "")), "--json", capsys=capsys)
    report = json.loads(out)
    assert code == 2 and report["steps"][2]["status"] == "failed", err
    assert report["steps"][2]["detail"] == "pl1's job (profile plain) cannot be checked before the old run is stopped"
    assert f"hint: add check: to profile plain in {env.inventory}" in err, err
    assert state_of(env, "pl1") == "running" and lineage(env) == {"pl1": None}

    code, out, err = env.cli(
        "play", str(write("told.yaml", (steps % ", unchecked: true").replace("pl1", "pl5"))), capsys=capsys
    )
    assert code == 0, err
    assert lineage(env) == {"pl1": None, "pl5": None, "pl6": "pl5"} and state_of(env, "pl5") == "stopped"
