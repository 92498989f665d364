"""`run_distributed(cfg)`: one node of a distributed run, started by torchrun (one process per node).

On every node:
    torchrun --nnodes N --node-rank R --master-addr ADDR --master-port PORT --nproc-per-node 1 \\
        -m trainer train --nodes N --output-dir RUN_DIR_OF_THIS_NODE [the same flags on every node]
  1. torchrun's environment -> (rank, nodes) (trainer.dist.rendezvous), or bad input before anything
  2. join the job (torch.distributed; bounded by --dist-timeout), heartbeats start
  3. pre-flight on every node (node 0 also resolves --resume and reads --init-from), then one all_gather of
     every node's code hash, configuration and pre-flight outcome: every node refuses together, naming the node
     that differs, before anything is written (exit 2)
  4. trainer.training.loop.run_training with the pipeline engine over a TorchCluster (trainer.pipeline.pipeline_engine): each
     node runs its threaded pipeline on its own devices and the nodes meet in collectives every step
What each node writes into its --output-dir: train_config.json and status.json (phase, step, heartbeat, exit
code); node 0 also metrics.jsonl (the job's metrics) and checkpoints/ (written once, for the whole job).
Exit codes as `python -m trainer train`: 0 done, 1 failed (a lost node: one `error:` line naming it), 2 bad
input, 128+signum stopped (a SIGTERM to any node stops every node after the same step, with a checkpoint).
"""

from __future__ import annotations

import sys

import torch

from trainer.core.config import TrainConfig, TrainerInputError
from trainer.dist.rendezvous import agree_on_start, node_fingerprint, torchrun_node
from trainer.dist.torch_cluster import TorchCluster
from trainer.pipeline.options import PipelineOptions
from trainer.pipeline.pipeline_engine import PipelineEngine
from trainer.state.failure import ExplainedFailure
from trainer.training.loop import EXIT_FAILED, run_training
from trainer.training.preflight import preflight


def _cuda_device(cfg: TrainConfig) -> torch.device | None:
    """The drafters' first CUDA device (NCCL's device for this process), or None for a CPU run (gloo)."""
    names = cfg.drafter_gpus or (["cuda:0"] if torch.cuda.is_available() else ["cpu"])
    device = torch.device(names[0])
    return device if device.type == "cuda" else None


def run_distributed(cfg: TrainConfig, options: PipelineOptions | None = None) -> int:
    """Run this node's share of the job; return its exit code (see module doc)."""
    options = options or PipelineOptions.from_config(cfg)
    options.check()
    rank, nodes = torchrun_node(cfg)
    fingerprint = node_fingerprint(cfg)  # before the pre-flight fills in derived fields
    try:
        cluster = TorchCluster.connect(rank, nodes, cfg.dist_timeout, _cuda_device(cfg))
    except RuntimeError as exc:  # the rendezvous timed out or failed: nothing written yet
        print(
            f"error: node {rank} could not join the run's {nodes} nodes: {str(exc).splitlines()[0][:300]}",
            file=sys.stderr,
        )
        print(
            f"hint: start torchrun on every node within --dist-timeout ({cfg.dist_timeout:.0f} s) with the same "
            "--master-addr/--master-port, reachable from every node",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_FAILED
    engine: PipelineEngine | None = None
    failure: BaseException | None = None
    try:
        setup, refusal = None, None
        try:
            setup = preflight(cfg, reads_checkpoints=rank == 0)
            engine = PipelineEngine(setup, options, cluster)
        except TrainerInputError as exc:
            refusal = exc
        resume_from = agree_on_start(cluster, fingerprint, refusal, setup.resume_from if setup else None)
        assert setup is not None and engine is not None
        setup.resume_from = resume_from  # node 0's checkpoint; node 0 sends its contents to the others
        code = run_training(setup, engine)
        failure = engine.failure
        return code
    except ExplainedFailure as exc:  # a node lost during the start agreement: no run directory yet
        failure = exc
        print(f"error: {exc.message}", file=sys.stderr)
        print(f"hint: {exc.hint}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    except TrainerInputError as exc:  # every node refuses (trainer.train prints it)
        failure = exc
        raise
    finally:
        cluster.close(failure)
