"""Our own Triton attention for the DFlash interval-form mask (issue 31, item 2), forward and backward.

Each query row q of batch row r sees exactly the keys [ctx_lo, ctx_hi) and [blk_lo, blk_hi) (QueryBounds in
trainer/model/attention.py: the context before its anchor, and its own block). The two intervals never overlap:
the first lies in [0, S), the second in [S, K).

Forward (one program per (BLOCK_M query rows, batch row x q head)): two loops over key tiles, one per interval,
each from the lowest `lo` to the highest `hi` of the tile's rows (sorted anchors: a tile's rows share a few
anchors, so the context loop stops near them: flex's tile skipping, read off the intervals). Online softmax in
fp32; writes O and the log-sum-exp (base 2) per row. A row that sees nothing gets O = 0. The key tiles every row
of the query tile sees whole are walked without the mask (FwdConfig.split), the ones before and after masked.

Backward (FA2's schedule, FA3's dQ accumulation): one program per (BLOCK_N key tile, batch row x kv head) keeps
its K and V tiles and the dK/dV accumulators on chip and walks the query tiles that meet it (a compacted list per
key tile, built once per mask: no empty tile visited) for every q head of its GQA group, in FA2's orientation:
S^T = K Q^T, P^T = exp2(S^T - lse), dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta), dK += dS^T Q,
dQ = dS K: five matmuls per tile pair where flex's backward does seven (its dq programs recompute QK^T and dP).
dQ is added into an fp32 buffer by the TMA unit's bulk reduce-add (Hopper and later; fp32 atomics elsewhere and
under the interpreter); the default schedule computes it transposed into [R, Hq, D, Q], folds the softmax scale
into P, and issues the matmuls in the order that lets dV and dK overlap other work (BwdConfig's flags). The full
pairs (every row sees every key of the tile) are walked first, without the mask and without loading the rows'
bounds; the partial ones after, masked. bench/results/kernels.md 2026-12-04 "The attention backward's schedule" and
2026-12-05 "The attention backward's dQ path" have the measurements behind each of
these choices.

Launch configurations come from a ladder per kernel, fastest first on the H200, walked by
trainer/kernels/triton_fit.py against the device's shared-memory limit (Blackwell: ~100 KB). The query-tile lists are at
BLOCK_M_TABLE x TILE_N_TABLE granularity; a backward rung steps through them in BLOCK_M rows (dividing
BLOCK_M_TABLE) with a key tile that divides TILE_N_TABLE.

Entry point: `interval_attention(q, k, v, table)` (autograd through torch.library custom ops, so a compiled
layer treats it as one opaque call). Triton is imported at the first call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch

from trainer.kernels import triton_fit

BLOCK_M_TABLE = 64  # query rows per tile of the backward's lists
TILE_N_TABLE = 128  # keys per tile of the backward's lists


@dataclass(frozen=True)
class IntervalTable:
    """What the kernels read besides q, k, v: the four bounds (int32 [R, Qpad]) and, per key tile of
    TILE_N_TABLE keys, the query tiles of BLOCK_M_TABLE rows that meet it: q_count int32 [R, Kt, 2] (how many
    are full: every row of the tile sees every key of the key tile; how many partial) and q_index int32
    [R, Kt, Qt] (the full tiles first, then the partial ones, each ascending)."""

    ctx_lo: torch.Tensor
    ctx_hi: torch.Tensor
    blk_lo: torch.Tensor
    blk_hi: torch.Tensor
    q_count: torch.Tensor
    q_index: torch.Tensor


def build_table(
    ctx_lo: torch.Tensor, ctx_hi: torch.Tensor, blk_lo: torch.Tensor, blk_hi: torch.Tensor, q_len: int, kv_len: int
) -> IntervalTable:
    """IntervalTable from the bounds (torch ops on their device, no host sync; R x Qpad x Kt interval tests).

    A full pair needs no mask: the backward walks those without loading the rows' bounds (bench/results/kernels.md 2026-12-04 "The attention backward's schedule": the
    bounds, broadcast over a 128-key tile, cost each thread ~64 registers and ~50 shared-memory loads per tile
    pair; at the seed shape ~93% of the pairs are full). Rows past q_len count as covered (their q and dO load
    as zeros, so they contribute nothing unmasked); a key tile that runs past kv_len is never full."""
    rows, q_pad = ctx_lo.shape
    device = ctx_lo.device
    q_tiles = -(-q_len // BLOCK_M_TABLE)
    kv_tiles = -(-kv_len // TILE_N_TABLE)
    k0 = torch.arange(kv_tiles, device=device, dtype=torch.int32) * TILE_N_TABLE
    k1 = (k0 + TILE_N_TABLE).clamp(max=kv_len)
    bounds = [
        b[:, : q_tiles * BLOCK_M_TABLE]
        if b.shape[1] >= q_tiles * BLOCK_M_TABLE
        else torch.nn.functional.pad(b, (0, q_tiles * BLOCK_M_TABLE - b.shape[1]))
        for b in (ctx_lo, ctx_hi, blk_lo, blk_hi)
    ]
    lo1, hi1, lo2, hi2 = (b[:, :, None] for b in bounds)  # [R, Qp, 1]
    row_ok = (torch.arange(q_tiles * BLOCK_M_TABLE, device=device) < q_len)[None, :, None]
    meets = (torch.maximum(lo1, k0) < torch.minimum(hi1, k1)) | (torch.maximum(lo2, k0) < torch.minimum(hi2, k1))
    meets &= row_ok
    covers = ((lo1 <= k0) & (k1 <= hi1)) | ((lo2 <= k0) & (k1 <= hi2)) | ~row_ok
    tiles = meets.view(rows, q_tiles, BLOCK_M_TABLE, kv_tiles).any(dim=2).transpose(1, 2)  # [R, Kt, Qt]
    full = covers.view(rows, q_tiles, BLOCK_M_TABLE, kv_tiles).all(dim=2).transpose(1, 2)
    full &= tiles & (k0 + TILE_N_TABLE <= kv_len)[None, :, None]
    rank = tiles.to(torch.int32) + full.to(torch.int32)  # 2 full, 1 partial, 0 does not meet
    order = torch.argsort(rank, dim=-1, descending=True, stable=True).to(torch.int32)
    n_full = full.sum(-1)
    counts = torch.stack((n_full, tiles.sum(-1) - n_full), dim=-1).to(torch.int32)
    return IntervalTable(ctx_lo, ctx_hi, blk_lo, blk_hi, counts.contiguous(), order.contiguous())


@dataclass(frozen=True)
class FwdConfig:
    """One forward launch. `split`: the key tiles every (in-range) row of the query tile sees whole are walked
    without the mask (as the backward walks its full pairs), the rest masked."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    split: bool = False

    def launch_kwargs(self, head_dim: int) -> dict[str, int | bool]:
        """The forward kernel's constexprs and launch options for this configuration."""
        return dict(
            D=head_dim,
            BLOCK_M=self.block_m,
            BLOCK_N=self.block_n,
            SPLIT=self.split,
            num_warps=self.num_warps,
            num_stages=self.num_stages,
        )


