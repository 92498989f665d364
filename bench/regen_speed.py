"""Regeneration speed: `model.generate` over batches (what `prepare --regenerate` does) against its variants, on
the same real-world prompts, each variant's answers compared with `generate`'s token for token.

    python bench/regen_speed.py --threads 1 --prompts 32 --batch 16 --new-tokens 96
    python bench/regen_speed.py --device cuda:0 --target DIR --prompts 2048 --batch 1024 --profile  (a GPU machine)

Variants (--variants): generate; sorted-drop, a greedy loop that sorts prompts by length (less padding) and drops
finished rows from its KV cache; static, `generate` with a cache allocated once for the whole answer (transformers'
dynamic cache grows by a copy of the whole cache at every step); packed-gqa, `generate` with a decode step's query
heads grouped by their key/value head (`packed_gqa_attention`) instead of the key/value heads copied to every query
head. Prints one line per variant: seconds, generated tokens a second, identical answers. --profile: the ops that
took the device's time in one batch of `generate` (torch.profiler), to say where a step goes before changing it.
Needs the converted SmolLM2 (trainer/data/real_target.py; `make demo-real` makes it) or --target.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from trainer.data import real_prompts, real_target
from trainer.data.regenerate import generate_answers, left_pad
from trainer.data.tokenizer_utils import end_of_turn_ids, padding_id, tokenize_prompt


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
        ids, mask = left_pad([prompts[i] for i in rows], pad_id)
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


def generate_loop(
    model: Any,
    prompts: list[list[int]],
    new: int,
    stops: list[int],
    pad_id: int,
    batch: int,
    on_batch: Callable[[int, int], None] | None = None,
    **generate_kwargs: Any,
) -> list[list[int]]:
    """`prepare --regenerate`'s own generation (regenerate.generate_answers) over consecutive batches."""
    answers: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        answers += generate_answers(model, chunk, max_new_tokens=new, stops=stops, pad_id=pad_id, **generate_kwargs)
        if on_batch is not None:
            on_batch(min(start + batch, len(prompts)), len(prompts))
    return answers


VARIANTS = ("generate", "sorted-drop", "static", "packed-gqa")
PACKED_GQA = "packed_gqa"  # the attention implementation's registered name
packed_calls = 0  # decode attention calls that went through the packed path (printed: the variant ran it)


