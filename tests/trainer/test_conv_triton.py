"""DFlash2's convolution kernels (trainer/kernels/conv_triton.py) against grouped_dynamic_conv's autograd, float32 on
CPU through Triton's interpreter (one child process: tests/trainer/conv_interp_worker.py). Shapes cover a partial
row tile (M not a multiple of 32), taps K = 1..3, blocks of 4 and 8 (taps that reach the block's start), two
channel tiles (H = 512: the 256-wide tiles) and a delta that is a strided view of the projection's output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.triton_interp import interpret_cases
from trainer.model.dflash2 import grouped_dynamic_conv

pytest.importorskip("triton", reason="the triton package is not installed (`make test` installs it: dev extra)")

WORKER = Path(__file__).with_name("conv_interp_worker.py")
CASES = {  # rows, blocks, block size, hidden, group size, taps
    "k2-b8": (2, 3, 8, 64, 16, 2),
    "k1-b4": (1, 5, 4, 32, 8, 1),
    "k3-b4-two-tiles": (1, 3, 4, 512, 16, 3),
    "k2-b8-strided-delta": (3, 2, 8, 64, 16, 2),
}


def _case(name: str) -> dict:
    R, N, B, H, gs, K = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    shape = (R, N * B)
    x = torch.randn(*shape, H, generator=gen)
    kernels = torch.randn(*shape, 2, K, H // gs, generator=gen)  # as BlockConv.prepare's projection output
    delta = kernels[..., 1, :, :] if "strided" in name else kernels[..., 0, :, :].contiguous()
    return dict(
        x=x,
        delta=delta,
        base=torch.randn(K, H, generator=gen),
        grad_out=torch.randn(*shape, H, generator=gen),
        block_size=B,
        group_size=gs,
    )


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    cases = {name: _case(name) for name in CASES}
    return interpret_cases(WORKER, cases, tmp_path_factory.mktemp("conv-interp"))


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_match_the_torch_convolution_and_its_gradients(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    x, delta, base = (case[k].double().requires_grad_(True) for k in ("x", "delta", "base"))
    ref = grouped_dynamic_conv(x, delta, base, block_size=case["block_size"], group_size=case["group_size"])
    grads = torch.autograd.grad(ref, (x, delta, base), case["grad_out"].double())
    # fp32 accumulation of K products (forward, dx), group_size (d delta) or all rows (d base) against float64
    torch.testing.assert_close(got["out"].double(), ref.detach(), rtol=1e-5, atol=1e-5)
    for key, value in zip(("dx", "ddelta", "dbase"), grads):
        assert got[key].shape == value.shape, key
        torch.testing.assert_close(got[key].double(), value, rtol=1e-5, atol=1e-4, msg=key)
    if case["delta"].shape[-2] > 1:  # the taps reach back: slot 0 of each block must see zeros, not the last block
        assert not torch.allclose(
            got["out"].double(),
            (x * (base[0] + delta[..., 0, :].repeat_interleave(case["group_size"], -1))).detach(),
            atol=1e-3,
        )
