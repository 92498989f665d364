"""DFlash2's block convolution (trainer/model/dflash2.py: grouped_dynamic_conv) as two Triton kernels behind one
custom op, forward and backward, so the compiled layer sees one opaque call per convolution.

    out[m, h] = sum_{t < K, t <= m % B} x[m - t, h] * (base[t, h] + delta[m, t, h // group_size])

x [M, H] (M = rows x N*B, block-major: blocks never straddle rows), delta [M, K, G] (G = H / group_size), base
[K, H]. Why: torch.compile's code for the same expression spends ~1.25 ms per convolution (forward + backward) at
the qwen3-8b seed shape ([32832, 4096] bf16, 20 convolutions: +25 ms per step, bench/results/kernels.md 2026-12-04 "DFlash2's top-k inside the fused CE kernel"): the
padded shift, the broadcast coefficient and the three gradients (x, the per-group deltas, the per-channel base)
come out as several kernels that each re-read x and g. Here the forward reads x (and its K-1 shifted copies,
L1/L2 hits) and the deltas once and writes out once; the backward reads g, x and the deltas once and writes dx
and d delta once, with d base as per-tile partial sums (fp32, summed by torch: deterministic, no atomics).
Accumulation in fp32, one rounding to x's dtype (eager rounds base + delta and each product to bf16 first).

Triton is imported at the first call (CPU CI without it imports this module); TRITON_INTERPRET=1 runs the kernels
on CPU tensors for tests (tests/trainer/test_conv_triton.py).
"""

from __future__ import annotations

import functools
import os

import torch

from trainer.kernels import triton_fit

