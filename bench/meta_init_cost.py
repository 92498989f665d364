"""What the first `normal_` on a meta tensor costs in a fresh interpreter with the trainer imported.

The pre-flight (`python -m trainer check`, and every trainer start: preflight.expected_shapes) built the drafter
on the meta device for its tensor shapes, and the drafter's init drew normal_ there; the first such call loads
torch's reference-op machinery. Since bench/results/kernels.md 2026-12-04 ("the pre-flight's meta build") a meta build skips its init. This prints that first call's cost
(3 fresh interpreters), and what expected_shapes costs now at the qwen3-8b shape.

    python3 bench/meta_init_cost.py
"""

from __future__ import annotations

import subprocess
import sys

FIRST_NORMAL = """
import time, torch
import trainer.train
with torch.device("meta"):
    weight = torch.nn.Linear(4096, 4096).weight
t = time.perf_counter(); torch.nn.init.normal_(weight); print(f"{time.perf_counter() - t:.3f}")
"""
SHAPES_NOW = """
import time
import trainer.train
from trainer.model.drafter import DrafterConfig
from trainer.training.preflight import expected_shapes
config = DrafterConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16,
                       target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36, mask_token_id=151669)
t = time.perf_counter(); expected_shapes(config); print(f"{time.perf_counter() - t:.3f}")
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


if __name__ == "__main__":
    for _ in range(3):
        print(f"first normal_ on meta (s): {run(FIRST_NORMAL)}   expected_shapes qwen3-8b now (s): {run(SHAPES_NOW)}")
