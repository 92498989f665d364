"""Regeneration speed on the CPU: `model.generate` over batches (what `prepare --regenerate` does) against a greedy
loop that sorts prompts by length and drops finished rows from its KV cache, on the same real-world prompts.

    python bench/regen_speed.py --threads 1 --prompts 32 --batch 16 --new-tokens 96

Prints tokens/s of each and how many answers are identical token for token. Needs the converted SmolLM2
(trainer/data/real_target.py; `make demo-real` makes it).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer.data import real_prompts, real_target
from trainer.data.tokenizer_utils import end_of_turn_ids, tokenize_prompt


@torch.inference_mode()
def greedy_generate(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stops: list[int],
    pad_id: int,
    batch_size: int,
    on_batch: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """Greedy answers (cut after the first stop id), in prompt order, from batches with a KV cache.

    What it saves against a plain `model.generate` loop over the same batches: prompts are sorted by length so a
    batch holds little padding, and a row that has finished leaves the batch (its cache rows are dropped), so the
    rest of the batch does not pay for it; `generate` keeps computing finished rows until the longest answer ends.
    Each row sees exactly its own left-padded prompt under an attention mask, as in `generate`; whether the outputs
    are identical token for token is measured, not assumed (this file's main).
    `on_batch(done, total)` is called after each batch (progress).
    """
    from transformers import DynamicCache

    device = model.get_input_embeddings().weight.device
    # transformers 5.x renames `past_key_values` to `cache` (5.25 warns on the old name); accept either version.
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    stop_ids = torch.tensor(stops, device=device)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        live = torch.arange(len(rows), device=device)  # batch row -> index into `rows`
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kwarg: cache})
        for _ in range(max_new_tokens):
            token = out.logits[:, -1].argmax(-1)  # [live]
            for r, t in zip(live.tolist(), token.tolist()):
                answers[rows[r]].append(t)
            done = torch.isin(token, stop_ids)
            if len(answers[rows[int(live[0])]]) >= max_new_tokens or bool(done.all()):
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, token, mask, positions = live[keep], token[keep], mask[keep], positions[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_kwarg: cache},
            )
        if on_batch is not None:
            on_batch(min(start + batch_size, len(order)), len(order))
    return answers


@torch.inference_mode()
def generate_loop(model: Any, prompts: list[list[int]], new: int, stops: list[int], pad_id: int, batch: int):
    answers = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad_id)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, prompt in enumerate(chunk):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=pad_id,
        )
        for row in out[:, width:].tolist():
            answers.append(row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))])
    return answers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    target = real_target.ensure_target()
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    train, _ = real_prompts.build()
    prompts = [
        tokenize_prompt(tokenizer, [{"role": "user", "content": p.prompt}], None)
        for p in real_prompts.stratified(train, args.prompts)
    ]
    stops, pad = end_of_turn_ids(tokenizer), int(tokenizer.pad_token_id)
    started = time.monotonic()
    fast = greedy_generate(
        model, prompts, max_new_tokens=args.new_tokens, stops=stops, pad_id=pad, batch_size=args.batch
    )
    fast_s = time.monotonic() - started
    started = time.monotonic()
    plain = generate_loop(model, prompts, args.new_tokens, stops, pad, args.batch)
    plain_s = time.monotonic() - started
    tokens = sum(map(len, plain))
    print(
        f"load {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {len(prompts)} prompts, batch {args.batch}: "
        f"generate {tokens / plain_s:.1f} tok/s, sorted+drop {sum(map(len, fast)) / fast_s:.1f} tok/s, "
        f"identical answers {sum(a == b for a, b in zip(fast, plain))}/{len(plain)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
