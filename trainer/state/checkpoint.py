"""Checkpoints: `<run>/checkpoints/step_NNNNNN/`, written to a temporary directory and renamed.

A checkpoint directory holds
    model.safetensors   the drafter's trainable weights, public DFlash tensor names
    optimizer.pt        AdamW state (torch.save)
    rng.pt              torch / numpy / python RNG states (and CUDA's, when present)
    state.json          step, data position (epoch, index: the next micro-batch), scheduler state, the run's
                        config, the drafter config and every tensor's shape — written LAST, so a directory
                        without it is incomplete and ignored.
The rename is atomic on one filesystem, so a reader sees either the whole checkpoint or none; a crash
mid-save leaves only a `.tmp-*` directory, which the next save removes (a write that fails with an
exception removes its own at once: on a full disk that gives the space back). Only the newest `keep` complete
checkpoints are kept; nothing outside `<run>/checkpoints/` is ever touched.

Saving is two halves: `snapshot_checkpoint` copies everything to host memory on the caller's thread at a step
boundary (the part training must wait for), `write_checkpoint` serialises, fsyncs and renames. `save_checkpoint`
does both; `CheckpointWriter` runs the second half on a background thread, so training goes on while the disk
works (an 8B-shaped drafter plus its AdamW moments is ~6 GB and took 22 s to write on the H200 machine).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import traceback
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.serialization  # its `config` (torch.save reads it)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trainer.core.config import TrainerInputError
from trainer.core.diskspace import is_out_of_space, mount_point
from trainer.core.run_files import CHECKPOINT_PREFIX, CHECKPOINTS

_STEP_DIR = re.compile(rf"^{CHECKPOINT_PREFIX}(\d{{6,}})$")
# Tests only, standing in for a slow disk (an 8B drafter's 12.6 GB take ~15-20 s on the H200 machine; the CPU
# tests' checkpoints take milliseconds): each background write waits DELAY seconds before it starts, and/or until
# the file GATE names exists (a test opens the gate once it has seen what must come first: an ordering, not a
# race); the SYNC pair holds the write between its files written and their fsyncs.
WRITE_DELAY_ENV, WRITE_GATE_ENV = "TRAINER_TEST_WRITE_DELAY_S", "TRAINER_TEST_WRITE_GATE"
SYNC_DELAY_ENV, SYNC_GATE_ENV = "TRAINER_TEST_SYNC_DELAY_S", "TRAINER_TEST_SYNC_GATE"


def _test_hold(delay_env: str, gate_env: str) -> None:
    time.sleep(float(os.environ.get(delay_env) or 0.0))
    gate = os.environ.get(gate_env)
    while gate and not os.path.exists(gate):
        time.sleep(0.05)


@dataclass
class CheckpointContents:
    """The parts of one checkpoint, tensors on the CPU."""

    step: int
    epoch: int
    index: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]


@dataclass(kw_only=True)
class CheckpointState(CheckpointContents):
    """What `load_checkpoint` returns."""

    path: Path


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where checkpoint `step` of a run lands (complete once its state.json is there)."""
    return checkpoints_root(run_dir) / f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (those with state.json), oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and (entry / "state.json").is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(kw_only=True)
class CheckpointSnapshot(CheckpointContents):
    """A checkpoint's contents copied to host memory, owned by nobody else (see `snapshot_checkpoint`)."""

    buffers: list[torch.Tensor] = field(default_factory=list)  # every host tensor above, in copy order


