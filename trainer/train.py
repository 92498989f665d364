"""`python -m trainer train`: the single-process DFlash drafter trainer (one target, one drafter).

Reads top to bottom like a torchtitan Trainer.train:
  1. parse flags -> TrainConfig (presets, cross-checks)
  2. check everything that can refuse — target shape and taps, drafter shape, mask id, data, resume
     checkpoint shape — BEFORE writing anything (bad input: `error:`/`hint:`, exit 2, no run directory)
  3. create the run directory, status.json (warmup), load the target, build the drafter, optimizer, schedule
  4. resume (model, optimizer, schedule, RNG, data position) when a checkpoint exists
  5. loop: grad_accum micro-batches -> target features -> drafter forward/backward (loss normalised over the
     whole step) -> clip, AdamW, schedule -> log -> checkpoint every --save-interval and at the end
  6. SIGTERM/SIGHUP/SIGINT: finish the step, checkpoint, status `stopped`, exit 128+signum
Exit codes: 0 done, 1 failed (status.json `failed` with the error; a full disk while checkpointing is one
`error:` line naming the filesystem, the step and the last good checkpoint: trainer.failure), 2 bad input,
128+signum stopped.
Several target/drafter devices (or --pipeline) hand over to the threaded pipeline (trainer.pipeline.run).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import CheckpointWriter, check_shapes, load_checkpoint, resolve_resume, restore_rng
from trainer.config import TrainConfig, TrainerInputError, parse_train_args
from trainer.data import BatchStream, open_dataset
from trainer.failure import record_failure
from trainer.loss import position_weights
from trainer.metrics import RunRecorder, truncate_metrics
from trainer.model import DFlashDrafter, DrafterConfig, TargetModel
from trainer.signals import GracefulStop
from trainer.step import DrafterSide, StepStats, TargetSide, check_loss_kernels, micro_batches, noise_std_at

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def main(argv: list[str]) -> int:
    """Entry point of `python -m trainer train`; returns the exit code."""
    try:
        cfg = parse_train_args(argv)
        if cfg.pipeline or len(cfg.target_gpus) > 1 or len(cfg.drafter_gpus) > 1:
            try:
                from trainer.pipeline.run import run_pipeline  # lazy: threads, compile guards
            except ImportError as exc:
                raise TrainerInputError(f"--drafter-gpus/--target-gpus: the threaded pipeline is unavailable ({exc})",
                                        hint="give one target and one drafter device") from None
            return int(run_pipeline(cfg))
        return run(cfg)
    except TrainerInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return EXIT_BAD_INPUT


@dataclass
class Plan:
    """Everything decided before the run directory exists."""

    cfg: TrainConfig
    hf_config: Any
    drafter_config: DrafterConfig
    dataset: Any
    resume_from: Path | None
    target_device: torch.device
    drafter_device: torch.device
    total_steps: int = 0  # optimizer steps of this run: min(--max-steps, what the data holds)


def _device(devices: list[str]) -> torch.device:
    if devices:
        return torch.device(devices[0])
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def _target_hf_config(cfg: TrainConfig) -> Any:
    """The target's HF config, read without loading weights."""
    from transformers import AutoConfig, Qwen3Config

    if cfg.target_model is None:
        assert cfg.tiny_target is not None
        return Qwen3Config(**cfg.tiny_target, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})
    path = Path(cfg.target_model)
    if not (path / "config.json").is_file():
        raise TrainerInputError(f"--target-model: {path} is not a model directory (no config.json)",
                                hint="pass a local Hugging Face model directory")
    return AutoConfig.from_pretrained(path, local_files_only=True)


