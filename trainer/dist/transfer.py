"""Sending a nest of containers with tensors (a checkpoint's state, optimizer states) from one node to another.

`send_nest(value, dst, group)` / `recv_nest(src, group)`: the nest with every tensor replaced by a
placeholder goes as one pickled object (send_object_list), then each tensor as itself (dist.send of its
contiguous CPU copy: no pickling of big tensors, no second copy of the whole state in a byte buffer). Both ends
must call in the same order. Returns the bytes sent or received (what the caller counts as traffic).
Cost for the qwen3-8b drafter's checkpoint: 4.2 GB of weights + 8.4 GB of AdamW moments per receiving node,
about 10 s per node at 10 Gb/s.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a _TensorSlot (the tensors appended to `tensors`, on the CPU)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu").contiguous())
        return _TensorSlot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {key: _strip(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(item, tensors) for item in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, _TensorSlot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: _fill(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(item, tensors) for item in value)
    return value


def send_nest(value: Any, dst: int, group: Any) -> int:
    """Send `value` to global rank `dst`; returns the bytes handed to the collectives."""
    tensors: list[torch.Tensor] = []
    skeleton = _strip(value, tensors)
    dist.send_object_list([skeleton], dst=dst, group=group)
    sent = len(pickle.dumps(skeleton))
    for tensor in tensors:
        dist.send(tensor, dst=dst, group=group)
        sent += tensor.numel() * tensor.element_size()
    return sent


def recv_nest(src: int, group: Any) -> tuple[Any, int]:
    """Receive what `send_nest` on global rank `src` sent: (the value, its tensors on the CPU; bytes received)."""
    holder: list[Any] = [None]
    dist.recv_object_list(holder, src=src, group=group)
    skeleton = holder[0]
    received = len(pickle.dumps(skeleton))
    slots: list[_TensorSlot] = []
    _collect(skeleton, slots)
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(slots)
    for slot in sorted(slots, key=lambda s: s.index):
        buffer = torch.empty(slot.shape, dtype=slot.dtype)
        dist.recv(buffer, src=src, group=group)
        tensors[slot.index] = buffer
        received += buffer.numel() * buffer.element_size()
    return _fill(skeleton, tensors), received


def _collect(value: Any, slots: list[_TensorSlot]) -> None:
    if isinstance(value, _TensorSlot):
        slots.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect(item, slots)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect(item, slots)
