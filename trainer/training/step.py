"""One training step, split into the two halves the threaded pipeline runs on different devices/threads.

    TargetSide(target, device).features(batch)                    -> FeatureBatch   (frozen target, no grad)
    DrafterSide(cfg, drafter, embed, lm_head, device, total_steps)
        .forward_backward(features, normalizer, num_blocks, ...)  -> StepStats      (accumulates .grad)
        .optimizer_step()                                         -> (lr, grad_norm tensor: no sync)

Nothing here touches process-global state: each side holds its own device, and the noise on the context
features comes from a generator seeded per (seed, step, micro-batch), so the same step gives the same noise
whichever thread or device runs it, and a resumed run replays it exactly. `normalizer` is the sum of the
slot weights over the WHOLE optimizer step (all micro-batches, all drafters) and `num_blocks` the number of
real blocks over it, so micro-batch gradients simply add up (docs/method.md#loss). bf16 autocast on CUDA only.
The single-process trainer (`trainer.train`) is TargetSide + DrafterSide on one device.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trainer.core.compile_scope import private_compile, replica_scope
from trainer.core.config import TrainConfig, TrainerInputError
from trainer.data.batches import Batch
from trainer.kernels.loss_triton import triton_available
from trainer.model import DFlashDrafter, TargetModel, attention
from trainer.model.attention import Backend
from trainer.model.dflash2 import block_predecessors, selector_loss
from trainer.model.drafter import call_layer, embed_context, finish_hidden
from trainer.training.feature_cache import FeatureCache
from trainer.training.loss import LossResult, dflash_loss, make_chunk_kernels, resolve_loss_kernels, simulated_tau

__all__ = [
    "Batch",
    "FeatureBatch",
    "StepStats",
    "TargetSide",
    "DrafterSide",
    "check_loss_kernels",
    "check_triton_adamw",
    "load_optimizer_state",
    "apply_run_hyperparameters",
    "lr_factor",
    "noise_std_at",
]


@dataclass
class FeatureBatch:
    """What a target worker hands a drafter worker: the batch plus the target's outputs for it."""

    batch: Batch  # on the target device (moved by the drafter side)
    ctx_features: torch.Tensor  # [R,S,T*H] tapped layer outputs, low layer first
    teacher_hidden: torch.Tensor | None  # [R,S,H] target final hidden (post norm) when soft labels are on


@dataclass
class StepStats:
    """Sums over the micro-batches of one optimizer step, as detached tensors (reading them syncs)."""

    loss: torch.Tensor  # the step's loss (each micro-batch's share is already normalised over the step)
    ce_sum: torch.Tensor
    kl_sum: torch.Tensor
    cap_sum: torch.Tensor
    weight_sum: torch.Tensor
    tau_sum: torch.Tensor
    num_blocks: torch.Tensor
    slot_correct: torch.Tensor  # [B]
    slot_valid: torch.Tensor  # [B]
    # DFlash2's selector (zeros for DFlash): sum_i w_i CE_K, the simulated tau of the selector's teacher-forced
    # picks (a pick counts only where the unary top-k held the label: what serving can propose), per-slot hits
    sel_ce_sum: torch.Tensor
    sel_tau_sum: torch.Tensor
    sel_slot_correct: torch.Tensor  # [B]
    block_tokens: int = 0  # real blocks x B
    ctx_tokens: int = 0  # real context tokens

    def __add__(self, other: StepStats) -> StepStats:
        device = self.loss.device
        return StepStats(
            **{
                name: (
                    getattr(self, name) + getattr(other, name).to(device)
                    if isinstance(getattr(self, name), torch.Tensor)
                    else getattr(self, name) + getattr(other, name)
                )
                for name in self.__dataclass_fields__
            }
        )

    def summary(self) -> dict[str, Any]:
        """Plain floats for metrics.jsonl (one host sync for all of them)."""
        blocks = max(float(self.num_blocks), 1.0)
        weights = float(self.weight_sum)
        accuracy = (self.slot_correct / self.slot_valid.clamp(min=1)).tolist()[1:]
        selector: dict[str, Any] = {}
        if float(self.sel_tau_sum):  # a DFlash2 step (its tau is >= 1 per real block)
            sel_accuracy = (self.sel_slot_correct / self.slot_valid.clamp(min=1)).tolist()[1:]
            selector = {
                "sel_ce": float(self.sel_ce_sum) / weights if weights else 0.0,
                "sel_tau_sim": float(self.sel_tau_sum) / blocks,
                "sel_acc_slot": [round(a, 5) for a in sel_accuracy],
            }
        return {
            "loss": float(self.loss),
            "ce": float(self.ce_sum) / weights if weights else 0.0,
            "kl": float(self.kl_sum) / weights if weights else 0.0,
            "cap": float(self.cap_sum) / blocks,
            "tau_sim": float(self.tau_sum) / blocks if float(self.num_blocks) else 1.0,
            "acc_slot": [round(a, 5) for a in accuracy],
            "blocks": int(float(self.num_blocks)),
            **selector,
        }


