"""`dflashops fetch RUN --export --format speculators` typed as a user would, on a run of the real trainer's tiny
preset (its target built from a config, never a directory): the export rebuilds that target from the run's
recorded config and seed, and its embedding, LM head and final norm are the very tensors the run trained against.
`--target-model`/`--verifier` reach `trainer export`; given without `--format speculators` they are refused."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.controller.helpers import Env

TINY = """\
  tiny:
    argv: ["{python}", -m, trainer, train, --preset, tiny, --output-dir, "{run_dir}", --max-steps, "2",
           --save-interval, "2", --wandb, "off"]
"""


def test_speculators_export_of_a_tiny_run(env: Env, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from trainer.core.config import parse_train_args
    from trainer.training.preflight import load_target, preflight

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    env.inventory.write_text(env.inventory.read_text() + TINY)
    code, _, err = env.cli("deploy", "--profile", "tiny", "--name", "t1", "--launcher", "nohup", capsys=capsys)
    assert code == 0, err
    assert env.cli("logs", "t1", "-f", "--timeout", "120", capsys=capsys)[0] == 0
    dest = tmp_path / "here"
    code, out, err = env.cli("fetch", "t1", "--export", "--format", "speculators", "--to", str(dest), capsys=capsys)
    assert code == 0, err
    spec = dest / "export/step_000002-speculators"
    assert out.strip() == str(dest) and sorted(p.name for p in spec.iterdir()) == ["config.json", "model.safetensors"]
    # the rate is the transfer's, not over the export's seconds too (that said `0 MiB/s` for a ~1 MB fetch)
    said = re.search(r"bytes sent in (\d+\.\d) s \((\d+\.\d) s in all, the export included\), [\d.]+ \w+/s\)", err)
    assert said and float(said.group(1)) < float(said.group(2)), err
    assert (
        "tiny-preset target (seed 0"
        in json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    )
    tensors = load_file(str(spec / "model.safetensors"))
    state = json.loads((env.runs / "t1/checkpoints/step_000002/state.json").read_text())
    cfg = parse_train_args(
        ["--preset", "tiny", "--output-dir", str(tmp_path / "x"), "--seed", str(state["config"]["seed"])]
    )
    trained = load_target(
        preflight(cfg, reads_checkpoints=False)
    )  # the target the run built, built again as the trainer builds it
    assert torch.equal(tensors["embed_tokens.weight"], trained.embed_weight)
    assert torch.equal(tensors["lm_head.weight"], trained.lm_head_weight)

    # the options `trainer export` takes reach it; a target directory that is not one is the trainer's own error
    code, _, err = env.cli(
        "fetch", "t1", "--export", "--format", "speculators", "--checkpoint", "2", "--target-model",
        str(tmp_path / "nomodel"), "--verifier", "Org/Tiny", "--dry-run", capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    code, out, err = env.cli("fetch", "t1", "--export", "--target-model", str(tmp_path), capsys=capsys)
    assert (code, out) == (2, "") and err.startswith("error: --target-model and --verifier apply to the speculators")
    assert "\nhint: " in err


def test_a_relative_target_model_is_recorded_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's config is what `trainer export` reads the target directory from, later and from another
    folder (fetch runs it from the agent's): `--target-model models/t` is recorded as the absolute path."""
    from trainer.core.config import parse_train_args

    monkeypatch.chdir(tmp_path)
    cfg = parse_train_args(["--preset", "tiny", "--target-model", "models/t", "--output-dir", "run"])
    assert cfg.to_dict()["target_model"] == str(tmp_path / "models/t")
