"""AdamW with one Triton kernel per parameter (`--adamw triton`; issue 31 item 3).

    TritonAdamW(params, lr=..., weight_decay=...)     a torch.optim.AdamW (same state, state_dict, groups)
    opt.grad_scale = tensor or None                  divide every gradient by it as it is read (the clip)
    opt.step()                                       one kernel launch per parameter, no host sync

Why it exists: torch's fused AdamW, given `grad_scale` (how the step clips inside the kernel), also writes the
rescaled gradients back (GradScaler's unscale contract), so it moves 32 bytes per parameter: reads p, g, m, v and
writes p, g, m, v. The gradients are freed right after the step (zero_grad(set_to_none=True)), so the write is
wasted: this kernel reads p, g, m, v and writes p, m, v, 28 bytes per parameter. At the qwen3-8b drafter's 1.05 B
parameters that is 29.4 GB instead of 33.6 GB per step (the fused kernel: 10.2 ms of the specforge step,
bench/results/kernels.md 2026-12-03).

The math is torch's AdamW (decoupled weight decay, no amsgrad, no maximize), in fp32 with the bias corrections
computed on the host in float64, as torch's single-tensor AdamW does for a CPU step count:
    p -= lr * wd * p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
with IEEE division and square root, so results equal torch.optim.AdamW's to fp32 rounding (tests/trainer/test_adamw_triton.py, under the Triton
interpreter). The state is torch's: `step` (a CPU float32 tensor: reading it never syncs the device), `exp_avg`,
`exp_avg_sq` per parameter, so checkpoints move between `--adamw fused`, `foreach` and `triton` either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - the CPU test machine has triton; a bare torch install may not
    HAVE_TRITON = False

# Elements per program and warps: 4096 fp32 x 4 streams per program keeps enough bytes in flight per SM for the
# H200's bandwidth without spilling (16 elements per thread at 8 warps).
BLOCK = 4096
NUM_WARPS = 8

if HAVE_TRITON:

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        scale_ptr,
        n,
        decay,  # lr * weight_decay
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        step_size,  # lr / (1 - beta1^t)
        bc2_sqrt,  # sqrt(1 - beta2^t)
        HAS_SCALE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Scalars arrive as fp32, so every constant is formed on the host in float64 first: 1 - beta2 formed here
        # from fp32 0.999 would be 0.00099998713 (1.3e-5 off, in every v). Division and square root are the
        # IEEE round-to-nearest forms (div_rn, sqrt_rn): Triton's `/` and tl.sqrt are the approximate PTX ones.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        # streamed once: nothing here is read again, so none of it should stay in L2
        p = tl.load(p_ptr + offs, mask=inside, eviction_policy="evict_first")
        g = tl.load(g_ptr + offs, mask=inside, eviction_policy="evict_first").to(tl.float32)
        m = tl.load(m_ptr + offs, mask=inside, eviction_policy="evict_first")
        v = tl.load(v_ptr + offs, mask=inside, eviction_policy="evict_first")
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        p = p - p * decay  # torch's fused form (param -= lr * wd * param)
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        tl.store(p_ptr + offs, p, mask=inside)
        tl.store(m_ptr + offs, m, mask=inside)
        tl.store(v_ptr + offs, v, mask=inside)


def _host_step(state: dict[str, Any]) -> float:
    """Advance and return the parameter's step count, kept as a CPU float32 tensor (as torch's AdamW keeps it
    without fused/capturable): a checkpoint of a fused run holds it on the device, moved here once (one sync)."""
    step = state["step"]
    if step.device.type != "cpu":
        step = state["step"] = step.detach().to("cpu", torch.float32)
    step += 1
    return float(step)


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay) whose step is `_adamw_kernel`, one launch per parameter with a
    gradient. fp32 parameters and moments; gradients fp32 or bf16. `grad_scale`: a 0-dim device tensor every
    gradient is divided by (the clip coefficient), or None."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        if not HAVE_TRITON:
            raise RuntimeError("TritonAdamW needs the triton package")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False, fused=False)
        self.grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["differentiable"]:
                raise ValueError("TritonAdamW: amsgrad, maximize and differentiable are not supported")
            lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            beta1, beta2 = (float(b) for b in group["betas"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype != torch.float32 or not p.is_contiguous() or not p.grad.is_contiguous():
                    raise ValueError(
                        f"TritonAdamW: parameters must be contiguous float32 with contiguous gradients, got "
                        f"{p.dtype} {tuple(p.shape)}"
                    )
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                t = _host_step(state)
                self._launch(p, p.grad, state["exp_avg"], state["exp_avg_sq"], lr, weight_decay, beta1, beta2, eps, t)
        return loss

    def _launch(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        lr: float,
        weight_decay: float,
        beta1: float,
        beta2: float,
        eps: float,
        t: float,
    ) -> None:
        n = p.numel()
        scale = self.grad_scale
        grid = (triton.cdiv(n, BLOCK),)
        _adamw_kernel[grid](
            p,
            g,
            m,
            v,
            scale if scale is not None else p,  # never read without HAS_SCALE
            n,
            lr * weight_decay,
            beta1,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            eps,
            lr / (1.0 - beta1**t),
            (1.0 - beta2**t) ** 0.5,
            HAS_SCALE=scale is not None,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
