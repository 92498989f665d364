"""The DFlash training loss without [tokens, vocab] logits (docs/method.md#loss).

``dflash_loss`` takes the drafter's final hidden states of all block tokens, flattened to [M, H] with
M = blocks * B (block-major: row i is slot ``i % B`` of block ``i // B``), and the frozen LM head [V, H].
Per token it computes the CE against the same-position label, optionally the soft KL against the
target's distribution, and per block the CAP term:

    loss = ( sum_i w_i CE_i  +  kl_weight * T^2 * sum_i w_i KL_i ) / normalizer
           - cap_lambda * sum_blocks A_b / (B - 1) / num_blocks_normalizer

    A_b  = sum_{k>=1} v_k exp(S_k),  S_k = sum_{j=1..k} v_j l_j,  l_j = -CE_j,  v_j = [w_j > 0]

Invalid slots (v_j = 0: padding, past the sequence end, unsupervised) neither count nor break the chain.
``normalizer`` is sum(w) over the whole optimizer step and ``num_blocks_normalizer`` the number of real
blocks (blocks with a valid slot) over the whole step, so micro-batch losses simply add up.

Slot 0 of each block (the anchor: weight 0, no target) never goes through the LM head (``SKIP_ANCHOR_SLOT``):
a chunk of k blocks has k * (B - 1) rows of logits, its rows of the gradient are 0 and of ``correct`` False.

How the logits are avoided: rows are processed in chunks; for each chunk the logits [C, V] exist only
transiently and the gradient w.r.t. the chunk's hidden rows is computed right away (the LM head is
frozen, so d/dW is never needed): d loss / d logits is
    (w/normalizer + cap_coef) * (softmax - onehot) + kl_weight * w/normalizer * T * (softmax_T - teacher_T)
and one GEMM with W turns it into d loss / d hidden. A custom autograd.Function returns the scalar loss
and its backward only scales the saved [M, H] gradient. GEMMs per chunk: 2 for CE (logits, input grad),
+1 for the teacher's logits with soft labels, 0 extra for CAP: chunks are whole blocks (the chunk size
is rounded down to a multiple of B), so a block's prefix sums are complete inside its chunk and the CAP
coefficient just rescales the CE direction before the input-gradient GEMM (no second pass, no stored
per-token [M, H] direction). Memory: the [M, H] gradient plus per-chunk temporaries: bf16 logits and
~2 fp32 [C, V] buffers in eager mode (~5 with soft labels); pick C so they fit (``default_chunk_rows``).
No host-device sync anywhere: the sums stay on the device until the caller reads them.
Speed: the element-wise [C, V] work is memory-bound; eager it costs roughly 0.5-1 GEMM-equivalent on top
of the GEMMs. torch.compile'd kernels (``make_chunk_kernels("compiled")``) fuse it into two kernels
(statistics, then d loss/d logits: the bf16 logits are read twice, the gradient written once): CE measured
at 2.27-2.34 GEMM-eq on the H200. ``make_chunk_kernels("triton")`` does CE and CE+CAP in ONE Triton kernel
per chunk (trainer/kernels/loss_triton.py: row statistics, then g = softmax - onehot re-reading the same row, from
L2 when the rows in flight fit). Its g is unscaled, so the per-row coefficient (w/normalizer + CAP's)
scales the rows of the input-gradient GEMM's output instead: diag(c) (P - Y) W = ((P - Y) W) * c[:, None].
Measured on the H200 (Qwen3-8B head, bf16): CE 2.25 GEMM-eq at chunk 1728 and 2.14 at chunk 4096, against
2.34 and 2.31 compiled (the element-wise work drops from ~0.42 to ~0.19 GEMM-eq; larger chunks also help the
GEMMs; with triton kernels there is no fp32 [C, V] temporary at all).
Soft labels with "triton" kernels (trainer/kernels/loss_triton_kl.py): CE+KL is ONE kernel per chunk reading the
student's and the teacher's logits (statistics, KL, then g = (softmax - onehot) + kl_weight*T*(softmax_T -
teacher_T), unscaled like the CE kernel's: without CAP the KL coefficient over the CE coefficient is the
constant kl_weight * T on every row), writing g over the teacher logits (two bf16 [C, V] buffers, as for CE).
CE+KL+CAP cannot use a constant ratio (CAP's coefficient needs the block's CEs first), so it runs the same
kernel as two launches, statistics then gradient with the per-row ratio k_i / c_i; that costs the re-read
from HBM the fused launch partly gets from L2. Predicted on the H200, not measured yet (bench/results/step.md 2026-12-01):
CE+KL ~3.2 GEMM-eq at chunk 4096 against 3.61 compiled at 1728. bench/loss_gemm.py measures all of them.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from trainer.core.compile_scope import private_compile

# Compute no logits for slot 0 of a block (the anchor: weight 0, no target). Off only in the bench's `triton-s8`
# variant, which measures what computing them cost.
SKIP_ANCHOR_SLOT = True


class LossInputError(ValueError):
    """Arguments to the loss that cannot be right (shapes, block layout, hyper-parameters)."""


@dataclass
class LossResult:
    """Output of ``dflash_loss``.

    loss: 0-dim tensor, float32 (float64 when the LM head is float64); its backward writes d loss/d hidden
    (the saved gradient times grad_output).
    ce_sum: sum_i w_i CE_i (not normalised). kl_sum: sum_i w_i KL_i at temperature T (no kl_weight, no T^2).
    cap_sum: sum over blocks of A_b/(B-1), the per-block mean acceptance probability (no cap_lambda).
    weight_sum: sum_i w_i; num_blocks: blocks with at least one valid slot (in this micro-batch).
    correct: [M] bool, argmax(logits) == label (meaningless where w == 0).
    All except ``loss`` are detached tensors on the hidden's device: reading them (.item()) syncs.
    """

    loss: torch.Tensor
    ce_sum: torch.Tensor
    kl_sum: torch.Tensor
    cap_sum: torch.Tensor
    weight_sum: torch.Tensor
    num_blocks: torch.Tensor
    correct: torch.Tensor
    # DFlash2 (``topk > 0``): each row's unary top-k with the label put last where missing [M, k] int64, their
    # unary logits [M, k] (fp32, detached), the label's place [M]; slot-0 rows are 0 / False.
    candidates: torch.Tensor | None = None
    candidate_logits: torch.Tensor | None = None
    label_place: torch.Tensor | None = None
    label_found: torch.Tensor | None = None  # [M] bool: the unary top-k held the label (what serving can pick)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Per-slot weights [B] float32: 0 for slot 0 (the anchor), exp(-(k-1)/gamma) for slot k >= 1."""
    if block_size < 2:
        raise LossInputError(f"block size must be >= 2 (got {block_size})")
    if not gamma > 0:
        raise LossInputError(f"gamma must be > 0 (got {gamma})")
    slots = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass
