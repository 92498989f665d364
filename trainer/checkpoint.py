"""Checkpoints: `<run>/checkpoints/step_NNNNNN/`, written to a temporary directory and renamed.

A checkpoint directory holds
    model.safetensors   the drafter's trainable weights, public DFlash tensor names
    optimizer.pt        AdamW state (torch.save)
    rng.pt              torch / numpy / python RNG states (and CUDA's, when present)
    state.json          step, data position (epoch, index: the next micro-batch), scheduler state, the run's
                        config, the drafter config and every tensor's shape — written LAST, so a directory
                        without it is incomplete and ignored.
The rename is atomic on one filesystem, so a reader sees either the whole checkpoint or none; a crash
mid-save leaves only a `.tmp-*` directory, which the next save removes. Only the newest `keep` complete
checkpoints are kept; nothing outside `<run>/checkpoints/` is ever touched.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from trainer.config import TrainerInputError

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


@dataclass
class CheckpointState:
    """What `load_checkpoint` returns; tensors are on the CPU."""

    path: Path
    step: int
    epoch: int
    index: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]


def checkpoints_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


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
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, *, model: dict[str, torch.Tensor], optimizer: dict[str, Any],
                    scheduler: dict[str, Any], epoch: int, index: int, extra: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically, prune to the newest `keep`; return its directory."""
    root = checkpoints_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # a crash during an earlier save
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    tmp.mkdir()
    cpu_model = {name: tensor.detach().to("cpu").contiguous() for name, tensor in model.items()}
    save_file(cpu_model, str(tmp / "model.safetensors"))
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    state = {"step": step, "epoch": epoch, "index": index, "scheduler": scheduler,
             "shapes": {name: list(t.shape) for name, t in cpu_model.items()}, **extra}
    (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json"):
        with open(tmp / name, "rb") as handle:
            os.fsync(handle.fileno())
    if final.exists():  # the same step saved again (e.g. a stop right after a resume): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict[str, Any]:
    """state.json of a checkpoint directory (cheap: no tensors), or a TrainerInputError."""
    state_file = Path(path) / "state.json"
    if not state_file.is_file():
        raise TrainerInputError(f"--resume: {path} is not a complete checkpoint (no state.json)",
                                hint="point --resume at a checkpoints/step_NNNNNN directory")
    return json.loads(state_file.read_text())


def check_shapes(path: Path, expected: dict[str, list[int]]) -> None:
    """Refuse a checkpoint whose tensors differ in name or shape from the drafter being trained."""
    saved: dict[str, list[int]] = read_state(path)["shapes"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if missing or unexpected:
        what = f"lacks {missing[0]}" if missing else f"has an extra tensor {unexpected[0]}"
        raise TrainerInputError(f"checkpoint {path} is of a different drafter shape: it {what}",
                                hint="resume with the flags it was trained with (e.g. --num-draft-layers), or use a new --output-dir")
    for name, shape in expected.items():
        if list(saved[name]) != list(shape):
            raise TrainerInputError(
                f"checkpoint {path} is of a different drafter shape: {name} is {saved[name]} there, {list(shape)} here",
                hint="resume with the flags it was trained with, or use a new --output-dir")


def load_checkpoint(path: Path) -> CheckpointState:
    """Load every part of a checkpoint onto the CPU."""
    state = read_state(path)
    extra = {k: v for k, v in state.items() if k not in ("step", "epoch", "index", "scheduler", "shapes")}
    return CheckpointState(
        path=Path(path), step=int(state["step"]), epoch=int(state["epoch"]), index=int(state["index"]),
        model=load_file(str(Path(path) / "model.safetensors")),
        optimizer=torch.load(Path(path) / "optimizer.pt", weights_only=False),
        scheduler=state["scheduler"], rng=torch.load(Path(path) / "rng.pt", weights_only=False), extra=extra,
    )


def resolve_resume(resume: str, run_dir: Path) -> Path | None:
    """--resume auto: newest complete checkpoint of run_dir (or None); never: None, but refuse to start over
    a run directory that has checkpoints (nothing gets overwritten); otherwise the given directory."""
    existing = list_checkpoints(run_dir)
    if resume == "auto":
        return existing[-1][1] if existing else None
    if resume == "never":
        if existing:
            raise TrainerInputError(f"--resume never: {run_dir} already holds checkpoints",
                                    hint="use a new --output-dir, or --resume auto to continue that run")
        return None
    path = Path(resume)
    read_state(path)
    return path
