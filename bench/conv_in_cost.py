"""Issue 32 item 4 (bench/results/kernels.md 2026-12-05): the input-side convolution's kernel gradients through
trainer/kernels/conv_in_triton.py against Inductor's code for the same gradients, on the H200 at one call's shape of
the qwen3-8b seed step: x (the residual stream) and the GEMMs' input-gradient pieces [6, 5472, 4096] bf16 (171
blocks of 32 a row; 2 pieces as the MLP's gate/up, 3 as attention's q/k/v), rstd [6, 5472, 1] float32, the norm
weight float32, K = 2 taps, groups of 16, the deltas a strided view of the [6, 5472, 2, 2, 256] projection.

    python3 bench/conv_in_cost.py [--iters 20] [--best-out FILE] [--dry-run]

Forms, for 2 and 3 pieces: "inductor" = the op's three gradients (d delta, d base, and the norm weight's gradient
through the convolution, sum of dn * xhat) as torch code, g the float32 sum of the pieces, xhat = x * rstd
recomputed, torch.compile'd (Inductor fuses the sum and the recompute into its reductions; in the layer the old form
computed these inside the layer's own kernels, so this is a like-for-like of the op, not of the step); "triton" =
the kernel on the same pieces. Parity: relative errors of d delta and d base against float32 autograd (n as the
compiled layer computes it: inductor_xhat), and the kernel's bits against Inductor's. Timing: back to back (a
queue, one sync: the step's situation), interleaved twice; then the kernel's ladder (2 pieces). Table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the CPU has no Triton driver: the interpreter, set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import back_to_back_ms
from trainer.kernels import conv_in_triton, triton_fit
from trainer.kernels.conv_grad import conv_gradients
from trainer.model.dflash2 import grouped_dynamic_conv

R, Q, H, B, GS, K = 6, 171 * 32, 4096, 32, 16, 2
LADDER = [(2, 2, 16, 24), (4, 4, 16, 12), (4, 4, 16, 8), (2, 4, 16, 24), (2, 4, 16, 12), (4, 8, 32, 6), (2, 2, 16, 12)]


def kernel_grads(g, x, rstd, w, delta, base):
    """The op's three gradients in torch (compiled: Inductor's code for them); xhat as Inductor computes it."""
    xhat = conv_in_triton.inductor_xhat(x, rstd)
    dn, dd, db = conv_gradients(g, w * xhat, delta, base, B, GS)
    return dd, db, (dn * xhat).sum((0, 1))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--best-out", default="")
    parser.add_argument("--dry-run", action="store_true", help="CPU, 2 x 64 rows x 256, through the Triton interpreter")
    args = parser.parse_args()
    global R, Q, H
    if args.dry_run:
        R, Q, H = 2, 64, 256
    device = torch.device("cpu" if args.dry_run else "cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(R, Q, H, device=device, generator=gen) * 3).to(torch.bfloat16)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    w = torch.rand(H, device=device, generator=gen) + 0.5
    kernels = (torch.randn(R, Q, 2, K, H // GS, device=device, generator=gen) * 0.1).to(torch.bfloat16)
    delta = kernels[..., 0, :, :]
    base = torch.randn(K, H, device=device, generator=gen) * 0.5 + 0.5
    pieces = [torch.randn(R, Q, H, device=device, generator=gen).to(torch.bfloat16) for _ in range(3)]

    compiled = torch.compile(kernel_grads)

    def forms(np: int) -> dict:
        ps = pieces[:np]
        return {
            f"inductor x{np}": lambda: compiled(sum(p.float() for p in ps), x, rstd, w, delta, base),
            f"triton x{np}": lambda: conv_in_triton.conv_prepare_kernel_grads(ps, x, rstd, w, delta, base, B),
        }

    def use(config) -> None:
        conv_in_triton.CONFIGS[:] = [config]
        triton_fit._VERDICT.clear()

    use(LADDER[0])
    runs = {**forms(2), **forms(3)}
    for np in (2, 3):
        g = sum(p.float() for p in pieces[:np])
        xhat = conv_in_triton.inductor_xhat(x, rstd)  # the compiled layer's
        rw, rd, rb = (t.detach().float().requires_grad_(True) for t in (w, delta, base))
        ref = torch.autograd.grad(grouped_dynamic_conv(rw * xhat, rd, rb, block_size=B, group_size=GS), (rd, rb, rw), g)
        got = {name: runs[name]() for name in (f"inductor x{np}", f"triton x{np}")}
        for name, outs in got.items():
            errs = [float((a.float() - b).norm() / b.norm()) for a, b in zip(outs, ref, strict=True)]
            print(f"{name}: rel err vs fp32 autograd: d delta {errs[0]:.2e} d base {errs[1]:.2e} d w {errs[2]:.2e}")
        (td, tb, tw), (idd, ib, iw) = got[f"triton x{np}"], got[f"inductor x{np}"]
        base_rel, w_rel = (float((a - b).norm() / b.norm()) for a, b in ((tb, ib), (tw, iw)))
        print(
            f"triton vs inductor x{np}: d delta {int((td.float() != idd.float()).sum())} of {td.numel()} elements "
            f"differ; d base relative {base_rel:.2e}, d w {w_rel:.2e}"
        )
        del got, ref, rw, rd, rb, g, xhat
    times: dict[str, list[float]] = {}
    for fn in runs.values():
        fn()
    for _ in range(2):
        for name, fn in runs.items():
            use(LADDER[0])
            times.setdefault(name, []).append(back_to_back_ms(fn, device, args.iters))
    ladder: dict[tuple, float] = {}
    for config in LADDER:
        use(config)
        runs["triton x2"]()
        ladder[config] = min(back_to_back_ms(runs["triton x2"], device, args.iters) for _ in range(2))
    best = min(ladder, key=ladder.__getitem__)
    print(
        "ladder, 2 pieces (back to back ms): "
        + ", ".join(f"{':'.join(map(str, c))} {ms:.3f}" for c, ms in ladder.items())
    )
    if args.best_out:
        Path(args.best_out).write_text(":".join(map(str, best)))
    print(f"\none call: x, pieces [{R}, {Q}, {H}] bf16, K={K}, groups of {GS}")
    print(f"{'form':<14} {'back to back ms':>18} {'GB':>6} {'TB/s':>6}")
    for name in runs:
        np = int(name[-1])
        moved = ((np + 1) * R * Q * H * 2 + 2 * R * Q * K * (H // GS) * 2) / 1e9  # DRAM at least: pieces, x, deltas
        t = times[name]
        print(f"{name:<14} {t[0]:8.3f}/{t[1]:8.3f} {moved:6.3f} {moved / min(t) / 1e3:6.2f}")
    print(
        f"best rung {':'.join(map(str, best))}: {ladder[best]:.3f} ms (2 pieces) against Inductor's "
        f"{min(times['inductor x2']):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