class TauStats:
    """Simulated acceptance over real blocks, kept as sums so micro-batches can be added up.

    tau_sum: sum over real blocks of 1 + sum_{k>=1} prod_{j<=k} correct_j (an invalid slot ends the run).
    num_blocks: real blocks (any valid slot). slot_correct / slot_valid: [B] counts per slot.
    """

    tau_sum: torch.Tensor
    num_blocks: torch.Tensor
    slot_correct: torch.Tensor
    slot_valid: torch.Tensor

    @property
    def tau(self) -> torch.Tensor:
        """Mean simulated acceptance length (1.0 when there is no real block)."""
        return torch.where(self.num_blocks > 0, self.tau_sum / self.num_blocks.clamp(min=1), 1.0)

    @property
    def slot_accuracy(self) -> torch.Tensor:
        """[B] accuracy per slot (NaN for slots with no valid token, e.g. slot 0)."""
        return self.slot_correct / self.slot_valid  # 0/0 -> NaN on purpose: "no data", not "0%"


def simulated_tau(correct: torch.Tensor, valid: torch.Tensor) -> TauStats:
    """Simulated acceptance per block (docs/method.md#acceptance-length) from correct [nb, B] bool and
    valid [nb, B] bool (weights > 0; slot 0 is ignored in both). A run of accepted slots stops at the first wrong or
    invalid slot, like serving stops at a mismatch or at the end of the text."""
    if correct.dim() != 2 or correct.shape != valid.shape:
        raise LossInputError(f"correct {tuple(correct.shape)} and valid {tuple(valid.shape)} must both be [blocks, B]")
    hit = (correct & valid)[:, 1:].to(torch.int64)
    accepted = torch.cumprod(hit, dim=1).sum(dim=1)
    real = valid[:, 1:].any(dim=1)
    tau_sum = ((1 + accepted) * real).sum().to(torch.float32)
    valid_slots = valid.clone()
    valid_slots[:, 0] = False
    return TauStats(
        tau_sum=tau_sum,
        num_blocks=real.sum().to(torch.float32),
        slot_correct=(correct & valid_slots).sum(dim=0).to(torch.float32),
        slot_valid=valid_slots.sum(dim=0).to(torch.float32),
    )


