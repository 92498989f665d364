"""trainer.core.config: presets, the seed run's flags, unknown keys, cross-checks that name the flag."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from trainer.core.config import PRESETS, TrainConfig, TrainerInputError, parse_train_args, target_compile_enabled
from trainer.train import build_drafter_config

SEED_FLAGS = [  # every flag of the seed run, with a value of the right kind
    "--target-model",
    "/models/t",
    "--data-dir",
    "/data",
    "--output-dir",
    "/out",
    "--target-gpus",
    "0",
    "--drafter-gpus",
    "1",
    "--epochs",
    "2",
    "--lr",
    "1e-4",
    "--warmup-ratio",
    "0.1",
    "--weight-decay",
    "0.01",
    "--grad-accum",
    "4",
    "--grad-clip",
    "0.5",
    "--token-budget",
    "8192",
    "--max-seq-len",
    "2048",
    "--max-batch-size",
    "4",
    "--block-size",
    "32",
    "--max-anchors",
    "512",
    "--num-draft-layers",
    "5",
    "--gamma",
    "10",
    "--noise-start",
    "0.1",
    "--noise-end",
    "0.0",
    "--noise-type",
    "gaussian",
    "--use-soft-labels",
    "--kl-weight",
    "0.5",
    "--kl-temperature",
    "2.0",
    "--cap-lambda",
    "0.1",
    "--save-interval",
    "500",
    "--wandb-project",
    "proj",
    "--wandb-run-name",
    "r1",
    "--anchors-per-seq",
    "256",
    "--sliding-window",
    "2048",
    "--seed",
    "7",
    "--max-steps",
    "100",
    "--log-interval",
    "5",
]


def test_every_seed_flag_is_accepted_with_its_meaning() -> None:
    cfg = parse_train_args(["--preset", "qwen3-8b", *SEED_FLAGS])
    assert (cfg.target_model, cfg.data_dir, cfg.output_dir) == ("/models/t", "/data", "/out")
    assert cfg.target_gpus == ["cuda:0"] and cfg.drafter_gpus == ["cuda:1"]
    assert (cfg.epochs, cfg.lr, cfg.warmup_ratio, cfg.weight_decay, cfg.grad_accum, cfg.grad_clip) == (
        2,
        1e-4,
        0.1,
        0.01,
        4,
        0.5,
    )
    assert (cfg.token_budget, cfg.max_seq_len, cfg.max_batch_size, cfg.block_size, cfg.max_anchors) == (
        8192,
        2048,
        4,
        32,
        512,
    )
    assert (cfg.gamma, cfg.noise_start, cfg.noise_end, cfg.noise_type) == (10.0, 0.1, 0.0, "gaussian")
    assert cfg.use_soft_labels is True and (cfg.kl_weight, cfg.kl_temperature, cfg.cap_lambda) == (0.5, 2.0, 0.1)
    assert (cfg.save_interval, cfg.wandb_project, cfg.wandb_run_name) == (500, "proj", "r1")
    assert (cfg.anchors_per_seq, cfg.sliding_window, cfg.seed, cfg.max_steps, cfg.log_interval) == (
        256,
        2048,
        7,
        100,
        5,
    )


def test_preset_values_are_defaults_and_flags_override_them() -> None:
    cfg = parse_train_args(["--preset", "tiny", "--block-size", "4", "--use-soft-labels", "false"])
    assert cfg.block_size == 4 and cfg.use_soft_labels is False
    assert cfg.gamma == PRESETS["tiny"]["gamma"] and cfg.tiny_target is not None
    assert parse_train_args(["--preset", "tiny", "--target-gpus", "cpu,cpu"]).target_gpus == ["cpu", "cpu"]


def test_presets_have_the_published_drafter_shapes() -> None:
    q8 = parse_train_args(["--preset", "qwen3-8b", "--target-model", "/m", "--data-dir", "/d"])
    assert (q8.hidden_size, q8.num_attention_heads, q8.num_key_value_heads, q8.head_dim) == (4096, 32, 8, 128)
    assert (q8.intermediate_size, q8.num_draft_layers, q8.vocab_size, q8.mask_token_id) == (12288, 5, 151936, 151669)
    assert q8.layer_types() == ["full_attention"] * 5
    q36 = parse_train_args(["--preset", "qwen3.6-27b", "--target-model", "/m", "--data-dir", "/d"])
    assert (q36.num_target_layers, q36.mask_token_id, q36.vocab_size, q36.sliding_window) == (64, 248070, 248320, 2048)
    assert q36.layer_types() == ["sliding_attention"] * 4 + ["full_attention"]


def _target_config(layers: int, hidden: int, vocab: int) -> Qwen3Config:
    return Qwen3Config(
        num_hidden_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=hidden * 3,
    )


@pytest.mark.parametrize(
    "preset, layers, hidden, vocab, taps",
    [
        ("qwen3-8b", 36, 4096, 151936, [1, 9, 17, 25, 33]),
        ("qwen3.6-27b", 64, 5120, 248320, [1, 16, 31, 46, 61]),
    ],
)
def test_drafter_config_from_preset_and_target_config(
    preset: str, layers: int, hidden: int, vocab: int, taps: list[int]
) -> None:
    cfg = parse_train_args(["--preset", preset, "--target-model", "/m", "--data-dir", "/d"])
    drafter = build_drafter_config(cfg, _target_config(layers, hidden, vocab))
    assert drafter.target_layer_ids == taps and drafter.hidden_size == hidden
    assert drafter.mask_token_id == cfg.mask_token_id and drafter.layer_types == cfg.layer_types()


@pytest.mark.parametrize(
    "flags, flag_named",
    [
        (["--block-size", "1"], "--block-size"),
        (["--gamma", "0"], "--gamma"),
        (["--gamma", "-1"], "--gamma"),
        (["--max-anchors", "0"], "--max-anchors"),
        (["--anchors-per-seq", "0"], "--anchors-per-seq"),
        (["--token-budget", "63"], "--token-budget"),
        (["--noise-type", "pink"], "--noise-type"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--mask-token-id", "256"], "--mask-token-id"),
        (["--sliding-layers", "3"], "--sliding-layers"),
        (["--epochs", "many"], "--epochs"),
        (["--bogus-flag", "1"], "--bogus-flag"),
        (["--queue-depth", "0"], "--queue-depth"),
        (["--feature-transfer", "carrier-pigeon"], "--feature-transfer"),
        (["--stall-timeout", "0"], "--stall-timeout"),
        (["--sync-interval", "0"], "--sync-interval"),
        (["--preset", "huge"], "--preset"),
        (["--loss-kernels", "turbo"], "--loss-kernels"),
        (["--loss-kernels", "triton", "--drafter-gpus", "cpu"], "--loss-kernels"),
        (["--target-compile", "yes"], "--target-compile"),
        (["--attention-kernel", "fast"], "--attention-kernel"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(flags: list[str], flag_named: str) -> None:
    with pytest.raises(TrainerInputError) as info:
        parse_train_args(["--preset", "tiny", *flags])
    assert flag_named in info.value.message


def test_target_compile_is_on_by_default_for_a_cuda_target_only() -> None:
    cfg = parse_train_args(["--preset", "tiny"])
    assert cfg.target_compile == "auto"
    assert target_compile_enabled("auto", "cuda:1") and target_compile_enabled("auto", torch.device("cuda", 0))
    assert not target_compile_enabled("auto", "cpu") and not target_compile_enabled("auto", torch.device("cpu"))
    assert target_compile_enabled("on", "cpu") and not target_compile_enabled("off", "cuda:0")
    # checkpoints written before `auto` stored the flag as a bool
    assert TrainConfig.from_dict({**cfg.to_dict(), "target_compile": True}).target_compile == "on"
    assert TrainConfig.from_dict({**cfg.to_dict(), "target_compile": False}).target_compile == "off"


def test_attention_kernel_auto_is_triton_on_hopper_only() -> None:
    from trainer.model.attention import cuda_backend

    assert parse_train_args(["--preset", "tiny", "--attention-kernel", "auto"]).attention_kernel == "auto"
    assert cuda_backend("auto", (9, 0)) == "triton"
    assert cuda_backend("auto", (12, 0)) == "flex" and cuda_backend("auto", (8, 0)) == "flex"
    assert cuda_backend("auto") == "flex"  # capability unknown
    assert cuda_backend("triton", (8, 0)) == "triton" and cuda_backend("flex", (9, 0)) == "flex"
    with pytest.raises(ValueError, match="expected 'auto', 'flex' or 'triton'"):
        cuda_backend("fast")


def test_real_presets_need_a_target_and_data() -> None:
    with pytest.raises(TrainerInputError, match="--target-model"):
        parse_train_args(["--preset", "qwen3-8b", "--data-dir", "/d"])
    with pytest.raises(TrainerInputError, match="--data-dir"):
        parse_train_args(["--preset", "qwen3-8b", "--target-model", "/m"])


def test_from_dict_rejects_unknown_keys_and_round_trips() -> None:
    cfg = parse_train_args(["--preset", "tiny", "--output-dir", "/x"])
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TrainerInputError, match="--learning-rate"):
        TrainConfig.from_dict({**cfg.to_dict(), "learning_rate": 1.0})


def test_hidden_size_mismatch_with_the_target_is_an_error() -> None:
    cfg = parse_train_args(["--preset", "qwen3-8b", "--target-model", "/m", "--data-dir", "/d"])
    with pytest.raises(TrainerInputError, match="hidden size 4096 != target hidden size 5120"):
        build_drafter_config(cfg, _target_config(36, 5120, 151936))


def test_static_anchor_slots_per_row() -> None:
    cfg = parse_train_args(["--preset", "tiny", "--anchors-per-seq", "8", "--max-anchors", "20"])
    assert [cfg.anchors_per_row(r) for r in (1, 2, 3, 4, 40)] == [8, 8, 6, 5, 1]


def test_loss_kernels_default_to_auto_and_take_the_kinds() -> None:
    assert parse_train_args(["--preset", "tiny"]).loss_kernels == "auto"
    for kind in ("compiled", "eager", "triton"):
        assert parse_train_args(["--preset", "tiny", "--loss-kernels", kind]).loss_kernels == kind