@dataclass(frozen=True)
class BwdConfig:
    """One backward launch: keys per program (block_n, divides TILE_N_TABLE), query rows per step (block_m,
    divides BLOCK_M_TABLE), warps, pipeline stages, and how dQ is accumulated: "tma" (bulk reduce-add by the
    TMA unit, FA3's way; Hopper and later), "atomic" (fp32 atomics) or "none" (dQ not computed: a timing
    diagnostic only, never in a ladder). `flags`, letters of:
    - "t": dQ computed transposed, dQ^T = K^T dS^T [D, rows], into an fp32 buffer [R, Hq, D, Q] (one more small
      kernel transposes and casts it at the end): dS^T is stored to shared memory as it is (the B operand of
      that matmul) instead of transposed through shared memory into registers (the A operand of dS K);
    - "f": the softmax scale folded into P^T (exp2(S^T - lse + log2 scale): dS^T leaves its matmul scaled, so
      neither dQ nor dK is multiplied by it per tile; dV divides once at the end);
    - "o": dP^T's matmul before dV's and dQ's before dK's (Triton waits for each matmul whose result is used next
      with nothing left in flight: this order lets dV run while dS^T is formed and dK while dQ is reduced)."""

    block_n: int
    block_m: int
    num_warps: int
    num_stages: int
    dq: str
    flags: str = ""


DQ_MODES = {"none": 0, "atomic": 1, "tma": 2}

# Fastest first (H200, bench/results/kernels.md 2026-12-04 and 2026-12-05); the later rungs for ~100 KB of shared memory (Blackwell), the last for
# anything. The forward walks its full key tiles unmasked (6.10 against 6.67 ms at the seed shape); the
# backward's rung 0 is `128,64,8,2,tma,tfo` (14.30 ms against the earlier rung 0 `128,64,8,2,tma` at 16.39,
# still selectable through $DFLASH_ATTENTION_BWD_CONFIG); rung 1 keeps the 2026-12-04 one-stage schedule (19.8 ms,
# "tf" did not help it: 19.9).
FWD_CONFIGS = (
    FwdConfig(128, 128, 8, 2, True),
    FwdConfig(128, 64, 8, 2, True),
    FwdConfig(64, 64, 4, 2, True),
    FwdConfig(64, 32, 4, 1, True),
)
BWD_CONFIGS = (
    BwdConfig(128, 64, 8, 2, "tma", "tfo"),
    BwdConfig(128, 64, 8, 1, "tma"),
    BwdConfig(64, 64, 4, 1, "atomic"),
    BwdConfig(32, 64, 4, 1, "atomic"),
)
BWD_ENV = "DFLASH_ATTENTION_BWD_CONFIG"
FWD_SPLIT_ENV = "DFLASH_ATTENTION_FWD_SPLIT"


