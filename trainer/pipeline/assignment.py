"""Who computes which micro-batch: a deterministic assignment, so data order survives threads and resumes.

The run's micro-batches form one global sequence g = 0, 1, 2, ... (epoch by epoch, in the order
trainer.data.batches.epoch_batches gives). Optimizer step k (0-based) consumes D * A of them (D drafters, A = --grad-accum):

    g(k, d, a) = (k * D + d) * A + a          drafter d's a-th micro-batch of step k
    target(g)  = g mod T                      round robin over the T target workers

Each target worker walks its own g's in increasing order and puts each into the channel (target, drafter(g));
each drafter takes its g's, in increasing order, from the channel of target(g). Both ends of every channel see
the same increasing order, so the order is fixed no matter how threads are scheduled, and (because g is
step-major) no drafter can wait on an item that sits behind a full channel of another drafter: no deadlock.
A checkpoint after step k stores the position of g = (k+1) * D * A; prefetched items beyond it are dropped at
stop and recomputed after resume.

Several nodes (the distributed engine): with N nodes of D drafters each, the job has N * D drafters numbered
node-major (node r owns drafters r*D .. r*D+D-1), and g(k, d, a) above runs over all of them, so a step
consumes N * D * A micro-batches and node r reads exactly those of its own drafters: disjoint shards of every
epoch that together cover it, in the same global order a one-node run with N * D drafters would read (the
checkpoint's data position therefore resumes the same global order). Inside a node, the node's own
micro-batches are numbered 0, 1, 2, ... ("local positions") and dealt round robin to its T target workers.

Fault points (`FaultPoints`) are the test hook for failures that cannot be produced on demand with real parts
(a target forward that raises, a put that fails, a worker that hangs): `"target0.features@3"` raises
`InjectedFault` the 3rd time target0 reaches that point; `"target0.features@3=hang"` blocks there instead until
the run's stop event is set (at most 120 s), which is how a stuck worker looks to the supervisor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Assignment:
    num_targets: int  # target workers of this node
    num_drafters: int  # drafter workers of this node
    grad_accum: int
    num_nodes: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_targets < 1 or self.num_drafters < 1 or self.grad_accum < 1:
            raise ValueError(f"need at least one target worker, one drafter worker and grad_accum >= 1, got {self}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"node {self.node_rank} is not one of the {self.num_nodes} nodes")

    @property
    def total_drafters(self) -> int:
        return self.num_nodes * self.num_drafters

    @property
    def per_step(self) -> int:
        """Micro-batches per optimizer step, all nodes together."""
        return self.total_drafters * self.grad_accum

    @property
    def first_drafter(self) -> int:
        """The job-wide number of this node's drafter 0."""
        return self.node_rank * self.num_drafters

    def micro_index(self, step: int, drafter: int, accum: int) -> int:
        """g of job-wide drafter `drafter`'s `accum`-th micro-batch of step `step`."""
        return (step * self.total_drafters + drafter) * self.grad_accum + accum

    def drafter_of(self, g: int) -> int:
        """The job-wide drafter that trains on g."""
        return (g // self.grad_accum) % self.total_drafters

    def local_drafter_of(self, g: int) -> int:
        """This node's drafter worker that trains on g (valid when `owns(g)`)."""
        return self.drafter_of(g) - self.first_drafter

    def owns(self, g: int) -> bool:
        return 0 <= self.local_drafter_of(g) < self.num_drafters

    def _local_position(self, g: int) -> int:
        local_per_step = self.num_drafters * self.grad_accum
        return (g // self.per_step) * local_per_step + g % self.per_step - self.first_drafter * self.grad_accum

    def _global_index(self, local: int) -> int:
        local_per_step = self.num_drafters * self.grad_accum
        step, within = divmod(local, local_per_step)
        return step * self.per_step + self.first_drafter * self.grad_accum + within

    def target_of(self, g: int) -> int:
        """This node's target worker that computes g: round robin over the node's micro-batches."""
        return self._local_position(g) % self.num_targets

    def indices_of_target(self, target: int, start: int, stop: int) -> Iterable[int]:
        """The g's in [start, stop) that this node's `target` computes, increasing."""
        if self.num_nodes == 1:
            first = start + ((target - start) % self.num_targets)
            return range(first, stop, self.num_targets)
        local_start, local_stop = self._owned_before(start), self._owned_before(stop)
        first = local_start + ((target - local_start) % self.num_targets)
        return map(self._global_index, range(first, local_stop, self.num_targets))

    def _owned_before(self, g: int) -> int:
        """How many of this node's micro-batches come before g."""
        full, rest = divmod(g, self.per_step)
        local_per_step = self.num_drafters * self.grad_accum
        return full * local_per_step + min(max(rest - self.first_drafter * self.grad_accum, 0), local_per_step)

    def channel_pairs(self) -> list[tuple[int, int]]:
        """(target, local drafter) pairs of this node that ever exchange a micro-batch (one channel each)."""
        cycle = self.num_targets * self.num_drafters * self.grad_accum
        return sorted({(self.target_of(g), self.local_drafter_of(g)) for g in map(self._global_index, range(cycle))})

    def describe(self, target_devices: list[str], drafter_devices: list[str]) -> str:
        """Human-readable map printed at start: which target worker feeds which drafter worker."""
        feeds: dict[int, list[int]] = {}
        for t, d in self.channel_pairs():
            feeds.setdefault(t, []).append(d)
        lines = [
            f"target{t} ({target_devices[t]}) -> " + ", ".join(f"drafter{d} ({drafter_devices[d]})" for d in ds)
            for t, ds in sorted(feeds.items())
        ]
        if self.num_nodes > 1:
            last = self.first_drafter + self.num_drafters - 1
            head = (
                f"pipeline of node {self.node_rank}: {self.num_targets} target worker(s), {self.num_drafters} "
                f"drafter worker(s) (the job's drafters {self.first_drafter}-{last} of {self.total_drafters}), "
                f"{self.per_step} micro-batches per optimizer step on all {self.num_nodes} nodes"
            )
        else:
            head = (
                f"pipeline: {self.num_targets} target worker(s), {self.num_drafters} drafter worker(s), "
                f"{self.per_step} micro-batches per optimizer step"
            )
        return head + "\n  " + "\n  ".join(lines)


class GlobalOrder:
    """Maps the global micro-batch index g to a data position (epoch, index) and back."""

    def __init__(self, epoch_sizes: list[int]) -> None:
        self.epoch_sizes = list(epoch_sizes)
        self._starts = np.concatenate([[0], np.cumsum(self.epoch_sizes)]).astype(np.int64)

    @property
    def total(self) -> int:
        return int(self._starts[-1])

    def position(self, g: int) -> tuple[int, int]:
        if not 0 <= g <= self.total:
            raise IndexError(f"micro-batch {g} is outside the run (0..{self.total})")
        if g == self.total:
            return len(self.epoch_sizes), 0
        epoch = int(np.searchsorted(self._starts, g, side="right") - 1)
        return epoch, g - int(self._starts[epoch])

    def index(self, epoch: int, index: int) -> int:
        if epoch >= len(self.epoch_sizes):
            return self.total
        return int(self._starts[epoch]) + index


class InjectedFault(RuntimeError):
    """Raised at a fault point a test asked for."""


class FaultPoints:
    """Thread-safe counters of named points; `hit(name)` raises on the configured occurrence."""

    def __init__(self, spec: list[str] | None = None) -> None:
        self._at: dict[str, int] = {}
        self._hang: set[str] = set()
        for item in spec or []:
            name, _, rest = item.partition("@")
            count, _, action = rest.partition("=")
            if not name or not count.isdigit() or int(count) < 1 or action not in ("", "hang"):
                raise ValueError(f"fault point {item!r} must look like NAME@N or NAME@N=hang with N >= 1")
            self._at[name] = int(count)
            if action:
                self._hang.add(name)
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def hit(self, name: str, stop_event: threading.Event | None = None) -> None:
        if name not in self._at:
            return
        with self._lock:
            self._seen[name] = self._seen.get(name, 0) + 1
            fire = self._seen[name] == self._at[name]
        if fire and name in self._hang:
            (stop_event or threading.Event()).wait(120.0)
            return
        if fire:
            raise InjectedFault(f"injected fault at {name} (occurrence {self._at[name]})")
