"""Issue 31, items 2 and 5 (bench/results/kernels.md 2026-12-03): our Triton interval attention against flex_attention on the H200.

    python3 bench/attention_vs_flex.py                 # parity + interleaved timing, both shapes; table last
    DFLASH_SMEM_LIMIT=99K python3 bench/attention_vs_flex.py --fit-only --ref-dir DIR   # the ~100 KB rehearsal

Shapes: qwen3-8b seed (6 x 8192 context, 171 anchors x 32) and specforge (2 x 768, 256 x 16); 32 q / 8 kv heads x
128, bf16, inputs in the layer's own layout (transposed views of [R, L, h, D]), sorted anchors. Parity: triton
against flex (both bf16) and, at the specforge shape, both against an fp32 dense reference. Timing: forward and
forward+backward, flex then triton then flex then triton (the GPU drifts), CUDA events, median of 10.
--fit-only: the kernels under the forced limit: which rung each took, its compiled `metadata.shared`, and the
outputs against those saved by the full run (--ref-dir), plus the CE loss kernel and `--loss-kernels auto`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import SHAPES, synthetic_batch
from trainer.bench.bench_common import time_ms as bench_time_ms
from trainer.kernels import attention_triton as T
from trainer.kernels import triton_fit
from trainer.model import attention as A

HQ, HKV, D = 32, 8, 128


def inputs(shape_name: str, seed: int = 0):
    shape = SHAPES[shape_name]
    from trainer.bench.bench_common import preset_config

    _, dcfg = preset_config("qwen3-8b", shape, [])
    batch = synthetic_batch(dcfg, shape, 4.0, torch.device("cuda"), sorted_anchors=True, seed=seed)
    R, S, N, B = shape.rows, shape.ctx, shape.anchors, shape.block
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(R, N * B, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k = torch.randn(R, S + N * B, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    v = torch.randn(R, S + N * B, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    go = torch.randn(R, HQ, N * B, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return batch, shape, q, k, v, go


def masks(batch, shape):
    flex = A.build_draft_mask(batch.anchors, batch.keep, shape.ctx, shape.block, backend="flex")
    tri = A.build_draft_mask(batch.anchors, batch.keep, shape.ctx, shape.block, backend="triton")
    return flex, tri


def run(q, k, v, go, mask, backward: bool):
    q, k, v = (t.detach().requires_grad_(backward) for t in (q, k, v))
    out = A.attend(q, k, v, mask, A.FULL)
    if not backward:
        return out, None
    out.backward(go)
    return out, (q.grad, k.grad, v.grad)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def time_ms(fn) -> float:
    """Median of 10 timed calls after 2 warm-up calls (bench_common's CUDA-event timer)."""
    return statistics.median(bench_time_ms(fn, torch.device("cuda"), warmup=2, iters=10))


def dense_reference(q, k, v, go, batch, shape):
    q, k, v = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    m = A.build_draft_mask(batch.anchors, batch.keep, shape.ctx, shape.block, backend="dense")
    out = A.attend(q, k, v, m, A.FULL)
    out.backward(go.float())
    return out, (q.grad, k.grad, v.grad)


def full(args) -> None:
    table = []
    for name in ("specforge", "seed"):
        batch, shape, q, k, v, go = inputs(name)
        flex, tri = masks(batch, shape)
        of, gf = run(q, k, v, go, flex, True)
        ot, gt = run(q, k, v, go, tri, True)
        torch.cuda.synchronize()
        errs = {"o": rel(ot, of), "dq": rel(gt[0], gf[0]), "dk": rel(gt[1], gf[1]), "dv": rel(gt[2], gf[2])}
        print(f"{name}: triton vs flex rel err {errs}", flush=True)
        if name == "specforge":
            od, gd = dense_reference(q, k, v, go, batch, shape)
            for label, (o, g) in (("flex", (of, gf)), ("triton", (ot, gt))):
                print(
                    f"{name}: {label} vs fp32 dense: o {rel(o, od):.2e} dq {rel(g[0], gd[0]):.2e} "
                    f"dk {rel(g[1], gd[1]):.2e} dv {rel(g[2], gd[2]):.2e}",
                    flush=True,
                )
            del od, gd
            if args.ref_dir:
                torch.save({"o": ot.cpu(), "g": [t.cpu() for t in gt]}, Path(args.ref_dir) / "specforge.pt")
        # a second draw: the same function on fresh inputs
        batch2, _, q2, k2, v2, go2 = inputs(name, seed=1)
        f2, t2 = masks(batch2, shape)
        o2f, g2f = run(q2, k2, v2, go2, f2, True)
        o2t, g2t = run(q2, k2, v2, go2, t2, True)
        print(
            f"{name} seed 1: o {rel(o2t, o2f):.2e} dq {rel(g2t[0], g2f[0]):.2e} dk {rel(g2t[1], g2f[1]):.2e}",
            flush=True,
        )
        res = {}
        for _round in range(2):
            for label, mask in (("flex", flex), ("triton", tri)):
                fwd = time_ms(lambda m=mask: run(q, k, v, go, m, False))
                both = time_ms(lambda m=mask: run(q, k, v, go, m, True))
                res.setdefault(label, []).append((fwd, both))
        build = {}
        for label, backend in (("flex", "flex"), ("triton", "triton")):
            build[label] = time_ms(
                lambda b=backend: A.build_draft_mask(batch.anchors, batch.keep, shape.ctx, shape.block, backend=b)
            )
        for label, runs in res.items():
            for rnd, (fwd, both) in enumerate(runs):
                table.append((name, label, rnd, fwd, both - fwd, (both - fwd) / fwd, build[label]))
        print(f"chosen: {triton_fit.chosen('attention-fwd')} {triton_fit.chosen('attention-bwd')}", flush=True)
    print(f"{'shape':<10} {'kernel':<7} {'run':>3} {'fwd ms':>8} {'bwd ms':>8} {'bwd/fwd':>7} {'mask ms':>8}")
    for row in table:
        print(f"{row[0]:<10} {row[1]:<7} {row[2]:>3} {row[3]:8.3f} {row[4]:8.3f} {row[5]:7.2f} {row[6]:8.3f}")


def shared_of(name, kernel, configs, launch, index):
    grid, a, kw = launch(configs[index])
    return int(kernel.warmup(*a, grid=grid, **kw).metadata.shared)


def fit_only(args) -> None:
    limit = triton_fit.smem_limit(torch.device("cuda"))
    print(f"forced limit: {limit} B", flush=True)
    print("attention usable:", T.usable(torch.device("cuda")), flush=True)
    batch, shape, q, k, v, go = inputs("specforge")
    _, tri = masks(batch, shape)
    ot, gt = run(q, k, v, go, tri, True)
    torch.cuda.synchronize()
    print("chosen fwd", triton_fit.chosen("attention-fwd"), "bwd", triton_fit.chosen("attention-bwd"))
    _, fwd, bwd = T._kernels()
    R, H, n_q, _ = q.shape
    for _key, index in triton_fit.chosen("attention-fwd").items():
        c = T.fwd_ladder()[index]
        o = torch.empty(R, H, n_q, D, dtype=q.dtype, device="cuda")
        lse = torch.empty(R, H, n_q, device="cuda")
        tb = tri.triton[A.FULL]
        a = (
            q,
            k,
            v,
            o,
            lse,
            tb.ctx_lo,
            tb.ctx_hi,
            tb.blk_lo,
            tb.blk_hi,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            n_q,
            k.shape[2],
            tb.ctx_lo.shape[1],
            H,
            H // k.shape[1],
            1.0,
        )
        kw = c.launch_kwargs(D)
        print(f"fwd rung {index} {c}: shared {int(fwd.warmup(*a, grid=(1, 1), **kw).metadata.shared)} B", flush=True)
        for j, c0 in enumerate(T.fwd_ladder()[:index]):
            kw0 = c0.launch_kwargs(D)
            print(f"  refused rung {j} {c0}: shared {int(fwd.warmup(*a, grid=(1, 1), **kw0).metadata.shared)} B")
    for _key, index in triton_fit.chosen("attention-bwd").items():
        print(f"bwd rung {index} {T.bwd_ladder()[index]}")  # the ladder $DFLASH_ATTENTION_BWD_CONFIG may lead
    if args.ref_dir and (Path(args.ref_dir) / "specforge.pt").exists():
        ref = torch.load(Path(args.ref_dir) / "specforge.pt")
        print(
            f"99K vs default configs: o {rel(ot.cpu(), ref['o']):.2e} "
            + " ".join(f"{n} {rel(g.cpu(), r):.2e}" for n, g, r in zip(("dq", "dk", "dv"), gt, ref["g"]))
        )
    from trainer.kernels.loss_triton import fused_ce
    from trainer.training.loss import resolve_loss_kernels

    print("loss kernels auto ->", resolve_loss_kernels("auto", torch.device("cuda"), True))
    print(
        "loss kernels auto, soft labels ->", resolve_loss_kernels("auto", torch.device("cuda"), True, soft_labels=True)
    )
    logits = torch.randn(512, 151936, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 151936, (512,), device="cuda")
    grad, lse, ce, _ = fused_ce(logits, labels)
    ref_ce = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")
    print(f"ce kernel rung {triton_fit.chosen('ce')}: ce rel err {rel(ce, ref_ce):.2e}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fit-only", action="store_true")
    p.add_argument("--ref-dir", default="")
    a = p.parse_args()
    fit_only(a) if a.fit_only else full(a)
