"""`run_pipeline(cfg)`: the threaded multi-drafter trainer (`--target-gpus A,B --drafter-gpus C,D` or `--pipeline`).

Same contract as the single-process trainer (trainer.train): checks that can refuse run before anything is
written; exit 0 done, 1 failed (status.json `failed`, the failing worker's traceback on stderr), 2 bad input,
128+signum after a signal-requested stop with its checkpoint. Order of events:
  1. pipeline options, pre-flight (trainer.training.preflight.preflight), devices and the micro-batch assignment
     (trainer.pipeline.pipeline_engine.PipelineEngine's constructor): every refusal, before the run directory exists
  2. trainer.training.loop.run_training drives the engine: run directory, targets (one model per target worker),
     drafter replicas (one init, copied), resume into every replica; warm-up in the main thread for every
     (drafter device x batch shape the run will meet); CompileGuard on, workers start, the main thread runs the
     step loop (trainer.pipeline.coordinator); metrics / checkpoints / stop at step boundaries; shutdown joins
     every thread with a timeout
"""

from __future__ import annotations

from trainer.core.config import TrainConfig
from trainer.pipeline.options import PipelineOptions
from trainer.pipeline.pipeline_engine import PipelineEngine
from trainer.pipeline.replicas import ReplicaDivergenceError, check_replicas
from trainer.training.loop import run_training
from trainer.training.preflight import preflight, resolve_devices


def run_pipeline(cfg: TrainConfig, options: PipelineOptions | None = None) -> int:
    """Train per `cfg` with the threaded pipeline; return the exit code (see module doc)."""
    options = options or PipelineOptions.from_config(cfg)
    options.check()
    setup = preflight(cfg)
    return run_training(setup, PipelineEngine(setup, options))


__all__ = ["run_pipeline", "PipelineOptions", "ReplicaDivergenceError", "check_replicas", "resolve_devices"]