def default_chunk_rows(vocab_size: int, block_size: int, budget_bytes: int = 1 << 30) -> int:
    """Rows per chunk so that one fp32 [C, V] temporary is about ``budget_bytes`` (whole blocks, >= 1 block)."""
    rows = max(1, budget_bytes // (4 * vocab_size))
    return max(block_size, rows // block_size * block_size)


def fused_chunk_rows(vocab_size: int, block_size: int, budget_bytes: int = 5 << 29) -> int:
    """Rows per chunk for the fused Triton kernels: 4096 (H200, V=151936, CE: 2.14 GEMM-eq against 2.25 at the
    1728-row default, because the input-gradient GEMM [C, V] x [V, H] fills its waves better), fewer when the
    two bf16 [C, V] buffers would pass `budget_bytes` (2.5 GiB), whole blocks. The buffers: logits and gradient
    for CE; logits and teacher logits for soft labels (the gradient is written over the teacher logits).
    6144 and 8192 rows measured no better in the whole 8B seed step (-5 ms in one run, +2 to +7 in the next:
    inside the power-capped GPU's run-to-run spread; bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step") for 1-2.6 GiB more memory."""
    return min(4096 // block_size * block_size, default_chunk_rows(vocab_size, block_size, budget_bytes))


def _student_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float, want_tempered: bool):
    """Row reductions of one chunk: (logsumexp, CE, argmax, logsumexp(logits/T) or None).

    Upcast first: a bf16 logsumexp rounds its result to bf16 (ulp 0.06 at 12), far too coarse for CE."""
    acc = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(acc, dim=-1)
    ce = lse - acc.gather(1, labels[:, None]).squeeze(1)
    lse_t = torch.logsumexp(acc / temperature, dim=-1) if want_tempered else None
    return lse, ce, logits.argmax(dim=-1), lse_t


def _logit_grad(
    logits: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ce_coef: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    lse_student_t: torch.Tensor | None,
    kl_coef: torch.Tensor | None,
    temperature: float,
    onehot_by_compare: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d loss/d logits of one chunk in the logits' dtype, and per-row KL(teacher_T || student_T) (or None).

    ce_coef >= 0 is folded into the exponent, coef * softmax = exp(z - (lse - log coef)), which saves one
    [C, V] pass in eager mode (coef 0 gives exp(-inf) = 0). Eager CE path: copy, sub, exp, cast = 4 fp32
    passes (~20 B/element); torch.compile fuses it into one read and one write of the bf16 logits when
    the one-hot is a comparison with the column index (``onehot_by_compare``; a scatter would split the
    kernel and force an fp32 [C, V] round trip; in eager the comparison costs a [C, V] pass instead)."""
    acc = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)  # private: modified in place
    kl = kl_part = None
    if teacher_logits is not None:
        assert lse_student_t is not None and kl_coef is not None
        log_q = teacher_logits.to(acc.dtype, copy=True).div_(temperature)
        log_q.sub_(torch.logsumexp(log_q, dim=-1, keepdim=True))
        log_p = (acc / temperature).sub_(lse_student_t[:, None])
        diff = log_q - log_p
        q = log_q.exp_()
        kl = diff.mul_(q).sum(dim=-1)
        del diff
        kl_part = log_p.exp_().sub_(q).mul_(kl_coef[:, None])  # T^2 * (1/T) * (p_T - q), times kl_weight*w/norm
        del q
    grad = acc.sub_((lse - torch.log(ce_coef))[:, None]).exp_()  # ce_coef * softmax
    if onehot_by_compare:
        columns = torch.arange(grad.shape[1], device=grad.device)
        grad = grad - torch.where(columns == labels[:, None], ce_coef[:, None], 0.0)
    else:
        grad.scatter_add_(1, labels[:, None], -ce_coef[:, None])  # - ce_coef * onehot
    if kl_part is not None:
        grad.add_(kl_part)
    return grad.to(logits.dtype), kl


KERNEL_KINDS = ("eager", "compiled", "triton")


@dataclass
class ChunkKernels:
    """The per-chunk [C, V] element-wise functions: row statistics, then d loss/d logits.

    Eager by default. ``make_chunk_kernels("compiled")`` wraps fresh torch.compile objects: the caller owns
    them (one per device / worker thread, warmed up before threads start, docs/method.md#compiling), never a
    process-wide singleton. Each distinct chunk shape (usually full chunks + one short last chunk) compiles once; the
    soft-label variant compiles separately. ``fused_ce`` (set by ``make_chunk_kernels("triton")``) replaces
    both for CE and CE+CAP: one kernel returning (unscaled softmax - onehot, lse, ce, argmax); ``soft_label``
    (set by the same) replaces them with soft labels (CE+KL, CE+KL+CAP)."""

    stats: Callable[..., tuple] = _student_stats
    logit_grad: Callable[..., tuple] = _logit_grad
    fused_ce: Callable[..., tuple] | None = None
    # fused_ce with a running top-k (DFlash2's candidates): (logits, labels, k, *, want_grad) -> fused_ce's four
    # outputs + (values [C, k] fp32, ids [C, k] int64), best first, ties to the lower column
    fused_ce_topk: Callable[..., tuple] | None = None
    soft_label: SoftLabelKernels | None = None
    kind: str = "eager"


@dataclass(frozen=True)
class SoftLabelKernels:
    """Fused per-chunk kernels for soft labels (trainer/kernels/loss_triton_kl.py has the full contract). With
    x = logits, t = teacher logits, p = softmax(x), p_T = softmax(x/T), q_T = softmax(t/T), y = onehot(label):

    fused(x, t, labels, *, temperature, kl_ratio: float, want_grad, out) -> (g | None, lse, ce, kl, argmax)
    stats(x, t, labels, *, temperature) -> (row_state, lse, ce, kl, argmax)
    grad(x, t, labels, row_state, kl_ratio: [C] tensor, *, temperature, out) -> g

    g = (p - y) + kl_ratio * (p_T - q_T) in the logits' dtype, UNSCALED in the CE direction (the loss scales
    the rows of g @ W by the CE coefficient afterwards); kl = KL(q_T || p_T) per row; ``out`` receives g and
    may be t itself. ``fused`` is one launch for CE+KL, where kl_ratio = kl_weight * T on every row; CE+KL+CAP
    runs ``stats``, then CAP's coefficients, then ``grad`` with the per-row ratio (two launches)."""

    fused: Callable[..., tuple]
    stats: Callable[..., tuple]
    grad: Callable[..., torch.Tensor]


def _compiled_stats_and_grad(backend: str = "inductor") -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """Private torch.compile'd copies of the stats and logit-grad functions, static shapes.

    Private (trainer/core/compile_scope.py): each call compiles new code objects, so two replicas' worker threads
    never evaluate one dynamo cache's guards at the same time (the race that failed 3 of 8 two-drafter runs on
    the H200). Static (dynamic=False): one entry per chunk shape (full chunks + the short last one) instead of
    a symbolic-shape entry whose guards run as Python code."""
    return (
        private_compile(_student_stats, backend=backend),
        private_compile(functools.partial(_logit_grad, onehot_by_compare=True), backend=backend),
    )


# --loss-kernels auto picks the fused Triton kernel only where it has been measured: Hopper (H200, capability
# 9.0) gave +0.7% on the qwen3-8b seed step, +4-5% in the small pipeline, and ten cold two-thread runs with
# bitwise-identical replicas and losses (bench/results/step.md 2026-11-29 "`--loss-kernels auto` on the H200"). Other GPUs keep the compiled kernels.
TRITON_AUTO_MIN_CAPABILITY = (9, 0)


def resolve_loss_kernels(requested: str, device: torch.device, compiled: bool, soft_labels: bool = False) -> str:
    """The chunk kernels a drafter on ``device`` uses for ``--loss-kernels requested`` (explicit kinds pass
    through, except triton on a CUDA device where no rung of the run's kernel's ladder fits: compiled, with one
    line): for auto, eager when the drafter is not compiled, triton on a CUDA device of compute capability >=
    TRITON_AUTO_MIN_CAPABILITY with the triton package installed and the kernel fitting, else compiled. The
    kernel is the CE kernel, and with ``soft_labels`` the CE+KL kernel too (its own ladder)."""
    if requested == "triton" and device.type == "cuda":
        # asked for by name, still never a kernel that cannot launch here (a ~100 KB-shared-memory GPU): the
        # compiled kernels compute the same loss, and one line says so
        misfit = _triton_misfit(device, soft_labels)
        if misfit:
            print(f"loss kernels: {misfit} (asked: triton); compiled", file=sys.stderr)
            return "compiled"
    if requested != "auto":
        return requested
    if not compiled:
        return "eager"
    if device.type == "cuda":
        from trainer.kernels.loss_triton import triton_available

        if torch.cuda.get_device_capability(device) >= TRITON_AUTO_MIN_CAPABILITY and triton_available():
            # never a kernel that cannot launch here: the ladder is compiled against the device's shared memory
            misfit = _triton_misfit(device, soft_labels)
            if not misfit:
                return "triton"
            print(f"loss kernels: {misfit}; compiled", file=sys.stderr)
    return "compiled"


def _triton_misfit(device: torch.device, soft_labels: bool) -> str | None:
    """Why the run's Triton loss kernel cannot launch on `device` (no rung of its ladder fits its shared
    memory), or None when it can."""
    from trainer.kernels import loss_triton

    if not loss_triton.fits_device(device):
        return f"the triton CE kernel does not fit {device}'s shared memory"
    if soft_labels:
        from trainer.kernels import loss_triton_kl

        if not loss_triton_kl.fits_device(device):
            return f"the triton CE+KL kernel (soft labels) does not fit {device}'s shared memory"
    return None


def make_chunk_kernels(
    kind: str = "eager",
    *,
    triton_config: str | None = None,
    kl_triton_config: str | None = None,
    topk_triton_config: str | None = None,
    compile_backend: str = "inductor",
) -> ChunkKernels:
    """Kernels by kind (KERNEL_KINDS). eager: plain torch ops. compiled: new torch.compile'd functions
    (compiled lazily at the first call). triton (needs the triton package and a CUDA device): the fused Triton
    CE kernel for CE and CE+CAP, launch config ``triton_config`` ("BLOCK_V:NUM_WARPS[:PROGRAMS_PER_SM]"), else
    $DFLASH_CE_TRITON, else trainer/kernels/loss_triton.py's default; and the fused CE+KL kernels for soft labels
    (CE+KL and CE+KL+CAP), config ``kl_triton_config``, else $DFLASH_KL_TRITON, else
    trainer/kernels/loss_triton_kl.py's default; DFlash2's CE kernel with the running top-k, config
    ``topk_triton_config``, else ``triton_config``, else $DFLASH_CE_TOPK_TRITON, else loss_triton.TOPK_CONFIG.
    (Its stats/logit_grad are compiled kernels that dflash_loss no longer
    calls: every combination of terms has a fused kernel; float64 logits are refused by both kernels.)"""
    if kind == "eager":
        return ChunkKernels()
    if kind == "compiled":
        return ChunkKernels(*_compiled_stats_and_grad(compile_backend), kind="compiled")
    if kind == "triton":
        from trainer.kernels import loss_triton  # imports triton itself only at the first kernel call

        if not loss_triton.triton_available():
            raise loss_triton.TritonUnavailableError(
                "the triton loss kernels need the triton package (CUDA torch wheels bring it)"
            )
        config = (
            loss_triton.CEKernelConfig.parse(triton_config) if triton_config else loss_triton.CEKernelConfig.from_env()
        )
        from trainer.kernels import loss_triton_kl

        fused = functools.partial(loss_triton.fused_ce, config=config)
        topk_text = topk_triton_config or triton_config
        topk_config = loss_triton.CEKernelConfig.parse(topk_text) if topk_text else loss_triton.topk_config_from_env()
        kl_config = (
            loss_triton.CEKernelConfig.parse(kl_triton_config) if kl_triton_config else loss_triton_kl.config_from_env()
        )
        soft_label = SoftLabelKernels(
            fused=functools.partial(loss_triton_kl.fused_ce_kl, config=kl_config),
            stats=functools.partial(loss_triton_kl.ce_kl_stats, config=kl_config),
            grad=functools.partial(loss_triton_kl.ce_kl_grad, config=kl_config),
        )
        compiled = make_chunk_kernels("compiled", compile_backend=compile_backend)
        return ChunkKernels(
            stats=compiled.stats,
            logit_grad=compiled.logit_grad,
            fused_ce=fused,
            fused_ce_topk=functools.partial(loss_triton.fused_ce_topk, config=topk_config),
            soft_label=soft_label,
            kind="triton",
        )
    raise ValueError(f"unknown loss kernels {kind!r}: one of {', '.join(KERNEL_KINDS)}")


def _cap_coefficients(ce: torch.Tensor, valid: torch.Tensor, slots: int, scale: float, block_size: int):
    """Per-block CAP for whole blocks in one chunk: returns (sum_b A_b/(B-1), d CAP-loss / d CE per token).

    ce, valid: [C] with C a multiple of `slots`: slots 1..B-1 of each block (or all B; slot 0 is invalid, so it
    adds nothing either way). CAP loss = -scale * sum_b A_b/(B-1) with scale = cap_lambda/num_blocks_normalizer;
    d/dl_j = -scale/(B-1) * v_j * sum_{k>=j} v_k exp(S_k), and dl_j/dCE_j = -1, so the coefficient of
    (softmax - onehot) is +scale/(B-1) * v_j * suffix_j."""
    v = valid.view(-1, slots).to(ce.dtype)
    log_prefix = torch.cumsum(-ce.view(-1, slots) * v, dim=1)  # S_k <= 0: exp never overflows
    terms = v * torch.exp(log_prefix)
    suffix = terms.flip(1).cumsum(1).flip(1)
    per_token = (scale / (block_size - 1)) * v * suffix
    return terms.sum() / (block_size - 1), per_token.reshape(-1)


class _AttachHiddenGrad(torch.autograd.Function):
    """Returns the precomputed loss value; backward = saved d loss/d hidden * grad_output (no recompute)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, loss_value: torch.Tensor, grad_hidden: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_hidden)
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_output.to(grad_hidden.dtype), None, None


def dflash_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
    normalizer: float,
    teacher_hidden: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    kl_temperature: float = 1.0,
    cap_lambda: float = 0.0,
    num_blocks_normalizer: float = 1.0,
    chunk_size: int | None = None,
    kernels: ChunkKernels | None = None,
    topk: int = 0,
) -> LossResult:
    """The DFlash loss of one micro-batch; see the module docstring for the formula.

    hidden [M, H] (M = blocks*B, block-major), lm_head_weight [V, H] frozen (its dtype is the GEMM dtype;
    autocast is switched off inside), labels [M] int64 (any value where weights == 0), weights [M] float
    (w_k * mask, 0 on slot 0). teacher_hidden [M, H]: the target's final hidden at p+k-1, required when
    kl_weight > 0. chunk_size: at most this many rows per chunk, rounded down to whole blocks (default: ~1 GiB
    fp32 logits); the rows are split into equal chunks under it.
    kernels: the per-chunk element-wise functions (default eager; see ``make_chunk_kernels``): ``fused_ce``
    when kl_weight == 0, ``soft_label`` when kl_weight > 0, where set; the stats + logit_grad path otherwise.
    The d/d hidden GEMM is skipped when hidden does not require grad (eval).
    topk > 0 (DFlash2's candidate selector): also return each supervised row's unary top-k candidates, read from
    the chunk's logits while they exist (before a fused kernel overwrites them): no extra LM-head GEMM.
    """
    _check_inputs(
        hidden,
        lm_head_weight,
        labels,
        weights,
        teacher_hidden,
        block_size,
        normalizer,
        kl_weight,
        kl_temperature,
        cap_lambda,
        num_blocks_normalizer,
        chunk_size,
    )
    plan = _plan_chunks(
        hidden.shape[0],
        lm_head_weight,
        block_size=block_size,
        normalizer=normalizer,
        kl_weight=kl_weight,
        kl_temperature=kl_temperature,
        cap_lambda=cap_lambda,
        num_blocks_normalizer=num_blocks_normalizer,
        chunk_size=chunk_size,
        kernels=kernels or ChunkKernels(),
        topk=topk,
    )
    want_grad = hidden.requires_grad and torch.is_grad_enabled()
    rows = _loss_rows(hidden, lm_head_weight, labels, weights, teacher_hidden, plan)
    out = _empty_outputs(hidden, plan, want_grad)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        for b0 in range(0, plan.num_blocks, plan.chunk_blocks):
            _loss_chunk(plan, rows, out, b0, min(b0 + plan.chunk_blocks, plan.num_blocks))

    ce_and_kl = out.ce_sum + kl_weight * kl_temperature**2 * out.kl_sum
    loss_value = ce_and_kl * plan.inv_norm - plan.cap_scale * out.cap_sum
    real_blocks = rows.valid.view(-1, block_size).any(dim=1).sum().to(plan.acc_dtype)
    loss = _AttachHiddenGrad.apply(hidden, loss_value, out.grad_hidden) if want_grad else loss_value
    return LossResult(
        loss=loss,
        ce_sum=out.ce_sum,
        kl_sum=out.kl_sum,
        cap_sum=out.cap_sum,
        weight_sum=rows.weights.sum(),
        num_blocks=real_blocks,
        correct=out.correct,
        candidates=out.candidates,
        candidate_logits=out.candidate_logits,
        label_place=out.label_place,
        label_found=out.label_found,
    )


@dataclass(frozen=True)
class _ChunkPlan:
    """What every chunk of one ``dflash_loss`` call shares: block layout, chunking, kernel path, coefficients."""

    block_size: int
    num_blocks: int
    chunk_blocks: int  # whole blocks per chunk (the last chunk may have fewer)
    first: int  # the first slot of a block that goes through the LM head (1: the anchor is skipped)
    slots: int  # rows of a block that go through the LM head
    kernels: ChunkKernels
    soft: SoftLabelKernels | None  # the fused soft-label kernels, where set and soft labels are on
    fused_ce: bool  # the fused CE kernel (no soft labels)
    fused: bool  # a fused kernel writes g unscaled: the row scale follows GEMM 2
    use_kl: bool
    use_cap: bool
    topk: int
    topk_in_kernel: bool  # the fused CE kernel keeps the running top-k (no sort over [C, V])
    inv_norm: float
    cap_scale: float
    kl_weight: float
    kl_temperature: float
    kl_ratio: float  # KL coefficient / CE coefficient on every row while CAP is off
    gemm_dtype: torch.dtype
    acc_dtype: torch.dtype

    def supervised(self, t: torch.Tensor, b0: int, b1: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of blocks b0..b1-1, slots 1..B-1, as one [rows, ...] tensor (cast first: one copy, not two)."""
        rows_of_blocks = t.view(self.num_blocks, self.block_size, *t.shape[1:])[b0:b1, self.first :]
        return rows_of_blocks.to(dtype or t.dtype).reshape(-1, *t.shape[1:])


def _plan_chunks(
    num_rows: int,
    lm_head_weight: torch.Tensor,
    *,
    block_size: int,
    normalizer: float,
    kl_weight: float,
    kl_temperature: float,
    cap_lambda: float,
    num_blocks_normalizer: float,
    chunk_size: int | None,
    kernels: ChunkKernels,
    topk: int,
) -> _ChunkPlan:
    """Pick the kernel path, split the blocks into equal chunks and compute the scalar coefficients."""
    vocab = lm_head_weight.shape[0]
    use_kl, use_cap = kl_weight > 0, cap_lambda > 0
    soft = kernels.soft_label if use_kl else None
    fused_ce = kernels.fused_ce is not None and not use_kl
    fused = fused_ce or soft is not None  # a fused kernel writes g unscaled: the row scale follows GEMM 2
    if chunk_size is None:
        chunk = fused_chunk_rows(vocab, block_size) if fused else default_chunk_rows(vocab, block_size)
    else:
        chunk = chunk_size
    # Equal chunks of whole blocks, none above `chunk` rows: a short last chunk is a GEMM pair that reads the whole
    # LM head for a few rows (qwen3-8b seed: 1026 blocks of 32 in chunks of 128 left 2; now 9 x 114).
    num_blocks, most = num_rows // block_size, max(1, chunk // block_size)
    chunk_blocks = -(-num_blocks // -(-num_blocks // most)) if num_blocks else most
    gemm_dtype = lm_head_weight.dtype
    # Slot 0 (the anchor, weight 0) is never computed: its logits cost 1/B of every LM-head GEMM and of the [C, V]
    # element-wise work for a prediction nothing uses (qwen3-8b seed, B = 32: -6 ms per step on the H200,
    # bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step"). The chunks below see blocks x (B - 1) rows; slot 0's gradient is 0 and its
    # `correct` False.
    first = 1 if SKIP_ANCHOR_SLOT else 0
    return _ChunkPlan(
        block_size=block_size,
        num_blocks=num_blocks,
        chunk_blocks=chunk_blocks,
        first=first,
        slots=block_size - first,
        kernels=kernels,
        soft=soft,
        fused_ce=fused_ce,
        fused=fused,
        use_kl=use_kl,
        use_cap=use_cap,
        topk=topk,
        topk_in_kernel=topk > 0 and fused_ce and kernels.fused_ce_topk is not None,
        inv_norm=1.0 / normalizer if normalizer > 0 else 0.0,  # all-zero weights: every sum is 0, no NaN
        cap_scale=cap_lambda / num_blocks_normalizer if num_blocks_normalizer > 0 else 0.0,
        kl_weight=kl_weight,
        kl_temperature=kl_temperature,
        kl_ratio=kl_weight * kl_temperature,
        gemm_dtype=gemm_dtype,
        acc_dtype=torch.promote_types(gemm_dtype, torch.float32),
    )


@dataclass(frozen=True)
class _LossRows:
    """The micro-batch's rows that the chunks slice: inputs detached, labels made safe, weights in the acc dtype."""

    hidden: torch.Tensor
    teacher: torch.Tensor | None
    lm_head_weight: torch.Tensor
    labels: torch.Tensor
    safe_labels: torch.Tensor
    weights: torch.Tensor
    valid: torch.Tensor


def _loss_rows(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    teacher_hidden: torch.Tensor | None,
    plan: _ChunkPlan,
) -> _LossRows:
    """Mark the valid rows (weight > 0, not slot 0) and prepare the tensors every chunk reads."""
    slot = torch.arange(hidden.shape[0], device=hidden.device) % plan.block_size
    valid = (weights > 0) & (slot > 0)
    return _LossRows(
        hidden=hidden.detach().contiguous(),  # the [blocks, B, H] views need it (a no-op when it is)
        teacher=teacher_hidden.detach().contiguous() if teacher_hidden is not None else None,
        lm_head_weight=lm_head_weight,
        labels=labels,
        safe_labels=torch.where(valid, labels, torch.zeros_like(labels)),  # -100 padding would break gather
        weights=weights.to(plan.acc_dtype),
        valid=valid,
    )


@dataclass
class _LossOutputs:
    """What the chunks fill in: the sums, ``correct``, d loss/d hidden (None in eval) and DFlash2's candidates."""

    ce_sum: torch.Tensor
    kl_sum: torch.Tensor
    cap_sum: torch.Tensor
    correct: torch.Tensor
    grad_hidden: torch.Tensor | None
    candidates: torch.Tensor | None = None
    candidate_logits: torch.Tensor | None = None
    label_place: torch.Tensor | None = None
    label_found: torch.Tensor | None = None


def _empty_outputs(hidden: torch.Tensor, plan: _ChunkPlan, want_grad: bool) -> _LossOutputs:
    """Zero sums, no row correct, slot 0's gradient 0 (the chunks write every other row), empty candidates."""
    rows, device = hidden.shape[0], hidden.device
    zero = torch.zeros((), dtype=plan.acc_dtype, device=device)
    out = _LossOutputs(
        ce_sum=zero.clone(),
        kl_sum=zero.clone(),
        cap_sum=zero.clone(),
        correct=torch.zeros(rows, dtype=torch.bool, device=device),
        grad_hidden=torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if want_grad else None,
    )
    if out.grad_hidden is not None and plan.first:
        out.grad_hidden.view(plan.num_blocks, plan.block_size, hidden.shape[1])[:, 0] = 0
    if plan.topk > 0:
        out.candidates = torch.zeros(rows, plan.topk, dtype=torch.long, device=device)
        out.candidate_logits = torch.zeros(rows, plan.topk, dtype=torch.float32, device=device)
        out.label_place = torch.zeros(rows, dtype=torch.long, device=device)
        out.label_found = torch.zeros(rows, dtype=torch.bool, device=device)
    return out


class _ChunkStats(NamedTuple):
    """One chunk's row statistics, and g where the statistics' kernel wrote it."""

    grad_logits: torch.Tensor | None
    lse: torch.Tensor | None
    ce: torch.Tensor
    kl: torch.Tensor | None
    argmax: torch.Tensor
    row_state: torch.Tensor | None  # soft labels with CAP: the stats' state for the second launch
    lse_t: torch.Tensor | None  # eager / compiled: logsumexp(logits / T) with soft labels
    unary: torch.Tensor | None  # DFlash2: the unary top-k ids


def _loss_chunk(plan: _ChunkPlan, rows: _LossRows, out: _LossOutputs, b0: int, b1: int) -> None:
    """One chunk of whole blocks b0..b1-1: logits, statistics, sums and its rows of d loss/d hidden."""
    h = plan.supervised(rows.hidden, b0, b1, plan.gemm_dtype)
    lab, w = plan.supervised(rows.safe_labels, b0, b1), plan.supervised(rows.weights, b0, b1)
    logits = h @ rows.lm_head_weight.T  # GEMM 1
    teacher_logits = kl_coef = None
    # The fused CE kernel keeps a running top-k as it streams the row (no sort over [C, V]: the sort cost
    # 39 ms per step at the qwen3-8b seed shape, bench/results/kernels.md 2026-12-03 "Our own Triton attention"); every other path sorts here.
    # No kernel below writes into `logits` (g goes to its own buffer), so the gather after them reads it.
    unary = logits.topk(plan.topk, dim=-1).indices if plan.topk > 0 and not plan.topk_in_kernel else None
    if plan.use_kl:
        assert rows.teacher is not None
        teacher = plan.supervised(rows.teacher, b0, b1, plan.gemm_dtype)
        teacher_logits = teacher @ rows.lm_head_weight.T  # GEMM 3
        kl_coef = w * (plan.inv_norm * plan.kl_weight * plan.kl_temperature)
    stats = _chunk_statistics(plan, logits, teacher_logits, lab, unary, want_grad=out.grad_hidden is not None)
    _record_predictions(plan, out, b0, b1, stats, logits, lab, rows.labels)
    out.ce_sum += (w * stats.ce).sum()
    ce_coef = w * plan.inv_norm
    if plan.use_cap:
        valid = plan.supervised(rows.valid, b0, b1)
        block_cap, cap_coef = _cap_coefficients(stats.ce, valid, plan.slots, plan.cap_scale, plan.block_size)
        out.cap_sum += block_cap
        ce_coef = ce_coef + cap_coef
    grad_logits = _finish_logit_grad(plan, out, stats, logits, teacher_logits, lab, w, ce_coef, kl_coef)
    if out.grad_hidden is not None:
        _write_hidden_grad(plan, out.grad_hidden, grad_logits, rows.lm_head_weight, ce_coef, b0, b1)


def _chunk_statistics(
    plan: _ChunkPlan,
    logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    lab: torch.Tensor,
    unary: torch.Tensor | None,
    *,
    want_grad: bool,
) -> _ChunkStats:
    """Row statistics by the kernel path: a fused kernel also writes g (unscaled) when a gradient is wanted."""
    kernels, soft = plan.kernels, plan.soft
    grad_logits = kl = row_state = lse_t = None
    if soft is not None and not plan.use_cap and want_grad:
        # one kernel: statistics, KL and the UNSCALED g, written over the teacher logits (each element
        # is read before it is overwritten), so soft labels need no third [C, V] buffer
        grad_logits, lse, ce, kl, argmax = soft.fused(
            logits,
            teacher_logits,
            lab,
            temperature=plan.kl_temperature,
            kl_ratio=plan.kl_ratio,
            want_grad=True,
            out=teacher_logits,
        )
    elif soft is not None:  # CAP needs every CE of the chunk before g (or eval: no g at all)
        row_state, lse, ce, kl, argmax = soft.stats(logits, teacher_logits, lab, temperature=plan.kl_temperature)
    elif plan.fused_ce:  # one kernel: statistics and the UNSCALED g = softmax - onehot (scaled after GEMM 2)
        assert kernels.fused_ce is not None
        if plan.topk_in_kernel:
            assert kernels.fused_ce_topk is not None
            grad_logits, lse, ce, argmax, _, unary = kernels.fused_ce_topk(logits, lab, plan.topk, want_grad=want_grad)
        else:
            grad_logits, lse, ce, argmax = kernels.fused_ce(logits, lab, want_grad=want_grad)
    else:
        lse, ce, argmax, lse_t = kernels.stats(logits, lab, plan.kl_temperature, plan.use_kl)
    return _ChunkStats(grad_logits, lse, ce, kl, argmax, row_state, lse_t, unary)


def _record_predictions(
    plan: _ChunkPlan,
    out: _LossOutputs,
    b0: int,
    b1: int,
    stats: _ChunkStats,
    logits: torch.Tensor,
    lab: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    """The chunk's rows of ``correct`` and, with topk > 0, of the candidates (read from the chunk's logits)."""
    nb, bs, first, slots, topk = plan.num_blocks, plan.block_size, plan.first, plan.slots, plan.topk
    out.correct.view(nb, bs)[b0:b1, first:] = (stats.argmax == plan.supervised(labels, b0, b1)).view(-1, slots)
    if stats.unary is not None and out.candidates is not None and out.candidate_logits is not None:
        assert out.label_place is not None and out.label_found is not None
        from trainer.model.dflash2 import training_candidates

        ids, place, found = training_candidates(stats.unary, lab)
        out.candidates.view(nb, bs, topk)[b0:b1, first:] = ids.view(-1, slots, topk)
        out.candidate_logits.view(nb, bs, topk)[b0:b1, first:] = logits.gather(1, ids).float().view(-1, slots, topk)
        out.label_place.view(nb, bs)[b0:b1, first:] = place.view(-1, slots)
        out.label_found.view(nb, bs)[b0:b1, first:] = found.view(-1, slots)


def _finish_logit_grad(
    plan: _ChunkPlan,
    out: _LossOutputs,
    stats: _ChunkStats,
    logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    lab: torch.Tensor,
    w: torch.Tensor,
    ce_coef: torch.Tensor,
    kl_coef: torch.Tensor | None,
) -> torch.Tensor | None:
    """Add the chunk's KL sum; return g, computed here where the statistics' kernel did not write it."""
    grad_logits = stats.grad_logits
    if plan.soft is not None:
        assert stats.kl is not None  # the soft-label kernels return KL
        out.kl_sum += (w * stats.kl).sum()
        if stats.row_state is not None and out.grad_hidden is not None:
            # c_i (p - y) + k_i (p_T - q_T) = c_i [(p - y) + (k_i / c_i)(p_T - q_T)]; k_i = 0 wherever
            # c_i = 0 (both carry w_i / normalizer and CAP's part is >= 0), so the ratio is 0 there
            assert kl_coef is not None  # soft labels: use_kl
            ratio = torch.where(ce_coef > 0, kl_coef / ce_coef, 0.0)
            grad_logits = plan.soft.grad(
                logits, teacher_logits, lab, stats.row_state, ratio, temperature=plan.kl_temperature, out=teacher_logits
            )
    elif not plan.fused:
        grad_logits, kl = plan.kernels.logit_grad(
            logits, lab, stats.lse, ce_coef, teacher_logits, stats.lse_t, kl_coef, plan.kl_temperature
        )
        if kl is not None:
            out.kl_sum += (w * kl).sum()
    return grad_logits


def _write_hidden_grad(
    plan: _ChunkPlan,
    grad_hidden: torch.Tensor,
    grad_logits: torch.Tensor | None,
    lm_head_weight: torch.Tensor,
    ce_coef: torch.Tensor,
    b0: int,
    b1: int,
) -> None:
    """GEMM 2: the chunk's rows of d loss/d hidden = g @ W, scaled per row here when g came unscaled."""
    assert grad_logits is not None  # every path above computes g when a gradient is wanted
    hidden_size = grad_hidden.shape[1]
    out = grad_hidden.view(plan.num_blocks, plan.block_size, hidden_size)[b0:b1, plan.first :]  # [blocks, B-1, H]
    direction = (grad_logits @ lm_head_weight).view(out.shape)  # GEMM 2
    if plan.fused:
        # then the per-row coefficient: diag(c) (P - Y) W. One [C, H] pass (H << V), in fp32 before
        # the single rounding to the gradient's dtype; weight-0 rows get c = 0 exactly.
        torch.mul(direction, ce_coef.view(-1, plan.slots, 1), out=out)
    else:
        out.copy_(direction)


def _check_inputs(
    hidden,
    weight,
    labels,
    weights,
    teacher_hidden,
    block_size,
    normalizer,
    kl_weight,
    kl_temperature,
    cap_lambda,
    num_blocks_normalizer,
    chunk_size,
) -> None:
    """Shape and hyper-parameter checks that need no device sync (values on the device are trusted)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise LossInputError(
            f"hidden {tuple(hidden.shape)} and lm_head_weight {tuple(weight.shape)} must be [M, H] and [V, H]"
        )
    rows = hidden.shape[0]
    if labels.shape != (rows,) or weights.shape != (rows,):
        raise LossInputError(f"labels {tuple(labels.shape)} and weights {tuple(weights.shape)} must be [{rows}]")
    if labels.dtype != torch.int64:
        raise LossInputError(f"labels must be int64 (got {labels.dtype})")
    if block_size < 2 or rows % block_size:
        raise LossInputError(f"rows ({rows}) must be whole blocks of block_size >= 2 (got {block_size})")
    if teacher_hidden is not None and teacher_hidden.shape != hidden.shape:
        raise LossInputError(f"teacher_hidden {tuple(teacher_hidden.shape)} must match hidden {tuple(hidden.shape)}")
    if kl_weight > 0 and teacher_hidden is None:
        raise LossInputError("kl_weight > 0 needs teacher_hidden (soft labels are on but no teacher states were given)")
    for name, value in (
        ("normalizer", normalizer),
        ("num_blocks_normalizer", num_blocks_normalizer),
        ("kl_weight", kl_weight),
        ("cap_lambda", cap_lambda),
    ):
        if not (value >= 0 and math.isfinite(value)):
            raise LossInputError(f"{name} must be finite and >= 0 (got {value})")
    if not (kl_temperature > 0 and math.isfinite(kl_temperature)):
        raise LossInputError(f"kl_temperature must be > 0 (got {kl_temperature})")
    if chunk_size is not None and chunk_size < 1:
        raise LossInputError(f"chunk_size must be >= 1 (got {chunk_size})")
