"""Before any node trains: the torchrun environment, and the nodes' agreement on code, config and input.

- `torchrun_node(cfg)`: this process's (rank, nodes) from torchrun's environment, or a refusal: --nodes N
  without torchrun, torchrun's --nnodes different from --nodes, more than one process per node.
- `node_fingerprint(cfg)`: a hash of the trainer code this process runs (every trainer/**/*.py) and its
  configuration, minus what is per node by nature (--output-dir, --resume: node 0's counts; device names:
  their number counts).
- `agree_on_start(...)`: one all_gather of every node's fingerprint and pre-flight outcome, right after the
  rendezvous. Every node sees the same list and so refuses together, naming the first node that differs (its
  code, a flag, or its own pre-flight error); nothing has been written on any node then. Returns node 0's
  resume checkpoint (node 0 decides whether the run resumes; the others learn it here). Refuses, too, when
  another node's run directory holds checkpoints and node 0's none (the ranks moved between launches).
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path
from typing import Any

from trainer.state.checkpoint import list_checkpoints
from trainer.core.config import TrainConfig, TrainerInputError
from trainer.dist.cluster import Cluster

PER_NODE_KEYS = ("output_dir", "resume")
LAUNCH = ("torchrun --nnodes N --node-rank R --master-addr ADDR --master-port PORT --nproc-per-node 1 "
          "-m trainer train ... --nodes N")


def torchrun_node(cfg: TrainConfig) -> tuple[int, int]:
    """(rank, nodes) of this process; TrainerInputError when torchrun did not start it as one node of --nodes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise TrainerInputError(f"--nodes {cfg.nodes}: a run on several nodes is started by torchrun, one process "
                                "per node", hint=f"on every node: {LAUNCH}")
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if per_node != 1:
        raise TrainerInputError(f"torchrun --nproc-per-node {per_node}: the trainer runs one process per node (its "
                                "threads use every device of --target-gpus/--drafter-gpus)",
                                hint="start torchrun with --nproc-per-node 1 and list the node's GPUs in "
                                     "--target-gpus/--drafter-gpus")
    if world != cfg.nodes:
        raise TrainerInputError(f"--nodes {cfg.nodes}: torchrun started {world} node(s) (its --nnodes)",
                                hint="give --nodes the same number as torchrun's --nnodes")
    return rank, world


def code_hash() -> str:
    """sha256 over the trainer package's Python sources (relative path and bytes, in path order)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def comparable_config(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration every node must share (see module doc)."""
    values = {k: v for k, v in cfg.to_dict().items() if k not in PER_NODE_KEYS}
    values["target_gpus"], values["drafter_gpus"] = len(cfg.target_gpus), len(cfg.drafter_gpus)
    return values


def node_fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    """Taken before the pre-flight (which fills in derived fields such as the vocabulary size). `checkpoint`: the
    newest checkpoint in this node's own run directory (only node 0's are read; see agree_on_start)."""
    found = list_checkpoints(Path(cfg.output_dir or "."))
    return {"host": f"{socket.gethostname()} (pid {os.getpid()})", "code": code_hash(),
            "config": comparable_config(cfg), "resume_mode": cfg.resume,
            "checkpoint": str(found[-1][1]) if found else None}


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def agree_on_start(cluster: Cluster, fingerprint: dict[str, Any], refusal: TrainerInputError | None,
                   resume_from: Path | None) -> Path | None:
    """Exchange fingerprints and pre-flight outcomes; refuse (the same error on every node) or return node 0's
    resume checkpoint. Sets `cluster.hosts`."""
    mine = {**fingerprint, "refusal": None if refusal is None else (refusal.message, refusal.hint),
            "resume": None if resume_from is None else str(resume_from)}
    everyone = cluster.all_gather(mine, "setup")
    cluster.hosts = [node["host"] for node in everyone]  # type: ignore[attr-defined]
    if refusal is not None:
        raise refusal
    for rank, node in enumerate(everyone):
        if node["refusal"] is not None:
            raise TrainerInputError(f"node {rank} ({node['host']}) refused to start: {node['refusal'][0]}",
                                    hint=f"fix what node {rank}'s train.log names, then start every node again")
    first = everyone[0]
    for rank, node in enumerate(everyone[1:], start=1):
        if node["code"] != first["code"]:
            raise TrainerInputError(f"node {rank} ({node['host']}) runs other trainer code than node 0 (code hash "
                                    f"{node['code'][:12]} there, {first['code'][:12]} on node 0)",
                                    hint="deploy the same release to every node, then start every node again")
        for key in sorted(set(first["config"]) | set(node["config"])):
            theirs, ours = node["config"].get(key), first["config"].get(key)
            if theirs != ours:
                raise TrainerInputError(f"node {rank} ({node['host']}) was started with another configuration than "
                                        f"node 0: {_flag(key)} is {theirs!r} there, {ours!r} on node 0",
                                        hint="start every node with the same flags (only --output-dir, --resume "
                                             "and the device names may differ)")
    if first["resume"] is None and first["resume_mode"] == "auto":
        # Only node 0 reads checkpoints. If another node's run directory holds some and node 0's none, the nodes
        # changed ranks since that run (a c10d rendezvous hands out ranks by arrival): starting now would
        # silently begin the run again from step 0.
        holders = [(rank, node) for rank, node in enumerate(everyone) if node["checkpoint"]]
        if holders:
            rank, node = holders[0]
            raise TrainerInputError(f"node {rank} ({node['host']}) holds the run's checkpoints ({node['checkpoint']}) "
                                    "but node 0, which reads them for every node, has none: the nodes' ranks "
                                    "changed since they were written",
                                    hint=f"start that node as node 0 (torchrun --node-rank 0 there; a static "
                                         "rendezvous keeps the ranks), or pass --resume never to start over")
    return None if first["resume"] is None else Path(first["resume"])