def packed_gqa_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, but a decode step (one query token) of a grouped-query model reads each
    key/value head once: the query [B, H, 1, D] is viewed as [B, Hkv, H/Hkv, D], the mask [B, 1, 1, L] broadcasts
    over both, and the output goes back to transformers' [B, 1, H, D].

    Why: with a padding mask (every left-padded batch has one), transformers 5.17's sdpa path copies the keys and
    values to every query head (`repeat_kv`) in every layer at every step: for SmolLM2 (9 query heads, 3 key/value
    heads) at 1,024 rows and ~300 positions, ~85 GB written and read a step against the cache's ~14 GB, work
    that grows with the rows (quality.md 2026-12-07 "2.3x the prompts, and four draft layers from the target's
    last four": a step's cost grew with its rows). transformers 5.25 does the same grouping itself (`pack_gqa`),
    so on it this variant times the same arithmetic. Prefill and models without groups go to sdpa unchanged.
    Measured on the CPU (quality.md 2026-12-07 "Regeneration's decode step on the GPU: the key/value heads copied
    to every query head (planned)"): 1.22-1.28x `generate` under 5.17 at 64 rows, 0.97-0.98x under 5.25, the same
    answers."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1))
    shared_mask = attention_mask is None or attention_mask.shape[1] == 1
    if groups == 1 or query.shape[2] != 1 or dropout or not shared_mask:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    global packed_calls
    packed_calls += 1
    rows, heads, _, dim = query.shape
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(rows, heads // groups, groups, dim), key, value, attn_mask=attention_mask, scale=scaling
    )  # [B, Hkv, H/Hkv, D]: row g of kv head k is query head k * groups + g, as repeat_kv orders them
    return out.reshape(rows, 1, heads, dim), None


def use_packed_gqa(model: Any, on: bool) -> None:
    """Switch `model`'s attention to `packed_gqa_attention` (registered under PACKED_GQA with sdpa's masks; a second
    registration replaces the first) or back to sdpa, and start `packed_calls` again from 0."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    global packed_calls
    AttentionInterface.register(PACKED_GQA, packed_gqa_attention)
    AttentionMaskInterface.register(PACKED_GQA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(PACKED_GQA if on else "sdpa")
    packed_calls = 0


def profile_generate(model: Any, prompts: list[list[int]], new: int, stops: list[int], pad_id: int) -> str:
    """The ops that took the device's time (then the CPU's) in one batch of `generate`, as torch.profiler's table."""
    from torch.profiler import ProfilerActivity, profile

    cuda = next(model.parameters()).is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        generate_loop(model, prompts, new, stops, pad_id, len(prompts))
        if cuda:
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=18)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--target", type=Path, default=None, help="converted target (default: make setup's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variants", default="generate,sorted-drop", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true", help="profile one batch of generate first")
    args = parser.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        print(f"error: --variants: no variant {', '.join(unknown)}", file=sys.stderr)
        print(f"hint: choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # as prepare's fp32 regeneration
    target = args.target or real_target.ensure_target()
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    train, _ = real_prompts.build()
    prompts = [
        tokenize_prompt(tokenizer, [{"role": "user", "content": p.prompt}], None)
        for p in real_prompts.stratified(train, args.prompts)
    ]
    stops, pad = end_of_turn_ids(tokenizer), padding_id(tokenizer)
    widths = [max(map(len, prompts[i : i + args.batch])) for i in range(0, len(prompts), args.batch)]
    print(
        f"{args.device}, load {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {len(prompts)} prompts "
        f"(mean {sum(map(len, prompts)) / len(prompts):.0f} tokens, batches padded to {widths}), batch {args.batch}, "
        f"<= {args.new_tokens} new tokens, float32",
        flush=True,
    )
    if args.profile:
        print(profile_generate(model, prompts[: args.batch], args.new_tokens, stops, pad), flush=True)
    marks: list[float] = []  # when each batch ended: a first batch that compiles shows as the slow one

    def mark(done: int, total: int) -> None:
        marks.append(time.monotonic())

    runs: dict[str, Callable[[], list[list[int]]]] = {
        "generate": lambda: generate_loop(model, prompts, args.new_tokens, stops, pad, args.batch, mark),
        "sorted-drop": lambda: greedy_generate(
            model,
            prompts,
            max_new_tokens=args.new_tokens,
            stops=stops,
            pad_id=pad,
            batch_size=args.batch,
            on_batch=mark,
        ),
        "static": lambda: generate_loop(
            model, prompts, args.new_tokens, stops, pad, args.batch, mark, cache_implementation="static"
        ),
    }
    runs["packed-gqa"] = runs["generate"]  # the same loop: the model's attention is what use_packed_gqa switches
    reference: list[list[int]] | None = None
    for name in args.variants.split(","):
        use_packed_gqa(model, name == "packed-gqa")  # and its count of packed calls from 0
        marks[:] = [time.monotonic()]
        answers = runs[name]()  # each batch's answers come back as lists: the device has finished it
        seconds = marks[-1] - marks[0]
        batches = " ".join(f"{b - a:.1f}" for a, b in itertools.pairwise(marks))
        reference = reference or answers
        same = sum(a == b for a, b in zip(answers, reference))
        packed = f"  ({packed_calls} packed decode calls)" if name == "packed-gqa" else ""
        print(
            f"{name:12s} {seconds:8.1f} s (batches {batches} s)  {sum(map(len, answers)) / seconds:9.1f} tok/s{packed}  "
            f"identical to {args.variants.split(',')[0]}: {same}/{len(answers)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
