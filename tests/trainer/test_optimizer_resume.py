"""A resumed optimizer keeps this run's kernel settings (trainer.training.step.load_optimizer_state) and takes everything
else from the checkpoint. torch's own load_state_dict takes the saved groups whole: the controls below show it
carrying `fused` across, which is what made a CPU checkpoint resume on the GPU with the foreach path."""

from __future__ import annotations

import copy

import pytest
import torch

from trainer.training.step import OPTIMIZER_IMPLEMENTATION_KEYS, load_optimizer_state


def _trained(fused: bool | None, steps: int = 2) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
    for step in range(steps):
        for index, param in enumerate(params):
            param.grad = torch.full_like(param, 0.1 * (step + 1) + index)
        optimizer.step()
    return params, optimizer


def _settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{key: group.get(key) for key in OPTIMIZER_IMPLEMENTATION_KEYS} for group in optimizer.param_groups]


@pytest.mark.parametrize(("saved_fused", "resumed_fused"), [(True, None), (None, True)])
def test_resume_keeps_this_runs_kernel_and_the_checkpoints_state(saved_fused, resumed_fused) -> None:
    params, saved = _trained(saved_fused)
    state = copy.deepcopy(saved.state_dict())  # as from a checkpoint file: no tensor shared with `saved`
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = torch.optim.AdamW(fresh, lr=1e-3, weight_decay=0.0, fused=resumed_fused)
    wanted = _settings(resumed)

    load_optimizer_state(resumed, state)

    assert _settings(resumed) == wanted
    assert resumed.param_groups[0]["lr"] == 1e-2 and resumed.param_groups[0]["weight_decay"] == 0.1  # saved
    for before, after in zip(params, fresh):
        kept, loaded = saved.state[before], resumed.state[after]
        assert float(loaded["step"]) == 2.0 and loaded["step"].dtype == torch.float32
        assert torch.equal(loaded["exp_avg"], kept["exp_avg"]) and torch.equal(loaded["exp_avg_sq"], kept["exp_avg_sq"])
    # the next step runs on this run's kernel and lands where the saved optimizer's own next step does (the
    # fused and the for-loop CPU kernels agree to a few ulps, not bitwise)
    for index, (a, b) in enumerate(zip(params, fresh)):
        a.grad, b.grad = torch.full_like(a, 0.3 + index), torch.full_like(b, 0.3 + index)
    saved.step()
    resumed.step()
    for a, b in zip(params, fresh):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    assert state["param_groups"][0].get("fused") == saved_fused  # the checkpoint's own dict is left as it was

    control = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3, fused=resumed_fused)
    control.load_state_dict(state)
    assert _settings(control) != wanted  # torch alone takes the saved kernel settings


def test_a_state_with_another_number_of_groups_is_refused_by_torch() -> None:
    _, saved = _trained(None)
    other = torch.optim.AdamW(
        [{"params": [torch.nn.Parameter(torch.zeros(2))]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}]
    )
    with pytest.raises(ValueError, match="different number of parameter groups"):
        load_optimizer_state(other, saved.state_dict())
