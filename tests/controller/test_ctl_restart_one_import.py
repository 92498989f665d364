"""A restart of a trainer job on the local target pays one interpreter start on its way to the first step
(issue 46 item 2): the agent starts a standby for this restart alone, runs the pre-flight in a fork of it, and
the child is that standby's interpreter (agent/restart.py one_shot_standby). Real agent, real processes: the
`trainer` is a small package that prints its pid and refuses `check --no-such-flag` as the trainer would; the
standby imports `json` ahead instead of torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflashops.agent.common import read_proc
from dflashops.agent.protocol import wire
from dflashops.agent.standby import standbys
from dflashops.ops.releases.sync import install_payload, local_manifest, release_files
from tests.controller.helpers import AGENT, Env
from tests.controller.test_ctl_standby import wait_for

FAKE_TRAINER = """\
import json, os, sys, time
if sys.argv[1:2] == ["check"] and "--no-such-flag" in sys.argv:
    print("error: unknown flag --no-such-flag", file=sys.stderr)
    print("hint: python -m trainer train --help lists the flags", file=sys.stderr)
    sys.exit(2)
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:]}), flush=True)
if "--sleep" in sys.argv and sys.argv[1] == "train":
    time.sleep(float(sys.argv[sys.argv.index("--sleep") + 1]))
"""


def fake_release(root: Path) -> Path:
    package = root / "fake" / "trainer"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(FAKE_TRAINER)
    return root / "fake"


def running(env: Env, name: str) -> bool:
    return env.agent("status", {"workspace": str(env.workspace), "name": name})["runs"][0]["state"] == "running"


@pytest.fixture
def old_run(env: Env, capsys: pytest.CaptureFixture[str]) -> dict:
    """A deployed `work` run (for the workspace's current release), then the trainer run `o1` to restart, and the
    agent's restart request for it (a new release: workload.py changed)."""
    deployed = env.cli(
        "deploy", "--profile", "work", "--name", "w1", "--launcher", "nohup", "--wait", "step 1", capsys=capsys
    )
    assert deployed[0] == 0, deployed
    code, out, _ = env.cli("restart", "w1", "--dry-run", capsys=capsys)
    assert code == 0 and '"standby_once": true' in out  # the controller asks it on the local target
    assert env.cli("stop", "w1", "--grace", "5", capsys=capsys)[0] == 0
    rel = fake_release(env.root)
    job = {
        "workspace": str(env.workspace),
        "argv": [sys.executable, "-m", "trainer", "train", "--sleep", "600"],
        "env": {"PYTHONPATH": str(rel)},
        "launcher": "nohup",
        "standby": False,
        "standby_preload": ["json"],
    }
    assert env.agent("launch", {**job, "name": "o1"})["ok"]
    releases = env.workspace / "releases"
    workload = env.root / "workload.py"
    workload.write_text(workload.read_text() + "# a change\n")
    files = release_files(("workload.py",), env.root, packages=())
    code_hash, manifest = local_manifest(files)
    current = os.readlink(releases / "current")
    base_files = json.loads((releases / current / ".manifest.json").read_text())
    payload = install_payload(str(env.workspace), files, code_hash, manifest, current, base_files)
    install, upload = wire(payload.request), payload.tar
    tar = upload.read_bytes()
    request = {**job, "old": "o1", "name": "o2", "grace": 5, "install": install, "tar_bytes": len(tar)}
    return {**request, "preflight": True, "standby_once": True, "tar": tar.hex()}


def call_restart(request: dict) -> dict:
    tar = bytes.fromhex(request.pop("tar"))
    out = subprocess.run(
        [sys.executable, str(AGENT), "restart"], input=json.dumps(request).encode() + b"\n" + tar,
        capture_output=True, timeout=40,
    )  # fmt: skip
    return json.loads(out.stdout.decode().splitlines()[-1])


def log_of(env: Env, name: str) -> str:
    """The run's train.log so far ("" before its wrapper or adopted standby has made it)."""
    try:
        return (env.runs / name / "train.log").read_text()
    except FileNotFoundError:
        return ""


def idle_standbys(env: Env) -> list[str]:
    """Standby folders no launch has claimed (an interpreter waiting for nobody)."""
    return [folder for folder, _ in standbys(str(env.workspace)) if not os.path.exists(os.path.join(folder, "claimed"))]


def test_the_child_is_the_preflights_interpreter_and_none_is_left_waiting(env: Env, old_run: dict) -> None:
    answer = call_restart(old_run)
    assert answer["ok"] is True, answer
    assert answer["preflight"]["in"] == "a standby interpreter"
    assert answer["standby"] is True
    pid = env.job_pid("o2")
    assert pid == answer["preflight"]["standby_pid"]  # the interpreter that checked is the one that runs
    wait_for(lambda: '"pid"' in log_of(env, "o2"), "o2 to start")
    started = json.loads((env.runs / "o2" / "train.log").read_text().splitlines()[-1])
    assert started == {"pid": pid, "argv": ["train", "--sleep", "600"]}
    assert idle_standbys(env) == []  # nothing waits for a next launch
    assert answer["old_status"]["state"] == "stopped"


def test_bad_flags_are_refused_in_the_standby_the_parent_runs_on_and_the_standby_leaves(
    env: Env, old_run: dict
) -> None:
    argv = [*old_run["argv"], "--no-such-flag", "3"]
    answer = call_restart({**old_run, "argv": argv})
    assert answer["ok"] is False and answer["code"] == "preflight", answer
    assert "error: unknown flag --no-such-flag" in answer["error"]
    assert running(env, "o1") and not (env.runs / "o2").exists()
    pids = [int(Path(folder, "ready").read_text()) for folder, _ in standbys(str(env.workspace))]
    wait_for(lambda: standbys(str(env.workspace)) == [], "the one-shot standby to leave", timeout=30)
    assert all(read_proc(pid, "environ") == b"" for pid in pids)  # its interpreter has exited


def test_a_standby_that_cannot_start_falls_back_to_new_interpreters(env: Env, old_run: dict) -> None:
    (env.workspace / "standby").write_text("not a folder: no standby can start here\n")  # a real fault
    answer = call_restart(old_run)
    assert answer["ok"] is True, answer
    assert answer["preflight"]["in"] == "a new interpreter" and answer["standby"] is False
    wait_for(lambda: '"pid"' in log_of(env, "o2"), "o2 to start")
    assert answer["old_status"]["state"] == "stopped"
