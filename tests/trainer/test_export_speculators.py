"""export --format speculators: vLLM speculators' own loader reads it with no missing or unexpected key, and its
forward gives our drafter's draft logits; the z-lab form of the same checkpoint says the same about every tap.

The target is the tiny demo's shape, 4 layers with taps [0, 3]: layer 3 is the last one, the tap that speculators
0.9's own z-lab converter drops by default. speculators runs in its own environment (speculators_env.py: built on
a machine's first use, 13-95 s), in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.trainer.speculators_env import SPECULATORS_VERSION, speculators_env, speculators_python
from tests.trainer.test_export import save_training_checkpoint
from tests.trainer.tiny import build_tiny_target, tiny_drafter_config
from trainer.export import export as export_cli
from trainer.export.export_speculators import speculators_layer_ids, speculators_tensor_names
from trainer.model.drafter import DFlashDrafter, make_block_input_ids
from trainer.model.target import TargetModel

# float32 on the CPU, both sides, the same torch. Measured: 0 (bit for bit equal, logits up to ~0.6 in size) on this
# project's 2-core x86 test machine; the tolerance leaves room for another op order (HF's Qwen3RMSNorm and RoPE,
# speculators' SDPA call, against ours) on other CPUs, three orders of magnitude under the swapped-tap control below.
LOGIT_ATOL = 1e-5
CONTEXT, ANCHORS, BLOCK = 24, [0, 5, 11, 17], 4
FORWARD = Path(__file__).with_name("speculators_forward.py")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, Path]:
    model = build_tiny_target(seed=3, num_hidden_layers=4)
    assert model.layer_ids == [0, 3]  # the demo's taps: the first and the last layer
    directory = tmp_path_factory.mktemp("target")
    model.model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def drafter(target: tuple[TargetModel, Path]) -> DFlashDrafter:
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_drafter_config(target[0], num_hidden_layers=2, block_size=BLOCK)).eval()
    with torch.no_grad():  # non-trivial norms, so a dropped or swapped norm tensor would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def checkpoint(run_dir: Path, model: DFlashDrafter, target_dir: Path | None, step: int = 5) -> Path:
    """A training checkpoint whose state.json records the run's target_model, as the trainer writes it."""
    return save_training_checkpoint(run_dir, model, step, config={"target_model": target_dir and str(target_dir)})


