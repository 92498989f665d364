"""The single-process engine: one target and one drafter, one thread, no queues (`python -m trainer train`).

Per optimizer step: --grad-accum micro-batches -> target features -> drafter forward/backward (the loss
normalised over the whole step, docs/method.md#loss) -> clip, AdamW, schedule. The data position is the micro-batch
after the last one trained, so a checkpoint resumes exactly where the run stopped (bitwise on the CPU).
The metrics line averages the loss over the steps since the last line. Driven by trainer.training.loop.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.core.config import target_compile_enabled
from trainer.data.batches import Batch, BatchStream
from trainer.model import DFlashDrafter
from trainer.model.drafter import init_output_norm, start_from_target
from trainer.state.checkpoint import CheckpointState, load_checkpoint, restore_rng
from trainer.state.handover import free_device_memory
from trainer.state.metrics import RunRecorder
from trainer.training.feature_cache import open_feature_cache
from trainer.training.loss import position_weights
from trainer.training.preflight import RunSetup, load_target
from trainer.training.step import DrafterSide, StepStats, TargetSide, micro_batches, noise_std_at


class SingleEngine:
    """trainer.training.engine.Engine for one target and one drafter device."""

    writes_metrics = True
    writes_checkpoints = True

    def __init__(self, setup: RunSetup) -> None:
        self.setup, self.cfg = setup, setup.cfg
        self.total_steps = setup.total_steps
        self.stream = BatchStream(
            setup.dataset, self.cfg, position_weights(self.cfg.block_size, self.cfg.gamma).numpy()
        )
        self.epoch, self.index = 0, 0  # the next micro-batch to read
        self.recorder: RunRecorder | None = None

    def announce(self, run_dir: Path) -> list[str]:
        return [
            f"run directory {run_dir.resolve()} ({self.total_steps} steps; target on {self.setup.target_device}, "
            f"drafter on {self.setup.drafter_device})"
        ]

    def build(self) -> None:
        cfg, setup = self.cfg, self.setup
        target = load_target(setup)
        torch.manual_seed(cfg.seed)  # the drafter's init is a function of --seed
        if setup.resume_from is not None:  # every weight comes from the checkpoint: init on the device, no copy
            with torch.device(setup.drafter_device):
                drafter = DFlashDrafter(setup.drafter_config)
        else:
            with torch.device(setup.drafter_device):  # a GPU initialises in milliseconds, the CPU in seconds
                drafter = DFlashDrafter(setup.drafter_config)
            if cfg.init_from is not None:
                drafter.load_state_dict(DFlashDrafter.from_pretrained(cfg.init_from).state_dict())
            elif cfg.drafter_init == "target":
                print(start_from_target(drafter, target), file=sys.stderr, flush=True)
            elif cfg.output_norm_init == "calibrated":
                init_output_norm(drafter, target.embed_weight, target.lm_head_weight, cfg)
        self.target_side = TargetSide(
            target,
            setup.target_device,
            soft_labels=cfg.use_soft_labels,
            compile=target_compile_enabled(cfg.target_compile, setup.target_device),
            feature_cache=open_feature_cache(cfg, target),
        )
        self.drafter_side = DrafterSide(
            cfg, drafter, target.embed_weight, target.lm_head_weight, setup.drafter_device, self.total_steps
        )
        head = str(self.drafter_side.lm_head_weight.dtype).removeprefix("torch.")
        print(f"loss kernels: {self.drafter_side.loss_kernels.kind}; LM head {head}", file=sys.stderr, flush=True)
        layers = self.target_side.layers
        print(f"target layers: {layers} (--target-compile {cfg.target_compile})", file=sys.stderr, flush=True)
        attention = f"{self.drafter_side.device} {self.drafter_side.backend}"
        print(
            f"drafter attention: {attention} (--attention-kernel {cfg.attention_kernel})", file=sys.stderr, flush=True
        )

    def warm_up(self, step: int, position: tuple[int, int], recorder: RunRecorder) -> None:
        """Nothing ahead: the first step compiles (one drafter, one shape bucket at a time)."""

    def load_checkpoint(self, path: Path) -> CheckpointState:
        return load_checkpoint(path, self.setup.drafter_device)

    def restore(self, state: CheckpointState) -> tuple[int, str]:
        side = self.drafter_side
        side.drafter.load_state_dict(state.model)
        side.restore_optimizer(state.optimizer, state.scheduler)
        restore_rng(state.rng)
        self.epoch, self.index = state.epoch, state.index
        return state.step, f"epoch {state.epoch}, batch {state.index}"

    @contextlib.contextmanager
    def running(self, step: int, recorder: RunRecorder) -> Iterator[None]:
        self.batches: Iterator[Batch] = self.stream.iterate(self.epoch, self.index)
        self.recorder = recorder
        self.on_cuda = self.drafter_side.device.type == "cuda"
        self.first_step = step
        # The first step compiles flex_attention (and the target's kernels) on CUDA.
        recorder.set_status(phase="compiling" if self.on_cuda else "training", step=step)
        self._new_window()
        yield

    def _new_window(self) -> None:
        self.window: StepStats | None = None
        self.window_start, self.window_steps = time.perf_counter(), 0

    def train_step(self, step: int) -> None:
        cfg, side = self.cfg, self.drafter_side
        micro = micro_batches(self.batches, cfg.grad_accum)
        normalizer = sum(b.weight_sum for b in micro)  # whole optimizer step (docs/method.md#loss)
        num_blocks = float(sum(b.num_blocks for b in micro))
        self.noise = noise_std_at(step, self.total_steps, cfg.noise_start, cfg.noise_end)
        stats: StepStats | None = None
        for i, batch in enumerate(micro):
            features = self.target_side.features(batch)
            part = side.forward_backward(
                features, normalizer, num_blocks, noise_std=self.noise, noise_seed=(cfg.seed, step, i)
            )
            stats = part if stats is None else stats + part
        self.lr, self.grad_norm = side.optimizer_step()
        self.epoch, self.index = micro[-1].epoch, micro[-1].index + 1  # the next micro-batch to read
        assert stats is not None
        self.window = stats if self.window is None else self.window + stats
        self.window_steps += 1
        if step == self.first_step and self.on_cuda and self.recorder is not None:
            self.recorder.set_status(phase="training")

    def after_step(self, step: int) -> dict[str, Any] | None:
        return None

    def agree_stop(self, signum: int | None) -> int | None:
        return signum

    def record(self, step: int) -> dict[str, Any]:
        assert self.window is not None
        elapsed = time.perf_counter() - self.window_start
        # loss terms, tau_sim and accuracies over the steps since the last log line
        summary = self.window.summary()
        summary["loss"] /= self.window_steps
        record = {
            "step": step,
            "epoch": self.epoch,
            **summary,
            "lr": self.lr,
            "grad_norm": float(self.grad_norm),  # the one read of it: a log step syncs, the others do not
            "noise_std": self.noise,
            "block_tok_s": self.window.block_tokens / elapsed,
            "ctx_tok_s": self.window.ctx_tokens / elapsed,
            "eta_s": (self.total_steps - step) * elapsed / self.window_steps,
            "time": time.time(),
        }
        if self.on_cuda:
            record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.drafter_side.device) / 2**30
        self._new_window()
        return record

    def checkpoint_parts(self, step: int) -> dict[str, Any]:
        side = self.drafter_side
        return dict(
            model=side.drafter.state_dict(),
            optimizer=side.optimizer.state_dict(),
            scheduler=side.scheduler.state_dict(),
            epoch=self.epoch,
            index=self.index,
            extra={"config": self.cfg.to_dict(), "drafter_config": side.drafter.config.to_hf_dict()},
        )

    def checkpoint_layout(self) -> dict[str, Any]:
        side = self.drafter_side
        return {"model": side.drafter.state_dict(), "optimizer": side.optimizer.state_dict()}

    def finish(self) -> None:
        pass

    def release_devices(self) -> dict[str, int]:
        for name in ("target_side", "drafter_side", "batches", "window"):
            self.__dict__.pop(name, None)  # the target, the drafter and its optimizer, a prefetched batch
        return free_device_memory([self.setup.target_device, self.setup.drafter_device])

    def close(self, failure: BaseException | None) -> None:
        pass
