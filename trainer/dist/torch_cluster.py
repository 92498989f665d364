"""The nodes of a distributed run, joined by torch.distributed (torchrun: one process per node).

Groups: the default process group uses NCCL when the drafters are on CUDA (the gradient / weight buffers, on
the GPU) and gloo otherwise; everything else (normaliser, stop flags, checksums, metrics sums, checkpoint
transfers: CPU values) goes through a gloo group, the default one on the CPU. Every collective is bounded by
--dist-timeout (the process groups' timeout; NCCL work is additionally polled against it from the host, so a
dead peer cannot block a CUDA sync forever), and a failing one becomes NodeLost, naming the node that went
away (trainer.dist.liveness) and the step: one `error:` and one `hint:` line, exit 1, on every survivor.

Bytes: each call counts what this node hands to the collective (numel x element size; pickled size for
objects) under a kind (grad, average, normaliser, stop, metrics, checksums, setup, checkpoint, finish);
`take_traffic` reports them per metrics window. A ring all-reduce of S bytes puts 2 (N-1)/N x S on each
node's link in each direction, so for two nodes the wire carries what is counted here.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from trainer.state.checkpoint import CheckpointState, load_checkpoint
from trainer.dist.cluster import Splitter
from trainer.dist.liveness import Liveness, heartbeat_interval
from trainer.dist.transfer import recv_nest, send_nest
from trainer.state.failure import ExplainedFailure

T = TypeVar("T")


class NodeLost(ExplainedFailure):
    """A collective failed or timed out: a node died, or the network between nodes failed."""


class TorchCluster:
    """trainer.dist.cluster.Cluster over torch.distributed. Create with `connect`."""

    distributed = True

    def __init__(self, rank: int, nodes: int, backend: str, control: Any, timeout_s: float, liveness: Liveness) -> None:
        self.rank, self.nodes, self.backend = rank, nodes, backend
        self.control = control  # gloo group for CPU values (None: the default group, itself gloo)
        self.timeout_s = timeout_s
        self.liveness = liveness
        self.hosts: list[str] = [f"rank {r}" for r in range(nodes)]  # "host (pid N)", set at the start agreement
        self.step = 0  # the step being trained, 1-based as in the log lines
        self.failed = False
        self._traffic: Counter[str] = Counter()

    @classmethod
    def connect(cls, rank: int, nodes: int, timeout_s: float, cuda_device: torch.device | None) -> TorchCluster:
        """Join the job torchrun started (env:// rendezvous: MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), bounded by
        `timeout_s`. NCCL when the drafters are on `cuda_device`, gloo otherwise."""
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if cuda_device is not None else "gloo"
        if cuda_device is not None:
            torch.cuda.set_device(cuda_device)
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=nodes)
        control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        store = dist.distributed_c10d._get_default_store()
        return cls(rank, nodes, backend, control, timeout_s, Liveness(store, rank, nodes, heartbeat_interval(timeout_s)))

    def describe(self) -> list[str]:
        return [f"node {self.rank} of {self.nodes} ({self.backend}, --dist-timeout {self.timeout_s:.0f} s): "
                + ", ".join(f"node {r} {host}" for r, host in enumerate(self.hosts))]

    def at_step(self, step: int) -> None:
        self.step = step + 1

    # ---- collectives -------------------------------------------------------------------------------------
    def _run(self, kind: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RuntimeError as exc:  # gloo/NCCL errors, DistError and its subclasses, our own timeout
            raise self._lost(kind, exc) from exc

    def _wait(self, work: Any, on_gpu: bool) -> None:
        if on_gpu:  # NCCL: poll the completion from the host against the timeout (a CUDA sync would not return)
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no completion within --dist-timeout {self.timeout_s:.0f} s")
                time.sleep(0.001)
        work.wait()  # gloo: raises on failure, bounded by the group's timeout

    def all_reduce_sum_(self, tensor: torch.Tensor, kind: str) -> None:
        self._traffic[kind] += tensor.numel() * tensor.element_size()
        group = None if tensor.is_cuda else self.control
        self._run(kind, lambda: self._wait(dist.all_reduce(tensor, group=group, async_op=True), tensor.is_cuda))

    def all_gather(self, value: Any, kind: str) -> list[Any]:
        self._traffic[kind] += len(pickle.dumps(value))
        out: list[Any] = [None] * self.nodes
        self._run(kind, lambda: dist.all_gather_object(out, value, group=self.control))
        return out

    def agree_stop(self, signum: int | None) -> list[int]:
        mine = torch.tensor([signum or 0], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.nodes)]
        self._traffic["stop"] += 8
        self._run("stop agreement", lambda: dist.all_gather(out, mine, group=self.control))
        return [int(t) for t in out]

    def broadcast_module_(self, module: nn.Module) -> None:
        for tensor in module.state_dict().values():
            self._traffic["setup"] += tensor.numel() * tensor.element_size()
            self._run("initial weight broadcast", functools.partial(dist.broadcast, tensor, src=0, group=self.control))

    def load_checkpoint(self, path: Path, split: Splitter, device: torch.device | None = None) -> CheckpointState:
        """Node 0 reads the checkpoint and sends every other node its share; the others never touch the disk,
        so resuming needs no storage shared between nodes (and works the same with it)."""
        def transfer() -> CheckpointState:
            if self.rank == 0:
                state = load_checkpoint(path)
                for node in range(1, self.nodes):
                    share = split(state, node)
                    self._traffic["checkpoint"] += send_nest(
                        {f.name: getattr(share, f.name) for f in dataclasses.fields(share)}, node, self.control)
                return split(state, 0)
            fields, received = recv_nest(0, self.control)
            self._traffic["checkpoint"] += received
            return CheckpointState(**fields)
        return self._run("checkpoint transfer", transfer)

    def gather_to_writer(self, value: Any, kind: str) -> list[Any] | None:
        def gather() -> list[Any] | None:
            if self.rank != 0:
                self._traffic[kind] += send_nest(value, 0, self.control)
                return None
            out = [value]
            for node in range(1, self.nodes):
                received, count = recv_nest(node, self.control)
                self._traffic[kind] += count
                out.append(received)
            return out
        return self._run(kind, gather)

    def barrier(self, kind: str) -> None:
        self.all_reduce_sum_(torch.zeros(1, dtype=torch.int64), kind)

    def take_traffic(self) -> dict[str, int]:
        traffic, self._traffic = dict(self._traffic), Counter()
        return traffic

    # ---- failures and the end ----------------------------------------------------------------------------
    def _lost(self, kind: str, exc: BaseException) -> NodeLost:
        self.failed = True
        lost = self.liveness.lost_nodes()
        if lost is None:
            who = f"lost node 0 ({self.hosts[0]}), which hosts the job's rendezvous store: it cannot be reached"
        elif lost:
            silent = 2.5 * self.liveness.interval_s
            who = "lost " + ", ".join(f"node {r} ({self.hosts[r]})" for r in lost) + f": no heartbeat for {silent:.1f} s"
            reasons = [(r, self.liveness.failure_of(r)) for r in lost]
            who += "".join(f"; node {r} failed: {reason}" for r, reason in reasons if reason)
        else:
            who = ("lost a link between nodes: every node's heartbeat is alive, so the network failed or was slower "
                   f"than --dist-timeout {self.timeout_s:.0f} s")
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # gloo prefixes its source file and line and appends advice on reading the other node's log
        detail = detail.split("] ", 1)[-1].split(". This is typically caused")[0][:300]
        return NodeLost(f"{who} (node {self.rank} noticed in the {kind} collective of step {self.step}: {detail})",
                        hint=f"every node of the run stops (each collective waits at most --dist-timeout "
                             f"{self.timeout_s:.0f} s); see the lost node's train.log for why it went away, then "
                             "start every node again with the same command: they resume from node 0's last "
                             "checkpoint")

    def close(self, failure: BaseException | None = None) -> None:
        """Leave the job. After this node's own `failure` (not a lost peer), its error is left for the others."""
        if failure is not None and not self.failed:
            self.liveness.publish_failure(f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}")
        self.liveness.close()
        if failure is None and not self.failed and dist.is_initialized():
            dist.destroy_process_group()  # after a failure a dead peer could block this: the process just exits
