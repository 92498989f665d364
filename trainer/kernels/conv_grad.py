"""DFlash2's block convolution's gradients in torch (trainer/model/dflash2.py: GroupedDynamicConv.backward, what
Inductor compiles into the layer), apart from the layers so that trainer/kernels/conv_bwd_triton.py's fallback can use
them without importing the layers back."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _shift(t: torch.Tensor, tap: int) -> torch.Tensor:
    """Block-local shift of [R,N,B,...] along B, zeros in: slot j gets slot j - tap (tap > 0) or j + |tap| (tap < 0)."""
    B, tail = t.shape[2], (0, 0) * (t.dim() - 3)
    if tap > 0:
        return F.pad(t[:, :, : B - tap], (*tail, tap, 0))
    return F.pad(t[:, :, -tap:], (*tail, 0, -tap))


def conv_gradients(
    grad: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GroupedDynamicConv's backward in torch (what Inductor compiles into the layer): grad, x [R,Q,H], delta
    [R,Q,K,G], base [K,H] -> (dx, d delta, d base) in x's, delta's and base's dtypes and shapes."""
    R, Q, H = x.shape
    K, S = base.shape[0], group_size
    B, G = block_size, H // S
    acc = torch.promote_types(torch.promote_types(x.dtype, grad.dtype), torch.float32)
    blocks = x.view(R, Q // B, B, G, S).to(acc)
    g = grad.view(R, Q // B, B, G, S).to(acc)
    d_delta, d_base = [], []
    for tap in range(K):
        # d coef_t at slot j is g_j * x_{j-t}: formed at slot j - t (g shifted up, x in place), group sums
        # shifted back down; the slots shifted in hold zeros, so they add exact zeros to the base sums
        gs = g if tap == 0 else _shift(g, -tap)
        sums = (gs * blocks).sum(-1)
        d_delta.append(sums if tap == 0 else _shift(sums, tap))
        d_base.append((blocks * gs).sum((0, 1, 2)).reshape(H))
    return (
        conv_input_gradient(grad, delta, base, block_size, group_size, x.dtype),
        torch.stack(d_delta, dim=3).to(delta.dtype).reshape(delta.shape),
        torch.stack(d_base).to(base.dtype),
    )


def conv_input_gradient(
    grad: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """conv_gradients' dx, for an input of `dtype` (the input itself is not needed): grad [R,Q,H] -> [R,Q,H]. dx_j
    gets g_{j+t} times slot j+t's coefficient, rounded as the forward rounded it (to `dtype`)."""
    R, Q, H = grad.shape
    K, S = base.shape[0], group_size
    B, G = block_size, H // S
    acc = torch.promote_types(torch.promote_types(dtype, grad.dtype), torch.float32)
    g = grad.view(R, Q // B, B, G, S).to(acc)
    coef = delta.view(R, Q // B, B, K, G)
    dx = torch.zeros_like(g)
    for tap in range(K):
        term = g * (base[tap].to(dtype).view(G, S) + coef[:, :, :, tap, :, None]).to(acc)
        dx = dx + (term if tap == 0 else _shift(term, -tap))
    return dx.to(dtype).reshape(R, Q, H)


__all__ = ["conv_gradients", "conv_input_gradient"]
