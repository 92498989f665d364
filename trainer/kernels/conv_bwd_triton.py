"""The backward of DFlash2's output-side block convolution as one Triton kernel (issue 32 item 4).

For out[j] = sum_{t < K, t <= j % B} y[j - t] * (base[t] + delta[j, t, group]) (trainer/model/dflash2.py:
grouped_dynamic_conv) and its output gradient g, one pass over g and y gives all three gradients:

    d delta[j, t, grp] = sum_{c in grp} g[j, c] * y[j - t, c]            (0 where slot j < t)
    d base[t, c]       = sum_j g[j, c] * y[j - t, c]
    dy[j, c]           = sum_t g[j + t, c] * (base[t, c] + delta[j + t, t, grp])   (slot j + t inside j's block)

Why only the output side (`BlockConv.finish`): its backward reads only materialised tensors (g, the residual
stream's gradient; y, the sublayer's GEMM output, saved anyway; the deltas) and its dy feeds a GEMM, so a kernel
of our own loses no fusion there. Inductor's code for it (GroupedDynamicConv.backward, compiled in the layer) runs at
~1.6-1.8 TB/s: its per-row and per-group scalars are re-loaded per element (bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor"). Here a
program owns a strip of channels (NG groups of S) and walks a chunk of row tiles; a tile is 2-D, [KP x BM, NG x S],
its rows the (tap, row) pairs tap-major (KP: the taps padded to a power of two). Every [rows, H]-sized operand is
such a tile: g (the same rows for every tap: L1 hits), y[j - t] and g[j + t] (rows shifted: L1/L2 hits, not DRAM
traffic), dy (stored from the tap-0 rows only); so they all get one layout, each warp reading whole rows of the
strip, and the reshapes that sum the taps ([KP, BM, ...], in-thread) and the groups ([.., NG, S]: 8 in-thread, one
shuffle) move no data. The deltas load once per (tap, row, group), [KP x BM, NG], and broadcast over the group.
d base is accumulated in registers over the chunk and reduced once per program into a [chunks, K, H] partial
(summed by torch: deterministic, no atomics). DRAM traffic: g and y read once, dy written once, the deltas read and
written once (~0.87 GB per call at the qwen3-8b seed shape).

Tile shapes that did worse, compiled offline for sm_90 (triton 3.6, the H200's, and 3.9): a 4-D [taps, rows,
groups, channels] tile got a layout per operand shape (g [1, ...], base [KP, 1, ...]) and per Triton version
(3.6 ordered the tap axis before the channels' groups: each warp read 32-byte pieces of 16 rows), with 2-5
[tile]-sized shared-memory layout conversions per row tile; a 3-D [taps, rows, channels] tile put warps on the tap
axis under 3.6 (the tap sum then crossed warps through shared memory). The 2-D form compiles to the same layouts
under both versions, with two [KP x BM, NG] conversions per tile (the deltas in, their gradient out).

Rounding as Inductor's code for GroupedDynamicConv (forward and backward): products and sums in float32 (float64 for
float64 inputs), the coefficient base[t] + delta unrounded (float32 base, the delta widened), each gradient rounded
once to its input's dtype. Eager bf16 rounds base and the coefficient to bf16 first (the torch backward,
`conv_gradients`, follows it): the two agree to that rounding.

Where it runs: CUDA (the Triton interpreter on CPU tensors for tests: TRITON_INTERPRET=1), when `supported()` says
the shapes fit; the launch walks a configuration ladder through trainer/kernels/triton_fit.py, and if no configuration
fits the device the op computes the same gradients with torch (one log line).
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch

from trainer.kernels import triton_fit

# (rows per tile, warps, groups per tile, programs per SM), the fastest on the H200 first (bench/conv_bwd_cost.py,
# bench/results/kernels.md 2026-12-05 "The output-side convolution's backward as one Triton kernel", run 2: back to back at the qwen3-8b seed shape, the coefficient in float32: 2:2:16:24 0.335 ms,
# 4:4:16:12 0.365, 4:8:32:6 0.375, 8:4:16:10 0.428, 4:4:16:8 0.463, 4:8:32:4 0.482, 2:4:16:12 1.37; Inductor's
# code 0.394). With the bf16-rounded coefficient of run 1 (base held as bf16: 16 fewer registers a thread)
# 4:4:16:8 took 0.325. Compiled offline for sm_90 (triton 3.6, K = 2, 16-channel groups, bf16): 4:4:16 and 2:2:16
# 80 registers, 8:4:16 130, none spilled; 4-16 KB of shared memory (the per-group tiles' layout changes, d base's
# final sum), so every rung fits a ~100 KB Blackwell too; the ladder (trainer/kernels/triton_fit.py) is there for what
# another compiler or GPU does. "Programs per SM" sets how many row chunks (and d base partials) there are: more,
# smaller chunks won. $DFLASH_CONV_BWD_CONFIG="ROWS:WARPS:GROUPS:PER_SM" puts one configuration first.
Config = tuple[int, int, int, int]
CONFIGS: list[Config] = [(2, 2, 16, 24), (4, 4, 16, 12), (4, 8, 32, 6), (8, 4, 16, 10)]
_FORCED = os.environ.get("DFLASH_CONV_BWD_CONFIG", "").strip()
if _FORCED:
    CONFIGS.insert(0, tuple(int(v) for v in _FORCED.split(":")))  # type: ignore[arg-type]
MAX_TAPS = 4  # the taps are padded to a power of two and their rows held in each thread's registers


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(hidden: int, group_size: int, taps: int, dtype: torch.dtype) -> str | None:
    """None when the kernel takes these shapes, else why not (the caller keeps Inductor's backward)."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        return f"dtype {dtype}"
    if not _pow2(group_size) or group_size > 64:
        return f"group size {group_size} (a power of two up to 64)"
    if hidden % group_size:
        return f"hidden {hidden} not a multiple of the group size {group_size}"
    if taps > MAX_TAPS:
        return f"{taps} taps (at most {MAX_TAPS})"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def conv_finish_bwd(
        g_ptr,
        y_ptr,
        delta_ptr,
        base_ptr,
        dy_ptr,
        dd_ptr,
        part_ptr,
        M,
        tiles_per_prog,
        stride_g,
        stride_y,
        stride_d,
        H: tl.constexpr,
        K: tl.constexpr,
        KP: tl.constexpr,
        G: tl.constexpr,
        S: tl.constexpr,
        BLOCK: tl.constexpr,
        BM: tl.constexpr,
        NG: tl.constexpr,
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
        # base in its own dtype (float32: the parameter), one row per (tap, row)
        base = tl.load(base_ptr + tap * H + col, mask=tap_ok, other=0.0).to(acc_t)  # [QT,BH]
        acc_b = tl.zeros((QT, BH), dtype=acc_t)
        for i in range(tiles_per_prog):
            r = (pid_m * tiles_per_prog + i) * BM + row_in_tile
            r64 = r.to(tl.int64)
            ok = r < M
            slot = r % BLOCK
            # d delta[j, t] and d base[t]: g[j] * y[j - t], zero where slot j - t is before j's block
            g = tl.load(g_ptr + r64 * stride_g + col, mask=ok & tap_ok, other=0.0).to(acc_t)
            src_ok = ok & tap_ok & (slot >= tap)
            ys = tl.load(y_ptr + (r64 - tap) * stride_y + col, mask=src_ok, other=0.0).to(acc_t)
            prod = g * ys  # [QT,BH]
            acc_b += prod
            dd = tl.sum(tl.reshape(prod, (QT, NG, S)), axis=2)  # [QT,NG]
            tl.store(dd_ptr + r64 * (K * G) + tap * G + grp, dd.to(dd_ptr.dtype.element_ty), mask=ok & tap_ok)
            # dy[j] = sum_t g[j + t] * (base[t] + delta[j + t, t]), slot j + t inside j's block
            dst_ok = ok & tap_ok & (slot + tap < BLOCK) & (r + tap < M)
            gs = tl.load(g_ptr + (r64 + tap) * stride_g + col, mask=dst_ok, other=0.0).to(acc_t)
            d2 = tl.load(delta_ptr + (r64 + tap) * stride_d + tap * G + grp, mask=dst_ok, other=0.0)  # [QT,NG]
            d = tl.reshape(tl.broadcast_to(tl.expand_dims(d2, 2), (QT, NG, S)), (QT, BH))
            # base + delta unrounded, as Inductor computes the compiled forward's coefficient (it keeps float32
            # through the fused kernel: eager bf16 would round base and the sum; the first GPU run of this kernel
            # rounded them here, and dy moved off Inductor's by up to a few bf16 steps, 1.7x its error)
            coef = base + d.to(acc_t)
            dy = tl.sum(tl.reshape(gs * coef, (KP, BM, BH)), axis=0)  # [BM,BH]
            # back to the tile's shape (its layout, no data moved), stored from the tap-0 rows
            dy = tl.reshape(tl.broadcast_to(tl.expand_dims(dy, 0), (KP, BM, BH)), (QT, BH))
            tl.store(dy_ptr + r64 * H + col, dy.to(dy_ptr.dtype.element_ty), mask=ok & (tap == 0))
        part = tl.sum(tl.reshape(acc_b, (KP, BM, BH)), axis=1)  # [KP,BH]
        taps = tl.arange(0, KP)[:, None]
        tl.store(part_ptr + (pid_m * K + taps) * H + col, part, mask=taps < K)

    return conv_finish_bwd


def _rows(t: torch.Tensor, *inner: int) -> torch.Tensor:
    """t [..., *inner] as [M, *inner] with any row stride and dense inner dims (a view where it can be, a copy where
    not: the deltas are a strided view of the kernel projection's output, [R,Q,2,K,G][..., 1, :, :])."""
    flat = t.reshape(-1, *inner)
    dense = flat.stride(-1) == 1 and (len(inner) == 1 or flat.stride(-2) == inner[-1])
    return flat if dense else flat.contiguous()


def tile_grid(rows: int, groups: int, config: Config, sms: int) -> tuple[int, int, int, int]:
    """How a configuration tiles `rows` x `groups` (this kernel's and conv_in_triton's): (groups per tile, a
    power of two dividing `groups` for tl.arange, so fewer for small H; column tiles; row tiles per program; row
    chunks, i.e. programs down the rows and d base partials, about `per_sm` x `sms` programs in all)."""
    bm, _, ng, per_sm = config
    ng = math.gcd(ng, groups & -groups)
    tiles = -(-rows // bm)
    col_tiles = groups // ng
    chunks = max(1, min(tiles, -(-per_sm * sms // col_tiles)))
    per = -(-tiles // chunks)
    return ng, col_tiles, per, -(-tiles // per)


def _torch_gradients(
    g: torch.Tensor, y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same gradients with torch (the fallback where no configuration fits the device): [M,H], [M,K,G]."""
    from trainer.kernels.conv_grad import conv_gradients

    M, H = y.shape
    K, G = delta.shape[1], delta.shape[2]
    dx, dd, db = conv_gradients(g.view(1, M, H), y.view(1, M, H), delta.view(1, M, K, G), base, block_size, H // G)
    return dx.view(M, H), dd.reshape(M, K, G), db


_LOGGED: set[str] = set()


@torch.library.custom_op("dflash::conv_finish_backward", mutates_args=())
def conv_finish_backward(
    g: torch.Tensor, y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """g, y [..., H], delta [..., K, G], base [K, H] -> (dy like y, d delta like delta, d base like base)."""
    H = y.shape[-1]
    K, G = delta.shape[-2], delta.shape[-1]
    g2, y2, d2 = _rows(g, H), _rows(y, H), _rows(delta, K, G)
    M = y2.shape[0]
    wide = torch.float64 in (g.dtype, y.dtype, delta.dtype)
    acc = torch.float64 if wide else torch.float32
    dy = torch.empty(M, H, dtype=y.dtype, device=y.device)
    dd = torch.empty(M, K, G, dtype=delta.dtype, device=y.device)
    partial: list[torch.Tensor] = []  # the launched configuration's d base partial, [chunks, K, H]
    sms = triton_fit.sm_count(y.device)

    def launch(config: Config) -> tuple[tuple, tuple, dict]:
        bm, warps = config[:2]
        ng, col_tiles, per, chunks = tile_grid(M, G, config, sms)
        part = torch.empty(chunks, K, H, dtype=acc, device=y.device)
        partial[:] = [part]
        meta = dict(H=H, K=K, KP=triton_next_pow2(K), G=G, S=H // G, BLOCK=block_size, BM=bm, NG=ng, WIDE=wide)
        args = (g2, y2, d2, base, dy, dd, part, M, per, g2.stride(0), y2.stride(0), d2.stride(0))
        return (col_tiles, chunks), args, {**meta, "num_warps": warps}

    ladder = CONFIGS
    guard = triton_fit.on_device(y.device)
    try:
        with guard:
            triton_fit.launch_first_fit(
                "conv-finish-bwd", _kernel(), ladder, launch, y.device, (y.dtype, delta.dtype, K, H // G, block_size)
            )
    except triton_fit.NoConfigFitsError as exc:
        if str(y.device) not in _LOGGED:
            _LOGGED.add(str(y.device))
            print(f"{exc}; the convolution's backward runs in torch", file=sys.stderr, flush=True)
        dx, ddt, db = _torch_gradients(g2, y2, d2, base, block_size)
        return dx.view(y.shape), ddt.view(delta.shape), db
    dbase = partial[0].sum(0).to(base.dtype)
    return dy.view(y.shape), dd.view(delta.shape), dbase


@conv_finish_backward.register_fake
def _(g, y, delta, base, block_size):
    return y.new_empty(y.shape), delta.new_empty(delta.shape), base.new_empty(base.shape)


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


__all__ = ["CONFIGS", "conv_finish_backward", "supported"]
