"""Drafter replicas of a pipeline run: their identity check and their optimizer states in a checkpoint.

- `check_replicas`: every --checksum interval, each replica's bitwise weight checksum (trainer.pipeline.replica_sync),
  gathered from every node; under --sync grad every replica of the job must be identical, or the run fails
  naming the node and replica that differs (it would silently train apart otherwise).
- `replica_optimizer_states` / `node_share`: a checkpoint stores replica 0's optimizer state and, under
  --sync average, every other replica's (job-wide, node-major) under "pipeline_replicas". On resume node 0
  reads it and gives each node only its own replicas' states (`node_share`): the qwen3-8b drafter's AdamW state
  is 8.4 GB per replica, which a node should not receive for every replica of the job.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from typing import Any

from trainer.dist.cluster import Cluster
from trainer.pipeline.replica_sync import differing_parameters, replica_checksums
from trainer.state.checkpoint import CheckpointState


class ReplicaDivergenceError(RuntimeError):
    """Under --sync grad the replicas must stay bitwise identical; they did not."""


def check_replicas(sides: list[Any], sync_mode: str, step: int, cluster: Cluster) -> list[str]:
    """Log every replica's weight checksum (all nodes', node-major); under `grad` sync a difference is an error.
    Under `average` they agree right after each averaging step only. A collective in a distributed run: every
    node calls it at the same steps, and every node sees the same checksums, so all fail together."""
    local = replica_checksums([s.drafter for s in sides])
    per_node: list[list[str]] = cluster.all_gather(local, "checksums")
    checksums = [c for node in per_node for c in node]
    same = len(set(checksums)) == 1
    print(
        f"replica checksums at step {step}: {' '.join(checksums)} ({'identical' if same else 'different'})",
        file=sys.stderr,
        flush=True,
    )
    if sync_mode == "grad" and not same:
        if len(set(local)) > 1:
            first = "; ".join(differing_parameters([s.drafter for s in sides]))
            where = f"first differing: {first}"
        else:
            node = next(n for n, sums in enumerate(per_node) if sums[0] != per_node[0][0])
            where = f"node {node}'s replicas differ from node 0's"
        raise ReplicaDivergenceError(
            f"drafter replicas differ at step {step} under --sync grad (checksums "
            f"{', '.join(checksums)}; {where}): the gradient reduction or an optimizer "
            f"step is not deterministic"
        )
    return checksums


def replica_optimizer_states(state: CheckpointState, replicas: int) -> list[dict[str, Any]]:
    """One optimizer state per replica of the job: the stored ones under --sync average (when their number
    matches), else replica 0's for every replica (under --sync grad they are identical)."""
    base = dict(state.optimizer)
    stored = base.pop("pipeline_replicas", None)
    if stored and len(stored) == replicas - 1:
        return [base, *stored]
    return [base] * replicas


def node_share(state: CheckpointState, node: int, drafters_per_node: int, nodes: int) -> CheckpointState:
    """The part of a loaded checkpoint that `node` needs: everything but the optimizer, and its own replicas'
    optimizer states. No two replicas may share a moment tensor (they would update each other's: load_state_dict
    keeps a tensor already on the parameter's device and dtype), so a state given to several replicas is copied
    for every one but the last, which takes the loaded tensors (one copy fewer of 8.4 GB for the qwen3-8b)."""
    states = replica_optimizer_states(state, drafters_per_node * nodes)
    own = states[node * drafters_per_node : (node + 1) * drafters_per_node]
    shares = [copy.deepcopy(s) if any(s is later for later in own[i + 1 :]) else s for i, s in enumerate(own)]
    return dataclasses.replace(state, optimizer={"replicas": shares})
