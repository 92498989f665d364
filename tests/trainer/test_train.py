"""`python -m trainer train` end to end on CPU with the tiny preset: the run-directory contract, bad inputs
(clear error, exit 2, nothing written), gradient accumulation, and SIGTERM + resume reproducing the
uninterrupted run bitwise."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from trainer.__main__ import main as trainer_main
from trainer.core.config import parse_train_args
from trainer.data.batches import collate, open_dataset
from trainer.data.shards import DatasetMeta, write_index, write_shard
from trainer.model import DFlashDrafter, TargetModel
from trainer.training.loss import position_weights
from trainer.training.preflight import build_drafter_config, target_shape
from trainer.training.preflight import target_hf_config as _target_hf_config
from trainer.training.step import DrafterSide, TargetSide, lr_factor, noise_std_at

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--preset",
    "tiny",
    "--synthetic-samples",
    "48",
    "--max-seq-len",
    "32",
    "--token-budget",
    "128",
    "--wandb",
    "off",
]


def _read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_short_run_follows_the_run_directory_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code = trainer_main(
        [
            "train",
            *SMALL,
            "--max-steps",
            "4",
            "--log-interval",
            "2",
            "--save-interval",
            "3",
            "--output-dir",
            str(run),
            "--wandb",
            "on",
        ]
    )
    assert code == 0
    metrics = _read_metrics(run)
    assert [m["step"] for m in metrics] == [2, 4]
    for key in ("epoch", "loss", "ce", "acc_slot", "tau_sim", "lr", "grad_norm", "block_tok_s", "ctx_tok_s", "eta_s"):
        assert key in metrics[-1], key
    assert len(metrics[-1]["acc_slot"]) == 7 and metrics[-1]["tau_sim"] >= 1.0
    status = json.loads((run / "status.json").read_text())
    assert (status["phase"], status["step"], status["total_steps"], status["exit_code"]) == ("done", 4, 4, 0)
    assert status["error"] is None and status["heartbeat"] >= status["started_at"]
    assert status["last_checkpoint"].endswith("checkpoints/step_000004")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    names = load_file(str(run / "checkpoints/step_000004/model.safetensors"))
    assert len(names) == 25 and "fc.weight" in names  # public names, 2 layers
    out, err = capsys.readouterr()
    if importlib.util.find_spec("wandb") is None:  # optional: a warning, never a failure
        assert "wandb is not installed; continuing without it" in err
    assert "step 4/4" in out and "tau_sim" in out and "block tok/s" in out and "eta" in out
    assert "drafter attention: cpu dense (--attention-kernel flex)" in err  # the CPU's dense mask, whatever the flag


def _bad_shard_dir(tmp_path: Path) -> Path:
    data = tmp_path / "bad-shard"
    entry = write_shard(data, "shard-00000", [(np.arange(20) % 200, np.ones(20))])
    write_index(data, [entry], DatasetMeta(vocab_size=256))
    np.save(data / "shard-00000.mask.npy", np.ones(5, np.uint8))
    return data


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data-dir", "{tmp}/missing"], "does not exist"),
        (["--data-dir", "{tmp}/empty"], "meta.json is missing"),
        (["--data-dir", "{bad_shard}"], "must agree"),
        (["--block-size", "1"], "--block-size"),
        (["--gamma", "0"], "--gamma"),
        (["--max-anchors", "0"], "--max-anchors"),
        (["--anchors-per-seq", "0"], "--anchors-per-seq"),
        (["--token-budget", "16"], "smaller than one sequence"),
        (["--num-draft-layers", "3"], "cannot tap 3 distinct layers"),
        (["--target-layer-ids", "0,5"], "no layer [5]"),
        (["--mask-token-id", "300"], "outside the vocabulary"),
        (["--hidden-size", "32"], "drafter hidden size 32 != target hidden size 64"),
        (["--target-model", "{tmp}/no-model"], "not a model directory"),
        (["--grad-accum", "1000"], "fewer than one optimizer step"),
        (["--resume", "{tmp}/empty"], "not a complete checkpoint"),
        (["--init-from", "{tmp}/empty"], "has no model.safetensors"),
        (["--loss-kernels", "triton"], "needs a CUDA drafter device"),  # this machine has no GPU: cpu is chosen
        (["--adamw", "triton"], "--adamw triton needs a CUDA drafter device"),
        (["--drafter-init", "zeros"], "--drafter-init: invalid choice: 'zeros' (choose from 'random', 'target')"),
        (["--drafter-init", "target"], "the deepest tap is layer 1 of 2, so the target has 0 layer(s) after it"),
        (["--drafter-init", "target", "--init-from", "{tmp}/empty"], "target and --init-from both set"),
        (["--drafter-init", "target", "--output-norm-init", "calibrated"], "--output-norm-init calibrated would"),
        (
            ["--drafter-init", "target", "--num-draft-layers", "1", "--target-layer-ids", "0", "--head-dim", "8"],
            "the drafter's --head-dim is 8, the target's layers have 16",
        ),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    (tmp_path / "empty").mkdir()
    bad_shard = _bad_shard_dir(tmp_path) if "{bad_shard}" in flags else None
    flags = [f.format(tmp=tmp_path, bad_shard=bad_shard) for f in flags]
    run = tmp_path / "run"
    code = trainer_main(["train", *SMALL, "--max-steps", "2", "--output-dir", str(run), *flags])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and message in err.splitlines()[0]
    assert not run.exists()


def test_an_unknown_flag_names_the_closest_one(tmp_path: Path) -> None:
    """`python -m trainer train --lrr 1`, typed as a user would: one error line, the flag it was close to."""
    run = tmp_path / "run"
    typed = [sys.executable, "-m", "trainer", "train", "--preset", "tiny", "--output-dir", str(run)]
    out = subprocess.run([*typed, "--lrr", "1"], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "") and not run.exists()
    assert out.stderr == (
        "error: unrecognized arguments: --lrr 1\n"
        "hint: did you mean --lr? (`python -m trainer train --help` lists every flag)\n"
    )
    out = subprocess.run([*typed, "--qqqqqq"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.endswith("\nhint: `python -m trainer train --help` lists every flag\n")


def test_a_log_gets_no_progress_bars(tmp_path: Path) -> None:
    """`python -m trainer train --target-model DIR > train.log 2>&1`, as a launched run writes its log: the
    target's load draws no tqdm bar (carriage-return redraws, one garbled line in a log)."""
    from tests.trainer.tiny import build_tiny_target

    build_tiny_target().model.save_pretrained(tmp_path / "target")
    log = tmp_path / "train.log"
    typed = [sys.executable, "-m", "trainer", "train", *SMALL, "--max-steps", "1", "--output-dir", str(tmp_path / "r")]
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    with log.open("w") as out:
        done = subprocess.run(
            [*typed, "--target-model", str(tmp_path / "target")], stdout=out, stderr=subprocess.STDOUT, env=env,
            timeout=300,
        )  # fmt: skip
    text = log.read_text()
    assert done.returncode == 0, text
    assert "step 1/1" in text and "\r" not in text and "Loading weights" not in text