BLOCK_M, BLOCK_H = 32, 256  # a forward tile: 32 rows x 256 channels (16 groups of 16), 4 warps
# The backward's (rows per tile, warps): it holds ~5 fp32 tiles (g, x, g shifted, the product, dx), so 32 x 256 on
# 4 warps is ~320 registers a thread (spills). $DFLASH_CONV_TRITON_BWD="ROWS:WARPS" overrides, for benches.
BWD_CONFIG: tuple[int, int] = tuple(int(v) for v in os.environ.get("DFLASH_CONV_TRITON_BWD", "32:8").split(":"))  # type: ignore[assignment]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    # Tiles are 3-D, [BM rows, NG groups, GROUP channels] (NG * GROUP = BH contiguous channels): the deltas load as a
    # [BM, NG] tile and broadcast over the last axis, the per-group sums reduce it. (The first version indexed the
    # deltas per channel, cols // GROUP: scalar, unvectorised loads, 3.7x slower than Inductor's code: bench/results/kernels.md 2026-12-04 "DFlash2's top-k inside the fused CE kernel", run 2.)
    @triton.jit
    def conv_fwd(
        x_ptr,
        delta_ptr,
        base_ptr,
        out_ptr,
        M,
        H: tl.constexpr,
        K: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        BM: tl.constexpr,
        NG: tl.constexpr,
    ):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        groups = tl.program_id(1) * NG + tl.arange(0, NG)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
        row_ok = rows < M
        slot = rows % BLOCK
        acc = tl.zeros((BM, NG, GROUP), dtype=tl.float32)
        for t in tl.static_range(K):
            src_ok = row_ok & (slot >= t)  # slot j reads slot j - t of its own block, zeros before its start
            x = tl.load(
                x_ptr + (rows - t).to(tl.int64)[:, None, None] * H + cols[None, :, :],
                mask=src_ok[:, None, None],
                other=0.0,
            )
            d = tl.load(
                delta_ptr + rows.to(tl.int64)[:, None] * (K * G) + t * G + groups[None, :],
                mask=row_ok[:, None],
                other=0.0,
            )
            b = tl.load(base_ptr + t * H + cols)
            acc += x.to(tl.float32) * (b.to(tl.float32)[None, :, :] + d.to(tl.float32)[:, :, None])
        tl.store(
            out_ptr + rows.to(tl.int64)[:, None, None] * H + cols[None, :, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None, None],
        )

    @triton.jit
    def conv_bwd(
        g_ptr,
        x_ptr,
        delta_ptr,
        base_ptr,
        dx_ptr,
        ddelta_ptr,
        dbase_ptr,
        M,
        H: tl.constexpr,
        K: tl.constexpr,
        G: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        BM: tl.constexpr,
        NG: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        rows = pid_m * BM + tl.arange(0, BM)
        groups = tl.program_id(1) * NG + tl.arange(0, NG)
        cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
        row_ok = rows < M
        slot = rows % BLOCK
        at = rows.to(tl.int64)[:, None, None] * H + cols[None, :, :]
        g = tl.load(g_ptr + at, mask=row_ok[:, None, None], other=0.0).to(tl.float32)
        dx = tl.zeros((BM, NG, GROUP), dtype=tl.float32)
        for t in tl.static_range(K):
            # d delta[m, t, group] and d base[t, h]: g[m] * x[m - t] (where slot m - t is in m's block)
            src_ok = row_ok & (slot >= t)
            x = tl.load(x_ptr + at - t * H, mask=src_ok[:, None, None], other=0.0)
            prod = g * x.to(tl.float32)
            tl.store(
                ddelta_ptr + rows.to(tl.int64)[:, None] * (K * G) + t * G + groups[None, :],
                tl.sum(prod, axis=2).to(ddelta_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )
            tl.store(dbase_ptr + (pid_m * K + t) * H + cols, tl.sum(prod, axis=0))
            # dx[m]: g[m + t] * (base[t] + delta[m + t, t]) where slot m + t is in m's block
            dst_ok = (rows + t < M) & (slot + t < BLOCK)
            g_t = tl.load(g_ptr + at + t * H, mask=dst_ok[:, None, None], other=0.0).to(tl.float32)
            d_t = tl.load(
                delta_ptr + (rows + t).to(tl.int64)[:, None] * (K * G) + t * G + groups[None, :],
                mask=dst_ok[:, None],
                other=0.0,
            ).to(tl.float32)
            b = tl.load(base_ptr + t * H + cols).to(tl.float32)
            dx += g_t * (b[None, :, :] + d_t[:, :, None])
        tl.store(dx_ptr + at, dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None, None])

    return conv_fwd, conv_bwd


def _meta(x: torch.Tensor, delta: torch.Tensor, block_size: int) -> dict:
    M, H = x.shape
    K, G = delta.shape[1], delta.shape[2]
    bh = min(BLOCK_H, H)
    if H % bh or bh % (H // G):
        raise ValueError(f"hidden {H} must be a multiple of {bh} and {bh} of the group size {H // G}")
    group = H // G
    if group & (group - 1) or (bh // group) & (bh // group - 1):
        raise ValueError(f"the group size {group} and {bh} // it must be powers of two (tl.arange)")
    return dict(H=H, K=K, G=G, GROUP=group, BLOCK=block_size, BM=BLOCK_M, NG=bh // group, num_warps=4)


def _grid(M: int, meta: dict) -> tuple[int, int]:
    return (-(-M // meta["BM"]), meta["G"] // meta["NG"])


@torch.library.custom_op("dflash::block_conv", mutates_args=())
def _conv_op(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    out = torch.empty_like(x)
    meta = _meta(x, delta, block_size)
    with triton_fit.on_device(x.device):
        _kernels()[0][_grid(x.shape[0], meta)](x, delta, base, out, x.shape[0], **meta)
    return out


@_conv_op.register_fake
def _(x, delta, base, block_size):
    return torch.empty_like(x)


@torch.library.custom_op("dflash::block_conv_backward", mutates_args=())
def _conv_backward_op(
    g: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = {**_meta(x, delta, block_size), "BM": BWD_CONFIG[0], "num_warps": BWD_CONFIG[1]}
    grid = _grid(x.shape[0], meta)
    dx, ddelta = torch.empty_like(x), torch.empty_like(delta)
    partial = torch.empty(grid[0], delta.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    with triton_fit.on_device(x.device):
        _kernels()[1][grid](g, x, delta, base, dx, ddelta, partial, x.shape[0], **meta)
    return dx, ddelta, partial.sum(0).to(base.dtype)


@_conv_backward_op.register_fake
def _(g, x, delta, base, block_size):
    return torch.empty_like(x), torch.empty_like(delta), torch.empty_like(base)


def _setup_context(ctx, inputs, output) -> None:
    x, delta, base, block_size = inputs
    ctx.save_for_backward(x, delta, base)
    ctx.block_size = block_size


def _backward(ctx, g):
    x, delta, base = ctx.saved_tensors
    dx, ddelta, dbase = _conv_backward_op(g.contiguous(), x, delta, base, ctx.block_size)
    return dx, ddelta, dbase, None


_conv_op.register_autograd(_backward, setup_context=_setup_context)


def block_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int, group_size: int
) -> torch.Tensor:
    """grouped_dynamic_conv's contract (x [R,N*B,H], delta [R,N*B,K,G], base [K,H] -> [R,N*B,H]) through the
    kernels; differentiable in all three."""
    R, Q, H = x.shape
    K = base.shape[0]
    if H // group_size != delta.shape[-1] or delta.shape[-2] != K or Q % block_size:
        raise ValueError(f"x {tuple(x.shape)}, delta {tuple(delta.shape)}, base {tuple(base.shape)} do not agree")
    out = _conv_op(
        x.reshape(R * Q, H).contiguous(), delta.reshape(R * Q, K, H // group_size).contiguous(), base, block_size
    )
    return out.view(R, Q, H)


__all__ = ["block_conv"]
