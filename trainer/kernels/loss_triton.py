"""One fused Triton kernel per loss chunk for the CE part of ``trainer.training.loss.dflash_loss`` (CE and CE+CAP).

Contract of ``fused_ce(logits, labels)`` for one chunk, logits [C, V] (bf16/fp16/fp32, rows contiguous),
labels [C] int64 in [0, V) (the caller's "safe" labels: any in-range value on rows whose weight is 0):
    grad   [C, V] logits.dtype  g = softmax(x) - onehot(label), UNSCALED (None with want_grad=False)
    lse    [C] fp32             logsumexp(x)
    ce     [C] fp32             lse - x[label]  (NaN if a label is out of range instead of a wild read)
    argmax [C] int64            first index of the row maximum, like torch.argmax (NaN rows: unspecified)
All statistics are accumulated in fp32, whatever the logits' dtype (float64 logits are refused: use the
eager/compiled kernels for those). Because g is unscaled, the per-row coefficient (w/normalizer, plus CAP's
coefficient, which needs the CE of the whole block first) is applied after the input-gradient GEMM as a row
scale: diag(c) (P - Y) W = (g @ W) * c[:, None], exact algebra, and it keeps CAP working with one kernel.
Soft labels (KL) are handled by the sibling kernel in trainer/kernels/loss_triton_kl.py (same launch config class,
same row loop, the same unscaled-g contract with a KL term added).

The kernel, one row per program iteration:
  pass 1 over V in tiles of BLOCK_V: online max / sum-exp in fp32 (one exp per element; the tile's max and
         first arg-max come from one reduction), then lse, the label's logit, CE and argmax;
  pass 2 over V: re-reads the row and writes g = exp(x - lse) - [col == label] in the logits' dtype.

Memory traffic (bytes per [C, V] element; the GEMMs write/read the bf16 logits and g themselves):
  torch.compile'd two-kernel path: the stats kernel reads the logits (2 B), the gradient kernel reads them
  again (2 B) and writes g (2 B): 6 B from/to HBM, in two launches.
  fused: pass 1 reads 2 B from HBM, pass 2 re-reads the row just read (2 B) and writes g (2 B). The re-read
  is an L2 hit only if the rows in flight fit in L2: a row is V*2 B = 304 KB at V=151936 (485 KB at
  V=248320) and the H200's L2 is 60 MB, i.e. ~1-2 rows per SM in flight. One program per row
  (programs_per_sm=0, the default) lets occupancy put several rows per SM in flight: more loads in flight,
  but more of the re-read comes from HBM; a persistent grid of 1-2 programs per SM with large tiles and many
  warps (e.g. "16384:16:2") keeps the working set near the L2's size. Pass-1 loads are marked evict_last,
  pass-2 loads evict_first, g's stores streaming (.cs), for the same reason. Cost model at H=4096: one
  GEMM-equivalent is 2H = 8192 FLOP per element, ~10 ps at ~790 TFLOP/s; 4-6 B at ~4.3 TB/s is ~1-1.4 ps,
  so the ideal fused element-wise work is ~0.1 GEMM-eq. Two exps per element against ~3.9 T exp/s (MUFU)
  is ~0.5 ps: hidden under the memory time.
Measured on the H200 (bench/loss_gemm.py --profile, M=32832 H=4096 V=151936 bf16, chunk 1728 rows):
  this kernel takes 0.58 ms per chunk inside the loss (0.19 GEMM-eq in all) where the compiled stats +
  gradient kernels take 0.57 + 0.70 ms (0.42 GEMM-eq); CE went from 2.34 to 2.25 GEMM-eq at chunk 1728 and
  from 2.31 to 2.14 at chunk 4096 (CE+CAP the same). Alone on one chunk: 0.54 ms at 4096:8:0, of which pass
  1 is 0.25 ms (2.1 TB/s of reads: half of HBM's bandwidth, as its two block-wide reductions per tile
  serialise loads and barriers), and 0.51-0.65 ms across 8192:8:0, 16384:16:1/2, 32768:32:1, 8192:16:1, so
  the default stays the simplest. The next step, if the ~0.1 GEMM-eq left matters: a barrier-free pass 1
  (per-warp running max/sum over a [warps, BLOCK_V/warps] tile, combined once per row) and a prefetch of the
  next tile before reducing the current one.

Tuning without autotune (compile time at a worker's first call must be predictable): ``CEKernelConfig``
(BLOCK_V, num_warps, programs_per_sm), default 4096:8:0, overridable for experiments through the
environment variable DFLASH_CE_TRITON="BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM]" (read by make_chunk_kernels).
Each (dtype, BLOCK_V, num_warps, want_grad) compiles once per device; the row count is not specialised,
so the short last chunk does not recompile.

Triton is imported at the first call, never at import time: the trainer imports (and the CPU CI runs)
without it. Under TRITON_INTERPRET=1 (set before the first call) the kernel runs on CPU tensors through
Triton's interpreter, which is how tests/trainer/test_loss_triton.py checks it against the eager path.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

from trainer.kernels import triton_fit

ENV_CONFIG = "DFLASH_CE_TRITON"
TOPK_ENV_CONFIG = "DFLASH_CE_TOPK_TRITON"


class TritonUnavailableError(RuntimeError):
    """The fused kernel cannot run here (no triton package, or no CUDA device and no interpreter)."""


@dataclass(frozen=True)
class CEKernelConfig:
    """Launch configuration. block_v: tile width over V (a power of two; clamped to V's next power of
    two). num_warps: warps per program. programs_per_sm: 0 = one program per row (the hardware schedules
    as many as occupancy allows); k > 0 = a persistent grid of k programs per SM, each looping over rows
    (fewer rows in flight, so pass 2's re-read stays in L2)."""

    block_v: int = 4096
    num_warps: int = 8
    programs_per_sm: int = 0

    def __post_init__(self) -> None:
        if self.block_v < 16 or self.block_v & (self.block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16 (got {self.block_v})")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two <= 32 (got {self.num_warps})")
        if self.programs_per_sm < 0:
            raise ValueError(f"programs_per_sm must be >= 0 (got {self.programs_per_sm})")

    @classmethod
    def parse(cls, text: str) -> CEKernelConfig:
        """'4096:8' or '16384:16:1' -> config (BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM])."""
        try:
            parts = [int(p) for p in text.split(":")]
        except ValueError:
            parts = []
        if not 2 <= len(parts) <= 3:
            raise ValueError(f"expected BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM], got {text!r}")
        return cls(*parts)

    @classmethod
    def from_env(cls) -> CEKernelConfig:
        text = os.environ.get(ENV_CONFIG, "").strip()
        return cls.parse(text) if text else cls()

    @property
    def label(self) -> str:
        return f"{self.block_v}:{self.num_warps}:{self.programs_per_sm}"


# DFlash2's kernel (fused_ce_topk) has a default of its own: each insertion into the running top-k is an arg-max over
# one tile, whose cost is mostly the cross-warp step (shared memory and barriers), so fewer warps and a narrower tile
# win although the row takes a few more insertions. One chunk [3968, 151936] bf16 on the H200 (bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor",
# bench/topk_tiles.py), N(0,1) / Zipf-biased rows: 4096:8 2.00-2.05 / 1.61 ms, 2048:4 1.57-1.63 /
# 1.44, 1024:1 1.59-1.60 / 1.48, 2048:8 2.01-2.07 / 1.71; plain fused_ce at 4096:8 1.25-1.30.
TOPK_CONFIG = CEKernelConfig(block_v=2048, num_warps=4, programs_per_sm=0)


def topk_config_from_env() -> CEKernelConfig:
    """$DFLASH_CE_TOPK_TRITON ("BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM]") or TOPK_CONFIG."""
    text = os.environ.get(TOPK_ENV_CONFIG, "").strip()
    return CEKernelConfig.parse(text) if text else TOPK_CONFIG


def config_ladder(config: CEKernelConfig) -> tuple[CEKernelConfig, ...]:
    """`config`, then smaller tiles for GPUs with less shared memory (trainer/kernels/triton_fit.py walks it): the CE
    kernels keep only per-warp reduction scratch in shared memory, so the smaller rungs are a safety net, not a
    tuning (Blackwell's ~100 KB fits the default)."""
    rungs = [config, CEKernelConfig(2048, 4, config.programs_per_sm), CEKernelConfig(1024, 4, config.programs_per_sm)]
    return tuple(dict.fromkeys(rungs))


def fits_device(device: torch.device, config: CEKernelConfig | None = None) -> bool:
    """Whether some rung of the CE kernel's ladder compiles within `device`'s shared memory (compiled for a
    tiny bf16 problem, not launched; once per device and config): --loss-kernels auto asks this."""
    key = (str(device), config)
    if key not in _FITS:
        logits = torch.zeros(4, 151936, dtype=torch.bfloat16, device=device)
        labels = torch.zeros(4, dtype=torch.int64, device=device)
        out = torch.zeros(4, dtype=torch.float32, device=device)

        def launch(c: CEKernelConfig) -> tuple[tuple, tuple, dict]:
            args = (logits, labels, logits, out, out, labels, 4, logits.stride(0), logits.stride(0), out, labels)
            return (4,), args, dict(N_COLS=151936, BLOCK_V=c.block_v, WRITE_GRAD=True, num_warps=c.num_warps)

        ladder = config_ladder(config or CEKernelConfig.from_env())
        _FITS[key] = triton_fit.fits("ce", _kernel(), ladder, launch, device) is not None
    return _FITS[key]


_FITS: dict[tuple, bool] = {}


def triton_available() -> bool:
    """Whether the triton package is installed (found, not imported: importing it waits for the first call)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernel():
    """Import triton and define the kernel (once per process; Triton caches compiled binaries per device).
    Whether it runs compiled or interpreted is decided here, by TRITON_INTERPRET at the first call."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise TritonUnavailableError(
            "the triton loss kernels need the triton package (CUDA torch wheels bring it)"
        ) from exc

    @triton.jit(do_not_specialize=["n_rows"])
    def _ce_rows_kernel(
        logits_ptr,
        labels_ptr,
        grad_ptr,
        lse_ptr,
        ce_ptr,
        argmax_ptr,
        n_rows,
        logits_stride,
        grad_stride,
        top_values_ptr,
        top_ids_ptr,
        N_COLS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        TOP_K: tl.constexpr = 0,
        TOP_PAD: tl.constexpr = 1,
    ):
        # V is a compile-time constant (fixed per run) and rows advance in a while loop: Triton 3.6's
        # interpreter under numpy >= 2.4 cannot take range() bounds that are runtime values (triton#9171).
        cols = tl.arange(0, BLOCK_V)
        row = tl.program_id(0)
        while row < n_rows:
            x_row = logits_ptr + row.to(tl.int64) * logits_stride
            label = tl.load(labels_ptr + row).to(tl.int32)
            # pass 1: running max m (also the arg-max's value), sum of exp(x - m), first arg-max
            m = tl.full((), float("-inf"), tl.float32)
            s = tl.full((), 0.0, tl.float32)
            arg = tl.full((), 0, tl.int32)
            if TOP_K > 0:
                # the running top-TOP_PAD of the row (values, column ids), unordered; placeholders hold -inf and
                # distinct ids >= N_COLS, so they are the first evicted and never collide with a real column
                slots = tl.arange(0, TOP_PAD)
                top_v = tl.full((TOP_PAD,), float("-inf"), tl.float32)
                top_i = N_COLS + slots
            for start in range(0, N_COLS, BLOCK_V):
                idx = start + cols
                x = tl.load(x_row + idx, mask=idx < N_COLS, other=float("-inf"), eviction_policy="evict_last").to(
                    tl.float32
                )
                tile_max, tile_arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
                arg = tl.where(tile_max > m, start + tile_arg, arg)  # strict: an earlier tile wins a tie
                m_new = tl.maximum(m, tile_max)
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)  # masked lanes: exp(-inf) = 0
                m = m_new
                if TOP_K > 0:
                    # Merge the tile into the running top: take the tile's elements best first (value, then the
                    # lower column) while they beat the worst held one (strictly: an equal value at a later column
                    # loses), each replacing the worst (the lowest value, of those the highest column). Held
                    # elements then are the row's top under (value desc, column asc). Cost: one tile reduction
                    # per insertion; after the first tiles only a few elements a tile get in (~TOP_K/t at the
                    # t-th tile for unordered rows), and a tile whose maximum is below the worst costs nothing.
                    worst = tl.min(top_v, 0)
                    cur, cur_arg, xk = tile_max, tile_arg, x
                    while cur > worst:
                        out_id = tl.max(tl.where(top_v == worst, top_i, -1), 0)
                        held = top_i == out_id
                        top_v = tl.where(held, cur, top_v)
                        top_i = tl.where(held, start + cur_arg, top_i)
                        xk = tl.where(cols == cur_arg, float("-inf"), xk)
                        cur, cur_arg = tl.max(xk, 0, return_indices=True, return_indices_tie_break_left=True)
                        worst = tl.min(top_v, 0)
            lse = m + tl.log(s)
            in_range = (label >= 0) & (label < N_COLS)
            x_label = tl.load(x_row + label, mask=in_range, other=float("nan")).to(tl.float32)
            tl.store(lse_ptr + row, lse)
            tl.store(ce_ptr + row, lse - x_label)
            tl.store(argmax_ptr + row, arg.to(tl.int64))
            if TOP_K > 0:
                # the held elements best first, as torch.topk(sorted=True) orders them (ties: the lower column)
                alive = slots < TOP_PAD
                for j in range(0, TOP_K):
                    best = tl.max(tl.where(alive, top_v, float("-inf")), 0)
                    best_id = tl.min(tl.where(alive & (top_v == best), top_i, N_COLS + TOP_PAD), 0)
                    alive = alive & (top_i != best_id)
                    tl.store(top_values_ptr + row.to(tl.int64) * TOP_K + j, best)
                    tl.store(top_ids_ptr + row.to(tl.int64) * TOP_K + j, best_id.to(tl.int64))
            if WRITE_GRAD:
                # pass 2: the same row again (L2 if the rows in flight fit), g = softmax - onehot, unscaled
                g_row = grad_ptr + row.to(tl.int64) * grad_stride
                for start in range(0, N_COLS, BLOCK_V):
                    idx = start + cols
                    mask = idx < N_COLS
                    x = tl.load(x_row + idx, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                    p = tl.exp(x - lse)
                    g = tl.where(idx == label, p - 1.0, p)
                    tl.store(g_row + idx, g.to(grad_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
            row += tl.num_programs(0)

    return _ce_rows_kernel


def fused_ce(
    logits: torch.Tensor, labels: torch.Tensor, *, want_grad: bool = True, config: CEKernelConfig | None = None
):
    """(grad or None, lse, ce, argmax) of one chunk; see the module docstring for the contract."""
    grad, lse, ce, argmax, _, _ = _fused_ce(logits, labels, want_grad=want_grad, config=config, topk=0)
    return grad, lse, ce, argmax


def fused_ce_topk(
    logits: torch.Tensor,
    labels: torch.Tensor,
    topk: int,
    *,
    want_grad: bool = True,
    config: CEKernelConfig | None = None,
):
    """fused_ce's (grad or None, lse, ce, argmax), plus each row's top-``topk`` logits from the same pass over the
    row: (values [C, topk] fp32, ids [C, topk] int64), best first, as ``logits.float().topk(topk)`` with ties
    broken by the lower column (torch.topk leaves the order of ties, and which of them fill the last places,
    unspecified). 1 <= topk <= V; NaN rows: unspecified; rows with fewer than topk logits above -inf: the
    missing places hold ids >= V."""
    if not 1 <= topk <= logits.shape[-1]:
        raise ValueError(f"topk must be in [1, {logits.shape[-1]}] (got {topk})")
    return _fused_ce(logits, labels, want_grad=want_grad, config=config, topk=topk)


def _fused_ce(logits: torch.Tensor, labels: torch.Tensor, *, want_grad: bool, config: CEKernelConfig | None, topk: int):
    config = config or CEKernelConfig()
    if logits.dim() != 2 or labels.shape != (logits.shape[0],):
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must be [C, V] and [C]")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(
            f"the triton CE kernel accumulates in fp32; {logits.dtype} logits need the eager or compiled kernels"
        )
    if logits.device.type != "cuda" and not _interpreting():
        raise TritonUnavailableError(
            f"the triton loss kernels need a CUDA device (logits are on {logits.device}; "
            "TRITON_INTERPRET=1 runs them on CPU, slowly, for tests)"
        )
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if want_grad else None
    lse = torch.empty(rows, dtype=torch.float32, device=device)
    ce = torch.empty(rows, dtype=torch.float32, device=device)
    argmax = torch.empty(rows, dtype=torch.int64, device=device)
    top_values = torch.empty(rows, topk, dtype=torch.float32, device=device) if topk else lse
    top_ids = torch.empty(rows, topk, dtype=torch.int64, device=device) if topk else argmax
    outputs = (grad, lse, ce, argmax, top_values if topk else None, top_ids if topk else None)
    if rows == 0:
        return outputs
    # a persistent grid of programs_per_sm programs per SM, else one program per row
    programs = rows if config.programs_per_sm == 0 else min(rows, triton_fit.sm_count(device) * config.programs_per_sm)
    guard = triton_fit.on_device(device)
    ladder = config_ladder(config)

    def launch(c: CEKernelConfig) -> tuple[tuple, tuple, dict]:
        args = (
            logits,
            labels,
            grad if grad is not None else logits,
            lse,
            ce,
            argmax,
            rows,
            logits.stride(0),
            grad.stride(0) if grad is not None else 0,
            top_values,
            top_ids,
        )
        width = min(c.block_v, max(16, 1 << (vocab - 1).bit_length()))
        grid = (rows if c.programs_per_sm == 0 else programs,)
        pad = 1 << max(0, topk - 1).bit_length()  # the running top's width: tl.arange wants a power of two
        meta = dict(N_COLS=vocab, BLOCK_V=width, WRITE_GRAD=want_grad, TOP_K=topk, TOP_PAD=pad, num_warps=c.num_warps)
        return grid, args, meta

    with (
        guard
    ):  # the first configuration of the ladder that fits the device's shared memory (trainer/kernels/triton_fit.py)
        key = (logits.dtype, vocab, want_grad, topk)
        triton_fit.launch_first_fit("ce", _kernel(), ladder, launch, device, key)
    return outputs
