"""The agent's tail (offsets, partial lines, rotation), the shipped inventory, and tmux `=name` exactness."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from dflashops.agent.common import tmux_socket
from dflashops.core.inventory import load_inventory
from tests.controller.helpers import AGENT, REPO, Env
from tests.tmux_screen import session_names


def test_tail_never_loses_or_repeats_a_line(env: Env) -> None:
    run = env.runs / "t1"
    run.mkdir(parents=True)
    log = run / "train.log"
    log.write_bytes(b"line 1\nline 2\npart")
    request = {"workspace": str(env.workspace), "name": "t1", "offset": 0}
    first = env.agent("tail", request)
    assert first["data"] == "line 1\nline 2\n" and first["offset"] == 14  # the partial line waits
    with log.open("ab") as handle:
        handle.write(b"ial 3\nline 4\n")
    second = env.agent("tail", {**request, "offset": first["offset"], "inode": first["inode"]})
    assert second["data"] == "partial 3\nline 4\n"
    # rotation: train.log -> train.log.1 with unread lines, a new train.log begins
    with log.open("ab") as handle:
        handle.write(b"line 5\n")
    os.rename(log, run / "train.log.1")
    log.write_bytes(b"new 1\n")
    third = env.agent("tail", {**request, "offset": second["offset"], "inode": second["inode"]})
    assert third["data"] == "line 5\n" and third["offset"] == 0
    fourth = env.agent("tail", {**request, "offset": third["offset"], "inode": third["inode"]})
    assert fourth["data"] == "new 1\n"
    (run / "exit_code").write_text("0\n")
    with log.open("ab") as handle:
        handle.write(b"no newline at the end")
    last = env.agent("tail", {**request, "offset": fourth["offset"], "inode": fourth["inode"]})
    assert last["data"] == "no newline at the end" and last["finished"] is True


def test_shipped_inventory_loads_with_profiles() -> None:
    inventory = load_inventory(REPO / "inventory.yaml")
    assert {"tiny", "demo"} <= set(inventory.profiles)
    assert inventory.target("local").kind == "local" and os.path.isabs(inventory.target("local").workspace)
    assert inventory.targets["local"].env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert inventory.profile("tiny").argv[1:4] == ("-m", "trainer", "train")
    assert inventory.profile("tiny").packages == ("trainer",)
    assert inventory.lineage_path == REPO / "lineage.sqlite"
    seed = inventory.profile("qwen3-8b").argv
    for flag in ("--target-gpus", "--drafter-gpus", "--token-budget", "--use-soft-labels", "--cap-lambda"):
        assert flag in seed


def test_tmux_stop_is_exact_about_session_names(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`dflash` and `dflash2` both exist; stopping `dflash` must leave `dflash2` (tmux prefix matching)."""
    for name in ("dflash2", "dflash"):
        assert env.cli("deploy", "--profile", "work", "--name", name, "--wait", "step 1", capsys=capsys)[0] == 0
    assert env.cli("stop", "dflash", "--grace", "5", capsys=capsys)[0] == 0
    sessions = session_names(tmux_socket(str(env.workspace)))
    assert sessions == ["dflash2"]
    code, out, _ = env.cli("status", "dflash2", capsys=capsys)
    assert re.search(r"^dflash2\s+local\s+running\s", out, re.M), out


def test_help_lists_the_verbs() -> None:
    out = subprocess.run(
        [os.sys.executable, "-m", "dflashops.cli.main", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    ).stdout
    for verb in ("deploy", "restart", "stop", "status", "logs", "runs", "exec", "attach"):
        assert f"    {verb} " in out


def test_agent_is_reuploaded_when_its_file_vanishes(env: Env) -> None:
    from dflashops.core.inventory import load_inventory
    from dflashops.ops.invocation import Invocation

    invocation = Invocation(load_inventory(env.inventory))
    try:
        target = invocation.inventory.target("local")
        assert invocation.agent(target).call("status", {"workspace": str(env.workspace)})["runs"] == []
        for path in (env.workspace / ".dflashops").iterdir():
            path.unlink()  # someone cleaned the workspace while a `logs -f` was running
        assert invocation.agent(target).call("status", {"workspace": str(env.workspace)})["ok"] is True
    finally:
        invocation.close()


def follow_process(env: Env, name: str, **cursor: object) -> subprocess.Popen[bytes]:
    request = {"workspace": str(env.workspace), "name": name, **cursor}
    return subprocess.Popen(
        [sys.executable, str(AGENT), "follow", "--json-args", json.dumps(request)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_follow_streams_each_new_line_then_ends_with_the_run(env: Env) -> None:
    """`follow` (what `logs -f` reads): one answer line per move of the log, heartbeats in between, and it
    ends by itself once the run has ended and everything was delivered, the last partial line included."""
    run = env.runs / "f1"
    run.mkdir(parents=True)
    log = run / "train.log"
    log.write_bytes(b"line 1\n")
    proc = follow_process(env, "f1")
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    assert first["ok"] and first["data"] == "line 1\n" and first["offset"] == 7
    with log.open("ab") as handle:
        handle.write(b"line 2\npartial")
    answers = []
    while "line 2\n" not in "".join(a["data"] for a in answers):
        answers.append(json.loads(proc.stdout.readline()))
    heartbeat = json.loads(proc.stdout.readline())  # nothing new for a second: an empty answer
    assert heartbeat["data"] == "" and heartbeat["offset"] == 14 and not heartbeat["finished"]
    (run / "exit_code").write_text("0\n")
    rest = [json.loads(line) for line in proc.stdout.read().splitlines()]
    assert proc.wait(timeout=10) == 0
    assert "".join(a["data"] for a in rest) == "partial" and rest[-1]["finished"] and rest[-1]["data"] == ""


def test_follow_ends_when_its_reader_goes_away(env: Env) -> None:
    """A reader that disconnects (ssh cut, Ctrl-C) must not leave a follower behind in the container."""
    run = env.runs / "f2"
    run.mkdir(parents=True)
    (run / "train.log").write_bytes(b"line 1\n")
    proc = follow_process(env, "f2")
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["data"] == "line 1\n"
    proc.stdout.close()  # the pipe's read end is gone: the next heartbeat cannot be written
    assert proc.wait(timeout=5) == 0
    assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
    (run / "exit_code").write_text("0\n")  # an ended run: the teardown's stop need not wait for a launch
