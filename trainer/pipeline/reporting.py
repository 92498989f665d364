"""Metrics and checkpoints of a pipeline run (the run-directory contract, docs/run-directory.md).

`StepWindow` accumulates the steps between two log lines and turns them into one metrics.jsonl record: the
loss terms over all drafters, lr and grad norm, block tokens/s overall and per drafter (per drafter = its
block tokens over its own forward/backward time, so a drafter slowed by the GIL shows it), context tokens/s
per target worker, queue depths and blocked time per channel, GPU memory per drafter device, eta.

In a distributed run (`cluster.distributed`) the loss terms, tau_sim, accuracies and token rates are the
job's: this node's sums are added to the other nodes' in one collective of 2 * block_size + 9 float64 values
per metrics line (not per step), and `block_tok_s_per_drafter` lists every drafter of the job, node-major.
Queue depths, per-target rates and GPU memory stay this node's own. Three fields say what crossed the nodes:
`nodes`, `dist_bytes_per_step` (bytes this node handed to collectives per step over the window, steady-state
kinds only) and `dist_bytes_per_step_by_kind` (the same by kind, one-off kinds such as the start-up weight
broadcast and checkpoint transfers included).

`pipeline_checkpoint_parts` is ONE checkpoint for the whole run through trainer.state.checkpoint: the synced
drafter (replica 0), replica 0's optimizer state with the other replicas' states under "pipeline_replicas"
(identical under --sync grad, so they are stored only for --sync average; in a distributed run every node's
replicas, node-major), the schedule, the RNG, the data position (epoch, index of the next micro-batch) and,
under "pipeline", each target worker's next micro-batch (node 0's workers) and, in a distributed run, the
number of nodes. It loads in the single-process trainer as well (the extra optimizer key is ignored there).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from trainer.core.config import TrainConfig
from trainer.dist.cluster import Cluster, LocalCluster
from trainer.pipeline.assignment import Assignment
from trainer.pipeline.channel import ChannelGroup
from trainer.pipeline.coordinator import StepResult
from trainer.pipeline.worker_supervisor import Supervisor
from trainer.training.step import StepStats

ONE_OFF_KINDS = ("setup", "checkpoint")  # collectives that are not part of every step
_STAT_FIELDS = (
    "loss",
    "ce_sum",
    "kl_sum",
    "cap_sum",
    "weight_sum",
    "tau_sum",
    "num_blocks",
    "slot_correct",
    "slot_valid",
    "sel_ce_sum",
    "sel_tau_sum",
    "sel_slot_correct",
)


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

    def record(
        self,
        step: int,
        epoch: int,
        total_steps: int,
        channels: ChannelGroup,
        drafter_devices: list[torch.device],
        noise_std: float,
        cluster: Cluster | None = None,
    ) -> dict[str, Any]:
        """The metrics line for the window that ends at `step`, then start a new window. With a distributed
        `cluster` every node must call this at the same step (it holds collectives)."""
        assert self.last is not None
        cluster = cluster or LocalCluster()
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        combined = None
        for stats in self.last.stats:
            for part in stats:
                combined = part if combined is None else combined + part
        assert combined is not None
        block_tokens, ctx_tokens = float(sum(self.block_tokens)), float(self.ctx_tokens)
        per_drafter = [round(t / max(c, 1e-9), 1) for t, c in zip(self.block_tokens, self.compute_s)]
        if cluster.distributed:
            combined, (block_tokens, ctx_tokens) = sum_over_nodes(cluster, combined, [block_tokens, ctx_tokens])
            per_drafter = [rate for node in cluster.all_gather(per_drafter, "metrics") for rate in node]
        lr, grad_norm = self.last.optimizer[0]
        record: dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            **combined.summary(),
            "lr": lr,
            "grad_norm": float(grad_norm),  # a device tensor (DrafterSide.optimizer_step); the worker synced already
            "noise_std": noise_std,
            "block_tok_s": block_tokens / elapsed,
            "ctx_tok_s": ctx_tokens / elapsed,
            "block_tok_s_per_drafter": per_drafter,
            "sync_s_per_step": self.sync_s / self.steps,
            "eta_s": (total_steps - step) * elapsed / self.steps,
            "time": time.time(),
        }
        if cluster.distributed:
            traffic = cluster.take_traffic()
            record["nodes"] = cluster.nodes
            record["dist_bytes_per_step"] = sum(v for k, v in traffic.items() if k not in ONE_OFF_KINDS) / self.steps
            record["dist_bytes_per_step_by_kind"] = {k: v / self.steps for k, v in sorted(traffic.items())}
        targets = {s.name: s.steps for s in self.supervisor.states() if s.role == "target"}
        record["micro_batches_s_per_target"] = {
            name: round((count - self.target_steps.get(name, 0)) / elapsed, 3) for name, count in targets.items()
        }
        record["queues"] = {
            c.name: {
                "depth": c.depth,
                "max": c.max_depth,
                "put_blocked_s": c.put_blocked_s,
                "get_blocked_s": c.get_blocked_s,
            }
            for c in channels.stats()
            if "->" in c.name
        }
        gpus = sorted({d for d in drafter_devices if d.type == "cuda"}, key=str)
        if gpus:
            record["gpu_mem_gb"] = {str(d): round(torch.cuda.max_memory_allocated(d) / 2**30, 3) for d in gpus}
        self._reset()
        return record


def sum_over_nodes(cluster: Cluster, stats: StepStats, extra: list[float]) -> tuple[StepStats, list[float]]:
    """The job's StepStats (and `extra` sums) from every node's: one float64 all-reduce of everything packed."""
    tensors = [getattr(stats, name).detach().reshape(-1).to("cpu", torch.float64) for name in _STAT_FIELDS]
    packed = torch.cat([*tensors, torch.tensor(extra, dtype=torch.float64)])
    cluster.all_reduce_sum_(packed, "metrics")
    values, start = {}, 0
    for name, tensor in zip(_STAT_FIELDS, tensors):
        values[name] = packed[start : start + tensor.numel()].reshape(getattr(stats, name).shape)
        start += tensor.numel()
    block_tokens, ctx_tokens = int(packed[-2]), int(packed[-1])
    total = StepStats(**values, block_tokens=block_tokens, ctx_tokens=ctx_tokens)
    return total, packed[start:].tolist()


def pipeline_checkpoint_parts(
    cfg: TrainConfig,
    sides: list[Any],
    sync_mode: str,
    epoch: int,
    index: int,
    assignment: Assignment,
    g_next: int,
    *,
    replica_optimizers: list[dict[str, Any]] | None = None,
    nodes: int | None = None,
) -> dict[str, Any]:
    """What one consistent checkpoint of the whole pipeline holds, taken at a step boundary (every worker idle):
    the synced drafter, the optimizer state (per replica under `average`: `replica_optimizers`, every replica of
    the job, node-major; default this process's), the data position of every target. `nodes`: recorded for a
    distributed run (resuming on another number of nodes is refused, trainer.training.preflight)."""
    optimizer = sides[0].optimizer.state_dict()
    if sync_mode == "average":
        states = replica_optimizers if replica_optimizers is not None else [s.optimizer.state_dict() for s in sides]
        if len(states) > 1:
            optimizer = {**states[0], "pipeline_replicas": states[1:]}
    window = assignment.per_step * assignment.num_targets  # holds the next g of every target worker of the node
    targets = {
        f"target{t}": next(iter(assignment.indices_of_target(t, g_next, g_next + window)))
        for t in range(assignment.num_targets)
    }
    pipeline: dict[str, Any] = {
        "drafters": assignment.num_drafters,
        "targets": assignment.num_targets,
        "sync": sync_mode,
        "grad_accum": assignment.grad_accum,
        "next_micro_batch": g_next,
        "target_next_micro_batch": targets,
    }
    if nodes is not None:
        pipeline["nodes"] = nodes
    extra = {"config": cfg.to_dict(), "drafter_config": sides[0].drafter.config.to_hf_dict(), "pipeline": pipeline}
    return dict(
        model=sides[0].drafter.state_dict(),
        optimizer=optimizer,
        scheduler=sides[0].scheduler.state_dict(),
        epoch=epoch,
        index=index,
        extra=extra,
    )