def fwd_ladder() -> tuple[FwdConfig, ...]:
    """FWD_CONFIGS, each with `split` set to $DFLASH_ATTENTION_FWD_SPLIT ("1" or "0") where that is set (the step
    bench's knob: "0" is the masked forward measured on 2026-12-04)."""
    text = os.environ.get(FWD_SPLIT_ENV, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"${FWD_SPLIT_ENV}={text!r}: expected 0 or 1")
    return tuple(dataclasses.replace(c, split=text == "1") for c in FWD_CONFIGS) if text else FWD_CONFIGS


def parse_bwd_config(text: str) -> BwdConfig:
    """'block_n,block_m,warps,stages,tma|atomic[,flags]' (e.g. '128,64,8,2,tma' or '128,64,8,2,tma,tf') ->
    BwdConfig; ValueError names what is wrong."""
    parts = [p.strip() for p in text.split(",")]
    hint = "expected block_n,block_m,warps,stages,tma|atomic[,flags of t, f, o], e.g. 128,64,8,2,tma,tf"
    flags = parts.pop() if len(parts) == 6 else ""
    if flags.strip("tfo") or len(set(flags)) != len(flags):
        raise ValueError(f"${BWD_ENV}={text!r}: {hint}")
    if len(parts) != 5 or not all(p.isdigit() for p in parts[:4]):
        raise ValueError(f"${BWD_ENV}={text!r}: {hint}")
    block_n, block_m, warps, stages = (int(p) for p in parts[:4])
    if block_n < 16 or TILE_N_TABLE % block_n or block_m < 16 or BLOCK_M_TABLE % block_m:
        raise ValueError(
            f"${BWD_ENV}={text!r}: block_n must divide {TILE_N_TABLE} and block_m {BLOCK_M_TABLE} (each >= 16)"
        )
    if warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 6:
        raise ValueError(f"${BWD_ENV}={text!r}: warps one of 1, 2, 4, 8, 16 and stages 1 to 6")
    if parts[4] not in ("tma", "atomic"):
        raise ValueError(f"${BWD_ENV}={text!r}: {hint}")
    return BwdConfig(block_n, block_m, warps, stages, parts[4], "".join(f for f in "tfo" if f in flags))


