"""`python -m trainer prepare`: prompts (JSONL) -> token shards (trainer/data/shards.py format) for `train`.

Each valid input record becomes one sample, in input order. Records are cut into shards of `shard_size`
records; shard k always holds records [k*shard_size, (k+1)*shard_size), so a rerun after an interruption
recomputes exactly the shards whose files are missing (a shard is complete once its offsets file exists:
shards.py writes it last, atomically) and never duplicates a sample. `prepare.json`, written before the
first shard, fingerprints the job (input sha256, tokenizer template, generation settings and, when regenerating,
the target's identity); a rerun with a different fingerprint in the same directory is refused instead of mixing
two datasets. `meta.json` (written last by shards.write_index) marks the dataset complete.

Regeneration (`--regenerate`) replaces each record's answer with the target's own: the prompt is the
conversation up to (excluding) its trailing assistant turns, rendered with the generation prompt and the
chosen thinking mode; the target generates in left-padded batches (greedy at temperature 0, sampled
otherwise, seeded per shard so a resumed shard is reproducible); the generated ids up to and including the
first end-of-turn token are appended verbatim and supervised.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import shards
from trainer.data.tokenizer_utils import (
    DataInputError,
    chat_template_sha256,
    end_of_turn_ids,
    tokenize_conversation,
)

MANIFEST = "prepare.json"


@dataclass
class PrepareOptions:
    target_model: str
    input: str
    output_dir: str
    regenerate: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    enable_thinking: bool | None = None
    num_workers: int = 1
    batch_size: int = 16
    shard_size: int = 256
    seed: int = 0
    skip_bad: bool = False
    tokenizer: str | None = None  # defaults to target_model
    dtype: str = "auto"  # --regenerate: the target's dtype (auto: bf16 on CUDA, fp32 on CPU)


def load_records(path: str | Path, skip_bad: bool) -> tuple[list[list[dict]], list[int]]:
    """Parse the JSONL into message lists. Returns (records, bad line numbers); raises on the first bad line
    unless `skip_bad`. Accepted: {"messages": [{"role", "content"}, ...]} or {"prompt": str[, "response": str]}."""
    source = Path(path)
    if not source.is_file():
        raise DataInputError(f"prompt file {source} does not exist")
    records: list[list[dict]] = []
    bad: list[int] = []
    with open(source, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                records.append(_parse_record(line))
            except ValueError as exc:
                if not skip_bad:
                    raise DataInputError(
                        f"{source}:{number}: {exc}", hint="fix the line, or pass --skip-bad to skip malformed lines"
                    ) from None
                bad.append(number)
    if not records:
        raise DataInputError(f"prompt file {source} holds no valid records")
    return records, bad


def _parse_record(line: str) -> list[dict]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError("a record must be a JSON object")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for message in messages:
            if (
                not isinstance(message, dict)
                or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content"), str)
            ):
                raise ValueError("every message needs string 'role' and 'content'")
        return [dict(m) for m in messages]
    if isinstance(obj.get("prompt"), str):
        messages = [{"role": "user", "content": obj["prompt"]}]
        if isinstance(obj.get("response"), str):
            messages.append({"role": "assistant", "content": obj["response"]})
        return messages
    raise ValueError("a record needs 'messages' (list) or 'prompt' (string)")


def record_kinds(path: str | Path, bad: list[int]) -> list[str | None]:
    """Each valid record's optional "kind" label (e.g. code-explain, writing), in the order of `load_records`."""
    kinds: list[str | None] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip() and number not in bad:
                kind = json.loads(line).get("kind")
                kinds.append(kind if isinstance(kind, str) else None)
    return kinds


def composition(kinds: list[str | None], lengths: np.ndarray) -> dict[str, dict[str, int]]:
    """{kind: {"samples", "tokens"}} over the records that carry a kind ({} when none does)."""
    table: dict[str, dict[str, int]] = {}
    for kind, length in zip(kinds, lengths.tolist()):
        if kind is not None:
            row = table.setdefault(kind, {"samples": 0, "tokens": 0})
            row["samples"] += 1
            row["tokens"] += int(length)
    return dict(sorted(table.items()))


