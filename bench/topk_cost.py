"""Issue 32 item 4 (bench/results/kernels.md 2026-12-04): DFlash2's unary top-k inside the fused CE kernel, against torch.topk, on the H200.

    python3 bench/topk_cost.py [--rows 3968] [--topk 16] [--iters 10]

One chunk of the qwen3-8b seed shape's loss (bf16 logits [rows, 151936]), two logit distributions: N(0, 1)
(unordered rows: the running top-k takes the most insertions) and a drafter-like one (N(0, 1) plus a Zipf-ish
bias falling with the column: the row's best are spread over the first tiles). Parity: the kernel's values equal
torch.topk's (bit for bit), its ids equal a stable descending sort's (ties to the lower column); CE outputs equal
the plain kernel's. Timing (CUDA events, median): plain fused_ce, fused_ce_topk, fused_ce + torch.topk + gather
(what dflash_loss ran before). Table last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.bench.bench_common import time_ms
from trainer.kernels.loss_triton import fused_ce, fused_ce_topk

VOCAB = 151936


def logits_of(kind: str, rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, VOCAB, device="cuda", generator=g)
    if kind == "zipf":
        x = x + 4.0 - torch.log1p(torch.arange(VOCAB, device="cuda", dtype=torch.float32)) * 0.5
    return (x * 2).to(torch.bfloat16)


def measure(kind: str, rows: int, k: int, iters: int) -> tuple[dict[str, list[float]], bool]:
    """Parity lines for one logit distribution, then {variant: [median ms, median ms]} (interleaved), parity."""
    device = torch.device("cuda")
    x = logits_of(kind, rows)
    labels = torch.randint(0, VOCAB, (rows,), device="cuda")
    grad, lse, ce, argmax, values, ids = fused_ce_topk(x, labels, k)
    plain = fused_ce(x, labels)
    same_ce = all(torch.equal(a, b) for a, b in zip((grad, lse, ce, argmax), plain))
    ref_values = x.float().topk(k, dim=-1).values
    ref_ids = torch.sort(x.float(), dim=-1, descending=True, stable=True).indices[:, :k]
    ties = int((ref_values[:, 1:] == ref_values[:, :-1]).any(dim=1).sum())
    values_ok, ids_ok = torch.equal(values, ref_values), torch.equal(ids, ref_ids)
    torch_ids = float((x.topk(k, dim=-1).indices == ref_ids).float().mean())
    print(
        f"{kind}: values==topk {values_ok}, ids==stable sort {ids_ok}, CE outputs == plain {same_ce}, "
        f"rows with ties in the top {ties}/{rows}, torch.topk ids == stable sort {torch_ids:.4f}"
    )

    def old() -> None:  # what dflash_loss ran before: the plain kernel, then a sort-based topk and a gather
        fused_ce(x, labels)
        x.gather(1, x.topk(k, dim=-1).indices).float()

    variants = {"plain": lambda: fused_ce(x, labels), "in-kernel": lambda: fused_ce_topk(x, labels, k), "old": old}
    times: dict[str, list[float]] = {}
    for _ in range(2):
        for name, fn in variants.items():
            times.setdefault(name, []).append(statistics.median(time_ms(fn, device, warmup=2, iters=iters)))
    return times, values_ok and ids_ok and same_ce


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=3968)  # the seed shape's chunk: 31806 rows in 8 of ~3968
    parser.add_argument("--topk", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    table = [(kind, *measure(kind, args.rows, args.topk, args.iters)) for kind in ("normal", "zipf")]
    print(f"\nchunk [{args.rows}, {VOCAB}] bf16, top-{args.topk}, ms (two interleaved medians each)")
    print(f"{'logits':<8} {'plain CE':>14} {'CE+topk kernel':>16} {'CE + torch.topk':>16} {'parity':>7}")
    for kind, t, ok in table:
        cells = ["/".join(f"{v:.3f}" for v in t[name]) for name in ("plain", "in-kernel", "old")]
        print(f"{kind:<8} {cells[0]:>14} {cells[1]:>16} {cells[2]:>16} {ok!s:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
