"""`python -m trainer inspect DIR`: what a prepared dataset holds, on stdout.

Counts (samples, tokens, supervised tokens and their share), a text histogram of sample lengths, the
recorded provenance (chat template sha256, thinking mode, regenerated or not), and one decoded sample with
the supervised part bracketed as `[[...]]`, so a wrong loss mask is visible at a glance. Reads only the
memory-mapped shards (no copy); decoding needs the tokenizer recorded in meta.json (or --tokenizer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from trainer.data.shards import ShardedDataset, ShardError


def length_histogram(lengths: np.ndarray, bins: int = 8, width: int = 40) -> list[str]:
    """Lines `lo-hi  count  ####` for `bins` equal-width length ranges (bars scaled to `width` chars)."""
    lo, hi = int(lengths.min()), int(lengths.max())
    edges = np.linspace(lo, hi + 1, num=min(bins, hi - lo + 1) + 1).astype(int)
    counts, _ = np.histogram(lengths, bins=edges)
    peak = max(int(counts.max()), 1)
    return [
        f"{edges[i]:>7}-{edges[i + 1] - 1:<7} {int(c):>7}  {'#' * round(width * int(c) / peak)}"
        for i, c in enumerate(counts)
    ]


def kinds_table(kinds: dict[str, dict[str, int]], total_tokens: int) -> list[str]:
    """Lines of the prompt kinds the input recorded (samples, tokens, share), then the share of code."""
    if not kinds:
        return []
    samples = sum(k["samples"] for k in kinds.values())
    lines = ["kinds (samples, tokens, share of tokens):"]
    lines += [
        f"  {name:<16} {k['samples']:>7} {k['tokens']:>9} {100.0 * k['tokens'] / max(total_tokens, 1):5.1f}%"
        for name, k in kinds.items()
    ]
    code = sum(k["samples"] for name, k in kinds.items() if name.startswith("code"))
    lines.append(f"code share         {100.0 * code / max(samples, 1):.1f}% of samples (kinds named code-*)")
    return lines


def render_sample(tokenizer, ids: np.ndarray, mask: np.ndarray) -> str:
    """Decode `ids`, wrapping each supervised run in [[ ]]."""
    parts: list[str] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode([int(t) for t in ids[start:i]], skip_special_tokens=False)
            parts.append(f"[[{text}]]" if mask[start] else text)
            start = i
    return "".join(parts)


def summarize(directory: str | Path, *, tokenizer_path: str | None = None, sample_index: int = 0) -> str:
    dataset = ShardedDataset(directory)
    meta = dataset.meta
    supervised = sum(int(np.asarray(m, dtype=np.int64).sum()) for m in dataset._mask)
    total = int(dataset.lengths.sum())
    lines = [
        f"dataset            {Path(directory)}",
        f"samples            {len(dataset)}",
        f"tokens             {total}",
        f"supervised tokens  {supervised} ({100.0 * supervised / max(total, 1):.1f}%)",
        f"length min/mean/max {int(dataset.lengths.min())} / {dataset.lengths.mean():.1f} / {int(dataset.lengths.max())}",
        f"regenerated        {meta.regenerated}",
        f"enable_thinking    {meta.enable_thinking}",
        f"chat template      sha256 {meta.chat_template_sha256}",
        f"tokenizer          {meta.tokenizer}",
        "length histogram:",
        *length_histogram(dataset.lengths),
        *kinds_table(meta.extra.get("kinds") or {}, total),
    ]
    if not 0 <= sample_index < len(dataset):
        raise ShardError(f"sample {sample_index} out of range (dataset has {len(dataset)})")
    source = tokenizer_path or meta.tokenizer
    sample = dataset[sample_index]
    if source and Path(source).exists():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
        lines += [
            f"sample {sample_index} (supervised part in [[ ]]):",
            render_sample(tokenizer, sample.input_ids, sample.loss_mask),
        ]
    else:
        lines += [f"sample {sample_index}: tokenizer {source!r} not found; ids: {sample.input_ids[:64].tolist()}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer inspect", description="Summarize a prepared dataset.")
    parser.add_argument("directory", help="a prepared dataset directory (python -m trainer prepare)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the one in meta.json)")
    parser.add_argument("--sample", type=int, default=0, help="index of the sample to decode (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.directory, tokenizer_path=args.tokenizer, sample_index=args.sample))
    except ShardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print("hint: run `python -m trainer prepare` to build a dataset first", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
