"""The target wrapper (taps), the drafter (public names, visibility/leakage, gradients, checkpoint format) and
their cross-checks. Tiny real models only (tests/trainer/tiny.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding, apply_rotary_pos_emb

from tests.trainer.tiny import TINY_MASK_TOKEN_ID, build_tiny_target, tiny_drafter_config, tiny_target_config
from trainer.model import (
    DFlashDrafter,
    DrafterConfig,
    TargetModel,
    build_draft_mask,
    default_target_layer_ids,
    make_block_input_ids,
)
from trainer.model.drafter import RMSNorm, apply_rope, rope_cos_sin

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return build_tiny_target(seed=0)


def make_drafter(target: TargetModel, seed: int = 0, **kwargs) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(tiny_drafter_config(target, **kwargs))
    # Non-trivial norm weights so that a wrong wiring of any norm shows up in the comparisons below.
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return drafter


# ------------------------------------------------------------------------------------------------------ taps


def test_default_tap_ids_match_the_published_drafters() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_tap_ids_edge_cases_are_defined() -> None:
    assert default_target_layer_ids(36, 1) == [18]  # n == 1: the middle layer
    assert default_target_layer_ids(2, 2) == [0, 1]  # tiny fallback: spread over all layers
    assert default_target_layer_ids(4, 2) == [0, 3]
    assert default_target_layer_ids(39, 3) == [1, 18, 36]  # 18.5 rounds half to even, like the reference
    for num_layers in range(1, 70):
        for n in range(1, min(num_layers, 8) + 1):
            ids = default_target_layer_ids(num_layers, n)
            assert len(ids) == n and sorted(set(ids)) == ids and ids[0] >= 0 and ids[-1] < num_layers
    with pytest.raises(ValueError, match="cannot tap 3 distinct layers of a 2-layer target"):
        default_target_layer_ids(2, 3)


def test_taps_equal_hf_hidden_states(target: TargetModel) -> None:
    ids = torch.randint(0, 200, (2, 11))
    attn = torch.ones_like(ids)
    attn[1, 8:] = 0  # right padding
    out = target.features(ids, attn, return_final_hidden=True)
    hf = target.model(ids, attention_mask=attn, output_hidden_states=True)
    H = target.hidden_size
    assert out.taps.shape == (2, 11, len(target.layer_ids) * H)
    for k, layer in enumerate(target.layer_ids):  # [0, 1]; layer 1 is the last: post-norm
        torch.testing.assert_close(out.taps[..., k * H : (k + 1) * H], hf.hidden_states[layer + 1])
    torch.testing.assert_close(out.final_hidden, hf.hidden_states[-1])
    assert target.features(ids, attn).final_hidden is None


def test_early_exit_above_the_highest_tap_gives_the_same_taps_and_leaves_no_hooks() -> None:
    deep = TargetModel.from_config(tiny_target_config(num_hidden_layers=4), layer_ids=[0, 2], seed=3)
    ids = torch.randint(0, 200, (1, 7))
    hf = deep.model(ids, output_hidden_states=True)  # (installs HF's own capture hooks)
    hooks_before = [len(layer._forward_hooks) for layer in deep.model.model.layers]
    for _ in range(2):  # twice: the first call must clean up after itself
        taps = deep.features(ids).taps
        torch.testing.assert_close(taps, torch.cat([hf.hidden_states[1], hf.hidden_states[3]], dim=-1))
    assert [len(layer._forward_hooks) for layer in deep.model.model.layers] == hooks_before


def test_target_is_frozen_and_exposes_shared_weights(target: TargetModel) -> None:
    assert not any(p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    assert target.embed_weight.shape == target.lm_head_weight.shape == (256, 64)
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (2, 64, 256)


def test_target_without_a_tapped_layer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"target has 2 layers .* \[5\]"):
        TargetModel.from_config(tiny_target_config(), layer_ids=[0, 5])
    with pytest.raises(ValueError, match="cannot tap 5 distinct layers"):
        TargetModel.from_config(tiny_target_config(), num_draft_layers=5)


# -------------------------------------------------------------------------------------------- config checks


def test_drafter_hidden_size_must_match_the_target(target: TargetModel) -> None:
    wide = build_tiny_target(seed=1, hidden_size=32, head_dim=8)
    cfg = tiny_drafter_config(wide)
    with pytest.raises(ValueError, match="drafter hidden_size 32 != target hidden size 64"):
        cfg.check_target(
            num_target_layers=target.num_layers, hidden_size=target.hidden_size, vocab_size=target.vocab_size
        )


def test_mask_id_outside_the_vocabulary_is_a_clear_error(target: TargetModel) -> None:
    with pytest.raises(ValueError, match="mask_token_id 256 is outside the vocabulary"):
        tiny_drafter_config(target, mask_token_id=256)
    with pytest.raises(ValueError, match="mask_token_id -1 is outside the vocabulary"):
        tiny_drafter_config(target, mask_token_id=-1)


def test_drafter_config_rejects_taps_beyond_the_target_and_bad_shapes(target: TargetModel) -> None:
    cfg = tiny_drafter_config(target)
    with pytest.raises(ValueError, match="do not fit a 2-layer target"):
        DrafterConfig(**{**cfg.__dict__, "target_layer_ids": [0, 2]})
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        tiny_drafter_config(target, block_size=1)
    with pytest.raises(ValueError, match="sliding_window >= block_size"):
        tiny_drafter_config(target, layer_types=["sliding_attention", "full_attention"], sliding_window=None)


def test_hf_config_round_trip_and_public_style_config(target: TargetModel) -> None:
    cfg = tiny_drafter_config(target, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    d = cfg.to_hf_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"]["target_layer_ids"] == [0, 1] and d["num_target_layers"] == 2
    assert DrafterConfig.from_hf_dict(json.loads(json.dumps(d))) == cfg
    public = {k: v for k, v in d.items() if k not in ("rope_parameters", "layer_types", "sliding_window")}
    public["dflash_config"] = {"mask_token_id": TINY_MASK_TOKEN_ID, "target_layer_ids": [0, 1]}
    loaded = DrafterConfig.from_hf_dict(public)
    assert loaded.layer_types == ["full_attention"] * 2 and loaded.causal_in_block["full_attention"] is False
    with pytest.raises(ValueError, match="not a DFlash drafter config"):
        DrafterConfig.from_hf_dict({"model_type": "qwen3"})


# ------------------------------------------------------------------------------------------------ the drafter


def test_state_dict_has_exactly_the_public_names(target: TargetModel) -> None:
    sd = DFlashDrafter(tiny_drafter_config(target)).state_dict()
    per_layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    per_layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    per_layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    expected = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {
        "norm.weight",
        "fc.weight",
        "hidden_norm.weight",
    }
    assert len(sd) == 25 and set(sd) == expected
    assert sd["fc.weight"].shape == (64, 2 * 64)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_drafter_built_on_meta_has_the_real_ones_shapes_and_leaves_the_rng_alone(
    target: TargetModel, arch: str
) -> None:
    """The pre-flight builds the drafter on the meta device for its tensor shapes (preflight.expected_shapes); its
    init is skipped there (nothing to draw), which must change neither a shape nor the RNG a real build draws."""
    from dataclasses import replace

    from trainer.training.preflight import expected_shapes

    config = replace(tiny_drafter_config(target), arch=arch)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    shapes = expected_shapes(config)
    assert torch.equal(torch.get_rng_state(), before)
    real = DFlashDrafter(config)
    assert shapes == {name: list(tensor.shape) for name, tensor in real.state_dict().items()}
    torch.manual_seed(0)
    again = DFlashDrafter(config)
    assert all(torch.equal(a, b) for a, b in zip(real.state_dict().values(), again.state_dict().values()))
    assert real.fc.weight.std() > 0  # a real build still draws its init


def test_norm_and_rope_match_hf_qwen3() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    ours, theirs = RMSNorm(16, 1e-6), Qwen3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), theirs(x))

    positions = torch.tensor([[3, 4, 5, 90, 91, 1000]])
    hf_rope = Qwen3RotaryEmbedding(tiny_target_config(head_dim=16))
    cos, sin = hf_rope(x, positions)
    q, k = torch.randn(1, 4, 6, 16), torch.randn(1, 2, 6, 16)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    our_cos, our_sin = rope_cos_sin(positions, 16, 10000.0)
    torch.testing.assert_close(apply_rope(q, our_cos[:, None], our_sin[:, None]), want_q)
    torch.testing.assert_close(apply_rope(k, our_cos[:, None], our_sin[:, None]), want_k)


def run_drafter(
    drafter: DFlashDrafter, ctx: torch.Tensor, block_embeds: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    mask = drafter.build_mask(anchors, keep, ctx.shape[1])
    return drafter(ctx, block_embeds, anchors, keep, mask)


@pytest.mark.parametrize("variant", ["full", "sliding+causal", "full+causal"])
def test_no_leakage_from_future_context_or_other_blocks(target: TargetModel, variant: str) -> None:
    kwargs = {
        "full": {},
        "full+causal": {"causal_in_block": {"full_attention": True}},
        "sliding+causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6},
    }[variant]
    drafter = make_drafter(target, **kwargs).double()
    B, S = drafter.config.block_size, 24
    torch.manual_seed(5)
    anchors = torch.tensor([[3, 9, 9, 17, 0]])
    keep = torch.tensor([[True, True, True, True, False]])
    N = anchors.shape[1]
    ctx = torch.randn(1, S, 128, dtype=torch.float64)
    emb = torch.randn(1, N * B, 64, dtype=torch.float64)
    base = run_drafter(drafter, ctx, emb, anchors, keep)
    for n in range(N - 1):
        a, rows = int(anchors[0, n]), slice(n * B, (n + 1) * B)
        # Any context at or after the anchor (the anchor position itself included) is invisible.
        future = ctx.clone()
        future[:, a:] += torch.randn_like(future[:, a:])
        assert torch.equal(run_drafter(drafter, future, emb, anchors, keep)[:, rows], base[:, rows])
        # Other blocks' tokens are invisible.
        others = emb.clone()
        others[:, [i for i in range(N * B) if not rows.start <= i < rows.stop]] += 1.0
        assert torch.equal(run_drafter(drafter, ctx, others, anchors, keep)[:, rows], base[:, rows])
        # Positive control: the context just before the anchor is seen (so the checks above can fail).
        if a > 0:
            past = ctx.clone()
            past[:, a - 1] += 1.0
            assert not torch.allclose(run_drafter(drafter, past, emb, anchors, keep)[:, rows], base[:, rows])
    assert base[:, (N - 1) * B :].abs().max() == 0  # padded block: exactly 0


def test_in_block_causality_follows_the_config(target: TargetModel) -> None:
    for causal in (False, True):
        drafter = make_drafter(target, causal_in_block={"full_attention": causal}).double()
        B = drafter.config.block_size
        anchors, keep = torch.tensor([[5]]), torch.tensor([[True]])
        ctx, emb = torch.randn(1, 8, 128, dtype=torch.float64), torch.randn(1, B, 64, dtype=torch.float64)
        base = run_drafter(drafter, ctx, emb, anchors, keep)
        changed = emb.clone()
        changed[:, 2] += 1.0  # slot 2 of the block
        diff = (run_drafter(drafter, ctx, changed, anchors, keep) - base).abs().amax(-1)[0]
        assert (diff[:2] == 0).all() if causal else (diff[:2] > 0).all()
        assert (diff[2:] > 0).all()


def test_truncated_context_equals_inference_form(target: TargetModel) -> None:
    """A block trained at anchor a over a long row gives the same hidden as the inference call (R=1, N=1,
    S = a committed tokens): the context it sees is exactly the positions before its anchor."""
    drafter = make_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=5).double()
    B = drafter.config.block_size
    ctx = torch.randn(1, 20, 128, dtype=torch.float64)
    anchors, keep = torch.tensor([[4, 11]]), torch.tensor([[True, True]])
    emb = torch.randn(1, 2 * B, 64, dtype=torch.float64)
    trained = run_drafter(drafter, ctx, emb, anchors, keep)
    for n, a in enumerate((4, 11)):
        single = run_drafter(drafter, ctx[:, :a], emb[:, n * B : (n + 1) * B], torch.tensor([[a]]), keep[:, :1])
        torch.testing.assert_close(single, trained[:, n * B : (n + 1) * B], rtol=1e-12, atol=1e-12)


def test_end_to_end_future_tokens_do_not_leak(target: TargetModel) -> None:
    drafter = make_drafter(target)
    B = drafter.config.block_size
    ids = torch.randint(0, 200, (1, 16))
    anchors, keep = torch.tensor([[6]]), torch.tensor([[True]])

    def hidden(input_ids: torch.Tensor) -> torch.Tensor:
        taps = target.features(input_ids, torch.ones_like(input_ids)).taps
        emb = F.embedding(make_block_input_ids(input_ids, anchors, B, TINY_MASK_TOKEN_ID), target.embed_weight)
        return run_drafter(drafter, taps, emb, anchors, keep)

    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 200  # every token after the anchor
    assert torch.equal(hidden(changed), hidden(ids))


def test_block_input_ids() -> None:
    ids = torch.arange(10, 20).reshape(1, 10)
    got = make_block_input_ids(ids, torch.tensor([[2, 7]]), 3, 99)
    assert got.tolist() == [[12, 99, 99, 17, 99, 99]]


def test_gradients_reach_the_drafter_but_not_the_frozen_target(target: TargetModel) -> None:
    drafter = make_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    B = drafter.config.block_size
    ids = torch.randint(0, 200, (2, 14))
    anchors = torch.tensor([[2, 8], [5, 0]])
    keep = torch.tensor([[True, True], [True, False]])
    out = target.features(ids, torch.ones_like(ids))
    block_ids = make_block_input_ids(ids, anchors, B, TINY_MASK_TOKEN_ID)
    hidden = drafter(
        out.taps, F.embedding(block_ids, target.embed_weight), anchors, keep, drafter.build_mask(anchors, keep, 14)
    )
    logits = hidden @ target.lm_head_weight.T
    labels = torch.gather(ids, 1, (anchors[:, :, None] + torch.arange(B)).clamp(max=13).reshape(2, -1))
    F.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1)).backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert all(p.grad is None for p in target.model.parameters())


def test_a_mask_built_inside_equals_the_one_passed_in(target: TargetModel) -> None:
    """forward(..., "dense") builds the mask itself (after queuing the context's GEMM): same hidden states as with
    the mask built beforehand."""
    drafter = make_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6).double()
    B = drafter.config.block_size
    anchors, keep = torch.tensor([[2, 8, 5]]), torch.tensor([[True, True, False]])
    ctx = torch.randn(1, 14, 128, dtype=torch.float64)
    emb = torch.randn(1, 3 * B, 64, dtype=torch.float64)
    built_inside = drafter(ctx, emb, anchors, keep, "dense")
    assert torch.equal(built_inside, run_drafter(drafter, ctx, emb, anchors, keep))


def test_drafter_rejects_inputs_of_the_wrong_shape(target: TargetModel) -> None:
    drafter = make_drafter(target)
    anchors, keep = torch.tensor([[3]]), torch.tensor([[True]])
    mask = build_draft_mask(anchors, keep, 8, 4)
    with pytest.raises(ValueError, match="expected 2 taps x 64"):
        drafter(torch.randn(1, 8, 2 * 32), torch.randn(1, 4, 64), anchors, keep, mask)  # a hidden-32 target
    with pytest.raises(ValueError, match="mask was built for S=8"):
        drafter(torch.randn(1, 9, 128), torch.randn(1, 4, 64), anchors, keep, mask)


def test_save_and_load_public_checkpoint(target: TargetModel, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path / "d")
    assert len(load_file(str(tmp_path / "d" / "model.safetensors"))) == 25
    loaded = DFlashDrafter.from_pretrained(tmp_path / "d")
    anchors, keep = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    ctx, emb = torch.randn(1, 9, 128), torch.randn(1, 8, 64)
    torch.testing.assert_close(
        run_drafter(loaded, ctx, emb, anchors, keep), run_drafter(drafter, ctx, emb, anchors, keep)
    )

    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    state["fc.weight"] = torch.zeros(64, 64)
    save_file(state, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="wrong shape \\['fc.weight'\\]"):
        DFlashDrafter.from_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="is not a drafter checkpoint"):
        DFlashDrafter.from_pretrained(tmp_path / "missing")
