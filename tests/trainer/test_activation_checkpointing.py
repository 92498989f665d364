"""Activation checkpointing recomputes layer activations in backward: same outputs and gradients. Also: the
DrafterSide takes its per-run settings (checkpointing, loss kernels) from the config."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.trainer.tiny import TINY_MASK_TOKEN_ID, build_tiny_target, tiny_drafter_config
from trainer.model import DFlashDrafter
from trainer.model.drafter import make_block_input_ids

torch.set_num_threads(1)


def _grads(checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    target = build_tiny_target(seed=0)
    torch.manual_seed(0)
    drafter = DFlashDrafter(
        tiny_drafter_config(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    )
    drafter.activation_checkpointing = checkpointing
    B = drafter.config.block_size
    ids = torch.randint(0, 200, (2, 14), generator=torch.Generator().manual_seed(1))
    anchors, keep = torch.tensor([[2, 8], [5, 0]]), torch.tensor([[True, True], [True, False]])
    taps = target.features(ids, torch.ones_like(ids)).taps
    block_ids = make_block_input_ids(ids, anchors, B, TINY_MASK_TOKEN_ID)
    hidden = drafter(
        taps, F.embedding(block_ids, target.embed_weight), anchors, keep, drafter.build_mask(anchors, keep, 14)
    )
    (hidden @ target.lm_head_weight.T).logsumexp(-1).sum().backward()
    return hidden.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}


def test_checkpointed_layers_give_the_same_output_and_gradients() -> None:
    out_plain, grads_plain = _grads(False)
    out_ckpt, grads_ckpt = _grads(True)
    torch.testing.assert_close(out_ckpt, out_plain, rtol=0, atol=0)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-6, atol=1e-7, msg=name)


def _losses(out, *extra: str) -> list[float]:
    import json

    from trainer import train

    assert (
        train.main(
            [
                "--preset",
                "tiny",
                "--max-steps",
                "3",
                "--log-interval",
                "1",
                "--output-dir",
                str(out),
                "--wandb",
                "off",
                *extra,
            ]
        )
        == 0
    )
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_flag_trains_the_same_losses(tmp_path) -> None:
    plain = _losses(tmp_path / "plain")
    checkpointed = _losses(tmp_path / "ckpt", "--activation-checkpointing")
    assert len(plain) == 3 and checkpointed == plain


def test_drafter_side_takes_the_setting_from_the_config() -> None:
    from trainer.core.config import parse_train_args
    from trainer.training.step import DrafterSide

    target = build_tiny_target(seed=0)
    drafter = DFlashDrafter(tiny_drafter_config(target))
    for flag, expected in (([], False), (["--activation-checkpointing"], True)):
        cfg = parse_train_args(["--preset", "tiny", "--output-dir", "/tmp/unused", *flag])
        side = DrafterSide(cfg, drafter, target.embed_weight, target.lm_head_weight, "cpu", total_steps=1)
        assert side.drafter.activation_checkpointing is expected


def test_drafter_side_picks_the_loss_kernels_from_the_config() -> None:
    from trainer.core.config import TrainerInputError, parse_train_args
    from trainer.training.step import DrafterSide

    target = build_tiny_target(seed=0)
    drafter = DFlashDrafter(tiny_drafter_config(target))
    for kind, expected in (("auto", "eager"), ("eager", "eager"), ("compiled", "compiled")):
        cfg = parse_train_args(["--preset", "tiny", "--output-dir", "/tmp/unused", "--loss-kernels", kind])
        side = DrafterSide(cfg, drafter, target.embed_weight, target.lm_head_weight, "cpu", total_steps=1)
        assert side.loss_kernels.kind == expected
    cfg = parse_train_args(["--preset", "tiny", "--output-dir", "/tmp/unused", "--loss-kernels", "triton"])
    with pytest.raises(TrainerInputError, match="--loss-kernels triton needs a CUDA drafter device"):
        DrafterSide(cfg, drafter, target.embed_weight, target.lm_head_weight, "cpu", total_steps=1)


def test_loss_kernels_auto_resolves_by_device_and_compile() -> None:
    """auto: eager for an eager drafter, compiled for a compiled one off CUDA; explicit kinds pass through.
    The CUDA branch (triton on capability >= 9.0) runs on the GPU machine (bench/results/step.md 2026-11-29 "`--loss-kernels auto` on the H200")."""
    from trainer.training.loss import resolve_loss_kernels

    cpu = torch.device("cpu")
    assert resolve_loss_kernels("auto", cpu, compiled=False) == "eager"
    assert resolve_loss_kernels("auto", cpu, compiled=True) == "compiled"
    for kind in ("eager", "compiled", "triton"):
        assert resolve_loss_kernels(kind, cpu, compiled=True) == kind


def test_loss_kernels_triton_asked_by_name_falls_back_where_no_rung_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--loss-kernels triton on a GPU whose shared memory fits no rung of the CE kernel's ladder (a ~100 KB
    Blackwell card; issue 31 item 5) runs the compiled kernels, with one line, instead of failing at the first
    launch. A GPU that small cannot be had here: `fits_device` (which compiles the ladder against the device; its
    own test rehearses the limit under the interpreter) is the one part replaced."""
    import trainer.kernels.loss_triton
    from trainer.training.loss import resolve_loss_kernels

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(trainer.kernels.loss_triton, "fits_device", lambda device: False)
    assert resolve_loss_kernels("triton", cuda, compiled=True) == "compiled"
    assert capsys.readouterr().err.splitlines() == [
        "loss kernels: the triton CE kernel does not fit cuda:0's shared memory (asked: triton); compiled"
    ]
    monkeypatch.setattr(
        trainer.kernels.loss_triton, "fits_device", lambda device: True
    )  # the control: it fits, it runs
    assert resolve_loss_kernels("triton", cuda, compiled=True) == "triton"
    assert capsys.readouterr().err == ""


def test_loss_kernels_with_soft_labels_also_need_the_ce_kl_kernel_to_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With soft labels the run's Triton loss kernel is the CE+KL kernel (trainer/kernels/loss_triton_kl.py), whose ladder
    is its own: where the CE kernel fits and the CE+KL kernel does not, auto and triton both take the compiled
    kernels with one line naming the CE+KL kernel; where both fit, triton; without soft labels the CE+KL kernel
    is never asked. As above, `fits_device` is the one part replaced (no ~100 KB GPU here)."""
    import trainer.kernels.loss_triton
    import trainer.kernels.loss_triton_kl
    from trainer.training.loss import resolve_loss_kernels

    cuda = torch.device("cuda", 0)
    asked: list[str] = []

    def ce_kl_fits(fits: bool):
        def check(device: torch.device) -> bool:
            asked.append(str(device))
            return fits

        return check

    monkeypatch.setattr(trainer.kernels.loss_triton, "fits_device", lambda device: True)
    monkeypatch.setattr(trainer.kernels.loss_triton_kl, "fits_device", ce_kl_fits(False))
    assert resolve_loss_kernels("triton", cuda, compiled=True, soft_labels=True) == "compiled"
    assert capsys.readouterr().err.splitlines() == [
        "loss kernels: the triton CE+KL kernel (soft labels) does not fit cuda:0's shared memory (asked: triton); "
        "compiled"
    ]
    assert resolve_loss_kernels("triton", cuda, compiled=True) == "triton" and asked == ["cuda:0"]  # not asked
    monkeypatch.setattr(trainer.kernels.loss_triton_kl, "fits_device", ce_kl_fits(True))  # the control: both fit
    assert resolve_loss_kernels("triton", cuda, compiled=True, soft_labels=True) == "triton"
    assert capsys.readouterr().err == ""
