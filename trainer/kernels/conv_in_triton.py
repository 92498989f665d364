"""The input-side block convolution's kernel gradients as one Triton kernel (issue 32 item 4).

`BlockConv.prepare` convolves the sublayer's normed input n = w * xhat, xhat = x * rstd (the RMSNorm's output,
float32 under bf16 autocast: x the residual stream, rstd its per-row 1/rms, w the norm's weight). For the output
gradient g of the convolution, with dn its input gradient (dn[j] = sum_t g[j + t] * (base[t] + delta[j + t, t])),
this kernel gives

    d delta[j, t, grp] = sum_{c in grp} g[j, c] * n[j - t, c]      (0 where slot j < t)
    d base[t, c]       = sum_j g[j, c] * n[j - t, c]
    d w[c] (the convolution's half) = sum_j dn[j, c] * xhat[j, c]

in one pass over g and x, xhat recomputed per element from x and rstd (as Inductor's code recomputes it: never
materialised, not in the forward either). dn itself (times w: xhat's gradient, fed to the norm's row reductions
with the kernel projection's half and then to the skip add) stays Inductor's, fused into the norm's backward:
taking it here would cut that fusion (an extra [rows, H] write and read). What it replaces (bench/results/kernels.md 2026-12-05 "The input-side convolution's kernel gradients as one Triton kernel",
Inductor's code of one qwen3-8b layer): a per-group reduction kernel for d delta, and a column
reduction for d base and d w that read the pieces and x again plus dn, which the norm's backward wrote in float32
for it (now the norm weight's other half, the kernel projection's input gradient times xhat, is autograd's and
Inductor sums it from that gradient and x). Why these three here: d base sums the same products g * n as d delta;
d delta must be done before the kernel projection's input-gradient GEMM that the norm's backward needs, so this is
the first pass over g; and d w's convolution half needs only g, the coefficients and xhat, all at hand in it.

g is not one tensor: the convolved input feeds 2-3 GEMMs (gate/up, q/k/v), and its gradient is the sum of their
input gradients, which Inductor summed in float32 inside each consumer (never rounded, never materialised). A
custom op's tensor arguments are materialised, so the layer hands each GEMM a view of its own (NormedConv's
fan-out) and the op gets the pieces (`gs`, 1..3), summed here in float32 as they are read: no extra pass over
them, and g's bits as before.

Tile and launch as trainer/kernels/conv_bwd_triton.py's (2-D [(tap, row) pairs, NG groups x S channels], d base in
registers over a chunk of row tiles, one float32 partial per program summed by torch): its y operand replaced by n,
its g by the pieces' sum, its dy (here dn) multiplied by xhat and summed over rows instead of stored. Rounding: n
exactly Inductor's bits (`inductor_xhat`: x * rstd in rstd's dtype, not rounded to x's dtype, as Inductor's code
for the compiled layer computes it in the forward too, times w: no sums, so no order to differ), g the pieces'
float32 sum, products and sums in float32 (float64 for float64 inputs), d delta rounded once to delta's dtype, d
base and d w in float32 (the parameters' dtype): only the order of the 16-channel group sums, of the row sums, and d
w's split in two halves (summed by autograd) differ from Inductor's.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from trainer.kernels import triton_fit

# supported(): the same tile as conv_bwd_triton's takes the same shapes (else the caller keeps Inductor's backward)
from trainer.kernels.conv_bwd_triton import _rows, supported, tile_grid, triton_next_pow2

# (rows per tile, warps, groups per tile, programs per SM): conv_bwd_triton's ladder (its order is
# bench/results/kernels.md 2026-12-05 "The output-side convolution's backward as one Triton kernel"), until this one is measured on the GPU (bench/conv_in_cost.py; not measured yet). Compiled offline for sm_90 (triton 3.9, ptxas 12.8, K = 2, 16-channel groups, bf16, strides
# divisible by 16 as the JIT specialises them), 2 or 3 pieces: 2:2:16, 4:4:16 and 4:8:32 128 registers, 2:4:16
# 110, no spills, 1-4 KB of shared memory, 16-byte loads of the pieces and x; 8:4:16 (conv_bwd_triton's last rung)
# spilled (168 registers, 2 pieces) or took 255 (3 pieces): left out.
# $DFLASH_CONV_IN_CONFIG="ROWS:WARPS:GROUPS:PER_SM" puts one configuration first.
Config = tuple[int, int, int, int]
CONFIGS: list[Config] = [(2, 2, 16, 24), (4, 4, 16, 12), (4, 8, 32, 6), (2, 4, 16, 24)]
_FORCED = os.environ.get("DFLASH_CONV_IN_CONFIG", "").strip()
if _FORCED:
    CONFIGS.insert(0, tuple(int(v) for v in _FORCED.split(":")))  # type: ignore[arg-type]


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv_prepare_bwd(
        g0_ptr,
        g1_ptr,
        g2_ptr,
        x_ptr,
        rstd_ptr,
        w_ptr,
        delta_ptr,
        base_ptr,
        dd_ptr,
        part_ptr,
        wpart_ptr,
        M,
        tiles_per_prog,
        stride_g0,
        stride_g1,
        stride_g2,
        stride_x,
        stride_d,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        G: tl.constexpr,
        S: tl.constexpr,
        BLOCK: tl.constexpr,
        BM: tl.constexpr,
        NG: tl.constexpr,
        NP: tl.constexpr,
        WIDE: tl.constexpr,
    ):
        acc_t = tl.float64 if WIDE else tl.float32
        pid_h = tl.program_id(0)
        pid_m = tl.program_id(1)
        BH: tl.constexpr = NG * S
        QT: tl.constexpr = KP * BM
        q = tl.arange(0, QT)[:, None]  # [QT,1]: tap-major (tap, row) pairs
        tap = q // BM
        row_in_tile = q % BM
        col = pid_h * BH + tl.arange(0, BH)[None, :]  # [1,BH]
        grp = pid_h * NG + tl.arange(0, NG)[None, :]  # [1,NG]
        tap_ok = tap < K
        w = tl.load(w_ptr + col).to(acc_t)  # [1,BH]
        # base in its own dtype (float32: the parameter), one row per (tap, row)
        base = tl.load(base_ptr + tap * H + col, mask=tap_ok, other=0.0).to(acc_t)  # [QT,BH]
        acc_b = tl.zeros((QT, BH), dtype=acc_t)
        acc_w = tl.zeros((BM, BH), dtype=acc_t)
        for i in range(tiles_per_prog):
            r = (pid_m * tiles_per_prog + i) * BM + row_in_tile
            r64 = r.to(tl.int64)
            ok = r < M
            slot = r % BLOCK
            # g: the sum of the NP gradient pieces (one per GEMM that read the convolved input), in float32 as
            # Inductor's code summed them inside each consumer (never rounded to their dtype). (A jit helper for
            # the two sums below would be a module-level name: this module imports triton only when launching.)
            m = ok & tap_ok
            g = tl.load(g0_ptr + r64 * stride_g0 + col, mask=m, other=0.0).to(acc_t)
            if NP > 1:
                g += tl.load(g1_ptr + r64 * stride_g1 + col, mask=m, other=0.0).to(acc_t)
            if NP > 2:
                g += tl.load(g2_ptr + r64 * stride_g2 + col, mask=m, other=0.0).to(acc_t)
            src_ok = ok & tap_ok & (slot >= tap)
            xs = tl.load(x_ptr + (r64 - tap) * stride_x + col, mask=src_ok, other=0.0)  # [QT,BH], x's dtype
            rs = tl.load(rstd_ptr + (r64 - tap), mask=src_ok, other=0.0)  # [QT,1], once per (tap, row)
            # xhat and n as Inductor's code for the layer computes them (`inductor_xhat`): x * rstd never
            # rounded to x's dtype
            xh = (xs.to(rs.dtype) * rs).to(acc_t)
            prod = g * (w * xh)  # [QT,BH]
            acc_b += prod
            dd = tl.sum(tl.reshape(prod, (QT, NG, S)), axis=2)  # [QT,NG]
            tl.store(dd_ptr + r64 * (K * G) + tap * G + grp, dd.to(dd_ptr.dtype.element_ty), mask=ok & tap_ok)
            # d w's convolution half: dn[j] = sum_t g[j + t] * (base[t] + delta[j + t, t]) (slot j + t inside j's
            # block), times xhat[j] (the tap-0 rows' xh), summed over rows
            dst_ok = ok & tap_ok & (slot + tap < BLOCK) & (r + tap < M)
            rt = r64 + tap
            gs = tl.load(g0_ptr + rt * stride_g0 + col, mask=dst_ok, other=0.0).to(acc_t)
            if NP > 1:
                gs += tl.load(g1_ptr + rt * stride_g1 + col, mask=dst_ok, other=0.0).to(acc_t)
            if NP > 2:
                gs += tl.load(g2_ptr + rt * stride_g2 + col, mask=dst_ok, other=0.0).to(acc_t)
            d2 = tl.load(delta_ptr + rt * stride_d + tap * G + grp, mask=dst_ok, other=0.0)  # [QT,NG]
            d = tl.reshape(tl.broadcast_to(tl.expand_dims(d2, 2), (QT, NG, S)), (QT, BH))
            dn = tl.sum(tl.reshape(gs * (base + d.to(acc_t)), (KP, BM, BH)), axis=0)  # [BM,BH]
            xh0 = tl.sum(tl.reshape(tl.where(tap == 0, xh, 0.0), (KP, BM, BH)), axis=0)  # xhat[j]: the tap-0 rows
            acc_w += dn * xh0
        part = tl.sum(tl.reshape(acc_b, (KP, BM, BH)), axis=1)  # [KP,BH]
        taps = tl.arange(0, KP)[:, None]
        tl.store(part_ptr + (pid_m * K + taps) * H + col, part, mask=taps < K)
        tl.store(wpart_ptr + pid_m * H + col, tl.sum(acc_w, axis=0)[None, :])

    return conv_prepare_bwd


def inductor_xhat(x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """The norm's normalised input as Inductor's code for the compiled layer computes it, forward and backward, and
    as the kernel recomputes it: x * rstd in rstd's dtype, NOT rounded to x's dtype (Inductor drops the round trip
    of a value it never stores: its code reads `tmp.to(tl.float32)` where eager RMSNorm rounds to bf16,
    bench/results/kernels.md 2026-12-05 "The input-side convolution's kernel gradients as one Triton kernel"). The same as eager's for float32 and float64 x; for bf16 x one rounding apart
    (relative 2^-9 at most)."""
    return x.to(rstd.dtype) * rstd


def _torch_gradients(
    g: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same three gradients with torch (the fallback where no configuration fits the device): g, x [M,H], rstd
    [M], delta [M,K,G] -> [M,K,G], [K,H], [H], in float32 (float64 for float64 inputs)."""
    from trainer.kernels.conv_grad import conv_gradients

    M, H = x.shape
    xhat = inductor_xhat(x, rstd.view(M, 1))
    n = weight * xhat
    dn, dd, db = conv_gradients(g.view(1, M, H), n.view(1, M, H), delta.view(1, *delta.shape), base, block_size,
                                H // delta.shape[-1])  # fmt: skip
    return dd.view(delta.shape), db, (dn.view(M, H) * xhat).sum(0)


_LOGGED: set[str] = set()


MAX_PIECES = 3


@torch.library.custom_op("dflash::conv_prepare_kernel_grads", mutates_args=())
def conv_prepare_kernel_grads(
    gs: list[torch.Tensor],
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gs: 1..MAX_PIECES output-gradient pieces [..., H] (their float32 sum is g), x [..., H], rstd [..., 1], weight
    [H], delta [..., K, G], base [K, H] -> (d delta like delta, d base like base, d weight like weight) of the
    convolution of n = weight * xhat, xhat = x * rstd (inductor_xhat), for that g: d weight = sum over rows of
    dn * xhat, dn the convolution's input gradient (the norm weight's gradient through the convolution only)."""
    H = x.shape[-1]
    K, G = delta.shape[-2], delta.shape[-1]
    if not 1 <= len(gs) <= MAX_PIECES:
        raise ValueError(f"conv_prepare_kernel_grads takes 1..{MAX_PIECES} gradient pieces, got {len(gs)}")
    pieces, x2 = [_rows(t, H) for t in gs], _rows(x, H)
    r2 = rstd.reshape(-1).contiguous()
    M = x2.shape[0]
    wide = torch.float64 in (*(t.dtype for t in gs), x.dtype, rstd.dtype, weight.dtype)
    acc = torch.float64 if wide else torch.float32
    d2 = _rows(delta, K, G)
    dd = torch.empty(M, K, G, dtype=delta.dtype, device=x.device)
    partial: list[torch.Tensor] = []
    sms = triton_fit.sm_count(x.device)

    def launch(config: Config) -> tuple[tuple, tuple, dict]:
        bm, warps = config[:2]
        ng, col_tiles, per, chunks = tile_grid(M, G, config, sms)
        part = torch.empty(chunks, K, H, dtype=acc, device=x.device)
        wpart = torch.empty(chunks, H, dtype=acc, device=x.device)
        partial[:] = [part, wpart]
        meta = dict(
            H=H, K=K, KP=triton_next_pow2(K), G=G, S=H // G, BLOCK=block_size, BM=bm, NG=ng, NP=len(pieces), WIDE=wide
        )
        gp = (pieces + pieces[:1] * MAX_PIECES)[:MAX_PIECES]  # the unused pointers are never read
        strides = (*(t.stride(0) for t in gp), x2.stride(0), d2.stride(0))
        args = (*gp, x2, r2, weight, d2, base, dd, part, wpart, M, per, *strides)
        return (col_tiles, chunks), args, {**meta, "num_warps": warps}

    try:
        with triton_fit.on_device(x.device):
            triton_fit.launch_first_fit(
                "conv-prepare-bwd",
                _kernel(),
                CONFIGS,
                launch,
                x.device,
                (x.dtype, gs[0].dtype, len(gs), K, H // G, block_size),
            )
    except triton_fit.NoConfigFitsError as exc:
        if str(x.device) not in _LOGGED:
            _LOGGED.add(str(x.device))
            print(f"{exc}; the convolution's kernel gradients run in torch", file=sys.stderr, flush=True)
        acc_g = functools.reduce(torch.add, [t.to(acc) for t in pieces])
        ddt, db, dw = _torch_gradients(acc_g, x2, r2, weight, d2, base, block_size)
        return ddt.to(delta.dtype).view(delta.shape), db.to(base.dtype), dw.to(weight.dtype)
    return dd.view(delta.shape), partial[0].sum(0).to(base.dtype), partial[1].sum(0).to(weight.dtype)


@conv_prepare_kernel_grads.register_fake
def _(gs, x, rstd, weight, delta, base, block_size):
    return delta.new_empty(delta.shape), base.new_empty(base.shape), weight.new_empty(weight.shape)


__all__ = ["CONFIGS", "conv_prepare_kernel_grads", "inductor_xhat", "supported"]
