"""`restart --resume` with the hand-over (trainer/handover.py, agent.py verb_stop): the real trainer on the local
target, its final checkpoint write slowed down (TRAINER_TEST_WRITE_DELAY_S stands in for the 15-20 s an 8B
drafter's 12.6 GB take), real processes throughout.

- the child is launched while the parent is still writing, waits for that checkpoint, and resumes from it;
  the parent's stop completes in the background (exit 143, stop.json, the checkpoint complete);
- `--wait-exit` keeps the old order (the parent has exited when restart returns);
- a parent whose final write fails: the child ends with one error line naming the last good checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

pytestmark = pytest.mark.slow

PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "100000"]
resume_args: [--resume, "{checkpoint}"]
env: {TRAINER_TEST_WRITE_DELAY_S: "%s", TRAINER_TEST_SYNC_DELAY_S: "%s"}
"""


def status(env: Env, run: str) -> dict:
    return json.loads((env.runs / run / "status.json").read_text())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def deploy_parent(env: Env, capsys: pytest.CaptureFixture[str], delay: float, sync_delay: float = 0.0) -> int:
    add_profile(env, "tinyslow", PROFILE % (delay, sync_delay))
    code, _, err = env.cli(
        "deploy",
        "--profile",
        "tinyslow",
        "--name",
        "ho1",
        "--launcher",
        "nohup",
        "--wait",
        r"^step 2/",
        "--timeout",
        "240",
        capsys=capsys,
    )
    assert code == 0, err
    return int(status(env, "ho1")["pid"])


def test_restart_resume_starts_the_child_while_the_parent_writes_its_final_checkpoint(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = deploy_parent(env, capsys, delay=8.0)
    code, out, err = env.cli("restart", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    assert out.strip() == "ho2"
    assert "ho1 stopping: its trainer freed its GPUs and is writing its final checkpoint" in err
    offer = status(env, "ho1")["handover"]
    checkpoint = Path(offer["checkpoint"])
    assert alive(trainer) and not checkpoint.exists(), "restart waited for the parent's write"
    assert f"resuming from {checkpoint}" in err
    # The child builds meanwhile, waits for the checkpoint, and resumes from exactly that one.
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: f"resumed from {checkpoint} at step {offer['step']}" in log.read_text(), timeout=240)
    assert f"waiting for ho1 to finish writing {checkpoint}" in log.read_text()
    # The parent's stop finished in the background, as a plain stop would have.
    wait_until(lambda: "finished_at" in json.loads((env.runs / "ho1" / "stop.json").read_text()), timeout=120)
    assert not alive(trainer)
    assert (env.runs / "ho1" / "exit_code").read_text().strip() == "143"
    assert (checkpoint / "state.json").is_file() and status(env, "ho1")["phase"] == "stopped"
    assert "Traceback" not in (env.runs / "ho1" / "train.log").read_text()
    timeline = status(env, "ho2")["timeline"]
    assert timeline["checkpoint_ready"] <= timeline["resumed"] <= timeline["first_step"]
    code, out, _ = env.cli("status", "ho1", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["runs"][0]["state"] == "stopped"


def test_the_child_reads_the_written_checkpoint_before_the_parents_fsyncs_end(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parent's files are all written, only their fsyncs are left (slowed to 8 s): the child reads them from
    the parent's temporary directory through the page cache instead of waiting for the disk, and resumes at
    the offered step; the parent then makes the checkpoint durable and renames it into place as before."""
    deploy_parent(env, capsys, delay=0.0, sync_delay=8.0)
    code, _, err = env.cli("restart", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    offer = status(env, "ho1")["handover"]
    checkpoint = Path(offer["checkpoint"])
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: f"resumed from {checkpoint} at step {offer['step']}" in log.read_text(), timeout=240)
    wait_until(lambda: "ended" in status(env, "ho1")["timeline"], timeout=120)
    assert status(env, "ho2")["timeline"]["resumed"] < status(env, "ho1")["timeline"]["ended"]
    assert (checkpoint / "state.json").is_file() and not list(checkpoint.parent.glob(".tmp-*"))
    assert status(env, "ho2")["last_checkpoint"] == str(checkpoint)


def test_wait_exit_launches_only_after_the_parent_has_exited(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    trainer = deploy_parent(env, capsys, delay=2.0)
    code, _, err = env.cli("restart", "ho1", "--resume", "--wait-exit", "--grace", "60", capsys=capsys)
    assert code == 0, err
    assert "ho1 stopped (exit code 143)" in err and not alive(trainer)
    step = status(env, "ho1")["step"]
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: "resumed from" in log.read_text(), timeout=240)
    assert "waiting for ho1" not in log.read_text() and f"at step {step}" in log.read_text()


def test_a_parent_whose_final_write_fails_ends_the_child_with_one_error_line(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy_parent(env, capsys, delay=6.0)
    code, _, err = env.cli("restart", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    # A real failure of the parent's write: its checkpoints folder becomes a file while the write is delayed.
    checkpoints = env.runs / "ho1" / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # made by the first write (this run saved none before)
    checkpoints.write_text("not a folder\n")
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: (env.runs / "ho2" / "exit_code").is_file(), timeout=240)
    text = log.read_text()
    assert re.search(
        r"error: --resume: ho1 ended \((exit code 1|status failed: CheckpointWriteError: writing "
        r"checkpoint step_\d+ failed: .*)\) without writing its final checkpoint step_\d+",
        text,
    ), text[-2000:]
    assert "hint: restart from its last complete checkpoint: none" in text and "Traceback" not in text
    assert (env.runs / "ho2" / "exit_code").read_text().strip() == "1"
    assert time.time() - status(env, "ho2")["heartbeat"] < 120
