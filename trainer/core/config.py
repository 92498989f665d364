"""Typed training configuration: presets, command-line flags, cross-checks.

`parse_train_args(argv) -> TrainConfig` is the only way `python -m trainer train` builds its config:
a preset (tiny / qwen3-8b / qwen3.6-27b) supplies defaults, flags given on the command line override them,
then `TrainConfig.validate()` checks every field and names the offending flag in its message. Nothing is
read from or written to disk here. `TrainConfig.from_dict(d)` (used by checkpoints and tests) rejects
unknown keys, so a typo in a saved config is an error, not a silently ignored setting.

Flags keep the seed run's names and meanings (`--token-budget`, `--gamma`, `--noise-start`, ...). Device
lists (`--target-gpus`, `--drafter-gpus`) take comma-separated GPU indices or device names ("0,1", "cpu").
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class TrainerInputError(ValueError):
    """Bad input the user can fix: a one-line message plus an optional hint. Exit code 2, nothing written."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


# Drafter shapes. qwen3-8b: the published Qwen3-8B DFlash drafter. qwen3.6-27b: hidden 5120, intermediate
# 17408, 32 q / 8 kv heads x 128, rope_theta 1e7, 262144 positions — read from the public
# z-lab/Qwen3.6-27B-DFlash config.json (via a mirror), with 4 sliding (window 2048) + 1 full layers
# (docs/method.md#presets).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        # Target built from `tiny_target` when --target-model is absent; data synthesised when --data-dir is.
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        mask_token_id=255,
        num_target_layers=2,
        num_draft_layers=2,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tiny_target=dict(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            max_position_embeddings=512,
            initializer_range=0.2,
        ),
        block_size=8,
        gamma=4.0,
        max_seq_len=64,
        token_budget=256,
        max_batch_size=4,
        anchors_per_seq=8,
        max_anchors=32,
        lr=3e-3,
        warmup_ratio=0.05,
        epochs=50,
        log_interval=10,
        save_interval=100,
        synthetic_samples=256,
    ),
    "qwen3-8b": dict(
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        mask_token_id=151669,
        num_target_layers=36,
        num_draft_layers=5,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        block_size=16,
        gamma=7.0,
        max_seq_len=4096,
        token_budget=16384,
        max_batch_size=8,
        anchors_per_seq=512,
        max_anchors=1024,
    ),
    "qwen3.6-27b": dict(
        hidden_size=5120,
        intermediate_size=17408,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=248320,
        mask_token_id=248070,
        num_target_layers=64,
        num_draft_layers=5,
        rope_theta=10000000.0,
        max_position_embeddings=262144,
        sliding_layers=4,
        sliding_window=2048,
        block_size=16,
        gamma=7.0,
        max_seq_len=4096,
        token_budget=16384,
        max_batch_size=8,
        anchors_per_seq=512,
        max_anchors=1024,
    ),
}


# --loss-kernels: the per-chunk element-wise kernels of the loss (trainer/training/loss.py make_chunk_kernels).
# triton = one fused Triton kernel per chunk for CE (+CAP); soft labels keep the compiled kernels.
LOSS_KERNELS = ("auto", "compiled", "eager", "triton")
# The loss's LM-head GEMMs: auto runs them in the head's own dtype (the target's: bf16 on CUDA, fp32 on the CPU);
# bfloat16 casts a CPU target's head (a no-op on CUDA)
LM_HEAD_DTYPES = ("auto", "bfloat16")
# --attention-kernel: the drafter's attention on CUDA (trainer/model/attention.py): flex_attention with a BlockMask,
# our Triton kernel for the interval-form mask (trainer/kernels/attention_triton.py; bench/results/kernels.md 2026-12-03 "Our own Triton attention"), or
# auto: triton on Hopper (compute capability 9.x), flex elsewhere.
ATTENTION_KERNELS = ("auto", "flex", "triton")
# --adamw: torch's fused or foreach AdamW, or trainer/kernels/adamw_triton.py's kernel (CUDA; opt-in until measured to pay)
ADAMW_IMPLS = ("auto", "fused", "foreach", "triton")
OUTPUT_NORM_INITS = ("ones", "calibrated")
# --drafter-init: the drafter's layers at init: random (HF-style normal init), or target: its layers start as the
# target's layers after its deepest tap, the final norm as the target's, and fc reads that tap alone
# (trainer/model/drafter.py start_from_target; bench/results/quality.md 2026-12-07 "`make demo-real`'s drafter
# started from the target's last layers").
DRAFTER_INITS = ("random", "target")
# --target-compile: the frozen target's decoder layers through one compiled layer call per target. auto = on where
# the target runs on CUDA (H200, bench/results/kernels.md 2026-12-05 "The target's layers compiled, measured": the Qwen3-8B-shaped target's forward 47.7 -> 34.5 ms,
# the one-GPU pipeline 11.84 -> 12.96 samples/s), off on the CPU (Inductor's C++ compiles cost more than they save
# on the tiny targets CPU runs use).
TARGET_COMPILE = ("auto", "on", "off")


