"""The restart hand-over's trainer side (trainer/state/handover.py): which --resume may be waited for, the wait itself
(a real thread renaming a checkpoint into place, a real writer that ends without it), and a real trainer
process that offers the hand-over on a stop and frees its devices. The whole cycle through the CLI is
tests/controller/test_ctl_handover.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer.core.config import TrainerInputError
from trainer.state.checkpoint import check_shapes
from trainer.state.handover import RESUME_WRITER_ENV, check_handed_over, pending_writer, wait_for_checkpoint

REPO = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path) -> None:
    tmp = path.parent / f".tmp-{path.name}"
    tmp.mkdir(parents=True)
    (tmp / "state.json").write_text("{}")
    os.replace(tmp, path)


def test_no_writer_named_means_no_wait(tmp_path: Path) -> None:
    assert pending_writer(str(tmp_path / "run" / "checkpoints" / "step_000005"), environ={}) is None
    assert pending_writer("auto", environ={RESUME_WRITER_ENV: str(tmp_path)}) is None


def test_a_missing_checkpoint_of_the_named_writer_is_pending(tmp_path: Path) -> None:
    writer = tmp_path / "old"
    target = writer / "checkpoints" / "step_000005"
    assert pending_writer(str(target), environ={RESUME_WRITER_ENV: str(writer)}) == writer
    make_checkpoint(target)
    assert pending_writer(str(target), environ={RESUME_WRITER_ENV: str(writer)}) is None  # complete: read now


def test_a_checkpoint_outside_the_writers_run_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TrainerInputError, match="is not a checkpoint of"):
        pending_writer(str(tmp_path / "elsewhere" / "step_000005"), environ={RESUME_WRITER_ENV: str(tmp_path / "old")})


def test_the_wait_ends_when_the_checkpoint_is_renamed_into_place(tmp_path: Path) -> None:
    target = tmp_path / "old" / "checkpoints" / "step_000007"
    (tmp_path / "old" / "checkpoints").mkdir(parents=True)
    timer = threading.Timer(0.4, make_checkpoint, args=(target,))
    started = time.monotonic()
    timer.start()
    wait_for_checkpoint(target, tmp_path / "old", timeout_s=30)
    assert (target / "state.json").is_file() and 0.3 < time.monotonic() - started < 10


def test_a_written_checkpoint_is_readable_from_the_writers_temporary_directory(tmp_path: Path) -> None:
    """All files written (state.json last), fsyncs pending: `wait_for_checkpoint` returns the writer's own
    `.tmp-<name>-<pid>`; not with `durable=True`, not another process's, not one without state.json."""
    writer = tmp_path / "old"
    target = writer / "checkpoints" / "step_000007"
    (writer / "checkpoints").mkdir(parents=True)
    alive = os.getpid()  # the writer must be alive: one whose process is gone has ended
    (writer / "status.json").write_text(json.dumps({"pid": alive}))
    other = writer / "checkpoints" / ".tmp-step_000007-99"
    other.mkdir()
    (other / "state.json").write_text("{}")  # a crashed earlier writer's leftover: not this writer's
    mine = writer / "checkpoints" / f".tmp-step_000007-{alive}"
    mine.mkdir()
    timer = threading.Timer(0.3, (mine / "state.json").write_text, args=("{}",))
    timer.start()
    assert wait_for_checkpoint(target, writer, timeout_s=30) == mine
    timer = threading.Timer(0.3, make_checkpoint, args=(target,))
    timer.start()
    assert wait_for_checkpoint(target, writer, timeout_s=30, durable=True) == target


def test_the_deferred_checks_follow_a_rename_between_the_wait_and_the_check(tmp_path: Path) -> None:
    """The window a fresh-clone `make test` hit (the hand-over test's child failed with "--resume:
    .tmp-step_000057-PID is not a complete checkpoint"): the wait returns the writer's temporary directory, the
    writer renames it into place, and only then do the pre-flight's deferred checks read it. They must read the
    checkpoint under its final name, and say so; a real mismatch is still refused, from either place."""
    writer = tmp_path / "old"
    target = writer / "checkpoints" / "step_000007"
    (writer / "checkpoints").mkdir(parents=True)
    (writer / "status.json").write_text(json.dumps({"pid": os.getpid()}))  # the writer, alive
    written = writer / "checkpoints" / f".tmp-step_000007-{os.getpid()}"
    written.mkdir()
    (written / "state.json").write_text(json.dumps({"shapes": {"w": [2, 3]}}))
    source = wait_for_checkpoint(target, writer, timeout_s=30)
    assert source == written
    os.replace(written, target)  # the writer's fsyncs end: the rename, right after the wait returned

    with pytest.raises(TrainerInputError, match="is not a complete checkpoint"):
        check_shapes(source, {"w": [2, 3]})  # the check on what the wait returned, as the loop did before
    assert check_handed_over(lambda where: check_shapes(where, {"w": [2, 3]}), source, target, writer) == target
    with pytest.raises(TrainerInputError, match="different drafter shape"):
        check_handed_over(lambda where: check_shapes(where, {"v": [2, 3]}), source, target, writer)
    os.replace(target, written)  # not yet renamed: the check reads the temporary directory and refuses there
    with pytest.raises(TrainerInputError, match="different drafter shape"):
        check_handed_over(lambda where: check_shapes(where, {"v": [2, 3]}), written, target, writer)
    assert check_handed_over(lambda where: check_shapes(where, {"w": [2, 3]}), written, target, writer) == written