def bwd_ladder() -> tuple[BwdConfig, ...]:
    """BWD_CONFIGS, led by $DFLASH_ATTENTION_BWD_CONFIG where set (tuning: the step bench takes a schedule this
    way; the ladder's own rungs stay behind it for a device it does not fit)."""
    text = os.environ.get(BWD_ENV, "").strip()
    return (parse_bwd_config(text), *BWD_CONFIGS) if text else BWD_CONFIGS


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def _fwd_tiles(
        acc, m_i, l_i, q, K, V, k_base, v_base, skn, svn, lo, hi, t0, t1, n_kv, qk_scale,
        D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        """Online softmax over the key tiles [t0, t1) of one interval; returns (acc, m_i, l_i)."""
        offs_d = tl.arange(0, D)
        for start_n in range(t0, t1, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            in_kv = offs_n < n_kv
            k = tl.load(K + k_base + offs_n[None, :] * skn + offs_d[:, None], mask=in_kv[None, :], other=0.0)
            s = tl.dot(q, k) * qk_scale
            if MASKED:
                vis = (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
                s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + v_base + offs_n[:, None] * svn + offs_d[None, :], mask=in_kv[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        return acc, m_i, l_i

    globals()["_fwd_tiles"] = _fwd_tiles

    @triton.jit
    def _fwd(
        Q,
        K,
        V,
        OUT,
        LSE,
        CLO,
        CHI,
        BLO,
        BHI,
        sqb,
        sqh,
        sqm,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        n_q,
        n_kv,
        q_pad,
        H,
        GROUP,
        qk_scale,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        hk = h // GROUP
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < n_q
        lo1 = tl.load(CLO + b * q_pad + offs_m, mask=row_ok, other=0)
        hi1 = tl.load(CHI + b * q_pad + offs_m, mask=row_ok, other=0)
        lo2 = tl.load(BLO + b * q_pad + offs_m, mask=row_ok, other=0)
        hi2 = tl.load(BHI + b * q_pad + offs_m, mask=row_ok, other=0)
        q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = b * skb + hk * skh
        v_base = b * svb + hk * svh
        for which in tl.static_range(2):  # the context interval, then the block's own (disjoint key ranges)
            if which == 0:
                lo = lo1
                hi = hi1
            else:
                lo = lo2
                hi = hi2
            start = (tl.min(tl.where(lo < hi, lo, n_kv)) // BLOCK_N) * BLOCK_N
            end = tl.max(tl.where(lo < hi, hi, 0))
            if SPLIT:
                # [full_lo, full_hi): tiles every in-range row sees whole (a row with an empty interval has
                # lo >= hi, which leaves the range empty); rows past n_q are never stored, so they may see more
                full_lo = tl.cdiv(tl.max(tl.where(row_ok, lo, 0)), BLOCK_N) * BLOCK_N
                full_hi = (tl.min(tl.where(row_ok, hi, n_kv)) // BLOCK_N) * BLOCK_N
                if full_lo < full_hi:
                    acc, m_i, l_i = _fwd_tiles(
                        acc, m_i, l_i, q, K, V, k_base, v_base, skn, svn, lo, hi, start, full_lo, n_kv, qk_scale,
                        D, BLOCK_N, True,
                    )  # fmt: skip
                    acc, m_i, l_i = _fwd_tiles(
                        acc, m_i, l_i, q, K, V, k_base, v_base, skn, svn, lo, hi, full_lo, full_hi, n_kv, qk_scale,
                        D, BLOCK_N, False,
                    )  # fmt: skip
                    start = full_hi
            acc, m_i, l_i = _fwd_tiles(
                acc, m_i, l_i, q, K, V, k_base, v_base, skn, svn, lo, hi, start, end, n_kv, qk_scale,
                D, BLOCK_N, True,
            )  # fmt: skip
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_rows = OUT + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :]
        tl.store(o_rows, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + bh * n_q + offs_m, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), 0.0), mask=row_ok)

    @triton.jit
    def _bwd_pair(
        dk,
        dv,
        k,
        v,
        Q,
        DO,
        LSE,
        DELTA,
        DQ,
        DQ_DESC,
        CLO,
        CHI,
        BLO,
        BHI,
        list_base,
        j,
        g,
        b,
        hk,
        offs_n,
        sqb,
        sqh,
        sqm,
        sdb,
        sdh,
        sdm,
        n_q,
        q_pad,
        dq_sm,
        HK,
        GROUP,
        qk_scale,
        scale,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        TABLE_M: tl.constexpr,
        MASKED: tl.constexpr,
        DQ_MODE: tl.constexpr,
        DQ_T: tl.constexpr,
        FOLD: tl.constexpr,
        ORDER: tl.constexpr,
    ):
        """One (key tile, BLOCK_M query rows of q head g) pair in FA2's orientation: S^T [keys, rows], so P^T
        and dS^T are the A operands of dV and dK as they leave their matmuls; only dQ's is transposed.
        Returns (dk, dv)."""
        qt = tl.load(list_base + j // (TABLE_M // BLOCK_M))
        offs_m = qt * TABLE_M + (j % (TABLE_M // BLOCK_M)) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        h = hk * GROUP + g
        bh = b * HK * GROUP + h
        row_ok = offs_m < n_q
        lse = tl.load(LSE + bh * n_q + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + bh * n_q + offs_m, mask=row_ok, other=0.0)
        do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q_t = tl.load(
            Q + b * sqb + h * sqh + offs_m[None, :] * sqm + offs_d[:, None], mask=row_ok[None, :], other=0.0
        )  # [D, BLOCK_M]
        st = tl.dot(k, q_t) * qk_scale
        pt = tl.exp2(st - lse[None, :])
        if MASKED:
            lo1 = tl.load(CLO + b * q_pad + offs_m, mask=row_ok, other=0)
            hi1 = tl.load(CHI + b * q_pad + offs_m, mask=row_ok, other=0)
            lo2 = tl.load(BLO + b * q_pad + offs_m, mask=row_ok, other=0)
            hi2 = tl.load(BHI + b * q_pad + offs_m, mask=row_ok, other=0)
            n_col = offs_n[:, None]
            vis = ((n_col >= lo1[None, :]) & (n_col < hi1[None, :])) | (
                (n_col >= lo2[None, :]) & (n_col < hi2[None, :])
            )
            pt = tl.where(vis, pt, 0.0)
        # (unmasked: a row past n_q has q = dO = lse = delta = 0, so p = 1 and every product below is 0)
        if ORDER:  # dP^T first: dV's matmul may still run while dS^T is formed
            dpt = tl.dot(v, tl.trans(do))
            dv += tl.dot(pt.to(do.dtype), do)
        else:
            dv += tl.dot(pt.to(do.dtype), do)
            dpt = tl.dot(v, tl.trans(do))
        dst = (pt * (dpt - delta[None, :])).to(do.dtype)
        if not ORDER:
            dk += tl.dot(dst, tl.trans(q_t))
        m0 = qt * TABLE_M + (j % (TABLE_M // BLOCK_M)) * BLOCK_M
        if DQ_MODE != 0 and DQ_T:
            # dQ^T = K^T dS^T [D, rows]: both operands straight from shared memory (K's tile is there already,
            # dS^T is stored as it is), no transpose through registers; rows past n_q are clipped by the mask
            # or by the descriptor's bounds (its columns are this head's n_q rows)
            dqt = tl.dot(tl.trans(k), dst)
            if not FOLD:
                dqt = dqt * scale
            if DQ_MODE == 1:
                tl.atomic_add(
                    DQ + bh * D * dq_sm + offs_d[:, None] * dq_sm + offs_m[None, :],
                    dqt,
                    mask=row_ok[None, :],
                    sem="relaxed",
                )
            else:
                DQ_DESC.atomic_add([bh * D, m0], dqt)
        elif DQ_MODE != 0:
            dq = tl.dot(tl.trans(dst), k)
            if not FOLD:
                dq = dq * scale
            if DQ_MODE == 1:  # fp32 atomics (vectorised where Triton can)
                tl.atomic_add(
                    DQ + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], dq, mask=row_ok[:, None], sem="relaxed"
                )
            else:
                # FA3's dQ: one bulk reduce-add of the tile by the TMA unit (cp.reduce.async.bulk.tensor), left in
                # flight while the next pair's matmuls run. The descriptor spans [R*Hq*Q, D]: rows of a tile past
                # this head's n_q hold exact zeros, so adding them to the next head's first rows changes nothing;
                # past the last row the TMA unit drops them.
                DQ_DESC.atomic_add([bh * n_q + m0, 0], dq)
        if ORDER:  # dK's matmul after dQ's: it may still run while dQ is staged and reduced
            dk += tl.dot(dst, tl.trans(q_t))
        return dk, dv

    # Triton resolves a kernel's callees among its module's globals, not this closure's locals: publish the helper
    # (import triton stays lazy, so the kernels are built here, not at module level).
    globals()["_bwd_pair"] = _bwd_pair

    @triton.jit
    def _bwd(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        DQ_DESC,
        DK,
        DV,
        CLO,
        CHI,
        BLO,
        BHI,
        QCOUNT,
        QINDEX,
        sqb,
        sqh,
        sqm,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sdb,
        sdh,
        sdm,
        n_q,
        n_kv,
        q_pad,
        q_tiles,
        kv_tiles_t,
        dq_sm,
        HK,
        GROUP,
        qk_scale,
        scale,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TABLE_M: tl.constexpr,
        TABLE_N: tl.constexpr,
        DQ_MODE: tl.constexpr,
        DQ_T: tl.constexpr,
        FOLD: tl.constexpr,
        ORDER: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        bhk = tl.program_id(1)
        b = bhk // HK
        hk = bhk % HK
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        in_kv = offs_n < n_kv
        k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * skn + offs_d[None, :], mask=in_kv[:, None], other=0.0)
        v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svn + offs_d[None, :], mask=in_kv[:, None], other=0.0)
        dk = tl.zeros([BLOCK_N, D], DQ.dtype.element_ty)  # fp32 (fp64 for float64 inputs: exact parity tests)
        dv = tl.zeros([BLOCK_N, D], DQ.dtype.element_ty)
        kt = (pid_n * BLOCK_N) // TABLE_N
        n_full = tl.load(QCOUNT + (b * kv_tiles_t + kt) * 2)
        n_part = tl.load(QCOUNT + (b * kv_tiles_t + kt) * 2 + 1)
        list_base = QINDEX + (b * kv_tiles_t + kt) * q_tiles
        # Two flat walks over (q head of the group, listed query tile, sub-tile), as flex splits its full and
        # partial blocks: the full pairs without the mask (no bounds loaded), then the partial ones with it. One
        # software pipeline each, no drain and refill per head.
        steps = n_full * (TABLE_M // BLOCK_M)
        for it in range(0, GROUP * steps):
            g = it // steps
            dk, dv = _bwd_pair(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, DQ_DESC, CLO, CHI, BLO, BHI, list_base, it - g * steps, g,
                b, hk, offs_n, sqb, sqh, sqm, sdb, sdh, sdm, n_q, q_pad, dq_sm, HK, GROUP, qk_scale, scale,
                D, BLOCK_M, TABLE_M, False, DQ_MODE, DQ_T, FOLD, ORDER,
            )  # fmt: skip
        first = steps
        steps = n_part * (TABLE_M // BLOCK_M)
        for it in range(0, GROUP * steps):
            g = it // steps
            dk, dv = _bwd_pair(
                dk, dv, k, v, Q, DO, LSE, DELTA, DQ, DQ_DESC, CLO, CHI, BLO, BHI, list_base, first + it - g * steps,
                g, b, hk, offs_n, sqb, sqh, sqm, sdb, sdh, sdm, n_q, q_pad, dq_sm, HK, GROUP, qk_scale, scale,
                D, BLOCK_M, TABLE_M, True, DQ_MODE, DQ_T, FOLD, ORDER,
            )  # fmt: skip
        kv_rows = bhk * n_kv * D + offs_n[:, None] * D + offs_d[None, :]
        if FOLD:  # P^T was scale * P (the LSE came in shifted by log2 scale): dS^T and so dK already carry it
            tl.store(DK + kv_rows, dk.to(DK.dtype.element_ty), mask=in_kv[:, None])
            tl.store(DV + kv_rows, (dv * (1.0 / scale)).to(DV.dtype.element_ty), mask=in_kv[:, None])
        else:
            tl.store(DK + kv_rows, (dk * scale).to(DK.dtype.element_ty), mask=in_kv[:, None])
            tl.store(DV + kv_rows, dv.to(DV.dtype.element_ty), mask=in_kv[:, None])

    return triton, _fwd, _bwd


@functools.cache
def _delta_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _delta(OUT, DO, DELTA, sdb, sdh, sdm, n_q, H, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta[r, h, m] = sum_d o * do in the accumulation dtype, one read of each (o contiguous)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < n_q
        o = tl.load(OUT + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(
            DO + (bh // H) * sdb + (bh % H) * sdh + offs_m[:, None] * sdm + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        acc_ty = DELTA.dtype.element_ty
        tl.store(DELTA + bh * n_q + offs_m, tl.sum(o.to(acc_ty) * do.to(acc_ty), 1), mask=row_ok)

    return _delta


@functools.cache
def _dq_out_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _dq_out(DQT, DQ, n_q, dq_sm, D: tl.constexpr, BLOCK_M: tl.constexpr):
        """dq[r, h, m, :] = dqt[r, h, :, m] in dq's dtype: the transposed accumulator (BwdConfig flag "t") back
        to q's layout, one read and one write (Triton transposes the tile on chip)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        row_ok = offs_m < n_q
        t = tl.load(DQT + bh * D * dq_sm + offs_d[None, :] * dq_sm + offs_m[:, None], mask=row_ok[:, None])
        tl.store(
            DQ + bh * n_q * D + offs_m[:, None] * D + offs_d[None, :], t.to(DQ.dtype.element_ty), mask=row_ok[:, None]
        )

    return _dq_out


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} must be [R,Hq,Q,D] and k, v {tuple(k.shape)} [R,Hkv,K,D]")
    if q.shape[1] % k.shape[1] or q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("Hq must be a multiple of Hkv and the head dimension contiguous")
    if not q.dtype == k.dtype == v.dtype:
        # the kernels' tl.dot needs equal operand dtypes: mixed ones fail inside Triton's compiler with a bare
        # position ("CompilationError at 83:17", issue 31 item 2), so say it here; interval_attention casts first
        raise TypeError(f"q, k, v must have one dtype (got {q.dtype}, {k.dtype}, {v.dtype})")


def forward(q, k, v, ctx_lo, ctx_hi, blk_lo, blk_hi, scale: float, config: FwdConfig | None = None):
    """(o [R,Hq,Q,D] contiguous, lse fp32 [R,Hq,Q] in base 2) of the interval-masked attention. `config`: launch
    that one configuration (benches, tests; no fit check) instead of the first of FWD_CONFIGS that fits."""
    _check(q, k, v)
    _, fwd, _ = _kernels()
    R, H, n_q, D = q.shape
    hkv, n_kv = k.shape[1], k.shape[2]
    o = torch.empty(R, H, n_q, D, dtype=q.dtype, device=q.device)
    # fp32 (fp64 for float64 inputs: the exact parity tests on CPU)
    lse = torch.empty(R, H, n_q, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
    qk_scale = scale * 1.4426950408889634

    def launch(c: FwdConfig):
        grid = (-(-n_q // c.block_m), R * H)
        args = (
            q,
            k,
            v,
            o,
            lse,
            ctx_lo,
            ctx_hi,
            blk_lo,
            blk_hi,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            n_q,
            n_kv,
            ctx_lo.shape[1],
            H,
            H // hkv,
            qk_scale,
        )
        return grid, args, c.launch_kwargs(D)

    with triton_fit.on_device(q.device):
        if config is not None:
            grid, args, kwargs = launch(config)
            fwd[grid](*args, **kwargs)
        else:
            triton_fit.launch_first_fit("attention-fwd", fwd, fwd_ladder(), launch, q.device, (q.dtype, D))
    return o, lse


def effective(c: BwdConfig, device: torch.device) -> BwdConfig:
    """`c` as it can run on `device`: the TMA reduce needs Hopper or later and a compiled kernel (Triton's CPU
    interpreter has no descriptor reduce), elsewhere the same tiles accumulate dQ with atomics, without flag "t"
    (its transposed atomics were slower on the H200: `atomic-tf` 18.4 against `atomic` 17.4 ms, bench/results/kernels.md 2026-12-05 "The attention backward's dQ path")."""
    if c.dq != "tma":
        return c
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return BwdConfig(c.block_n, c.block_m, c.num_warps, c.num_stages, "atomic", c.flags.replace("t", ""))
    return c


def dq_buffer(c: BwdConfig, q: torch.Tensor) -> torch.Tensor:
    """The zeroed accumulator `c` adds dQ into: fp32 (fp64 for float64 inputs) [R, Hq, Q, D], or with flag "t"
    [R, Hq, D, Qp] (Qp = Q rounded up to 4: the TMA unit needs 16-byte row strides)."""
    R, H, n_q, D = q.shape
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if "t" in c.flags:
        return torch.zeros(R, H, D, -(-n_q // 4) * 4, dtype=acc_dtype, device=q.device)
    return torch.zeros(R, H, n_q, D, dtype=acc_dtype, device=q.device)


def _bwd_launch(c: BwdConfig, q, k, v, do, lse, delta, dq, dk, dv, table: IntervalTable, scale: float):
    """(grid, args, keyword args) of one backward launch of configuration `c` (already `effective`); dq from
    dq_buffer(c, q)."""
    R, H, n_q, D = q.shape
    hkv, n_kv = k.shape[1], k.shape[2]
    kv_tiles_t, q_tiles = table.q_index.shape[1], table.q_index.shape[2]
    transposed = "t" in c.flags
    desc = None
    if c.dq == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        if transposed:  # columns are one head's n_q rows: a tile's rows past n_q are dropped by the TMA unit
            desc = TensorDescriptor(dq, [R * H * D, n_q], [dq.stride(2), 1], [D, c.block_m])
        else:
            desc = TensorDescriptor.from_tensor(dq.view(R * H * n_q, D), [c.block_m, D])
    if "f" in c.flags:  # P^T = exp2(S^T - lse + log2 scale) = scale * P^T (see BwdConfig)
        lse = lse - math.log2(scale)
    grid = (-(-n_kv // c.block_n), R * hkv)
    args = (
        q,
        k,
        v,
        do,
        lse,
        delta,
        dq,
        desc,
        dk,
        dv,
        table.ctx_lo,
        table.ctx_hi,
        table.blk_lo,
        table.blk_hi,
        table.q_count,
        table.q_index,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        do.stride(0),
        do.stride(1),
        do.stride(2),
        n_q,
        n_kv,
        table.ctx_lo.shape[1],
        q_tiles,
        kv_tiles_t,
        dq.stride(2) if transposed else 0,
        hkv,
        H // hkv,
        scale * 1.4426950408889634,
        scale,
    )
    kwargs = dict(
        D=D,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        TABLE_M=BLOCK_M_TABLE,
        TABLE_N=TILE_N_TABLE,
        DQ_MODE=DQ_MODES[c.dq],
        DQ_T=transposed,
        FOLD="f" in c.flags,
        ORDER="o" in c.flags,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
    )
    return grid, args, kwargs


def backward(do, q, k, v, o, lse, table: IntervalTable, scale: float, config: BwdConfig | None = None):
    """(dq, dk, dv), each contiguous in its input's shape and dtype. `config`: launch that one configuration
    (benches; no fit check) instead of the first of BWD_CONFIGS that fits the device."""
    _, _, bwd = _kernels()
    R, H, n_q, D = q.shape
    if do.stride(3) != 1:
        do = do.contiguous()
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    # delta = rowsum(o * do) by one small kernel: the torch expression (fp32 copies of o and do, their product,
    # its sum) moved ~2.7 GB at the seed shape, ~0.8 ms against one ~0.55 GB read.
    delta = torch.empty(R, H, n_q, dtype=acc_dtype, device=q.device)
    o = o.contiguous()
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    buffers: dict[bool, torch.Tensor] = {}  # dQ's accumulator per layout (a ladder may mix them)

    def buffer(c: BwdConfig) -> torch.Tensor:
        transposed = "t" in c.flags
        if transposed not in buffers:
            buffers[transposed] = dq_buffer(c, q)
        return buffers[transposed]

    def launch(c: BwdConfig):
        e = effective(c, q.device)
        return _bwd_launch(e, q, k, v, do, lse, delta, buffer(e), dk, dv, table, scale)

    # dq is accumulated in place: a rung refused after a partial launch never happens (the fit is decided by
    # compiling, before any launch; an OutOfResources at launch means nothing ran).
    with triton_fit.on_device(q.device):
        _delta_kernel()[(-(-n_q // 64), R * H)](
            o, do, delta, do.stride(0), do.stride(1), do.stride(2), n_q, H, D=D, BLOCK_M=64, num_warps=4
        )
        if config is not None:
            grid, args, kwargs = launch(config)
            bwd[grid](*args, **kwargs)
            used = config
        else:
            used = triton_fit.launch_first_fit("attention-bwd", bwd, bwd_ladder(), launch, q.device, (q.dtype, D))
        if "t" not in effective(used, q.device).flags:
            return buffers[False].to(q.dtype), dk, dv
        dqt = buffers[True]
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        _dq_out_kernel()[(-(-n_q // 64), R * H)](dqt, dq, n_q, dqt.stride(2), D=D, BLOCK_M=64, num_warps=4)
    return dq, dk, dv


# ----------------------------------------------------------------------------------- autograd through custom ops


@torch.library.custom_op("dflash::interval_attention", mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ctx_lo: torch.Tensor,
    ctx_hi: torch.Tensor,
    blk_lo: torch.Tensor,
    blk_hi: torch.Tensor,
    q_count: torch.Tensor,
    q_index: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, ctx_lo, ctx_hi, blk_lo, blk_hi, scale)


@_attention_op.register_fake
def _(q, k, v, ctx_lo, ctx_hi, blk_lo, blk_hi, q_count, q_index, scale):
    R, H, n_q, D = q.shape
    return q.new_empty(R, H, n_q, D), q.new_empty(
        R, H, n_q, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32
    )


@torch.library.custom_op("dflash::interval_attention_backward", mutates_args=())
def _attention_backward_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    ctx_lo: torch.Tensor,
    ctx_hi: torch.Tensor,
    blk_lo: torch.Tensor,
    blk_hi: torch.Tensor,
    q_count: torch.Tensor,
    q_index: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    table = IntervalTable(ctx_lo, ctx_hi, blk_lo, blk_hi, q_count, q_index)
    return backward(do, q, k, v, o, lse, table, scale)


@_attention_backward_op.register_fake
def _(do, q, k, v, o, lse, ctx_lo, ctx_hi, blk_lo, blk_hi, q_count, q_index, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *table, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *table)
    ctx.scale = scale


def _backward(ctx, do, dlse):
    q, k, v, o, lse, *table = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(do.to(o.dtype), q, k, v, o, lse, *table, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def interval_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: IntervalTable, scale: float | None = None
) -> torch.Tensor:
    """Attention of q [R,Hq,Q,D] over k, v [R,Hkv,K,D] under the table's intervals -> [R,Hq,Q,D] (rows that see
    nothing: 0, zero gradient). Differentiable in q, k, v."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # One dtype for the kernels, the narrowest of the three: in the bf16-autocast step q and k leave q_norm/k_norm in
    # fp32 (fp32 weight x bf16) while v stays bf16; the fp32 q/k tiles also doubled the backward's shared memory
    # (262,144 B against the H200's 232,448, bench/results/kernels.md 2026-12-03 "Our own Triton attention"). Gradients return in each input's dtype.
    dtype = min((q.dtype, k.dtype, v.dtype), key=lambda d: torch.finfo(d).bits)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    o, _ = _attention_op(
        q, k, v, table.ctx_lo, table.ctx_hi, table.blk_lo, table.blk_hi, table.q_count, table.q_index, scale
    )
    return o


def usable(device: torch.device) -> tuple[bool, str]:
    """(whether both kernels have a configuration that fits `device`, why not): compiles them for a tiny
    problem once (no launch). CPU: only under the Triton interpreter."""
    if device.type != "cuda":
        interpreting = triton_fit._interpreting()
        return interpreting, "" if interpreting else "needs a CUDA device (or TRITON_INTERPRET=1)"
    try:
        _, fwd, bwd = _kernels()
    except ImportError as exc:
        return False, f"no triton: {exc}"
    R, H, n, D = 1, 2, 64, 128
    q = torch.zeros(R, H, n, D, dtype=torch.bfloat16, device=device)
    bounds = torch.zeros(R, n, dtype=torch.int32, device=device)
    table = build_table(bounds, bounds, bounds, bounds, n, n)
    lse = torch.zeros(R, H, n, device=device)

    def fwd_args(c: FwdConfig):
        args = (
            q,
            q,
            q,
            q,
            lse,
            bounds,
            bounds,
            bounds,
            bounds,
            *q.stride()[:3],
            *q.stride()[:3],
            *q.stride()[:3],
            n,
            n,
            n,
            H,
            1,
            1.0,
        )
        return (1, 1), args, c.launch_kwargs(D)

    def bwd_args(c: BwdConfig):
        e = effective(c, device)
        grid, args, kwargs = _bwd_launch(e, q, q, q, q, lse, lse, dq_buffer(e, q), q, q, table, 1.0)
        return (1, 1), args, kwargs

    limit = triton_fit.smem_limit(device)
    if triton_fit.fits("attention-fwd", fwd, fwd_ladder(), fwd_args, device) is None:
        return False, f"no forward configuration within {limit} B of shared memory"
    if triton_fit.fits("attention-bwd", bwd, bwd_ladder(), bwd_args, device) is None:
        return False, f"no backward configuration within {limit} B of shared memory"
    return True, ""
