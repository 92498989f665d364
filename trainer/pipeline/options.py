"""The threaded pipeline's knobs: queue depth, transfer mode, time limits (from the command line), test hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainer.core.config import TrainConfig, TrainerInputError
from trainer.pipeline.handoff import TRANSFER_MODES


@dataclass
class PipelineOptions:
    """Pipeline knobs: queue depth, transfer mode and time limits (from the config by default), test hooks."""

    queue_capacity: int = 2  # feature batches per (target, drafter) channel: the memory bound
    feature_transfer: str = "device"  # device | pinned (trainer.pipeline.handoff)
    stall_warn_s: float = 120.0  # log which side starves after this long without a step
    stall_abort_s: float = 900.0  # then fail the run (also the bound on any single put/get)
    join_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> PipelineOptions:
        """The knobs the command line sets (--queue-depth, --feature-transfer, --stall-timeout)."""
        return cls(
            queue_capacity=cfg.queue_depth,
            feature_transfer=cfg.feature_transfer,
            stall_warn_s=min(120.0, cfg.stall_timeout / 2),
            stall_abort_s=cfg.stall_timeout,
        )

    @property
    def worker_timeout_s(self) -> float:
        """A worker's own bound on one put/get: a backstop behind the main thread's stall limit, which fires
        first and says more (which side starves)."""
        return 2 * self.stall_abort_s + 10.0

    faults: list[str] = field(default_factory=list)  # test hook, see trainer.pipeline.assignment.FaultPoints
    # Called in the main thread after every optimizer step with (step, drafter sides), every worker idle:
    # lets tests check replica identity and send signals at a known step.
    on_step: Callable[[int, list[Any]], None] | None = None
    on_warmup: Callable[[Any], None] | None = None  # bench/gpu_pipeline.py records warm-up time
    # Every this many steps (and at the last) each replica's weight checksum is logged; under --sync grad they
    # must be equal (bitwise identical replicas), and a difference fails the run.
    checksum_interval: int = 50
    # Test hook: compile every replica, on any device, with this dynamo backend ("eager" on the CPU exercises
    # dynamo's caches and guards across worker threads without inductor's code generation).
    compile_backend: str | None = None

    def check(self) -> None:
        """Bad knobs are bad input (before anything is set up or written)."""
        if self.feature_transfer not in TRANSFER_MODES:
            raise TrainerInputError(
                f"--feature-transfer: must be one of {', '.join(TRANSFER_MODES)}, got {self.feature_transfer!r}"
            )
        if self.queue_capacity < 1:
            raise TrainerInputError(f"--queue-depth: must be >= 1, got {self.queue_capacity}")
        if self.checksum_interval < 1:
            raise TrainerInputError(f"replica checksum interval must be >= 1, got {self.checksum_interval}")