def prompt_part(messages: list[dict]) -> list[dict]:
    """The conversation the target answers when regenerating: everything before the trailing assistant turns."""
    end = len(messages)
    while end > 0 and messages[end - 1]["role"] == "assistant":
        end -= 1
    if end == 0:
        raise DataInputError("a conversation holds only assistant turns: nothing to prompt the target with")
    return messages[:end]


SAMPLE_BYTES = 1 << 20  # target_identity reads this much at each of three places of every weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weight_files(model_dir: Path) -> list[Path]:
    """A model directory's weight files, by name: what a digest of the target's identity covers."""
    return sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def target_identity(target_model: str) -> str:
    """A digest of what regenerated answers depend on of the target: its config.json and, of every weight file, its
    name, size and 1 MiB at its start (safetensors' header names every tensor), middle and end. Not the path (a
    moved model is the same model) and not the whole files (an 8B target's 16 GB would take a minute to hash): a
    fine-tune of the same shape differs in nearly every tensor, so in the sampled bytes too. A name that is no local
    directory (a hub id) is its own identity."""
    root = Path(target_model)
    if not root.is_dir():
        return target_model
    digest = hashlib.sha256()
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in weight_files(root):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            for offset in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _fingerprint(options: PrepareOptions, template_sha: str) -> dict[str, Any]:
    digest = hashlib.sha256(Path(options.input).read_bytes()).hexdigest()
    return {
        "input_sha256": digest,
        # the answers are the target's own: another target's in the same directory would mix two datasets
        **({"target": target_identity(options.target_model)} if options.regenerate else {}),
        "chat_template_sha256": template_sha,
        "enable_thinking": options.enable_thinking,
        "regenerate": options.regenerate,
        "max_new_tokens": options.max_new_tokens if options.regenerate else None,
        **({"dtype": options.dtype} if options.regenerate and options.dtype != "auto" else {}),
        "temperature": options.temperature if options.regenerate else None,
        "seed": options.seed if options.regenerate else None,
        "shard_size": options.shard_size,
        "skip_bad": options.skip_bad,
    }


