"""Tiny models for trainer tests (shared by all trainer teams): build in milliseconds, run in milliseconds.

The tiny target is a real `transformers.Qwen3ForCausalLM` built from a config: hidden 64, 2 layers, 4 query /
2 key-value heads of 16, vocabulary 256 (bytes). Two layers, as the issue's `tiny` preset says: a 2-layer
target cannot use the formula of docs/method.md#target-taps (it needs L >= n + 3), so
`default_target_layer_ids(2, 2)` spreads the taps over all layers and the tiny drafter taps [0, 1] (layer 1 being
the last layer, that tap is HF's post-norm hidden_states[2]). That keeps both taps distinct and the features
informative; the formula itself is tested on the 36- and 64-layer shapes. The MASK token is the last vocabulary
id (255), reserved by convention: the tiny tests never use byte 255 as text.
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen3Config

from trainer.core.config import TrainConfig, parse_train_args
from trainer.model.drafter import DrafterConfig
from trainer.model.target import TargetModel

TINY_VOCAB = 256
TINY_MASK_TOKEN_ID = TINY_VOCAB - 1


def tiny_target_config(
    *,
    vocab_size: int = TINY_VOCAB,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
) -> Qwen3Config:
    """A Qwen3 config small enough for a CPU unit test (about 60K parameters at the defaults)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def build_tiny_target(seed: int = 0, *, num_draft_layers: int = 2, **config_overrides: int) -> TargetModel:
    """A frozen tiny Qwen3 target (float32, CPU), deterministic in `seed`; tap ids from the default formula."""
    return TargetModel.from_config(tiny_target_config(**config_overrides), num_draft_layers=num_draft_layers, seed=seed)


def tiny_drafter_config(
    target: TargetModel,
    *,
    num_hidden_layers: int = 2,
    block_size: int = 4,
    mask_token_id: int = TINY_MASK_TOKEN_ID,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    causal_in_block: dict[str, bool] | None = None,
) -> DrafterConfig:
    """A drafter matching `target` (same hidden size, heads, vocab; taps = the target's layer_ids)."""
    return DrafterConfig.for_target(
        target,
        num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target.layer_ids,
        layer_types=layer_types,
        sliding_window=sliding_window,
        causal_in_block=causal_in_block,
    )


def tiny_train_config(out: Path, *extra: str) -> TrainConfig:
    """The tiny preset's TrainConfig for a quick CPU run into `out`: synthetic data, no wandb, a log line per step,
    no periodic checkpoint; `extra` flags come last and win."""
    return parse_train_args(
        ["--preset", "tiny", "--output-dir", str(out), "--wandb", "off", "--synthetic-samples", "48"]
        + ["--log-interval", "1", "--save-interval", "1000", *extra]
    )
