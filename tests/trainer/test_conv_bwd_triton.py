"""The output-side convolution's backward kernel (trainer/kernels/conv_bwd_triton.py) against autograd through the
plain expression (grouped_dynamic_conv), on CPU through Triton's interpreter (one child process:
tests/trainer/conv_bwd_interp_worker.py): float64 to 1e-12, float32 to 1e-5 as the layers' own backward is tested
(tests/trainer/test_dflash2.py). Shapes cover taps K = 1..4 (the tap axis padded to a power of two for K = 3),
blocks of 4 and 8 (taps that reach the block's start), partial row tiles and several row chunks, two channel tiles,
groups narrower than a tile, a delta that is a strided view of the projection's output and a stride-0 gradient;
then the layers' wiring (GroupedDynamicConv with triton_backward, eager and through torch.compile), the
configuration ladder's next rung and the torch fallback when no rung fits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.triton_interp import interpret_cases
from trainer.kernels.conv_bwd_triton import supported
from trainer.kernels.conv_grad import conv_gradients
from trainer.model.dflash2 import grouped_dynamic_conv

pytest.importorskip("triton", reason="the triton package is not installed (`make test` installs it: dev extra)")

WORKER = Path(__file__).with_name("conv_bwd_interp_worker.py")
CASES = {  # rows, blocks, block size, hidden, group size, taps, dtype, extra
    "k2-b8-strided-delta": (2, 3, 8, 64, 16, 2, torch.float32, {}),
    "k1-b4": (1, 5, 4, 32, 8, 1, torch.float32, {}),
    "k3-b4-two-tiles": (1, 3, 4, 512, 16, 3, torch.float32, {}),
    "k4-b4-f64-many-chunks": (3, 5, 4, 64, 4, 4, torch.float64, {}),
    "k2-b8-bf16": (2, 2, 8, 64, 16, 2, torch.bfloat16, {}),
    "k2-b4-expanded-grad": (2, 3, 4, 32, 16, 2, torch.float32, {"expanded": True}),
    "autograd-f64": (2, 3, 8, 64, 16, 2, torch.float64, {"mode": "autograd"}),
    "compiled": (2, 3, 8, 64, 16, 2, torch.float32, {"mode": "compiled"}),
    "next-rung": (1, 3, 8, 64, 16, 2, torch.float32, {"smem": "1K"}),
    "no-rung-fits": (1, 3, 8, 64, 16, 2, torch.float32, {"smem": "1K", "configs": [(8, 4, 16, 4)]}),
}


def _case(name: str) -> dict:
    R, N, B, H, gs, K, dtype, extra = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    shape = (R, N * B)
    kernels = torch.randn(*shape, 2, K, H // gs, generator=gen).to(dtype)  # as BlockConv.prepare's projection
    g = torch.randn(*shape, H, generator=gen).to(dtype)
    if extra.get("expanded"):  # the output gradient of a .sum(): stride 0 everywhere
        g = torch.ones((), dtype=dtype).expand(*shape, H)
    return {
        "y": torch.randn(*shape, H, generator=gen).to(dtype),
        "delta": kernels[..., 1, :, :],  # the output side's half: a strided view
        # a float32 parameter as in the layer (float64 in the float64 cases)
        "base": torch.randn(K, H, generator=gen).to(torch.promote_types(dtype, torch.float32)),
        "g": g,
        "block_size": B,
        "group_size": gs,
        "mode": extra.get("mode", "op"),
        **{k: v for k, v in extra.items() if k in ("smem", "configs")},
    }


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    cases = {name: _case(name) for name in CASES}
    return interpret_cases(WORKER, cases, tmp_path_factory.mktemp("conv-bwd-interp"))


def _reference(case: dict) -> tuple[torch.Tensor, ...]:
    """Autograd through grouped_dynamic_conv in float64 (from the case's values)."""
    y, delta, base = (case[k].double().requires_grad_(True) for k in ("y", "delta", "base"))
    out = grouped_dynamic_conv(y, delta, base, block_size=case["block_size"], group_size=case["group_size"])
    return (out.detach(), *torch.autograd.grad(out, (y, delta, base), case["g"].double()))


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][6] != torch.bfloat16])
def test_the_kernel_gives_autograds_gradients(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    out, *grads = _reference(case)
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if case["y"].dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    for key, want, like in zip(("dy", "dd", "db"), grads, ("y", "delta", "base"), strict=True):
        assert got[key].shape == want.shape and got[key].dtype == case[like].dtype, key
        torch.testing.assert_close(got[key].double(), want, **tolerance, msg=key)
    if "out" in got:  # the forward is GroupedDynamicConv's own: unchanged by the backward's choice
        torch.testing.assert_close(got["out"].double(), out, **tolerance)
    if CASES[name][5] > 1:  # the taps reach back: slot 0 of each block gets no d delta from the block before
        first = got["dd"].view(*case["delta"].shape)[:, :: case["block_size"], 1:]
        assert torch.equal(first, torch.zeros_like(first))


def test_bfloat16_matches_the_unrounded_coefficients_gradients_to_rounding(interpreted):
    """bf16 in, float32 products, sums and coefficient (base + delta unrounded, as Inductor's code for the layer
    computes it), one rounding per gradient. The interpreter's float32 -> bf16 casts truncate where the GPU rounds
    to nearest (kernel values one or two bf16 steps nearer zero), so the bound is 2^-6, not one rounding; the GPU's
    parity is bench/conv_bwd_cost.py's (against Inductor's compiled backward)."""
    case, got = interpreted["cases"]["k2-b8-bf16"], interpreted["out"]["k2-b8-bf16"]
    wide = [case[k].float() for k in ("g", "y", "delta")]
    want = conv_gradients(*wide[:2], wide[2], case["base"], case["block_size"], case["group_size"])
    for key, value, like in zip(("dy", "dd", "db"), want, ("y", "delta", "base"), strict=True):
        assert got[key].dtype == case[like].dtype, key
        torch.testing.assert_close(got[key].float(), value.float(), rtol=2**-6, atol=2**-6, msg=key)


def test_compiled_layers_trace_the_op_once(interpreted):
    assert interpreted["out"]["compiled"]["frames"] == 1
    assert interpreted["out"]["compiled"]["rung"] == 0


def test_a_rung_that_does_not_fit_gives_way_to_the_next_with_one_log_line(interpreted):
    got = interpreted["out"]["next-rung"]
    assert got["rung"] == 1
    assert got["log"].count("\n") == 1 and "triton conv-finish-bwd: using" in got["log"] and "refused" in got["log"]


def test_no_rung_fitting_falls_back_to_torch_with_one_log_line(interpreted):
    got = interpreted["out"]["no-rung-fits"]
    assert got["rung"] == -1
    assert got["log"].count("\n") == 1 and "no configuration fits" in got["log"] and "runs in torch" in got["log"]


@pytest.mark.parametrize(
    ("hidden", "group", "taps", "dtype", "why"),
    [
        (4096, 16, 2, torch.bfloat16, None),
        (4096, 12, 2, torch.bfloat16, "group size 12"),
        (4096, 16, 5, torch.bfloat16, "5 taps"),
        (4096, 16, 2, torch.int32, "dtype"),
        (100, 16, 2, torch.float32, "hidden 100"),
    ],
)
def test_supported_names_what_the_kernel_does_not_take(hidden, group, taps, dtype, why):
    got = supported(hidden, group, taps, dtype)
    assert got is None if why is None else (got is not None and why in got)


def test_an_unknown_backward_kernel_is_refused_by_name(monkeypatch):
    from trainer.model import dflash2

    monkeypatch.setattr(dflash2, "CONV_BACKWARD", "cuda")
    with pytest.raises(ValueError, match="DFLASH_CONV_BACKWARD must be one of triton, inductor, got 'cuda'"):
        dflash2.BlockConv(32, block_size=4, kernel_size=2, group_size=8)


def test_the_layers_keep_inductors_backward_on_cpu():
    from trainer.model.dflash2 import BlockConv

    conv = BlockConv(32, block_size=4, kernel_size=2, group_size=8)
    assert conv.backward_kernel == "triton" and not conv._triton_backward(torch.zeros(1, 4, 32), 2)
