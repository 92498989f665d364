"""The qwen3-8b-shaped random target's forward at the specforge shape (2 x 768 tokens, taps [1, 9, 17, 25, 33]),
eager HF against its layers through one compiled call (--target-compile; TargetModel.compile_layers), without
the drafter: the prefill's own time and the taps' largest difference (issue 31 item 4, bench/RESULTS.md session 17).

    python3 bench/s17_target_compile.py [--iters 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen3Config

from trainer.bench_common import time_ms
from trainer.model import TargetModel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    hf = Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=34, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
    )  # fmt: skip
    target = TargetModel.from_config(hf, [1, 9, 17, 25, 33], dtype=torch.bfloat16, device=device)
    ids = torch.randint(0, 151936, (2, 768), device=device)
    mask = torch.ones_like(ids)

    def prefill() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return target.features(ids, mask).taps

    eager_taps = prefill()
    rows = [("eager", statistics.median(time_ms(prefill, device, warmup=2, iters=args.iters)))]
    target.compile_layers()
    started = time.monotonic()
    compiled_taps = prefill()
    compile_s = time.monotonic() - started
    rows.append(("compiled", statistics.median(time_ms(prefill, device, warmup=2, iters=args.iters))))
    diff = (compiled_taps.float() - eager_taps.float()).abs().max().item()
    scale = eager_taps.float().abs().max().item()
    flops = 2 * 2 * 768 * 34 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 12288)
    print(f"compile {compile_s:.1f} s; taps' largest difference {diff:.3g} (largest magnitude {scale:.3g})")
    print(f"{'target':<12} {'ms':>8} {'TFLOP/s':>8}")
    for name, ms in rows[:2]:
        print(f"{name:<12} {ms:8.2f} {flops / (ms * 1e-3) / 1e12:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
