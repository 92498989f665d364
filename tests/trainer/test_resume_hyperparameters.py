"""A resume trains with this run's --lr, --weight-decay and schedule length (trainer.training.step.apply_run_hyperparameters),
not the checkpoint's: torch's loads restore the saved run's (LambdaLR.load_state_dict its base_lrs, the optimizer's
its groups' lr and weight_decay), so `restart R -- --lr 1e-3` used to train on at R's LR while the lineage diff
showed the new one. The controls below show torch's loads alone keeping the old values."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.tiny import tiny_train_config
from trainer.pipeline_run import run_pipeline
from trainer.train import EXIT_OK
from trainer.train import run as run_single
from trainer.training.step import apply_run_hyperparameters, load_optimizer_state, lr_factor

pytestmark = pytest.mark.timeout(180)

SAVED_LR, SAVED_DECAY, SAVED_TOTAL = 1e-2, 0.1, 10
WARMUP = 0.2


def _optimizer(lr: float, weight_decay: float, total: int) -> tuple[torch.optim.AdamW, Any]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total, WARMUP))
    return optimizer, scheduler


def _saved_after(steps: int) -> tuple[dict, dict, torch.optim.AdamW]:
    optimizer, scheduler = _optimizer(SAVED_LR, SAVED_DECAY, SAVED_TOTAL)
    for step in range(steps):
        for param in (p for group in optimizer.param_groups for p in group["params"]):
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        optimizer.step()
        scheduler.step()
    return copy.deepcopy(optimizer.state_dict()), copy.deepcopy(scheduler.state_dict()), optimizer


def _resumed(lr: float, weight_decay: float, total: int, apply: bool) -> tuple[torch.optim.AdamW, Any]:
    optimizer_state, scheduler_state, _ = _saved_after(3)
    optimizer, scheduler = _optimizer(lr, weight_decay, total)
    load_optimizer_state(optimizer, optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    if apply:
        apply_run_hyperparameters(optimizer, scheduler, lr, weight_decay)
    return optimizer, scheduler


def test_a_resume_takes_this_runs_lr_weight_decay_and_schedule_length() -> None:
    optimizer, scheduler = _resumed(1e-3, 0.0, 20, apply=True)
    group = optimizer.param_groups[0]
    assert group["lr"] == 1e-3 * lr_factor(3, 20, WARMUP) and scheduler.get_last_lr() == [group["lr"]]
    assert group["weight_decay"] == 0.0 and group["initial_lr"] == 1e-3
    for param in group["params"]:
        param.grad = torch.ones_like(param)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 1e-3 * lr_factor(4, 20, WARMUP)
    # the moments are still the checkpoint's: only the hyperparameters are this run's
    assert float(optimizer.state[group["params"][0]]["step"]) == 4.0

    control, control_scheduler = _resumed(1e-3, 0.0, 20, apply=False)  # torch's loads alone
    assert control.param_groups[0]["weight_decay"] == SAVED_DECAY
    control.step()
    control_scheduler.step()
    assert control.param_groups[0]["lr"] == SAVED_LR * lr_factor(4, 20, WARMUP)  # the old peak LR goes on


def test_an_unchanged_resume_keeps_the_saved_lr_bit_for_bit() -> None:
    optimizer_state, scheduler_state, saved = _saved_after(3)
    optimizer, scheduler = _resumed(SAVED_LR, SAVED_DECAY, SAVED_TOTAL, apply=True)
    assert optimizer.param_groups[0]["lr"] == saved.param_groups[0]["lr"]  # the same float product
    assert scheduler.state_dict()["base_lrs"] == scheduler_state["base_lrs"]
    assert optimizer.param_groups[0]["weight_decay"] == optimizer_state["param_groups"][0]["weight_decay"]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", ["single", "pipeline"])
def test_restart_with_another_lr_trains_at_it_and_says_so(
    tmp_path: Path, engine: str, capfd: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    run = run_pipeline if engine == "pipeline" else run_single
    extra = ("--pipeline",) if engine == "pipeline" else ()
    out = tmp_path / "run"
    first = tiny_train_config(out, *extra, "--max-steps", "3", "--save-interval", "3", "--lr", "3e-3")
    assert run(first) == EXIT_OK
    capfd.readouterr()
    resumed = tiny_train_config(
        out, *extra, "--max-steps", "6", "--lr", "1e-3", "--weight-decay", "0.05", "--resume", "auto"
    )
    assert run(resumed) == EXIT_OK
    err = capfd.readouterr().err
    line = next((ln for ln in err.splitlines() if "learning-rate schedule is recomputed" in ln), None)
    assert line is not None, err[-3000:]
    assert "--lr 0.001 (the checkpoint's run had 0.003)" in line
    assert "--weight-decay 0.05 (the checkpoint's run had 0)" in line and "--max-steps 6" in line
    by_step = {m["step"]: m for m in _lines(out)}
    warmup = resumed.warmup_ratio
    for step in (4, 5, 6):  # metrics' step N is the N-th optimizer step, which ran at schedule index N - 1
        assert by_step[step]["lr"] == pytest.approx(1e-3 * lr_factor(step - 1, 6, warmup), rel=1e-12), step
    assert by_step[3]["lr"] == pytest.approx(3e-3 * lr_factor(2, 3, warmup), rel=1e-12)  # before the resume
