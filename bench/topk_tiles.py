"""Issue 32 item 4 (bench/results/kernels.md 2026-12-04): the fused CE kernel's in-kernel top-16 (trainer/kernels/loss_triton.py fused_ce_topk) by
tile width, on the H200, one chunk of the qwen3-8b seed shape (bf16 logits [3968, 151936]).

    python3 bench/topk_tiles.py [--rows 3968] [--iters 10]

Each insertion into the running top-k costs a reduction over one tile (BLOCK_V wide), and an unordered row takes
~k (1 + ln(tiles)) insertions: narrower tiles and fewer warps make each insertion cheaper (one warp reduces
without shared memory or a barrier) and add a few insertions; one program per row keeps many rows in flight.
For N(0, 1) rows (a fresh drafter's near-uniform logits, the bench step's case) and Zipf-biased rows (a trained
drafter's), the time of fused_ce_topk per config against plain fused_ce at the default, and parity: every
config's ids and values equal the default config's (the kernel's order is exact: value desc, then the lower
column). Table last.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import time_ms
from trainer.kernels.loss_triton import CEKernelConfig, fused_ce, fused_ce_topk

VOCAB, K = 151936, 16
CONFIGS = ("4096:8", "2048:8", "2048:4", "2048:2", "1024:4", "1024:2", "1024:1", "512:1")


def logits_of(kind: str, rows: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g)
    if kind == "zipf":
        x = x + 4.0 - torch.log1p(torch.arange(VOCAB, device="cuda", dtype=torch.float32)) * 0.5
    return (x * 2).to(torch.bfloat16)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3968)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    table = []
    for kind in ("normal", "zipf"):
        logits = logits_of(kind, args.rows)
        labels = torch.randint(0, VOCAB, (args.rows,), device="cuda")
        _, _, _, _, ref_v, ref_i = fused_ce_topk(logits, labels, K)
        times: dict[str, list[float]] = {}
        runs = {"plain 4096:8": functools.partial(fused_ce, logits, labels)}
        for text in CONFIGS:
            runs[text] = functools.partial(fused_ce_topk, logits, labels, K, config=CEKernelConfig.parse(text))
        for _ in range(2):  # interleaved twice against drift
            for text, run in runs.items():
                times.setdefault(text, []).append(statistics.median(time_ms(run, device, warmup=2, iters=args.iters)))
        for text in CONFIGS:
            _, _, _, _, v, i = fused_ce_topk(logits, labels, K, config=CEKernelConfig.parse(text))
            same = bool(torch.equal(v, ref_v) and torch.equal(i, ref_i))
            table.append((kind, text, times[text], same))
        table.append((kind, "plain 4096:8", times["plain 4096:8"], True))
    print(f"{'logits':<8} {'config':<14} {'ms (twice)':<16} {'== 4096:8'}")
    for kind, text, ms, same in table:
        print(f"{kind:<8} {text:<14} {ms[0]:.3f} {ms[1]:.3f}      {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
