"""The input-side convolution's kernel gradients (trainer/kernels/conv_in_triton.py) against autograd through the
plain expression (grouped_dynamic_conv of the norm's output), on CPU through Triton's interpreter (one child
process: tests/trainer/conv_in_interp_worker.py): float64 to 1e-12, float32 to 1e-5 as the output side's kernel is
tested. Small shapes (the suite's time is a goal): taps K = 1..4, blocks of 4 and 8, partial row tiles and several
row chunks, two channel tiles, a strided delta; the wiring (NormedConv, eager and through torch.compile), the
ladder's next rung and the torch fallback; then the layer's own wiring on CPU (BlockConv.prepare with the norm,
NormedConv's torch backward) against autograd through the norm and the plain expression."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.conv_in_interp_worker import run_case
from tests.trainer.triton_interp import interpret_cases
from trainer.kernels.conv_in_triton import inductor_xhat
from trainer.model.dflash2 import BlockConv, grouped_dynamic_conv

pytest.importorskip("triton", reason="the triton package is not installed (`make test` installs it: dev extra)")

WORKER = Path(__file__).with_name("conv_in_interp_worker.py")
CASES = {  # rows, blocks, block size, hidden, group size, taps, dtype, extra ("pieces": g's, default 1)
    "k2-b8-strided-delta-3-pieces": (2, 3, 8, 64, 16, 2, torch.float32, {"pieces": 3}),
    "k1-b4": (1, 5, 4, 32, 8, 1, torch.float32, {}),
    "k3-b4-two-tiles-2-pieces": (1, 3, 4, 512, 16, 3, torch.float32, {"pieces": 2}),
    "k4-b4-f64-many-chunks": (3, 5, 4, 64, 4, 4, torch.float64, {}),
    "k2-b8-bf16-2-pieces": (2, 2, 8, 64, 16, 2, torch.bfloat16, {"pieces": 2}),
    "autograd-f64-3-pieces": (2, 3, 8, 64, 16, 2, torch.float64, {"mode": "autograd", "pieces": 3}),
    "next-rung": (1, 3, 8, 64, 16, 2, torch.float32, {"smem": "1K"}),
}
# In this process (no interpreter: the suite's time), with an empty ladder so the op takes its torch fallback:
# tracing through the fake implementation and the fallback's log line need no kernel to run.
IN_PROCESS = {
    "compiled-2-pieces": (1, 3, 8, 64, 16, 2, torch.float32, {"mode": "compiled", "pieces": 2}),
    "no-rung-fits-3-pieces": (1, 3, 8, 64, 16, 2, torch.float64, {"pieces": 3}),
}


def _case(name: str) -> dict:
    R, N, B, H, gs, K, dtype, extra = {**CASES, **IN_PROCESS}[name]
    gen = torch.Generator().manual_seed(len(name))
    shape = (R, N * B)
    x = torch.randn(*shape, H, generator=gen).to(dtype)  # the residual stream (bf16 in the layer)
    wide = torch.promote_types(dtype, torch.float32)
    rstd = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + 1e-6)
    kernels = torch.randn(*shape, 2, K, H // gs, generator=gen).to(dtype)
    return {
        "x": x,
        "rstd": rstd,
        "weight": (torch.rand(H, generator=gen) + 0.5).to(wide),  # a float32 parameter (float64 cases: float64)
        "delta": kernels[..., 0, :, :],  # the input side's half: a strided view
        "base": torch.randn(K, H, generator=gen).to(wide),
        # the GEMMs' input-gradient pieces (their sum is the convolution's output gradient)
        "gs": [torch.randn(*shape, H, generator=gen).to(dtype) for _ in range(extra.get("pieces", 1))],
        "block_size": B,
        "group_size": gs,
        "mode": extra.get("mode", "op"),
        **{k: v for k, v in extra.items() if k in ("smem", "configs")},
    }


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    cases = {name: _case(name) for name in CASES}
    return interpret_cases(WORKER, cases, tmp_path_factory.mktemp("conv-in-interp"))


def _reference(case: dict) -> tuple[torch.Tensor, ...]:
    """Autograd through grouped_dynamic_conv of n = weight * xhat (xhat = x * rstd as Inductor computes it: not
    rounded to x's dtype), in float64: (out, d xhat, d weight, d delta, d base)."""
    x, rstd = case["x"], case["rstd"]
    xhat = inductor_xhat(x, rstd).double().requires_grad_(True)
    weight, delta, base = (case[k].double().requires_grad_(True) for k in ("weight", "delta", "base"))
    out = grouped_dynamic_conv(weight * xhat, delta, base, block_size=case["block_size"], group_size=case["group_size"])
    return (out.detach(), *torch.autograd.grad(out, (xhat, weight, delta, base), _g(case)))


def _g(case: dict) -> torch.Tensor:
    """The output gradient: the pieces' sum, in float64."""
    return sum(piece.double() for piece in case["gs"])


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][6] != torch.bfloat16])
def test_the_kernel_gives_autograds_gradients(interpreted, name):
    case, got = interpreted["cases"][name], interpreted["out"][name]
    out, dxhat, *grads = _reference(case)
    f64 = case["x"].dtype == torch.float64
    tolerance = {"rtol": 1e-12, "atol": 1e-12} if f64 else {"rtol": 1e-5, "atol": 1e-5}
    for key, want, like in zip(("dw", "dd", "db"), grads, ("weight", "delta", "base"), strict=True):
        assert got[key].shape == want.shape and got[key].dtype == case[like].dtype, key
        torch.testing.assert_close(got[key].double(), want, **tolerance, msg=key)
    if "out" in got:  # the forward and d xhat are torch's (GroupedDynamicConv's values, dn * weight)
        torch.testing.assert_close(got["out"].double(), out, **tolerance)
        torch.testing.assert_close(got["dxhat"].double(), dxhat, **tolerance)
    if CASES[name][5] > 1:  # the taps reach back: slot 0 of each block gets no d delta from the block before
        first = got["dd"].view(*case["delta"].shape)[:, :: case["block_size"], 1:]
        assert torch.equal(first, torch.zeros_like(first))


