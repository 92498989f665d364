"""Pre-flight: every check that can refuse a training run, made BEFORE the run directory exists.

`preflight(cfg)` reads the target's config (no weights), builds the drafter shape, opens the data, resolves
the resume checkpoint and checks its shape and the number of nodes that wrote it, checks --init-from and the
loss kernels, and counts the optimizer steps the data holds. It reads and never writes; bad input is a
TrainerInputError (one `error:` line, one `hint:` line, exit 2, nothing on disk). `load_target(setup)` is the
one place a target model is loaded, shared by every engine (single-process, threaded pipeline, distributed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from trainer.core.config import TrainConfig, TrainerInputError
from trainer.data.batches import BatchStream, open_dataset
from trainer.model import DFlashDrafter, DrafterConfig, TargetModel
from trainer.state.checkpoint import check_shapes, read_state, resolve_resume
from trainer.state.handover import pending_writer
from trainer.state.metrics import STARTUP_MARKS
from trainer.training.loss import position_weights
from trainer.training.step import check_loss_kernels, check_triton_adamw


@dataclass
class RunSetup:
    """Everything decided before the run directory exists."""

    cfg: TrainConfig
    drafter_config: DrafterConfig
    dataset: Any
    resume_from: Path | None
    target_device: torch.device
    drafter_device: torch.device
    total_steps: int = 0  # optimizer steps of this run: min(--max-steps, what the data holds)
    # Micro-batches in each epoch (BatchStream.epoch_sizes) up to the epoch --max-steps reaches: counted once
    # here, reused (and extended for several drafters) by the engine.
    epoch_sizes: list[int] = field(default_factory=list)
    # The run still writing the --resume checkpoint (a restart's hand-over, trainer.state.handover): its checks are
    # deferred until trainer.training.loop has waited for it.
    resume_writer: Path | None = None
    # False on the nodes of a distributed run other than node 0: `resume_from` then names node 0's checkpoint,
    # which only node 0 reads (and sends); it may not exist on this node's disk.
    reads_checkpoints: bool = True


def first_device(devices: list[str]) -> torch.device:
    """The first of a device list, or cuda:0 when there is a GPU, else the CPU."""
    if devices:
        return torch.device(devices[0])
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def target_hf_config(cfg: TrainConfig) -> Any:
    """The target's HF config, read without loading weights."""
    from transformers import AutoConfig, Qwen3Config

    if cfg.target_model is None:
        assert cfg.tiny_target is not None
        return Qwen3Config(
            **cfg.tiny_target,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        )
    path = Path(cfg.target_model)
    if not (path / "config.json").is_file():
        raise TrainerInputError(
            f"--target-model: {path} is not a model directory (no config.json)",
            hint="pass a local Hugging Face model directory",
        )
    return AutoConfig.from_pretrained(path, local_files_only=True)


def target_shape(cfg: TrainConfig) -> Any:
    """What build_drafter_config reads of the target: the tiny preset's own values (a namespace: they name every
    field it reads; tests/trainer/test_train.py checks both give one drafter config), else the HF config. The tiny
    target's needs no transformers: importing it reads the `__all__` of every model file in transformers.models
    (~1 CPU-s of a `trainer check`'s ~2.7, ~25 checks a test suite); load_target imports it to build the model."""
    if cfg.target_model is None:
        assert cfg.tiny_target is not None
        return SimpleNamespace(**cfg.tiny_target)
    return target_hf_config(cfg)


