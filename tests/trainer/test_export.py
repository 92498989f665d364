"""export: real training checkpoints (trainer/state/checkpoint.py) -> public DFlash format -> load -> same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.tiny import build_tiny_target, tiny_drafter_config
from trainer.export import export as export_cli
from trainer.model.drafter import DFlashDrafter
from trainer.state.checkpoint import save_checkpoint


@pytest.fixture(scope="module")
def drafter() -> DFlashDrafter:
    torch.manual_seed(0)
    target = build_tiny_target()
    model = DFlashDrafter(tiny_drafter_config(target, num_hidden_layers=2, block_size=4))
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm tensor would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_training_checkpoint(run_dir: Path, model: DFlashDrafter, step: int = 5, config: dict | None = None) -> Path:
    """A training checkpoint as the trainer writes it; `config`: the run's config recorded in it (none: omitted)."""
    return save_checkpoint(
        run_dir,
        step,
        model=model.state_dict(),
        optimizer={},
        scheduler={},
        epoch=0,
        index=0,
        extra={"drafter_config": model.config.to_hf_dict(), **({"config": config} if config is not None else {})},
        keep=3,
    )


def drafter_outputs(model: DFlashDrafter) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    cfg = model.config
    ctx = torch.randn(1, 6, cfg.num_taps * cfg.hidden_size, generator=generator)
    block = torch.randn(1, 2 * cfg.block_size, cfg.hidden_size, generator=generator)
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    with torch.no_grad():
        return model(ctx, block, anchors, keep, model.build_mask(anchors, keep, 6))


def test_export_round_trip_public_format(drafter, tmp_path, capsys):
    step_dir = save_training_checkpoint(tmp_path / "run", drafter)
    out = tmp_path / "export"
    assert export_cli.main([str(step_dir), "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["num_hidden_layers"] == 2 and config["block_size"] == 4 and config["num_target_layers"] == 2
    assert config["dflash_config"]["target_layer_ids"] == [0, 1] and config["dflash_config"]["block_size"] == 4
    assert config["dflash_config"]["mask_token_id"] == 255
    assert config["layer_types"] == ["full_attention"] * 2 and "sliding_window" in config
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = sorted(handle.keys())
    assert len(names) == 25 and names == sorted(export_cli.public_tensor_names(2))
    assert not any("embed" in n or "lm_head" in n for n in names)
    loaded = export_cli.load_drafter(out)
    assert torch.equal(drafter_outputs(loaded), drafter_outputs(drafter))
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_export_of_a_run_directory_takes_the_newest_checkpoint(drafter, tmp_path):
    run = tmp_path / "run"
    save_training_checkpoint(run, DFlashDrafter(drafter.config), step=1)
    save_training_checkpoint(run, drafter, step=2)
    assert export_cli.main([str(run), "--output", str(tmp_path / "e")]) == 0
    assert torch.equal(drafter_outputs(export_cli.load_drafter(tmp_path / "e")), drafter_outputs(drafter))


def test_incomplete_checkpoints_are_refused(drafter, tmp_path, capsys):
    step_dir = save_training_checkpoint(tmp_path / "run", drafter)
    (step_dir / "state.json").unlink()
    assert export_cli.main([str(step_dir), "--output", str(tmp_path / "a")]) == 2
    assert "is incomplete: no state.json" in capsys.readouterr().err and not (tmp_path / "a").exists()

    step_dir = save_training_checkpoint(tmp_path / "run2", drafter)
    (step_dir / "model.safetensors").unlink()
    assert export_cli.main([str(step_dir), "--output", str(tmp_path / "b")]) == 2
    assert "model.safetensors is missing" in capsys.readouterr().err and not (tmp_path / "b").exists()

    from safetensors.torch import save_file

    step_dir = save_training_checkpoint(tmp_path / "run3", drafter)
    partial = {k: v for k, v in drafter.state_dict().items() if k != "fc.weight"}
    save_file(partial, str(step_dir / "model.safetensors"))
    assert export_cli.main([str(step_dir), "--output", str(tmp_path / "c")]) == 2
    assert "missing ['fc.weight']" in capsys.readouterr().err and not (tmp_path / "c").exists()

    (tmp_path / "empty-run" / "checkpoints").mkdir(parents=True)
    assert export_cli.main([str(tmp_path / "empty-run"), "--output", str(tmp_path / "d")]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err


def test_existing_output_is_never_overwritten(drafter, tmp_path, capsys):
    step_dir = save_training_checkpoint(tmp_path / "run", drafter)
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export_cli.main([str(step_dir), "--output", str(out)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_load_drafter_of_a_non_export(tmp_path):
    with pytest.raises(export_cli.DataInputError, match="is not an exported drafter"):
        export_cli.load_drafter(tmp_path)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_item23_exported_files_get_the_umask_mode_of_a_new_file(drafter, tmp_path, umask, mode):
    """Exports are copied to serving machines: not 0600 (safetensors' private temporary file) but what the
    process umask gives any new file. A real `python -m trainer export` process, started with that umask."""
    import os
    import stat
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    step_dir = save_training_checkpoint(tmp_path / "run", drafter)
    out = tmp_path / "export"
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "export", str(step_dir), "--output", str(out)],
        capture_output=True,
        text=True,
        cwd=repo,
        umask=umask,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert done.returncode == 0, done.stderr
    files = sorted(out.iterdir())
    assert [p.name for p in files] == ["config.json", "model.safetensors"]
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(mode) for p in files}
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