def fixed_batch(target: TargetModel) -> dict[str, torch.Tensor]:
    """Real tapped features of random text; loss_mask 1 exactly at the anchors (each >= B before the end)."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 255, (1, CONTEXT), generator=generator)  # 255 is the MASK id
    loss_mask = torch.zeros(1, CONTEXT, dtype=torch.long)
    loss_mask[0, ANCHORS] = 1
    return {
        "hidden_states": target.features(input_ids).taps,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "num_anchors": torch.tensor(len(ANCHORS)),
    }


def our_logits(model: DFlashDrafter, target: TargetModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """[1,N*B,V]: our drafter's forward on the batch, through the target's LM head (every slot, anchor included)."""
    anchors = torch.tensor([ANCHORS])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    ids = make_block_input_ids(batch["input_ids"], anchors, BLOCK, model.config.mask_token_id)
    with torch.no_grad():
        hidden = model(batch["hidden_states"], target.embed_weight[ids], anchors, keep, "dense")
        return hidden @ target.lm_head_weight.T


# The first run in a fresh clone builds the speculators environment inside this test (95 s measured with an empty
# pip cache, more on a slow link): past pytest's default 300 s limit is possible there, so this test gets more.
@pytest.mark.timeout(900)
def test_speculators_loads_our_export_strictly_and_gives_our_draft_logits(drafter, target, tmp_path):
    target_model, target_dir = target
    step = checkpoint(tmp_path / "run", drafter, target_dir)
    out = tmp_path / "spec"
    assert export_cli.main([str(step), "--output", str(out), "--format", "speculators"]) == 0  # recorded target
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["speculators_version"] == SPECULATORS_VERSION
    assert config["aux_hidden_state_layer_ids"] == [1, 4]  # our taps [0, 3] + 1, the last layer's kept
    assert config["block_size"] == BLOCK and config["mask_token_id"] == 255 and config["draft_vocab_size"] == 256
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": str(target_dir),
        "architectures": ["Qwen3ForCausalLM"],
    }
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = sorted(handle.keys())
        assert names == sorted(speculators_tensor_names(2)) and len(names) == 28
        assert torch.equal(handle.get_tensor("embed_tokens.weight"), target_model.embed_weight)
        assert torch.equal(handle.get_tensor("lm_head.weight"), target_model.lm_head_weight)
        assert torch.equal(handle.get_tensor("verifier_norm.weight"), target_model.model.model.norm.weight)

    batch = fixed_batch(target_model)
    torch.save(batch, tmp_path / "batch.pt")
    done = subprocess.run(
        [str(speculators_python()), str(FORWARD), str(out), str(tmp_path / "batch.pt"), str(tmp_path / "out.pt")],
        capture_output=True,
        text=True,
        timeout=600,
        env=speculators_env(),
        cwd=tmp_path,  # not the repository: its own imports must not come from our checkout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = torch.load(tmp_path / "out.pt")

    # Strict: the loader reports nothing, and the file holds every tensor of the model except
    # verifier_lm_head.weight (speculators' training-only copy of the LM head, which it never saves either;
    # its loader fills it from the verifier).
    assert result["loading_info"] == {
        "missing_keys": [],
        "unexpected_keys": [],
        "mismatched_keys": [],
        "error_msgs": [],
    }
    ours = our_logits(drafter, target_model, batch)
    slots = torch.arange(ours.shape[1]) % BLOCK != 0  # the drafted slots 1..B-1 of every block
    for how in ("alone", "filled"):  # the file's own target parts; the verifier's, loaded over them
        theirs = result[how]
        assert set(theirs["model_keys"]) - set(result["file_keys"]) == {"verifier_lm_head.weight"}, how
        assert set(result["file_keys"]) - set(theirs["model_keys"]) == set(), how
        assert all(theirs["target_parts_equal"].values()), (how, theirs["target_parts_equal"])
        assert theirs["aux_hidden_state_layer_ids"] == [1, 4] and theirs["fc_in_features"] == 2 * 64
        assert theirs["anchors"].tolist() == ANCHORS
        assert theirs["logits"].shape == ours.shape == (1, len(ANCHORS) * BLOCK, 256)
        diff = (theirs["logits"] - ours).abs().max().item()
        print(f"{how}: max |logit difference| speculators vs ours: {diff:.3g} (scale {ours.abs().max().item():.3g})")
        assert diff <= LOGIT_ATOL, how
        assert torch.equal(theirs["logits"][0, slots].argmax(-1), ours[0, slots].argmax(-1)), how
    # The plain load leaves nothing unloaded (the other path skips the fill of verifier_lm_head, see
    # speculators_forward.py, and that tensor is never read on the way to the draft logits).
    assert result["filled"]["not_finite"] == []
    assert result["alone"]["not_finite"] in ([], ["verifier_lm_head.weight"])

    # control: the comparison can fail. The same features with the two taps swapped give other logits.
    features = batch["hidden_states"]
    swapped = {**batch, "hidden_states": torch.cat(features.chunk(2, dim=-1)[::-1], dim=-1)}
    assert (
        result["filled"]["logits"] - our_logits(drafter, target_model, swapped)
    ).abs().max().item() > 1e3 * LOGIT_ATOL


def test_the_two_formats_agree_on_every_tap(drafter, target, tmp_path):
    """z-lab's target_layer_ids count decoder layers (HF hidden_states[i+1]); speculators' aux ids count
    hidden_states indices. One drafter exported both ways: the same taps, the same drafter tensors."""
    _, target_dir = target
    step = checkpoint(tmp_path / "run", drafter, target_dir)
    assert export_cli.main([str(step), "--output", str(tmp_path / "z")]) == 0
    assert export_cli.main([str(step), "--output", str(tmp_path / "s"), "--format", "speculators"]) == 0
    zlab = json.loads((tmp_path / "z/config.json").read_text())
    spec = json.loads((tmp_path / "s/config.json").read_text())
    taps = zlab["dflash_config"]["target_layer_ids"]
    assert taps == [0, 3] and spec["aux_hidden_state_layer_ids"] == speculators_layer_ids(taps) == [1, 4]
    assert zlab["num_target_layers"] == 4 and len(spec["aux_hidden_state_layer_ids"]) == zlab["num_hidden_layers"]
    with (
        safe_open(str(tmp_path / "z/model.safetensors"), "pt") as z,
        safe_open(str(tmp_path / "s/model.safetensors"), "pt") as s,
    ):
        assert set(z.keys()) == set(s.keys()) - {"embed_tokens.weight", "lm_head.weight", "verifier_norm.weight"}
        for name in sorted(z.keys()):
            assert torch.equal(z.get_tensor(name), s.get_tensor(name)), name
    # the z-lab form keeps its own check: it loads back into our drafter with the same outputs
    loaded = export_cli.load_drafter(tmp_path / "z")
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in drafter.state_dict().items())


def test_speculators_export_needs_a_target_and_refuses_what_it_cannot_express(drafter, target, tmp_path, capsys):
    _, target_dir = target
    step = checkpoint(tmp_path / "run", drafter, None)  # a tiny-preset run: its target had no directory
    assert export_cli.main([str(step), "--output", str(tmp_path / "a"), "--format", "speculators"]) == 2
    err = capsys.readouterr().err
    assert "records no target model directory" in err and "--target-model DIR" in err
    assert not (tmp_path / "a").exists()

    argv = [str(step), "--output", str(tmp_path / "b"), "--format", "speculators", "--target-model", str(target_dir)]
    assert export_cli.main([*argv, "--verifier", "Qwen/Qwen3-8B"]) == 0  # given by hand, recorded as given
    config = json.loads((tmp_path / "b/config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "Qwen/Qwen3-8B"

    assert export_cli.main([str(step), "--output", str(tmp_path / "c"), "--target-model", str(target_dir)]) == 2
    assert "only apply to --format speculators" in capsys.readouterr().err

    other = build_tiny_target(seed=1, num_hidden_layers=4, hidden_size=32, head_dim=8)
    other.model.save_pretrained(tmp_path / "other")
    argv = [str(step), "--output", str(tmp_path / "d"), "--format", "speculators", "--target-model"]
    assert export_cli.main([*argv, str(tmp_path / "other")]) == 2
    assert "the target's embedding has shape (256, 32), the drafter needs (256, 64)" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()

    causal = DFlashDrafter(
        tiny_drafter_config(target[0], num_hidden_layers=2, block_size=BLOCK, causal_in_block={"full_attention": True})
    )
    step = checkpoint(tmp_path / "run2", causal, target_dir)
    assert export_cli.main([str(step), "--output", str(tmp_path / "e"), "--format", "speculators"]) == 2
    assert "only has bidirectional full-attention blocks" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()