def target_compile_enabled(setting: str, device: object) -> bool:
    """--target-compile's value for a target on `device` (a torch.device or its string; this module does not import
    torch, so `--help` stays fast): "on", or "auto" on a CUDA device."""
    return setting == "on" or (setting == "auto" and str(device).split(":")[0] == "cuda")


def _need(ok: bool, flag: str, why: str, hint: str | None = None) -> None:
    """Raise TrainerInputError naming `--flag` unless `ok`."""
    if not ok:
        raise TrainerInputError(f"--{flag}: {why}", hint=hint)


@dataclass
class TrainConfig:
    """Every setting of a training run. Field names are the flags with `-` -> `_`."""

    preset: str | None = None
    target_model: str | None = None  # local HF directory; None = build from `tiny_target` (tiny preset only)
    data_dir: str | None = None  # prepared shards; None = synthetic tokens (tiny preset only)
    output_dir: str | None = None  # the run directory; None = runs/train-<timestamp>
    init_from: str | None = None  # exported drafter directory to start from (fresh optimizer)
    feature_cache: str | None = (
        None  # directory of per-sample target taps (trainer/training/feature_cache.py); None = off
    )
    output_norm_init: str = "ones"  # the final norm's weight at init (model/drafter.py: calibrated_output_norm)
    drafter_init: str = "random"  # the drafter's weights at init (model/drafter.py: start_from_target)
    tokenizer: str | None = None  # tokenizer directory for the dataset check (default: --target-model)
    enable_thinking: bool | None = None  # the serving thinking mode; checked against the dataset's (None: no check)
    resume: str = "auto"  # auto: latest checkpoint in output_dir if any | never | a checkpoint path
    target_gpus: list[str] = field(default_factory=list)  # devices; [] = cuda:0 if available else cpu
    drafter_gpus: list[str] = field(default_factory=list)
    pipeline: bool = False  # force the threaded pipeline (trainer.pipeline) even with one drafter
    sync: str = "grad"  # pipeline replica sync: grad | average
    sync_interval: int = 50  # --sync average: steps between weight averages (the seed's 50); unused by grad
    queue_depth: int = 2  # pipeline: feature batches in flight per (target, drafter) channel (the memory bound)
    feature_transfer: str = "device"  # pipeline: device (copy onto the drafter's GPU) | pinned (host staging)
    stall_timeout: float = 900.0  # pipeline: seconds without an optimizer step before the run fails
    nodes: int = 1  # distributed: nodes of the job, one torchrun process each (trainer.dist); 1 = this process
    dist_timeout: float = 300.0  # distributed: seconds a collective waits for the other nodes before failing
    # optimisation
    epochs: int = 6
    max_steps: int | None = None  # stop after this many optimizer steps; also the LR schedule's horizon
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    adamw: str = "auto"  # auto: torch's fused AdamW kernel for CUDA drafters, foreach elsewhere
    grad_accum: int = 1
    grad_clip: float = 1.0
    seed: int = 0
    # batching and anchors
    token_budget: int = 16384  # padded context tokens (rows x padded length) per micro-batch
    max_seq_len: int = 4096  # longer samples are truncated
    max_batch_size: int = 8  # rows per micro-batch
    block_size: int = 16
    anchors_per_seq: int = 512
    max_anchors: int = 1024  # anchors per micro-batch (all rows together)
    # objective
    gamma: float = 7.0
    noise_type: str = "uniform"  # uniform | gaussian
    noise_start: float = 0.0
    noise_end: float = 0.0
    use_soft_labels: bool = False
    kl_weight: float = 1.0
    kl_temperature: float = 1.0
    cap_lambda: float = 0.0
    activation_checkpointing: bool = False  # recompute drafter layer activations in backward (memory for time)
    target_compile: str = "auto"  # auto (on for a CUDA target) | on | off: TARGET_COMPILE
    loss_chunk_size: int | None = None  # rows per chunk in the logits-free loss (None: ~1 GiB of fp32 logits)
    loss_kernels: str = (
        "auto"  # auto (triton on Hopper, else compiled; eager for an eager drafter) | compiled | eager | triton
    )
    lm_head_dtype: str = "auto"  # the loss's LM-head GEMMs: auto (the head's own dtype) | bfloat16
    # architecture: dflash, or dflash2 (block convolutions + candidate selector, docs/method.md#dflash2)
    arch: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    selector_loss_alpha: float = 1.0
    attention_kernel: str = "flex"  # auto | flex | triton: ATTENTION_KERNELS (CUDA; CPU always runs the dense mask)
    # drafter shape (hidden_size must equal the target's)
    num_draft_layers: int = 5
    hidden_size: int | None = None  # None: taken from the target
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    mask_token_id: int | None = None
    num_target_layers: int | None = None
    target_layer_ids: list[int] | None = None  # None: default_target_layer_ids(L, num_draft_layers)
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    sliding_layers: int = 0  # the first `sliding_layers` drafter layers use sliding-window attention
    sliding_window: int | None = None
    tiny_target: dict[str, Any] | None = None  # Qwen3Config kwargs for a target built from a config
    synthetic_samples: int = 0
    # bookkeeping
    save_interval: int = 1000
    keep_checkpoints: int = 3
    log_interval: int = 10
    wandb: str = "auto"  # auto (on if wandb is installed) | on | off
    wandb_project: str = "dflash"
    wandb_run_name: str | None = None

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a plain dict; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        if isinstance(values.get("target_compile"), bool):  # checkpoints before 2026-12-05's `auto` stored it as a bool
            values = {**values, "target_compile": "on" if values["target_compile"] else "off"}
        unknown = sorted(set(values) - known)
        if unknown:
            flags = ", ".join("--" + k.replace("_", "-") for k in unknown)
            raise TrainerInputError(f"unknown config key(s): {flags}", hint="see `python -m trainer train --help`")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- cross-checks -------------------------------------------------------------------------------
    def validate(self) -> TrainConfig:
        """Check every field; raise TrainerInputError naming the flag. Returns self for chaining."""
        # in this order: where several fields are wrong, the first step's error is the one reported
        self._check_preset()
        self._check_block()
        self._check_batching()
        self._check_schedule()
        self._check_feature_cache()
        self._check_implementations()
        self._check_loss_and_gradients()
        self._check_drafter_layers()
        self._check_checkpoints_and_logging()
        self._check_pipeline_and_nodes()
        self._check_target_and_data()
        return self

    def _check_preset(self) -> None:
        """The preset names one of PRESETS."""
        _need(
            self.preset is None or self.preset in PRESETS,
            "preset",
            f"unknown preset {self.preset!r}",
            f"choose one of {', '.join(PRESETS)}",
        )

    def _check_block(self) -> None:
        """The drafted block and what reads it: block size, conv, selector, position weights (gamma)."""
        _need(
            self.block_size >= 2,
            "block-size",
            f"must be >= 2 (anchor + at least one drafted token), got {self.block_size}",
        )
        _need(
            self.conv_kernel_size >= 1 and self.conv_kernel_size <= self.block_size,
            "conv-kernel-size",
            f"must be 1..block-size ({self.block_size}), got {self.conv_kernel_size}",
        )
        _need(self.conv_group_size >= 1, "conv-group-size", f"must be >= 1, got {self.conv_group_size}")
        _need(self.selector_rank >= 1, "selector-rank", f"must be >= 1, got {self.selector_rank}")
        _need(
            self.selector_top_k >= 2, "selector-top-k", f"must be >= 2 (a choice to rerank), got {self.selector_top_k}"
        )
        _need(
            self.selector_loss_alpha >= 0,
            "selector-loss-alpha",
            f"must be >= 0, got {self.selector_loss_alpha}",
        )
        _need(self.gamma > 0, "gamma", f"must be > 0 (position weights exp(-(k-1)/gamma)), got {self.gamma}")

    def _check_batching(self) -> None:
        """Anchors, sequence length and the micro-batch's rows and token budget."""
        _need(self.anchors_per_seq >= 1, "anchors-per-seq", f"must be >= 1, got {self.anchors_per_seq}")
        _need(self.max_anchors >= 1, "max-anchors", f"must be >= 1, got {self.max_anchors}")
        _need(self.max_seq_len >= 2, "max-seq-len", f"must be >= 2, got {self.max_seq_len}")
        _need(self.max_batch_size >= 1, "max-batch-size", f"must be >= 1, got {self.max_batch_size}")
        _need(
            self.token_budget >= self.max_seq_len,
            "token-budget",
            f"{self.token_budget} is smaller than one sequence (--max-seq-len {self.max_seq_len})",
            "raise --token-budget or lower --max-seq-len",
        )

    def _check_schedule(self) -> None:
        """Epochs, steps and the learning-rate schedule."""
        _need(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        _need(self.max_steps is None or self.max_steps >= 1, "max-steps", f"must be >= 1, got {self.max_steps}")
        _need(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        _need(0 <= self.warmup_ratio < 1, "warmup-ratio", f"must be in [0, 1), got {self.warmup_ratio}")
        _need(self.weight_decay >= 0, "weight-decay", f"must be >= 0, got {self.weight_decay}")

    def _check_feature_cache(self) -> None:
        """The feature cache: no soft labels, real target and data, the single-process engine."""
        _need(
            not (self.feature_cache and self.feature_cache != "off" and self.use_soft_labels),
            "feature-cache",
            "stores only the taps; soft labels need the target's final hidden state of every step",
            "drop --use-soft-labels or --feature-cache",
        )
        _need(
            not (
                self.feature_cache
                and self.feature_cache != "off"
                and (self.target_model is None or self.data_dir is None)
            ),
            "feature-cache",
            "needs --target-model and --data-dir (synthetic tiny data is made on the fly)",
        )
        _need(
            not (
                self.feature_cache
                and self.feature_cache != "off"
                and (self.pipeline or len(self.target_gpus) > 1 or len(self.drafter_gpus) > 1)
            ),
            "feature-cache",
            "works with the single-process engine only (the pipeline's target workers run ahead of the drafters)",
            "one --target-gpus and one --drafter-gpus device, no --pipeline",
        )

    def _check_implementations(self) -> None:
        """The named implementations: output norm init, drafter init, AdamW, target compile."""
        _need(
            self.output_norm_init in OUTPUT_NORM_INITS,
            "output-norm-init",
            f"must be one of {', '.join(OUTPUT_NORM_INITS)}, got {self.output_norm_init!r}",
        )
        _need(
            self.drafter_init in DRAFTER_INITS,
            "drafter-init",
            f"must be one of {', '.join(DRAFTER_INITS)}, got {self.drafter_init!r}",
        )
        if self.drafter_init == "target":
            _need(
                self.init_from is None,
                "drafter-init",
                "target and --init-from both set the drafter's starting weights",
                "give one of them",
            )
            _need(
                self.output_norm_init == "ones",
                "drafter-init",
                "target sets the final norm to the target's own, which --output-norm-init calibrated would replace",
                "leave --output-norm-init at ones",
            )
        _need(self.adamw in ADAMW_IMPLS, "adamw", f"must be one of {', '.join(ADAMW_IMPLS)}, got {self.adamw!r}")
        _need(
            self.target_compile in TARGET_COMPILE,
            "target-compile",
            f"must be one of {', '.join(TARGET_COMPILE)}, got {self.target_compile!r}",
        )

    def _check_loss_and_gradients(self) -> None:
        """Gradient accumulation and clipping, noise, the KL and cap terms, the loss's chunks and kernels."""
        _need(self.grad_accum >= 1, "grad-accum", f"must be >= 1, got {self.grad_accum}")
        _need(self.grad_clip >= 0, "grad-clip", f"must be >= 0 (0 disables clipping), got {self.grad_clip}")
        _need(
            self.noise_type in ("uniform", "gaussian"),
            "noise-type",
            f"must be uniform or gaussian, got {self.noise_type!r}",
        )
        _need(
            self.noise_start >= 0 and self.noise_end >= 0,
            "noise-start",
            f"noise std must be >= 0, got start {self.noise_start} end {self.noise_end}",
        )
        _need(self.kl_weight >= 0, "kl-weight", f"must be >= 0, got {self.kl_weight}")
        _need(self.kl_temperature > 0, "kl-temperature", f"must be > 0, got {self.kl_temperature}")
        _need(self.cap_lambda >= 0, "cap-lambda", f"must be >= 0, got {self.cap_lambda}")
        _need(
            self.loss_chunk_size is None or self.loss_chunk_size >= 1,
            "loss-chunk-size",
            f"must be >= 1, got {self.loss_chunk_size}",
        )
        _need(
            self.loss_kernels in LOSS_KERNELS,
            "loss-kernels",
            f"must be one of {', '.join(LOSS_KERNELS)}, got {self.loss_kernels!r}",
        )
        _need(
            self.lm_head_dtype in LM_HEAD_DTYPES,
            "lm-head-dtype",
            f"must be one of {', '.join(LM_HEAD_DTYPES)}, got {self.lm_head_dtype!r}",
        )
        _need(
            self.loss_kernels != "triton" or all(d.startswith("cuda") for d in self.drafter_gpus),
            "loss-kernels",
            f"triton needs CUDA drafter devices, got --drafter-gpus {','.join(self.drafter_gpus)}",
            "use --loss-kernels auto, compiled or eager",
        )

    def _check_drafter_layers(self) -> None:
        """Drafter depth, sliding-window layers and the target layers tapped."""
        _need(self.num_draft_layers >= 1, "num-draft-layers", f"must be >= 1, got {self.num_draft_layers}")
        _need(
            0 <= self.sliding_layers <= self.num_draft_layers,
            "sliding-layers",
            f"must be between 0 and --num-draft-layers ({self.num_draft_layers}), got {self.sliding_layers}",
        )
        _need(
            self.sliding_layers == 0 or (self.sliding_window or 0) >= 1,
            "sliding-window",
            "sliding layers need a window >= 1",
        )
        _need(self.target_layer_ids is None or len(self.target_layer_ids) >= 1, "target-layer-ids", "must not be empty")

    def _check_checkpoints_and_logging(self) -> None:
        """Checkpoint and log intervals, kept checkpoints, wandb."""
        _need(self.save_interval >= 1, "save-interval", f"must be >= 1, got {self.save_interval}")
        _need(self.keep_checkpoints >= 1, "keep-checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        _need(self.log_interval >= 1, "log-interval", f"must be >= 1, got {self.log_interval}")
        _need(self.wandb in ("auto", "on", "off"), "wandb", f"must be auto, on or off, got {self.wandb!r}")

    def _check_pipeline_and_nodes(self) -> None:
        """The pipeline's sync, queues and stall timeout; the nodes of a distributed run."""
        _need(self.sync in ("grad", "average"), "sync", f"must be grad or average, got {self.sync!r}")
        _need(self.sync_interval >= 1, "sync-interval", f"must be >= 1, got {self.sync_interval}")
        _need(self.queue_depth >= 1, "queue-depth", f"must be >= 1, got {self.queue_depth}")
        _need(
            self.feature_transfer in ("device", "pinned"),
            "feature-transfer",
            f"must be device or pinned, got {self.feature_transfer!r}",
        )
        _need(self.stall_timeout > 0, "stall-timeout", f"must be > 0 seconds, got {self.stall_timeout}")
        _need(
            self.nodes >= 1,
            "nodes",
            f"must be >= 1, got {self.nodes}",
            "the number of nodes of the run, as torchrun's --nnodes (1: this process alone)",
        )
        _need(
            self.dist_timeout > 0,
            "dist-timeout",
            f"must be > 0 seconds, got {self.dist_timeout}",
            "how long a collective may wait for the other nodes, e.g. 300",
        )

    def _check_target_and_data(self) -> None:
        """The mask token fits the vocabulary; a target model and data exist or can be made."""
        if self.vocab_size is not None and self.mask_token_id is not None:
            _need(
                0 <= self.mask_token_id < self.vocab_size,
                "mask-token-id",
                f"{self.mask_token_id} is outside the vocabulary (size {self.vocab_size})",
            )
        if self.target_model is None:
            _need(
                self.tiny_target is not None,
                "target-model",
                "is required (only the tiny preset builds its target from a config)",
                "pass --target-model /path/to/hf-model or use --preset tiny",
            )
        if self.data_dir is None:
            _need(
                self.synthetic_samples > 0,
                "data-dir",
                "is required (only the tiny preset synthesises data)",
                "prepare one with `python -m trainer prepare` and pass --data-dir",
            )

    # ---- derived ------------------------------------------------------------------------------------
    def layer_types(self) -> list[str]:
        """Per drafter layer: the first `sliding_layers` are sliding (docs/method.md#presets: Qwen3.6 is S,S,S,S,F)."""
        return ["sliding_attention"] * self.sliding_layers + ["full_attention"] * (
            self.num_draft_layers - self.sliding_layers
        )

    def anchors_per_row(self, rows: int) -> int:
        """Static anchor slots N per row for a micro-batch of `rows` rows (padded with keep=False)."""
        return max(1, min(self.anchors_per_seq, self.max_anchors // max(rows, 1)))


# ---- command line -----------------------------------------------------------------------------------
def _devices(text: str) -> list[str]:
    """'0,1' -> ['cuda:0', 'cuda:1']; 'cpu,cpu' -> ['cpu', 'cpu']; 'cuda:2' stays."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        out.append(f"cuda:{part}" if part.isdigit() else part)
    if not out:
        raise argparse.ArgumentTypeError(f"no device in {text!r}")
    return out


def int_list(text: str) -> list[int]:
    """A comma-separated list of integers (`--target-layer-ids`), as an argparse type."""
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


ON_OFF_FLAGS = {"enable_thinking"}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise TrainerInputError(message, hint=self.flag_hint(message))

    def flag_hint(self, message: str) -> str:
        """`--lrr 1` -> "did you mean --lr?": the closest known flag to each unknown one argparse names."""
        import difflib

        listing = "`python -m trainer train --help` lists every flag"
        if not message.startswith("unrecognized arguments: "):
            return "see `python -m trainer train --help`"
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        close = []
        for word in message.removeprefix("unrecognized arguments: ").split():
            if word.startswith("--"):
                close += difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
        return f"did you mean {' / '.join(dict.fromkeys(close))}? ({listing})" if close else listing


def build_parser() -> argparse.ArgumentParser:
    """One flag per TrainConfig field, each with its help line (trainer.core.train_help: what it does, its default and
    each preset's) and, where the set of values is fixed, its choices. The parser's own defaults are SUPPRESSed
    so presets can tell what the user set; the help shows the real ones."""
    from trainer.core.train_help import (
        ARCHS,
        FLAG_HELP,
        NOISE_TYPES,
        SYNC_MODES,
        TRANSFER_MODES,
        WANDB_MODES,
        flag_help,
    )

    parser = _Parser(
        prog="python -m trainer train",
        description="Train a DFlash drafter.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # keeps the epilog's lines
        epilog=f"presets: {', '.join(PRESETS)}; a preset sets the defaults listed after '--preset',\n"
        "and a flag given on the command line wins over both.\n"
        "exit codes: 0 done, 1 failed, 2 bad input, 128+signal stopped (resumable).",
    )
    types = {
        "target_gpus": _devices,
        "drafter_gpus": _devices,
        "target_layer_ids": int_list,
        "use_soft_labels": _bool,
        "pipeline": _bool,
        "enable_thinking": _bool,
        "activation_checkpointing": _bool,
    }
    choices = {
        "preset": tuple(PRESETS),
        "loss_kernels": LOSS_KERNELS,
        "lm_head_dtype": LM_HEAD_DTYPES,
        "attention_kernel": ATTENTION_KERNELS,
        "adamw": ADAMW_IMPLS,
        "output_norm_init": OUTPUT_NORM_INITS,
        "drafter_init": DRAFTER_INITS,
        "wandb": WANDB_MODES,
        "sync": SYNC_MODES,
        "feature_transfer": TRANSFER_MODES,
        "noise_type": NOISE_TYPES,
        "arch": ARCHS,
        "target_compile": TARGET_COMPILE,
    }
    metavars = {
        "target_gpus": "DEVICES",
        "drafter_gpus": "DEVICES",
        "target_layer_ids": "IDS",
        "resume": "auto|never|PATH",
        "target_model": "DIR",
        "data_dir": "DIR",
        "output_dir": "DIR",
        "init_from": "DIR",
        "feature_cache": "DIR",
        "tokenizer": "DIR",
    }
    skip = {"tiny_target"}
    for f in dataclasses.fields(TrainConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[operator]
        help_text = flag_help(f.name, default, PRESETS)  # KeyError for a field with no help: add it to FLAG_HELP
        kind: Callable[[str], Any] | None = types.get(f.name)
        if kind is None:
            text = str(f.type)
            kind = float if "float" in text else int if "int" in text else str
        if kind is _bool:
            # --enable-thinking is a mode, written on|off as eval's and prepare's (each takes true|false too).
            words = ("on", "off") if f.name in ON_OFF_FLAGS else ("true", "false")
            parser.add_argument(
                flag,
                dest=f.name,
                type=_bool,
                nargs="?",
                const=True,
                metavar="|".join(words),
                help=help_text + f"; the flag alone means {words[0]}",
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=kind, choices=choices.get(f.name), metavar=metavars.get(f.name), help=help_text
            )
    assert set(FLAG_HELP) == {f.name for f in dataclasses.fields(TrainConfig)} - skip, "FLAG_HELP out of date"
    return parser


def parse_train_args(argv: list[str]) -> TrainConfig:
    """Flags -> validated TrainConfig: preset values first, then what the user gave."""
    given = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    preset = given.get("preset")
    if preset is not None:
        if preset not in PRESETS:
            raise TrainerInputError(f"--preset: unknown preset {preset!r}", hint=f"choose one of {', '.join(PRESETS)}")
        values.update(PRESETS[preset])
    values.update(given)
    if preset != "tiny":
        values.setdefault("tiny_target", None)
    if values.get("target_model"):
        # Recorded absolute (the checkpoint's config): `trainer export --format speculators` reads the target's
        # embedding, LM head and norm from it later, from whatever folder the export runs in.
        values["target_model"] = os.path.abspath(values["target_model"])
    if values.get("output_dir") is None:
        values["output_dir"] = f"runs/train-{time.strftime('%Y%m%d-%H%M%S')}"
    return TrainConfig.from_dict(values).validate()