def test_bfloat16_gives_the_float32_gradients_to_rounding(interpreted):
    """bf16 x and pieces, xhat recomputed as Inductor's code for the layer computes it (float32 rstd, x * rstd not
    rounded to bf16), float32 products and sums, d delta rounded once. The interpreter's float32 -> bf16 casts
    truncate where the GPU rounds to nearest (d delta up to 2^-8 low, one-sided), so each gradient is bounded by
    2^-6 of the sum of its products' magnitudes (the same sums of |g| |n|), not of its own (cancelling) value; the
    GPU's parity against Inductor's code is bench/conv_in_cost.py's."""
    case, got = interpreted["cases"]["k2-b8-bf16-2-pieces"], interpreted["out"]["k2-b8-bf16-2-pieces"]
    B, S = case["block_size"], case["group_size"]
    xhat = inductor_xhat(case["x"], case["rstd"]).float()

    def grads(xh: torch.Tensor, g: torch.Tensor, delta: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight, delta, base = (t.float().requires_grad_(True) for t in (case["weight"], delta, base))
        out = grouped_dynamic_conv(weight * xh, delta, base, block_size=B, group_size=S)
        return torch.autograd.grad(out, (weight, delta, base), g)

    g, g_abs = _g(case).float(), sum(piece.float().abs() for piece in case["gs"])
    want = grads(xhat, g, case["delta"], case["base"])
    scale = grads(xhat.abs(), g_abs, case["delta"].abs(), case["base"].abs())  # every term's magnitude (weight > 0)
    for key, value, bound, like in zip(("dw", "dd", "db"), want, scale, ("weight", "delta", "base"), strict=True):
        assert got[key].dtype == case[like].dtype, key
        assert bool(((got[key].float() - value).abs() <= 2**-6 * bound + 1e-5).all()), key


@pytest.fixture
def no_rung(monkeypatch):
    """The op's ladder emptied: every call takes the torch fallback (run_case restores nothing in this process)."""
    from trainer.kernels import conv_in_triton, triton_fit

    monkeypatch.setattr(conv_in_triton, "CONFIGS", [])
    monkeypatch.setattr(conv_in_triton, "_LOGGED", set())
    monkeypatch.setattr(triton_fit, "_VERDICT", {})
    return run_case


def test_compiled_layers_trace_the_op_once(no_rung):
    case = _case("compiled-2-pieces")
    got = no_rung({**case, "configs": []})
    assert got["frames"] == 1 and got["rung"] == -1
    _, dxhat, *grads = _reference(case)
    for key, want in zip(("dxhat", "dw", "dd", "db"), (dxhat, *grads), strict=True):
        torch.testing.assert_close(got[key].double(), want, rtol=1e-5, atol=1e-5, msg=key)


def test_a_rung_that_does_not_fit_gives_way_to_the_next_with_one_log_line(interpreted):
    got = interpreted["out"]["next-rung"]
    assert got["rung"] == 1
    assert got["log"].count("\n") == 1 and "triton conv-prepare-bwd: using" in got["log"] and "refused" in got["log"]


def test_no_rung_fitting_falls_back_to_torch_with_one_log_line(no_rung):
    case = _case("no-rung-fits-3-pieces")
    got = no_rung({**case, "configs": []})
    assert got["rung"] == -1
    assert got["log"].count("\n") == 1 and "no configuration fits" in got["log"] and "run in torch" in got["log"]
    _, _, *grads = _reference(case)
    for key, want in zip(("dw", "dd", "db"), grads, strict=True):
        torch.testing.assert_close(got[key], want, rtol=1e-12, atol=1e-12, msg=key)


def _prepare_grads(conv: BlockConv, x: torch.Tensor, norm: torch.nn.Module, plain: bool) -> list[torch.Tensor]:
    """Three consumers of the convolved input (the three views of fanout=3, or the one plain tensor three times)."""
    h, delta = conv.prepare(norm(x)) if plain else conv.prepare(x, norm, fanout=3)
    views = (h, h, h) if plain else h
    loss = delta.pow(2).sum()
    for i, view in enumerate(views):
        loss = loss + (view * torch.linspace(-1, 1 + i, view.numel(), dtype=view.dtype).view_as(view)).sum()
    params = [x, norm.weight, conv.base_kernel, conv.kernel_projection.weight]
    return [views[0].detach(), *torch.autograd.grad(loss, params)]


def test_the_layers_norm_wiring_gives_autograds_gradients_in_float64():
    """BlockConv.prepare(x, norm, fanout=3) through NormedConv (its torch backward: the three views' gradients
    summed, n recomputed from x, rstd and the weight, no gradient for them from the convolution itself) against
    prepare(norm(x)) through the plain expression, its one output read three times."""
    from trainer.model.drafter import RMSNorm

    torch.manual_seed(0)
    conv = BlockConv(64, block_size=8, kernel_size=2, group_size=16).double()
    norm = RMSNorm(64, 1e-6).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 24, 64, dtype=torch.float64, requires_grad=True)
    conv.input_backward_kernel, conv.kernel = "torch", "torch"
    got = _prepare_grads(conv, x, norm, plain=False)
    conv.kernel = "autograd"  # grouped_dynamic_conv through autograd, the norm outside
    want = _prepare_grads(conv, x, norm, plain=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_convolved_input_comes_in_the_autocast_dtype_with_the_same_values():
    from trainer.model.drafter import RMSNorm

    torch.manual_seed(0)
    conv, norm = BlockConv(32, block_size=4, kernel_size=2, group_size=8), RMSNorm(32, 1e-6)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_(std=0.1)
    x = torch.randn(1, 8, 32).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv.input_backward_kernel = "inductor"
        old, _ = conv.prepare(x, norm)
        conv.input_backward_kernel = "torch"
        new, _ = conv.prepare(x, norm)
    assert old.dtype == torch.float32 and new.dtype == torch.bfloat16
    assert torch.equal(new, old.to(torch.bfloat16))


def test_an_unknown_input_backward_kernel_is_refused_by_name(monkeypatch):
    from trainer.model import dflash2

    monkeypatch.setattr(dflash2, "CONV_INPUT_BACKWARD", "cuda")
    with pytest.raises(
        ValueError, match="DFLASH_CONV_INPUT_BACKWARD must be one of triton, inductor, torch, got 'cuda'"
    ):
        dflash2.BlockConv(32, block_size=4, kernel_size=2, group_size=8)


def test_the_layers_keep_inductors_input_backward_by_default_and_on_cpu():
    conv = BlockConv(32, block_size=4, kernel_size=2, group_size=8)
    assert conv.input_backward_kernel == "inductor" and conv._input_mode(torch.zeros(1, 4, 32)) == "inductor"
    conv.input_backward_kernel = "triton"  # asked for: still Inductor's on CPU (the kernel is CUDA's)
    assert conv._input_mode(torch.zeros(1, 4, 32)) == "inductor"
