"""`python -m trainer train --help`: one line per flag, with its default (and each preset's), and its choices.

Kept apart from trainer/core/config.py so that the config stays a list of fields. `FLAG_HELP` has an entry for
every TrainConfig field that is a flag; `trainer.core.config.build_parser` looks each one up, so a new field without
help fails every parse (and the tests) at once instead of shipping a silent flag. The defaults shown are read
from TrainConfig and PRESETS, never retyped here, so they cannot drift from what the run does.
"""

from __future__ import annotations

from typing import Any

# Fixed sets of values: argparse `choices=` (the help lists them; anything else is refused naming the flag).
WANDB_MODES = ("auto", "on", "off")
SYNC_MODES = ("grad", "average")  # as trainer.pipeline.replica_sync.SYNC_MODES (not imported: that pulls in torch)
TRANSFER_MODES = ("device", "pinned")  # as trainer.pipeline.handoff.TRANSFER_MODES
NOISE_TYPES = ("uniform", "gaussian")
ARCHS = ("dflash", "dflash2")  # as trainer.model.dflash2.ARCHS (not imported: that pulls in torch)

# What a default of None (or an empty list) means, where it means something (otherwise "none" is shown).
NONE_MEANS = {
    "preset": "none: the plain defaults",
    "target_model": "none: only the tiny preset, which builds its own target",
    "data_dir": "none: only the tiny preset, which synthesises token data",
    "output_dir": "runs/train-<timestamp>",
    "tokenizer": "--target-model",
    "target_gpus": "cuda:0 if there is a GPU, else cpu",
    "drafter_gpus": "cuda:0 if there is a GPU, else cpu",
    "enable_thinking": "none: not checked",
    "max_steps": "none: no cap, every step the data holds",
    "loss_chunk_size": "none: about 1 GiB of fp32 logits per chunk",
    "hidden_size": "the target's",
    "intermediate_size": "the target's",
    "num_attention_heads": "the target's",
    "num_key_value_heads": "the target's",
    "head_dim": "the target's, else hidden / heads",
    "vocab_size": "the target's",
    "mask_token_id": "none: required",
    "num_target_layers": "none: not checked",
    "target_layer_ids": "spread over the target's layers (docs/method.md#target-taps)",
    "sliding_window": "none",
    "wandb_run_name": "$DFLASHOPS_RUN_NAME, else wandb's own",
}

