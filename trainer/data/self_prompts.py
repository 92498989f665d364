"""Prompts the target writes itself: more, and more varied, training prompts than the fixed sources make.

An instruction-tuned target given its chat template up to the start of a user turn, and nothing after it, writes
a user's message: the kind of request it was tuned on (the idea of Magpie, Xu et al. 2024, "Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing"). Sampled at temperature 1 these are varied and
need no dataset, so they add prompts where the stdlib documentation and the templates run out (7,909 training
prompts for SmolLM2; bench/results/quality.md 2026-12-06 "The real target's largest point at 3,000 steps" found
the held-out gap growing with steps: data, not steps, was the limit).

Every batch continues one opener (`OPENERS`, cycled by batch): an empty opener is plain self-prompting, the
others steer a share of the prompts toward the kinds a user asks (code, arithmetic, writing), in phrasings of
their own, none of them a held-out template's. A message is kept when:
- the target ended it (an end-of-turn id before `max_new_tokens`): a cut message is not a prompt;
- it is 16-800 characters long once stripped;
- it names no held-out module as a word (the held-out split is by source; `real_prompts.held_out_module`), so a
  self-written prompt never asks about what the held-out prompts ask about;
- its text, lower-cased with runs of white space made one, was not seen before (in this set or `seen`).

Cost: one batched sampling pass per `batch` candidates; on a GPU the batch sets throughput (the prefix is shared,
so no padding). The prompts depend on the seed, the target's weights and the torch build (sampling).
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from trainer.data.real_prompts import STDLIB_MODULES, Prompt, held_out_module
from trainer.data.tokenizer_utils import end_of_turn_ids

KIND = "self"
SOURCE = "self:target"  # never held out: the held-out prompts stay the fixed sources' (real_prompts.is_held_out)
OPENERS = (
    "",
    "",
    "",
    "",
    "Write a Python",
    "In Python,",
    "Explain",
    "How do I",
    "What is",
    "Calculate",
    "Write a short",
    "Summarize",
    "Give me",
    "Why",
    "Describe",
    "Can you",
)
_SENTINEL = "\x00USER\x00"
_HELD_OUT_WORDS = re.compile(
    r"\b(" + "|".join(re.escape(m) for m in STDLIB_MODULES if held_out_module(m)) + r")\b", re.IGNORECASE
)


def pre_query(tokenizer: Any) -> str:
    """The chat template's text before a user's content (system turn included, where the template adds one)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    return str(text)[: str(text).index(_SENTINEL)]


def normal_form(text: str) -> str:
    return " ".join(text.lower().split())


def keep(texts: Iterable[str], seen: set[str]) -> list[str]:
    """The texts that pass the module docstring's rules, in order; each kept text's normal form joins `seen`."""
    kept = []
    for text in texts:
        text = text.strip()
        key = normal_form(text)
        if not 16 <= len(text) <= 800 or _HELD_OUT_WORDS.search(text) or key in seen:
            continue
        seen.add(key)
        kept.append(text)
    return kept


@torch.inference_mode()
def sample_messages(
    model: Any, tokenizer: Any, opener: str, count: int, *, seed: int, max_new_tokens: int, temperature: float
) -> list[str]:
    """`count` user messages sampled after the pre-query text and `opener`; only those the target ended."""
    prefix = tokenizer(pre_query(tokenizer) + opener, add_special_tokens=False)["input_ids"]
    stops = end_of_turn_ids(tokenizer)
    device = next(model.parameters()).device
    input_ids = torch.tensor([prefix] * count, device=device)
    torch.manual_seed(seed)
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,  # plain sampling, as Magpie's: no nucleus or top-k cut (transformers' default top-k is 50)
        top_k=0,
        eos_token_id=stops,
        pad_token_id=stops[0],
    )
    messages = []
    for row in output[:, len(prefix) :].tolist():
        end = next((i for i, token in enumerate(row) if token in stops), None)
        if end is not None:
            messages.append(opener + tokenizer.decode(row[:end]))
    return messages


def generate(
    model: Any,
    tokenizer: Any,
    count: int,
    *,
    seed: int = 0,
    batch: int = 256,
    max_new_tokens: int = 96,
    temperature: float = 1.0,
    seen: Iterable[str] = (),
    log: Callable[[str], None] | None = None,
) -> tuple[list[Prompt], dict[str, Any]]:
    """Up to `count` self-written prompts (fewer when 8x `count` candidates do not give them) and a report
    (candidates, ended by the target, kept, seconds). `seen`: texts that must not come back (the fixed sources')."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    known = {normal_form(text) for text in seen}
    kept: list[str] = []
    candidates = ended = 0
    started = time.monotonic()
    for index in range(-(-8 * count // batch)):
        if len(kept) >= count:
            break
        messages = sample_messages(
            model,
            tokenizer,
            OPENERS[index % len(OPENERS)],
            batch,
            seed=seed * 1_000_003 + index,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
        candidates += batch
        ended += len(messages)
        kept += keep(messages, known)
        say(
            f"self-prompts: {min(len(kept), count)}/{count} kept of {candidates} sampled ({ended} ended), "
            f"{time.monotonic() - started:.0f} s"
        )
    report = {
        "candidates": candidates,
        "ended": ended,
        "kept": min(len(kept), count),
        "seconds": round(time.monotonic() - started, 1),
        "openers": list(OPENERS),
        "temperature": temperature,
    }
    return [Prompt(text, KIND, SOURCE) for text in kept[:count]], report