def build_drafter_config(cfg: TrainConfig, hf_config: Any) -> DrafterConfig:
    """Drafter shape from the config, unset fields taken from the target; every mismatch names its flag."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_target_layers = int(text.num_hidden_layers)
    heads = cfg.num_attention_heads or text.num_attention_heads
    hidden = cfg.hidden_size or text.hidden_size
    vocab = int(text.vocab_size)
    if hidden != text.hidden_size:
        raise TrainerInputError(
            f"--hidden-size: drafter hidden size {hidden} != target hidden size {text.hidden_size}",
            hint="the drafter shares the target's embedding and LM head; use the matching preset",
        )
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < vocab:
        raise TrainerInputError(
            f"--mask-token-id: {cfg.mask_token_id} is outside the target's vocabulary (size {vocab})",
            hint="use a reserved token id of the target's tokenizer (Qwen3: 151669)",
        )
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
        raise TrainerInputError(
            f"--num-target-layers: the preset expects a {cfg.num_target_layers}-layer target, "
            f"{cfg.target_model} has {num_target_layers}",
            hint="pick the preset of this target",
        )
    from trainer.model import default_target_layer_ids

    try:
        layer_ids = cfg.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.num_draft_layers)
        missing = [i for i in layer_ids if not 0 <= i < num_target_layers]
        if missing:
            raise ValueError(f"the target has layers 0..{num_target_layers - 1}, no layer {missing}")
        config = DrafterConfig(
            hidden_size=hidden,
            intermediate_size=cfg.intermediate_size or text.intermediate_size,
            num_hidden_layers=cfg.num_draft_layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.num_key_value_heads or getattr(text, "num_key_value_heads", heads),  # type: ignore[arg-type]
            head_dim=cfg.head_dim or getattr(text, "head_dim", None) or hidden // heads,
            vocab_size=vocab,
            block_size=cfg.block_size,
            target_layer_ids=layer_ids,
            num_target_layers=num_target_layers,
            mask_token_id=cfg.mask_token_id,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            layer_types=cfg.layer_types(),
            sliding_window=cfg.sliding_window,
            max_position_embeddings=cfg.max_position_embeddings,
            arch=cfg.arch,
            conv_kernel_size=cfg.conv_kernel_size,
            conv_group_size=cfg.conv_group_size,
            selector_rank=cfg.selector_rank,
            selector_top_k=cfg.selector_top_k,
        )
    except ValueError as exc:
        if any(key in str(exc) for key in ("conv_", "selector_")):
            raise TrainerInputError(f"--arch dflash2: {exc}", hint="see --help for the dflash2 settings") from None
        raise TrainerInputError(
            f"--num-draft-layers/--target-layer-ids: {exc}", hint="the drafter taps one target layer per drafter layer"
        ) from None
    if cfg.drafter_init == "target":
        check_target_start(config, text)
    return config


def check_target_start(config: DrafterConfig, text: Any) -> None:
    """`--drafter-init target` copies the target's layers after the deepest tap into the drafter's: there must be
    one for every draft layer, of the drafter's shapes."""
    deepest, layers = max(config.target_layer_ids), int(text.num_hidden_layers)
    if deepest + config.num_hidden_layers >= layers:
        raise TrainerInputError(
            f"--drafter-init target: the deepest tap is layer {deepest} of {layers}, so the target has "
            f"{layers - 1 - deepest} layer(s) after it for {config.num_hidden_layers} draft layers",
            hint="tap shallower layers (--target-layer-ids), use fewer draft layers, or --drafter-init random",
        )
    heads = int(text.num_attention_heads)
    theirs = {
        "intermediate-size": int(text.intermediate_size),
        "num-attention-heads": heads,
        "num-key-value-heads": int(getattr(text, "num_key_value_heads", heads)),
        "head-dim": int(getattr(text, "head_dim", None) or text.hidden_size // heads),
    }
    ours = {
        "intermediate-size": config.intermediate_size,
        "num-attention-heads": config.num_attention_heads,
        "num-key-value-heads": config.num_key_value_heads,
        "head-dim": config.head_dim,
    }
    for flag, value in ours.items():
        if value != theirs[flag]:
            raise TrainerInputError(
                f"--drafter-init target: the drafter's --{flag} is {value}, the target's layers have {theirs[flag]}",
                hint=f"leave --{flag} unset (it is then the target's), or --drafter-init random",
            )


def check_dataset_settings(cfg: TrainConfig, dataset: object) -> None:
    """Refuse data tokenized with another chat template or thinking mode than this run serves (docs/method.md#data).

    Only prepared datasets that recorded a chat template are checked; the tokenizer is read from --tokenizer,
    else from --target-model. Reads files, writes nothing."""
    meta = getattr(dataset, "meta", None)
    if meta is None or not (meta.chat_template_sha256 or meta.enable_thinking is not None):
        return
    from trainer.data.prepare import check_dataset_matches

    tokenizer = None
    if meta.chat_template_sha256:
        source = cfg.tokenizer or cfg.target_model
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True) if source else None
        except (OSError, ValueError) as exc:
            raise TrainerInputError(
                f"--tokenizer: cannot load a tokenizer from {source}: {str(exc).splitlines()[0]}",
                hint="pass --tokenizer DIR (the serving tokenizer) to check the dataset's chat template",
            ) from None
        if tokenizer is None:
            raise TrainerInputError(
                "--tokenizer: the dataset records a chat template but no tokenizer was given",
                hint="pass --tokenizer DIR or --target-model DIR",
            )
    if tokenizer is not None:
        check_dataset_matches(meta, tokenizer, cfg.enable_thinking)
    elif (
        cfg.enable_thinking is not None
        and meta.enable_thinking is not None
        and meta.enable_thinking != cfg.enable_thinking
    ):
        raise TrainerInputError(
            f"--enable-thinking: the dataset was prepared with enable_thinking={meta.enable_thinking}",
            hint="re-run prepare with the serving thinking mode",
        )


def check_resume_nodes(path: Path, nodes: int) -> None:
    """Refuse to resume a checkpoint written by another number of nodes. The nodes split every optimizer step's
    micro-batches, so their number fixes the global batch, the step count the data holds and the schedule's
    horizon: continuing on fewer or more nodes would be another run under the same name."""
    saved = int(read_state(path).get("pipeline", {}).get("nodes", 1))
    if saved != nodes:
        raise TrainerInputError(
            f"--resume: checkpoint {path} was written by a run on {saved} node(s); this run has --nodes {nodes}",
            hint=f"resume it on {saved} node(s) (--nodes {saved}, one torchrun per node), or "
            "export it and start a new run with --init-from",
        )


