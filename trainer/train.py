"""`python -m trainer train`: parse the flags, pick the engine, run the one training loop.

  1. flags -> TrainConfig (presets, cross-checks; trainer.core.config)
  2. the engine:
     - launched by torchrun, or --nodes > 1: the distributed engine (trainer.distributed_run), one process per node
       with the threaded pipeline inside
     - several --target-gpus/--drafter-gpus, or --pipeline: the threaded pipeline (trainer.pipeline_run)
     - else the single-process engine (trainer.training.single_engine): one target, one drafter, one thread
  3. pre-flight (trainer.training.preflight): everything that can refuse the run, BEFORE anything is written (bad input:
     `error:`/`hint:`, exit 2, no run directory)
  4. trainer.training.loop.run_training: resume, steps, log lines, checkpoints, stop and failure handling
Exit codes: 0 done, 1 failed (status.json `failed` with the error; a full disk while checkpointing or writing
status.json, metrics.jsonl or train_config.json is one `error:` line naming the filesystem, the write and the
last good checkpoint: trainer.state.failure), 2 bad input,
128+signum stopped (SIGTERM/SIGHUP/SIGINT: the step finishes, a checkpoint is written; resumable).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from trainer.core.config import TrainConfig, TrainerInputError, parse_train_args
from trainer.training.loop import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, run_training
from trainer.training.preflight import RunSetup, build_drafter_config, preflight


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run) sets TORCHELASTIC_RUN_ID in every worker's environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def warm_devices(cfg: TrainConfig) -> None:
    """Create the CUDA contexts of the run's devices on a background thread while the pre-flight reads configs
    and data (~1 s on the H200 machine, otherwise paid by the build's first tensor). Only the devices the run
    names (cuda:0 when it names none), so a shared machine's other GPUs get no context from this run."""
    names = [*cfg.target_gpus, *cfg.drafter_gpus] or ["cuda:0"]
    devices = {torch.device(n) for n in names if n.startswith("cuda")}
    if not devices:
        return

    def touch() -> None:
        try:
            if torch.cuda.is_available():
                for device in devices:
                    if (device.index or 0) < torch.cuda.device_count():
                        torch.empty(0, device=device)
        except Exception:  # noqa: BLE001 - an unusable device is the pre-flight's to report, with its flag
            pass

    threading.Thread(target=touch, name="cuda-warm", daemon=True).start()


def main(argv: list[str]) -> int:
    """Entry point of `python -m trainer train`; returns the exit code."""
    from trainer.core.process_start import IMPORTED_AT
    from trainer.state.metrics import STARTUP_MARKS

    STARTUP_MARKS.update(python_started=IMPORTED_AT, imports_done=round(time.time(), 3))  # torch is in by now
    try:
        cfg = parse_train_args(argv)
        warm_devices(cfg)
        if cfg.nodes > 1 or launched_by_torchrun():
            from trainer.distributed_run import run_distributed  # lazy: torch.distributed

            return int(run_distributed(cfg))
        if cfg.pipeline or len(cfg.target_gpus) > 1 or len(cfg.drafter_gpus) > 1:
            try:
                from trainer.pipeline_run import run_pipeline  # lazy: threads, compile guards
            except ImportError as exc:
                raise TrainerInputError(
                    f"--drafter-gpus/--target-gpus: the threaded pipeline is unavailable ({exc})",
                    hint="give one target and one drafter device",
                ) from None
            STARTUP_MARKS["engine_imported"] = round(time.time(), 3)
            return int(run_pipeline(cfg))
        return run(cfg)
    except TrainerInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run(cfg: TrainConfig) -> int:
    """Train per `cfg` with one target and one drafter; return the exit code (see module doc)."""
    from trainer.training.single_engine import SingleEngine

    setup = preflight(cfg)
    return run_training(setup, SingleEngine(setup))


__all__ = ["main", "run", "preflight", "RunSetup", "build_drafter_config", "EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT"]
