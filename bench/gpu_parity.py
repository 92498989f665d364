"""GPU parity: the flex_attention path (BlockMask + compiled flex, per device) against the dense SDPA reference.

Run on a CUDA machine from the repository root:   python bench/gpu_parity.py [--device cuda:0]

For every case it runs forward + backward in bf16 through both back-ends of trainer.model.attention and
compares each against a float32 dense reference; flex passes when its max abs error (output, dq, dk, dv; the
upstream gradient is random, so gradients are O(1)) is within 2x the bf16 dense path's own error + 0.2% of the
reference's max (both are bf16 roundings of the same math). Then the whole
drafter (bf16 weights, sliding + full layers, padded blocks) is compared flex vs dense, output and gradients.
Prints one table row per comparison; exit status 1 if anything fails, 2 if there is no CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model.attention import FULL, SLIDING, attend, build_draft_mask
from trainer.model.drafter import DFlashDrafter, DrafterConfig


@dataclass
class Case:
    name: str
    rows: int
    ctx: int  # S
    blocks: int  # N per row (the last `padded` of each row have keep=False)
    block: int  # B
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    causal: bool = False
    padded: int = 0
    docs: bool = False
    sort: bool = True


CASES = [
    Case("tiny-odd", 2, 77, 9, 4, 4, 2, 64, padded=3),  # nothing a multiple of 128
    Case("full-b16", 1, 1024, 64, 16, 8, 2, 128, padded=5),
    Case("sliding-causal", 2, 1024, 48, 16, 8, 2, 128, window=256, causal=True, padded=4),
    Case("full-causal-docs", 2, 600, 40, 8, 8, 8, 64, causal=True, docs=True),
    Case("unsorted", 1, 900, 50, 16, 8, 2, 128, sort=False),
    Case("b32-sliding", 1, 2048, 64, 32, 16, 4, 128, window=512, causal=True, padded=8),
]


def make_inputs(case: Case, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    anchors = torch.randint(1, case.ctx, (case.rows, case.blocks), generator=gen)
    if case.sort:
        anchors = anchors.sort(dim=1).values
    keep = torch.ones(case.rows, case.blocks, dtype=torch.bool)
    if case.padded:
        keep[:, -case.padded :] = False
        anchors[:, -case.padded :] = 0
    doc = None
    if case.docs:
        doc = (torch.rand(case.rows, case.ctx, generator=gen) < 0.01).cumsum(dim=1).to(device)
    return anchors.to(device), keep.to(device), doc


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def run_attention(mask, q, k, v, grad_out, layer_type: str, dtype: torch.dtype) -> list[torch.Tensor]:
    qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out = attend(qq, kk, vv, mask, layer_type)
    out.backward(grad_out.to(dtype))
    return [out.detach(), qq.grad, kk.grad, vv.grad]


def attention_case(case: Case, device: torch.device, gen: torch.Generator) -> list[tuple[str, list[float], bool]]:
    anchors, keep, doc = make_inputs(case, device, gen)
    layer_type = SLIDING if case.window else FULL
    kw = dict(
        sliding_window=case.window,
        causal_full=case.causal,
        causal_sliding=case.causal,
        doc_ids=doc,
        layer_types=[layer_type],
    )
    dense = build_draft_mask(anchors, keep, case.ctx, case.block, backend="dense", **kw)
    flex = build_draft_mask(anchors, keep, case.ctx, case.block, backend="flex", **kw)
    q_len, kv_len = case.blocks * case.block, case.ctx + case.blocks * case.block
    q = torch.randn(case.rows, case.heads, q_len, case.head_dim, generator=gen).to(device)
    k = torch.randn(case.rows, case.kv_heads, kv_len, case.head_dim, generator=gen).to(device)
    v = torch.randn(case.rows, case.kv_heads, kv_len, case.head_dim, generator=gen).to(device)
    grad_out = torch.randn(case.rows, case.heads, q_len, case.head_dim, generator=gen).to(device)  # O(1) grads
    ref = run_attention(dense, q, k, v, grad_out, layer_type, torch.float32)
    dense_bf16 = run_attention(dense, q, k, v, grad_out, layer_type, torch.bfloat16)
    flex_bf16 = run_attention(flex, q, k, v, grad_out, layer_type, torch.bfloat16)
    dense_err = [max_err(a, b) for a, b in zip(dense_bf16, ref)]
    flex_err = [max_err(a, b) for a, b in zip(flex_bf16, ref)]
    scale = [t.abs().max().item() for t in ref]
    ok = all(f <= 2 * d + 2e-3 * s for f, d, s in zip(flex_err, dense_err, scale))
    ok = ok and all(torch.isfinite(t).all().item() for t in flex_bf16)
    return [(f"{case.name} dense-bf16", dense_err, True), (f"{case.name} flex-bf16", flex_err, ok)]


def drafter_case(device: torch.device, gen: torch.Generator) -> tuple[str, list[float], bool]:
    """Whole drafter (sliding + full layers, padded blocks): bf16 flex and bf16 dense, each against an fp32 dense
    copy of the same weights; output and three parameter gradients, relative to the reference's max. A bf16
    model's gradients differ from fp32 by a few percent on their own, so flex passes when its error is within
    2x the bf16 dense path's error + 1e-2 (the same rule as the attention rows)."""
    cfg = DrafterConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        block_size=16,
        target_layer_ids=[1, 3, 5],
        num_target_layers=8,
        mask_token_id=999,
        layer_types=[SLIDING, SLIDING, FULL],
        sliding_window=128,
    )
    torch.manual_seed(0)
    reference = DFlashDrafter(cfg).to(device=device, dtype=torch.float32)
    R, S, N = 2, 700, 40
    anchors = torch.randint(1, S, (R, N), generator=gen).sort(dim=1).values.to(device)
    keep = torch.ones(R, N, dtype=torch.bool, device=device)
    keep[1, -7:] = False
    ctx = torch.randn(R, S, 3 * 512, generator=gen).to(device)
    emb = torch.randn(R, N * 16, 512, generator=gen).to(device)

    def run(dtype: torch.dtype, backend: str) -> list[torch.Tensor]:
        model = DFlashDrafter(cfg).to(device=device, dtype=dtype)
        model.load_state_dict(reference.state_dict())
        out = model(ctx.to(dtype), emb.to(dtype), anchors, keep, model.build_mask(anchors, keep, S, backend=backend))
        out.float().square().mean().backward()
        grads = [
            model.fc.weight.grad,
            model.layers[0].self_attn.k_proj.weight.grad,
            model.layers[2].mlp.down_proj.weight.grad,
        ]
        return [out.detach().float()] + [g.detach().float() for g in grads]

    ref = run(torch.float32, "dense")
    errors = {
        b: [max_err(x, r) / max(r.abs().max().item(), 1e-6) for x, r in zip(run(torch.bfloat16, b), ref)]
        for b in ("dense", "flex")
    }
    ok = all(f <= 2 * d + 1e-2 for f, d in zip(errors["flex"], errors["dense"]))
    dense_txt = " ".join(f"{e:.1e}" for e in errors["dense"])
    return (f"drafter flex vs fp32 (rel; dense-bf16: {dense_txt})", errors["flex"], ok)