def test_a_writer_that_ends_without_the_checkpoint_names_its_last_good_one(tmp_path: Path) -> None:
    writer = tmp_path / "old"
    make_checkpoint(writer / "checkpoints" / "step_000003")
    (writer / "exit_code").write_text("1\n")
    with pytest.raises(TrainerInputError) as caught:
        wait_for_checkpoint(writer / "checkpoints" / "step_000007", writer, timeout_s=30)
    assert "old ended (exit code 1) without writing its final checkpoint step_000007" in caught.value.message
    assert caught.value.hint is not None and caught.value.hint.endswith("checkpoints/step_000003")


@pytest.mark.slow
def test_a_stopped_trainer_offers_the_handover_while_its_final_checkpoint_is_written(tmp_path: Path) -> None:
    """A real `python -m trainer train` (tiny preset, threaded pipeline with two drafter threads) stopped with
    SIGTERM while its final write is slow: status.json offers the hand-over with the checkpoint being written,
    before that checkpoint exists; the process then writes it and exits 143."""
    run_dir = tmp_path / "run"
    gate = tmp_path / "write-gate"  # the final write waits for it: opened once the offer was seen
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAINER_TEST_WRITE_GATE": str(gate)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trainer",
            "train",
            "--preset",
            "tiny",
            "--output-dir",
            str(run_dir),
            "--max-steps",
            "100000",
            "--wandb",
            "off",
            "--drafter-gpus",
            "cpu,cpu",
            "--log-interval",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = run_dir / "status.json"
        deadline = time.monotonic() + 240
        while not (status.is_file() and json.loads(status.read_text()).get("step", 0) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # our own child, by pid
        offer = None
        while offer is None:
            assert proc.poll() is None and time.monotonic() < deadline, "exited without offering the hand-over"
            offer = json.loads(status.read_text()).get("handover")
            time.sleep(0.05)
        checkpoint = Path(offer["checkpoint"])
        assert offer["devices_released"] is True and offer["device_bytes_left"] == {}  # the CPU holds no cache
        assert isinstance(offer["position"], list) and len(offer["position"]) == 2  # where the next run warms up
        assert checkpoint.parent == run_dir / "checkpoints" and not checkpoint.exists()  # still being written
        gate.touch()
        assert proc.wait(timeout=120) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    final = json.loads(status.read_text())
    assert (checkpoint / "state.json").is_file() and final["phase"] == "stopped"
    timeline = final["timeline"]
    order = [
        "python_started",
        "imports_done",
        "preflight_done",
        "built",
        "compiled",
        "warmed_up",
        "first_step",
        "stop_agreed",
        "final_snapshot",
        "devices_released",
        "ended",
    ]
    assert [timeline[k] for k in order] == sorted(timeline[k] for k in order), timeline  # write after release


def test_the_start_point_comes_from_the_checkpoint_or_the_offer_and_never_from_another_nodes_disk(
    tmp_path: Path,
) -> None:
    """Where the warm-up starts before the checkpoint is read (trainer.training.loop.start_point): the beginning, the
    checkpoint's state.json, the writer's hand-over offer; nothing on a node that reads no checkpoints (a
    distributed run's node 1 names node 0's checkpoint, which is not on its disk: read, it failed the run)."""
    from trainer.core.config import parse_train_args
    from trainer.training.loop import start_point
    from trainer.training.preflight import preflight

    setup = preflight(parse_train_args(["--preset", "tiny", "--output-dir", str(tmp_path / "run"), "--wandb", "off"]))
    assert start_point(setup) == (0, (0, 0))
    checkpoint = tmp_path / "old" / "checkpoints" / "step_000009"
    setup.resume_from = checkpoint  # not on this node's disk
    setup.reads_checkpoints = False
    assert start_point(setup) is None
    setup.reads_checkpoints = True
    checkpoint.mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"step": 9, "epoch": 1, "index": 4, "scheduler": {}}))
    assert start_point(setup) == (9, (1, 4))
    pending = tmp_path / "old" / "checkpoints" / "step_000012"
    offer = {"checkpoint": str(pending), "step": 12, "position": [2, 0]}
    (tmp_path / "old" / "status.json").write_text(json.dumps({"pid": 1, "handover": offer}))
    setup.resume_from, setup.resume_writer = pending, tmp_path / "old"
    assert start_point(setup) == (12, (2, 0))
