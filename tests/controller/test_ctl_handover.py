"""`restart --resume` with the hand-over (trainer/state/handover.py, agent/stop.py): the real trainer on the local
target, its final checkpoint write held at a gate file (TRAINER_TEST_WRITE_GATE / TRAINER_TEST_SYNC_GATE stand in
for the 15-20 s an 8B drafter's 12.6 GB take; the test opens the gate once it has seen what must come first, so
no assertion depends on one side being slower), real processes throughout.

- the child is launched while the parent is still writing, waits for that checkpoint, and resumes from it;
  the parent's stop completes in the background (exit 143, stop.json, the checkpoint complete);
- the child reads the written data while the parent's fsyncs are held, and resumes once it is durable;
- `--wait-exit` keeps the old order (the parent has exited when restart returns);
- a parent whose final write fails: the child ends with one error line naming the last good checkpoint."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.controller.helpers import Env
from tests.controller.test_ctl_reliability import add_profile, wait_until

pytestmark = pytest.mark.slow

PROFILE = """
argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "100000",
       --wandb, "off", --log-interval, "1", --save-interval, "100000"]
resume_args: [--resume, "{checkpoint}"]
env: {TRAINER_TEST_WRITE_GATE: "%s", TRAINER_TEST_SYNC_GATE: "%s", TRAINER_TEST_MIN_STEP_S: "0.1"}
"""


def status(env: Env, run: str) -> dict:
    """The run's status.json, or {} before the trainer has written one (it is replaced atomically)."""
    try:
        return json.loads((env.runs / run / "status.json").read_text())
    except FileNotFoundError:
        return {}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(autouse=True)
def gates_open_at_the_end(env: Env) -> Iterator[None]:
    """Open both gates before `env` stops the test's runs: no final write may wait at one then."""
    yield
    for gate in ("write-gate", "sync-gate"):
        (env.root / gate).touch()


def both_logs(env: Env) -> str:
    """The last lines of both runs' logs and statuses: what a failed wait shows."""
    parts = []
    for run in ("ho1", "ho2"):
        log = env.runs / run / "train.log"
        tail = log.read_text().splitlines()[-15:] if log.is_file() else ["(no log)"]
        parts.append(f"--- {run} status {status(env, run)}\n" + "\n".join(tail))
    return "\n".join(parts)


def deploy_parent(env: Env, capsys: pytest.CaptureFixture[str], *, hold: str) -> tuple[int, Path]:
    """ho1 at its second step; its final checkpoint write held at the `hold` gate ("write": before it starts,
    "sync": between its files written and their fsyncs, "none"); (its trainer's pid, the gate to open)."""
    gates = {"write": env.root / "write-gate", "sync": env.root / "sync-gate"}
    for name, gate in gates.items():
        if name != hold:
            gate.touch()
    add_profile(env, "tinyslow", PROFILE % (gates["write"], gates["sync"]))
    # The parent's deploy skips its pre-flight (a `trainer check` interpreter, ~1.8 CPU-s): these tests are about
    # the restart, whose pre-flight still runs; the deploy's is test_ctl_preflight.py's (issue 29 item 11).
    code, _, err = env.cli(
        "deploy",
        "--skip-preflight",
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
    return int(status(env, "ho1")["pid"]), gates.get(hold, env.root / "no-gate")


def test_restart_resume_starts_the_child_while_the_parent_writes_its_final_checkpoint(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, gate = deploy_parent(env, capsys, hold="write")
    code, out, err = env.cli("restart", "--detach", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    assert out.strip() == "ho2"
    # The local target has no GPUs: nothing is said about freeing any (issue 29 item 9).
    assert "ho1 stopped training and is writing its final checkpoint " in err
    assert "GPU" not in err, err
    offer = status(env, "ho1")["handover"]
    checkpoint = Path(offer["checkpoint"])
    assert alive(trainer) and not checkpoint.exists(), "restart waited for the parent's write"
    assert f"resuming from {checkpoint}" in err
    # The child builds meanwhile, waits for the checkpoint, and resumes from exactly that one.
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: bool(status(env, "ho2").get("waiting_for")), timeout=240, explain=lambda: both_logs(env))
    gate.touch()
    wait_until(
        lambda: f"resumed from {checkpoint} at step {offer['step']}" in log.read_text(),
        timeout=240,
        explain=lambda: both_logs(env),
    )
    assert f"waiting for ho1 to finish writing {checkpoint}" in log.read_text()
    # The parent's stop finished in the background, as a plain stop would have.
    wait_until(lambda: "finished_at" in json.loads((env.runs / "ho1" / "stop.json").read_text()), timeout=120)
    assert not alive(trainer)
    assert (env.runs / "ho1" / "exit_code").read_text().strip() == "143"
    assert (checkpoint / "state.json").is_file() and status(env, "ho1")["phase"] == "stopped"
    assert "Traceback" not in (env.runs / "ho1" / "train.log").read_text()
    # "resumed from" is logged before the child's first step: wait for that step, not for the log line.
    wait_until(
        lambda: "first_step" in status(env, "ho2").get("timeline", {}), timeout=240, explain=lambda: both_logs(env)
    )
    timeline = status(env, "ho2")["timeline"]
    assert timeline["checkpoint_ready"] <= timeline["resumed"] <= timeline["first_step"]
    code, out, _ = env.cli("status", "ho1", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["runs"][0]["state"] == "stopped"


def test_the_child_reads_the_written_checkpoint_during_the_parents_fsyncs_and_resumes_once_durable(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """The parent's files are all written, only their fsyncs are left (held at the gate): the child reads them
    from the parent's temporary directory through the page cache instead of waiting for the disk, but resumes
    only once the parent has made the checkpoint durable and renamed it into place."""
    trainer, gate = deploy_parent(env, capsys, hold="sync")
    code, _, err = env.cli("restart", "--detach", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    offer = status(env, "ho1")["handover"]
    checkpoint = Path(offer["checkpoint"])
    wait_until(lambda: "checkpoint_read" in status(env, "ho2").get("timeline", {}), timeout=240)
    assert alive(trainer) and not checkpoint.exists(), "the child read it before the parent's fsyncs ended"
    assert "resumed" not in status(env, "ho2").get("timeline", {}), "it resumed from a checkpoint that is not durable"
    gate.touch()
    log = env.runs / "ho2" / "train.log"
    wait_until(lambda: f"resumed from {checkpoint} at step {offer['step']}" in log.read_text(), timeout=240)
    wait_until(lambda: "ended" in status(env, "ho1")["timeline"], timeout=120)
    assert (checkpoint / "state.json").is_file() and not list(checkpoint.parent.glob(".tmp-*"))
    assert "committed" not in log.read_text()  # the parent made it durable itself
    assert status(env, "ho2")["last_checkpoint"] == str(checkpoint)


def test_wait_exit_launches_only_after_the_parent_has_exited(env: Env, capsys: pytest.CaptureFixture[str]) -> None:
    trainer, _ = deploy_parent(env, capsys, hold="none")
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
    _, gate = deploy_parent(env, capsys, hold="write")
    code, _, err = env.cli("restart", "--detach", "ho1", "--resume", "--grace", "60", capsys=capsys)
    assert code == 0, err
    # A real failure of the parent's write: its checkpoints folder becomes a file while the write is held.
    checkpoints = env.runs / "ho1" / "checkpoints"
    shutil.rmtree(checkpoints, ignore_errors=True)  # made by the first write (this run saved none before)
    checkpoints.write_text("not a folder\n")
    gate.touch()
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