def build_drafter_config(cfg: TrainConfig, hf_config: Any) -> DrafterConfig:
    """Drafter shape from the config, unset fields taken from the target; every mismatch names its flag."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    num_target_layers = int(text.num_hidden_layers)
    heads = cfg.num_attention_heads or text.num_attention_heads
    hidden = cfg.hidden_size or text.hidden_size
    vocab = int(text.vocab_size)
    if hidden != text.hidden_size:
        raise TrainerInputError(f"--hidden-size: drafter hidden size {hidden} != target hidden size {text.hidden_size}",
                                hint="the drafter shares the target's embedding and LM head; use the matching preset")
    if cfg.mask_token_id is None or not 0 <= cfg.mask_token_id < vocab:
        raise TrainerInputError(f"--mask-token-id: {cfg.mask_token_id} is outside the target's vocabulary (size {vocab})",
                                hint="use a reserved token id of the target's tokenizer (Qwen3: 151669)")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_target_layers:
        raise TrainerInputError(f"--num-target-layers: the preset expects a {cfg.num_target_layers}-layer target, "
                                f"{cfg.target_model} has {num_target_layers}", hint="pick the preset of this target")
    from trainer.model import default_target_layer_ids

    try:
        layer_ids = cfg.target_layer_ids or default_target_layer_ids(num_target_layers, cfg.num_draft_layers)
        missing = [i for i in layer_ids if not 0 <= i < num_target_layers]
        if missing:
            raise ValueError(f"the target has layers 0..{num_target_layers - 1}, no layer {missing}")
        return DrafterConfig(
            hidden_size=hidden, intermediate_size=cfg.intermediate_size or text.intermediate_size,
            num_hidden_layers=cfg.num_draft_layers, num_attention_heads=heads,
            num_key_value_heads=cfg.num_key_value_heads or getattr(text, "num_key_value_heads", heads),
            head_dim=cfg.head_dim or getattr(text, "head_dim", None) or hidden // heads, vocab_size=vocab,
            block_size=cfg.block_size, target_layer_ids=layer_ids, num_target_layers=num_target_layers,
            mask_token_id=cfg.mask_token_id, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
            layer_types=cfg.layer_types(), sliding_window=cfg.sliding_window,
            max_position_embeddings=cfg.max_position_embeddings)
    except ValueError as exc:
        raise TrainerInputError(f"--num-draft-layers/--target-layer-ids: {exc}",
                                hint="the drafter taps one target layer per drafter layer") from None


def check_dataset_settings(cfg: TrainConfig, dataset: object) -> None:
    """Refuse data tokenized with another chat template or thinking mode than this run serves (METHOD.md 4).

    Only prepared datasets that recorded a chat template are checked; the tokenizer is read from --tokenizer,
    else from --target-model. Reads files, writes nothing."""
    meta = getattr(dataset, "meta", None)
    if meta is None or not (meta.chat_template_sha256 or meta.enable_thinking is not None):
        return
    from trainer.prepare import check_dataset_matches

    tokenizer = None
    if meta.chat_template_sha256:
        source = cfg.tokenizer or cfg.target_model
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True) if source else None
        except (OSError, ValueError) as exc:
            raise TrainerInputError(f"--tokenizer: cannot load a tokenizer from {source}: {str(exc).splitlines()[0]}",
                                    hint="pass --tokenizer DIR (the serving tokenizer) to check the dataset's chat template") from None
        if tokenizer is None:
            raise TrainerInputError("--tokenizer: the dataset records a chat template but no tokenizer was given",
                                    hint="pass --tokenizer DIR or --target-model DIR")
    if tokenizer is not None:
        check_dataset_matches(meta, tokenizer, cfg.enable_thinking)
    elif cfg.enable_thinking is not None and meta.enable_thinking is not None and meta.enable_thinking != cfg.enable_thinking:
        raise TrainerInputError(f"--enable-thinking: the dataset was prepared with enable_thinking={meta.enable_thinking}",
                                hint="re-run prepare with the serving thinking mode")


def plan_run(cfg: TrainConfig) -> Plan:
    """Every check that can refuse the run; reads, never writes."""
    hf_config = _target_hf_config(cfg)
    drafter_config = build_drafter_config(cfg, hf_config)
    cfg.vocab_size = drafter_config.vocab_size
    dataset = open_dataset(cfg)
    check_dataset_settings(cfg, dataset)
    run_dir = Path(cfg.output_dir or ".")
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainerInputError(f"--output-dir: {run_dir} exists and is not a directory")
    resume_from = resolve_resume(cfg.resume, run_dir)
    with torch.device("meta"):  # shapes only: no memory, no init
        expected = {n: list(t.shape) for n, t in DFlashDrafter(drafter_config).state_dict().items()}
    if resume_from is not None:
        check_shapes(resume_from, expected)
    if cfg.init_from is not None:
        _check_init_from(Path(cfg.init_from), expected)
    stream = BatchStream(dataset, cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    steps_in_data = stream.total_micro_batches() // cfg.grad_accum
    if steps_in_data < 1:
        raise TrainerInputError(f"--grad-accum: the data holds {stream.total_micro_batches()} micro-batches over "
                                f"--epochs {cfg.epochs}, fewer than one optimizer step", hint="use more data or epochs")
    total_steps = min(cfg.max_steps, steps_in_data) if cfg.max_steps else steps_in_data
    drafter_device = _device(cfg.drafter_gpus)
    check_loss_kernels(cfg.loss_kernels, drafter_device)  # before the (minutes long) target load
    return Plan(cfg, hf_config, drafter_config, dataset, resume_from, _device(cfg.target_gpus),
                drafter_device, total_steps)


def _check_init_from(directory: Path, expected: dict[str, list[int]]) -> None:
    """An exported drafter to start from must have exactly this drafter's tensors (names and shapes)."""
    from safetensors import safe_open

    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise TrainerInputError(f"--init-from: {directory} has no model.safetensors",
                                hint="point it at an exported drafter directory (python -m trainer export)")
    with safe_open(str(weights), framework="pt") as handle:  # reads the header only
        found = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    if found != expected:
        diff = sorted(set(found) ^ set(expected)) or [n for n in expected if found[n] != expected[n]]
        raise TrainerInputError(f"--init-from: {directory} is of a different drafter shape (first difference: {diff[0]})",
                                hint="use the flags that drafter was trained with")


