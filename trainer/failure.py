"""How a training run that failed says so: stderr (train.log) and status.json `failed` with the error.

Shared by the single-process trainer (trainer.train) and the threaded pipeline (trainer.pipeline.run), so both
report the same way. A failure with a known cause and fix is one `error:` line plus a `hint:` line and no
traceback; anything else keeps its traceback (the only clue to an unknown failure).

Known causes: an ExplainedFailure (it carries its own message and hint; e.g. a lost node of a distributed run,
trainer.dist), and the disk filling up while a checkpoint was written. The failed write has removed its partial files
(trainer.checkpoint.write_checkpoint), so the status write below has room again. The disk can fill up on the
writer thread while the training thread is the one that trips over it (its metrics or status write fails
first): the run's exception is then a plain ENOSPC, and the writer's own failure, collected once the writer
has closed, is the cause reported.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from trainer.checkpoint import CheckpointWriteError, CheckpointWriter, list_checkpoints
from trainer.config import TrainerInputError
from trainer.metrics import RunRecorder


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
    """Report `exc` (the run's failure) on stderr and in status.json. `writer` must be closed already (its
    write in flight finished), so that a checkpoint write failing at the same time is seen. Never raises."""
    late = writer.take_error() if writer is not None else None
    full = _disk_full(exc) or _disk_full(late)
    if full is not None:
        found = list_checkpoints(run_dir)
        last_good = str(found[-1][1]) if found else "none"
        message = f"{full}; last good checkpoint: {last_good}"
        print(f"error: {message}", file=sys.stderr)
        print(
            f"hint: free space on {full.no_space_on} (one checkpoint needs about "
            f"{full.needed_bytes / 2**20:.1f} MiB) or keep fewer checkpoints with --keep-checkpoints (now "
            f"{keep_checkpoints}), then run the same command again"
            f"{' to resume from the last good checkpoint' if found else ''}",
            file=sys.stderr,
            flush=True,
        )
    elif isinstance(exc, (ExplainedFailure, TrainerInputError)):  # e.g. a hand-over whose checkpoint never came
        message = exc.message
        print(f"error: {message}", file=sys.stderr, flush=True)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr, flush=True)
    else:
        traceback.print_exception(exc)
        message = f"{type(exc).__name__}: {exc}"[:2000]
    try:
        recorder.set_status(phase="failed", error=message, exit_code=exit_code)
    except OSError as status_error:  # e.g. a disk that is still full: stderr is all that is left
        print(f"warning: could not record the failure in status.json: {status_error}", file=sys.stderr, flush=True)
