"""A run's checkpoints: the complete ones, the latest, and the temporaries a killed writer left."""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile

from .common import alive, read_json

# The trainer writes checkpoints/.tmp-step_N-<pid>/ (state.json last), fsyncs it and renames it to step_N
# (trainer/state/checkpoint.py). A checkpoint exists when it is durable under its final name. A writer killed after its
# data was complete but before the rename leaves a temporary that holds the whole checkpoint: whoever resumes
# (restart --resume, the supervisor, the hand-over child in trainer/state/handover.py) commits it before using it.
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
    """Every file of checkpoint `path` was written to its end (checkpoint_damage finds nothing) and state.json
    (written last) names `step`."""
    return checkpoint_damage(path) is None and (read_json(os.path.join(path, "state.json")) or {}).get("step") == step


def checkpoint_damage(path: str) -> str | None:
    """What makes checkpoint `path` unloadable, or None when it is whole, from each file's size and header (a few
    KiB read, no tensor): state.json parses and names its step and shapes, model.safetensors is as long as its
    header says and holds those shapes, the torch files end in a zip directory. The trainer's own check
    (trainer/state/checkpoint.py checkpoint_damage) is the same; this one runs in the agent, before any interpreter
    with torch, so a restart refuses a damaged checkpoint before it stops anything. Sizes and headers, not a
    digest: a cut or a lost file is what happens to checkpoints (a full disk, a killed copy), and a digest would
    read every byte (12.6 GB for an 8B drafter) at each commit and each check."""
    for name in CHECKPOINT_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{name} is missing"
    state = read_json(os.path.join(path, "state.json"))
    if state is None:
        return "state.json is cut short or not JSON"
    if not isinstance(state.get("step"), int):
        return "state.json lacks its step"
    weights = os.path.join(path, "model.safetensors")
    try:
        with open(weights, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            header_bytes = int.from_bytes(handle.read(8), "little")
            if header_bytes > size - 8:
                raise ValueError("header past the end")
            header = json.loads(handle.read(header_bytes))
        tensors = {k: t for k, t in header.items() if k != "__metadata__"}
        end = max((int(t["data_offsets"][1]) for t in tensors.values()), default=0)
        shapes = {k: list(t["shape"]) for k, t in tensors.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"model.safetensors has no readable header ({os.path.getsize(weights)} bytes)"
    if size != 8 + header_bytes + end:
        return f"model.safetensors is cut short ({size} of {8 + header_bytes + end} bytes)"
    recorded = state.get("shapes")  # every trainer checkpoint records them; compared where present
    if isinstance(recorded, dict) and shapes != {k: list(v) for k, v in recorded.items()}:
        return "model.safetensors holds other tensors than state.json records"
    for name in ("optimizer.pt", "rng.pt"):
        if not zipfile.is_zipfile(os.path.join(path, name)):
            return f"{name} is cut short or not a torch file ({os.path.getsize(os.path.join(path, name))} bytes)"
    return None


def last_good_checkpoint(path: str) -> str | None:
    """The newest whole checkpoint beside `path` (the same checkpoints/ folder), `path` itself excluded."""
    root = os.path.dirname(os.path.abspath(path))
    names = [n for n in os.listdir(root) if CHECKPOINT_RE.match(n)] if os.path.isdir(root) else []
    for name in sorted(names, key=lambda n: int(n[5:]), reverse=True):
        candidate = os.path.join(root, name)
        if name != os.path.basename(os.path.abspath(path)) and checkpoint_damage(candidate) is None:
            return candidate
    return None


def damaged(path: str, damage: str) -> str:
    """The `error:`/`hint:` lines for a damaged resume checkpoint: the file, and the last good checkpoint."""
    good = last_good_checkpoint(path)
    step = (good or "").rsplit("_", 1)[-1].lstrip("0") or "0"
    return f"error: checkpoint {path} cannot be loaded: {damage}; last good checkpoint: {good or 'none'}\n" + (
        f"hint: resume from that one: --checkpoint {step}" if good else "hint: no checkpoint of this run is whole"
    )


# A checkpoint held against deletion (the trainer keeps its newest N and deletes older ones while it runs): a
# folder of hard links beside it, `.hold-step_N-<agent pid>`. The files' data lives while a link does, so what
# the pre-flight checks and what the child resumes stays whole even when the run rotates the original away. No
# data is copied; the trainer's rotation, the agent's commits and `gc` look only at step_N and `.tmp-*` names.
HOLD_RE = re.compile(r"^\.hold-(step_\d{6,})-(\d+)$")
HOLD_NAME = re.compile(r"/\.hold-(step_\d{6,})-\d+$")  # a hold folder's path -> sub(r"/\1") -> its checkpoint


def hold_checkpoint(path: str) -> str | None:
    """Hard-link every file of checkpoint `path` into a hold folder beside it; return the folder, or None when
    the checkpoint went away meanwhile (rotated out) or the filesystem has no hard links. Holds whose agent died
    are removed first."""
    root, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        match = HOLD_RE.match(entry)
        if match and not alive(int(match.group(2))):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    hold = os.path.join(root, f".hold-{name}-{os.getpid()}")
    shutil.rmtree(hold, ignore_errors=True)
    try:
        os.mkdir(hold)
        for entry in os.listdir(path):
            os.link(os.path.join(path, entry), os.path.join(hold, entry))
    except OSError:
        shutil.rmtree(hold, ignore_errors=True)
        return None
    if not os.path.isfile(os.path.join(hold, "state.json")):  # rotated out between the listing and the links
        shutil.rmtree(hold, ignore_errors=True)
        return None
    return hold


def restore_held(hold: str | None, path: str) -> bool:
    """Put a held checkpoint back under its name when the run's rotation deleted it meanwhile (the run has
    stopped by then, so nothing deletes it again); True when it was put back."""
    if hold is None or os.path.isfile(os.path.join(path, "state.json")) or not os.path.isdir(hold):
        return False
    shutil.rmtree(path, ignore_errors=True)  # a rotation's half-done rmtree
    os.rename(hold, path)
    return True


def release_hold(hold: str | None) -> None:
    """Remove a hold folder (its links only: the checkpoint's own files stay while it has its own)."""
    if hold is not None:
        shutil.rmtree(hold, ignore_errors=True)


def fsync_folder(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
