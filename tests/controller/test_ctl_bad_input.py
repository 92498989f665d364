"""Every bad input of issue 2 is refused with `error: ...` (+ `hint:`), a non-zero exit, and no change."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.controller.helpers import AGENT, Env


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under root with its size and mtime: equal snapshots mean nothing changed."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize(
    "name", ["a;rm -rf x", "two words", "..", "a/b", "it's", 'q"uote', "x" * 65, "-lead", "a..b", ""]
)
def test_bad_run_names_are_refused_before_anything(env: Env, capsys: pytest.CaptureFixture[str], name: str) -> None:
    before = snapshot(env.root)
    code, out, err = env.cli("deploy", "--detach", "--profile", "work", f"--name={name}", capsys=capsys)
    assert code == 2
    assert err.startswith("error: invalid run name") and "\nhint: " in err
    assert out == "" and snapshot(env.root) == before and not env.workspace.exists()


def test_bad_names_in_other_verbs(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["stop", "a;b"],
        ["logs", "../x"],
        ["status", "a b"],
        ["restart", "--detach", "x" * 65],
        ["deploy", "--detach", "--profile", "work", "--parent", "a/b"],
    ):
        code, _, err = env.cli(*argv, capsys=capsys)
        assert code == 2 and "error: invalid" in err, argv
    assert not env.workspace.exists()


def test_unknown_target_and_profile(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli("deploy", "--detach", "nowhere", "--profile", "work", capsys=capsys)
    assert code == 3 and "error: unknown target 'nowhere'" in err and "hint: targets: local" in err
    code, _, err = env.cli("deploy", "--detach", "local", "--profile", "nope", capsys=capsys)
    assert code == 3 and "error: unknown profile 'nope'" in err and "hint: profiles: work" in err
    assert not env.workspace.exists() and not env.db.exists()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("targets:\n  local:\n    kind: local\n   workspace: ws\n", "inventory.yaml:4: invalid YAML"),
        (
            "targets:\n  local:\n    kind: local\n    workspace: ws\n    gpus: zero\n",
            "inventory.yaml:5: targets.local.gpus: expected a list of integers",
        ),
        (
            "targets:\n  local:\n    kind: local\n    workspace: ws\n    wrkspace: ws\n",
            "inventory.yaml:5: targets.local.wrkspace: unknown key",
        ),
        (
            "targets:\n  local:\n    kind: lxc\n    workspace: ws\n",
            "inventory.yaml:3: targets.local.kind: must be one of",
        ),
        ("profiles:\n  p:\n    argv: python\n", "inventory.yaml:3: profiles.p.argv: expected a list of strings"),
        ("hosts:\n  h:\n    user: root\n", "inventory.yaml:3: hosts.h: missing required key 'address'"),
        ("targets: [1, 2]\n", "inventory.yaml:1: targets: expected a mapping"),
        ("colour: blue\n", "inventory.yaml:1: colour: unknown key"),
        (
            "profiles:\n  p:\n    argv: [x]\n    packages: [a-b]\n",
            "inventory.yaml:4: profiles.p.packages: 'a-b' is not",
        ),
        ("profiles:\n  p:\n    argv: [x]\n    env: {A-B: 1}\n", "profiles.p.env.A-B: invalid environment variable"),
        (
            "targets:\n  local:\n    kind: local\n    workspace: ws\n    standby: maybe\n",
            "inventory.yaml:5: targets.local.standby: expected bool",
        ),
        (
            "targets:\n  local:\n    kind: local\n    workspace: ws\n    standby_idle_s: 0\n",
            "inventory.yaml:5: targets.local.standby_idle_s: must be a positive number of seconds",
        ),
    ],
)
def test_malformed_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str) -> None:
    from dflashops.cli.main import main

    (tmp_path / "inventory.yaml").write_text(text)
    code = main(["--inventory", str(tmp_path / "inventory.yaml"), "status"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and expected in err and "hint: " in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.yaml"]


def test_missing_inventory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dflashops.cli.main import main

    assert main(["--inventory", str(tmp_path / "absent.yaml"), "status"]) == 2
    assert "cannot read inventory" in capsys.readouterr().err


def test_deploy_onto_existing_name_changes_nothing(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "taken", "--wait", "step 2", capsys=capsys)[0] == 0
    assert env.cli("stop", "taken", "--grace", "5", capsys=capsys)[0] == 0
    before = snapshot(env.root)
    code, _, err = env.cli("deploy", "--detach", "--profile", "work", "--name", "taken", capsys=capsys)
    assert code == 4 and "error: run name 'taken' is already used" in err and "hint:" in err
    assert snapshot(env.root) == before
    # A run directory the database does not know (db lost): still refused, before any sync.
    (env.runs / "orphan").mkdir()
    before = snapshot(env.root)
    code, _, err = env.cli("deploy", "--detach", "--profile", "work", "--name", "orphan", capsys=capsys)
    assert code == 4 and "already exists" in err and snapshot(env.root) == before


def test_restart_onto_existing_name_leaves_the_run_running(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "keep-v1", "--wait", "step 1", capsys=capsys)[0] == 0
    assert env.cli("deploy", "--profile", "work", "--name", "other", "--wait", "step 1", capsys=capsys)[0] == 0
    code, _, err = env.cli("restart", "--detach", "keep-v1", "--name", "other", capsys=capsys)
    assert code == 4 and "already used" in err
    code, out, _ = env.cli("status", "keep-v1", capsys=capsys)
    assert re.search(r"^keep-v1\s+local\s+running\s", out, re.M), out


def test_stop_logs_restart_of_missing_or_finished_runs(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli("stop", "ghost", capsys=capsys)
    assert code == 3 and "does not exist" in err
    code, _, err = env.cli("logs", "ghost", capsys=capsys)
    assert code == 3 and "error:" in err
    code, _, err = env.cli("restart", "--detach", "ghost", capsys=capsys)
    assert code == 3 and "no run named 'ghost'" in err
    assert (
        env.cli(
            "deploy",
            "--profile",
            "work",
            "--name",
            "brief",
            "--launcher",
            "nohup",
            "--wait",
            "done",
            "--",
            "--steps",
            "2",
            capsys=capsys,
        )[0]
        == 0
    )
    deadline = time.monotonic() + 10  # "done" is printed just before the job exits: let it finish
    while not (env.runs / "brief" / "exit_code").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    code, _, err = env.cli("stop", "brief", capsys=capsys)
    assert code == 9 and "error: local: run 'brief' is not running" in err and "hint:" in err
    assert (env.runs / "brief" / "exit_code").read_text().strip() == "0"
    assert not (env.runs / "brief" / "stop.json").exists()


def test_logs_of_a_run_that_never_started(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    (env.runs / "empty").mkdir(parents=True)  # a directory, but no process ever wrote a log
    code, _, err = env.cli("logs", "empty", capsys=capsys)
    assert code == 3 and "never started" in err


def test_resume_without_resume_args_or_checkpoint(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.deploy_one_step("nockpt", capsys) == 0
    code, _, err = env.cli("restart", "--detach", "nockpt", "--resume", capsys=capsys)
    assert code == 3 and "has no checkpoint" in err and "--fresh" in err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["stop", "--json-args", "garbage"], "not valid JSON"),
        (["stop", "--json-args", "[1]"], "must be a JSON object"),
        (["explode"], "unknown verb"),
        (["launch", "--json-args", '{"workspace": "relative", "name": "x", "argv": ["true"]}'], "absolute path"),
        (["launch", "--json-args", '{"workspace": "/tmp", "name": "../etc", "argv": ["true"]}'], "invalid run name"),
        (["clear-cache", "--json-args", '{"workspace": "relative/ws"}'], "absolute path"),
    ],
)
def test_agent_refuses_garbage(argv: list[str], fragment: str) -> None:
    out = subprocess.run([sys.executable, str(AGENT), *argv], capture_output=True, text=True, timeout=30)
    lines = out.stdout.splitlines()
    assert len(lines) == 1, out.stdout
    answer = json.loads(lines[0])
    assert answer["ok"] is False and fragment in answer["error"] and out.returncode == 2


def test_exec_needs_a_command(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli("exec", "local", capsys=capsys)
    assert code == 2 and "exec needs a command" in err
    code, out, _ = env.cli(
        "exec", "local", "--", sys.executable, "-c", "print('hi'); raise SystemExit(3)", capsys=capsys
    )
    assert code == 3 and out == "hi\n"
    assert os.environ.get("DFLASHOPS_RUN_ID") is None


def test_attach_refuses_a_nohup_run(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    assert env.deploy_one_step("bg", capsys) == 0
    code, _, err = env.cli("attach", "bg", capsys=capsys)
    assert code == 2 and "launched with nohup" in err and "hint: `dflashops logs bg -f`" in err