def _load_target(plan: Plan) -> TargetModel:
    cfg, ids = plan.cfg, plan.drafter_config.target_layer_ids
    dtype = torch.bfloat16 if plan.target_device.type == "cuda" else torch.float32
    if cfg.target_model is None:
        return TargetModel.from_config(plan.hf_config, ids, seed=cfg.seed, dtype=dtype, device=plan.target_device)
    return TargetModel.from_pretrained(cfg.target_model, ids, dtype=dtype, device=plan.target_device)


def run(cfg: TrainConfig) -> int:
    """Train per `cfg`; return the exit code (see module doc)."""
    plan = plan_run(cfg)
    run_dir = Path(cfg.output_dir or ".")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")
    stream = BatchStream(plan.dataset, cfg, position_weights(cfg.block_size, cfg.gamma).numpy())
    total_steps = plan.total_steps
    recorder = RunRecorder(run_dir, total_steps)
    print(f"run directory {run_dir.resolve()} ({total_steps} steps; target on {plan.target_device}, "
          f"drafter on {plan.drafter_device})", file=sys.stderr, flush=True)
    on_force = lambda signum: recorder.set_status(  # noqa: E731 - a second signal: no checkpoint
        phase="failed", error=f"second signal {signum}: exited without a checkpoint", exit_code=128 + signum)
    writer: CheckpointWriter | None = None  # read by the failure report: a write that failed meanwhile
    # Installed before the (possibly minutes long) target load, so a stop request is never lost.
    with GracefulStop(on_force=on_force) as stop:
        try:
            recorder.open_wandb(cfg.wandb, cfg.wandb_project, cfg.wandb_run_name, cfg.to_dict())
            target = _load_target(plan)
            torch.manual_seed(cfg.seed)  # the drafter's init is a function of --seed
            drafter = DFlashDrafter(plan.drafter_config)
            if cfg.init_from is not None:
                drafter.load_state_dict(DFlashDrafter.from_pretrained(cfg.init_from).state_dict())
            target_side = TargetSide(target, plan.target_device, soft_labels=cfg.use_soft_labels)
            drafter_side = DrafterSide(cfg, drafter, target.embed_weight, target.lm_head_weight, plan.drafter_device,
                                       total_steps)
            print(f"loss kernels: {drafter_side.loss_kernels.kind}", file=sys.stderr, flush=True)
            step, epoch, index = 0, 0, 0
            if plan.resume_from is not None:
                state = load_checkpoint(plan.resume_from)
                drafter_side.drafter.load_state_dict(state.model)
                drafter_side.optimizer.load_state_dict(state.optimizer)
                drafter_side.scheduler.load_state_dict(state.scheduler)
                restore_rng(state.rng)
                step, epoch, index = state.step, state.epoch, state.index
                dropped = truncate_metrics(run_dir, step)
                print(f"resumed from {plan.resume_from} at step {step} (epoch {epoch}, batch {index}"
                      f"{f'; dropped {dropped} metrics lines past it' if dropped else ''})", file=sys.stderr, flush=True)
                recorder.set_status(step=step, last_checkpoint=str(plan.resume_from))
            # A checkpoint snapshotted before a failure still lands: the writer's exit waits for it.
            with CheckpointWriter(run_dir, cfg.keep_checkpoints) as writer:
                return _train_loop(cfg, recorder, writer, stream, target_side, drafter_side, stop, step, epoch, index,
                                   total_steps)
        except Exception as exc:  # noqa: BLE001 - reported on stderr and in status.json
            record_failure(recorder, exc, run_dir=run_dir, writer=writer, keep_checkpoints=cfg.keep_checkpoints,
                           exit_code=EXIT_FAILED)
            return EXIT_FAILED
        finally:
            recorder.close()


