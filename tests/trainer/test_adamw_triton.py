"""trainer/kernels/adamw_triton.py: TritonAdamW against torch.optim.AdamW, under the Triton CPU interpreter (one child
process for every case, tests/trainer/triton_interp.py). Equal to fp32 rounding: with and without the clip's
grad_scale, bf16 gradients, a parameter without a gradient in one step, a changing lr; and checkpoints cross
both ways (a fused AdamW's state resumes here, this one's resumes in torch's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.triton_interp import interpret_cases

WORKER = Path(__file__).with_name("adamw_interp_worker.py")
SHAPES = [(5000,), (64, 33), (7,)]  # 5000 > one program's 4096 elements; 7 < one warp's
LR = [1e-2, 3e-3, 5e-3, 2e-3]
DECAY = 0.1


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _grads(seed: int, steps: int, dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor | None]]:
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(s, generator=gen) * 3).to(dtype) for s in SHAPES] for _ in range(steps)]


def _reference(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor | None]],
    scales: list[torch.Tensor | None],
    lrs: list[float],
    *,
    fused: bool = False,
    state: dict | None = None,
) -> tuple[list[torch.Tensor], torch.optim.AdamW]:
    """torch's AdamW over the same steps; the scale divides the gradients first (what fused's grad_scale does)."""
    params = [p.clone() for p in params]
    opt = torch.optim.AdamW(params, lr=lrs[0], weight_decay=DECAY, foreach=False, fused=fused)
    if state is not None:
        opt.load_state_dict(state)
    for step, step_grads in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lrs[step]
        for p, g in zip(params, step_grads):
            scale = scales[step]
            p.grad = None if g is None else g.float() / (1.0 if scale is None else scale)
        opt.step()
    return params, opt


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    grads = _grads(1, 3)
    with_gap = [list(step) for step in grads]
    with_gap[1][2] = None  # the smallest parameter has no gradient in the middle step: skipped, its count too
    scales = [torch.tensor(2.5), torch.tensor(1.0), torch.tensor(3.0)]
    _, fused_two = _reference(_params(0), _grads(2, 2), [None, None], LR[:2], fused=True)
    cases = {
        "plain": {"params": _params(0), "grads": grads, "scales": [None] * 3, "lr": LR[:3]},
        "scaled": {"params": _params(0), "grads": with_gap, "scales": scales, "lr": LR[:3]},
        "bf16-grads": {"params": _params(0), "grads": _grads(3, 3, torch.bfloat16), "scales": [None] * 3, "lr": LR[:3]},
        # resume from a fused AdamW's checkpoint after 2 steps: the parameters as that run left them
        "resume-fused": {
            "params": _reference(_params(0), _grads(2, 2), [None, None], LR[:2], fused=True)[0],
            "grads": _grads(2, 4)[2:],
            "scales": [None, None],
            "lr": LR[2:],
            "resume": fused_two.state_dict(),
        },
        "two-steps": {"params": _params(0), "grads": _grads(2, 2), "scales": [None, None], "lr": LR[:2]},
    }
    for case in cases.values():
        case["weight_decay"] = DECAY
    return interpret_cases(WORKER, cases, tmp_path_factory.mktemp("adamw"))


def _close(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Within a few fp32 roundings, elementwise; the absolute floor scales with the tensor (moments are ~1e-3 and
    ~1e-2: a fixed floor would hide a relative error of 1e-5 in them)."""
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6 * float(e.abs().max()))


@pytest.mark.parametrize("name", ["plain", "scaled", "bf16-grads"])
def test_steps_equal_torch_adamw(runs: dict, name: str) -> None:
    case, out = runs["cases"][name], runs["out"][name]
    expected, opt = _reference(case["params"], case["grads"], case["scales"], case["lr"])
    _close(out["params"], expected)
    reference = opt.state_dict()["state"]
    for index, state in out["state"]["state"].items():
        assert state["step"].device.type == "cpu" and float(state["step"]) == float(reference[index]["step"])
        _close([state["exp_avg"], state["exp_avg_sq"]], [reference[index]["exp_avg"], reference[index]["exp_avg_sq"]])
    if name == "scaled":  # skipped in one of three steps
        assert float(out["state"]["state"][2]["step"]) == 2.0


def test_resumes_a_fused_adamw_checkpoint(runs: dict) -> None:
    """Two fused steps, then two here == four fused steps; the loaded group's fused flag is cleared."""
    out = runs["out"]["resume-fused"]
    expected, _ = _reference(_params(0), _grads(2, 4), [None] * 4, LR, fused=True)
    _close(out["params"], expected)
    assert out["flags"] == [(False, False)]


def test_its_checkpoint_resumes_in_torch_adamw(runs: dict) -> None:
    """Two steps here, then two of torch's AdamW from this optimizer's state_dict == four of torch's."""
    out = runs["out"]["two-steps"]
    resumed, _ = _reference(out["params"], _grads(2, 4)[2:], [None, None], LR[2:], state=out["state"])
    expected, _ = _reference(_params(0), _grads(2, 4), [None] * 4, LR)
    _close(resumed, expected)
