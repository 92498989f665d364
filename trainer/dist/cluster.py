"""What the threaded pipeline needs from the other nodes of a run, and the one-node answer to it.

The pipeline engine (trainer.pipeline.pipeline_engine) calls a Cluster at fixed points of every step: the step-wide
loss normaliser, the gradient or weight sync, the stop agreement, replica checksums, metrics lines,
checkpoints. `LocalCluster` (one node, no torch.distributed) answers each call with this node's own value,
so the threaded pipeline is the distributed engine with one node and no collectives.
`trainer.dist.torch_cluster.TorchCluster` answers them with torch.distributed collectives between the nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from trainer.state.checkpoint import CheckpointState, load_checkpoint

# split(state, node) -> the part of a loaded checkpoint that `node` needs (e.g. only its replicas' optimizers).
Splitter = Callable[[CheckpointState, int], CheckpointState]


class Cluster(Protocol):
    rank: int  # this node's number, 0..nodes-1; node 0 writes metrics.jsonl and the checkpoints
    nodes: int
    distributed: bool  # a torch.distributed job (even of one node): metrics lines say what was sent

    def describe(self) -> list[str]:
        """Lines for the start of the log: who the nodes are."""

    def at_step(self, step: int) -> None:
        """The step now being trained (named in errors about lost nodes)."""

    def all_reduce_sum_(self, tensor: torch.Tensor, kind: str) -> None:
        """In place: `tensor` becomes the sum of every node's `tensor` (bitwise equal on every node)."""

    def all_gather(self, value: Any, kind: str) -> list[Any]:
        """Every node's `value` (picklable), in node order."""

    def agree_stop(self, signum: int | None) -> list[int]:
        """Every node's stop request after this step (0: none), in node order; the same list on every node."""

    def broadcast_module_(self, module: nn.Module) -> None:
        """In place: node 0's parameters and buffers into every node's `module` (its tensors on the CPU)."""

    def load_checkpoint(self, path: Path, split: Splitter, device: torch.device | None = None) -> CheckpointState:
        """Node 0 reads `path` and gives every node its part `split(state, node)`; no other node reads files.
        `device`: where this node wants the tensors (one node: loaded straight there; several: the CPU, what
        node 0 sends travels from there)."""

    def gather_to_writer(self, value: Any, kind: str) -> list[Any] | None:
        """Every node's `value` on node 0 (in node order); None elsewhere."""

    def barrier(self, kind: str) -> None:
        """Return when every node has arrived here."""

    def take_traffic(self) -> dict[str, int]:
        """Bytes handed to collectives by this node since the last call, by kind."""

    def close(self, failure: BaseException | None = None) -> None:
        """Leave the job; after this node's `failure`, without waiting for the others (and tell them why)."""


class LocalCluster:
    """One node: every collective is the identity (no copies, no synchronisation)."""

    rank = 0
    nodes = 1
    distributed = False

    def describe(self) -> list[str]:
        return []

    def at_step(self, step: int) -> None:
        pass

    def all_reduce_sum_(self, tensor: torch.Tensor, kind: str) -> None:
        pass

    def all_gather(self, value: Any, kind: str) -> list[Any]:
        return [value]

    def agree_stop(self, signum: int | None) -> list[int]:
        return [signum or 0]

    def broadcast_module_(self, module: nn.Module) -> None:
        pass

    def load_checkpoint(self, path: Path, split: Splitter, device: torch.device | None = None) -> CheckpointState:
        return split(load_checkpoint(path, device), 0)

    def gather_to_writer(self, value: Any, kind: str) -> list[Any] | None:
        return [value]

    def barrier(self, kind: str) -> None:
        pass

    def take_traffic(self) -> dict[str, int]:
        return {}

    def close(self, failure: BaseException | None = None) -> None:
        pass
