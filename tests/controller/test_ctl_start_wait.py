"""Issue 29 item 5: `deploy` (and `restart`) wait until the run has passed its start, as a user types them.

The `starter` job stands in for the trainer: it keeps a status.json timeline and writes `preflight_done` only
when the test creates its go-file (or crashes on a "bad argument" when the go-file says `crash`), so every
ordering here is an event the test makes, never a sleep.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import INVENTORY, REPO, WORKLOAD, Env, cleanup

STARTER = """\
import json, os, sys, time
run_dir, go = sys.argv[1], sys.argv[2]
def status(**fields):
    with open(os.path.join(run_dir, "status.json.tmp"), "w") as handle:
        json.dump({"heartbeat": time.time(), **fields}, handle)
    os.replace(os.path.join(run_dir, "status.json.tmp"), os.path.join(run_dir, "status.json"))
status(phase="warmup", timeline={"python_started": time.time()})
print("starter: importing", flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
if open(go).read().strip() == "crash":
    print("starter: checking arguments", flush=True)
    print("error: argument --lr: invalid float value: 'abc'", flush=True)
    sys.exit(2)
status(phase="training", step=0, timeline={"python_started": 1.0, "preflight_done": time.time()})
print("starter: pre-flight done", flush=True)
while True:
    time.sleep(0.05)
"""

STARTER_PROFILE = """\
  starter:
    argv: ["{{python}}", "{{release}}/starter.py", "{{run_dir}}", "{go}"]
    files: [starter.py]
    packages: []
    started_when: preflight_done
"""


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    (tmp_path / "workload.py").write_bytes(WORKLOAD.read_bytes())
    (tmp_path / "starter.py").write_text(STARTER)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY.format(python=sys.executable) + STARTER_PROFILE.format(go=tmp_path / "go"))
    setup = Env(root=tmp_path, inventory=inventory, workspace=tmp_path / "ws")
    yield setup
    cleanup(setup.workspace)


def deploy_in_background(env: Env, name: str, *extra: str) -> subprocess.Popen[str]:
    """`dflashops deploy --profile starter --name NAME` as a user types it, in its own process."""
    return subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), "deploy", "--profile",
         "starter", "--name", name, "--launcher", "nohup", *extra],
        cwd=env.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"},
    )  # fmt: skip


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def test_deploy_waits_past_the_preflight(env: Env) -> None:
    proc = deploy_in_background(env, "sw1")
    try:
        wait_for_file(env.runs / "sw1" / "status.json")  # launched, still "importing": deploy must not be done
        assert proc.poll() is None
        (env.root / "go").write_text("go")
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 0, err
    assert out.strip() == "sw1"
    assert "launched sw1" in err
    assert "sw1 passed its start: status.json timeline `preflight_done`" in err


def test_deploy_reports_a_crash_in_its_start(env: Env) -> None:
    proc = deploy_in_background(env, "sw2")
    try:
        wait_for_file(env.runs / "sw2" / "status.json")
        assert proc.poll() is None
        (env.root / "go").write_text("crash")  # the job dies on a bad argument after its import
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill() if proc.poll() is None else None
    assert proc.returncode == 7, err  # RunFailed
    lines = err.splitlines()
    error = next(i for i, line in enumerate(lines) if line.startswith("error: "))
    assert lines[error].startswith("error: sw2 did not pass its start: crashed, exit code 2")
    assert "  | starter: checking arguments" in lines
    assert "  | error: argument --lr: invalid float value: 'abc'" in lines
    assert "hint: dflashops logs sw2" in lines
    assert "passed its start:" not in err


def test_detach_returns_at_once(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = env.cli("deploy", "--profile", "starter", "--name", "sw3", "--launcher", "nohup", "--detach",
                             capsys=capsys)  # fmt: skip
    assert code == 0 and out.strip() == "sw3", err
    assert "launched sw3" in err and "passed its start" not in err
    # It returned while the job is still before its pre-flight (nothing has created the go-file).
    status = env.agent("status", {"workspace": str(env.workspace), "name": "sw3"})["runs"][0]
    assert status["state"] == "running" and "preflight_done" not in status["trainer_status"]["timeline"]
    code, _, err = env.cli("deploy", "--profile", "starter", "--name", "sw4", "--detach", "--wait", "x",
                           capsys=capsys)  # fmt: skip
    assert code == 2 and "error: --detach returns at once; --wait REGEX follows the log" in err


def test_a_plain_job_and_restart_wait_for_their_first_step(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """The `work` profile is no trainer (started_when: settle): its first step, from its status.json, is its
    start; `restart` waits for its child's start the same way."""
    code, out, err = env.cli("deploy", "--profile", "work", "--name", "pw1", "--launcher", "nohup", capsys=capsys)
    assert code == 0, err
    assert "pw1 passed its start: its first step (status.json step" in err
    code, out, err = env.cli("restart", "pw1", "--name", "pw2", "--grace", "5", capsys=capsys)
    assert code == 0, err
    assert "pw2 passed its start: its first step (status.json step" in err
    code, _, err = env.cli("deploy", "--profile", "work", "--name", "pw3", "--", "--steps", "1", "--interval", "0",
                           capsys=capsys)  # fmt: skip
    assert code == 0, err  # it finished before (or as) it was seen: no failure
    assert "pw3 passed its start" in err or "pw3 finished" in err
