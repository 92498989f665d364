"""`dflashops watch` for real: a live view in a real tmux pane over a running workload, `q` quits, the run is
untouched; a dropped link keeps the old data and says how stale it is; bad input is a clear error."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashops.core.inventory import load_inventory
from dflashops.core.shell import join_argv
from dflashops.ops.invocation import Invocation
from dflashops.ops.observe.watch import Watcher, run_row
from tests.controller.helpers import INVENTORY, REPO, WORKLOAD, Env, cleanup
from tests.tmux_screen import Screen

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (make test installs it)")


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    """C1's local-target inventory, but its python is a symlink so a test can cut the 'link' for real."""
    shutil.copy(WORKLOAD, tmp_path / "workload.py")
    (tmp_path / "py").symlink_to(sys.executable)
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY.format(python=tmp_path / "py"))
    setup = Env(root=tmp_path, inventory=inventory, workspace=tmp_path / "ws")
    yield setup
    cleanup(setup.workspace)


def launch(env: Env, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = env.cli(
        "deploy",
        "local",
        "--profile",
        "work",
        "--name",
        name,
        "--wait",
        r"step 2\b",
        "--timeout",
        "30",
        "--",
        "--interval",
        "0.1",
        capsys=capsys,
    )
    assert code == 0, err


def state_of(env: Env, name: str) -> str:
    return env.agent("status", {"workspace": str(env.workspace), "name": name})["runs"][0]["state"]


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_watch_in_a_tmux_pane(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    launch(env, "w1", capsys)
    socket = f"dflashops-watch-test-{os.getpid()}"
    conf = env.root / "tmux.conf"
    conf.write_text("set -g remain-on-exit on\n")
    command = join_argv(
        [
            "env",
            f"PYTHONPATH={REPO}",
            "NO_COLOR=1",
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "dflashops.cli.main",
            "--inventory",
            str(env.inventory),
            "watch",
            "w1",
            "--interval",
            "0.3",
        ]
    )
    exit_file = env.root / "watch.exit"
    command += f"; echo $? > {exit_file}"  # tmux 3.3 does not always record pane_dead_status
    screen = Screen(socket, command, width=120, height=30, config=conf)
    try:

        def step_shown() -> int | None:
            match = re.search(r"w1\s+local\s+running\s+(\d+)", screen.text())
            return int(match.group(1)) if match else None

        wait_until(lambda: step_shown() is not None, what="the w1 row in the pane")
        shown = screen.text()
        assert "dflashops watch w1 | updated" in shown and "q quits" in shown
        assert re.search(r"run\s+target\s+state\s+step\s+loss\s+tau_sim\s+blk tok/s\s+eta\s+beat\s+exit", shown)
        assert re.search(r"w1 log: step \d+ loss", shown)
        assert "gpus: none visible" in shown
        first = step_shown()
        wait_until(lambda: (step_shown() or 0) > (first or 0), what="the view to refresh")
        assert not re.search(r"\x1b\[(3[0-7]|38|9[0-7])[;m]", screen.text(escapes=True)), "colour used despite NO_COLOR"
        screen.keys("q")

        try:
            wait_until(
                lambda: exit_file.exists() and exit_file.read_text().strip() != "",
                timeout=10,
                what="watch to quit on q",
            )
        except AssertionError:
            os.kill(screen.pid(), 6)  # our own pane's process: faulthandler prints where it hangs
            time.sleep(1)
            raise AssertionError(f"watch did not quit on q; pane shows: {screen.text(history=60)}") from None
        assert exit_file.read_text().strip() == "0"
    finally:
        screen.close()
    assert state_of(env, "w1") == "running"  # watching never touches the run
    assert not (env.runs / "w1" / "stop.json").exists()


def test_dropped_link_keeps_data_and_reconnects(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    from dflashops.cli.watch import render

    launch(env, "w2", capsys)
    invocation = Invocation(load_inventory(env.inventory))
    try:
        watcher = Watcher(invocation, "w2")
        first = watcher.refresh()
        assert first.runs[0].state == "running" and watcher.stale_for is None
        (env.root / "py").unlink()  # the target's python is gone: every agent call now fails for real
        try:
            kept = watcher.refresh()
            assert kept is first and watcher.error and watcher.failures == 1
            time.sleep(0.3)
            assert watcher.stale_for is not None and watcher.stale_for >= 0.3
            console = Console(width=120, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
            console.print(render(watcher, "t"))
            text = console.export_text()
            assert "STALE" in text and "reconnecting: local: the target's python" in text and "w2" in text
        finally:
            (env.root / "py").symlink_to(sys.executable)
        fresh = watcher.refresh()
        assert watcher.error is None and watcher.stale_for is None
        assert fresh.taken_at > first.taken_at and (fresh.runs[0].step or 0) >= (first.runs[0].step or 0)
    finally:
        invocation.close()
    assert state_of(env, "w2") == "running"


def test_watch_once_json_and_bad_input(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    launch(env, "w3", capsys)
    code, out, _ = env.cli("watch", "w3", "--json", capsys=capsys)
    assert code == 0
    data = json.loads(out)
    assert [r["name"] for r in data["runs"]] == ["w3"] and data["runs"][0]["state"] == "running"
    assert data["stale_for_s"] is None and data["runs"][0]["loss"] is not None
    code, out, _ = env.cli("watch", "--all", "--once", capsys=capsys)
    assert code == 0 and "w3" in out and "running" in out
    code, out, err = env.cli("watch", "nope", capsys=capsys)
    assert code == 3 and out == ""
    assert "error: local: run 'nope' does not exist on this target" in err and "hint:" in err
    code, _, err = env.cli("watch", capsys=capsys)
    assert code == 2 and "error: watch needs a RUN or --all" in err
    code, _, err = env.cli("watch", "a;b", capsys=capsys)
    assert code == 2 and "invalid run name" in err
    code, _, err = env.cli("watch", "w3", "--interval", "0", capsys=capsys)
    assert code == 2 and "--interval must be > 0" in err


def test_trainer_metrics_become_columns() -> None:
    """The trainer's metrics line (per-drafter tok/s, queues, GPU memory, ETA) maps onto the view's row."""
    now = time.time()
    entry = {
        "name": "x",
        "state": "running",
        "step": 40,
        "target": "ct200",
        "last_log_line": "step 40/100 | ...",
        "trainer_status": {"phase": "training", "total_steps": 100, "heartbeat": now - 3, "step_limit": "epochs"},
        "last_metrics": {
            "step": 40,
            "loss": 2.5,
            "tau_sim": 3.1,
            "block_tok_s": 12345.6,
            "block_tok_s_per_drafter": [6000.1, 6345.5],
            "eta_s": 600.0,
            "time": now - 60,
            "queues": {"t0->d0": {"depth": 3, "max": 4}},
            "gpu_mem_gb": {"cuda:2": 30.5},
        },
    }
    row = run_row(entry, now)
    assert (row.step, row.total_steps, row.block_tok_s_per_drafter) == (40, 100, [6000.1, 6345.5])
    assert row.queues == {"t0->d0": "3/4"} and row.gpu_mem_gb == {"cuda:2": 30.5}
    assert 539 <= (row.eta_s or 0) <= 541 and 2.5 <= (row.heartbeat_age_s or 0) <= 4
    # Which limit the eta runs to (issue 46 item 4): the data's epochs, not a larger --max-steps.
    from rich.console import Console

    from dflashops.cli.run_table import runs_table

    console = Console(width=200, no_color=True)
    with console.capture() as shown:
        console.print(runs_table([row]))
    assert re.search(r"\s0:0[89]:\d\d \(epochs\)\s", shown.get()), shown.get()


def test_watch_run_ends_when_the_run_ends(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """`watch RUN` as a user types it: it exits 7 with how the run ended when it crashes, 0 when it finished."""
    crash = env.root / "crash-now"
    code, _, err = env.cli(
        "deploy", "--profile", "work", "--name", "we1", "--wait", r"step 1\b", "--", "--crash-file", str(crash),
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    watch = subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), "watch", "we1",
         "--interval", "0.2"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=env.root,
        env={**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1"},
    )  # fmt: skip
    try:
        crash.touch()  # the run crashes at its next step; watch must notice and end
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill() if watch.poll() is None else None
    assert watch.returncode == 7, (out, err)
    assert re.search(r"^error: we1 crashed at step \d+, exit code 1: RuntimeError: injected crash", err, re.M), err
    assert "hint: dflashops logs we1" in err
    assert re.search(r"^we1\s+local\s+crashed\s", out, re.M), out  # the last frame stays
    assert env.deploy_one_step("we2", capsys) == 0
    code, out, err = env.cli("watch", "we2", capsys=capsys)
    assert code == 0 and re.search(r"^we2\s+local\s+finished\s+1\s", out, re.M), (out, err)


def test_status_and_watch_print_one_table(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    """One layout for `status`, `status --all` and `watch --all`: a header, running runs first, an ended run
    with its end state and no eta or heartbeat age, its last log line not wandb's housekeeping."""
    assert env.deploy_one_step("ta1", capsys) == 0
    with open(env.runs / "ta1" / "train.log", "a") as log:  # what wandb prints as the job exits
        log.write("wandb: \nwandb: Find logs at: wandb/run-20250101_000000-abc/logs\n")
    launch(env, "ta2", capsys)
    header = r"^run\s+target\s+state\s+step\s+loss\s+tau_sim\s+blk tok/s\s+eta\s+beat\s+exit\s*$"
    for verb in (["status"], ["status", "--all"], ["watch", "--all", "--once"]):
        code, out, err = env.cli(*verb, capsys=capsys)
        assert code == 0, err
        assert re.search(header, out, re.M), (verb, out)
        rows = [line.split()[0] for line in out.splitlines() if re.match(r"ta\d\s+local\s", line)]
        assert rows == ["ta2", "ta1"], (verb, out)  # the running run first
        assert re.search(r"^ta1\s+local\s+finished\s+1\s+\S+\s+\S+\s+-\s+-\s+-\s+0\s*$", out, re.M), out
        assert re.search(r"^ta2\s+local\s+running\s+\d+\s.*\s\d+s\s+-\s*$", out, re.M), out  # a heartbeat age
        assert "ta1 log: done" in out.splitlines() and "wandb:" not in out
        assert "\x1b[" not in out
    code, out, _ = env.cli("status", "--json", capsys=capsys)
    assert code == 0 and set(json.loads(out)) == {"runs", "gpus"}


def test_an_error_line_is_not_prefixed_twice() -> None:
    from dflashops.cli.run_table import detail_lines

    entry = {"name": "x", "state": "crashed", "exit_code": 2, "error_line": "error: argument --lr: invalid float"}
    row = run_row(entry, time.time())
    assert detail_lines(row) == ["x error: argument --lr: invalid float"]
    assert row.eta_s is None and row.heartbeat_age_s is None
