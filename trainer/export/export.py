"""`python -m trainer export CHECKPOINT --output DIR [--format zlab|speculators]`: a training checkpoint -> a
drafter that public loaders read.

`--format zlab` (the default, the public DFlash format): the output directory holds exactly `config.json` (a Qwen3 config + `architectures: ["DFlashDraftModel"]`,
`block_size`, `num_target_layers`, `dflash_config`, `layer_types`, `sliding_window`; DrafterConfig.to_hf_dict)
and `model.safetensors` with the public tensor names (11 per layer + norm, fc, hidden_norm; no embedding, no
LM head), which public DFlash loaders and `trainer train --init-from DIR` read. It is written to a temporary
sibling directory and renamed, so DIR is either complete or absent; an existing non-empty DIR is refused.

`--format speculators`: what vLLM's `speculators` library loads (trainer/export/export_speculators.py): a
`DFlashSpeculatorConfig` whose `aux_hidden_state_layer_ids` are our tap ids + 1, and the same drafter tensors plus
the target's embedding, LM head and final norm, read from `--target-model` (default: the run's recorded
`target_model`; a tiny-preset run, whose target was built from its config, gets that target rebuilt from the
recorded config and seed on the device it trained on). Both forms say the same thing about a tap: docs/method.md#export-formats.

CHECKPOINT is a `checkpoints/step_NNNNNN` directory (trainer/state/checkpoint.py) or a run directory (its newest
complete checkpoint is used). The drafter's shape comes from `drafter_config` in the checkpoint's state.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from trainer.core.run_files import CHECKPOINT_PREFIX, CHECKPOINTS
from trainer.data.tokenizer_utils import DataInputError
from trainer.export.export_names import public_tensor_names
from trainer.export.export_speculators import (
    TargetParts,
    save_speculators,
    speculators_tensor_names,
    target_parts_from_dir,
    target_parts_from_model,
)
from trainer.model.drafter import CONFIG_NAME, WEIGHTS_NAME, DFlashDrafter, DrafterConfig
from trainer.state.checkpoint import checkpoint_damage, last_good_checkpoint

FORMATS = ("zlab", "speculators")


def drafter_config_from_dict(raw: dict[str, Any]) -> DrafterConfig:
    """Either the public HF form (has `dflash_config`) or a plain DrafterConfig field dict."""
    if "dflash_config" in raw:
        return DrafterConfig.from_hf_dict(raw)
    fields = {k: v for k, v in raw.items() if k in DrafterConfig.__dataclass_fields__}
    return DrafterConfig(**fields)


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory as given, or the newest complete `checkpoints/step_*` of a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise DataInputError(f"checkpoint {path} does not exist")
    if (path / CHECKPOINTS).is_dir() and not (path / "state.json").exists():
        complete = sorted(p for p in (path / CHECKPOINTS).glob(f"{CHECKPOINT_PREFIX}*") if (p / "state.json").is_file())
        if not complete:
            raise DataInputError(
                f"run directory {path} holds no complete checkpoint",
                hint="a checkpoint is complete once its state.json exists; train longer or pass a step directory",
            )
        return complete[-1]
    return path


# What export reads of a checkpoint: the weights and the config. A lost optimizer.pt or rng.pt is no reason to
# refuse an export (train --resume refuses it: it needs them).
EXPORT_READS = ("state.json", "model.safetensors")


def load_training_checkpoint(path: str | Path) -> DFlashDrafter:
    """The drafter stored in a training checkpoint; DataInputError for an incomplete, damaged (checkpoint_damage:
    state.json and model.safetensors by size and header) or inconsistent one."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    step_dir = resolve_checkpoint(path)
    state_file, weights = step_dir / "state.json", step_dir / WEIGHTS_NAME
    if not state_file.is_file():
        raise DataInputError(
            f"checkpoint {step_dir} is incomplete: no state.json (the save did not finish)",
            hint="export a complete checkpoints/step_NNNNNN directory, or the run directory",
        )
    damage = checkpoint_damage(step_dir, EXPORT_READS)
    if damage is not None:  # one line naming the file and the last good checkpoint, not a parser's traceback
        good = last_good_checkpoint(step_dir, EXPORT_READS)
        raise DataInputError(
            f"checkpoint {step_dir} cannot be exported: {damage}; last good checkpoint: {good or 'none'}",
            hint=f"export that one: python -m trainer export {good} --output DIR"
            if good
            else "no other checkpoint of this run is whole",
        )
    state = json.loads(state_file.read_text())
    if not isinstance(state.get("drafter_config"), dict):
        raise DataInputError(f"checkpoint {step_dir}: state.json has no drafter_config; cannot rebuild the drafter")
    try:
        config = drafter_config_from_dict(state["drafter_config"])
        tensors = load_file(str(weights))
    except (ValueError, TypeError, SafetensorError) as exc:
        raise DataInputError(f"checkpoint {step_dir} is unreadable: {exc}") from None
    drafter = DFlashDrafter(config)
    expected = set(drafter.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise DataInputError(
            f"checkpoint {step_dir} is incomplete or of another model: "
            f"missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    wrong = [n for n, t in drafter.state_dict().items() if tuple(tensors[n].shape) != tuple(t.shape)]
    if wrong:
        raise DataInputError(
            f"checkpoint {step_dir}: {wrong[0]} has shape {tuple(tensors[wrong[0]].shape)}, "
            f"its drafter_config says {tuple(drafter.state_dict()[wrong[0]].shape)}"
        )
    drafter.load_state_dict(tensors)
    return drafter


def current_umask() -> int:
    """This process's umask, read without changing it where Linux tells (/proc/self/status, Linux >= 4.7);
    elsewhere by setting and restoring it (os.umask has no read-only form)."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def recorded_target_model(path: str | Path) -> str | None:
    """The `target_model` directory the checkpoint's run trained against (state.json `config`), or None when the
    run built its target from the tiny preset's config or the checkpoint does not record it."""
    state = json.loads((resolve_checkpoint(path) / "state.json").read_text())
    value = (state.get("config") or {}).get("target_model")
    return str(value) if value else None


def rebuilt_tiny_target(path: str | Path) -> tuple[TargetParts, str] | None:
    """(the target's parts, a verifier label) of a tiny-preset run, whose target was never a directory: built from
    the recorded `tiny_target` config and seed on the device the run's rule picks here (--target-gpus, else cuda:0
    when there is a GPU, else the CPU), which is the training's own device when the export runs where the run
    trained (fetch --export does). None when the checkpoint's run had a target directory or records no config."""
    state = json.loads((resolve_checkpoint(path) / "state.json").read_text())
    raw = state.get("config") or {}
    if raw.get("target_model") or not raw.get("tiny_target"):
        return None
    from trainer.core.config import TrainConfig
    from trainer.model.target import TargetModel
    from trainer.training.preflight import first_device, target_hf_config

    cfg = TrainConfig.from_dict(raw)
    device = first_device(cfg.target_gpus)
    built = TargetModel.from_config(target_hf_config(cfg), [0], seed=cfg.seed, dtype=torch.float32, device=device)
    return target_parts_from_model(built.model), f"tiny-preset target (seed {cfg.seed}, built on {device.type})"


def export_drafter(
    drafter: DFlashDrafter,
    output: str | Path,
    *,
    format: str = "zlab",
    target_model: str | Path | None = None,
    verifier: str | None = None,
    target_parts: TargetParts | None = None,
) -> Path:
    """Write `drafter` in `format` (FORMATS) to `output` atomically; refuse a non-empty existing `output`.
    The speculators form needs `target_model` (a local HF directory: its embedding, LM head and final norm are
    copied in) and records `verifier` (default: `target_model` as given) as the verifier's name_or_path.
    Every file gets the mode the process umask gives a new file (0o666 & ~umask: 0644 under umask 022)."""
    if format not in FORMATS:
        raise DataInputError(f"unknown export format {format!r}", hint=f"choose one of {', '.join(FORMATS)}")
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DataInputError(
            f"export output {output} already exists and is not empty",
            hint="choose a new --output directory (an export is never overwritten)",
        )
    names = sorted(drafter.state_dict())
    if names != sorted(public_tensor_names(drafter.config.num_hidden_layers, drafter.config.arch)):
        raise DataInputError(f"drafter tensor names differ from the public DFlash names: {names[:3]} ...")
    parts = target_parts if target_model is None else None
    if format == "speculators":
        if target_model is None and parts is None:
            raise DataInputError(
                "--format speculators copies the target's embedding, LM head and final norm into the export, "
                "and this checkpoint's run records no target model directory",
                hint="pass --target-model DIR (the local Hugging Face directory of the target)",
            )
        if parts is None:
            assert target_model is not None
            parts = target_parts_from_dir(target_model)  # read (and shape-checked) before anything is written
        parts.check(drafter.config)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if parts is None:
        drafter.save_pretrained(tmp)
    else:
        save_speculators(drafter, parts, tmp, verifier=verifier if verifier is not None else str(target_model))
    # safetensors writes through a private temporary file, so model.safetensors comes out 0600. An export is
    # meant to be copied to serving machines and read by their users: give every file the mode a normal new
    # file gets under this process's umask (0644 under umask 022), before the rename publishes the directory.
    mode = 0o666 & ~current_umask()
    for path in tmp.iterdir():
        os.chmod(path, mode)
    if output.exists():
        output.rmdir()  # empty (checked above)
    os.replace(tmp, output)
    return output


def load_drafter(directory: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
    """A public-format drafter directory (ours or a published one) -> DFlashDrafter; DataInputError if invalid."""
    directory = Path(directory)
    if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
        raise DataInputError(
            f"{directory} is not an exported drafter (needs {CONFIG_NAME} and {WEIGHTS_NAME})",
            hint="run `python -m trainer export CHECKPOINT --output DIR` first",
        )
    try:
        return DFlashDrafter.from_pretrained(directory, device=device).eval()
    except (ValueError, json.JSONDecodeError) as exc:
        raise DataInputError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoints/step_NNNNNN directory, or a run directory (newest checkpoint)")
    parser.add_argument("--output", required=True, help="new directory for config.json + model.safetensors")
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="zlab",
        help="zlab: the public DFlash format (drafter tensors only); speculators: vLLM speculators' DFlash "
        "format, with the target's embedding, LM head and final norm (default: zlab)",
    )
    parser.add_argument(
        "--target-model",
        metavar="DIR",
        help="speculators only: the target's local HF directory (default: the run's recorded --target-model)",
    )
    parser.add_argument(
        "--verifier",
        metavar="NAME_OR_PATH",
        help="speculators only: the verifier name_or_path written into the config, e.g. Qwen/Qwen3-8B, so that "
        "loaders on other machines find the target (default: the --target-model directory)",
    )
    args = parser.parse_args(argv)
    try:
        if args.format != "speculators" and (args.target_model or args.verifier):
            raise DataInputError(
                "--target-model and --verifier only apply to --format speculators",
                hint="add --format speculators, or drop them",
            )
        drafter = load_training_checkpoint(args.checkpoint)
        target, rebuilt, verifier = args.target_model, None, args.verifier
        if args.format == "speculators" and target is None:
            target = recorded_target_model(args.checkpoint)
            tiny = rebuilt_tiny_target(args.checkpoint) if target is None else None
            if tiny is not None:
                rebuilt, label = tiny
                verifier = verifier if verifier is not None else label
        out = export_drafter(
            drafter, args.output, format=args.format, target_model=target, verifier=verifier, target_parts=rebuilt
        )
    except DataInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    layers, arch = drafter.config.num_hidden_layers, drafter.config.arch
    names = (
        speculators_tensor_names(layers, arch) if args.format == "speculators" else public_tensor_names(layers, arch)
    )
    count = len(names)
    print(f"exported {count} tensors ({args.format} format) to {out}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
