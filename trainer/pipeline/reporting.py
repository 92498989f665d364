"""Metrics and checkpoints of a pipeline run (the run-directory contract of DESIGN.md).

`StepWindow` accumulates the steps between two log lines and turns them into one metrics.jsonl record: the
loss terms over all drafters, lr and grad norm, block tokens/s overall and per drafter (per drafter = its
block tokens over its own forward/backward time, so a drafter slowed by the GIL shows it), context tokens/s
per target worker, queue depths and blocked time per channel, GPU memory per drafter device, eta.

`save_pipeline_checkpoint` writes ONE checkpoint for the whole run through trainer.checkpoint: the synced
drafter (replica 0), replica 0's optimizer state with the other replicas' states under "pipeline_replicas"
(identical under --sync grad, so they are stored only for --sync average), the schedule, the RNG, the data
position (epoch, index of the next micro-batch) and, under "pipeline", each target worker's next micro-batch.
It loads in the single-process trainer as well (the extra optimizer key is ignored there).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from trainer.config import TrainConfig
from trainer.pipeline.channel import ChannelGroup
from trainer.pipeline.coordinator import StepResult
from trainer.pipeline.plan import Assignment
from trainer.pipeline.supervisor import Supervisor


class StepWindow:
    def __init__(self, num_drafters: int, supervisor: Supervisor) -> None:
        self.num_drafters = num_drafters
        self.supervisor = supervisor
        self._reset()

    def _reset(self) -> None:
        self.started = time.perf_counter()
        self.steps = 0
        self.last: StepResult | None = None
        self.block_tokens = [0] * self.num_drafters
        self.ctx_tokens = 0
        self.compute_s = [0.0] * self.num_drafters
        self.sync_s = 0.0
        self.target_steps = {s.name: s.steps for s in self.supervisor.states() if s.role == "target"}

    def add(self, result: StepResult) -> None:
        self.steps += 1
        self.last = result
        for d, stats in enumerate(result.stats):
            self.block_tokens[d] += sum(s.block_tokens for s in stats)
            self.compute_s[d] += result.compute_s[d]
        self.ctx_tokens += result.num_ctx_tokens
        self.sync_s += result.sync_s

    def record(self, step: int, epoch: int, total_steps: int, channels: ChannelGroup, drafter_devices: list[torch.device],
               noise_std: float) -> dict[str, Any]:
        """The metrics line for the window that ends at `step`, then start a new window."""
        assert self.last is not None
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        combined = None
        for stats in self.last.stats:
            for part in stats:
                combined = part if combined is None else combined + part
        lr, grad_norm = self.last.optimizer[0]
        record: dict[str, Any] = {
            "step": step, "epoch": epoch, **combined.summary(), "lr": lr, "grad_norm": grad_norm, "noise_std": noise_std,
            "block_tok_s": sum(self.block_tokens) / elapsed, "ctx_tok_s": self.ctx_tokens / elapsed,
            "block_tok_s_per_drafter": [round(t / max(c, 1e-9), 1) for t, c in zip(self.block_tokens, self.compute_s)],
            "sync_s_per_step": self.sync_s / self.steps,
            "eta_s": (total_steps - step) * elapsed / self.steps, "time": time.time(),
        }
        targets = {s.name: s.steps for s in self.supervisor.states() if s.role == "target"}
        record["micro_batches_s_per_target"] = {
            name: round((count - self.target_steps.get(name, 0)) / elapsed, 3) for name, count in targets.items()}
        record["queues"] = {c.name: {"depth": c.depth, "max": c.max_depth, "put_blocked_s": c.put_blocked_s,
                                     "get_blocked_s": c.get_blocked_s}
                            for c in channels.stats() if "->" in c.name}
        gpus = sorted({d for d in drafter_devices if d.type == "cuda"}, key=str)
        if gpus:
            record["gpu_mem_gb"] = {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in gpus}
        self._reset()
        return record


def pipeline_checkpoint_parts(cfg: TrainConfig, sides: list[Any], sync_mode: str, epoch: int, index: int,
                              assignment: Assignment, g_next: int) -> dict[str, Any]:
    """What one consistent checkpoint of the whole pipeline holds, taken at a step boundary (every worker idle):
    the synced drafter, the optimizer state (per replica under `average`), the data position of every target."""
    optimizer = sides[0].optimizer.state_dict()
    if sync_mode == "average" and len(sides) > 1:
        optimizer = {**optimizer, "pipeline_replicas": [s.optimizer.state_dict() for s in sides[1:]]}
    targets = {f"target{t}": next(iter(assignment.indices_of_target(t, g_next, g_next + assignment.num_targets)))
               for t in range(assignment.num_targets)}
    extra = {"config": cfg.to_dict(), "drafter_config": sides[0].drafter.config.to_hf_dict(),
             "pipeline": {"drafters": assignment.num_drafters, "targets": assignment.num_targets, "sync": sync_mode,
                          "grad_accum": assignment.grad_accum, "next_micro_batch": g_next,
                          "target_next_micro_batch": targets}}
    return dict(model=sides[0].drafter.state_dict(), optimizer=optimizer, scheduler=sides[0].scheduler.state_dict(),
                epoch=epoch, index=index, extra=extra)
