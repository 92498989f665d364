"""Issue 32 item 4 (bench/results/kernels.md 2026-12-04): DFlash2's convolution through trainer/kernels/conv_triton.py against the torch form
(grouped_dynamic_conv, torch.compile'd alone), on the H200 at the qwen3-8b seed shape: x [6, 5472, 4096] bf16
(171 blocks of 32 per row), K = 2 taps, groups of 16.

    python3 bench/conv_triton_cost.py [--iters 10]

Parity: both bf16 forms against an fp32 eager reference (relative error of out, dx, d delta, d base). Timing
(CUDA events, median, interleaved twice): forward, and forward + backward. Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import time_ms
from trainer.kernels import conv_triton
from trainer.kernels.conv_triton import block_conv
from trainer.model.dflash2 import grouped_dynamic_conv

R, Q, H, B, GS, K = 6, 171 * 32, 4096, 32, 16, 2


def timed(fn, x, delta, base, go, device: torch.device, iters: int) -> list[float]:
    """[forward ms, forward + backward ms] of one form (medians)."""
    xs, ds, bs = (t.detach().requires_grad_(True) for t in (x, delta, base))
    fwd = statistics.median(time_ms(lambda: fn(xs, ds, bs), device, warmup=3, iters=iters))
    full = statistics.median(
        time_ms(lambda: torch.autograd.grad(fn(xs, ds, bs), (xs, ds, bs), go), device, warmup=3, iters=iters)
    )
    return [fwd, full]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--best-out", default="", help="write the best backward config here if it beats torch")
    args = parser.parse_args()
    device = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(R, Q, H, device="cuda", generator=g).to(torch.bfloat16)
    kernels = (torch.randn(R, Q, 2, K, H // GS, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    delta = kernels[..., 0, :, :]
    base = torch.randn(K, H, device="cuda", generator=g) * 0.5 + 0.5
    go = torch.randn(R, Q, H, device="cuda", generator=g).to(torch.bfloat16)
    compiled = torch.compile(grouped_dynamic_conv)
    forms = {
        "torch (compiled)": lambda a, d, b: compiled(a, d, b, block_size=B, group_size=GS),
        "triton": lambda a, d, b: block_conv(a, d, b, block_size=B, group_size=GS),
    }

    rx, rd, rb = (t.detach().float().requires_grad_(True) for t in (x, delta, base))
    ref = grouped_dynamic_conv(rx, rd, rb, block_size=B, group_size=GS)
    ref_grads = torch.autograd.grad(ref, (rx, rd, rb), go.float())
    rows = []
    for name, fn in forms.items():
        xs, ds, bs = (t.detach().requires_grad_(True) for t in (x, delta, base))
        out = fn(xs, ds, bs)
        got = torch.autograd.grad(out, (xs, ds, bs), go)
        errs = [float((a.float() - b).norm() / b.norm()) for a, b in zip((out, *got), (ref, *ref_grads))]
        print(f"{name}: rel err out {errs[0]:.2e} dx {errs[1]:.2e} d delta {errs[2]:.2e} d base {errs[3]:.2e}")
        rows.append((name, errs))
    times: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in forms.items():
            times.setdefault(name, []).extend(timed(fn, x, delta, base, go, device, args.iters))
    # the backward's tile rows x warps (conv_triton.BWD_CONFIG); the best is written for the step run that follows
    ladder: dict[tuple[int, int], float] = {}
    for config in ((32, 4), (32, 8), (16, 4), (16, 8), (64, 8)):
        conv_triton.BWD_CONFIG = config
        ladder[config] = timed(forms["triton"], x, delta, base, go, device, args.iters)[1]
    best = min(ladder, key=ladder.__getitem__)
    print("triton fwd+bwd by backward config: " + ", ".join(f"{r}:{w} {ms:.3f}" for (r, w), ms in ladder.items()))
    torch_ms = min(times["torch (compiled)"][1::2])
    if args.best_out and ladder[best] < torch_ms:
        Path(args.best_out).write_text(f"{best[0]}:{best[1]}")
    print(f"best {best[0]}:{best[1]} {ladder[best]:.3f} ms against torch {torch_ms:.3f}")
    print(f"\nconvolution x [{R}, {Q}, {H}] bf16, K={K}, groups of {GS}; ms, two interleaved medians")
    print(f"{'form':<18} {'fwd':>14} {'fwd+bwd':>14} {'max rel err':>12}")
    for name, errs in rows:
        t = times[name]
        print(f"{name:<18} {t[0]:6.3f}/{t[2]:6.3f} {t[1]:6.3f}/{t[3]:6.3f} {max(errs):12.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
