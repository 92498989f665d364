"""Handing a FeatureBatch from a target thread to a drafter thread, across devices and CUDA streams.

Every worker thread runs its kernels on its own CUDA stream (`use_worker_stream`: the current stream is
thread-local), so a target forward and a drafter step on the same GPU can overlap. A tensor made on one
stream and used on another needs two things: the consumer stream must wait for the producer's work (an
event), and the caching allocator must learn that the consumer stream uses the memory (`record_stream`),
or it may hand the block to someone else while the consumer still reads it.

Transfer modes (`--feature-transfer`), measured by bench/gpu_pipeline.py:
- `device`: the target thread copies the features to the drafter's GPU (peer copy on the source device's
  stream; torch makes the destination's current stream wait). Zero host traffic.
- `pinned`: the target thread copies to pinned host memory; the drafter thread copies it in on its own
  stream. Frees target GPU memory at once and keeps the target GPU's copy engine off the drafter's GPU.
On the CPU both are plain references (no copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

TRANSFER_MODES = ("device", "pinned")


def use_worker_stream(device: torch.device) -> None:
    """Give the calling thread its own stream on `device` (no-op on CPU). Call first thing in a worker."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def map_tensors(obj: Any, fn) -> Any:
    """Apply `fn` to every tensor field of a dataclass (or to a tensor); other values pass through."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


def _tensors(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    map_tensors(obj, keep)
    return found


@dataclass
class Parcel:
    """One micro-batch on its way to a drafter: the features plus its bookkeeping."""

    g: int  # global micro-batch index (trainer.pipeline.assignment)
    epoch: int
    index: int
    features: Any  # trainer.training.step.FeatureBatch
    weight_sum: float
    num_blocks: int
    num_ctx_tokens: int
    ready: torch.cuda.Event | None = None  # recorded after the producer's last write
    on_host: bool = False  # pinned-transfer mode: still has to be copied to the drafter's device


def publish(
    features: Any, producer: torch.device, consumer: torch.device, mode: str
) -> tuple[Any, torch.cuda.Event | None, bool]:
    """Producer side. Returns (features placed for the consumer, ready event or None, still_on_host)."""
    if mode not in TRANSFER_MODES:
        raise ValueError(f"--feature-transfer must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}")
    if producer.type != "cuda" and consumer.type != "cuda":
        return map_tensors(features, lambda t: t.to(consumer)), None, False
    if mode == "pinned" and producer.type == "cuda":
        moved = map_tensors(features, lambda t: t.to("cpu", non_blocking=True))  # lands in pinned memory
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(producer))
        return moved, event, consumer.type == "cuda"
    moved = map_tensors(features, lambda t: t.to(consumer, non_blocking=True))
    event = torch.cuda.Event()
    # A peer copy runs on the producer's current stream, and torch makes the consumer device's current stream
    # (for this thread: its default stream) wait for it; recording there marks "copy finished".
    event.record(torch.cuda.current_stream(consumer if consumer.type == "cuda" else producer))
    return moved, event, False


def accept(parcel: Parcel, consumer: torch.device) -> Any:
    """Consumer side: make this thread's stream wait for the producer, then claim the memory for it."""
    if parcel.ready is None:
        return parcel.features
    if consumer.type != "cuda":
        parcel.ready.synchronize()  # pinned host tensors read by the CPU
        return parcel.features
    stream = torch.cuda.current_stream(consumer)
    stream.wait_event(parcel.ready)
    features = parcel.features
    if parcel.on_host:
        features = map_tensors(features, lambda t: t.to(consumer, non_blocking=True))
    else:
        for tensor in _tensors(features):
            tensor.record_stream(stream)
    return features