def _claim_output_dir(out: Path, fingerprint: dict[str, Any]) -> None:
    """Refuse a directory holding anything but an earlier run of this same job; write prepare.json."""
    manifest = out / MANIFEST
    if out.exists() and any(out.iterdir()):
        if not manifest.exists():
            raise DataInputError(
                f"output directory {out} is not empty and holds no dataset made by prepare",
                hint="choose an empty or new --output-dir",
            )
        previous = json.loads(manifest.read_text())
        keys = set(previous) | set(fingerprint)
        if "target" not in previous:
            keys.discard("target")  # prepared before the target was part of the fingerprint: it cannot tell
        changed = sorted(k for k in keys if previous.get(k) != fingerprint.get(k))
        if changed:
            raise DataInputError(
                f"output directory {out} already holds a different dataset (differs in: {', '.join(changed)})",
                hint="choose a new --output-dir, or rerun with the original input and settings",
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    shards._atomic_write_json(manifest, fingerprint)


def shard_is_complete(out: Path, name: str, expected_samples: int) -> bool:
    """True when the shard's three files exist and agree (offsets are written last by shards.write_shard)."""
    try:
        offsets = np.load(out / f"{name}.offsets.npy", mmap_mode="r")
        tokens = np.load(out / f"{name}.tokens.npy", mmap_mode="r")
        mask = np.load(out / f"{name}.mask.npy", mmap_mode="r")
    except (FileNotFoundError, ValueError):
        return False
    return len(offsets) == expected_samples + 1 and int(offsets[-1]) == len(tokens) == len(mask)


def _tokenize_shard(
    tokenizer_path: str, records: list[list[dict]], enable_thinking: bool | None
) -> list[tuple[list[int], list[int]]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    return [tokenize_conversation(tokenizer, r, enable_thinking) for r in records]


def _write_tokenized_shard(
    out: Path, name: str, tokenizer_path: str, records: list[list[dict]], thinking: bool | None
) -> dict:
    return shards.write_shard(out, name, _tokenize_shard(tokenizer_path, records, thinking))


def _regenerate(
    options: PrepareOptions, tokenizer: Any, tokenizer_path: str, out: Path, jobs: list[tuple[str, list, int, str]]
) -> None:
    """Each job's shard (name, prompts, seed, label) regenerated and written. With --num-workers N > 1, N processes
    of their own (spawned, `regenerate.worker_threads` threads each) take whole shards: each shard's batches and
    seed are the same as in one process, so with the same threads the dataset is the same byte for byte
    (tests/trainer/test_prepare.py checks it); on the 2-core
    machine two processes of one thread each answer 1.9x as fast as one (quality.md 2026-12-07 "`make demo-real`
    in twenty minutes")."""
    from trainer.data import regenerate

    if options.num_workers <= 1 or len(jobs) <= 1:
        regenerator = regenerate.Regenerator(options.target_model, tokenizer, options)
        for name, prompts, seed, label in jobs:
            shards.write_shard(out, name, regenerator.shard_samples(prompts, seed=seed, label=label))
        return
    import multiprocessing

    workers = min(options.num_workers, len(jobs))
    start = (tokenizer_path, options, regenerate.worker_threads(workers), os.getpid())
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=regenerate.start_worker, initargs=start) as pool:
        futures = [
            (name, pool.submit(regenerate.worker_shard, prompts, seed, label)) for name, prompts, seed, label in jobs
        ]
        for name, future in futures:  # in shard order: a shard is on disk as soon as it and those before it are done
            shards.write_shard(out, name, future.result())


def prepare(options: PrepareOptions, *, log=None) -> shards.DatasetMeta:
    """Build (or finish) the dataset in `options.output_dir`; returns its metadata. Raises DataInputError."""
    from transformers import AutoTokenizer

    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    tokenizer_path = options.tokenizer or options.target_model
    if not Path(tokenizer_path).exists():
        raise DataInputError(f"target model/tokenizer path {tokenizer_path} does not exist")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    template_sha = chat_template_sha256(tokenizer)
    records, bad = load_records(options.input, options.skip_bad)
    if bad:
        say(f"skipped {len(bad)} malformed line(s): {', '.join(map(str, bad[:10]))}{' ...' if len(bad) > 10 else ''}")
    for index, record in enumerate(records):
        if options.regenerate:
            prompt_part(record)
        elif not any(m["role"] == "assistant" for m in record):
            raise DataInputError(
                f"record {index + 1} has no assistant turn to supervise",
                hint="pass --regenerate to let the target answer the prompts",
            )
    out = Path(options.output_dir)
    _claim_output_dir(out, _fingerprint(options, template_sha))
    names = [f"shard-{k:05d}" for k in range((len(records) + options.shard_size - 1) // options.shard_size)]
    chunks = [records[k * options.shard_size : (k + 1) * options.shard_size] for k in range(len(names))]
    todo = [k for k in range(len(names)) if not shard_is_complete(out, names[k], len(chunks[k]))]
    if len(todo) < len(names):
        say(f"resuming: {len(names) - len(todo)} of {len(names)} shard(s) already complete, skipped")
    if options.regenerate:
        jobs = [
            (names[k], [prompt_part(r) for r in chunks[k]], options.seed + k, f"{names[k]} ({k + 1}/{len(names)})")
            for k in todo
        ]
        _regenerate(options, tokenizer, tokenizer_path, out, jobs)
    elif options.num_workers > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=options.num_workers) as pool:
            futures = [
                pool.submit(_write_tokenized_shard, out, names[k], tokenizer_path, chunks[k], options.enable_thinking)
                for k in todo
            ]
            for future in futures:
                future.result()
    else:
        for k in todo:
            _write_tokenized_shard(out, names[k], tokenizer_path, chunks[k], options.enable_thinking)
            say(f"tokenized {names[k]} ({k + 1}/{len(names)})")
    entries, lengths = [], []
    for k, name in enumerate(names):
        offsets = np.load(out / f"{name}.offsets.npy", mmap_mode="r")
        lengths.append(np.diff(offsets))
        entries.append({"name": name, "num_samples": len(chunks[k]), "num_tokens": int(offsets[-1])})
    kinds = composition(record_kinds(options.input, bad), np.concatenate(lengths))
    meta = shards.DatasetMeta(
        tokenizer=str(Path(tokenizer_path).resolve()),
        chat_template_sha256=template_sha,
        enable_thinking=options.enable_thinking,
        regenerated=options.regenerate,
        vocab_size=len(tokenizer),
        extra={
            "input": str(Path(options.input).resolve()),
            "skipped_lines": bad,
            "end_of_turn_ids": end_of_turn_ids(tokenizer),
            **({"kinds": kinds} if kinds else {}),
            "options": {k: v for k, v in asdict(options).items() if k not in ("output_dir",)},
        },
    )
    shards.write_index(out, entries, meta)
    say(f"dataset complete: {meta.num_samples} samples, {meta.num_tokens} tokens in {out}")
    return meta


def check_dataset_matches(meta: shards.DatasetMeta, tokenizer: Any, enable_thinking: bool | None) -> None:
    """For `train`/`eval`: refuse data made with another chat template or thinking mode than serving will use
    (docs/method.md#data: such a mismatch has publicly cost half of the acceptance rate)."""
    expected = chat_template_sha256(tokenizer)
    if meta.chat_template_sha256 and meta.chat_template_sha256 != expected:
        raise DataInputError(
            f"the dataset was tokenized with chat template sha256 {meta.chat_template_sha256[:12]}..., "
            f"this tokenizer's is {expected[:12]}...",
            hint="re-run prepare with the serving tokenizer",
        )
    if enable_thinking is not None and meta.enable_thinking is not None and meta.enable_thinking != enable_thinking:
        raise DataInputError(
            f"the dataset was prepared with enable_thinking={meta.enable_thinking}, "
            f"training asks for {enable_thinking}",
            hint="re-run prepare with the serving thinking mode",
        )


def _on_off(value: str) -> bool:
    """on|off (the documented spelling), or true|false, yes|no, 1|0 as `train --enable-thinking` takes them."""
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer prepare", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target-model", required=True, help="HF model directory (its tokenizer and chat template are used)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --target-model)")
    parser.add_argument("--input", required=True, help="JSONL: {'messages': [...]} or {'prompt': ...} per line")
    parser.add_argument(
        "--output-dir", required=True, help="dataset directory (shards, meta.json); a rerun there resumes the same job"
    )
    parser.add_argument("--regenerate", action="store_true", help="let the target answer each prompt (default: off)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="--regenerate: tokens generated per answer at most (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="--regenerate: sampling temperature, 0 = greedy (default: %(default)s)",
    )
    parser.add_argument(
        "--enable-thinking",
        type=_on_off,
        default=None,
        metavar="on|off",
        help="the chat template's thinking mode (default: the template's own)",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=1,
        help="processes that tokenize, or with --regenerate answer, one shard at a time each (default: %(default)s)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=16, help="--regenerate: generation batch size (default: %(default)s)"
    )
    parser.add_argument("--shard-size", type=int, default=256, help="records per shard (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="--regenerate: the target's dtype; auto is bf16 on a GPU, fp32 on the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="--regenerate: sampling seed; shard k uses seed + k (default: %(default)s)"
    )
    parser.add_argument(
        "--skip-bad", action="store_true", help="skip malformed lines instead of stopping (default: off)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = PrepareOptions(**vars(args))
    if options.max_new_tokens < 1 or options.shard_size < 1 or options.batch_size < 1 or options.num_workers < 1:
        print("error: --max-new-tokens, --shard-size, --batch-size and --num-workers must be >= 1", file=sys.stderr)
        return 2
    try:
        prepare(options)
    except DataInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