class _HostCopier:
    """Copies a nest of containers to host memory, reusing the buffers of an earlier snapshot of the same nest.

    Reuse matters for big drafters. The qwen3-8b drafter with its AdamW moments is 12.6 GB; on the H200 machine a
    fresh pageable copy took 7.9 s at every save. Buffers for CUDA tensors are pinned, so the copies run
    asynchronously at PCIe speed (one device sync at the end, `finish`): 0.23 s per save once the buffers exist,
    13.7 s at the first save, which pins them (bench/results/pipeline.md 2026-11-29 "Snapshot into reused pinned buffers"). The buffers are matched to the
    tensors by position in the traversal (dicts keep their order), and a buffer of another shape or dtype is
    replaced."""

    def __init__(self, spare: list[torch.Tensor]) -> None:
        self.spare = iter(spare)
        self.buffers: list[torch.Tensor] = []
        self.devices: set[torch.device] = set()

    def __call__(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            source = value.detach()
            buffer = next(self.spare, None)
            if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=source.is_cuda)
            buffer.copy_(source, non_blocking=source.is_cuda)  # always a real copy: training goes on
            if source.is_cuda:
                self.devices.add(source.device)
            self.buffers.append(buffer)
            return buffer
        if isinstance(value, dict):
            return {key: self(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self(item) for item in value)
        return copy.deepcopy(value)

    def finish(self) -> list[torch.Tensor]:
        for device in self.devices:  # the pinned copies above were asynchronous
            torch.cuda.synchronize(device)
        return self.buffers


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a nest of containers, in the order _HostCopier visits them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def snapshot_checkpoint(
    step: int,
    *,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    epoch: int,
    index: int,
    extra: dict[str, Any],
    spare: list[torch.Tensor] | None = None,
) -> CheckpointSnapshot:
    """Copy a checkpoint's contents to host memory now, RNG state included (the RNG must be read at the step
    boundary, not when a background write gets to it), into the `spare` buffers of an earlier snapshot where
    they fit. Cost: one device->host copy of the weights and optimizer state, one device sync, and the same
    amount of host memory (pinned for CUDA tensors) for as long as the caller keeps the buffers."""
    copier = _HostCopier(spare or [])
    snapshot = CheckpointSnapshot(
        step=step,
        epoch=epoch,
        index=index,
        model=copier(model),
        optimizer=copier(optimizer),
        scheduler=copier(scheduler),
        rng=rng_state(),
        extra=copier(extra),
    )
    snapshot.buffers = copier.finish()
    return snapshot


def write_checkpoint(run_dir: Path, snapshot: CheckpointSnapshot, keep: int) -> Path:
    """Write a snapshot atomically (temporary directory, fsync, rename), prune to the newest `keep`; return its
    directory. Touches nothing outside `<run>/checkpoints/`.

    A failed write removes its temporary directory before raising: on a full disk that frees the space the
    partial files took, so the run can still record its failure. A full disk (however the library words it,
    see trainer.core.diskspace) is raised as CheckpointWriteError with `no_space_on` set; other errors as they are."""
    root = checkpoints_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    final = checkpoint_dir(run_dir, snapshot.step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        _write_parts(tmp, snapshot)
    except Exception as exc:
        needed = snapshot_bytes(snapshot)
        no_space = is_out_of_space(exc, root, needed)  # measured before the cleanup frees the space
        _drop_frames(exc)
        shutil.rmtree(tmp, ignore_errors=True)
        if no_space:
            mount = mount_point(root)
            raise CheckpointWriteError(
                f"no space left on {mount} while writing checkpoint step {snapshot.step}",
                step=snapshot.step,
                no_space_on=mount,
                needed_bytes=needed,
            ) from exc
        raise
    except BaseException:  # KeyboardInterrupt and the like: no half-written directory either
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():  # the same step saved again (e.g. a stop right after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _drop_frames(exc: BaseException) -> None:
    """Clear the local variables of the finished frames `exc` (and what it was raised from) holds. A failed
    writer's file object lives in its frame (torch.save's zip writer, the side-by-side writer's futures), and
    an open file keeps its blocks allocated after the unlink: on a full disk the cleanup would free nothing
    while the exception is alive. Tracebacks still print (file, line, function stay)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def _write_parts(tmp: Path, snapshot: CheckpointSnapshot) -> None:
    """Every file of a checkpoint into `tmp`, state.json last, then each fsynced.

    The two big files are written side by side (safetensors serialises while torch.save streams), and
    torch.save skips its zip records' CRC32 (one core at ~2-3 GB/s over 8.4 GB for the qwen3-8b drafter's
    optimizer; safetensors has no checksum either; torch.load accepts both). From the moment state.json is in
    `tmp` the data is complete and readable through the page cache, durable only after the fsyncs: a restart's
    next run may read it from there (trainer.state.handover.wait_for_checkpoint) instead of waiting for the disk."""
    torch.utils.serialization.config.save.compute_crc32 = False  # process-wide; checkpoints are its only torch.save
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-write") as pool:
        written = [
            pool.submit(save_file, snapshot.model, str(tmp / "model.safetensors")),
            pool.submit(torch.save, snapshot.optimizer, tmp / "optimizer.pt"),
        ]
        for future in written:
            future.result()
    torch.save(snapshot.rng, tmp / "rng.pt")
    state = {
        "step": snapshot.step,
        "epoch": snapshot.epoch,
        "index": snapshot.index,
        "scheduler": snapshot.scheduler,
        "shapes": {name: list(t.shape) for name, t in snapshot.model.items()},
        **snapshot.extra,
    }
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    _test_hold(SYNC_DELAY_ENV, SYNC_GATE_ENV)  # tests: a disk slow to make it durable
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())


def snapshot_bytes(snapshot: CheckpointSnapshot) -> int:
    """The tensor bytes of a snapshot: about what its checkpoint takes on disk (RNG and JSON are small)."""
    return sum(t.numel() * t.element_size() for t in snapshot.buffers)


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    scheduler: dict[str, Any],
    epoch: int,
    index: int,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Snapshot and write checkpoint `step` now (synchronously); return its directory."""
    snapshot = snapshot_checkpoint(
        step, model=model, optimizer=optimizer, scheduler=scheduler, epoch=epoch, index=index, extra=extra
    )
    return write_checkpoint(run_dir, snapshot, keep)


class CheckpointWriteError(RuntimeError):
    """A checkpoint write failed (disk full, permissions, ...); a background one is raised on the training thread.

    `step` is the checkpoint that failed; `no_space_on` is the mount point of the full filesystem when the
    cause was a full disk (else None), and `needed_bytes` about what that checkpoint needs."""

    def __init__(self, message: str, *, step: int, no_space_on: Path | None = None, needed_bytes: int = 0) -> None:
        super().__init__(message)
        self.step = step
        self.no_space_on = no_space_on
        self.needed_bytes = needed_bytes


class CheckpointWriter:
    """Writes checkpoint snapshots on one background thread while training goes on.

    Contract: `submit` takes a snapshot (from `snapshot`, or `snapshot_checkpoint`) and returns at once, unless
    an earlier write is still running: then it waits for that one first, so at most one snapshot sits in host
    memory and checkpoints land in step order. `poll` returns the directories written since the last call, oldest first;
    `wait` blocks until nothing is in flight and returns them too. A failed write is re-raised as
    CheckpointWriteError by the next `submit`, `poll` or `wait` on the caller's thread. `close` waits for the
    write in flight and stops the thread; use the writer as a context manager so that a failing run still
    finishes a checkpoint it already snapshotted."""

    def __init__(self, run_dir: Path, keep: int) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep
        self._lock = threading.Condition()
        self._pending: CheckpointSnapshot | None = None
        self._busy = False
        self._closed = False
        self._written: list[Path] = []
        self._spare: list[torch.Tensor] = []  # the last written snapshot's host buffers, for the next one
        self._preparing = False  # `prepare` is pinning buffers
        self._error: BaseException | None = None
        self._failed_step = -1
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def snapshot(self, step: int, **parts: Any) -> CheckpointSnapshot:
        """`snapshot_checkpoint(step, **parts)` into the host buffers of the previous snapshot (or those `prepare`
        pinned), once its write is done (waits for it): the run keeps one snapshot's worth of host memory."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy and self._pending is None and not self._preparing)
            spare, self._spare = self._spare, []
        return snapshot_checkpoint(step, spare=spare, **parts)

    def prepare(self, layout: dict[str, Any]) -> None:
        """Pin host buffers for the snapshots of `layout` (the parts a checkpoint will hold, or tensors of the
        same shapes) on a background thread, now, instead of at the first save. Pinning is the slow part of a
        first snapshot (qwen3-8b drafter + AdamW, 12.6 GB: 13.7 s, against 0.23 s once pinned); a stop early in
        a run, the usual restart, would wait for it. Buffers of CUDA tensors are pinned; nothing is done when
        there is none. A snapshot that comes first waits for this to finish."""
        tensors = _tensors(layout)
        if not any(t.is_cuda for t in tensors):
            return
        shapes = [(tuple(t.shape), t.dtype, t.is_cuda) for t in tensors]  # every one: buffers match by position
        with self._lock:
            if self._spare or self._preparing:
                return
            self._preparing = True
        threading.Thread(target=self._pin, args=(shapes,), name="checkpoint-pin", daemon=True).start()

    def _pin(self, shapes: list[tuple[tuple[int, ...], torch.dtype, bool]]) -> None:
        buffers: list[torch.Tensor] = []
        try:
            for shape, dtype, pinned in shapes:
                buffers.append(torch.empty(shape, dtype=dtype, pin_memory=pinned))
        except Exception:  # noqa: BLE001 - e.g. no room to pin: the first snapshot allocates as before
            buffers = []
        with self._lock:
            self._spare = self._spare or buffers
            self._preparing = False
            self._lock.notify_all()

    def submit(self, snapshot: CheckpointSnapshot) -> None:
        with self._lock:
            self._lock.wait_for(lambda: not self._busy and self._pending is None)
            self._raise_error()
            if self._closed:
                raise RuntimeError("CheckpointWriter is closed")
            self._pending = snapshot
            self._lock.notify_all()

    def poll(self) -> list[Path]:
        with self._lock:
            self._raise_error()
            written, self._written = self._written, []
            return written

    def in_flight(self) -> bool:
        """True while a submitted snapshot has not been written yet."""
        with self._lock:
            return self._busy or self._pending is not None

    def wait(self) -> list[Path]:
        with self._lock:
            self._lock.wait_for(lambda: not self._busy and self._pending is None)
        return self.poll()

    def close(self) -> None:
        """Finish the write in flight (its error, if any, stays for `poll`), then stop the thread."""
        with self._lock:
            self._lock.wait_for(lambda: not self._busy and self._pending is None)
            self._closed = True
            self._lock.notify_all()
        self._thread.join()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def take_error(self) -> CheckpointWriteError | None:
        """The failure of a write that nobody has been told of yet (and forget it), as `poll` would raise it.
        After `close`, this says whether the write in flight when the run failed had failed too."""
        with self._lock:
            error, self._error = self._error, None
        if error is None or isinstance(error, CheckpointWriteError):
            return error
        wrapped = CheckpointWriteError(
            f"writing checkpoint step_{self._failed_step:06d} failed: {type(error).__name__}: {error}",
            step=self._failed_step,
        )
        wrapped.__cause__ = error
        return wrapped

    def _raise_error(self) -> None:
        # Called with self._lock held; the lock is re-entrant (a Condition over an RLock).
        error = self.take_error()
        if error is not None:
            raise error

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                snapshot, self._pending, self._busy = self._pending, None, True
            try:
                _test_hold(WRITE_DELAY_ENV, WRITE_GATE_ENV)
                path = write_checkpoint(self.run_dir, snapshot, self.keep)
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                with self._lock:
                    self._error, self._failed_step, self._busy = exc, snapshot.step, False
                    self._lock.notify_all()
                continue
            with self._lock:
                self._written.append(path)
                self._spare = snapshot.buffers
                self._busy = False
                self._lock.notify_all()
            del snapshot


CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")  # each one is read on resume


def checkpoint_damage(path: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> str | None:
    """What makes checkpoint `path` unloadable, or None when it is whole, judged from each of `files`' size and
    header without reading a tensor: state.json parses and names its step and shapes; model.safetensors is as
    long as its header says and holds the shapes state.json records; the torch files end in their zip directory.

    Sizes and headers, not a digest recorded at commit: what damages checkpoints here is a cut (a full disk, a
    crash mid-copy, a killed rsync) or a lost file, and both show in the sizes; a digest would catch a flipped
    bit as well, but costs a read of every byte at each commit and at each check (an 8B drafter's 12.6 GB: tens
    of seconds of disk on the restart's critical path), where this reads a few KiB."""
    path = Path(path)
    for name in files:
        if not (path / name).is_file():
            return f"{name} is missing"
    state: Any = None
    if "state.json" in files:
        try:
            state = json.loads((path / "state.json").read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            return "state.json is cut short or not JSON"
        if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "shapes" not in state:
            return "state.json lacks its step or tensor shapes"
    if "model.safetensors" in files:
        damage = _safetensors_damage(path / "model.safetensors", state.get("shapes") if state else None)
        if damage:
            return damage
    for name in (n for n in files if n.endswith(".pt")):
        try:
            with zipfile.ZipFile(path / name):  # reads the central directory at the file's end
                pass
        except (OSError, zipfile.BadZipFile):
            return f"{name} is cut short or not a torch file ({(path / name).stat().st_size} bytes)"
    return None


def _safetensors_damage(weights: Path, shapes: dict[str, list[int]] | None) -> str | None:
    """model.safetensors's header parses, the file is as long as the header says, and, given `shapes` (state.json's),
    it holds those tensors in those shapes."""
    try:
        with open(weights, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header_bytes = int.from_bytes(handle.read(8), "little")
            if header_bytes > size - 8:
                raise ValueError
            header = json.loads(handle.read(header_bytes))
        tensors = {k: t for k, t in header.items() if k != "__metadata__"}
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"model.safetensors has no readable header ({weights.stat().st_size} bytes)"
    if size != 8 + header_bytes + end:
        return f"model.safetensors is cut short ({size} of {8 + header_bytes + end} bytes)"
    if shapes is not None:
        found, recorded = {k: list(t["shape"]) for k, t in tensors.items()}, {k: list(v) for k, v in shapes.items()}
        missing, unexpected = sorted(set(recorded) - set(found)), sorted(set(found) - set(recorded))
        if missing or unexpected:
            return f"model.safetensors does not match state.json: missing {missing[:3]}, unexpected {unexpected[:3]}"
        wrong = [k for k in recorded if found[k] != recorded[k]]
        if wrong:
            return f"model.safetensors does not match state.json: {wrong[0]} is {found[wrong[0]]}, not {recorded[wrong[0]]}"
    return None


def last_good_checkpoint(path: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> Path | None:
    """The newest whole checkpoint beside `path` (same checkpoints/ folder) other than `path` itself, or None."""
    path = Path(path)
    found = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else []:
        match = _STEP_DIR.match(entry.name)
        if match and entry.name != path.name:
            found.append((int(match.group(1)), entry))
    for _, entry in sorted(found, reverse=True):
        if checkpoint_damage(entry, files) is None:
            return entry
    return None


def require_whole(
    path: Path, *, flag: str = "--resume", files: tuple[str, ...] = CHECKPOINT_FILES, damage: str | None = None
) -> None:
    """TrainerInputError naming the damaged file of checkpoint `path` and the last good checkpoint beside it (the
    hint: `flag` pointed at that one), unless the checkpoint is whole. `damage`: already found, or found here."""
    damage = damage or checkpoint_damage(path, files)
    if damage is None:
        return
    good = last_good_checkpoint(path, files)
    raise TrainerInputError(
        f"{flag}: checkpoint {path} cannot be loaded: {damage}; last good checkpoint: {good or 'none'}",
        hint=f"use that one: {flag} {good}" if good else "no other checkpoint of this run is whole; start fresh",
    )


def read_state(path: Path) -> dict[str, Any]:
    """state.json of a checkpoint directory (cheap: no tensors), or a TrainerInputError (a missing or damaged
    state.json names the last good checkpoint)."""
    state_file = Path(path) / "state.json"
    if not state_file.is_file():
        raise TrainerInputError(
            f"--resume: {path} is not a complete checkpoint (no state.json)",
            hint="point --resume at a checkpoints/step_NNNNNN directory",
        )
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        state = None
    if not isinstance(state, dict):
        require_whole(path, files=("state.json",), damage="state.json is cut short or not JSON")
    return state


def check_shapes(path: Path, expected: dict[str, list[int]]) -> None:
    """Refuse a checkpoint whose tensors differ in name or shape from the drafter being trained."""
    saved: dict[str, list[int]] = read_state(path)["shapes"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has an extra tensor {unexpected[0]}"
        raise TrainerInputError(
            f"checkpoint {path} is of a different drafter shape: it {what}",
            hint="resume with the flags it was trained with (e.g. --num-draft-layers), or use a new --output-dir",
        )
    for name, shape in expected.items():
        if list(saved[name]) != list(shape):
            raise TrainerInputError(
                f"checkpoint {path} is of a different drafter shape: {name} is {saved[name]} there, {list(shape)} here",
                hint="resume with the flags it was trained with, or use a new --output-dir",
            )


def load_checkpoint(path: Path, device: torch.device | None = None) -> CheckpointState:
    """Load every part of a checkpoint: the model and optimizer tensors onto `device` (default the CPU; a GPU
    spares a resume the second copy from pageable host memory into every replica: 12.6 GB twice for the qwen3-8b
    drafter with two replicas), the RNG states and the optimizer's step counters onto the CPU, where
    `restore_rng` and a non-fused AdamW expect them.

    The two big files are read side by side, each memory-mapped (no read() copy: the device copy reads the page
    cache directly); both libraries release the GIL while they copy. A damaged checkpoint (checkpoint_damage,
    checked first: a few KiB of headers) is a TrainerInputError naming the file and the last good checkpoint."""
    require_whole(path)
    state = read_state(path)
    try:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="checkpoint-read") as pool:
            model = pool.submit(load_file, str(Path(path) / "model.safetensors"), device=str(device or "cpu"))
            loaded = pool.submit(
                torch.load, Path(path) / "optimizer.pt", weights_only=False, map_location=device, mmap=True
            )
            optimizer = loaded.result()
            tensors = model.result()
            rng = torch.load(Path(path) / "rng.pt", weights_only=False)
    except (
        OSError,
        RuntimeError,
        ValueError,
        EOFError,
        SafetensorError,
        pickle.UnpicklingError,
    ) as exc:  # whole by its headers, unreadable inside
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        require_whole(path, damage=f"{type(exc).__name__}: {first}")
        raise
    for entry in optimizer.get("state", {}).values():
        if isinstance(entry.get("step"), torch.Tensor) and entry["step"].device.type != "cpu":
            entry["step"] = entry["step"].cpu()  # as saved: load_state_dict moves it where the AdamW kind wants it
    extra = {k: v for k, v in state.items() if k not in ("step", "epoch", "index", "scheduler", "shapes")}
    return CheckpointState(
        path=Path(path),
        step=int(state["step"]),
        epoch=int(state["epoch"]),
        index=int(state["index"]),
        model=tensors,
        optimizer=optimizer,
        scheduler=state["scheduler"],
        rng=rng,
        extra=extra,
    )


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """--resume auto: newest complete checkpoint of run_dir (or None); never: None, but refuse to start over
    a run directory that has checkpoints (nothing gets overwritten); otherwise the given directory."""
    existing = list_checkpoints(run_dir)
    if resume == "auto":
        if existing:
            require_whole(existing[-1][1])
        return existing[-1][1] if existing else None
    if resume == "never":
        if existing:
            raise TrainerInputError(
                f"--resume never: {run_dir} already holds checkpoints",
                hint="use a new --output-dir, or --resume auto to continue that run",
            )
        return None
    path = Path(resume)
    read_state(path)
    require_whole(path)
    return path
