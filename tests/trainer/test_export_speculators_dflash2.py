"""export --format speculators of a DFlash2 drafter: speculators 0.9's own `DFlash2DraftModel` loads it with no
missing or unexpected key, and on a fixed batch gives our draft logits and our candidate selector's scores.

Same target, batch and subprocess as test_export_speculators.py (the demo's 4-layer shape, taps [0, 3]); the
drafter's convolutions are moved off their identity initialisation, so a wrong tap order, group layout or kernel
side would show in the logits.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.speculators_env import speculators_env, speculators_python
from tests.trainer.test_export_speculators import ANCHORS, BLOCK, FORWARD, checkpoint, fixed_batch, target  # noqa: F401
from tests.trainer.tiny import tiny_drafter_config
from trainer.export import export as export_cli
from trainer.export.export_speculators import speculators_tensor_names
from trainer.model.dflash2 import block_predecessors
from trainer.model.drafter import DFlashDrafter, make_block_input_ids
from trainer.model.target import TargetModel

# float32 CPU on both sides, the same torch; measured on the 2-core test machine: logits and selector scores within
# ~1e-7 (their sizes up to ~1). The tolerance is the DFlash test's, for the same reasons.
ATOL = 1e-5
TOP_K, RANK = 8, 16


@pytest.fixture(scope="module")
def drafter2(target: tuple[TargetModel, Path]) -> DFlashDrafter:  # noqa: F811
    torch.manual_seed(0)
    config = dataclasses.replace(
        tiny_drafter_config(target[0], num_hidden_layers=2, block_size=BLOCK),
        arch="dflash2",
        selector_top_k=TOP_K,
        selector_rank=RANK,
    )
    model = DFlashDrafter(config).eval()
    with torch.no_grad():  # off the identity: non-trivial norms, both kernel sides and taps, a live projection
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "_conv." in name:
                param.add_(torch.randn_like(param) * 0.1)
            if name.startswith("candidate_selector."):
                param.mul_(30.0)  # transition scores of the logits' size, so a wrong one changes the ranking
    return model


def our_outputs(model: DFlashDrafter, tiny: TargetModel, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our logits [1,N*B,V], and the selector's candidates and scores [1,N*B,k] (teacher-forced predecessors)."""
    anchors = torch.tensor([ANCHORS])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    ids = make_block_input_ids(batch["input_ids"], anchors, BLOCK, model.config.mask_token_id)
    positions = anchors[:, :, None] + torch.arange(BLOCK)
    labels = batch["input_ids"][0, positions.reshape(-1)].view(1, -1)
    selector = model.candidate_selector
    assert selector is not None
    with torch.no_grad():
        hidden = model(batch["hidden_states"], tiny.embed_weight[ids], anchors, keep, "dense")
        logits = hidden @ tiny.lm_head_weight.T
        unary, candidates = logits.topk(TOP_K, dim=-1)
        scores = unary + selector.transition(hidden, block_predecessors(ids, labels, BLOCK), candidates)
    return {"logits": logits, "candidates": candidates, "candidate_scores": scores}


@pytest.mark.timeout(900)
def test_speculators_loads_our_dflash2_export_and_gives_our_logits_and_selector_scores(drafter2, target, tmp_path):  # noqa: F811
    target_model, target_dir = target
    step = checkpoint(tmp_path / "run", drafter2, target_dir)
    out = tmp_path / "spec"
    assert export_cli.main([str(step), "--output", str(out), "--format", "speculators"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert (config["conv_kernel_size"], config["conv_group_size"]) == (2, 16)
    assert (config["selector_rank"], config["selector_top_k"]) == (RANK, TOP_K)
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = sorted(handle.keys())
    assert names == sorted(speculators_tensor_names(2, "dflash2")) and len(names) == 28 + 2 * 4 + 3

    batch = fixed_batch(target_model)
    torch.save(batch, tmp_path / "batch.pt")
    done = subprocess.run(
        [str(speculators_python()), str(FORWARD), str(out), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        env=speculators_env(),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["loading_info"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }

    ours = our_outputs(drafter2, target_model, batch)
    slots = torch.arange(BLOCK * len(ANCHORS)) % BLOCK != 0
    for how in ("alone", "filled"):
        theirs = result[how]
        assert set(theirs["model_keys"]) - set(result["file_keys"]) == {"verifier_lm_head.weight"}, how
        assert theirs["anchors"].tolist() == ANCHORS
        for key in ("logits", "candidate_scores"):
            diff = (theirs[key] - ours[key]).abs().max().item()
            print(f"{how} {key}: max |difference| speculators vs ours {diff:.3g} (scale {ours[key].abs().max():.3g})")
            assert theirs[key].shape == ours[key].shape and diff <= ATOL, (how, key)
        assert torch.equal(theirs["candidates"][0, slots], ours["candidates"][0, slots]), how
    # control: the selector changes the pick somewhere (so the score comparison tests something) ...
    reranked = ours["candidates"].gather(-1, ours["candidate_scores"].argmax(-1, keepdim=True)).squeeze(-1)
    assert (reranked[0, slots] != ours["logits"][0, slots].argmax(-1)).any()
    # ... and the convolutions matter: with them reset to the identity our logits move far past the tolerance
    plain = DFlashDrafter(drafter2.config).eval()
    plain.load_state_dict(drafter2.state_dict())
    for layer in plain.layers:
        layer.attention_conv.reset_parameters()
        layer.mlp_conv.reset_parameters()
    assert (our_outputs(plain, target_model, batch)["logits"] - ours["logits"]).abs().max().item() > 1e3 * ATOL
