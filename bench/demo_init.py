"""`make demo-real`'s drafter started from the target's own last layers instead of random weights, on the demo's
data (bench/results/quality.md 2026-12-07 "`make demo-real`'s drafter started from the target's last layers").

At the demo's budget (512 regenerated answers, 400 steps) the drafter is limited by sample efficiency: its held-out
tau is 1.23 against prompt lookup's 1.29. A drafter whose layers start as the target's layers after its deepest tap
starts from what the target computes there. The mapping, for a drafter of N layers whose deepest tap is layer b
(SmolLM2, N = 2: taps 1 and 27, so the target's layers 28 and 29, its last two):

- draft layer i <- the target's layer b + 1 + i: attention (q, k, v, o), MLP, both norms. The drafter's q_norm and
  k_norm (Qwen3's, which Llama has not) stay ones;
- the final norm <- the target's final norm (the head is the target's already);
- `fc` (taps -> context) <- the identity on the deepest tap's slice, zeros elsewhere, and `hidden_norm` <- the
  target's layer b + 1 input norm: the context's keys and values are then the target's layer b + 1 keys and values
  of the same positions (before q_norm/k_norm);
- `layers`: only the layers and norms copied, `fc` and `hidden_norm` left at their random init.

    .venv/bin/python bench/demo_init.py WORKDIR [--variants random,target,layers] [--steps 400] [--zero-step]

Uses the demo's cached target, regenerated data and feature cache (run `make demo-real` once first); trains each
variant with `train --init-from` (the weights only), exports it and evaluates it on the demo's 24 held-out prompts
against the target's greedy references (computed once into WORKDIR). Prints one line per variant and writes
WORKDIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from trainer import real_demo
from trainer.core.config import LM_HEAD_DTYPES, int_list
from trainer.data import real_prompts, real_target

VARIANTS = ("random", "target", "layers")


def log(message: str) -> None:
    print(f"[demo-init] {message}", file=sys.stderr, flush=True)


def initial_drafter(variant: str, config: Any, target_dir: Path, seed: int) -> Any:
    """The drafter of `config` with `variant`'s weights (random: the trainer's own init with `seed`)."""
    from trainer.data.regenerate import load_target_lm
    from trainer.model.drafter import DFlashDrafter

    torch.manual_seed(seed)
    drafter = DFlashDrafter(config)
    if variant == "random":
        return drafter
    target, _ = load_target_lm(str(target_dir), "float32")
    layers: Any = target.model.layers
    deepest = max(config.target_layer_ids)
    first = deepest + 1
    if first + len(drafter.layers) > len(layers):
        raise SystemExit(f"error: the target has {len(layers)} layers, none after tap {deepest} for every draft layer")
    with torch.no_grad():
        for i, layer in enumerate(list[Any](drafter.layers)):
            source: Any = layers[first + i]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, name).weight.copy_(getattr(source.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(source.mlp, name).weight)
            layer.input_layernorm.weight.copy_(source.input_layernorm.weight)
            layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
        drafter.norm.weight.copy_(target.model.norm.weight)
        if variant == "target":
            hidden = config.hidden_size
            slot = list(config.target_layer_ids).index(deepest)
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, slot * hidden : (slot + 1) * hidden].copy_(torch.eye(hidden))
            drafter.hidden_norm.weight.copy_(layers[first].input_layernorm.weight)
    return drafter


def main(argv: list[str] | None = None) -> int:
    from trainer import train
    from trainer.data.tokenizer_utils import end_of_turn_ids, padding_id, tokenize_prompt
    from trainer.evaluation import eval_workers
    from trainer.export.export import export_drafter, load_training_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=real_demo.FULL.train_steps)
    parser.add_argument("--zero-step", action="store_true", help="also evaluate each variant before training")
    parser.add_argument("--arch", choices=("dflash", "dflash2"), default="dflash")
    parser.add_argument("--seed", type=int, default=0, help="train's --seed: the init's and the data order's")
    parser.add_argument(
        "--taps", type=int_list, default=[], help="the target's layers to tap, e.g. 1,8,14,20,27 (default: the rule's)"
    )
    parser.add_argument(
        "--lm-head-dtype",
        choices=LM_HEAD_DTYPES,
        default=real_demo.FULL.lm_head_dtype,
        help="train's --lm-head-dtype (auto: the fp32 head the 2026-12-07 runs used)",
    )
    args = parser.parse_args(argv)
    # One thread, as `make demo-real` trains on an idle machine here (trainer.data.regenerate.choose_threads), and
    # two of these runs share the 2-core machine: two threads of one process spin against the other run.
    torch.set_num_threads(1)
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variant {bad[0]!r}; variants: {', '.join(VARIANTS)}")
    size = real_demo.size_with(
        real_demo.FULL, train_steps=args.steps, taps=tuple(args.taps), lm_head_dtype=args.lm_head_dtype
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    cache = real_target.default_cache_root()
    target_dir = real_target.ensure_target(cache, log)
    train_all, held_all = real_prompts.build()
    train_set = real_prompts.stratified(train_all, size.train_prompts)
    held_set = real_prompts.stratified(held_all, size.eval_prompts)
    train_file = real_prompts.write_jsonl(args.workdir / "prompts-train.jsonl", train_set)
    data = real_demo.dataset_dir(cache, target_dir, train_file, size)
    if not (data / "meta.json").is_file():
        raise SystemExit(f"error: no regenerated data at {data}\nhint: run `make demo-real` once first")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    mask_id = tokenizer.convert_tokens_to_ids(real_target.MASK_TOKEN)
    assert isinstance(mask_id, int)  # one token, one id
    prompts = [tokenize_prompt(tokenizer, [{"role": "user", "content": p.prompt}], None) for p in held_set]
    common: dict[str, Any] = {
        "max_new_tokens": size.eval_new_tokens,
        "stops": end_of_turn_ids(tokenizer),
        "pad_id": padding_id(tokenizer),
    }
    refs_file = args.workdir / "references.json"
    if refs_file.is_file():
        refs = json.loads(refs_file.read_text())
    else:
        log(f"the target's greedy answers to {len(prompts)} held-out prompts")
        refs = eval_workers.references(target_dir, prompts, common, "[demo-init]   ")
        refs_file.write_text(json.dumps(refs))

    results: dict[str, Any] = {}
    with eval_workers.worker_pool(2) as pool:

        def tau_of(export: Path) -> dict[str, Any]:
            job = eval_workers.EvalJob(prompts, refs)
            futures = eval_workers.submit_evaluation(pool, 2, target_dir, export, job, None, common, None)
            return eval_workers.merged(futures)["methods"]["trained"]

        for variant in variants:
            run = args.workdir / f"run-{variant}"
            config = real_demo.drafter_config(target_dir, data, run, mask_id, size, args.arch)
            init = args.workdir / f"init-{variant}"
            export_drafter(initial_drafter(variant, config, target_dir, seed=args.seed), init)
            one: dict[str, Any] = {
                "arch": args.arch,
                "seed": args.seed,
                "taps": list(config.target_layer_ids),
                "lm_head_dtype": size.lm_head_dtype,
            }
            if args.zero_step:
                one["zero_step"] = tau_of(init)
                log(f"{variant}: before training, held-out tau {one['zero_step']['tau']:.3f}")
            # `target` is the trainer's own --drafter-init target (the same weights as `initial_drafter`'s: every
            # weight it leaves alone is a norm at one); the others start from the exported init.
            start_size = real_demo.size_with(size, drafter_init="target" if variant == "target" else "random")
            flags = real_demo.train_argv(target_dir, data, run, mask_id, start_size, args.arch, cache / "real-features")
            flags += ["--seed", str(args.seed)]
            start = [] if variant == "target" else ["--init-from", str(init)]
            started = time.monotonic()
            code = train.main([*flags, *start])
            if code:
                return code
            one["train_seconds"] = round(time.monotonic() - started, 1)
            export = args.workdir / f"export-{variant}"
            export_drafter(load_training_checkpoint(run), export)
            one["trained"] = tau_of(export)
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            one["final_loss"] = lines[-1].get("loss")
            results[variant] = one
            log(
                f"{variant}: held-out tau {one['trained']['tau']:.3f} after {size.train_steps} steps "
                f"(final loss {one['final_loss']}, {one['train_seconds']:.0f} s of training)"
            )
            (args.workdir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    for variant, one in results.items():
        zero = f"{one['zero_step']['tau']:.3f} -> " if "zero_step" in one else ""
        print(f"{variant:8s} held-out tau {zero}{one['trained']['tau']:.3f}  loss {one['final_loss']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
