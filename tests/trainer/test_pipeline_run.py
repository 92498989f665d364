"""The threaded pipeline end to end on the CPU with the tiny preset: several target and drafter threads.

Real threads, real tiny Qwen3 target, real drafter, real checkpoints; failures are injected through the
pipeline's fault points (a raise or a hang at a named place in a named worker), everything else is real.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.tiny import tiny_train_config
from trainer.core.config import TrainerInputError, parse_train_args
from trainer.pipeline.replica_sync import max_replica_difference
from trainer.pipeline_run import PipelineOptions, run_pipeline
from trainer.train import EXIT_FAILED, EXIT_OK
from trainer.train import run as run_single

pytestmark = pytest.mark.timeout(120)


def _cfg(out: Path, *extra: str):
    return tiny_train_config(out, *extra)


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    newest = sorted((out / "checkpoints").glob("step_*"))[-1]
    return load_file(str(newest / "model.safetensors"))


def test_grad_sync_keeps_replicas_bitwise_identical_and_matches_one_drafter(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    seen: list[float] = []
    options = PipelineOptions(
        on_step=lambda step, sides: seen.append(max_replica_difference([s.drafter for s in sides])), checksum_interval=2
    )
    pipe = tmp_path / "pipe"
    code = run_pipeline(
        _cfg(pipe, "--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--sync", "grad", "--max-steps", "6"),
        options,
    )
    assert code == EXIT_OK
    assert seen == [0.0] * 6  # bitwise identical after every optimizer step
    single = tmp_path / "single"  # one drafter, the two micro-batches of each step accumulated
    assert run_single(_cfg(single, "--grad-accum", "2", "--max-steps", "6")) == EXIT_OK
    pipe_losses = [m["loss"] for m in _metrics(pipe)]
    single_losses = [m["loss"] for m in _metrics(single)]
    assert len(pipe_losses) == 6 and pipe_losses[-1] < pipe_losses[0]
    assert pipe_losses == pytest.approx(single_losses, rel=1e-5, abs=1e-6)
    for name, tensor in _final_weights(single).items():
        torch.testing.assert_close(_final_weights(pipe)[name], tensor, rtol=1e-5, atol=1e-6)
    checked = [m for m in _metrics(pipe) if "replica_checksums" in m]
    assert [m["step"] for m in checked] == [2, 4, 6]
    assert all(len(set(m["replica_checksums"])) == 1 for m in checked)
    record = _metrics(pipe)[-1]
    assert len(record["block_tok_s_per_drafter"]) == 2
    assert set(record["queues"]) == {"target0->drafter0", "target1->drafter1"}
    assert set(record["micro_batches_s_per_target"]) == {"target0", "target1"}


def test_two_drafters_extend_the_epochs_the_preflight_counted_for_one(tmp_path: Path) -> None:
    """The pre-flight counts the epochs one drafter's --max-steps reaches; two drafters read twice the micro-batches
    a step, so the engine counts further epochs instead of ending the run early."""
    torch.set_num_threads(1)
    out = tmp_path / "two"
    flags = ("--drafter-gpus", "cpu,cpu", "--epochs", "1000000", "--max-steps", "5", "--synthetic-samples", "8")
    assert run_pipeline(_cfg(out, "--target-gpus", "cpu", *flags), PipelineOptions()) == EXIT_OK
    assert [m["step"] for m in _metrics(out)] == [1, 2, 3, 4, 5]
    assert _status(out)["step_limit"] == "max_steps"
    epochs = tmp_path / "epochs"  # no --max-steps: every epoch is counted, and the epochs end the run
    flags = ("--drafter-gpus", "cpu,cpu", "--epochs", "2", "--synthetic-samples", "8")
    assert run_pipeline(_cfg(epochs, "--target-gpus", "cpu", *flags), PipelineOptions()) == EXIT_OK
    assert _status(epochs)["step_limit"] == "epochs"


def test_replicas_that_drift_apart_under_grad_sync_fail_the_run(tmp_path: Path, capfd) -> None:
    torch.set_num_threads(1)

    nudged: list[str] = []

    def nudge(step: int, sides) -> None:  # a fault that cannot happen for real: one replica changes by itself
        if step == 3:
            name, param = next((n, p) for n, p in sides[1].drafter.named_parameters() if p.requires_grad)
            with torch.no_grad():
                param.view(-1)[0] += 1e-3
            nudged.append(name)

    out = tmp_path / "drift"
    code = run_pipeline(
        _cfg(out, "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--sync", "grad", "--max-steps", "6"),
        PipelineOptions(on_step=nudge, checksum_interval=3),
    )
    assert code == EXIT_FAILED
    error = _status(out)["error"]
    assert "replicas differ at step 3 under --sync grad" in error
    assert f"first differing: {nudged[0]} (replica 1, max |diff| 0.001, 1 of " in error
    assert "(different)" in capfd.readouterr().err


def test_average_sync_with_one_target_feeding_two_drafters(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    seen: list[float] = []
    options = PipelineOptions(
        on_step=lambda step, sides: seen.append(max_replica_difference([s.drafter for s in sides]))
    )
    out = tmp_path / "avg"
    code = run_pipeline(
        _cfg(
            out,
            "--target-gpus",
            "cpu",
            "--drafter-gpus",
            "cpu,cpu",
            "--sync",
            "average",
            "--sync-interval",
            "2",
            "--max-steps",
            "4",
        ),
        options,
    )
    assert code == EXIT_OK
    assert seen[0] > 0 and seen[1] == 0.0 and seen[2] > 0 and seen[3] == 0.0  # averaged every 2nd step
    state = torch.load(sorted((out / "checkpoints").glob("step_*"))[-1] / "optimizer.pt", weights_only=False)
    assert len(state["pipeline_replicas"]) == 1  # the second replica's own AdamW state


@pytest.mark.parametrize(
    "fault, worker",
    [
        ("target1.features@2", "target1"),
        ("drafter1.forward_backward@2", "drafter1"),
        ("target0.put@2", "target0"),
        ("drafter0.get@3", "drafter0"),
    ],
)
def test_an_error_in_any_worker_ends_the_run_with_its_traceback(tmp_path: Path, capfd, fault: str, worker: str) -> None:
    torch.set_num_threads(1)
    started = time.monotonic()
    code = run_pipeline(
        _cfg(tmp_path, "--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "50"),
        PipelineOptions(faults=[fault], join_timeout_s=10),
    )
    assert code == EXIT_FAILED
    assert time.monotonic() - started < 30
    err = capfd.readouterr().err
    assert f"worker {worker} failed: InjectedFault" in err
    assert f"--- traceback of {worker} ---" in err and "faults.hit" in err
    status = _status(tmp_path)
    assert status["phase"] == "failed" and worker in status["error"]


def test_a_hung_target_is_reported_as_a_stall_that_names_the_starving_side(tmp_path: Path, capfd) -> None:
    torch.set_num_threads(1)
    started = time.monotonic()
    code = run_pipeline(
        _cfg(tmp_path, "--target-gpus", "cpu", "--drafter-gpus", "cpu", "--pipeline", "--max-steps", "50"),
        PipelineOptions(faults=["target0.features@3=hang"], stall_warn_s=0.5, stall_abort_s=1.5, join_timeout_s=10),
    )
    assert code == EXIT_FAILED
    assert time.monotonic() - started < 30
    err = capfd.readouterr().err
    assert "PipelineStalled" in err and "drafters starve: drafter0 wait for features" in err
    assert "warning: step stalled" in err
    assert "target0 (target): target forward" in err


def test_sigterm_mid_run_checkpoints_and_resume_reproduces_the_uninterrupted_run(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    args = ("--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "8")

    def terminate_at_3(step: int, sides) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal; GracefulStop handles it in this (main) thread

    stopped = tmp_path / "stopped"
    assert run_pipeline(_cfg(stopped, *args), PipelineOptions(on_step=terminate_at_3)) == 128 + signal.SIGTERM
    status = _status(stopped)
    assert status["phase"] == "stopped" and status["step"] == 3
    state = json.loads((stopped / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["pipeline"]["next_micro_batch"] == 6 and state["pipeline"]["target_next_micro_batch"] == {
        "target0": 6,
        "target1": 7,
    }
    assert run_pipeline(_cfg(stopped, *args)) == EXIT_OK  # --resume auto
    reference = tmp_path / "reference"
    assert run_pipeline(_cfg(reference, *args)) == EXIT_OK
    assert [m["loss"] for m in _metrics(stopped)] == [m["loss"] for m in _metrics(reference)]
    for name, tensor in _final_weights(reference).items():
        assert torch.equal(_final_weights(stopped)[name], tensor), name


def test_a_missing_gpu_is_bad_input_and_writes_nothing(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA device 7")
    out = tmp_path / "never"
    with pytest.raises(TrainerInputError, match="--drafter-gpus: cuda:7 does not exist"):
        run_pipeline(_cfg(out, "--target-gpus", "cpu", "--drafter-gpus", "cpu,7"))
    assert not out.exists()


def test_sigterm_from_outside_stops_the_cli_run_with_a_checkpoint_that_resumes(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "cli"
    argv = [
        sys.executable,
        "-m",
        "trainer",
        "train",
        "--preset",
        "tiny",
        "--output-dir",
        str(out),
        "--wandb",
        "off",
        "--synthetic-samples",
        "48",
        "--log-interval",
        "1",
        "--save-interval",
        "1000",
        "--target-gpus",
        "cpu,cpu",
        "--drafter-gpus",
        "cpu,cpu",
        "--max-steps",
        "5000",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFLASHOPS_RUN_NAME": "cli-7"}  # as dflashops launches it
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = out / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()
    assert b"received SIGTERM" in err
    status = _status(out)
    stopped_at = status["step"]
    # The last line says how to go on, for a dflashops run its own verb (issue 46 item 8), not "the same command".
    assert (
        err.decode().rstrip().splitlines()[-1]
        == f"stopped at step {stopped_at}; resume with: dflashops restart cli-7 --resume"
    )
    assert status["phase"] == "stopped" and 2 <= stopped_at < 5000
    assert (out / "checkpoints" / f"step_{stopped_at:06d}" / "state.json").is_file()
    # Resume it (shorter horizon, so the test ends): it starts from that checkpoint and trains two more steps.
    cfg = _cfg(out, "--target-gpus", "cpu,cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", str(stopped_at + 2))
    assert run_pipeline(cfg) == EXIT_OK
    assert [m["step"] for m in _metrics(out)][-3:] == [stopped_at, stopped_at + 1, stopped_at + 2]


@pytest.mark.parametrize(
    "options, message",
    [
        (PipelineOptions(feature_transfer="nvlink"), "--feature-transfer: must be one of device, pinned"),
        (PipelineOptions(queue_capacity=0), "--queue-depth: must be >= 1"),
        (PipelineOptions(checksum_interval=0), "checksum interval must be >= 1"),
    ],
)
def test_bad_pipeline_options_are_bad_input(tmp_path: Path, options: PipelineOptions, message: str) -> None:
    with pytest.raises(TrainerInputError, match=message):
        run_pipeline(_cfg(tmp_path / "never", "--pipeline"), options)
    assert not (tmp_path / "never").exists()


def test_pipeline_options_come_from_the_command_line() -> None:
    cfg = parse_train_args(
        [
            "--preset",
            "tiny",
            "--output-dir",
            "/tmp/unused",
            "--queue-depth",
            "3",
            "--feature-transfer",
            "pinned",
            "--stall-timeout",
            "60",
        ]
    )
    options = PipelineOptions.from_config(cfg)
    assert (options.queue_capacity, options.feature_transfer, options.stall_warn_s, options.stall_abort_s) == (
        3,
        "pinned",
        30.0,
        60.0,
    )


def test_periodic_checkpoints_are_written_in_the_background_and_a_failed_write_ends_the_run(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    good = tmp_path / "good"
    code = run_pipeline(
        _cfg(
            good,
            "--target-gpus",
            "cpu",
            "--drafter-gpus",
            "cpu,cpu",
            "--max-steps",
            "5",
            "--save-interval",
            "2",
            "--keep-checkpoints",
            "5",
        )
    )
    assert code == EXIT_OK
    assert sorted(p.name for p in (good / "checkpoints").iterdir()) == ["step_000002", "step_000004", "step_000005"]
    assert _status(good)["last_checkpoint"].endswith("step_000005")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "checkpoints").write_text("not a directory\n")  # a real fault on the writer thread
    code = run_pipeline(
        _cfg(bad, "--target-gpus", "cpu", "--drafter-gpus", "cpu,cpu", "--max-steps", "6", "--save-interval", "2")
    )
    assert code == EXIT_FAILED
    status = _status(bad)
    assert status["phase"] == "failed" and status["step"] <= 4
    assert "writing checkpoint step_000002 failed: FileExistsError" in status["error"]
