"""What the training loop (trainer.training.loop) asks of an engine; the engines implement it:

- trainer.training.single_engine.SingleEngine: one target, one drafter, one thread (`python -m trainer train`)
- trainer.pipeline.pipeline_engine.PipelineEngine with a LocalCluster: the threaded pipeline (several devices or
  --pipeline): target threads -> bounded queues -> drafter threads, replicas kept in sync in the process
- the same PipelineEngine with a trainer.dist.cluster.TorchCluster: the distributed engine (torchrun, one
  process per node, the threaded pipeline inside each node, torch.distributed between the nodes)

Call order, all from the main thread: announce, build, [warm_up], [load_checkpoint, restore], running(...) { train_step,
after_step, agree_stop, [record], [checkpoint_parts], ... finish }, [release_devices], close (always, also after a failure).
In a distributed run every node makes the same calls in the same order, so the collectives inside them match
up; which calls are made is decided from values all nodes agree on (step numbers, the agreed stop).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from trainer.state.checkpoint import CheckpointState
from trainer.state.metrics import RunRecorder


class Engine(Protocol):
    total_steps: int  # optimizer steps of the run (the schedule's horizon)
    writes_metrics: bool  # metrics.jsonl and wandb (in a distributed run: node 0 only)
    writes_checkpoints: bool  # checkpoints/ (in a distributed run: node 0 only)

    def announce(self, run_dir: Path) -> list[str]:
        """The lines logged once the run directory exists (devices, assignment, sync mode)."""

    def build(self) -> None:
        """Load the target(s), build the drafter replica(s), optimizers and schedules."""

    def warm_up(self, step: int, position: tuple[int, int], recorder: RunRecorder) -> None:
        """Whatever the steps from `step` on (first micro-batch at data position (epoch, index)) need before they
        start that reads no weights: the pipeline compiles every replica for their batch shapes. Called after
        build and before the checkpoint is read; `running` does what it did not."""

    def load_checkpoint(self, path: Path) -> CheckpointState:
        """The checkpoint to resume from (distributed: node 0 reads it and sends it to the others)."""

    def restore(self, state: CheckpointState) -> tuple[int, str]:
        """Load `state` into every replica; return (the step to continue from, its data position in words)."""

    def running(self, step: int, recorder: RunRecorder) -> AbstractContextManager[None]:
        """Warm-up, then the worker threads, for the steps from `step` on; leaving stops them."""

    def train_step(self, step: int) -> None:
        """Optimizer step `step` (0-based)."""

    def after_step(self, step: int) -> dict[str, Any] | None:
        """Checks after `step` steps are done; fields for a metrics line that must be logged now, else None."""

    def agree_stop(self, signum: int | None) -> int | None:
        """The stop every node agrees on after this step: the signal number any node received, else None."""

    def record(self, step: int) -> dict[str, Any]:
        """The metrics line of the steps since the last one, ending at `step`."""

    def checkpoint_parts(self, step: int) -> dict[str, Any] | None:
        """What `snapshot_checkpoint` takes for a checkpoint after `step` steps; None where this process writes
        none (a distributed run's other nodes, which still take part in what the checkpoint needs)."""

    def checkpoint_layout(self) -> dict[str, Any] | None:
        """The tensors a checkpoint of this process will hold, as {"model": ..., "optimizer": ...} in the order
        `checkpoint_parts` gives them, without its side effects (no replica sync, no collective), for
        CheckpointWriter.prepare; None where this process writes none. Valid after the first step (the
        optimizer's state exists then)."""

    def finish(self) -> None:
        """The run ends here (done or stopped): every node agrees before any leaves."""

    def release_devices(self) -> dict[str, int]:
        """After `running` (the final checkpoint is in host memory): stop the workers and drop every device
        tensor this engine holds; return the bytes each CUDA device still has reserved
        (trainer.state.handover.free_device_memory). Nothing but `close` may follow."""

    def close(self, failure: BaseException | None) -> None:
        """Release threads; must not raise. `failure`: what ended the run, if it failed (kept for the caller)."""
