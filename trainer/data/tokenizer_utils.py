"""Chat-template tokenization with an assistant-only loss mask, and tiny hub-like tokenizers for tests/demo.

Two ways to get (input_ids, loss_mask) for a conversation:

- `tokenize_prompt` + generated ids (the `--regenerate` path): the prompt is rendered with
  `add_generation_prompt=True`, the target's own generated ids are appended unchanged and supervised. No
  re-tokenization, so the training tokens are exactly the ones the target produced at serving time.
- `tokenize_conversation` (the dataset's own answers): the whole conversation is rendered as text, each
  assistant message's content (and `reasoning_content`) is located in that text in order, and tokens whose
  character span overlaps one of those spans are supervised, plus the end-of-turn token right after each
  answer (the drafter must learn when the target stops). Works for any fast tokenizer and any template that
  copies message content verbatim (Qwen3, Llama, ...), without `{% generation %}` tags.

`build_tiny_tokenizer` trains a byte-level BPE on given text with the `tokenizers` library, wraps it as a
`PreTrainedTokenizerFast` with a Qwen3-like chat template (including the `enable_thinking` switch), and saves
it with `save_pretrained`, so callers load it with `AutoTokenizer.from_pretrained(dir)` like a hub tokenizer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.core.config import TrainerInputError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|mask|>"]
END_OF_TURN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"

# Qwen3's template reduced to what matters here: im_start/im_end turns, an empty think block when thinking
# is switched off (in the generation prompt and in the last assistant turn), reasoning_content rendered
# inside <think>.
QWEN3_LIKE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content is defined and message.reasoning_content -%}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- elif loop.last and enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- message.content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


class DataInputError(TrainerInputError):
    """Bad user input to prepare/eval/export: a one-line message and an optional one-line hint (exit code 2).
    A TrainerInputError, so `python -m trainer` reports it like every other input error."""


def chat_template_sha256(tokenizer: Any) -> str:
    """sha256 of the tokenizer's chat template text; raises DataInputError when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataInputError(
            "the tokenizer has no chat template",
            hint="use the target's own tokenizer (tokenizer_config.json or chat_template.jinja must define one)",
        )
    if isinstance(template, dict):  # several named templates: hash them in a stable order
        template = "\n".join(f"{k}\n{template[k]}" for k in sorted(template))
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Ids that end an assistant turn: the tokenizer's eos plus `<|im_end|>` when the vocabulary has it."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end not in ids:
        ids.append(im_end)
    return ids


def padding_id(tokenizer: Any) -> int:
    """The id a left-padded batch fills its gaps with: the tokenizer's pad token, else its first end-of-turn id.

    SmolLM2 converted from its GGUF file by transformers 5.25 names `<|im_end|>` (2) its pad token; converted by 5.17
    (the GPU machine's) it names none and its eos is `<|im_start|>` (1), so 1 there, as the regeneration padded
    before. The padding is masked out: no answer depends on the filler. (Not `pad_id`: the generation functions
    take a parameter of that name.)"""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    stops = end_of_turn_ids(tokenizer)
    if not stops:
        raise DataInputError(
            "the tokenizer names neither a pad token nor an end of turn",
            hint="use the target's own tokenizer (its tokenizer_config.json names eos_token)",
        )
    return stops[0]


def _template_kwargs(enable_thinking: bool | None) -> dict[str, Any]:
    # Passed only when set: None means "the template's own default", as serving would do without the flag.
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def tokenize_prompt(tokenizer: Any, messages: list[dict], enable_thinking: bool | None) -> list[int]:
    """Ids of `messages` rendered with the generation prompt (what the target sees before answering)."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **_template_kwargs(enable_thinking)
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer: Any, messages: list[dict], enable_thinking: bool | None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a whole conversation; mask = assistant content + its end-of-turn token."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, **_template_kwargs(enable_thinking)
    )
    spans: list[tuple[int, int]] = []
    cursor = 0
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for part in (message.get("reasoning_content") or "", message.get("content") or ""):
            if not part:
                continue
            start = text.find(part, cursor)
            if start < 0:
                raise DataInputError(
                    "the chat template does not copy assistant content verbatim; cannot build the loss mask"
                )
            spans.append((start, start + len(part)))
            cursor = start + len(part)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    stops = set(end_of_turn_ids(tokenizer))
    mask = [0] * len(ids)
    span_index = 0
    for i, (lo, hi) in enumerate(offsets):
        while span_index < len(spans) and spans[span_index][1] <= lo:
            span_index += 1
        if span_index < len(spans) and lo < spans[span_index][1] and hi > spans[span_index][0]:
            mask[i] = 1
        elif i > 0 and mask[i - 1] and ids[i] in stops:
            mask[i] = 1  # the end-of-turn token that closes an answer
    return ids, mask


def build_tiny_tokenizer(texts: Iterable[str], out_dir: str | Path, *, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE on `texts`, attach the Qwen3-like chat template, save_pretrained to `out_dir`.

    Returns the saved tokenizer reloaded through `AutoTokenizer.from_pretrained`, exactly as a hub tokenizer
    would be used. The vocabulary holds 256 byte symbols, the merges, and SPECIAL_TOKENS (`<|mask|>` is the
    drafter's MASK token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(texts), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=END_OF_TURN,
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>", MASK_TOKEN],
    )
    wrapped.chat_template = QWEN3_LIKE_CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)
