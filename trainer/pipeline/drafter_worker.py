"""Drafter worker: one thread per drafter replica, driven step by step by the main thread.

The main thread sends commands; the worker answers each on its result channel:
  Gather(step)              take this step's A micro-batches from the channels of their targets, in order;
                            answer their weight/block/token sums (for the step-wide loss normaliser)
  ForwardBackward(step, ..) run DrafterSide.forward_backward on each gathered micro-batch with the step-wide
                            normalisers (gradients accumulate); noise seed (seed, step, d*A + a) with d the
                            job-wide drafter number (the same on one node with N*D drafters as on N nodes of D),
                            which for one drafter is exactly the single-process trainer's (seed, step, a); then
                            synchronize the stream so the main thread can reduce the gradients
  OptimizerStep(step)       DrafterSide.optimizer_step(); answer (lr, grad_norm as a device tensor)
Keeping the step loop in the main thread makes a stop, a gradient reduction or a checkpoint happen while every
drafter is idle at a step boundary: consistent by construction, with no barrier to get out of step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trainer.pipeline.assignment import Assignment, FaultPoints
from trainer.pipeline.channel import Channel
from trainer.pipeline.compile_guard import CompileGuard
from trainer.pipeline.handoff import Parcel, accept, use_worker_stream
from trainer.pipeline.worker_supervisor import Supervisor


class DrafterSideLike(Protocol):
    """What the worker needs of trainer.training.step.DrafterSide."""

    device: torch.device

    def forward_backward(
        self,
        features: Any,
        normalizer: float,
        num_blocks: float,
        *,
        noise_std: float = 0.0,
        noise_seed: tuple[int, ...] = (0,),
    ) -> Any: ...

    def optimizer_step(self) -> Any: ...


@dataclass
class Gather:
    step: int


@dataclass
class ForwardBackward:
    step: int
    normalizer: float  # sum of slot weights over the whole optimizer step (all drafters, all micro-batches)
    num_blocks: float  # real blocks over the whole optimizer step
    noise_std: float
    seed: int


@dataclass
class OptimizerStep:
    step: int


@dataclass
class Gathered:
    step: int
    weight_sum: float
    num_blocks: int
    num_ctx_tokens: int
    positions: list[tuple[int, int]]  # (epoch, index) of each micro-batch


@dataclass
class Computed:
    step: int
    stats: list[Any]  # one StepStats per micro-batch
    seconds: float


@dataclass
class Stepped:
    step: int
    result: Any  # what optimizer_step returned


@dataclass
class DrafterWorker:
    name: str  # "drafter0" (this node's worker names)
    number: int  # job-wide drafter number (node rank * drafters per node + local number)
    side: DrafterSideLike
    inputs: dict[int, Channel[Parcel]]  # target number -> channel
    commands: Channel[Any]
    results: Channel[Any]
    assignment: Assignment
    supervisor: Supervisor
    get_timeout_s: float = 600.0
    faults: FaultPoints | None = None
    _held: list[Parcel] = field(default_factory=list)

    def __call__(self) -> None:
        device = torch.device(self.side.device)
        use_worker_stream(device)
        faults = self.faults or FaultPoints()
        while True:
            self.supervisor.set_phase(self.name, "waiting for a command")
            command = self.commands.get(timeout=self.get_timeout_s)
            try:
                reply = self._execute(command, device, faults)
            except (RuntimeError, UserWarning) as exc:
                translated = CompileGuard.translate(exc, f"{self.name} on {device}")
                if translated is not None:
                    raise translated from exc
                raise
            self.results.put(reply, timeout=self.get_timeout_s)

    def _execute(self, command: Any, device: torch.device, faults: FaultPoints) -> Any:
        if isinstance(command, Gather):
            return self._gather(command.step, faults)
        if isinstance(command, ForwardBackward):
            self.supervisor.set_phase(self.name, f"forward/backward step {command.step}")
            started = time.perf_counter()
            stats = []
            for accum, parcel in enumerate(self._held):
                faults.hit(f"{self.name}.forward_backward", self.supervisor.stop_event)
                micro = self.number * self.assignment.grad_accum + accum
                stats.append(
                    self.side.forward_backward(
                        accept(parcel, device),
                        command.normalizer,
                        command.num_blocks,
                        noise_std=command.noise_std,
                        noise_seed=(command.seed, command.step, micro),
                    )
                )
            self._held = []
            if device.type == "cuda":  # the main thread reduces these gradients next: one sync per step
                torch.cuda.current_stream(device).synchronize()
            return Computed(command.step, stats, time.perf_counter() - started)
        if isinstance(command, OptimizerStep):
            self.supervisor.set_phase(self.name, f"optimizer step {command.step}")
            result = self.side.optimizer_step()
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self.supervisor.count_step(self.name)
            return Stepped(command.step, result)
        raise TypeError(f"{self.name}: unknown command {command!r}")

    def _gather(self, step: int, faults: FaultPoints) -> Gathered:
        self._held = []
        for accum in range(self.assignment.grad_accum):
            g = self.assignment.micro_index(step, self.number, accum)
            channel = self.inputs[self.assignment.target_of(g)]
            self.supervisor.set_phase(self.name, f"waiting for features {g} from {channel.name}")
            faults.hit(f"{self.name}.get", self.supervisor.stop_event)
            parcel = channel.get(timeout=self.get_timeout_s)
            if parcel.g != g:  # the assignment guarantees order; a mismatch is a bug, never silently trained on
                raise RuntimeError(f"{self.name}: expected micro-batch {g} from {channel.name}, got {parcel.g}")
            self._held.append(parcel)
        return Gathered(
            step=step,
            weight_sum=sum(p.weight_sum for p in self._held),
            num_blocks=sum(p.num_blocks for p in self._held),
            num_ctx_tokens=sum(p.num_ctx_tokens for p in self._held),
            positions=[(p.epoch, p.index) for p in self._held],
        )
