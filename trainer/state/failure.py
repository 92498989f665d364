"""How a training run that failed says so: stderr (train.log) and status.json `failed` with the error.

Shared by the single-process trainer (trainer.train) and the threaded pipeline (trainer.pipeline_run), so both
report the same way. A failure with a known cause and fix is one `error:` line plus a `hint:` line and no
traceback; anything else keeps its traceback (the only clue to an unknown failure).

Known causes: an ExplainedFailure (it carries its own message and hint; e.g. a lost node of a distributed run,
trainer.dist), and the disk filling up:
- while a checkpoint was written. The failed write has removed its partial files
  (trainer.state.checkpoint.write_checkpoint), so the status write below has room again. The disk can fill up on the
  writer thread while the training thread is the one that trips over it (its metrics or status write fails
  first): the run's exception is then a plain ENOSPC, and the writer's own failure, collected once the writer
  has closed, is the cause reported.
- while one of the run's records was written (status.json, also by the heartbeat, metrics.jsonl,
  train_config.json: trainer.state.metrics NoSpaceError; issue 27, item 8). Nothing frees space then: status.json
  `failed` lands in the block set aside for it (trainer.state.metrics), and it is written BEFORE the lines, since
  renaming it into place frees the old status.json's blocks, where the lines can go when train.log is on the
  full disk too. The lines are written whole or not at all (trainer.core.lines.say): never a cut line, never a
  second traceback from a stderr that cannot be written.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

from trainer.core.config import TrainerInputError
from trainer.core.diskspace import as_no_space
from trainer.core.lines import say
from trainer.state.checkpoint import CheckpointWriteError, CheckpointWriter, list_checkpoints
from trainer.state.metrics import RunRecorder


class ExplainedFailure(RuntimeError):
    """A failure whose cause is known: reported as one `error:` line and one `hint:` line, no traceback."""

    def __init__(self, message: str, *, hint: str) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


def _disk_full(error: BaseException | None) -> CheckpointWriteError | None:
    if isinstance(error, CheckpointWriteError) and error.no_space_on is not None:
        return error
    return None


def record_failure(
    recorder: RunRecorder,
    exc: BaseException,
    *,
    run_dir: Path,
    writer: CheckpointWriter | None,
    keep_checkpoints: int,
    exit_code: int,
) -> None:
    """Report `exc` (the run's failure) in status.json and on stderr. `writer` must be closed already (its
    write in flight finished), so that a checkpoint write failing at the same time is seen. Never raises."""
    message, lines = explain(exc, writer.take_error() if writer is not None else None, run_dir, keep_checkpoints)
    recorder.stop_heartbeat()  # the failure is the last record: no beat may take the space its lines need
    try:
        recorder.set_status(phase="failed", error=message, exit_code=exit_code)
    except OSError as status_error:  # e.g. a disk still full and no reserve left: stderr is all there is
        lines.append(f"warning: could not record the failure in status.json: {status_error}")
    say(*lines)


def explain(
    exc: BaseException, late: BaseException | None, run_dir: Path, keep_checkpoints: int
) -> tuple[str, list[str]]:
    """(status.json's `error`, the stderr lines) for the run's failure `exc`; `late`: the checkpoint writer's own
    failure, if any (it names the cause when both are a full disk)."""
    full = _disk_full(exc) or _disk_full(late)
    record = as_no_space(exc)  # status.json, metrics.jsonl, train_config.json (trainer.state.metrics)
    found = list_checkpoints(run_dir) if full is not None or record is not None else []
    last_good = str(found[-1][1]) if found else "none"
    if full is not None:
        message = f"{full}; last good checkpoint: {last_good}"
        hint = (
            f"free space on {full.no_space_on} (one checkpoint needs about "
            f"{full.needed_bytes / 2**20:.1f} MiB) or keep fewer checkpoints with --keep-checkpoints (now "
            f"{keep_checkpoints}), then run the same command again"
            f"{' to resume from the last good checkpoint' if found else ''}"
        )
        return message, [f"error: {message}", f"hint: {hint}"]
    if record is not None:
        message = f"{record}; last good checkpoint: {last_good}"
        again = "run the same command again" + (" to resume from the last good checkpoint" if found else "")
        run_name = os.environ.get("DFLASHOPS_RUN_NAME")  # set by dflashops' launch: its own restart
        if run_name:
            again += f" (a dflashops run: dflashops restart {run_name}{' --resume' if found else ''})"
        return message, [f"error: {message}", f"hint: free space on {record.mount}, then {again}"]
    if isinstance(exc, (ExplainedFailure, TrainerInputError)):  # e.g. a hand-over whose checkpoint never came
        return exc.message, [f"error: {exc.message}", *([f"hint: {exc.hint}"] if exc.hint else [])]
    trace = "".join(traceback.format_exception(exc)).rstrip("\n")
    return f"{type(exc).__name__}: {exc}"[:2000], [trace]