def time_flex_layer(device: torch.device, gen: torch.Generator) -> str:
    """The attention shape of docs/method.md#reference-figures, flex fwd+bwd per layer (S=8192, N=1024 x B=32,
    32/8 heads x 128), sorted anchors."""
    S, N, B = 8192, 1024, 32
    anchors = torch.randint(1, S, (1, N), generator=gen).sort(dim=1).values.to(device)
    keep = torch.ones(1, N, dtype=torch.bool, device=device)
    out = []
    for lt, window in ((FULL, None), (SLIDING, 2048)):
        mask = build_draft_mask(anchors, keep, S, B, sliding_window=window, backend="flex", layer_types=[lt])
        q = torch.randn(1, 32, N * B, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 8, S + N * B, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        for i in range(6):  # 3 warm-up iterations (compile), 3 timed
            if i == 3:
                torch.cuda.synchronize()
                start = time.perf_counter()
            attend(q, k, v, mask, lt).sum().backward()
        torch.cuda.synchronize()
        out.append(f"{lt} {(time.perf_counter() - start) / 3 * 1e3:.1f} ms")
    return "flex fwd+bwd per layer (S=8192, 1024x32 anchors, sorted): " + ", ".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-timing", action="store_true", help="skip the full-size timing line")
    parser.add_argument("--drafter-only", action="store_true", help="only the whole-drafter comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA device; flex_attention parity needs a GPU", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # Every case is a new static shape, i.e. a recompile: lift the limit (8) so flex never falls back to the
    # unfused path, and make that fallback's warning fatal so a PASS always means compiled flex.
    torch._dynamo.config.cache_size_limit = 64
    warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    gen = torch.Generator().manual_seed(0)
    rows: list[tuple[str, list[float], bool]] = []
    for case in [] if args.drafter_only else CASES:
        rows.extend(attention_case(case, device, gen))
    rows.append(drafter_case(device, gen))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}")
    print(f"{'comparison':<34} {'out':>9} {'d_1':>9} {'d_2':>9} {'d_3':>9}  result")
    for name, errs, ok in rows:
        print(f"{name:<34} " + " ".join(f"{e:9.2e}" for e in errs) + f"  {'PASS' if ok else 'FAIL'}")
    print(
        "(attention rows: max abs error vs fp32 dense of out, dq, dk, dv; drafter row: out, d fc, d k_proj[0], "
        "d down_proj[2], relative)"
    )
    if not args.no_timing:
        print(time_flex_layer(device, gen))
    failed = [name for name, _, ok in rows if not ok]
    if failed:
        print(f"FAIL: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
