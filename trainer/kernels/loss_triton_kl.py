"""Fused Triton kernels for the soft-label part of ``trainer.training.loss.dflash_loss`` (CE + KL, and CE + KL + CAP).

Per row, x = the student's logits, t = the teacher's (both [C, V], bf16/fp16/fp32, rows contiguous), T the
temperature, y the one-hot label, p = softmax(x), p_T = softmax(x/T), q_T = softmax(t/T):

Contract of ``fused_ce_kl(logits, teacher, labels, temperature=T, kl_ratio=r)`` (one launch per chunk):
    grad   [C, V] logits.dtype  g = (p - y) + r * (p_T - q_T), UNSCALED in the CE direction (None with
                                want_grad=False); written into ``out`` when given, which may be ``teacher``
                                itself (every element of it is read before the same program overwrites it)
    lse    [C] fp32             logsumexp(x)                       (T = 1, for CE)
    ce     [C] fp32             lse - x[label]  (NaN if a label is out of range instead of a wild read)
    kl     [C] fp32             KL(q_T || p_T) = sum q_T (log q_T - log p_T)   (no weight, no T^2)
    argmax [C] int64            first index of the row maximum of x, like torch.argmax (NaN rows: unspecified)
The loss multiplies row i of g @ W by c_i = w_i / normalizer after the input-gradient GEMM; with r = kl_weight * T
that is exactly d loss / d logits = c (p - y) + c kl_weight T (p_T - q_T) (trainer/training/loss.py ``_logit_grad``),
because without CAP the KL coefficient over the CE coefficient is the same constant on every row.

With CAP as well the CE coefficient c_i = w_i/normalizer + cap_i needs the CE of the row's whole block first, so
the ratio kl_coef_i / c_i differs per row and is known only after every row of the chunk has its CE. That case
takes two launches: ``ce_kl_stats`` (pass 1 only: the statistics above plus a [C, 5] fp32 row state), then the
caller computes the CAP coefficients and the per-row ratio, then ``ce_kl_grad`` (pass 2 only, reading the row
state and ratio [C]). Same arithmetic, same outputs; the cost is that pass 2 re-reads x and t from HBM instead
of (partly) from L2. Evaluation (no gradient) runs ``ce_kl_stats`` alone.

Pass 1 (statistics) over V in tiles of BLOCK_V, one reduction per tile: (max x, its first index, max t) in
one tuple reduce; everything else is accumulated per lane in [BLOCK_V] fp32 vectors (rescaled by the per-tile
shift of the maxima, summed across lanes once per row), which keeps block-wide barriers to one per tile:
    s   = sum exp(x - m_x)        s_T = sum exp((x - m_x)/T)        s_t = sum exp((t - m_t)/T)
    a   = sum exp((t - m_t)/T) * ((t - m_t) - (x - m_x))
    lse = m_x + log s,   KL = a / (T s_t) + log s_T - log s_t
(KL from log q_T - log p_T = ((t - m_t) - (x - m_x))/T - log s_t + log s_T: centred differences, so large
logits lose no precision in the cancellation.) The next tile's loads are issued before the current tile is
reduced (software prefetch), so a program has two tiles of loads in flight.
Pass 2 (gradient) re-reads x and t: e = exp((x - m_x)/T), p_T = e / s_T, p = e^T / s (for T = 1..4 an integer
power, i.e. multiplies; else its own exp), q_T = exp((t - m_t)/T) / s_t.

Cost per [C, V] element (the GEMMs write x and t and read g themselves):
  bytes: pass 1 reads x and t (4 B from HBM), pass 2 re-reads them (4 B, an L2 hit only while the rows in
  flight fit: a row of x and t is 2 * V * 2 B = 608 KB at V=151936, so ~132 rows in flight (one per SM) are
  80 MB against the H200's 50-60 MB of L2: expect mostly HBM; pass-1 loads are marked evict_last, pass-2
  loads evict_first and g's stores streaming, as in the CE kernel) and writes g (2 B): 6-10 B, against an
  estimated 10-12 B in two or more launches for the torch.compile'd kernels (statistics read x; the gradient
  kernel reads x and t, t once more for the teacher's logsumexp, and writes g).
  exps: 4 per element at an integer temperature (T = 2, the seed's: 2 in each pass), 6 otherwise. At ~4.2 T
  MUFU exp/s on the H200 that is ~1 ps per element, under the ~2.3-2.9 ps of 8-10 B at 3.5-4.3 TB/s, and ~38
  fp32 ALU operations per element (~1.1 ps) overlap with both, so the kernel should be memory-bound. One
  GEMM-equivalent at H=4096 is ~11.6 ps per element (8192 FLOP at ~700 TFLOP/s achieved), so the ideal is
  ~0.2-0.25 GEMM-eq. Measured on the H200 (bench/results/step.md 2026-12-01, CE+KL): the kernel takes 22.3 ms of a
  192 ms CE+KL fwd+bwd at 4096-row chunks (0.38 GEMM-eq), the whole loss 3.29 GEMM-eq against 3.55 for the
  compiled kernels, peak 2.35 GiB against 3.54.

Launch config: ``CEKernelConfig`` (BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM], trainer/kernels/loss_triton.py), default
2048:4:0, overridable through $DFLASH_KL_TRITON or ``make_chunk_kernels(..., kl_triton_config=...)``. Timed on
the H200 (CE+KL at 4096-row chunks, GEMM-eq): 2048:4:0 3.29, 1024:4:0 3.32, 512:4:0 3.35, 2048:8:0 3.36,
4096:16:1 3.37, 4096:16:0 3.40. Register counts, compiled offline for sm_90 with triton 3.6 (ptxas via cuobjdump): the
one-launch kernel needs 96 registers at 1024:4 (8 columns per thread: the 4 per-lane accumulators, two tiles
of x and t), so 5 programs (20 warps, ~40 KB of loads in flight) fit on an SM; 2048:8 needs 101 (2 programs,
~32 KB), 4096:16 101 (1 program), 512:4 72 (7 programs, ~28 KB), 2048:4 168 (3 programs, ~48 KB), 4096:8 179
(1 program) and 8192:16 spills. The more loads in flight per SM, the closer a streaming kernel gets to HBM
speed (bench/results/step.md 2026-12-01 has the table; tests/trainer/test_loss_triton.py fails if the default spills). Each
(dtype, BLOCK_V, num_warps, T power, pass set) compiles once per device; rows are not specialised (the short
last chunk does not recompile).
Triton is imported at the first call (trainer/kernels/loss_triton.py explains why and how the CPU tests interpret it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

from trainer.kernels import triton_fit
from trainer.kernels.loss_triton import CEKernelConfig, TritonUnavailableError, _interpreting, config_ladder

ENV_CONFIG = "DFLASH_KL_TRITON"
DEFAULT_CONFIG = CEKernelConfig(block_v=2048, num_warps=4, programs_per_sm=0)
ROW_STATE_WIDTH = 5  # per row: m_x, m_t, s, s_T, s_t (fp32), pass 1 -> pass 2 in the two-launch mode
MAX_INTEGER_POWER = 4  # exp(d) = exp(d/T)^T by T-1 multiplies for T = 1..4; other T pay one more exp


def config_from_env() -> CEKernelConfig:
    """$DFLASH_KL_TRITON ("BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM]") or the default."""
    text = os.environ.get(ENV_CONFIG, "").strip()
    return CEKernelConfig.parse(text) if text else DEFAULT_CONFIG


def temperature_power(temperature: float) -> int:
    """T itself when T is an integer 1..MAX_INTEGER_POWER (p = p_T^T up to a row constant), else 0."""
    return int(temperature) if temperature == int(temperature) and 1 <= temperature <= MAX_INTEGER_POWER else 0


def _max_first_index_and_max_combine(x1, i1, t1, x2, i2, t2):
    """Combine function of pass 1's one reduction per tile (jitted by ``_kernel``): the larger x with its
    smallest index on a tie (a reduction's order is unspecified), and the larger t."""
    take_first = (x1 > x2) | ((x1 == x2) & (i1 < i2))
    return tl.where(take_first, x1, x2), tl.where(take_first, i1, i2), tl.maximum(t1, t2)  # type: ignore[name-defined]  # noqa: F821


@functools.cache
def _kernel():
    """Import triton and define the kernel (once per process); TRITON_INTERPRET at the first call decides."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        raise TritonUnavailableError(
            "the triton loss kernels need the triton package (CUDA torch wheels bring it)"
        ) from exc

    # Triton's interpreter looks a kernel's callees up in its module's globals, not in this closure: publish the
    # jitted combine function and `tl` there, before the kernel is defined (the compiler finds them there too).
    globals().update(tl=tl, _max_first_index_and_max=triton.jit(_max_first_index_and_max_combine))

    @triton.jit(do_not_specialize=["n_rows"])
    def _ce_kl_rows_kernel(
        x_ptr,
        t_ptr,
        labels_ptr,
        grad_ptr,
        ratio_ptr,
        state_ptr,
        lse_ptr,
        ce_ptr,
        kl_ptr,
        argmax_ptr,
        n_rows,
        x_stride,
        t_stride,
        grad_stride,
        ratio,
        inv_temperature,
        N_COLS: tl.constexpr,
        BLOCK_V: tl.constexpr,
        T_POWER: tl.constexpr,
        STATS: tl.constexpr,
        GRAD: tl.constexpr,
        RATIO_PER_ROW: tl.constexpr,
    ):
        LOG2E: tl.constexpr = 1.4426950408889634
        cols = tl.arange(0, BLOCK_V)
        scale_t = inv_temperature * LOG2E  # exp((v - m)/T) = exp2((v - m) * scale_t)
        row = tl.program_id(0)
        while row < n_rows:  # a while loop: see trainer/kernels/loss_triton.py (interpreter, triton#9171)
            x_row = x_ptr + row.to(tl.int64) * x_stride
            t_row = t_ptr + row.to(tl.int64) * t_stride
            state_row = state_ptr + row.to(tl.int64) * 5  # ROW_STATE_WIDTH
            label = tl.load(labels_ptr + row).to(tl.int32)
            if STATS:
                m_x = tl.full((), float("-inf"), tl.float32)
                m_t = tl.full((), float("-inf"), tl.float32)
                arg = tl.full((), 0, tl.int32)
                sum_x = tl.zeros([BLOCK_V], tl.float32)  # per-lane partial sums, see the module docstring
                sum_x_t = tl.zeros([BLOCK_V], tl.float32)
                sum_t = tl.zeros([BLOCK_V], tl.float32)
                cross = tl.zeros([BLOCK_V], tl.float32)
                x_next = tl.load(x_row + cols, mask=cols < N_COLS, other=float("-inf"), eviction_policy="evict_last")
                t_next = tl.load(t_row + cols, mask=cols < N_COLS, other=float("-inf"), eviction_policy="evict_last")
                for start in range(0, N_COLS, BLOCK_V):
                    idx = start + cols
                    mask = idx < N_COLS
                    x = x_next.to(tl.float32)
                    t = t_next.to(tl.float32)
                    # prefetch: the next tile's loads fly while this one is reduced (masked off past the end)
                    next_idx = idx + BLOCK_V
                    x_next = tl.load(
                        x_row + next_idx, mask=next_idx < N_COLS, other=float("-inf"), eviction_policy="evict_last"
                    )
                    t_next = tl.load(
                        t_row + next_idx, mask=next_idx < N_COLS, other=float("-inf"), eviction_policy="evict_last"
                    )
                    tile_max_x, tile_arg, tile_max_t = tl.reduce((x, idx, t), 0, _max_first_index_and_max)  # type: ignore[name-defined]  # noqa: F821
                    arg = tl.where(tile_max_x > m_x, tile_arg, arg)  # strict: an earlier tile wins a tie
                    m_x_new = tl.maximum(m_x, tile_max_x)
                    m_t_new = tl.maximum(m_t, tile_max_t)
                    # rescale the partial sums to the new maxima (scalars: once per tile); on the first tile
                    # the old maxima are -inf, the factors 0 and the sums 0 (the centre shift is set to 0 there
                    # because -inf - -inf would be NaN and 0 * NaN is NaN)
                    rescale_x = tl.exp2((m_x - m_x_new) * LOG2E)
                    rescale_x_t = tl.exp2((m_x - m_x_new) * scale_t)
                    rescale_t = tl.exp2((m_t - m_t_new) * scale_t)
                    centre_shift = tl.where(start > 0, (m_x_new - m_x) - (m_t_new - m_t), 0.0)
                    d_x = x - m_x_new  # <= 0; -inf on masked lanes (exp2 -> 0)
                    d_t = t - m_t_new
                    e_x_t = tl.exp2(d_x * scale_t)  # exp((x - m_x)/T)
                    if T_POWER > 0:
                        e_x = e_x_t
                        for _ in tl.static_range(T_POWER - 1):
                            e_x = e_x * e_x_t  # exp((x - m_x)/T)^T = exp(x - m_x): multiplies, not an exp
                    else:
                        e_x = tl.exp2(d_x * LOG2E)
                    e_t = tl.exp2(d_t * scale_t)
                    sum_x = sum_x * rescale_x + e_x
                    sum_x_t = sum_x_t * rescale_x_t + e_x_t
                    # cross holds sum e_t * ((t - m_t) - (x - m_x)) about the current maxima: moving them adds
                    # centre_shift to every old term (old terms carry sum_t, before this tile is added)
                    cross = (cross + centre_shift * sum_t) * rescale_t + e_t * tl.where(mask, d_t - d_x, 0.0)
                    sum_t = sum_t * rescale_t + e_t
                    m_x = m_x_new
                    m_t = m_t_new
                s_x = tl.sum(sum_x, 0)
                s_x_t = tl.sum(sum_x_t, 0)
                s_t = tl.sum(sum_t, 0)
                lse = m_x + tl.log(s_x)
                in_range = (label >= 0) & (label < N_COLS)
                x_label = tl.load(x_row + label, mask=in_range, other=float("nan")).to(tl.float32)
                kl = tl.sum(cross, 0) / s_t * inv_temperature + tl.log(s_x_t) - tl.log(s_t)
                tl.store(lse_ptr + row, lse)
                tl.store(ce_ptr + row, lse - x_label)
                tl.store(kl_ptr + row, kl)
                tl.store(argmax_ptr + row, arg.to(tl.int64))
                if not GRAD:  # the two-launch mode: pass 2 runs later, from this state
                    tl.store(state_row + 0, m_x)
                    tl.store(state_row + 1, m_t)
                    tl.store(state_row + 2, s_x)
                    tl.store(state_row + 3, s_x_t)
                    tl.store(state_row + 4, s_t)
            else:
                m_x = tl.load(state_row + 0)
                m_t = tl.load(state_row + 1)
                s_x = tl.load(state_row + 2)
                s_x_t = tl.load(state_row + 3)
                s_t = tl.load(state_row + 4)
            if GRAD:
                if RATIO_PER_ROW:  # noqa: SIM108 - a constexpr branch: compiled in or out
                    r = tl.load(ratio_ptr + row)
                else:
                    r = ratio
                inv_s_x = 1.0 / s_x
                inv_s_x_t = 1.0 / s_x_t
                inv_s_t = 1.0 / s_t
                g_row = grad_ptr + row.to(tl.int64) * grad_stride
                x_next = tl.load(x_row + cols, mask=cols < N_COLS, other=0.0, eviction_policy="evict_first")
                t_next = tl.load(t_row + cols, mask=cols < N_COLS, other=0.0, eviction_policy="evict_first")
                for start in range(0, N_COLS, BLOCK_V):
                    idx = start + cols
                    mask = idx < N_COLS
                    x = x_next.to(tl.float32)
                    t = t_next.to(tl.float32)
                    next_idx = idx + BLOCK_V
                    x_next = tl.load(x_row + next_idx, mask=next_idx < N_COLS, other=0.0, eviction_policy="evict_first")
                    t_next = tl.load(t_row + next_idx, mask=next_idx < N_COLS, other=0.0, eviction_policy="evict_first")
                    d_x = x - m_x
                    e_x_t = tl.exp2(d_x * scale_t)
                    if T_POWER > 0:
                        e_x = e_x_t
                        for _ in tl.static_range(T_POWER - 1):
                            e_x = e_x * e_x_t
                    else:
                        e_x = tl.exp2(d_x * LOG2E)
                    q_t = tl.exp2((t - m_t) * scale_t) * inv_s_t
                    g = e_x * inv_s_x + r * (e_x_t * inv_s_x_t - q_t)
                    g = tl.where(idx == label, g - 1.0, g)
                    # this tile of t was loaded above; when grad_ptr is t_ptr it is overwritten only now
                    tl.store(g_row + idx, g.to(grad_ptr.dtype.element_ty), mask=mask, cache_modifier=".cs")
            row += tl.num_programs(0)

    return _ce_kl_rows_kernel


def _check(logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float) -> None:
    if logits.dim() != 2 or teacher.shape != logits.shape or labels.shape != (logits.shape[0],):
        raise ValueError(
            f"logits {tuple(logits.shape)}, teacher {tuple(teacher.shape)} and labels "
            f"{tuple(labels.shape)} must be [C, V], [C, V] and [C]"
        )
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32) or teacher.dtype != logits.dtype:
        raise TypeError(
            f"the triton CE+KL kernel accumulates in fp32 and needs bf16/fp16/fp32 logits and teacher "
            f"logits of one dtype (got {logits.dtype}, {teacher.dtype}); use the eager or compiled kernels"
        )
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if logits.device.type != "cuda" and not _interpreting():
        raise TritonUnavailableError(
            f"the triton loss kernels need a CUDA device (logits are on {logits.device}; "
            "TRITON_INTERPRET=1 runs them on CPU, slowly, for tests)"
        )


def _rows_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(1) == 1 else tensor.contiguous()


def _prepare(
    logits, teacher, labels, *, grad, ratio, row_state, temperature: float, stats: bool, config: CEKernelConfig
) -> tuple[tuple[torch.Tensor, ...], Callable[[CEKernelConfig], tuple[tuple, tuple, dict]], tuple]:
    """The outputs (lse, ce, kl, argmax; empty where ``stats`` is False), the launch arguments by configuration
    and the kernel's specialisation key, for one launch (``_launch``) or a fit check (``fits_device``)."""
    rows, vocab = logits.shape
    device = logits.device
    lse, ce, kl = (torch.empty(rows if stats else 0, dtype=torch.float32, device=device) for _ in range(3))
    argmax = torch.empty(rows if stats else 0, dtype=torch.int64, device=device)
    # a persistent grid of programs_per_sm programs per SM, else one program per row
    programs = rows if config.programs_per_sm == 0 else min(rows, triton_fit.sm_count(device) * config.programs_per_sm)
    per_row = isinstance(ratio, torch.Tensor)
    placeholder = logits  # for pointers the selected passes never touch

    def launch(c: CEKernelConfig) -> tuple[tuple, tuple, dict]:
        args = (
            logits,
            teacher,
            labels,
            grad if grad is not None else placeholder,
            ratio if per_row else placeholder,
            row_state if row_state is not None else placeholder,
            lse if stats else placeholder,
            ce if stats else placeholder,
            kl if stats else placeholder,
            argmax if stats else placeholder,
            rows,
            logits.stride(0),
            teacher.stride(0),
            grad.stride(0) if grad is not None else 0,
            0.0 if per_row else float(ratio),
            1.0 / temperature,
        )
        width = min(c.block_v, max(16, 1 << (vocab - 1).bit_length()))
        grid = (rows if c.programs_per_sm == 0 else programs,)
        return (
            grid,
            args,
            dict(
                N_COLS=vocab,
                BLOCK_V=width,
                T_POWER=temperature_power(temperature),
                STATS=stats,
                GRAD=grad is not None,
                RATIO_PER_ROW=per_row,
                num_warps=c.num_warps,
            ),
        )

    specialisation = (logits.dtype, vocab, stats, grad is not None, per_row, temperature_power(temperature))
    return (lse, ce, kl, argmax), launch, specialisation


def _launch(
    logits, teacher, labels, *, grad, ratio, row_state, temperature: float, stats: bool, config: CEKernelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel launch; returns (lse, ce, kl, argmax) (empty where ``stats`` is False)."""
    outputs, launch, specialisation = _prepare(
        logits,
        teacher,
        labels,
        grad=grad,
        ratio=ratio,
        row_state=row_state,
        temperature=temperature,
        stats=stats,
        config=config,
    )
    lse, ce, kl, argmax = outputs
    if logits.shape[0] == 0:
        return lse, ce, kl, argmax
    device = logits.device
    with triton_fit.on_device(
        device
    ):  # the first configuration of the ladder that fits the device's shared memory (trainer/kernels/triton_fit.py)
        triton_fit.launch_first_fit("ce-kl", _kernel(), config_ladder(config), launch, device, specialisation)
    return lse, ce, kl, argmax


def fits_device(device: torch.device, config: CEKernelConfig | None = None) -> bool:
    """Whether some rung of the CE+KL kernel's ladder compiles within `device`'s shared memory (compiled for a
    tiny bf16 problem with the gradient pass, not launched; once per device and config): --loss-kernels asks
    this for a run with soft labels, as trainer.kernels.loss_triton.fits_device for CE."""
    key = (str(device), config)
    if key not in _FITS:
        config = config or config_from_env()
        logits = torch.zeros(4, 151936, dtype=torch.bfloat16, device=device)
        labels = torch.zeros(4, dtype=torch.int64, device=device)
        _, launch, _ = _prepare(
            logits,
            logits,
            labels,
            grad=logits,
            ratio=1.0,
            row_state=None,
            temperature=1.0,
            stats=True,
            config=config,
        )
        _FITS[key] = triton_fit.fits("ce-kl", _kernel(), config_ladder(config), launch, device) is not None
    return _FITS[key]


_FITS: dict[tuple, bool] = {}


def _grad_buffer(logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(logits, memory_format=torch.contiguous_format)
    if out.shape != logits.shape or out.dtype != logits.dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be a row-contiguous [C, V] {logits.dtype} tensor")
    return out


def fused_ce_kl(
    logits: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    kl_ratio: float,
    want_grad: bool = True,
    out: torch.Tensor | None = None,
    config: CEKernelConfig | None = None,
):
    """(grad or None, lse, ce, kl, argmax) of one chunk in one launch; see the module docstring."""
    _check(logits, teacher, labels, temperature)
    logits, teacher = _rows_contiguous(logits), _rows_contiguous(teacher)
    config = config or DEFAULT_CONFIG
    if not want_grad:
        _, lse, ce, kl, argmax = ce_kl_stats(logits, teacher, labels, temperature=temperature, config=config)
        return None, lse, ce, kl, argmax
    grad = _grad_buffer(logits, out)
    lse, ce, kl, argmax = _launch(
        logits,
        teacher,
        labels,
        grad=grad,
        ratio=kl_ratio,
        row_state=None,
        temperature=temperature,
        stats=True,
        config=config,
    )
    return grad, lse, ce, kl, argmax


def ce_kl_stats(
    logits: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float,
    config: CEKernelConfig | None = None,
):
    """Pass 1 only: (row_state [C, 5] fp32 for ``ce_kl_grad``, lse, ce, kl, argmax)."""
    _check(logits, teacher, labels, temperature)
    logits, teacher = _rows_contiguous(logits), _rows_contiguous(teacher)
    row_state = torch.empty(logits.shape[0], ROW_STATE_WIDTH, dtype=torch.float32, device=logits.device)
    lse, ce, kl, argmax = _launch(
        logits,
        teacher,
        labels,
        grad=None,
        ratio=0.0,
        row_state=row_state,
        temperature=temperature,
        stats=True,
        config=config or DEFAULT_CONFIG,
    )
    return row_state, lse, ce, kl, argmax


def ce_kl_grad(
    logits: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    row_state: torch.Tensor,
    kl_ratio: torch.Tensor,
    *,
    temperature: float,
    out: torch.Tensor | None = None,
    config: CEKernelConfig | None = None,
) -> torch.Tensor:
    """Pass 2 only: g = (p - y) + kl_ratio[:, None] * (p_T - q_T) from ``ce_kl_stats``'s row_state (same
    logits, teacher and temperature); kl_ratio [C] (used in fp32). Written into ``out`` (may be ``teacher``)."""
    _check(logits, teacher, labels, temperature)
    logits, teacher = _rows_contiguous(logits), _rows_contiguous(teacher)
    rows = logits.shape[0]
    if row_state.shape != (rows, ROW_STATE_WIDTH) or row_state.dtype != torch.float32 or not row_state.is_contiguous():
        raise ValueError(f"row_state must be the contiguous [{rows}, {ROW_STATE_WIDTH}] fp32 state of ce_kl_stats")
    if kl_ratio.shape != (rows,) or not kl_ratio.is_floating_point():
        raise ValueError(f"kl_ratio must be a [{rows}] float tensor (got {tuple(kl_ratio.shape)} {kl_ratio.dtype})")
    grad = _grad_buffer(logits, out)
    _launch(
        logits,
        teacher,
        labels,
        grad=grad,
        ratio=kl_ratio.to(torch.float32).contiguous(),
        row_state=row_state,
        temperature=temperature,
        stats=False,
        config=config or DEFAULT_CONFIG,
    )
    return grad
