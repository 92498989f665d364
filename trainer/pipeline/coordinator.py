"""The main thread's step loop over the drafter workers.

One optimizer step = three rounds of (command to every drafter, wait for every answer):
  Gather -> the step-wide normaliser (sum of weights and of real blocks over all drafters and micro-batches,
  docs/method.md#loss; in a distributed run `step_totals` sums it over every node too) -> ForwardBackward -> replica sync of gradients (main thread, drafters idle) -> OptimizerStep
  -> periodic weight averaging -> compile-guard check.
Each round costs a few thread hand-offs (tens of microseconds) against steps of hundreds of milliseconds.

Waiting never blocks without a bound: answers are polled in slices, and between slices the supervisor is
asked for a worker failure (re-raised here with the worker's traceback) and the time since the step began is
compared with the stall limits: after `stall_warn_s` the log gets a report saying which side starves, after
`stall_abort_s` the run ends with PipelineStalled carrying that report.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.pipeline.channel import Channel, ChannelAborted, ChannelTimeout
from trainer.pipeline.compile_guard import CompileGuard
from trainer.pipeline.drafter_worker import Computed, ForwardBackward, Gather, Gathered, OptimizerStep, Stepped
from trainer.pipeline.replica_sync import ReplicaSync
from trainer.pipeline.worker_supervisor import PipelineStalled, Supervisor

POLL_SLICE_S = 0.25


@dataclass
class DrafterHandle:
    name: str
    commands: Channel[Any]
    results: Channel[Any]


@dataclass
class StepResult:
    step: int  # 0-based index of the optimizer step just completed
    weight_sum: float
    num_blocks: int
    num_ctx_tokens: int
    positions: list[tuple[int, int]]  # data positions consumed, drafter-major
    stats: list[list[Any]]  # [drafter][micro-batch] StepStats
    optimizer: list[Any]  # per drafter: what optimizer_step returned
    compute_s: list[float]  # per drafter: forward/backward seconds
    sync_s: float
    seconds: float


class Coordinator:
    def __init__(
        self,
        supervisor: Supervisor,
        drafters: list[DrafterHandle],
        sync: ReplicaSync,
        noise_std_at: Callable[[int], float],
        seed: int,
        *,
        guard: CompileGuard | None = None,
        stall_warn_s: float = 120.0,
        stall_abort_s: float = 900.0,
        log: Callable[[str], None] = lambda message: None,
        step_totals: Callable[[float, int], tuple[float, int]] | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.drafters = drafters
        self.sync = sync
        self.noise_std_at = noise_std_at
        self.seed = seed
        self.guard = guard
        self.stall_warn_s = stall_warn_s
        self.stall_abort_s = stall_abort_s
        self.log = log
        self.step_totals = step_totals  # (this node's weight sum, real blocks) -> the job's

    def step(self, step: int) -> StepResult:
        started = time.monotonic()
        self._warned = False
        gathered: list[Gathered] = self._round(Gather(step), Gathered, started)
        weight_sum = sum(g.weight_sum for g in gathered)
        num_blocks = sum(g.num_blocks for g in gathered)
        if self.step_totals is not None:
            weight_sum, num_blocks = self.step_totals(weight_sum, num_blocks)
        command = ForwardBackward(step, weight_sum, float(num_blocks), self.noise_std_at(step), self.seed)
        computed: list[Computed] = self._round(command, Computed, started)
        sync_started = time.monotonic()
        self.sync.after_backward()
        sync_s = time.monotonic() - sync_started
        stepped: list[Stepped] = self._round(OptimizerStep(step), Stepped, started)
        sync_started = time.monotonic()
        self.sync.after_step(step + 1)
        sync_s += time.monotonic() - sync_started
        if self.guard is not None:
            self.guard.check()
        return StepResult(
            step=step,
            weight_sum=weight_sum,
            num_blocks=num_blocks,
            num_ctx_tokens=sum(g.num_ctx_tokens for g in gathered),
            positions=[p for g in gathered for p in g.positions],
            stats=[c.stats for c in computed],
            optimizer=[s.result for s in stepped],
            compute_s=[c.seconds for c in computed],
            sync_s=sync_s,
            seconds=time.monotonic() - started,
        )

    def _round(self, command: Any, expect: type[Any], started: float) -> list[Any]:
        for handle in self.drafters:
            self._call(lambda: handle.commands.put(command, timeout=POLL_SLICE_S * 4))  # noqa: B023 - called at once
        replies = [self._await(handle, started) for handle in self.drafters]
        for handle, reply in zip(self.drafters, replies):
            if not isinstance(reply, expect) or reply.step != command.step:
                raise RuntimeError(f"{handle.name} answered {reply!r} to {command!r}")
        return replies

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run a channel operation; a channel aborted by a failing worker re-raises that worker's error."""
        try:
            return fn()
        except ChannelAborted:
            self.supervisor.check()
            raise

    def _await(self, handle: DrafterHandle, started: float) -> Any:
        while True:
            self.supervisor.check()
            try:
                return self._call(lambda: handle.results.get(timeout=POLL_SLICE_S))
            except ChannelTimeout:
                pass
            waited = time.monotonic() - started
            if waited > self.stall_abort_s:
                raise PipelineStalled(
                    f"no optimizer step completed for {waited:.0f} s (limit {self.stall_abort_s:.0f} s): "
                    f"{self.supervisor.stall_report()}"
                )
            if waited > self.stall_warn_s and not self._warned:
                self._warned = True
                self.log(f"warning: step stalled for {waited:.0f} s: {self.supervisor.stall_report()}")
