"""Target worker: one thread per target device.

Loop over this worker's micro-batch indices g (trainer.pipeline.assignment): build the batch on the CPU, run the
frozen target, hand the features to the drafter that owns g (handoff.publish) and put them into the
(target, drafter) channel. A full channel blocks the put: back-pressure bounds memory at `capacity`
feature batches per channel. When its last index is done the worker closes its channels (end of stream).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from trainer.pipeline.assignment import Assignment, FaultPoints
from trainer.pipeline.channel import Channel
from trainer.pipeline.handoff import Parcel, publish, use_worker_stream
from trainer.pipeline.worker_supervisor import Supervisor


class TargetSideLike(Protocol):
    """What the worker needs of trainer.training.step.TargetSide."""

    device: torch.device

    def features(self, batch: Any) -> Any: ...


@dataclass
class TargetWorker:
    name: str  # "target0"
    side: TargetSideLike
    make_batch: Callable[[int], Any]  # g -> trainer.data.batches.Batch on the CPU
    indices: Iterable[int]  # the g's this worker computes, increasing
    outputs: dict[int, Channel[Parcel]]  # drafter number -> channel
    drafter_devices: list[torch.device]
    assignment: Assignment
    supervisor: Supervisor
    transfer: str = "device"
    put_timeout_s: float = 600.0
    faults: FaultPoints | None = None

    def __call__(self) -> None:
        """Thread body. Raises on any error (the supervisor records it and stops the run)."""
        device = torch.device(self.side.device)
        use_worker_stream(device)
        faults = self.faults or FaultPoints()
        for g in self.indices:
            if self.supervisor.stop_event.is_set():
                return
            self.supervisor.set_phase(self.name, f"loading micro-batch {g}")
            batch = self.make_batch(g)
            self.supervisor.set_phase(self.name, f"target forward {g}")
            with torch.no_grad():
                features = self.side.features(batch.to(device))
            faults.hit(f"{self.name}.features", self.supervisor.stop_event)
            drafter = self.assignment.local_drafter_of(g)  # this node's worker number
            placed, ready, on_host = publish(features, device, self.drafter_devices[drafter], self.transfer)
            parcel = Parcel(
                g=g,
                epoch=batch.epoch,
                index=batch.index,
                features=placed,
                weight_sum=batch.weight_sum,
                num_blocks=batch.num_blocks,
                num_ctx_tokens=batch.num_ctx_tokens,
                ready=ready,
                on_host=on_host,
            )
            channel = self.outputs[drafter]
            full = channel.depth() >= channel.capacity
            self.supervisor.set_phase(
                self.name, f"blocked on full queue {channel.name}" if full else f"putting {g} into {channel.name}"
            )
            faults.hit(f"{self.name}.put", self.supervisor.stop_event)
            channel.put(parcel, timeout=self.put_timeout_s)
            self.supervisor.count_step(self.name)
        for channel in self.outputs.values():
            channel.close()
        self.supervisor.set_phase(self.name, "finished its micro-batches")
