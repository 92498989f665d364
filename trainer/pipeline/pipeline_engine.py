"""The threaded pipeline as an engine of trainer.training.loop; with a TorchCluster, the distributed engine.

Inside a node (unchanged from the threaded trainer): target threads (one TargetModel each: features() installs
hooks per call and is not thread safe) -> bounded (target, drafter) channels -> drafter threads, driven step by
step by the main thread (trainer.pipeline.coordinator); warm-up of every (replica x batch shape) in the main
thread before any worker starts, then a CompileGuard (docs/method.md#compiling).

The cluster (trainer.dist.cluster) is asked at fixed points, in the same order on every node:
  build         node 0's initial weights to every node (once: 4 bytes per parameter and buffer)
  every step    the step-wide normaliser (2 float64), the gradient sync (--sync grad: the node's summed
                gradient, 4 bytes per trainable parameter) or, every --sync-interval steps, the weight average
                (--sync average: the same size), and the stop agreement (one int64 per node)
  log steps     the metrics line's sums; every checksum interval, every replica's checksum
  checkpoints   --sync average: every replica's optimizer state to node 0 (8 bytes per parameter per replica)
With a LocalCluster all of these are the identity: the single-node threaded trainer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.core.config import TrainerInputError, target_compile_enabled
from trainer.data.batches import BatchStream, collate
from trainer.dist.cluster import Cluster, LocalCluster
from trainer.model import DFlashDrafter
from trainer.model.drafter import init_output_norm, start_from_target
from trainer.pipeline.assignment import Assignment, FaultPoints, GlobalOrder
from trainer.pipeline.channel import Channel, ChannelGroup
from trainer.pipeline.compile_guard import CompileGuard
from trainer.pipeline.coordinator import Coordinator, DrafterHandle
from trainer.pipeline.drafter_worker import DrafterWorker
from trainer.pipeline.options import PipelineOptions
from trainer.pipeline.replica_sync import ReplicaSync
from trainer.pipeline.replicas import check_replicas, node_share
from trainer.pipeline.reporting import StepWindow, pipeline_checkpoint_parts
from trainer.pipeline.target_worker import TargetWorker
from trainer.pipeline.warmup import warm_up_drafters
from trainer.pipeline.worker_supervisor import Supervisor
from trainer.state.checkpoint import CheckpointState, restore_rng
from trainer.state.handover import free_device_memory
from trainer.state.metrics import RunRecorder
from trainer.training.loss import position_weights
from trainer.training.preflight import RunSetup, load_target, resolve_devices
from trainer.training.step import DrafterSide, TargetSide, noise_std_at


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PipelineEngine:
    """trainer.training.engine.Engine for the threaded pipeline on this node's devices, `cluster` joining the nodes."""

    def __init__(self, setup: RunSetup, options: PipelineOptions, cluster: Cluster | None = None) -> None:
        """Every check that can refuse the run (devices, data for one step); writes nothing."""
        self.setup, self.cfg, self.options = setup, setup.cfg, options
        self.cluster = cluster or LocalCluster()
        cfg = self.cfg
        self.target_devices = resolve_devices(cfg.target_gpus, "target-gpus")
        self.drafter_devices = resolve_devices(cfg.drafter_gpus, "drafter-gpus")
        self.assignment = Assignment(
            len(self.target_devices), len(self.drafter_devices), cfg.grad_accum, self.cluster.nodes, self.cluster.rank
        )
        self.sync_mode = cfg.sync if self.assignment.total_drafters > 1 else "grad"
        self.faults = FaultPoints(options.faults)
        self.slot_weights = position_weights(cfg.block_size, cfg.gamma).numpy()
        self.stream = BatchStream(setup.dataset, cfg, self.slot_weights, known_sizes=setup.epoch_sizes)
        enough = cfg.max_steps * self.assignment.per_step if cfg.max_steps else None  # None: every epoch
        self.order = GlobalOrder(self.stream.epoch_sizes(enough))
        steps_in_data = self.order.total // self.assignment.per_step
        self.total_steps = min(cfg.max_steps, steps_in_data) if cfg.max_steps else steps_in_data
        if self.total_steps < 1:
            raise TrainerInputError(
                f"--data-dir: the data holds {self.order.total} micro-batches, fewer than one "
                f"optimizer step of the pipeline ({self.assignment.per_step} = drafters x "
                f"--grad-accum{' x nodes' if self.cluster.nodes > 1 else ''})"
            )
        self.writes_metrics = self.writes_checkpoints = self.cluster.rank == 0
        self.supervisor: Supervisor | None = None
        self.failure: BaseException | None = None
        self.g_start = 0  # the first micro-batch this process trains (0, or the resumed position)
        self.warmed: set[tuple[int, int]] = set()  # (rows, padded length) shapes the replicas are compiled for
        self.steps_done = 0
        self._told_stop = False

    def announce(self, run_dir: Path) -> list[str]:
        return [
            f"run directory {run_dir.resolve()} ({self.total_steps} steps, sync {self.sync_mode})",
            *self.cluster.describe(),
            self.assignment.describe([str(d) for d in self.target_devices], [str(d) for d in self.drafter_devices]),
        ]

    def build(self) -> None:
        cfg, setup = self.cfg, self.setup
        started = time.monotonic()
        targets = [load_target(setup, d) for d in self.target_devices]
        loaded = time.monotonic()
        self.target_sides = [
            TargetSide(
                t,
                d,
                soft_labels=cfg.use_soft_labels,
                compile=target_compile_enabled(cfg.target_compile, d),
                compile_backend=self.options.compile_backend,
            )
            for t, d in zip(targets, self.target_devices)
        ]
        compile_kw: dict[str, Any] = (
            dict(compile=True, compile_backend=self.options.compile_backend) if self.options.compile_backend else {}
        )
        if setup.resume_from is not None and not self.cluster.distributed:
            # Resuming on one node: every weight is overwritten by the checkpoint, so each replica is made on its
            # device (a GPU's init takes milliseconds) instead of a CPU init and a copy per replica (qwen3-8b:
            # ~16 s of a restart, bench/results/restart.md 2026-12-02 "The whole restart cycle of the 8B-shaped pipeline"). The RNG is restored from the checkpoint after.
            replicas = [self._drafter_on(d) for d in self.drafter_devices]
        else:
            torch.manual_seed(cfg.seed)  # the drafter's init is a function of --seed, as in the single-process engine
            # One node: initialised on the first drafter device (a GPU takes milliseconds, the CPU ~17 s for the
            # qwen3-8b drafter's 1.05 B parameters: bench/results/restart.md 2026-12-02 "Where the child's start goes"), so the values depend on the seed
            # and the device type. Several nodes: on the CPU, which the weight broadcast (gloo) sends from.
            home = torch.device("cpu") if self.cluster.distributed else self.drafter_devices[0]
            with torch.device(home):
                base = DFlashDrafter(setup.drafter_config)
            if cfg.init_from is not None and self.cluster.rank == 0:
                base.load_state_dict(DFlashDrafter.from_pretrained(cfg.init_from).state_dict())
            elif cfg.drafter_init == "target" and self.cluster.rank == 0:  # the others get it by the broadcast
                _log(start_from_target(base, targets[0]))
            elif cfg.output_norm_init == "calibrated":
                init_output_norm(base, targets[0].embed_weight, targets[0].lm_head_weight, cfg)
            self.cluster.broadcast_module_(base)  # every node starts from node 0's weights (--init-from: its file)
            # The last replica is the base itself: one copy fewer of the weights on the device at once.
            replicas = [copy.deepcopy(base) for _ in self.drafter_devices[:-1]] + [base]
        self.sides = [
            DrafterSide(
                cfg, drafter, targets[0].embed_weight, targets[0].lm_head_weight, d, self.total_steps, **compile_kw
            )
            for drafter, d in zip(replicas, self.drafter_devices)
        ]
        self._log_built(started, loaded)

    def _drafter_on(self, device: torch.device) -> DFlashDrafter:
        with torch.device(device):
            return DFlashDrafter(self.setup.drafter_config)

    def _log_built(self, started: float, loaded: float) -> None:
        _log(f"loss kernels: {', '.join(f'{side.device} {side.loss_kernels.kind}' for side in self.sides)}")
        layers = ", ".join(f"{t.device} {t.layers}" for t in self.target_sides)
        _log(f"target layers: {layers} (--target-compile {self.cfg.target_compile})")
        attention = ", ".join(f"{side.device} {side.backend}" for side in self.sides)
        _log(f"drafter attention: {attention} (--attention-kernel {self.cfg.attention_kernel})")
        _log(
            f"built in {time.monotonic() - started:.1f} s: target(s) {loaded - started:.1f} s, "
            f"drafter replicas {time.monotonic() - loaded:.1f} s"
        )

    def load_checkpoint(self, path: Path) -> CheckpointState:
        drafters, nodes = self.assignment.num_drafters, self.cluster.nodes
        return self.cluster.load_checkpoint(
            path, lambda state, node: node_share(state, node, drafters, nodes), device=self.drafter_devices[0]
        )

    def restore(self, state: CheckpointState) -> tuple[int, str]:
        for side, optimizer in zip(self.sides, state.optimizer["replicas"]):
            side.drafter.load_state_dict(state.model)
            side.restore_optimizer(optimizer, state.scheduler)
        restore_rng(state.rng)
        self.g_start = self.order.index(state.epoch, state.index)
        return state.step, f"epoch {state.epoch}, batch {state.index}, micro-batch {self.g_start}"

    def _make_batch(self, g: int, stream: BatchStream) -> Any:
        epoch, index = self.order.position(g)
        return collate(
            self.setup.dataset, stream.epoch_batches(epoch)[index], epoch, index, self.cfg, self.slot_weights
        )

    def warm_up(self, step: int, position: tuple[int, int] | None, recorder: RunRecorder) -> None:
        """Compile every replica for every batch shape of the steps from `step` on, whose first micro-batch is
        at data position `position` (epoch, index), before the checkpoint is read: on a restart this overlaps
        the stopped run's final write. A distributed run warms up in `running`, once every node knows it."""
        if position is None or self.cluster.distributed:
            return
        self._warm_up(step, self.order.index(*position), recorder)

    def _g_end(self, step: int, g_start: int) -> int:
        """One past the last micro-batch of the steps from `step` on, whose first is `g_start`."""
        return g_start + (self.total_steps - step) * self.assignment.per_step

    def _warm_up(self, step: int, g_start: int, recorder: RunRecorder) -> None:
        g_end = self._g_end(step, g_start)
        recorder.set_status(phase="compiling")
        report, self.warmed = warm_up_drafters(
            self.sides,
            self.target_sides,
            lambda g: self._make_batch(g, self.stream),
            self.stream,
            self.order,
            g_start,
            g_end,
            owns=self.assignment.owns,
            done=self.warmed,
        )
        if report.seconds_per_variant:
            _log(report.summary())
            if self.options.on_warmup is not None:
                self.options.on_warmup(report)

    @contextlib.contextmanager
    def running(self, step: int, recorder: RunRecorder) -> Iterator[None]:
        self._start_sync()
        self.start_step = self.steps_done = step
        g_start, g_end = self.g_start, self._g_end(step, self.g_start)
        if self.cluster.distributed:  # status.json says which node of the run this directory belongs to
            recorder.set_status(node=self.cluster.rank, nodes=self.cluster.nodes)
        recorder.set_status(step=step)
        self._warm_up(step, g_start, recorder)  # the shapes `warm_up` did not cover (all, if it was not called)
        self.channels = channels = ChannelGroup(threading.Event())
        self.supervisor = supervisor = Supervisor(channels, join_timeout_s=self.options.join_timeout_s)
        feature_channels, handles = self._open_channels(channels)
        with CompileGuard() as guard:
            self._spawn_drafters(supervisor, feature_channels, handles)
            self._spawn_targets(supervisor, feature_channels, g_start, g_end)
            self.coordinator = self._coordinator(supervisor, handles, guard)
            recorder.set_status(phase="training", step=step)
            self.window = StepWindow(len(self.sides), supervisor)
            yield

    def _start_sync(self) -> None:
        """The replicas' ReplicaSync (summed across nodes when there are several); followers drop their moments."""
        # One node: nothing to sum across, and the flat copies of every gradient would cost time (qwen3-8b: three
        # 4.2 GB copies per step); the job is then the threaded pipeline plus a few tiny control collectives.
        across = self.cluster.all_reduce_sum_ if self.cluster.nodes > 1 else None
        self.sync = ReplicaSync(
            [s.drafter for s in self.sides],
            self.sync_mode,
            self.cfg.sync_interval,
            across=across,
            world=self.assignment.total_drafters,
        )
        for side in self.sides[
            1:
        ]:  # replica 0 steps for every replica on its device (trainer/pipeline/replica_sync.py)
            side.follower = self.sync.followers
            if side.follower:
                side.optimizer.state.clear()  # a resumed follower's moments: never read (8 B/param)

    def _open_channels(self, channels: ChannelGroup) -> tuple[dict[tuple[int, int], Channel[Any]], list[DrafterHandle]]:
        """A bounded feature channel per (target, drafter) pair; each drafter's command and result channels."""
        feature_channels = {
            pair: channels.new(f"target{pair[0]}->drafter{pair[1]}", self.options.queue_capacity)
            for pair in self.assignment.channel_pairs()
        }
        handles = [
            DrafterHandle(
                f"drafter{d}", channels.new(f"drafter{d}.commands", 1), channels.new(f"drafter{d}.results", 1)
            )
            for d in range(len(self.sides))
        ]
        return feature_channels, handles

    def _spawn_drafters(
        self,
        supervisor: Supervisor,
        feature_channels: dict[tuple[int, int], Channel[Any]],
        handles: list[DrafterHandle],
    ) -> None:
        """One DrafterWorker thread per replica, reading its targets' channels and its handle's commands."""
        for d, (side, handle) in enumerate(zip(self.sides, handles)):
            inputs = {t: ch for (t, dd), ch in feature_channels.items() if dd == d}
            supervisor.spawn(
                handle.name,
                "drafter",
                DrafterWorker(
                    handle.name,
                    self.assignment.first_drafter + d,
                    side,
                    inputs,
                    handle.commands,
                    handle.results,
                    self.assignment,
                    supervisor,
                    get_timeout_s=self.options.worker_timeout_s,
                    faults=self.faults,
                ),
            )

    def _spawn_targets(
        self,
        supervisor: Supervisor,
        feature_channels: dict[tuple[int, int], Channel[Any]],
        g_start: int,
        g_end: int,
    ) -> None:
        """One TargetWorker thread per target, with its own BatchStream, for its micro-batches of [g_start, g_end)."""
        for t, target_side in enumerate(self.target_sides):
            own_stream = BatchStream(self.setup.dataset, self.cfg, self.slot_weights)
            outputs = {dd: ch for (tt, dd), ch in feature_channels.items() if tt == t}
            supervisor.spawn(
                f"target{t}",
                "target",
                TargetWorker(
                    f"target{t}",
                    target_side,
                    functools.partial(self._make_batch, stream=own_stream),
                    self.assignment.indices_of_target(t, g_start, g_end),
                    outputs,
                    self.drafter_devices,
                    self.assignment,
                    supervisor,
                    transfer=self.options.feature_transfer,
                    put_timeout_s=self.options.worker_timeout_s,
                    faults=self.faults,
                ),
            )

    def _coordinator(self, supervisor: Supervisor, handles: list[DrafterHandle], guard: CompileGuard) -> Coordinator:
        """The main thread's Coordinator, which drives the drafters step by step."""
        cfg, options = self.cfg, self.options
        return Coordinator(
            supervisor,
            handles,
            self.sync,
            lambda k: noise_std_at(k, self.total_steps, cfg.noise_start, cfg.noise_end),
            cfg.seed,
            guard=guard,
            stall_warn_s=options.stall_warn_s,
            stall_abort_s=options.stall_abort_s,
            log=_log,
            step_totals=self._step_totals if self.cluster.distributed else None,
        )

    def _step_totals(self, weight_sum: float, num_blocks: int) -> tuple[float, int]:
        """The step-wide normaliser over every node: one all-reduce of 2 float64 (the same on every node)."""
        totals = torch.tensor([weight_sum, float(num_blocks)], dtype=torch.float64)
        self.cluster.all_reduce_sum_(totals, "normaliser")
        return float(totals[0]), int(totals[1])

    def _position(self, step: int) -> tuple[int, int, int]:
        """(g, epoch, index) of the next micro-batch to read after `step` steps."""
        g_next = self.g_start + (step - self.start_step) * self.assignment.per_step
        return (g_next, *self.order.position(g_next))

    def train_step(self, step: int) -> None:
        self.cluster.at_step(step)
        self.window.add(self.coordinator.step(step))
        self.steps_done = step + 1

    def after_step(self, step: int) -> dict[str, Any] | None:
        if self.options.on_step is not None:
            self.options.on_step(step, self.sides)
        if self.assignment.total_drafters > 1 and (
            step % self.options.checksum_interval == 0 or step == self.total_steps
        ):
            return {"replica_checksums": check_replicas(self.sides, self.sync_mode, step, self.cluster)}
        return None

    def agree_stop(self, signum: int | None) -> int | None:
        asked = self.cluster.agree_stop(signum)
        if not any(asked):
            return None
        if self.cluster.nodes > 1 and not self._told_stop:
            self._told_stop = True
            who = ", ".join(f"node {n} ({signal.Signals(s).name})" for n, s in enumerate(asked) if s)
            _log(f"stop requested on {who}: every node stops after step {self.steps_done}")
        return max(asked)

    def record(self, step: int) -> dict[str, Any]:
        cfg = self.cfg
        _, epoch, _ = self._position(step)
        return self.window.record(
            step,
            epoch,
            self.total_steps,
            self.channels,
            self.drafter_devices,
            noise_std_at(step - 1, self.total_steps, cfg.noise_start, cfg.noise_end),
            self.cluster,
        )

    def checkpoint_parts(self, step: int) -> dict[str, Any] | None:
        self.sync.before_checkpoint()
        g_next, epoch, index = self._position(step)
        states = None
        if self.sync_mode == "average" and self.assignment.total_drafters > 1:
            per_node = self.cluster.gather_to_writer([s.optimizer.state_dict() for s in self.sides], "checkpoint")
            states = None if per_node is None else [s for node in per_node for s in node]
        if not self.writes_checkpoints:
            return None
        return pipeline_checkpoint_parts(
            self.cfg,
            self.sides,
            self.sync_mode,
            epoch,
            index,
            self.assignment,
            g_next,
            replica_optimizers=states,
            nodes=self.cluster.nodes if self.cluster.distributed else None,
        )

    def checkpoint_layout(self) -> dict[str, Any] | None:
        if not self.writes_checkpoints:
            return None
        optimizers = [s.optimizer.state_dict() for s in (self.sides if self.sync_mode == "average" else self.sides[:1])]
        return {"model": self.sides[0].drafter.state_dict(), "optimizer": optimizers}

    def finish(self) -> None:
        self.cluster.barrier("finish")

    def release_devices(self) -> dict[str, int]:
        self._stop_workers()
        for name in ("sides", "target_sides", "channels", "coordinator", "sync", "window"):
            self.__dict__.pop(name, None)  # the replicas, optimizers, targets and queued features
        return free_device_memory([*self.target_devices, *self.drafter_devices])

    def close(self, failure: BaseException | None) -> None:
        self.failure = failure  # trainer.distributed_run tells the other nodes (the cluster outlives the engine)
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self.supervisor is not None:
            stuck = self.supervisor.shutdown()
            self.supervisor = None
            if stuck:
                _log(
                    f"warning: worker thread(s) {', '.join(stuck)} did not stop within "
                    f"{self.options.join_timeout_s:.0f} s"
                )