def test_resume_with_a_different_shape_is_refused_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert trainer_main(["train", *SMALL, "--max-steps", "2", "--output-dir", str(run)]) == 0
    before = _snapshot(run)
    code = trainer_main(["train", *SMALL, "--max-steps", "4", "--output-dir", str(run), "--num-draft-layers", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "different drafter shape" in err and "hint: " in err
    assert _snapshot(run) == before


@pytest.mark.parametrize(
    "flags",
    [[], ["--num-draft-layers", "2", "--target-layer-ids", "0,1"], ["--arch", "dflash2", "--num-attention-heads", "2"]],
)
def test_the_tiny_targets_values_give_the_drafter_config_of_its_hf_config(tmp_path: Path, flags: list[str]) -> None:
    """The pre-flight reads the tiny target's shape from the preset (no transformers import); the run builds the
    Qwen3Config. Both must give one drafter config: a field the preset left to Qwen3Config's defaults would not."""
    cfg = parse_train_args(["--preset", "tiny", "--output-dir", str(tmp_path), *flags])
    shape = target_shape(cfg)
    assert not hasattr(shape, "to_dict")  # the namespace, not a transformers config
    assert build_drafter_config(cfg, shape) == build_drafter_config(cfg, _target_hf_config(cfg))


def test_gradient_accumulation_normalises_over_the_whole_step(tmp_path: Path) -> None:
    """Two micro-batches with the step-wide normaliser give the gradient of the combined batch."""
    cfg = parse_train_args([*SMALL, "--output-dir", str(tmp_path), "--max-anchors", "64", "--cap-lambda", "0.3"])
    hf = _target_hf_config(cfg)
    dcfg = build_drafter_config(cfg, hf)
    target = TargetModel.from_config(hf, dcfg.target_layer_ids, seed=0)
    dataset, slot_w = open_dataset(cfg), position_weights(cfg.block_size, cfg.gamma).numpy()
    both = collate(dataset, np.array([3, 8]), 0, 0, cfg, slot_w)
    parts = [collate(dataset, np.array([i]), 0, 0, cfg, slot_w) for i in (3, 8)]
    assert torch.equal(torch.cat([p.anchors[:1] for p in parts]), both.anchors[:2])  # same anchors either way
    grads = []
    for micro in ([both], parts):
        torch.manual_seed(0)
        side = DrafterSide(cfg, DFlashDrafter(dcfg), target.embed_weight, target.lm_head_weight, "cpu", 10)
        features = TargetSide(target, "cpu")
        normalizer, blocks = sum(b.weight_sum for b in micro), float(sum(b.num_blocks for b in micro))
        for batch in micro:
            side.forward_backward(features.features(batch), normalizer, blocks)
        grads.append({n: p.grad.clone() for n, p in side.drafter.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lm_head_dtype_bfloat16_runs_the_losss_head_in_bf16_to_nearly_the_same_gradient(tmp_path: Path) -> None:
    """--lm-head-dtype bfloat16 on the CPU: the loss's GEMMs read a bf16 copy of the target's fp32 head (the
    target's own stays fp32); the drafter's gradient moves by bf16's rounding, not more."""
    grads, heads = {}, {}
    for dtype in ("auto", "bfloat16"):
        cfg = parse_train_args([*SMALL, "--output-dir", str(tmp_path), "--lm-head-dtype", dtype])
        hf = _target_hf_config(cfg)
        dcfg = build_drafter_config(cfg, hf)
        target = TargetModel.from_config(hf, dcfg.target_layer_ids, seed=0)
        batch = collate(
            open_dataset(cfg), np.array([1, 2]), 0, 0, cfg, position_weights(cfg.block_size, cfg.gamma).numpy()
        )
        torch.manual_seed(0)
        side = DrafterSide(cfg, DFlashDrafter(dcfg), target.embed_weight, target.lm_head_weight, "cpu", 10)
        side.forward_backward(TargetSide(target, "cpu").features(batch), batch.weight_sum, batch.num_blocks)
        heads[dtype] = side.lm_head_weight.dtype, target.lm_head_weight.dtype
        grads[dtype] = torch.cat([p.grad.flatten() for p in side.drafter.parameters() if p.grad is not None])
    assert heads == {"auto": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.float32)}
    assert not torch.equal(grads["auto"], grads["bfloat16"])  # the bf16 GEMMs ran
    cosine = torch.nn.functional.cosine_similarity(grads["auto"], grads["bfloat16"], dim=0)
    assert cosine > 0.999, float(cosine)


@pytest.mark.parametrize("grad_clip", ["0.05", "0"])
def test_fused_adamw_clips_inside_its_kernel_like_clip_grad_norm(tmp_path: Path, grad_clip: str) -> None:
    """--adamw fused clips through the kernel's grad_scale; --adamw foreach through clip_grad_norm_. With a clip
    small enough to act (and with none) both report the same norm and move the parameters the same way."""
    sides = {}
    for adamw in ("fused", "foreach"):
        args = [*SMALL, "--output-dir", str(tmp_path), "--adamw", adamw, "--grad-clip", grad_clip]
        cfg = parse_train_args(args)
        hf = _target_hf_config(cfg)
        dcfg = build_drafter_config(cfg, hf)
        target = TargetModel.from_config(hf, dcfg.target_layer_ids, seed=0)
        slot_w = position_weights(cfg.block_size, cfg.gamma).numpy()
        batch = collate(open_dataset(cfg), np.array([1, 2]), 0, 0, cfg, slot_w)
        features = TargetSide(target, "cpu").features(batch)
        torch.manual_seed(0)
        side = DrafterSide(cfg, DFlashDrafter(dcfg), target.embed_weight, target.lm_head_weight, "cpu", 10)
        norms = []
        for _ in range(2):
            side.forward_backward(features, batch.weight_sum, batch.num_blocks)
            norms.append(float(side.optimizer_step()[1]))
        sides[adamw] = side, norms
    (fused, fused_norms), (reference, reference_norms) = sides["fused"], sides["foreach"]
    assert fused_norms == pytest.approx(reference_norms, rel=1e-5)
    if grad_clip != "0":
        assert min(fused_norms) > 0.05  # the clip acted in both steps
    for (name, p), q in zip(fused.drafter.named_parameters(), reference.drafter.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_every_objective_term_and_accumulation_run_end_to_end(tmp_path: Path) -> None:
    run = tmp_path / "run"
    code = trainer_main(
        [
            "train",
            *SMALL,
            "--max-steps",
            "2",
            "--log-interval",
            "1",
            "--output-dir",
            str(run),
            "--use-soft-labels",
            "--kl-weight",
            "0.5",
            "--kl-temperature",
            "2",
            "--cap-lambda",
            "0.2",
            "--noise-start",
            "0.05",
            "--noise-end",
            "0.01",
            "--noise-type",
            "gaussian",
            "--grad-accum",
            "2",
        ]
    )
    assert code == 0
    last = _read_metrics(run)[-1]
    assert last["kl"] > 0 and last["cap"] > 0 and last["noise_std"] == pytest.approx(0.01)
    assert all(np.isfinite([m["loss"] for m in _read_metrics(run)]))


def test_schedule_and_noise_are_deterministic_functions_of_the_step(tmp_path: Path) -> None:
    assert [round(lr_factor(s, 100, 0.1), 4) for s in (0, 4, 9, 10, 55, 100)] == [0.1, 0.5, 1.0, 1.0, 0.5, 0.0]
    assert (noise_std_at(0, 11, 0.2, 0.0), noise_std_at(10, 11, 0.2, 0.0)) == (0.2, 0.0)
    cfg = parse_train_args([*SMALL, "--output-dir", str(tmp_path)])
    hf = _target_hf_config(cfg)
    dcfg = build_drafter_config(cfg, hf)
    target = TargetModel.from_config(hf, dcfg.target_layer_ids, seed=0)
    batch = collate(open_dataset(cfg), np.array([1, 2]), 0, 0, cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    features = TargetSide(target, "cpu").features(batch)
    torch.manual_seed(0)
    side = DrafterSide(cfg, DFlashDrafter(dcfg), target.embed_weight, target.lm_head_weight, "cpu", 10)
    losses = [
        float(side.forward_backward(features, batch.weight_sum, batch.num_blocks, noise_std=std, noise_seed=seed).loss)
        for std, seed in ((0.0, (0,)), (0.5, (0, 1, 0)), (0.5, (0, 1, 0)), (0.5, (0, 2, 0)))
    ]
    assert losses[1] == losses[2] and len({losses[0], losses[1], losses[3]}) == 3


def _train_process(run: Path, steps: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    argv = [
        sys.executable,
        "-m",
        "trainer",
        "train",
        *SMALL,
        "--max-steps",
        str(steps),
        "--log-interval",
        "1",
        "--save-interval",
        "1000",
        "--output-dir",
        str(run),
    ]
    log = open(run.parent / f"{run.name}.log", "ab")  # noqa: SIM115 - the child's stdout, for its lifetime
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def test_sigterm_then_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path: Path) -> None:
    steps = 24
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    full.mkdir(), interrupted.mkdir()
    reference, victim = _train_process(full, steps), _train_process(interrupted, steps)
    kill_after = random.Random().randint(2, 10)
    deadline = time.monotonic() + 120
    metrics = interrupted / "metrics.jsonl"
    while time.monotonic() < deadline and victim.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.02)
    victim.send_signal(signal.SIGTERM)
    assert victim.wait(timeout=120) == 143, (interrupted.parent / "interrupted.log").read_text()[-2000:]
    status = json.loads((interrupted / "status.json").read_text())
    stopped_at = status["step"]
    assert status["phase"] == "stopped" and status["exit_code"] == 143 and kill_after <= stopped_at < steps
    assert status["last_checkpoint"].endswith(f"step_{stopped_at:06d}")

    resumed = _train_process(interrupted, steps)
    assert resumed.wait(timeout=180) == 0, (interrupted.parent / "interrupted.log").read_text()[-2000:]
    assert reference.wait(timeout=180) == 0, (full.parent / "full.log").read_text()[-2000:]
    losses = [(m["step"], m["loss"], m["tau_sim"]) for m in _read_metrics(interrupted)]
    assert losses == [(m["step"], m["loss"], m["tau_sim"]) for m in _read_metrics(full)]
    assert [s for s, _, _ in losses] == list(range(1, steps + 1))
    final_a = load_file(str(full / f"checkpoints/step_{steps:06d}/model.safetensors"))
    final_b = load_file(str(interrupted / f"checkpoints/step_{steps:06d}/model.safetensors"))
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)
    assert json.loads((interrupted / "status.json").read_text())["phase"] == "done"


def test_resume_after_a_hard_kill_redoes_the_steps_after_the_last_checkpoint(tmp_path: Path) -> None:
    """A SIGKILL leaves metrics lines past the last periodic checkpoint: resume drops and recomputes them."""
    run = tmp_path / "run"
    argv = [
        "train",
        *SMALL,
        "--max-steps",
        "6",
        "--log-interval",
        "1",
        "--save-interval",
        "4",
        "--output-dir",
        str(run),
    ]
    assert trainer_main(argv) == 0
    reference = _read_metrics(run)
    shutil.rmtree(run / "checkpoints" / "step_000006")  # as if killed after step 6 was logged, before its save
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 7, "lo')  # and a torn last line
    assert trainer_main(argv) == 0
    assert [(m["step"], m["loss"]) for m in _read_metrics(run)] == [(m["step"], m["loss"]) for m in reference]


def test_a_checkpoint_that_cannot_be_written_fails_the_run_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory\n")  # a real fault: the write fails on the writer thread
    code = trainer_main(
        ["train", *SMALL, "--max-steps", "6", "--log-interval", "1", "--save-interval", "2", "--output-dir", str(run)]
    )
    assert code == 1
    status = json.loads((run / "status.json").read_text())
    assert status["phase"] == "failed" and status["step"] <= 4  # noticed at the latest by the next save
    assert "CheckpointWriteError: writing checkpoint step_000002 failed: FileExistsError" in status["error"]
    assert "writing checkpoint step_000002 failed" in capsys.readouterr().err


def test_init_from_an_exported_drafter_checks_its_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_train_args([*SMALL, "--output-dir", str(tmp_path)])
    DFlashDrafter(build_drafter_config(cfg, _target_hf_config(cfg))).save_pretrained(tmp_path / "export")
    base = ["train", *SMALL, "--max-steps", "1", "--init-from", str(tmp_path / "export")]
    assert trainer_main([*base, "--output-dir", str(tmp_path / "ok")]) == 0
    code = trainer_main(
        [*base, "--output-dir", str(tmp_path / "bad"), "--num-draft-layers", "1", "--target-layer-ids", "1"]
    )
    assert code == 2 and "different drafter shape" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_trainer_verbs_dispatch_lazily(capsys: pytest.CaptureFixture[str]) -> None:
    assert trainer_main(["nonsense"]) == 2
    assert "unknown verb" in capsys.readouterr().err
    assert trainer_main([]) == 2 and "train" in capsys.readouterr().out


@pytest.mark.slow
def test_tiny_preset_200_steps_learns(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert (
        trainer_main(["train", "--preset", "tiny", "--max-steps", "200", "--wandb", "off", "--output-dir", str(run)])
        == 0
    )
    metrics = _read_metrics(run)
    first, last = metrics[:3], metrics[-3:]
    assert sum(m["loss"] for m in last) / 3 < sum(m["loss"] for m in first) / 3 - 0.5
    assert sum(m["tau_sim"] for m in last) / 3 > sum(m["tau_sim"] for m in first) / 3 + 0.5
    assert json.loads((run / "status.json").read_text())["phase"] == "done"


def test_the_limit_that_ends_the_run_is_said_when_it_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 46 item 4: `--max-steps 5000` on the tiny preset trained 3200 steps (its `epochs` cap it) and nothing
    said so. The start's log line and status.json's `step_limit` (which `dflashops status` shows by the eta) name
    the limit that binds, either way."""
    capped = tmp_path / "capped"
    assert trainer_main(["train", *SMALL, "--epochs", "1", "--max-steps", "5000", "--output-dir", str(capped)]) == 0
    status = json.loads((capped / "status.json").read_text())
    total = status["total_steps"]
    assert total < 5000 and status["step_limit"] == "epochs" and status["step"] == total
    _, err = capsys.readouterr()
    assert (
        f"{total} steps: --epochs 1 ends the run (the data gives {total} optimizer steps over 1 epoch; "
        "--max-steps 5000 is never reached: raise --epochs to reach it)" in err
    ), err
    short = tmp_path / "short"
    assert trainer_main(["train", *SMALL, "--max-steps", "2", "--output-dir", str(short)]) == 0
    assert json.loads((short / "status.json").read_text())["step_limit"] == "max_steps"
    assert "2 steps: --max-steps 2 ends the run (before --epochs 50)" in capsys.readouterr().err
