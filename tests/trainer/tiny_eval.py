"""The eval tests' world: a BPE tokenizer with a chat template, a tiny Qwen3 target, an untrained 2-layer drafter
(block 4) and prompts from the synthetic walk grammar. Shared by test_eval.py and test_ddtree.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.data.tiny_world import WalkWorld, build_tiny_target
from trainer.data.tokenizer_utils import MASK_TOKEN, build_tiny_tokenizer, end_of_turn_ids, tokenize_prompt
from trainer.model.drafter import DFlashDrafter, DrafterConfig


def build_eval_setup(root: Path, num_prompts: int) -> dict[str, Any]:
    """{root, tokenizer, model, drafter, prompts, stops}; deterministic (seeded drafter init)."""
    torch.set_num_threads(1)
    world = WalkWorld(num_words=24, answer_words=8)
    tokenizer = build_tiny_tokenizer(world.texts(), root / "tok", vocab_size=320)
    model = build_tiny_target(root / "target", tokenizer, hidden_size=32, num_layers=4, num_heads=2, num_kv_heads=1)
    torch.manual_seed(0)
    config = DrafterConfig.for_target(
        model.config, num_hidden_layers=2, block_size=4, mask_token_id=tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    )
    prompts = [tokenize_prompt(tokenizer, c[:1], False) for c in world.conversations(num_prompts, seed=5)]
    return {
        "root": root,
        "tokenizer": tokenizer,
        "model": model,
        "drafter": DFlashDrafter(config).eval(),
        "prompts": prompts,
        "stops": end_of_turn_ids(tokenizer),
    }
