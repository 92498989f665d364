"""A run's checkpoints: the complete ones, the latest, and the temporaries a killed writer left."""

from __future__ import annotations

import json
import os
import re
import zipfile

from .common import alive, read_json

# The trainer writes checkpoints/.tmp-step_N-<pid>/ (state.json last), fsyncs it and renames it to step_N
# (trainer/checkpoint.py). A checkpoint exists when it is durable under its final name. A writer killed after its
# data was complete but before the rename leaves a temporary that holds the whole checkpoint: whoever resumes
# (restart --resume, the supervisor, the hand-over child in trainer/handover.py) commits it before using it.
CHECKPOINT_RE = re.compile(r"^step_(\d{6,})$")
TEMPORARY_CHECKPOINT_RE = re.compile(r"^\.tmp-(step_\d{6,})-(\d+)$")
CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt", "state.json")


def checkpoint_names(directory: str) -> list[str]:
    """The run's complete checkpoints (step_N with state.json), oldest first."""
    root = os.path.join(directory, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    done = [n for n in names if CHECKPOINT_RE.match(n) and os.path.isfile(os.path.join(root, n, "state.json"))]
    return sorted(done, key=lambda n: int(n[5:]))


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint of a run (after committing one its dead writer left unfinished), or None."""
    commit_orphans(directory)
    names = checkpoint_names(directory)
    return os.path.join(directory, "checkpoints", names[-1]) if names else None


def complete_checkpoint(path: str) -> bool:
    """`path` is a complete checkpoint (committing it first when its dead writer left it unfinished)."""
    if not os.path.isfile(os.path.join(path, "state.json")):
        commit_orphans(os.path.dirname(os.path.dirname(os.path.abspath(path))))
    return os.path.isfile(os.path.join(path, "state.json"))


def commit_orphans(directory: str) -> list[str]:
    """Commit (fsync every file, rename into place, fsync the folder) each temporary checkpoint of the run whose
    writer has died after writing all of it and which has no final folder yet; return their final paths. A
    temporary that is incomplete, or whose writer lives (it is still fsyncing), is left alone."""
    root = os.path.join(directory, "checkpoints")
    committed = []
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        match = TEMPORARY_CHECKPOINT_RE.match(entry)
        if not match or alive(int(match.group(2))):
            continue
        tmp, final = os.path.join(root, entry), os.path.join(root, match.group(1))
        if os.path.exists(final) or not checkpoint_data_complete(tmp, int(match.group(1)[5:])):
            continue
        try:
            for name in CHECKPOINT_FILES:
                fd = os.open(os.path.join(tmp, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.rename(tmp, final)
            fsync_folder(root)
        except OSError:  # another resumer committed it first, or the disk failed: the caller looks again
            continue
        committed.append(final)
    return committed


def checkpoint_data_complete(path: str, step: int) -> bool:
    """Every file of checkpoint `path` was written to its end: state.json (written last) parses and names `step`,
    the safetensors file is as long as its header says, and the torch files end in a zip directory."""
    state = read_json(os.path.join(path, "state.json"))
    if state is None or state.get("step") != step:
        return False
    if not all(zipfile.is_zipfile(os.path.join(path, name)) for name in ("optimizer.pt", "rng.pt")):
        return False
    try:
        with open(os.path.join(path, "model.safetensors"), "rb") as handle:
            header_bytes = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_bytes))
            size = os.fstat(handle.fileno()).st_size
    except (OSError, ValueError):
        return False
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)]
    return size == 8 + header_bytes + max(ends, default=0)


def fsync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
