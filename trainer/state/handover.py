"""The restart hand-over: the next run builds while the stopped one is still writing its final checkpoint.

A restart of an 8B-shaped run waits for two long things that do not depend on each other: the old process
writing its final checkpoint (12.6 GB: ~15-20 s on the H200 machine's disk) and the new process starting
(imports, target load, drafter build: ~20 s). Done one after the other they add up; the hand-over runs them
side by side, with nothing read before it is complete:

Old run (trainer.training.loop, on a stop): the final snapshot is copied to host memory, the worker threads stop, every
device tensor is dropped (`free_device_memory`), and only then, if the devices are really free, status.json
gets `handover: {checkpoint, step, devices_released: true}` while the write goes on (phase `saving`).

The controller (dflashops' agent, `restart --resume`): having sent the SIGTERM, it launches the new run as
soon as it reads that field (instead of waiting for the old process to exit), with `--resume` naming the
checkpoint being written and `RESUME_WRITER_ENV` naming the old run's directory. The rest of the stop
(the old process's exit, its group, the escalation after --grace) completes in the background as before.

New run: the pre-flight accepts a `--resume` checkpoint that is not there yet only when `RESUME_WRITER_ENV`
names the run directory it belongs to, and defers its checks; the loop builds and compiles (from the offer's
data position), then `wait_for_checkpoint` waits until every file of the checkpoint is written: it reads them
from the writer's temporary directory while only their fsyncs are left, or from the checkpoint directory once
it is renamed into place (`read_handed_over` falls back to the latter if the former goes away). It resumes only
once the checkpoint is durable under its final name (`commit_when_durable`): the old run renames it there after
its fsyncs, and if the old run died between writing and renaming, the new run commits it itself (fsync, rename)
and says so. If the old run ends without writing it, the new run fails with one error line naming the old run's
last complete checkpoint. Without the variable nothing changes: a missing --resume path is refused up front.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainer.core.config import TrainerInputError
from trainer.core.run_files import STATUS
from trainer.state.checkpoint import checkpoints_root, list_checkpoints

T = TypeVar("T")
RESUME_WRITER_ENV = "DFLASHOPS_RESUME_WRITER"  # the run directory whose final checkpoint --resume names
WAIT_POLL_S = 0.1
# Device memory the old process may still hold after the release (its CUDA context lives outside the caching
# allocator and is not counted): more than this and the new run is not started beside it.
RELEASED_BELOW_BYTES = 1 << 30


def pending_writer(resume: str | None, environ: dict[str, str] | None = None) -> Path | None:
    """The run directory still writing the checkpoint `resume` names, or None when `resume` is to be read now
    (no hand-over, or the checkpoint is already complete). Only a checkpoint inside that run's checkpoints/
    may be waited for."""
    writer = (environ if environ is not None else os.environ).get(RESUME_WRITER_ENV)
    if not writer or not resume or resume in ("auto", "never"):
        return None
    path, root = Path(resume), checkpoints_root(Path(writer))
    if (path / "state.json").is_file():
        return None
    if path.parent.resolve() != root.resolve():
        raise TrainerInputError(
            f"--resume: {path} is not a checkpoint of {writer} ({RESUME_WRITER_ENV})",
            hint=f"unset {RESUME_WRITER_ENV}, or resume from a complete checkpoint",
        )
    return Path(writer)


def _status(writer: Path) -> dict[str, Any]:
    """The writer's status.json, or {} while it cannot be read (it is replaced atomically, so only absent)."""
    try:
        status = json.loads((writer / STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def offered_start(writer: Path, checkpoint: Path) -> tuple[int, tuple[int, int]] | None:
    """(step, (epoch, index)) of `checkpoint` from the hand-over offer in `writer`'s status.json, or None when
    the offer is not about it or does not say (a trainer from before `position` was offered)."""
    offer = _status(writer).get("handover") or {}
    position = offer.get("position")
    if Path(str(offer.get("checkpoint"))) != Path(checkpoint) or not isinstance(position, list) or len(position) != 2:
        return None
    return int(offer["step"]), (int(position[0]), int(position[1]))


def wait_for_checkpoint(path: Path, writer: Path, timeout_s: float = 3600.0, *, durable: bool = False) -> Path:
    """Block until checkpoint `path` can be read; return where to read it: `path` once it is complete (its
    state.json exists: trainer.state.checkpoint renames whole directories into place), or, unless `durable`, the
    writer's temporary directory as soon as all its files are written and only their fsyncs are left
    (state.json is written last): the page cache serves the same bytes, and the disk's seconds are no longer
    the next run's. A read from there that finds it gone (renamed into place, or removed after a failed fsync)
    asks again with `durable=True`. The writer's end without the checkpoint (its `exit_code` file, or a final
    status phase) is a TrainerInputError naming what the writer left; so is `timeout_s` without either."""
    deadline = time.monotonic() + timeout_s
    while not (path / "state.json").is_file():
        status = _status(writer)  # read once a poll: the writer's pid and how it ended
        written = None if durable else _written_not_durable(path, status)
        if written is not None:
            return written
        ended = _writer_end(writer, status)
        if ended is not None and not (path / "state.json").is_file():
            raise _ended_without(writer, ended, path)
        if time.monotonic() > deadline:
            raise TrainerInputError(
                f"--resume: {path} did not appear within {timeout_s:.0f} s", hint=f"see {writer / 'train.log'}"
            )
        time.sleep(WAIT_POLL_S)
    return path


def read_handed_over(load: Callable[[Path], T], source: Path, path: Path, writer: Path) -> T:
    """`load(source)`, where `source` is what `wait_for_checkpoint(path, writer)` returned. When that was the
    writer's temporary directory and it went away during the read (renamed into place, or removed after a
    failed fsync), load the complete checkpoint instead, or raise the writer's failure."""
    try:
        return load(source)
    except Exception:
        if source == path or source.exists():
            raise
        return load(wait_for_checkpoint(path, writer, durable=True))


def check_handed_over(check: Callable[[Path], None], source: Path, path: Path, writer: Path) -> Path:
    """Run `check` (the pre-flight's checks, deferred while the checkpoint was written) on `source`, what
    `wait_for_checkpoint(path, writer)` returned, as `read_handed_over` reads: the writer may rename its temporary
    directory into place between that wait and the check, and then the check runs on `path`. Returns where it
    read, the place to read the rest from."""

    def checked(where: Path) -> Path:
        check(where)
        return where

    return read_handed_over(checked, source, path, writer)


def commit_when_durable(path: Path, writer: Path, source: Path, timeout_s: float = 3600.0) -> str | None:
    """After the hand-over's checkpoint was read from `source` (the writer's temporary directory, while its
    fsyncs were left): wait until checkpoint `path` is durable under its final name, for this run resumes only
    from a checkpoint that exists (lineage, run.json and `fetch` name `path`). The writer renames it into place
    once its fsyncs end; if the writer ended before that with the data complete (it was just read whole from
    `source`), commit it here: fsync every file, rename, fsync the folder; return a line saying so. A writer that
    ended and took `source` with it (a failed fsync removes it) is a TrainerInputError naming the last
    complete checkpoint. Returns None when the writer made it durable itself."""
    deadline = time.monotonic() + timeout_s
    while not (path / "state.json").is_file():
        status = _status(writer)
        ended = _writer_end(writer, status)
        if ended is not None and not (path / "state.json").is_file():
            if source != path and (source / "state.json").is_file():
                _commit(source, path)
                return f"committed {path}: {writer.name} ended ({ended}) after writing it, before making it durable"
            raise _ended_without(writer, ended, path)
        if time.monotonic() > deadline:
            raise TrainerInputError(
                f"--resume: {path} was not made durable within {timeout_s:.0f} s", hint=f"see {writer / 'train.log'}"
            )
        time.sleep(WAIT_POLL_S)
    return None


def _ended_without(writer: Path, ended: str, path: Path) -> TrainerInputError:
    return TrainerInputError(
        f"--resume: {writer.name} ended ({ended}) without writing its final checkpoint {path.name}",
        hint=f"restart from its last complete checkpoint: {_last_complete(writer) or 'none'}",
    )


def _commit(tmp: Path, final: Path) -> None:
    """What trainer.state.checkpoint.write_checkpoint's end does, for a writer that died before it: fsync each file,
    rename the folder into place, fsync the parent (the rename's durability). Another resumer (the agent's
    restart or supervisor) may commit it at the same moment: its rename wins, ours finds the folder gone."""
    for part in sorted(tmp.iterdir()):
        with open(part, "rb") as handle:
            os.fsync(handle.fileno())
    try:
        os.rename(tmp, final)
    except FileNotFoundError:
        if not (final / "state.json").is_file():
            raise
    fd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _written_not_durable(path: Path, status: dict[str, Any]) -> Path | None:
    """The writer's temporary directory of checkpoint `path` (`.tmp-<name>-<its pid>`, trainer.state.checkpoint;
    the pid from its `status`) once its state.json is there, else None."""
    if not isinstance(status.get("pid"), int):
        return None
    tmp = path.parent / f".tmp-{path.name}-{status['pid']}"
    return tmp if (tmp / "state.json").is_file() else None


def _writer_end(writer: Path, status: dict[str, Any]) -> str | None:
    """How the writing run ended, in words (its exit_code file, else its `status`, else its trainer process gone
    with its wrapper: a SIGKILL of the whole group leaves no exit code), or None while it has not."""
    code = writer / "exit_code"
    if code.is_file():
        return f"exit code {code.read_text().strip()}"
    if status.get("phase") in ("stopped", "done", "failed"):
        return f"status {status['phase']}" + (f": {status['error']}" if status.get("error") else "")
    pid = status.get("pid")
    if isinstance(pid, int) and not _alive(pid):
        return f"its process {pid} is gone"
    return None


def _alive(pid: int) -> bool:
    """`pid` runs (a zombie, which no wrapper reaped yet, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2 :][:1] not in ("Z", "X")


def _last_complete(writer: Path) -> str | None:
    done = list_checkpoints(writer)
    return str(done[-1][1]) if done else None


def free_device_memory(devices: Iterable[torch.device]) -> dict[str, int]:
    """Give cached device memory back to the driver after the caller dropped its tensors; return the bytes
    each CUDA device still has reserved by this process (empty on the CPU). Costs a gc pass (~0.1-1 s with
    a big graph of compiled objects) and a device sync."""
    gc.collect()
    left: dict[str, int] = {}
    for device in {torch.device(d) for d in devices}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
            left[str(device)] = int(torch.cuda.memory_reserved(device))
    return left


def devices_free(left: dict[str, int]) -> bool:
    return all(value < RELEASED_BELOW_BYTES for value in left.values())