# The settings that pick AdamW's kernel (torch's fused, foreach or for-loop path), not its math. torch's
# Optimizer.load_state_dict takes every setting of the saved groups, these too: a checkpoint written by a CPU run
# (fused=None) and resumed on a GPU ran the foreach path there (~24 ms of the 8B seed step,
# bench/results/step.md 2026-12-01 "Where the drafter step's time goes"), and one written with --adamw fused kept that kernel after a resume with another --adamw.
OPTIMIZER_IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` that keeps this run's kernel settings (OPTIMIZER_IMPLEMENTATION_KEYS:
    what --adamw and the device chose) and takes everything else from the checkpoint. The saved groups get this
    run's settings before the load, so torch places each `step` count where this run's kernel wants it (fused
    and capturable: a float32 tensor on the parameter's device). A state with another number of groups goes to
    torch unchanged, which refuses it."""
    saved = state["param_groups"]
    if len(saved) == len(optimizer.param_groups):
        chosen = [
            {key: group[key] for key in OPTIMIZER_IMPLEMENTATION_KEYS if key in group}
            for group in optimizer.param_groups
        ]
        state = {**state, "param_groups": [{**group, **mine} for group, mine in zip(saved, chosen)]}
    optimizer.load_state_dict(state)


def apply_run_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, lr: float, weight_decay: float
) -> None:
    """After a resume's loads (load_optimizer_state, then the scheduler's): this run's --lr and --weight-decay.
    torch's loads restore the saved run's: LambdaLR.load_state_dict its base_lrs, the optimizer's its groups'
    lr, initial_lr and weight_decay, so `restart R -- --lr 1e-3` trained on at R's LR while the lineage diff
    showed the new one. The LR of the step about to run is set on this run's schedule (its lambda closes over
    this run's total steps), as LambdaLR's own step computes it, so an unchanged run resumes bitwise (the same
    float product) and a changed --max-steps takes effect at the resumed step itself, not one step later."""
    scheduler.base_lrs = [lr for _ in optimizer.param_groups]
    for group, schedule in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["weight_decay"] = weight_decay
        group["lr"] = lr * schedule(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def lr_factor(step: int, total_steps: int, warmup_ratio: float) -> float:
    """Linear warmup over round(warmup_ratio * total) steps (at least 1), then cosine to 0 at total_steps."""
    warmup = max(1, round(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def noise_std_at(step: int, total_steps: int, start: float, end: float) -> float:
    """Context-feature noise std, linear from `start` at step 0 to `end` at the last step."""
    return start + (end - start) * (step / max(1, total_steps - 1))


def _autocast(device: torch.device) -> contextlib.AbstractContextManager:
    # bf16 autocast on CUDA only: CPU runs (tests, tiny preset) stay in fp32 so resumes are bitwise exact.
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


class TargetSide:
    """The frozen target on its device: batch -> FeatureBatch."""

    def __init__(
        self,
        target: TargetModel,
        device: torch.device | str,
        *,
        soft_labels: bool = False,
        compile: bool = False,
        compile_backend: str | None = None,
        feature_cache: FeatureCache | None = None,
    ) -> None:
        """compile (--target-compile): the target's decoder layers through one compiled call
        (TargetModel.compile_layers; compile_backend: tests use "eager", as for the drafter). feature_cache
        (--feature-cache): taps of samples seen before come from disk (trainer/training/feature_cache.py)."""
        self.target, self.device, self.soft_labels = target, torch.device(device), soft_labels
        self.feature_cache = feature_cache
        self.compiled = compile
        if compile:
            target.compile_layers(**({"backend": compile_backend} if compile_backend else {}))

    @property
    def layers(self) -> str:
        """How the target's decoder layers run, for the run's log: "compiled" or "eager"."""
        return "compiled" if self.compiled else "eager"

    def features(self, batch: Batch) -> FeatureBatch:
        cache = self.feature_cache if batch.sample_ids is not None else None
        if cache is not None:
            assert batch.sample_ids is not None
            samples, lengths = batch.sample_ids.tolist(), batch.attention_mask.sum(1).tolist()
            cached = cache.load(samples, lengths, batch.input_ids.shape[1])
            if cached is not None:
                batch = batch.to(self.device)
                return FeatureBatch(batch=batch, ctx_features=cached.to(self.device), teacher_hidden=None)
        batch = batch.to(self.device)
        with _autocast(self.device):
            out = self.target.features(batch.input_ids, batch.attention_mask, return_final_hidden=self.soft_labels)
        if cache is not None:
            cache.store(samples, lengths, out.taps)
        return FeatureBatch(batch=batch, ctx_features=out.taps, teacher_hidden=out.final_hidden)


def check_loss_kernels(kind: str, device: torch.device) -> None:
    """Raise TrainerInputError when the drafter on ``device`` cannot run ``--loss-kernels kind`` (triton needs a
    CUDA device and the triton package). config.validate sees only explicit --drafter-gpus; this sees the device
    actually chosen."""
    if kind != "triton":
        return
    if device.type != "cuda":
        raise TrainerInputError(
            f"--loss-kernels triton needs a CUDA drafter device (the drafter would run on {device})",
            hint="use --loss-kernels auto, compiled or eager",
        )
    if not triton_available():
        raise TrainerInputError(
            "--loss-kernels triton: the triton package is not installed",
            hint="pip install triton (CUDA torch wheels bring it), or use --loss-kernels auto",
        )


def check_triton_adamw(device: torch.device) -> None:
    """Raise TrainerInputError when a drafter on ``device`` cannot run ``--adamw triton``."""
    if device.type != "cuda":
        raise TrainerInputError(
            f"--adamw triton needs a CUDA drafter device (the drafter would run on {device})",
            hint="use --adamw auto",
        )
    if not triton_available():
        raise TrainerInputError(
            "--adamw triton: the triton package is not installed",
            hint="pip install triton (CUDA torch wheels bring it), or use --adamw auto",
        )


_REPLICA_IDS = itertools.count()  # names each replica's compile scope


class DrafterSide:
    """The trainable drafter on its device with its optimizer (AdamW, trainable params only) and schedule."""

    def __init__(
        self,
        cfg: TrainConfig,
        drafter: DFlashDrafter,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        device: torch.device | str,
        total_steps: int,
        *,
        compile: bool | None = None,
        activation_checkpointing: bool | None = None,
        compile_backend: str = "inductor",
    ) -> None:
        self.cfg, self.device = cfg, torch.device(device)
        self.drafter = drafter.to(self.device).train()
        # Recompute layer activations in backward (--activation-checkpointing): measured on the H200 for the 27B
        # drafter at the seed shape, 66.1 -> 49.5 GiB peak for 18% more step time (bench/results/step.md 2026-11-29 "Parity, attention, loss and the qwen3-8b step").
        self.drafter.activation_checkpointing = (
            cfg.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
        )
        # torch.compile per replica: the layer call, flex_attention and the loss kernels are compiled from private
        # copies (trainer/core/compile_scope.py), so no two replicas, hence no two worker threads, share a dynamo cache.
        # Default: on CUDA only. Compilation happens lazily at the first forward/backward: warm up sequentially
        # before worker threads start (docs/method.md#compiling). compile_backend: tests use "eager" to get dynamo's
        # caches and guards on the CPU without inductor's code generation.
        self.compiled = self.device.type == "cuda" if compile is None else compile
        self.scope = f"replica-{next(_REPLICA_IDS)}"
        if self.compiled:
            self.drafter.layer_call = private_compile(call_layer, backend=compile_backend)
            self.drafter.context_call = private_compile(embed_context, backend=compile_backend)
            self.drafter.output_call = private_compile(finish_hidden, backend=compile_backend)
        # DFlash2's selector objective: compiled per replica like the layers (gathers, a [M', k, r] product and a
        # K-way CE: eager, ~8 kernels forward and more backward); its shapes are the step's static ones.
        self.selector_call: Callable[..., tuple[torch.Tensor, torch.Tensor]] = (
            private_compile(selector_loss, backend=compile_backend) if self.compiled else selector_loss
        )
        # --loss-kernels auto: the fused Triton kernel on Hopper, else follows the layers (trainer/training/loss.py).
        kind = resolve_loss_kernels(cfg.loss_kernels, self.device, self.compiled, soft_labels=cfg.use_soft_labels)
        check_loss_kernels(kind, self.device)
        self.loss_kernels = make_chunk_kernels(kind, compile_backend=compile_backend)
        self.loss_fn = dflash_loss  # replaceable for benchmarks (e.g. a recomputing baseline)
        # A follower replica's optimizer never steps: the pipeline's replica sync gives it replica 0's weights after
        # replica 0 stepped on the summed gradients (trainer/pipeline/replica_sync.py, every replica on one device)
        self.follower = False
        # Frozen, shared with the target; a copy only when the target lives on another device, or (the head) when
        # --lm-head-dtype names another dtype than the target's. The head's dtype is the loss's GEMM dtype: on the
        # CPU its two GEMMs (logits, their gradient) are most of a small drafter's step, and bf16 halves them
        # (bench/results/quality.md 2026-12-08 "The LM head in bf16 on the CPU").
        self.embed_weight = embed_weight.detach().to(self.device)
        head_dtype = None if cfg.lm_head_dtype == "auto" else getattr(torch, cfg.lm_head_dtype)
        self.lm_head_weight = lm_head_weight.detach().to(self.device, dtype=head_dtype)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        # Fused on CUDA (--adamw auto): one kernel family for the whole update instead of foreach's chain of
        # multi_tensor_apply launches (23.6 ms of the 8B seed step in the profile, bench/results/step.md 2026-12-01 "Where the drafter step's time goes").
        fused = cfg.adamw == "fused" or (cfg.adamw == "auto" and self.device.type == "cuda")
        self.clip_in_adamw = fused or cfg.adamw == "triton"  # see optimizer_step
        fused_kw: dict[str, Any] = {"fused": True} if fused else {}
        self.optimizer: torch.optim.AdamW
        if (
            cfg.adamw == "triton"
        ):  # --adamw triton: trainer/kernels/adamw_triton.py (the same state, 28 instead of 32 B/param)
            check_triton_adamw(self.device)
            from trainer.kernels.adamw_triton import TritonAdamW

            self.optimizer = TritonAdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, **fused_kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_ratio)
        )
        # --attention-kernel on CUDA (flex, our Triton kernel, or auto; $DFLASH_ATTENTION_KERNEL when the flag is
        # its default, for benches), the dense mask on CPU
        kernel = cfg.attention_kernel
        if kernel == TrainConfig.attention_kernel and attention.ATTENTION_KERNEL:
            kernel = attention.ATTENTION_KERNEL
        self.backend: Backend = "dense"
        if self.device.type == "cuda":
            self.backend = attention.cuda_backend(kernel, torch.cuda.get_device_capability(self.device))

    def restore_optimizer(self, optimizer_state: dict[str, Any], scheduler_state: dict[str, Any]) -> None:
        """A checkpoint's optimizer and schedule state, with this run's kernel (load_optimizer_state) and this run's
        --lr, --weight-decay and schedule length (apply_run_hyperparameters)."""
        load_optimizer_state(self.optimizer, optimizer_state)
        self.scheduler.load_state_dict(scheduler_state)
        apply_run_hyperparameters(self.optimizer, self.scheduler, self.cfg.lr, self.cfg.weight_decay)

    def _noise(self, shape: torch.Size, dtype: torch.dtype, std: float, seed: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(hash(seed) & 0x7FFF_FFFF_FFFF_FFFF)  # hash of a tuple of ints: stable across runs
        if self.cfg.noise_type == "gaussian":
            noise = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32) * std
        else:
            noise = (torch.rand(shape, generator=generator, device=self.device, dtype=torch.float32) * 2 - 1) * std
        return noise.to(dtype)

    def forward_backward(
        self,
        features: FeatureBatch,
        normalizer: float,
        num_blocks: float,
        *,
        noise_std: float = 0.0,
        noise_seed: tuple[int, ...] = (0,),
    ) -> StepStats:
        """Forward + backward of one micro-batch; gradients accumulate into the drafter's .grad."""
        cfg, batch = self.cfg, features.batch.to(self.device)
        ctx = features.ctx_features.to(self.device)
        if noise_std > 0:
            ctx = ctx + self._noise(ctx.shape, ctx.dtype, noise_std, noise_seed)
        rows, seq = batch.input_ids.shape
        block = cfg.block_size
        block_embeds = F.embedding(batch.block_ids, self.embed_weight)  # [R,N*B,H], frozen rows
        with _autocast(self.device), replica_scope(self.scope):  # this replica's compiled copies (eager-layer flex)
            # the mask is built inside, once the context's fc GEMM is queued (its host-bound build overlaps it)
            hidden = self.drafter(ctx, block_embeds, batch.anchors, batch.keep, self.backend)  # [R,N*B,H]
        teacher = None
        if cfg.use_soft_labels and features.teacher_hidden is not None:
            # Slot k (token p+k) learns the target's distribution at p+k-1 (slot 0 clamps; its weight is 0).
            positions = (batch.anchors[:, :, None] + torch.arange(block, device=self.device) - 1).clamp(0, seq - 1)
            index = positions.reshape(rows, -1, 1).expand(-1, -1, features.teacher_hidden.shape[-1])
            teacher = torch.gather(features.teacher_hidden.to(self.device), 1, index).reshape(-1, hidden.shape[-1])
        result = self.loss_fn(
            hidden.reshape(-1, hidden.shape[-1]),
            self.lm_head_weight,
            batch.labels.reshape(-1),
            batch.weights.reshape(-1),
            block_size=block,
            normalizer=normalizer,
            teacher_hidden=teacher,
            kl_weight=cfg.kl_weight if teacher is not None else 0.0,
            kl_temperature=cfg.kl_temperature,
            cap_lambda=cfg.cap_lambda,
            num_blocks_normalizer=num_blocks,
            chunk_size=cfg.loss_chunk_size,
            kernels=self.loss_kernels,
            **({"topk": self.drafter.config.selector_top_k} if self.drafter.candidate_selector is not None else {}),
        )
        valid = (batch.weights > 0).reshape(-1, block)
        loss = result.loss
        zero = torch.zeros((), device=self.device)
        sel_ce, sel_tau, sel_slots = zero, zero, torch.zeros(block, device=self.device)
        if self.drafter.candidate_selector is not None:
            loss_sel, sel_ce, sel_hits = self._selector_loss(batch, hidden, result, normalizer)
            loss = loss + cfg.selector_loss_alpha * loss_sel
            sel_stats = simulated_tau(sel_hits.reshape(-1, block), valid)
            sel_tau, sel_slots = sel_stats.tau_sum, sel_stats.slot_correct
        loss.backward()
        tau = simulated_tau(result.correct.reshape(-1, block), valid)
        return StepStats(
            loss=loss.detach().float(),  # DFlash2: the unary loss plus alpha times the selector's
            ce_sum=result.ce_sum.float(),
            kl_sum=result.kl_sum.float(),
            cap_sum=result.cap_sum.float(),
            weight_sum=result.weight_sum.float(),
            tau_sum=tau.tau_sum,
            num_blocks=tau.num_blocks,
            slot_correct=tau.slot_correct,
            slot_valid=tau.slot_valid,
            sel_ce_sum=sel_ce.float(),
            sel_tau_sum=sel_tau.float(),
            sel_slot_correct=sel_slots.float(),
            block_tokens=batch.num_blocks * block,
            ctx_tokens=batch.num_ctx_tokens,
        )

    def _selector_loss(
        self, batch: Batch, hidden: torch.Tensor, result: LossResult, normalizer: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """DFlash2's K-way selector objective over the unary top-k that dflash_loss returned (trainer/model/
        dflash2.py: selector_loss) -> (its normalised loss, sum w CE, [M] bool teacher-forced hits that serving
        could make: the pick is the label and the unary top-k held it)."""
        selector = self.drafter.candidate_selector
        assert selector is not None and result.candidates is not None and result.candidate_logits is not None
        assert result.label_place is not None and result.label_found is not None
        block = self.cfg.block_size
        predecessors = block_predecessors(batch.block_ids, batch.labels, block).reshape(-1)
        with _autocast(self.device), replica_scope(self.scope):
            ce_sum, pick = self.selector_call(
                selector,
                hidden.reshape(-1, hidden.shape[-1]),
                predecessors,
                result.candidates,
                result.candidate_logits,
                result.label_place,
                batch.weights.reshape(-1),
                block_size=block,
            )
        inv = 1.0 / normalizer if normalizer > 0 else 0.0  # all-zero weights: 0, not NaN (as dflash_loss)
        return ce_sum * inv, ce_sum.detach(), (pick == batch.labels.reshape(-1)) & result.label_found

    def optimizer_step(self) -> tuple[float, torch.Tensor]:
        """Clip, step AdamW and the schedule, zero the grads; return (lr used, grad norm before clipping as a
        detached 0-dim tensor on the drafter's device). Nothing here waits for the device: reading the norm
        (float()) syncs, so callers read it when they log, not every step. Why: a step that ends in a sync leaves
        the GPU idle while the host builds the next step (the mask build alone is ~3.5 ms of host time at the
        specforge shape, bench/results/kernels.md 2026-12-03 "Our own Triton attention"); without it the host queues step n+1 while step n runs."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.follower:  # the replica sync steps another replica's optimizer for this one (pipeline/replica_sync.py);
            # its own optimizer and schedule stay as they were (nothing reads them: metrics and checkpoints take
            # replica 0's under --sync grad)
            self.optimizer.zero_grad(set_to_none=True)
            return lr, torch.zeros((), device=self.device)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.clip_in_adamw:
            # The clip inside the fused AdamW kernel (and --adamw triton's, which reads the same attribute): it divides every gradient by `grad_scale` as it reads it (the
            # hook GradScaler uses) instead of clip_grad_norm_'s own read-and-write pass over all fp32 gradients.
            # The kernel then writes the rescaled gradients back, so the 8B seed step saves 0.8 of that pass's
            # 2.3 ms (bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step"). Same coefficient as clip_grad_norm_:
            # grad * min(max_norm / (norm + 1e-6), 1) = grad / max((norm + 1e-6) / max_norm, 1).
            grads = [p.grad for p in self.params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
            # without a clip (max_norm inf) the kernel need not rescale, nor write back, anything
            scale = ((grad_norm + 1e-6) / max_norm).clamp(min=1.0) if self.cfg.grad_clip > 0 else None
            self.optimizer.grad_scale = scale  # type: ignore[attr-defined]
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, grad_norm.detach()


def micro_batches(stream: Iterator[Batch], count: int) -> list[Batch]:
    """The next `count` micro-batches of one optimizer step (they may span an epoch boundary)."""
    return [next(stream) for _ in range(count)]