def preflight(cfg: TrainConfig, *, reads_checkpoints: bool = True) -> RunSetup:
    """Every check that can refuse the run; reads, never writes. `reads_checkpoints=False` (the nodes other than
    node 0 of a distributed run, which never read checkpoints or drafter files) skips --resume and --init-from:
    node 0 reads them and sends what it read to every node."""
    drafter_config = build_drafter_config(cfg, target_shape(cfg))
    cfg.vocab_size = drafter_config.vocab_size
    dataset = open_dataset(cfg)
    check_dataset_settings(cfg, dataset)
    run_dir = Path(cfg.output_dir or ".")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainerInputError(f"--output-dir: {run_dir} exists and is not a directory")
    writer = pending_writer(cfg.resume) if reads_checkpoints else None
    if writer is not None:
        resume_from: Path | None = Path(cfg.resume)
    else:
        resume_from = resolve_resume(cfg.resume, run_dir) if reads_checkpoints else None
    expected = expected_shapes(drafter_config)
    if resume_from is not None and writer is None:
        check_shapes(resume_from, expected)
        check_resume_nodes(resume_from, cfg.nodes)
    if cfg.init_from is not None and reads_checkpoints:
        check_init_from(Path(cfg.init_from), expected)
    stream = BatchStream(dataset, cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    # Count only the epochs --max-steps reaches (one drafter's micro-batches; a pipeline of several extends it).
    enough = cfg.max_steps * cfg.grad_accum if cfg.max_steps else None
    steps_in_data = stream.total_micro_batches(enough) // cfg.grad_accum
    if steps_in_data < 1:
        raise TrainerInputError(
            f"--grad-accum: the data holds {stream.total_micro_batches()} micro-batches over "
            f"--epochs {cfg.epochs}, fewer than one optimizer step",
            hint="use more data or epochs",
        )
    total_steps = min(cfg.max_steps, steps_in_data) if cfg.max_steps else steps_in_data
    drafter_device = first_device(cfg.drafter_gpus)
    check_loss_kernels(cfg.loss_kernels, drafter_device)  # before the (minutes long) target load
    if cfg.adamw == "triton":
        check_triton_adamw(drafter_device)
    STARTUP_MARKS["checked"] = round(time.time(), 3)  # the pre-flight's share of a start (status.json timeline)
    return RunSetup(
        cfg,
        drafter_config,
        dataset,
        resume_from,
        first_device(cfg.target_gpus),
        drafter_device,
        total_steps,
        resume_writer=writer,
        epoch_sizes=stream.epoch_sizes(enough),
        reads_checkpoints=reads_checkpoints,
    )


def expected_shapes(drafter_config: DrafterConfig) -> dict[str, list[int]]:
    """Every tensor name and shape of this drafter's checkpoint (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {n: list(t.shape) for n, t in DFlashDrafter(drafter_config).state_dict().items()}


def check_init_from(directory: Path, expected: dict[str, list[int]]) -> None:
    """An exported drafter to start from must have exactly this drafter's tensors (names and shapes)."""
    from safetensors import safe_open

    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise TrainerInputError(
            f"--init-from: {directory} has no model.safetensors",
            hint="point it at an exported drafter directory (python -m trainer export)",
        )
    with safe_open(str(weights), framework="pt") as handle:  # reads the header only
        found = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118 - not a dict
    if found != expected:
        diff = sorted(set(found) ^ set(expected)) or [n for n in expected if found[n] != expected[n]]
        raise TrainerInputError(
            f"--init-from: {directory} is of a different drafter shape (first difference: {diff[0]})",
            hint="use the flags that drafter was trained with",
        )


def resolve_devices(names: list[str], flag: str) -> list[torch.device]:
    """Device strings -> devices; an unavailable CUDA device is bad input naming the flag."""
    devices = [torch.device(n) for n in (names or ["cuda:0" if torch.cuda.is_available() else "cpu"])]
    for device in devices:
        if device.type == "cuda":
            count = torch.cuda.device_count()
            if (device.index or 0) >= count:
                raise TrainerInputError(
                    f"--{flag}: {device} does not exist (this machine has {count} CUDA device(s))",
                    hint="list devices with nvidia-smi; use 'cpu' on a machine without GPUs",
                )
        elif device.type != "cpu":
            raise TrainerInputError(f"--{flag}: unsupported device {device}", hint="use GPU indices or 'cpu'")
    return devices


def load_target(setup: RunSetup, device: torch.device | None = None) -> TargetModel:
    """The frozen target on `device` (default: the setup's target device); bf16 on CUDA, fp32 on the CPU."""
    cfg, ids = setup.cfg, setup.drafter_config.target_layer_ids
    device = device or setup.target_device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if cfg.target_model is None:
        return TargetModel.from_config(target_hf_config(cfg), ids, seed=cfg.seed, dtype=dtype, device=device)
    return TargetModel.from_pretrained(cfg.target_model, ids, dtype=dtype, device=device)
