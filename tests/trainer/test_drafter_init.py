"""`--drafter-init target` (trainer/model/drafter.py start_from_target): the drafter starts as the target's layers
after its deepest tap, and its context's keys and values are then that layer's own; both engines apply it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny import tiny_train_config
from trainer.core.config import parse_train_args
from trainer.model import DFlashDrafter, TargetModel
from trainer.model.drafter import embed_context, start_from_target
from trainer.pipeline_run import run_pipeline
from trainer.train import EXIT_OK
from trainer.train import run as run_single
from trainer.training.preflight import build_drafter_config, target_hf_config

pytestmark = pytest.mark.timeout(180)

# A 4-layer tiny target, two draft layers tapping layers 0 and 1: they start as its layers 2 and 3.
FLAGS = ("--num-target-layers", "4", "--num-draft-layers", "2", "--target-layer-ids", "0,1")


def tiny_pair(*extra: str) -> tuple[TargetModel, DFlashDrafter]:
    cfg = parse_train_args(["--preset", "tiny", *FLAGS, *extra])
    assert cfg.tiny_target is not None
    cfg.tiny_target = {**cfg.tiny_target, "num_hidden_layers": 4}
    hf_config = target_hf_config(cfg)
    config = build_drafter_config(cfg, hf_config)
    target = TargetModel.from_config(hf_config, config.target_layer_ids, seed=1, dtype=torch.float32)
    torch.manual_seed(0)
    return target, DFlashDrafter(config)


def test_the_drafter_starts_as_the_target_layers_after_its_deepest_tap() -> None:
    target, drafter = tiny_pair("--drafter-init", "target")
    line = start_from_target(drafter, target)
    assert line == "drafter init: the target's layers 2-3 and final norm; fc reads tap 1 (--drafter-init target)"
    for i, layer in enumerate(drafter.layers):
        theirs = dict(target.layer(2 + i).named_parameters())
        for name, ours in layer.named_parameters():
            if name in theirs:  # all of a Qwen3 layer's, its q/k norms too
                assert torch.equal(ours, theirs[name]), (i, name)
        assert len(theirs) == 11 and all(name in dict(layer.named_parameters()) for name in theirs)
    assert torch.equal(drafter.norm.weight, target.final_norm.weight)

    # The context's keys and values in draft layer 0 are the target's layer 2 keys and values of the same positions.
    ids = torch.randint(0, 250, (2, 12))
    out = target.features(ids)
    hidden = out.taps[..., 64:]  # tap 1: the output of layer 1, the input of layer 2
    layer, source = drafter.layers[0], target.layer(2)
    ctx = embed_context(drafter.fc, drafter.hidden_norm, out.taps)
    normed = source.input_layernorm(hidden)
    for proj, norm in (("k_proj", "k_norm"), ("v_proj", None)):
        ours = getattr(layer.self_attn, proj)(ctx).view(2, 12, 2, 16)
        theirs = getattr(source.self_attn, proj)(normed).view(2, 12, 2, 16)
        if norm is not None:
            ours, theirs = getattr(layer.self_attn, norm)(ours), getattr(source.self_attn, norm)(theirs)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_random_init_differs_from_the_target_start() -> None:
    """The control: without the flag the drafter's weights are its own (the test above could not pass by chance)."""
    target, drafter = tiny_pair()
    assert not torch.equal(drafter.layers[0].self_attn.q_proj.weight, target.layer(2).self_attn.q_proj.weight)


@pytest.mark.parametrize("engine", ["single", "pipeline"])
def test_both_engines_start_from_the_target_and_train(
    tmp_path: Path, engine: str, capfd: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    extra = ("--pipeline",) if engine == "pipeline" else ()
    run = run_pipeline if engine == "pipeline" else run_single
    flags = ("--num-draft-layers", "1", "--target-layer-ids", "0", "--drafter-init", "target", "--max-steps", "2")
    cfg = tiny_train_config(tmp_path / "run", *extra, *flags)
    assert run(cfg) == EXIT_OK
    err = capfd.readouterr().err
    assert "drafter init: the target's layer 1 and final norm; fc reads tap 0 (--drafter-init target)" in err, err
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