FLAG_HELP: dict[str, str] = {
    # run, inputs and outputs
    "preset": "named defaults for a drafter shape; tiny runs on the CPU with its own target and data",
    "target_model": "local Hugging Face directory of the frozen target model",
    "data_dir": "prepared token shards (python -m trainer prepare)",
    "output_dir": "the run directory: status.json, metrics.jsonl, checkpoints/",
    "init_from": "exported drafter directory to start from (weights only; fresh optimizer and schedule)",
    "feature_cache": "directory where each sample's target taps are stored the first time they are computed and "
    "read back after (the target's forward is paid once per sample, not once per epoch; single-process engine, "
    "no soft labels) (default: off)",
    "output_norm_init": "the drafter's final norm weight at init: ones, or calibrated so that a hidden state "
    "along the MASK token's embedding gives logits of std 1 through the target's LM head (targets whose "
    "embeddings are anisotropic, e.g. SmolLM2: a first loss of ~55 instead of ~15)",
    "drafter_init": "the drafter's weights at init: random, or target: each draft layer starts as the target's "
    "layer after the deepest tap (the first draft layer as the next layer, and so on), the final norm as the target's, "
    "and fc reads the deepest tap alone (needs the drafter's layer shapes to be the target's)",
    "tokenizer": "tokenizer directory used to check that the dataset's chat template is the serving one",
    "enable_thinking": "the serving thinking mode, checked against the one the dataset was prepared with",
    "resume": "auto: continue from the newest checkpoint in --output-dir if any; never: refuse a directory "
    "that has checkpoints; or a checkpoints/step_NNNNNN path",
    # devices and the threaded pipeline
    "target_gpus": "target devices, comma-separated GPU indices or names (0,1 / cpu); more than one starts "
    "the threaded pipeline",
    "drafter_gpus": "drafter devices, as --target-gpus; more than one trains replicas in the threaded pipeline",
    "pipeline": "use the threaded pipeline even with one target and one drafter device",
    "sync": "replica sync with several drafters (threads of a node, and the nodes of a distributed run): grad "
    "(gradients summed every step, replicas identical) or average (weights averaged every "
    "--sync-interval steps, the mode for 10-100 Gb/s links between nodes)",
    "sync_interval": "--sync average: steps between weight averages (unused by grad)",
    "queue_depth": "pipeline: feature batches in flight per (target, drafter) channel, the memory bound",
    "feature_transfer": "pipeline: device (features copied onto the drafter's GPU) or pinned (staged in "
    "pinned host memory)",
    "stall_timeout": "pipeline: seconds without an optimizer step before the run fails as stalled",
    "nodes": "nodes of a distributed run, one torchrun process per node (torchrun --nnodes N --nproc-per-node 1 "
    "-m trainer train ... --nodes N); each node runs the threaded pipeline on its own devices",
    "dist_timeout": "distributed: seconds a collective waits for the other nodes; a node that died or whose "
    "network is cut ends every other node within about this long",
    # optimisation
    "epochs": "passes over the data",
    "max_steps": "a cap: stop after at most this many optimizer steps (fewer if --epochs of data run out "
    "first); also the horizon of the LR schedule",
    "lr": "peak AdamW learning rate (linear warm-up, then cosine to 0 at the last step)",
    "warmup_ratio": "fraction of the run's steps spent in linear LR warm-up",
    "weight_decay": "AdamW weight decay",
    "adamw": "AdamW implementation: auto = torch's fused kernel for CUDA drafters (one kernel family instead of "
    "a foreach chain of launches), torch's default elsewhere; triton = one Triton kernel per parameter that does "
    "not write the clipped gradients back (CUDA only; trainer/kernels/adamw_triton.py)",
    "grad_accum": "micro-batches per optimizer step (the loss is normalised over the whole step)",
    "grad_clip": "clip the gradient norm to this (0 disables clipping)",
    "seed": "seed of the drafter's init, the data order, the anchors, the feature noise and synthetic data",
    # batching and anchors
    "token_budget": "padded context tokens (rows x padded length) per micro-batch",
    "max_seq_len": "longer samples are truncated to this many tokens",
    "max_batch_size": "rows per micro-batch at most",
    "arch": "drafter architecture: dflash, or dflash2 (block convolutions around each sublayer and a candidate "
    "selector that reranks each slot's unary top-k; docs/method.md#dflash2)",
    "conv_kernel_size": "dflash2: taps of each block convolution (slot j reads slots j-K+1..j of its block)",
    "conv_group_size": "dflash2: hidden channels sharing one dynamic kernel coefficient (must divide the hidden size)",
    "selector_rank": "dflash2: rank of the candidate selector's codebooks",
    "selector_top_k": "dflash2: unary candidates the selector reranks per slot",
    "selector_loss_alpha": "dflash2: weight of the selector's K-way cross-entropy next to the unary loss",
    "block_size": "tokens per draft block (the anchor plus block-size - 1 drafted tokens)",
    "anchors_per_seq": "anchor positions sampled per sequence, at most (see --max-anchors)",
    "max_anchors": "anchors per micro-batch, all rows together",
    # objective
    "gamma": "position weight decay: slot k weighs exp(-(k-1)/gamma)",
    "noise_type": "distribution of the noise added to the target's context features",
    "noise_start": "feature noise std at the first step (linear to --noise-end; 0: no noise)",
    "noise_end": "feature noise std at the last step",
    "use_soft_labels": "also train on the target's distributions (soft KL term, weight --kl-weight)",
    "kl_weight": "weight of the soft-label KL term (with --use-soft-labels)",
    "kl_temperature": "temperature of the soft-label KL term",
    "cap_lambda": "weight of the CAP (expected accepted length) term; 0: off",
    "activation_checkpointing": "recompute drafter layer activations in backward (less memory, more time)",
    "target_compile": "run the frozen target's decoder layers through one torch.compile'd layer call per target "
    "(fuses the eager norms, rotary and SiLU; compiled during the warm-up, cached across restarts); auto: on for a "
    "CUDA target",
    "loss_chunk_size": "rows per chunk of the logits-free loss (rounded down to whole blocks)",
    "attention_kernel": "the drafter's attention on CUDA: flex (flex_attention with a BlockMask), triton (our "
    "kernel for the interval-form mask, forward and backward; bench/results/kernels.md 2026-12-03) or auto (triton on "
    "Hopper, flex elsewhere)",
    "loss_kernels": "element-wise kernels of the loss: auto (eager for an uncompiled drafter, e.g. on the "
    "CPU; triton on CUDA compute capability >= 9.0 with triton installed; else compiled), "
    "compiled, eager, or triton (CUDA only)",
    "lm_head_dtype": "the dtype of the loss's LM-head GEMMs: auto (the target head's own: bf16 on CUDA, fp32 on the "
    "CPU) or bfloat16 (the same as auto on CUDA). On the CPU bfloat16 trained make demo-real's drafter 1.28x "
    'as fast to the same tau (bench/results/quality.md 2026-12-08 "The LM head in bf16 on the CPU")',
    # drafter shape
    "num_draft_layers": "drafter decoder layers (one target layer tapped per drafter layer)",
    "hidden_size": "drafter hidden size; must equal the target's",
    "intermediate_size": "drafter MLP size",
    "num_attention_heads": "drafter query heads",
    "num_key_value_heads": "drafter key/value heads",
    "head_dim": "drafter head dimension",
    "vocab_size": "vocabulary size; the run uses the target's (this value only pre-checks --mask-token-id)",
    "mask_token_id": "token id of the MASK token filling the draft block (a reserved id; Qwen3: 151669)",
    "num_target_layers": "the number of layers the preset expects of the target; a different target is refused",
    "target_layer_ids": "comma-separated target layer ids to tap, one per drafter layer",
    "rope_theta": "drafter RoPE base",
    "rms_norm_eps": "drafter RMSNorm epsilon",
    "max_position_embeddings": "drafter maximum positions (RoPE)",
    "sliding_layers": "the first this many drafter layers use sliding-window attention",
    "sliding_window": "window of the sliding-window layers, in tokens",
    "synthetic_samples": "synthetic sequences to train on when there is no --data-dir (tiny preset)",
    # bookkeeping
    "save_interval": "checkpoint every this many steps (and at the end and on a stop request)",
    "keep_checkpoints": "keep only the newest this many checkpoints of the run",
    "log_interval": "one metrics line and progress line every this many steps",
    "wandb": "Weights & Biases logging: auto (on if wandb is installed), on or off; offline unless "
    "WANDB_API_KEY is set",
    "wandb_project": "wandb project",
    "wandb_run_name": "wandb run name",
}


def _shown(name: str, value: Any) -> str:
    if value is None:
        return NONE_MEANS.get(name, "none")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value) or NONE_MEANS.get(name, "none")
    return str(value)


def flag_help(name: str, default: Any, presets: dict[str, dict[str, Any]]) -> str:
    """FLAG_HELP[name] + `(default: X; preset P: Y, ...)`, listing each preset that sets another value.
    `%` is escaped: argparse formats help strings with `%`."""
    preset_values = [
        f"{preset} {_shown(name, values[name])}"
        for preset, values in presets.items()
        if name in values and values[name] != default
    ]
    text = f"{FLAG_HELP[name]} (default: {_shown(name, default)}"
    if preset_values:
        text += f"; --preset {', '.join(preset_values)}"
    return (text + ")").replace("%", "%%")