def save_in_background(recorder: RunRecorder, writer: CheckpointWriter, step: int, parts: dict[str, Any], *,
                       last: bool) -> None:
    """Checkpoint `step` (`parts`: what `snapshot_checkpoint` takes) and report what has landed. Training waits
    only for the snapshot (device->host copy; status phase "saving" meanwhile); the write overlaps the next
    steps. The `last` checkpoint of this process (end of run, stop request) is waited for, so the process never
    exits with a checkpoint half written."""
    recorder.set_status(phase="saving", step=step)
    writer.submit(writer.snapshot(step, **parts))
    report_checkpoints(recorder, writer.wait() if last else writer.poll())
    recorder.set_status(phase="training")


def report_checkpoints(recorder: RunRecorder, paths: list[Path]) -> None:
    """Log each checkpoint that has landed and make the newest the run's `last_checkpoint`."""
    for path in paths:
        print(f"checkpoint {path}", file=sys.stderr, flush=True)
        recorder.set_status(last_checkpoint=str(path))


def _checkpoint_parts(cfg: TrainConfig, side: DrafterSide, epoch: int, index: int) -> dict[str, Any]:
    return dict(model=side.drafter.state_dict(), optimizer=side.optimizer.state_dict(),
                scheduler=side.scheduler.state_dict(), epoch=epoch, index=index,
                extra={"config": cfg.to_dict(), "drafter_config": side.drafter.config.to_hf_dict()})


def _train_loop(cfg: TrainConfig, recorder: RunRecorder, writer: CheckpointWriter, stream: BatchStream,
                target_side: TargetSide, drafter_side: DrafterSide, stop: GracefulStop, step: int, epoch: int,
                index: int, total_steps: int) -> int:
    batches = stream.iterate(epoch, index)
    on_cuda = drafter_side.device.type == "cuda"
    if stop.requested:  # signalled while loading: nothing trained since the last checkpoint (if any)
        recorder.set_status(phase="stopped", step=step, exit_code=stop.exit_code)
        return stop.exit_code
    # The first step compiles flex_attention (and the target's kernels) on CUDA.
    recorder.set_status(phase="compiling" if on_cuda else "training", step=step)
    window: StepStats | None = None
    window_start, window_steps = time.perf_counter(), 0
    while step < total_steps:
        micro = micro_batches(batches, cfg.grad_accum)
        normalizer = sum(b.weight_sum for b in micro)  # whole optimizer step (METHOD.md 3)
        num_blocks = float(sum(b.num_blocks for b in micro))
        noise = noise_std_at(step, total_steps, cfg.noise_start, cfg.noise_end)
        stats: StepStats | None = None
        for i, batch in enumerate(micro):
            features = target_side.features(batch)
            part = drafter_side.forward_backward(features, normalizer, num_blocks, noise_std=noise,
                                                 noise_seed=(cfg.seed, step, i))
            stats = part if stats is None else stats + part
        lr, grad_norm = drafter_side.optimizer_step()
        step += 1
        epoch, index = micro[-1].epoch, micro[-1].index + 1  # the next micro-batch to read
        assert stats is not None
        window = stats if window is None else window + stats
        window_steps += 1
        if step == 1 and on_cuda:
            recorder.set_status(phase="training")
        if step % cfg.log_interval == 0 or step == total_steps or stop.requested:
            elapsed = time.perf_counter() - window_start
            # loss terms, tau_sim and accuracies over the steps since the last log line
            summary = window.summary()
            summary["loss"] /= window_steps
            record = {"step": step, "epoch": epoch, **summary, "lr": lr, "grad_norm": grad_norm,
                      "noise_std": noise, "block_tok_s": window.block_tokens / elapsed,
                      "ctx_tok_s": window.ctx_tokens / elapsed,
                      "eta_s": (total_steps - step) * elapsed / window_steps, "time": time.time()}
            if on_cuda:
                record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(drafter_side.device) / 2**30
            recorder.log(record)
            window, window_start, window_steps = None, time.perf_counter(), 0
        if step % cfg.save_interval == 0 or step == total_steps or stop.requested:
            save_in_background(recorder, writer, step, _checkpoint_parts(cfg, drafter_side, epoch, index),
                               last=step == total_steps or stop.requested)
        else:
            report_checkpoints(recorder, writer.poll())  # a lock, no I/O: also raises a failed write here
        if stop.requested:
            recorder.set_status(phase="stopped", step=step, exit_code=stop.exit_code)
            print(f"stopped at step {step}; resume with the same command", file=sys.stderr, flush=True)
            return stop.exit_code
    recorder.set_status(phase="done", step=step, exit_code=EXIT_OK)
    return EXIT_OK


__all__ = ["main", "run", "plan_run", "Plan", "build_drafter_config", "EXIT_OK", "EXIT_FAILED", "EXIT_BAD_INPUT"]
