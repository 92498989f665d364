"""`run_pipeline(cfg)`: the threaded multi-drafter trainer (`--target-gpus A,B --drafter-gpus C,D` or `--pipeline`).

Same contract as the single-process trainer (trainer.train): checks that can refuse run before anything is
written; exit 0 done, 1 failed (status.json `failed`, the failing worker's traceback on stderr), 2 bad input,
128+signum after a signal-requested stop with its checkpoint. Order of events:
  1. plan (trainer.train.plan_run), devices, the micro-batch assignment (printed), run directory
  2. targets (one model per target worker: TargetModel.features is not thread safe),
     drafter replicas (one init, copied), their DrafterSides; resume restores every replica
  3. warm-up in the main thread: forward+backward for every (drafter device x batch shape the run will meet)
  4. CompileGuard on; workers start; the main thread runs the step loop (trainer.pipeline.coordinator)
  5. metrics / checkpoints / stop at step boundaries; shutdown joins every thread with a timeout
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.checkpoint import CheckpointWriter, load_checkpoint, restore_rng
from trainer.config import TrainConfig, TrainerInputError
from trainer.data import BatchStream, collate
from trainer.failure import record_failure
from trainer.loss import position_weights
from trainer.metrics import RunRecorder, truncate_metrics
from trainer.model import DFlashDrafter
from trainer.pipeline.channel import ChannelGroup
from trainer.pipeline.coordinator import Coordinator, DrafterHandle
from trainer.pipeline.drafter_worker import DrafterWorker
from trainer.pipeline.handoff import TRANSFER_MODES
from trainer.pipeline.plan import Assignment, FaultPoints, GlobalOrder
from trainer.pipeline.prime import warm_up_drafters
from trainer.pipeline.reporting import StepWindow, pipeline_checkpoint_parts
from trainer.pipeline.supervisor import Supervisor
from trainer.pipeline.sync import ReplicaSync, differing_parameters, replica_checksums
from trainer.pipeline.target_worker import TargetWorker
from trainer.pipeline.warmup import CompileGuard, WarmupReport
from trainer.signals import GracefulStop
from trainer.step import DrafterSide, TargetSide, noise_std_at
from trainer.loop import EXIT_FAILED, EXIT_OK, report_checkpoints, save_in_background
from trainer.preflight import load_target as _load_target
from trainer.preflight import plan_run


@dataclass
class PipelineOptions:
    """Pipeline knobs: queue depth, transfer mode and time limits (from the config by default), test hooks."""

    queue_capacity: int = 2  # feature batches per (target, drafter) channel: the memory bound
    feature_transfer: str = "device"  # device | pinned (trainer.pipeline.handoff)
    stall_warn_s: float = 120.0  # log which side starves after this long without a step
    stall_abort_s: float = 900.0  # then fail the run (also the bound on any single put/get)
    join_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> "PipelineOptions":
        """The knobs the command line sets (--queue-depth, --feature-transfer, --stall-timeout)."""
        return cls(queue_capacity=cfg.queue_depth, feature_transfer=cfg.feature_transfer,
                   stall_warn_s=min(120.0, cfg.stall_timeout / 2), stall_abort_s=cfg.stall_timeout)

    @property
    def worker_timeout_s(self) -> float:
        """A worker's own bound on one put/get: a backstop behind the main thread's stall limit, which fires
        first and says more (which side starves)."""
        return 2 * self.stall_abort_s + 10.0
    faults: list[str] = field(default_factory=list)  # test hook, see trainer.pipeline.plan.FaultPoints
    # Called in the main thread after every optimizer step with (step, drafter sides), every worker idle:
    # lets tests check replica identity and send signals at a known step.
    on_step: Callable[[int, list[DrafterSide]], None] | None = None
    on_warmup: Callable[[WarmupReport], None] | None = None  # bench/gpu_pipeline.py records warm-up time
    # Every this many steps (and at the last) each replica's weight checksum is logged; under --sync grad they
    # must be equal (bitwise identical replicas), and a difference fails the run.
    checksum_interval: int = 50
    # Test hook: compile every replica, on any device, with this dynamo backend ("eager" on the CPU exercises
    # dynamo's caches and guards across worker threads without inductor's code generation).
    compile_backend: str | None = None


def resolve_devices(names: list[str], flag: str) -> list[torch.device]:
    """Device strings -> devices; an unavailable CUDA device is bad input naming the flag."""
    devices = [torch.device(n) for n in (names or ["cuda:0" if torch.cuda.is_available() else "cpu"])]
    for device in devices:
        if device.type == "cuda":
            count = torch.cuda.device_count()
            if (device.index or 0) >= count:
                raise TrainerInputError(f"--{flag}: {device} does not exist (this machine has {count} CUDA device(s))",
                                        hint="list devices with nvidia-smi; use 'cpu' on a machine without GPUs")
        elif device.type != "cpu":
            raise TrainerInputError(f"--{flag}: unsupported device {device}", hint="use GPU indices or 'cpu'")
    return devices


class ReplicaDivergenceError(RuntimeError):
    """Under --sync grad the replicas must stay bitwise identical; they did not."""


def check_replicas(sides: list[DrafterSide], sync_mode: str, step: int) -> list[str]:
    """Log every replica's weight checksum; under `grad` sync a difference is an error (the replicas would
    silently train apart). Under `average` they agree right after each averaging step only."""
    checksums = replica_checksums([s.drafter for s in sides])
    same = len(set(checksums)) == 1
    _log(f"replica checksums at step {step}: {' '.join(checksums)} ({'identical' if same else 'different'})")
    if sync_mode == "grad" and not same:
        first = "; ".join(differing_parameters([s.drafter for s in sides]))
        raise ReplicaDivergenceError(f"drafter replicas differ at step {step} under --sync grad (checksums "
                                     f"{', '.join(checksums)}; first differing: {first}): the gradient "
                                     f"reduction or an optimizer step is not deterministic")
    return checksums


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_pipeline(cfg: TrainConfig, options: PipelineOptions | None = None) -> int:
    """Train per `cfg` with the threaded pipeline; return the exit code (see module doc)."""
    options = options or PipelineOptions.from_config(cfg)
    if options.feature_transfer not in TRANSFER_MODES:
        raise TrainerInputError(f"--feature-transfer: must be one of {', '.join(TRANSFER_MODES)}, got {options.feature_transfer!r}")
    if options.queue_capacity < 1:
        raise TrainerInputError(f"--queue-depth: must be >= 1, got {options.queue_capacity}")
    if options.checksum_interval < 1:
        raise TrainerInputError(f"replica checksum interval must be >= 1, got {options.checksum_interval}")
    plan = plan_run(cfg)
    target_devices = resolve_devices(cfg.target_gpus, "target-gpus")
    drafter_devices = resolve_devices(cfg.drafter_gpus, "drafter-gpus")
    assignment = Assignment(len(target_devices), len(drafter_devices), cfg.grad_accum)
    sync_mode = cfg.sync if len(drafter_devices) > 1 else "grad"
    faults = FaultPoints(options.faults)
    slot_weights = position_weights(cfg.block_size, cfg.gamma).numpy()
    stream = BatchStream(plan.dataset, cfg, slot_weights)
    order = GlobalOrder([len(stream.plan(e)) for e in range(cfg.epochs)])
    steps_in_data = order.total // assignment.per_step
    total_steps = min(cfg.max_steps, steps_in_data) if cfg.max_steps else steps_in_data
    if total_steps < 1:
        raise TrainerInputError(f"--data-dir: the data holds {order.total} micro-batches, fewer than one optimizer "
                                f"step of the pipeline ({assignment.per_step} = drafters x --grad-accum)")
    run_dir = Path(cfg.output_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    recorder = RunRecorder(run_dir, total_steps)
    supervisor: Supervisor | None = None
    writer: CheckpointWriter | None = None  # read by the failure report: a write that failed meanwhile
    try:
        _log(f"run directory {run_dir.resolve()} ({total_steps} steps, sync {sync_mode})")
        _log(assignment.describe([str(d) for d in target_devices], [str(d) for d in drafter_devices]))
        recorder.open_wandb(cfg.wandb, cfg.wandb_project, cfg.wandb_run_name, cfg.to_dict())
        # One TargetModel per worker, even on a shared device: TargetModel.features installs forward hooks per
        # call and is not thread safe (two workers on one model would capture each other's taps).
        targets = [_load_target(dataclasses.replace(plan, target_device=d)) for d in target_devices]
        target_sides = [TargetSide(t, d, soft_labels=cfg.use_soft_labels) for t, d in zip(targets, target_devices)]
        torch.manual_seed(cfg.seed)  # the drafter's init is a function of --seed, as in trainer.train
        base = DFlashDrafter(plan.drafter_config)
        if cfg.init_from is not None:
            base.load_state_dict(DFlashDrafter.from_pretrained(cfg.init_from).state_dict())
        any_target = targets[0]
        compile_kw = (dict(compile=True, compile_backend=options.compile_backend)
                      if options.compile_backend else {})
        sides = [DrafterSide(cfg, copy.deepcopy(base), any_target.embed_weight, any_target.lm_head_weight, d, total_steps,
                             **compile_kw)
                 for d in drafter_devices]
        _log(f"loss kernels: {', '.join(f'{side.device} {side.loss_kernels.kind}' for side in sides)}")
        step, g_start = 0, 0
        if plan.resume_from is not None:
            state = load_checkpoint(plan.resume_from)
            replicas_opt = state.optimizer.pop("pipeline_replicas", None)
            for number, side in enumerate(sides):
                side.drafter.load_state_dict(state.model)
                own = replicas_opt[number - 1] if number and replicas_opt and len(replicas_opt) == len(sides) - 1 else state.optimizer
                # A private copy per replica: load_state_dict keeps CPU tensors as they are, and replicas sharing
                # exp_avg/exp_avg_sq would each update the other's moments.
                side.optimizer.load_state_dict(copy.deepcopy(own))
                side.scheduler.load_state_dict(state.scheduler)
            restore_rng(state.rng)
            step, g_start = state.step, order.index(state.epoch, state.index)
            dropped = truncate_metrics(run_dir, step)
            _log(f"resumed from {plan.resume_from} at step {step} (epoch {state.epoch}, batch {state.index}, micro-batch "
                 f"{g_start}{f'; dropped {dropped} metrics lines past it' if dropped else ''})")
            recorder.set_status(step=step, last_checkpoint=str(plan.resume_from))
        sync = ReplicaSync([s.drafter for s in sides], sync_mode, cfg.sync_interval)
        start_step = step
        g_end = g_start + (total_steps - step) * assignment.per_step

        def make_batch(g: int, own_stream: BatchStream) -> Any:
            epoch, index = order.position(g)
            return collate(plan.dataset, own_stream.plan(epoch)[index], epoch, index, cfg, slot_weights)

        recorder.set_status(phase="compiling", step=step)
        report = warm_up_drafters(sides, target_sides[0], lambda g: make_batch(g, stream), stream, order, g_start, g_end)
        _log(report.summary())
        if options.on_warmup is not None:
            options.on_warmup(report)

        stop_event = threading.Event()
        channels = ChannelGroup(stop_event)
        supervisor = Supervisor(channels, join_timeout_s=options.join_timeout_s)
        feature_channels = {pair: channels.new(f"target{pair[0]}->drafter{pair[1]}", options.queue_capacity)
                            for pair in assignment.channel_pairs()}
        handles = [DrafterHandle(f"drafter{d}", channels.new(f"drafter{d}.commands", 1), channels.new(f"drafter{d}.results", 1))
                   for d in range(len(sides))]
        on_force = lambda signum: recorder.set_status(phase="failed", exit_code=128 + signum,
                                                      error=f"second signal {signum}: exited without a checkpoint")
        # The writer exits first: a checkpoint snapshotted before a failure still lands.
        with CompileGuard() as guard, GracefulStop(on_force=on_force) as stop, \
                CheckpointWriter(run_dir, cfg.keep_checkpoints) as writer:
            for d, (side, handle) in enumerate(zip(sides, handles)):
                inputs = {t: ch for (t, dd), ch in feature_channels.items() if dd == d}
                supervisor.spawn(handle.name, "drafter", DrafterWorker(
                    handle.name, d, side, inputs, handle.commands, handle.results, assignment, supervisor,
                    get_timeout_s=options.worker_timeout_s, faults=faults))
            for t, side in enumerate(target_sides):
                own_stream = BatchStream(plan.dataset, cfg, slot_weights)
                outputs = {dd: ch for (tt, dd), ch in feature_channels.items() if tt == t}
                supervisor.spawn(f"target{t}", "target", TargetWorker(
                    f"target{t}", side, lambda g, s=own_stream: make_batch(g, s), assignment.indices_of_target(t, g_start, g_end),
                    outputs, drafter_devices, assignment, supervisor, transfer=options.feature_transfer,
                    put_timeout_s=options.worker_timeout_s, faults=faults))
            coordinator = Coordinator(supervisor, handles, sync,
                                      lambda k: noise_std_at(k, total_steps, cfg.noise_start, cfg.noise_end), cfg.seed,
                                      guard=guard, stall_warn_s=options.stall_warn_s,
                                      stall_abort_s=options.stall_abort_s, log=_log)
            recorder.set_status(phase="training", step=step)
            window = StepWindow(len(sides), supervisor)
            while step < total_steps:
                result = coordinator.step(step)
                step += 1
                window.add(result)
                if options.on_step is not None:
                    options.on_step(step, sides)
                g_next = g_start + (step - start_step) * assignment.per_step  # the next micro-batch to read
                epoch, index = order.position(g_next)
                checksums = None
                if len(sides) > 1 and (step % options.checksum_interval == 0 or step == total_steps):
                    checksums = check_replicas(sides, sync_mode, step)
                if step % cfg.log_interval == 0 or step == total_steps or stop.requested or checksums:
                    record = window.record(step, epoch, total_steps, channels, drafter_devices,
                                           noise_std_at(step - 1, total_steps, cfg.noise_start, cfg.noise_end))
                    if checksums:
                        record["replica_checksums"] = checksums
                    recorder.log(record)
                if step % cfg.save_interval == 0 or step == total_steps or stop.requested:
                    sync.before_checkpoint()
                    parts = pipeline_checkpoint_parts(cfg, sides, sync_mode, epoch, index, assignment, g_next)
                    save_in_background(recorder, writer, step, parts, last=step == total_steps or stop.requested)
                else:
                    report_checkpoints(recorder, writer.poll())
                if stop.requested:
                    recorder.set_status(phase="stopped", step=step, exit_code=stop.exit_code)
                    _log(f"stopped at step {step}; resume with the same command")
                    return stop.exit_code
        recorder.set_status(phase="done", step=step, exit_code=EXIT_OK)
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - reported on stderr and in status.json (trainer.failure)
        record_failure(recorder, exc, run_dir=run_dir, writer=writer, keep_checkpoints=cfg.keep_checkpoints,
                       exit_code=EXIT_FAILED)
        return EXIT_FAILED
    finally:
        if supervisor is not None:
            stuck = supervisor.shutdown()
            if stuck:
                _log(f"warning: worker thread(s) {', '.join(stuck)} did not stop within {options.join_timeout_s:.0f} s")
        recorder.close()
