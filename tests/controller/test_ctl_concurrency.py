"""Commands that meet on one run (issue 27, items 1-3): two stops, two restarts, a stop and a restart, and a
`stop --now`; the hand-over child that finds its checkpoint never committed; a resume from a run that never
took a step. The real tiny trainer on the local target, real processes, real files.

Every ordering a test needs is waited for, never assumed: the trainer's final checkpoint write is held at a
gate file (TRAINER_TEST_WRITE_GATE / TRAINER_TEST_SYNC_GATE) that the test opens only once the second command
is seen waiting for the run's control lock in /proc/locks (the kernel's own list of blocked flock waiters)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import REPO, Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

pytestmark = pytest.mark.slow

SLOW = 240.0  # the tiny trainer's start takes seconds on an idle machine, much longer on a loaded one
PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "100000"]
resume_args: [--resume, "{checkpoint}"]
env: {TRAINER_TEST_WRITE_GATE: "@WRITE@", TRAINER_TEST_SYNC_GATE: "@SYNC@", TRAINER_TEST_MIN_STEP_S: "0.1"}
"""


# The restarts of the real trainer skip their pre-flight (a `trainer check` interpreter before the restart takes
# the run's lock, ~1.2 CPU-s and seconds of wall each): what these tests race is the lock and the stop behind it,
# which the pre-flight precedes. A restart's pre-flight during a hand-over is test_ctl_handover.py's (four
# restarts of the same gated trainer), its refusals test_ctl_preflight.py's (issue 29 item 11).
NO_CHECK = "--skip-preflight"


def gates(env: Env) -> tuple[Path, Path]:
    return env.root / "write-gate", env.root / "sync-gate"


@pytest.fixture(autouse=True)
def gates_open_at_the_end(env: Env) -> Iterator[None]:
    """Open both gates before `env` stops the test's runs: no final write may wait at one then."""
    yield
    for gate in gates(env):
        gate.touch()


