"""Issue 32 item 4 (bench/results/kernels.md 2026-12-05): the output-side convolution's backward through trainer/kernels/conv_bwd_triton.py
against Inductor's code for the same gradients (GroupedDynamicConv's torch backward, `conv_gradients`,
torch.compile'd alone), on the H200 at one call's shape of the qwen3-8b seed step: g, y [6, 5472, 4096] bf16 (171
blocks of 32 per row), K = 2 taps, groups of 16, the deltas a strided view of the [6, 5472, 2, 2, 256] projection.

    python3 bench/conv_bwd_cost.py [--iters 20] [--best-out FILE]

Parity: both against float32 autograd through grouped_dynamic_conv (relative error of dy, d delta, d base), and
the kernel against Inductor's bf16 outputs (elements that differ, in bf16 steps). Timing (ms, interleaved twice):
per call with a sync (median) and back to back (mean of a queue, one sync: the step's situation, where the host
is ahead). Then the kernel's configuration ladder; the fastest is written to FILE when it beats Inductor (the step
bench that follows puts it first: $DFLASH_CONV_BWD_CONFIG). Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import back_to_back_ms, time_ms
from trainer.kernels import conv_bwd_triton, triton_fit
from trainer.kernels.conv_grad import conv_gradients
from trainer.model.dflash2 import grouped_dynamic_conv

R, Q, H, B, GS, K = 6, 171 * 32, 4096, 32, 16, 2
LADDER = [
    (4, 4, 16, 8),
    (4, 4, 16, 12),
    (2, 4, 16, 12),
    (2, 4, 16, 24),
    (4, 8, 32, 4),
    (4, 8, 32, 6),
    (8, 4, 16, 10),
    (2, 2, 16, 24),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--best-out", default="")
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 x 64 rows x 256 (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    global R, Q, H
    if args.dry_run:
        R, Q, H = 2, 64, 256
    device = torch.device("cpu" if args.dry_run else "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    y = torch.randn(R, Q, H, device=device, generator=gen).to(torch.bfloat16)
    kernels = (torch.randn(R, Q, 2, K, H // GS, device=device, generator=gen) * 0.1).to(torch.bfloat16)
    delta = kernels[..., 1, :, :]
    base = torch.randn(K, H, device=device, generator=gen) * 0.5 + 0.5
    g = torch.randn(R, Q, H, device=device, generator=gen).to(torch.bfloat16)

    inductor = torch.compile(conv_gradients)

    def run_inductor():
        return inductor(g, y, delta, base, B, GS)

    def run_triton():
        return conv_bwd_triton.conv_finish_backward(g, y, delta, base, B)

    def use(config) -> None:
        conv_bwd_triton.CONFIGS[:] = [config]
        triton_fit._VERDICT.clear()

    use(LADDER[0])
    ry, rd, rb = (t.detach().float().requires_grad_(True) for t in (y, delta, base))
    ref_out = grouped_dynamic_conv(ry, rd, rb, block_size=B, group_size=GS)
    ref = torch.autograd.grad(ref_out, (ry, rd, rb), g.float())
    del ref_out, ry, rd, rb
    got = {"inductor": run_inductor(), "triton": run_triton()}
    errs = {}
    for name, outs in got.items():
        errs[name] = [float((a.float() - b).norm() / b.norm()) for a, b in zip(outs, ref, strict=True)]
        print(
            f"{name}: rel err vs fp32 autograd: dy {errs[name][0]:.2e} d delta {errs[name][1]:.2e} "
            f"d base {errs[name][2]:.2e}"
        )
    for key, a, b in zip(("dy", "d delta"), got["triton"][:2], got["inductor"][:2], strict=True):
        diff = a.float() != b.float()
        steps = ((a.float() - b.float()).abs() / b.float().abs().clamp_min(1e-2) * 128).max()
        print(
            f"triton vs inductor {key}: {int(diff.sum())} of {diff.numel()} elements differ, "
            f"at most {float(steps):.2f} bf16 steps (relative)"
        )
    del ref, got
    moved = (3 * R * Q * H * 2 + 2 * R * Q * K * (H // GS) * 2) / 1e9
    times: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in (("inductor", run_inductor), ("triton", run_triton)):
            use(LADDER[0])
            times.setdefault(name, []).append(statistics.median(time_ms(fn, device, warmup=3, iters=args.iters)))
            times.setdefault(name + " b2b", []).append(back_to_back_ms(fn, device, args.iters))
    ladder: dict[tuple, float] = {}
    for config in LADDER:
        use(config)
        fn_times = [back_to_back_ms(run_triton, device, args.iters) for _ in range(2)]
        ladder[config] = min(fn_times)
    best = min(ladder, key=ladder.__getitem__)
    inductor_ms = min(times["inductor b2b"])
    print("ladder (back to back ms): " + ", ".join(f"{':'.join(map(str, c))} {ms:.3f}" for c, ms in ladder.items()))
    if args.best_out and ladder[best] < inductor_ms:
        Path(args.best_out).write_text(":".join(map(str, best)))
    print(f"\none call: g, y [{R}, {Q}, {H}] bf16, K={K}, groups of {GS}; {moved:.3f} GB moved at least")
    print(f"{'form':<22} {'per call ms':>16} {'back to back ms':>18} {'TB/s (b2b)':>11}")
    for name in ("inductor", "triton"):
        t, b = times[name], times[name + " b2b"]
        print(f"{name:<22} {t[0]:7.3f}/{t[1]:7.3f} {b[0]:8.3f}/{b[1]:8.3f} {moved / min(b) / 1e3:11.2f}")
    print(
        f"best rung {':'.join(map(str, best))}: {ladder[best]:.3f} ms back to back, {moved / ladder[best] / 1e3:.2f} TB/s; "
        f"x {ladder[best] / inductor_ms:.2f} of Inductor's {inductor_ms:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
