"""DFlash2's two additions to the DFlash drafter (docs/method.md#dflash2), as in speculators 0.9's `dflash2`:

- `BlockConv`: a two-sided grouped dynamic causal convolution around each sublayer (attention and MLP):
  before the sublayer, x_j <- sum_t (base_in[t] + delta_in[j, t, g]) * x_{j-t}; after it, the same with the
  output-side kernel, where both deltas are one projection of the sublayer's (normed) input. The taps never cross
  a block boundary (slot j only sees slots j-t >= 0 of its own block), so the convolution is the same at any
  block size >= kernel_size: trained at 16, served at 8. Initialised to the identity (base tap 0 = 1, the
  projection 0), so a fresh DFlash2 drafter computes exactly what a DFlash drafter with the same weights does.
  Per layer it adds 2 * (2 K H + 2 K (H/G) H) parameters: at H = 4096, K = 2, G = 16, 4.2 M per sublayer pair.
- `CandidateSelector`: a rank-r bilinear score of (predecessor token, hidden state, candidate) added to the
  unary logits of each slot's top-k candidates: score(c) = logit(c) + <P[prev] * (W h), S[c]>. At inference the
  block is decoded left to right, slot j's predecessor being slot j-1's pick (the anchor for slot 1); in training
  the predecessor is the true token (teacher forcing) and the objective is a K-way cross-entropy over the unary
  top-k with the label put in the last place when it is missing (`training_candidates`).

State-dict names (speculators' own): `layers.{i}.{attention,mlp}_conv.base_kernel` [2,K,H],
`layers.{i}.{attention,mlp}_conv.kernel_projection.weight` [2*K*H/G, H], `candidate_selector.{predecessor,
successor}_codebook` [V,r], `candidate_selector.hidden_projection.weight` [r,H].
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.kernels.conv_grad import conv_gradients, conv_input_gradient

ARCHS = ("dflash", "dflash2")
# The convolutions' kernels ($DFLASH_CONV_KERNEL): "torch" (GroupedDynamicConv, compiled into the layer), "autograd"
# (grouped_dynamic_conv through autograd, the form before the GroupedDynamicConv rewrite, kept for A/B benches) or "triton"
# (trainer/kernels/conv_triton.py: one fused kernel each way behind a custom op; CUDA only, CPU runs torch).
CONV_KERNELS = ("torch", "autograd", "triton")
CONV_KERNEL: str = os.environ.get("DFLASH_CONV_KERNEL", "torch").strip() or "torch"
# The output-side convolution's backward under "torch" ($DFLASH_CONV_BACKWARD): "triton" (one kernel for its three
# gradients, trainer/kernels/conv_bwd_triton.py, where it fits: CUDA, shapes in `supported`; else Inductor's) or
# "inductor" (GroupedDynamicConv.backward compiled into the layer, the form before conv_bwd_triton, for A/B benches).
CONV_BACKWARDS = ("triton", "inductor")
CONV_BACKWARD: str = os.environ.get("DFLASH_CONV_BACKWARD", "triton").strip() or "triton"
# The input-side convolution's backward under "torch" ($DFLASH_CONV_INPUT_BACKWARD): "inductor" (GroupedDynamicConv
# on the norm's output, its backward compiled into the layer: the default until the kernel below is measured on the
# GPU, bench/results/kernels.md 2026-12-05 "The input-side convolution's kernel gradients as one Triton kernel"), "triton" (its kernel gradients and the norm weight's through it in one kernel,
# trainer/kernels/conv_in_triton.py, where it fits: CUDA, shapes in `supported`; the sublayer then gets the
# convolution's output in the autocast dtype, one view for each of its GEMMs, see NormedConv; elsewhere "inductor")
# or "torch" (NormedConv with its backward in torch, any device: the CPU's check of the wiring).
CONV_INPUT_BACKWARDS = ("triton", "inductor", "torch")
CONV_INPUT_BACKWARD: str = os.environ.get("DFLASH_CONV_INPUT_BACKWARD", "inductor").strip() or "inductor"
_UNFIT_LOGGED: set[str] = set()


def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int, group_size: int
) -> torch.Tensor:
    """x [R,N*B,H], delta [R,N*B,K,G] (G = H / group_size), base [K,H] -> [R,N*B,H]:
    out_j = sum_{t < K, t <= j % B} x_{j-t} * (base[t] + delta[j, t, group(h)]), block-local.

    The plain expression, differentiated by autograd: the reference of `GroupedDynamicConv` (the layers' form) and
    of trainer/kernels/conv_triton.py, and the layers' form before it ($DFLASH_CONV_KERNEL=autograd)."""
    R, Q, H = x.shape
    K, G = base.shape[0], H // group_size
    blocks = x.view(R, Q // block_size, block_size, G, group_size)
    coef = delta.view(R, Q // block_size, block_size, K, G)
    out = blocks * (base[0].to(x.dtype).view(G, group_size) + coef[:, :, :, 0, :, None])
    for tap in range(1, K):
        # slot j reads slot j - tap of its own block; the first `tap` slots read zeros (padding inside the block)
        shifted = F.pad(blocks[:, :, : block_size - tap], (0, 0, 0, 0, tap, 0))
        out = out + shifted * (base[tap].to(x.dtype).view(G, group_size) + coef[:, :, :, tap, :, None])
    return out.reshape(R, Q, H)


class GroupedDynamicConv(torch.autograd.Function):
    """grouped_dynamic_conv's values with a backward written for the compiled layer (bench/results/kernels.md 2026-12-04 "DFlash2's convolutions rewritten for Inductor",
    from Inductor's code of one qwen3-8b-sized layer: the DFlash2 layer moved ~14.6 GB more than DFlash's per
    step through its element-wise kernels, ~6.8 GB now).

    What autograd's form cost: (1) each F.pad'ed input was saved for the backward ([R,Q,H], float32 on the input
    side, where x is the norm's fp32 output): the partitioner may recompute element-wise ops, views and `index`,
    never `constant_pad_nd`, so four copies per layer were written in the forward and read in the backward (and
    held: the +13 GiB of peak memory); (2) its gradients came out as one reduction kernel per tap and per kind, each
    re-reading the output gradient and x, and the shared g * x products written once in float32 for two of them.

    Here: the forward shifts with `index` + `where` (recomputable; the same values: slot j < tap gets 0 * coef = 0
    either way), so only x, delta and base are live for the backward and Inductor recomputes x (the norm's output)
    from the layer input it keeps anyway; the backward shifts g, never x (a pad of x would be a forward value again),
    so every tap's delta sums share one iteration space (one reduction, with dx beside it) and every tap's base sums
    another; the base sums' products are their own nodes (operands swapped: CSE keeps them apart), which Inductor
    inlines into the reduction instead of writing [R,Q,H] float32 products. Products and sums in float32 (wider for
    wider inputs), each gradient rounded once to its input's dtype (autograd rounded every bf16 product first)."""

    @staticmethod
    def forward(
        x: torch.Tensor,
        delta: torch.Tensor,
        base: torch.Tensor,
        block_size: int,
        group_size: int,
        triton_backward: bool = False,
    ) -> torch.Tensor:
        R, Q, H = x.shape
        K, G = base.shape[0], H // group_size
        blocks = x.view(R, Q // block_size, block_size, G, group_size)
        coef = delta.view(R, Q // block_size, block_size, K, G)
        out = blocks * (base[0].to(x.dtype).view(G, group_size) + coef[:, :, :, 0, :, None])
        slot = torch.arange(block_size, device=x.device)
        for tap in range(1, K):
            shifted = torch.where((slot >= tap)[:, None, None], blocks[:, :, (slot - tap).clamp(min=0)], 0)
            out = out + shifted * (base[tap].to(x.dtype).view(G, group_size) + coef[:, :, :, tap, :, None])
        return out.reshape(R, Q, H)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        x, delta, base, block_size, group_size, *rest = inputs
        ctx.save_for_backward(x, delta, base)
        ctx.block_size, ctx.group_size = block_size, group_size
        ctx.triton_backward = bool(rest and rest[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None]:
        x, delta, base = ctx.saved_tensors
        # the output side on CUDA (BlockConv.finish): one kernel, trainer/kernels/conv_bwd_triton.py
        if ctx.triton_backward:
            from trainer.kernels.conv_bwd_triton import conv_finish_backward

            dx, d_delta, d_base = conv_finish_backward(grad, x, delta, base, ctx.block_size)
        else:
            dx, d_delta, d_base = conv_gradients(grad, x, delta, base, ctx.block_size, ctx.group_size)
        return dx, d_delta, d_base, None, None, None


class NormedConv(torch.autograd.Function):
    """The input side's convolution (GroupedDynamicConv's values) of the norm's output n = weight * xhat (xhat =
    x * rstd, the RMSNorm's normalised input), with the norm's parts at hand for the backward, which gives
    (trainer/kernels/conv_in_triton.py's kernel on CUDA, torch elsewhere):
    - d delta and d base, from n recomputed from x, rstd and the weight, never saved or materialised (a float32
      [R,Q,H]: ~0.3 ms a call of extra traffic at the qwen3-8b seed);
    - the norm weight's gradient through the convolution, sum over rows of dn * xhat: the kernel has dn's terms at
      hand (g and the coefficients), so Inductor's norm backward no longer writes dn in float32 and reads it back
      for these column sums (the kernel projection's half, sum of its input gradient * xhat, stays autograd's);
    - d xhat = dn * weight as torch code, which Inductor fuses into the norm's backward (rstd's row reductions).
    x and rstd get no gradient here (they reach xhat's own graph).

    The output comes in `out_dtype` (the autocast dtype, to which the sublayer's GEMMs cast it anyway: the same
    forward values) as `fanout` views, one for each GEMM that reads it (q/k/v: 3, gate/up: 2): the backward then
    gets each GEMM's input gradient as a piece of its own, which the kernel sums in float32 as it reads them, as
    Inductor's code did inside each consumer. One output instead would be given the pieces' sum as one tensor,
    which a custom op needs materialised: an extra pass over the pieces and one more bf16 rounding of g."""

    @staticmethod
    def forward(
        xhat: torch.Tensor,
        weight: torch.Tensor,
        delta: torch.Tensor,
        base: torch.Tensor,
        x: torch.Tensor,
        rstd: torch.Tensor,
        block_size: int,
        group_size: int,
        out_dtype: torch.dtype,
        fanout: int,
        triton_backward: bool,
    ) -> tuple[torch.Tensor, ...]:
        out = GroupedDynamicConv.forward(weight * xhat, delta, base, block_size, group_size).to(out_dtype)
        return tuple(out.view_as(out) for _ in range(fanout))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        xhat, weight, delta, base, x, rstd, block_size, group_size, _, _, triton_backward = inputs
        ctx.save_for_backward(weight, delta, base, x, rstd)
        ctx.block_size, ctx.group_size, ctx.triton_backward = block_size, group_size, triton_backward
        ctx.xhat_dtype, ctx.n_dtype = xhat.dtype, torch.promote_types(weight.dtype, xhat.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        weight, delta, base, x, rstd = ctx.saved_tensors
        B, S = ctx.block_size, ctx.group_size
        pieces = [g for g in grads if g is not None]
        none = (None,) * 7
        if not pieces:
            return None, None, None, None, *none
        acc = torch.promote_types(torch.promote_types(ctx.n_dtype, pieces[0].dtype), torch.float32)
        grad = pieces[0].to(acc)
        for piece in pieces[1:]:
            grad = grad + piece.to(acc)
        if ctx.triton_backward:
            from trainer.kernels.conv_in_triton import conv_prepare_kernel_grads

            d_delta, d_base, d_weight = conv_prepare_kernel_grads(pieces, x, rstd, weight, delta, base, B)
            dn = conv_input_gradient(grad, delta, base, B, S, ctx.n_dtype)  # the kernel leaves dn to Inductor
        else:
            xhat = (x.to(rstd.dtype) * rstd).to(ctx.xhat_dtype)  # as RMSNorm.parts computes it
            dn, d_delta, d_base = conv_gradients(grad, weight * xhat, delta, base, B, S)  # dn in n's dtype
            d_weight = (dn * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype)
        return (dn * weight).to(ctx.xhat_dtype), d_weight, d_delta, d_base, *none


class BlockConv(nn.Module):
    """The input- and output-side convolutions of one sublayer, driven by one projection of its input."""

    def __init__(self, hidden_size: int, *, block_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        if CONV_KERNEL not in CONV_KERNELS:
            raise ValueError(f"DFLASH_CONV_KERNEL must be one of {', '.join(CONV_KERNELS)}, got {CONV_KERNEL!r}")
        if CONV_BACKWARD not in CONV_BACKWARDS:
            raise ValueError(f"DFLASH_CONV_BACKWARD must be one of {', '.join(CONV_BACKWARDS)}, got {CONV_BACKWARD!r}")
        if CONV_INPUT_BACKWARD not in CONV_INPUT_BACKWARDS:
            raise ValueError(
                f"DFLASH_CONV_INPUT_BACKWARD must be one of {', '.join(CONV_INPUT_BACKWARDS)}, "
                f"got {CONV_INPUT_BACKWARD!r}"
            )
        self.kernel = CONV_KERNEL  # an attribute, so a bench variant can switch one drafter (read at compile time)
        self.backward_kernel = CONV_BACKWARD  # likewise
        self.input_backward_kernel = CONV_INPUT_BACKWARD  # likewise
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 of both base kernels 1, every other tap and the projection 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, norm: Any = None, fanout: int = 1) -> tuple[Any, torch.Tensor]:
        """x [R,Q,H]: the sublayer's normed input, or with `norm` (the layer's RMSNorm: `parts(x)` gives the
        normalised x before the weight and the per-row rstd) its input before the norm -> (its convolved input, the
        output side's kernel deltas). With the norm at hand the input side's backward may run conv_in_triton's
        kernel (NormedConv); then the convolved input comes in the autocast dtype where autocast is on (what the
        sublayer's GEMMs cast it to), as a tuple of `fanout` views (one for each of the sublayer's GEMMs) when
        fanout > 1; else one tensor."""
        xhat, rstd = norm.parts(x) if norm is not None else (x, None)
        n = norm.weight * xhat if norm is not None else x  # the norm's output, as RMSNorm.forward computes it
        kernels = self.kernel_projection(n).view(*n.shape[:-1], 2, self.kernel_size, self.num_groups)
        delta_in, delta_out = kernels[..., 0, :, :], kernels[..., 1, :, :]
        mode = self._input_mode(x) if norm is not None and self.kernel == "torch" else "inductor"
        if mode == "inductor" or norm is None:
            return self._conv(n, delta_in, self.base_kernel[0]), delta_out
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else n.dtype
        h = NormedConv.apply(
            xhat, norm.weight, delta_in, self.base_kernel[0], x, rstd, self.block_size, self.group_size, out_dtype,
            fanout, mode == "triton",
        )  # fmt: skip
        return (h if fanout > 1 else h[0]), delta_out

    def _input_mode(self, x: torch.Tensor) -> str:
        """The input side's backward: "triton" on CUDA where conv_in_triton's kernel takes the shapes (else
        Inductor's, with one log line per reason), "torch" when asked for, else "inductor"."""
        if self.input_backward_kernel != "triton":
            return self.input_backward_kernel
        if not x.is_cuda:
            return "inductor"
        from trainer.kernels.conv_in_triton import supported

        why = supported(x.shape[-1], self.group_size, self.kernel_size, x.dtype)
        if why is not None and "in " + why not in _UNFIT_LOGGED:
            _UNFIT_LOGGED.add("in " + why)
            print(f"dflash2: the input convolution's Triton backward does not take {why}; Inductor's", file=sys.stderr)
        return "triton" if why is None else "inductor"

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [R,Q,H] through the output-side convolution."""
        return self._conv(y, delta, self.base_kernel[1], finish=True)

    def _triton_backward(self, y: torch.Tensor, taps: int) -> bool:
        """Whether the output side's backward runs conv_bwd_triton's kernel: chosen on CUDA where the shapes fit,
        else Inductor's backward, with one log line per reason (decided while tracing: a constant of the graph)."""
        if self.backward_kernel != "triton" or not y.is_cuda:
            return False
        from trainer.kernels.conv_bwd_triton import supported

        why = supported(y.shape[-1], self.group_size, taps, y.dtype)
        if why is not None and why not in _UNFIT_LOGGED:
            _UNFIT_LOGGED.add(why)
            print(f"dflash2: the convolution's Triton backward does not take {why}; Inductor's", file=sys.stderr)
        return why is None

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, finish: bool = False) -> torch.Tensor:
        if self.kernel == "triton" and x.is_cuda:
            from trainer.kernels.conv_triton import block_conv

            return block_conv(x, delta, base, block_size=self.block_size, group_size=self.group_size)
        if self.kernel == "autograd":  # the original form: autograd through the forward expression
            return grouped_dynamic_conv(x, delta, base, block_size=self.block_size, group_size=self.group_size)
        triton_backward = finish and self._triton_backward(x, base.shape[0])
        return GroupedDynamicConv.apply(x, delta, base, self.block_size, self.group_size, triton_backward)


class CandidateSelector(nn.Module):
    """Bilinear (predecessor, hidden, candidate) scores added to the unary logits of a few candidates."""

    def __init__(self, *, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.init_std = init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.predecessor_codebook.is_meta:  # built for its shapes only (see DFlashDrafter.reset_parameters)
            return
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=self.init_std)

    def transition(self, hidden: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], predecessor [...] int, candidates [..., k] int -> transition scores [..., k] (the
        codebooks' dtype: fp32 under autocast too, where the projection's output is cast up)."""
        return self.projected_transition(self.hidden_projection(hidden), predecessor, candidates)

    def projected_transition(
        self, projected: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """transition() from hidden_projection(hidden) [..., r]: the training objective projects every slot's hidden
        (slot 0 too, 1/B more of a small GEMM) and then drops slot 0 from the [.., r] result, where dropping it
        from the [.., H] hidden first copied it (qwen3-8b seed: 261 MB forward, 269 MB of zero-padded gradient)."""
        context = self.predecessor_codebook[predecessor] * projected.to(self.predecessor_codebook.dtype)
        return (context.unsqueeze(-2) * self.successor_codebook[candidates]).sum(-1)


def training_candidates(
    candidates: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """candidates [M,k] (unary top-k, best first), labels [M] -> (the candidates with the label in the last place
    where it is missing, the label's place [M], whether the unary top-k held the label [M] bool). As speculators' `selector_training_candidates`: the K-way
    cross-entropy then always has its label, and serving's candidate set is changed only where it lacks it."""
    k = candidates.shape[1]
    hit = candidates.eq(labels[:, None])
    present = hit.any(dim=1)
    place = torch.where(present, hit.to(torch.int64).argmax(dim=1), k - 1)
    out = candidates.clone()
    out[:, -1] = torch.where(present, candidates[:, -1], labels)
    return out, place, present


def block_predecessors(block_ids: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """The teacher-forced predecessor of every slot, [R, N*B] -> [R, N*B]: slot 1's is the anchor token, slot j's
    (j >= 2) the true token of slot j-1 (its label); slot 0 (never scored) gets the anchor. Labels of unsupervised
    slots may be -100: those become the anchor too (their weight is 0, so their score is never used)."""
    R, Q = labels.shape
    ids = labels.view(R, Q // block_size, block_size)
    anchor = block_ids.view(R, Q // block_size, block_size)[:, :, :1]
    prev = torch.cat([anchor, ids[:, :, :-1]], dim=2)
    prev[:, :, 1] = anchor[:, :, 0]
    return torch.where(prev >= 0, prev, anchor).reshape(R, Q)


def selector_loss(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    predecessors: torch.Tensor,
    candidates: torch.Tensor,
    candidate_logits: torch.Tensor,
    place: torch.Tensor,
    weights: torch.Tensor,
    *,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selector's objective on one micro-batch: sum_i w_i CE_K(unary_i + transition_i, place_i), with the
    unary loss's slot weights, slot 0 left out (static shapes: [N, B-1] rows). The caller divides by the step's
    normaliser: a Python float argument would be a constant of the compiled graph, recompiled every step.

    hidden [M,H] (the drafter's final hidden, with grad), predecessors/place [M], candidates/candidate_logits [M,k]
    (from dflash_loss(topk=k)), weights [M]. The unary part of the score is held constant here (detached): the
    LM head's gradient through k gathered rows per slot would need a [M,k,H] gather (4 GB at the qwen3-8b seed),
    and the unary logits already learn from the full-vocabulary CE; speculators lets it flow. Returns (sum_i w_i CE_i
    with its graph, pick [M] int64: each row's argmax candidate id, 0 on slot 0)."""
    M, H = hidden.shape

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.view(M // block_size, block_size, *t.shape[1:])[:, 1:].reshape(-1, *t.shape[1:])

    cand = rows(candidates)
    projected = rows(selector.hidden_projection(hidden))
    scores = (
        rows(candidate_logits).detach() + selector.projected_transition(projected, rows(predecessors), cand).float()
    )
    w = rows(weights).float()
    ce = F.cross_entropy(scores, rows(place), reduction="none")
    ce_sum = (w * ce).sum()
    pick = torch.zeros(M, dtype=torch.long, device=hidden.device)
    best = cand.gather(1, scores.detach().argmax(dim=1, keepdim=True)).squeeze(1)
    pick.view(M // block_size, block_size)[:, 1:] = best.view(-1, block_size - 1)
    return ce_sum, pick


def select_block(
    selector: CandidateSelector, logits: torch.Tensor, hidden: torch.Tensor, anchor_token: int, top_k: int | None = None
) -> list[int]:
    """Inference: one block's drafted tokens. logits [J,V] and hidden [J,H] of slots 1..J; slot 1's predecessor is
    the anchor, each next slot's the previous pick. Each pick is the argmax of unary + transition over the unary
    top-k (the verifier makes any pick lossless; the selector only decides which token is proposed)."""
    k = min(top_k or selector.top_k, logits.shape[-1])
    unary, candidates = logits.float().topk(k, dim=-1)  # [J,k]
    picks: list[int] = []
    previous = anchor_token
    for j in range(logits.shape[0]):
        prev = torch.tensor(previous, device=logits.device)
        scores = unary[j] + selector.transition(hidden[j], prev, candidates[j]).float()
        previous = int(candidates[j, int(scores.argmax())])
        picks.append(previous)
    return picks


__all__ = [
    "ARCHS",
    "BlockConv",
    "CandidateSelector",
    "NormedConv",
    "block_predecessors",
    "grouped_dynamic_conv",
    "select_block",
    "selector_loss",
    "training_candidates",
]
