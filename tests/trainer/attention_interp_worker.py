"""Child process of tests/trainer/test_attention_triton.py: our Triton interval attention under Triton's CPU
interpreter (TRITON_INTERPRET=1 is set here only, before any kernel is defined), float64, against the dense
back-end. Prints one JSON line: per case, the relative errors of o, dq, dk, dv and which configuration rungs ran.
Usage: python attention_interp_worker.py [--forced-limit]   (the latter sets $DFLASH_SMEM_LIMIT first and runs
FORCED_LIMIT_CASES only)
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"
if "--forced-limit" in sys.argv:
    os.environ["DFLASH_SMEM_LIMIT"] = "99K"

import torch

from trainer.kernels import triton_fit
from trainer.model import attention as A

# name: (rows, q heads, kv heads, head dim, context, blocks, block size, sorted, window, causal, doc ids, padded)
CASES = {
    "gqa-sorted": (2, 4, 2, 16, 150, 5, 8, True, None, False, False, True),
    "causal-unsorted": (2, 2, 1, 16, 140, 6, 8, False, None, True, False, False),
    "sliding": (1, 2, 2, 16, 200, 4, 8, True, 24, True, False, False),
    "packed-docs": (2, 2, 1, 16, 130, 4, 8, True, None, False, True, False),
    "anchor-at-zero": (1, 2, 1, 16, 70, 3, 16, True, None, False, False, False),
    # long enough for full (key tile, query tile) pairs beside partial ones; padded rows make their tiles partial.
    # Two q heads on one kv head: the smallest group that walks a second head through every pair (run_schedules'
    # 11 configurations run here: 4 q heads cost twice the interpreter time, ~7 CPU-s, and reached nothing more)
    "full-tiles": (1, 2, 1, 16, 400, 24, 8, True, None, False, False, True),
}


def _inputs(name: str, seed: int | None = None):
    R, hq, hkv, d, S, N, B, ordered, window, causal, docs, padded = CASES[name]
    gen = torch.Generator().manual_seed(len(name) if seed is None else seed)
    anchors = torch.stack([torch.randperm(S - B, generator=gen)[:N] for _ in range(R)])
    if ordered:
        anchors = anchors.sort(dim=1).values
    if name == "anchor-at-zero":
        anchors[0, 0] = 0
    keep = torch.ones(R, N, dtype=torch.bool)
    if padded:
        keep[-1, -2:] = False
    doc_ids = torch.sort(torch.randint(0, 4, (R, S), generator=gen), dim=1).values if docs else None
    kw = dict(sliding_window=window, causal_full=causal, causal_sliding=causal, doc_ids=doc_ids)
    layer = A.SLIDING if window else A.FULL
    kw["layer_types"] = [layer]
    tri = A.build_draft_mask(anchors, keep, S, B, backend="triton", **kw)
    dense = A.build_draft_mask(anchors, keep, S, B, backend="dense", **kw)
    assert layer in tri.triton, "the interval form must be used"
    q = torch.randn(R, N * B, hq, d, dtype=torch.float64, generator=gen).transpose(1, 2).requires_grad_()
    k = torch.randn(R, hkv, S + N * B, d, dtype=torch.float64, generator=gen).requires_grad_()
    v = torch.randn(R, hkv, S + N * B, d, dtype=torch.float64, generator=gen).requires_grad_()
    go = torch.randn(R, hq, N * B, d, dtype=torch.float64, generator=gen)
    return tri, dense, layer, q, k, v, go


def run(name: str) -> dict:
    tri, dense, layer, q, k, v, go = _inputs(name)
    B, padded = CASES[name][6], CASES[name][11]
    results = []
    for mask in (tri, dense):
        out = A.attend(q, k, v, mask, layer)
        out.backward(go)
        results.append([out.detach(), q.grad, k.grad, v.grad])
        q.grad = k.grad = v.grad = None
    errs = {n: float((a - b).norm() / b.norm()) for n, a, b in zip(("o", "dq", "dk", "dv"), *results)}
    padded_rows_zero = bool((results[0][0][-1, :, -2 * B :] == 0).all()) if padded else True
    counts = tri.triton[layer].q_count
    pairs = {"full": int(counts[..., 0].sum()), "partial": int(counts[..., 1].sum())}
    return {**errs, "padded_rows_zero": padded_rows_zero, "pairs": pairs}


# Backward schedules besides the ladder's first (keys per program, query rows per step, BwdConfig flags: "t" dQ
# transposed, "f" the scale folded into P, "o" the matmuls reordered); dQ by atomics (the TMA reduce has no interpreter: GPU parity covers it,
# bench/attention_bwd_schedules.py).
SCHEDULES = [
    (128, 32, ""),
    (64, 64, ""),
    (64, 32, ""),
    (32, 32, ""),
    (128, 64, "t"),
    (128, 64, "f"),
    (128, 64, "o"),
    (64, 32, "tfo"),
]


def _fwd_split():
    from trainer.kernels import attention_triton as T

    # split (the default) at two tile shapes, and the fully masked walk
    return [T.FwdConfig(32, 32, 4, 1, True), T.FwdConfig(64, 128, 4, 1, True), T.FwdConfig(64, 64, 4, 1, False)]


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty hands out NaN-filled memory: an output element the kernels fail to write shows as NaN."""
    real = torch.empty

    def empty(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    with mock.patch.object(torch, "empty", empty):
        yield


def run_schedules(name: str) -> dict:
    """Each of SCHEDULES through trainer.kernels.attention_triton.backward directly, on a fresh random draw (its seed
    and the table's pair counts in the result), outputs poisoned first, against the dense back-end's gradients:
    {schedule: max rel err over dq, dk, dv}."""
    from trainer.kernels import attention_triton as T

    FWD_SPLIT = _fwd_split()
    while True:  # "full-tiles" draws until its table has a full pair (a third of the draws have none)
        seed = int.from_bytes(os.urandom(4), "little")
        tri, dense, layer, q, k, v, go = _inputs(name, seed)
        counts = tri.triton[layer].q_count
        pairs = {"full": int(counts[..., 0].sum()), "partial": int(counts[..., 1].sum())}
        if name != "full-tiles" or pairs["full"] > 0:
            break
    out = A.attend(q, k, v, dense, layer)
    out.backward(go)
    ref = (q.grad, k.grad, v.grad)
    table = tri.triton[layer]
    scale = q.shape[-1] ** -0.5
    qd, kd, vd = (t.detach() for t in (q, k, v))
    errs = {}
    with poisoned_empty():
        o, lse = T.forward(qd, kd, vd, table.ctx_lo, table.ctx_hi, table.blk_lo, table.blk_hi, scale)
        for block_n, block_m, flags in SCHEDULES:
            config = T.BwdConfig(block_n, block_m, 4, 1, "atomic", flags)
            got = T.backward(go, qd, kd, vd, o, lse, table, scale, config=config)
            name = f"{block_n}x{block_m}{'-' + flags if flags else ''}"
            errs[name] = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
    errs["o"] = float((o - out.detach()).norm() / out.detach().norm())
    for c in FWD_SPLIT:  # o against dense, lse against the default rung's
        o2, lse2 = T.forward(qd, kd, vd, table.ctx_lo, table.ctx_hi, table.blk_lo, table.blk_hi, scale, config=c)
        name = f"o-{'split' if c.split else 'masked'}-{c.block_m}x{c.block_n}"
        errs[name] = max(float((o2 - out.detach()).norm() / out.detach().norm()), float((lse2 - lse).abs().max()))
    return {"seed": seed, "pairs": pairs, "errs": errs}


def run_mixed_dtypes() -> dict:
    """q, k float64 and v float32 (as fp32 q/k from the norms with bf16 v in the autocast step): the result of the
    all-float32 computation, gradients in each input's dtype; the kernels themselves refuse mixed dtypes."""
    R, hq, hkv, d, S, N, B = 1, 2, 1, 16, 70, 3, 8
    gen = torch.Generator().manual_seed(7)
    anchors = torch.randperm(S - B, generator=gen)[:N].sort().values[None]
    tri = A.build_draft_mask(anchors, torch.ones(1, N, dtype=torch.bool), S, B, backend="triton", layer_types=[A.FULL])
    q = torch.randn(R, hq, N * B, d, dtype=torch.float64, generator=gen).requires_grad_()
    k = torch.randn(R, hkv, S + N * B, d, dtype=torch.float64, generator=gen).requires_grad_()
    v = torch.randn(R, hkv, S + N * B, d, dtype=torch.float32, generator=gen).requires_grad_()
    out = A.attend(q, k, v, tri, A.FULL)
    out.sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = A.attend(q32, k32, v32, tri, A.FULL)
    ref.sum().backward()
    from trainer.kernels import attention_triton as T

    table = tri.triton[A.FULL]
    try:
        T.forward(q, k, v, table.ctx_lo, table.ctx_hi, table.blk_lo, table.blk_hi, 0.25)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    return {
        "dtypes": [str(t.dtype) for t in (out, q.grad, k.grad, v.grad)],
        "equal_to_fp32": bool(
            torch.equal(out, ref) and torch.equal(q.grad.float(), q32.grad) and torch.equal(v.grad, v32.grad)
        ),
        "refused": refused,
    }


# The forced-limit run's cases: one per layer kind (full with GQA and padding, sliding); the schedules and the
# other cases set their configurations themselves or repeat these paths, and would cost ~12 CPU-s more there.
FORCED_LIMIT_CASES = ("gqa-sorted", "sliding")

if __name__ == "__main__":
    if "--forced-limit" in sys.argv:
        out = {name: run(name) for name in FORCED_LIMIT_CASES}
    else:
        out = {name: run(name) for name in CASES}
        out["mixed-dtypes"] = run_mixed_dtypes()
        out["schedules"] = {name: run_schedules(name) for name in ("full-tiles", "sliding")}
    out["rungs"] = {
        "fwd": sorted(set(triton_fit.chosen("attention-fwd").values())),
        "bwd": sorted(set(triton_fit.chosen("attention-bwd").values())),
    }
    print(json.dumps(out))
