"""A disk that fills up while a checkpoint is written (issue 15, item 7), on a REAL full disk: a small tmpfs.

`python -m trainer train` runs as a real subprocess with its run directory on a tmpfs sized so that training
and its first records fit but a checkpoint does not. The run must end with exit 1, one `error: no space left
on <mount> while writing checkpoint step N; last good checkpoint: <path|none>` line plus a hint, no traceback,
status.json `failed` with that error, and no leftover `.tmp-*` checkpoint directory.

Both engines report through trainer.state.failure.record_failure and write through
trainer.state.checkpoint.write_checkpoint; each has its own call site, so each has a test here.
Needs root (mount); the tests are skipped with that reason otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.full_disk import REPO, SMALL, TRAINER_ENV, fill, needs_root

# One tiny-preset checkpoint is about 1.04 MB on disk (model 0.33 MB + AdamW moments 0.68 MB + RNG, JSON).
CHECKPOINT_KB = 1040

pytestmark = needs_root


def _train(run: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **TRAINER_ENV}
    return subprocess.run(
        [sys.executable, "-m", "trainer", "train", *SMALL, "--output-dir", str(run), *flags],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=180,
    )


def _check_clean_failure(done: subprocess.CompletedProcess, run: Path, mount: Path, step: int, last_good: str) -> None:
    log = done.stdout + done.stderr
    line = f"error: no space left on {mount} while writing checkpoint step {step}; last good checkpoint: {last_good}"
    assert done.returncode == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    errors = [text for text in done.stderr.splitlines() if text.startswith("error:")]
    assert errors == [line], log[-3000:]
    hint = done.stderr.splitlines()[done.stderr.splitlines().index(line) + 1]
    assert hint.startswith("hint: free space on") and "--keep-checkpoints" in hint, hint
    status = json.loads((run / "status.json").read_text())
    assert (status["phase"], status["exit_code"], status["error"]) == ("failed", 1, line.removeprefix("error: "))
    assert not list((run / "checkpoints").glob(".tmp-*"))  # the partial checkpoint is gone, its space freed


def test_item7_disk_full_during_a_checkpoint_fails_the_run_with_one_error_line(small_disk) -> None:
    # Room for the step-2 checkpoint and the run's records, not for a second checkpoint next to it.
    mount = small_disk(CHECKPOINT_KB * 3 // 2)
    run = mount / "run"
    done = _train(run, "--max-steps", "6", "--save-interval", "2")
    assert (run / "checkpoints" / "step_000002" / "state.json").is_file(), "the tmpfs is too small for one checkpoint"
    _check_clean_failure(done, run, mount, 4, str(run / "checkpoints" / "step_000002"))


def test_item7_pipeline_disk_full_at_the_first_checkpoint_names_no_good_checkpoint(small_disk) -> None:
    mount = small_disk(CHECKPOINT_KB // 2)  # training and its records fit, no checkpoint does
    run = mount / "run"
    done = _train(
        run,
        "--pipeline",
        "true",
        "--target-gpus",
        "cpu",
        "--drafter-gpus",
        "cpu",
        "--max-steps",
        "4",
        "--save-interval",
        "2",
    )
    assert "sync grad" in done.stderr, done.stderr[-3000:]  # the threaded pipeline ran (its start-up line)
    _check_clean_failure(done, run, mount, 2, "none")


def test_item7_a_status_write_that_hits_the_full_disk_first_reports_the_checkpoint_write(small_disk, capsys) -> None:
    """The race: the writer thread fills the disk, the training thread's own status write fails first. The run's
    exception is then a plain ENOSPC; the report must name the checkpoint write, collected from the writer."""
    import torch

    from trainer.state.checkpoint import CheckpointWriter
    from trainer.state.failure import record_failure
    from trainer.state.metrics import RunRecorder

    disk = small_disk(256)
    run = disk / "run"
    run.mkdir()
    recorder = RunRecorder(run, total_steps=10, heartbeat_s=60)
    filler = fill(disk)
    with pytest.raises(OSError) as tripped:  # the training thread's status write, for real
        recorder.set_status(phase="training", step=3)
    filler.unlink()
    with CheckpointWriter(run, keep=3) as writer:  # a checkpoint four times the disk: fails on the writer thread
        writer.submit(
            writer.snapshot(
                3, model={"w": torch.zeros(256 * 1024)}, optimizer={}, scheduler={}, epoch=0, index=3, extra={}
            )
        )
    record_failure(recorder, tripped.value, run_dir=run, writer=writer, keep_checkpoints=3, exit_code=1)
    recorder.close()
    err = capsys.readouterr().err
    line = f"no space left on {disk} while writing checkpoint step 3; last good checkpoint: none"
    assert err.startswith(f"error: {line}\nhint: free space on {disk}") and "Traceback" not in err, err
    status = json.loads((run / "status.json").read_text())
    assert (status["phase"], status["error"], status["exit_code"]) == ("failed", line, 1)
    assert not list((run / "checkpoints").glob(".tmp-*"))