def deploy_trainer(env: Env, capsys: pytest.CaptureFixture[str], name: str, *, sync_gate: bool = False) -> int:
    """The tiny trainer at its second step, its final checkpoint write held at the write gate (and, with
    `sync_gate`, between its files written and their fsyncs instead); the trainer's pid."""
    write_gate, sync_gate_file = gates(env)
    if sync_gate:
        write_gate.touch()
    else:
        sync_gate_file.touch()
    add_profile(
        env,
        "tinygated",
        PROFILE.replace("@WRITE@", str(write_gate)).replace("@SYNC@", str(sync_gate_file)),
    )
    # The deploy skips its pre-flight (a `trainer check` interpreter, ~1.8 CPU-s): these tests are about what
    # meets a restart or a stop, whose pre-flight still runs; the deploy's is test_ctl_preflight.py's (issue 29
    # item 11).
    code, _, err = env.cli(
        "deploy", "--skip-preflight", "--profile", "tinygated", "--name", name, "--launcher", "nohup", "--wait",
        r"^step 2/", "--timeout", str(SLOW), capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    return int(status_json(env, name)["pid"])


def status_json(env: Env, run: str) -> dict:
    """The run's status.json, or {} before the trainer has written one (it is replaced atomically)."""
    try:
        return json.loads((env.runs / run / "status.json").read_text())
    except FileNotFoundError:
        return {}


def cli_process(env: Env, *args: str) -> subprocess.Popen[str]:
    """dflashops as a real process of its own, as a second shell would run it."""
    return subprocess.Popen(
        [sys.executable, "-m", "dflashops.cli.main", "--inventory", str(env.inventory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=env.root,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=SLOW)
    return proc.returncode, out, err


def written_state(checkpoints: Path) -> bool:
    """A temporary checkpoint's state.json is there and whole (it parses)."""
    for state in checkpoints.glob(".tmp-step_*/state.json"):
        try:
            json.loads(state.read_text())
            return True
        except (OSError, ValueError):
            pass
    return False


def lock_waiters(directory: Path) -> int:
    """How many processes are blocked waiting for a flock on `directory` (the run's control lock)."""
    st = os.stat(directory)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for line in lines if "->" in line and "FLOCK" in line and line.split()[-3] == device)


def log_text(env: Env, run: str) -> str:
    return (env.runs / run / "train.log").read_text()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


# ------------------------------------------------------------------------------------------------ item 1
def test_two_stops_that_meet_act_once_and_keep_the_final_checkpoint(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = deploy_trainer(env, capsys, "cc1")
    first = cli_process(env, "stop", "cc1", "--grace", "60")
    wait_until(lambda: "received SIGTERM" in log_text(env, "cc1"), timeout=SLOW)  # its final write waits
    second = cli_process(env, "stop", "cc1", "--grace", "60")
    wait_until(lambda: lock_waiters(env.runs / "cc1") == 1, timeout=SLOW)
    assert alive(trainer)
    gates(env)[0].touch()  # the write may go on now
    code1, out1, err1 = finish(first)
    code2, out2, err2 = finish(second)
    assert (code1, code2) == (0, 0), err1 + err2
    assert out1.strip() == out2.strip() == "cc1 stopped exit_code=143"
    assert "was already in progress; waited for it instead of signalling again" in err2
    assert "received SIGTERM again" not in log_text(env, "cc1")
    step = status_json(env, "cc1")["step"]
    assert (env.runs / "cc1" / "checkpoints" / f"step_{step:06d}" / "state.json").is_file()
    assert status_json(env, "cc1")["phase"] == "stopped"
    assert f"last checkpoint: step_{step:06d}" in err2


def test_two_restarts_that_meet_make_one_child(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    deploy_trainer(env, capsys, "cr1")
    first = cli_process(env, "restart", NO_CHECK, "--detach", "cr1", "--resume", "--name", "cr2")
    # The first restart's child starts at the hand-over; the rest of its stop (the write, held at the gate)
    # goes on in the background, holding the old run's lock.
    wait_until(lambda: (env.runs / "cr2").is_dir(), timeout=SLOW)
    second = cli_process(env, "restart", NO_CHECK, "--detach", "cr1", "--resume", "--name", "cr3")
    wait_until(lambda: lock_waiters(env.runs / "cr1") == 1, timeout=SLOW)
    gates(env)[0].touch()
    code1, out1, err1 = finish(first)
    code2, out2, err2 = finish(second)
    assert code1 == 0 and out1.strip() == "cr2", err1
    assert code2 == 4, err2
    assert "error: local: run 'cr1' was restarted meanwhile by another command, as 'cr2'; nothing was done" in err2
    assert "hint: `dflashops runs tree` shows the new run" in err2
    assert not (env.runs / "cr3").exists()
    code, out, _ = env.cli("runs", "list", "--json", capsys=capsys)
    assert "cr3" not in {row["name"] for row in json.loads(out)}, "the second restart's name was not given back"
    wait_until(lambda: "resumed from" in log_text(env, "cr2"), timeout=SLOW)
    assert "received SIGTERM again" not in log_text(env, "cr1")


def test_a_stop_that_meets_a_restart_says_what_the_restart_did(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    deploy_trainer(env, capsys, "cs1")
    restart = cli_process(env, "restart", NO_CHECK, "--detach", "cs1", "--resume", "--name", "cs2")
    wait_until(lambda: (env.runs / "cs2").is_dir(), timeout=SLOW)
    stop = cli_process(env, "stop", "cs1")
    wait_until(lambda: lock_waiters(env.runs / "cs1") == 1, timeout=SLOW)
    gates(env)[0].touch()
    assert finish(restart)[0] == 0
    code, out, err = finish(stop)
    assert code == 0, err
    assert "cs1: a restart of it by another command" in err
    assert "cs1 was restarted as cs2, which runs on: `dflashops stop cs2`" in err
    assert out.strip() == "cs1 stopped exit_code=143"


def test_stop_now_is_the_deliberate_second_signal(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = deploy_trainer(env, capsys, "cn1")
    first = cli_process(env, "stop", "cn1", "--grace", "60")
    wait_until(lambda: "received SIGTERM" in log_text(env, "cn1"), timeout=SLOW)
    code, out, err = env.cli("stop", "cn1", "--now", capsys=capsys)  # does not wait for the first stop
    assert code == 0, err
    assert "SIGKILL at once (--now: no final checkpoint)" in err
    assert not alive(trainer)
    code1, out1, err1 = finish(first)  # the first stop sees the run gone and records its end
    assert code1 == 0, err1
    assert not list((env.runs / "cn1" / "checkpoints").glob("step_*"))
    code, out, _ = env.cli("status", "cn1", "--json", capsys=capsys)
    entry = json.loads(out)["runs"][0]
    assert entry["state"] == "stopped" and entry["exit_code"] == 137


# ------------------------------------------------------------------------------------------------ item 2
def test_the_child_commits_a_checkpoint_its_killed_writer_left_complete(
    env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The parent is killed (SIGKILL) after writing every file of its final checkpoint into
    `.tmp-step_N-<pid>/`, before the fsyncs and the rename: the child, which read the data meanwhile, commits
    it (fsync, rename) before it resumes, and says so; the checkpoint exists under its final name."""
    trainer = deploy_trainer(env, capsys, "hk1", sync_gate=True)
    code, _, err = env.cli("restart", NO_CHECK, "--detach", "hk1", "--resume", "--name", "hk2", capsys=capsys)
    assert code == 0, err
    checkpoint = Path(status_json(env, "hk1")["handover"]["checkpoint"])
    # The child has read the written data (page cache) and waits for it to be durable.
    wait_until(lambda: "checkpoint_read" in status_json(env, "hk2").get("timeline", {}), timeout=SLOW)
    assert "resumed" not in status_json(env, "hk2")["timeline"] and not checkpoint.exists()
    os.kill(trainer, signal.SIGKILL)
    wait_until(lambda: "resumed" in status_json(env, "hk2").get("timeline", {}), timeout=SLOW)
    text = log_text(env, "hk2")
    # The child names the end as it saw it: the wrapper's exit code, or (when it looked before the wrapper wrote
    # one, which load makes likely) the process gone. Both are the truth; the order is not the test's to fix.
    ended = r"hk1 ended \((exit code 137|its process \d+ is gone)\)"
    assert re.search(
        rf"committed {re.escape(str(checkpoint))}: {ended} after writing it, before making it durable", text
    )
    assert f"resumed from {checkpoint} at step" in text
    assert (checkpoint / "state.json").is_file() and not list(checkpoint.parent.glob(".tmp-*"))
    wait_until(lambda: "first_step" in status_json(env, "hk2").get("timeline", {}), timeout=SLOW)
    code, out, _ = env.cli("runs", "show", "hk2", "--json", capsys=capsys)
    assert json.loads(out)["extra"]["resumed_from"] == str(checkpoint)
    step = int(checkpoint.name[5:])
    code, _, err = env.cli("fetch", "hk1", "--checkpoint", str(step), "--to", str(tmp_path / "got"), capsys=capsys)
    assert code == 0, err
    assert (tmp_path / "got" / "checkpoints" / checkpoint.name / "state.json").is_file()


def test_the_child_fails_naming_the_last_good_checkpoint_when_the_writer_died_mid_write(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = deploy_trainer(env, capsys, "hw1")  # held before its final write starts
    code, _, err = env.cli("restart", NO_CHECK, "--detach", "hw1", "--resume", "--name", "hw2", capsys=capsys)
    assert code == 0, err
    wait_until(lambda: status_json(env, "hw2").get("waiting_for"), timeout=SLOW)
    os.kill(trainer, signal.SIGKILL)
    wait_until(lambda: (env.runs / "hw2" / "exit_code").is_file(), timeout=SLOW)
    text = log_text(env, "hw2")
    ended = r"hw1 ended \((exit code 137|its process \d+ is gone)\)"  # as the child saw it first (see above)
    assert re.search(rf"error: --resume: {ended} without writing its final checkpoint step_", text), text
    assert "hint: restart from its last complete checkpoint: none" in text and "Traceback" not in text


def test_restart_commits_the_checkpoint_a_dead_writer_left_complete(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """No hand-over (--wait-exit): the old run's writer is killed between its files and the rename; the
    restart commits that checkpoint and resumes from it instead of an older one."""
    trainer = deploy_trainer(env, capsys, "rk1", sync_gate=True)
    stop = cli_process(env, "stop", "rk1", "--grace", "60")
    # Killed once state.json (written last, with write_text: created, then filled) is whole: the writer is then at
    # its sync gate, every file written. Killed the moment the file appeared (load made it likely), it left an
    # empty state.json: a checkpoint nobody may commit, and the restart rightly found none.
    wait_until(lambda: written_state(env.runs / "rk1" / "checkpoints"), timeout=SLOW)
    os.kill(trainer, signal.SIGKILL)
    assert finish(stop)[0] == 0
    tmp = next((env.runs / "rk1" / "checkpoints").glob(".tmp-step_*"))
    final = tmp.parent / tmp.name.split("-")[1]
    code, _, err = env.cli("restart", NO_CHECK, "rk1", "--resume", "--wait-exit", "--name", "rk2", capsys=capsys)
    assert code == 0, err
    assert f"resuming from {final}" in err
    assert (final / "state.json").is_file() and not tmp.exists()


# ------------------------------------------------------------------------------------------------ item 3
def test_resume_of_a_run_that_never_took_a_step_is_refused_before_it_is_stopped(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = env.cli(
        "deploy", "--detach", "--profile", "work", "--name", "ns1", "--launcher", "nohup", "--", "--hang-after", "0",
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    wait_until(lambda: (env.runs / "ns1" / "pid").is_file())
    code, out, err = env.cli("restart", "--detach", "ns1", "--resume", capsys=capsys)
    assert code == 3, err
    assert (
        "run 'ns1' has no checkpoint to resume from: it has not finished a step and started fresh; nothing was " in err
    )
    assert "hint: use --fresh to start from scratch" in err
    code, out, _ = env.cli("status", "ns1", "--json", capsys=capsys)
    assert json.loads(out)["runs"][0]["state"] == "running"
    assert not (env.runs / "ns1" / "stop.json").exists()


def test_resume_of_a_run_stopped_before_its_first_step_takes_the_checkpoint_it_started_from(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    assert env.cli("deploy", "--profile", "work", "--name", "nr1", "--wait", "step 3", capsys=capsys)[0] == 0
    code, _, err = env.cli(
        "restart", "--detach", "nr1", "--resume", "--name", "nr2", "--", "--hang-after", "3", capsys=capsys
    )
    assert code == 0, err
    started_from = err.split("resuming from ")[1].split()[0]
    wait_until(lambda: "resumed from" in log_text(env, "nr2"))
    # nr2 never takes a step; a stop that ends it without a checkpoint of its own (SIGKILL after the grace):
    code, _, err = env.cli("stop", "nr2", "--now", capsys=capsys)
    assert code == 0, err
    code, out, err = env.cli(
        "restart", "--detach", "nr2", "--resume", "--name", "nr3", "--", "--steps", "5", capsys=capsys
    )
    assert code == 0, err
    assert f"resuming from {started_from}" in err
    step = int(Path(started_from).name[5:])
    wait_until(lambda: f"resumed from {started_from} at step {step}" in log_text(env, "nr3"))
